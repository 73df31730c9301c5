"""Counted nouns in the reports (``conformance.words.plural``): "1 case", "2 cases",
never "1 cases" or "1 case(s)"."""

from __future__ import annotations

import types
from typing import Any

import numpy_attn
from conformance.reporting import terminal
from conformance.running import backends, runner
from conformance.words import plural


def test_plural_says_one_in_the_singular():
    assert plural(1, "case") == "1 case"
    assert plural(2, "case") == "2 cases"
    assert plural(0, "case") == "0 cases"
    assert plural(1, "more group") == "1 more group"
    assert plural(1, "entry", "entries") == "1 entry"
    assert plural(3, "entry", "entries") == "3 entries"


def _no_scale(query: Any, key: Any, value: Any, **kwargs: Any) -> Any:
    """numpy_attn with the scale forgotten."""
    kwargs["scale"] = 1.0
    return numpy_attn.scaled_dot_product_attention(query, key, value, **kwargs)


def test_a_report_with_one_failing_case_says_1_case():
    name = "planted_one_case"
    module = types.ModuleType(name)
    module.scaled_dot_product_attention = _no_scale
    backends.register(backends.from_module(module, name=name))
    try:
        result = runner.run([name], ["self"], ["float32"], check_errors=False, hypothesis=0)
    finally:
        backends.unregister(name)
    text = terminal.text(result)
    first = text.splitlines()[0]
    assert first.startswith(f"FAIL: {name}: ") and first.endswith(" (1 case)"), first
    assert f"1. every input · {name}: 1 case fails (every dtype): self" in " ".join(text.split())
    assert "(s)" not in text, text
