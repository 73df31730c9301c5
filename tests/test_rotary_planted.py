"""Each usual rotary-embedding mistake, planted in a checked module, fails its case with its
diagnosis in the verdict's headline; the same module without the mistake passes.

A planted module is numpy_attn's attention and rotary functions with the arguments of
``rotary_embedding``, ``rotary_embedding_vjp`` and ``rope_frequencies`` changed the way the
mistake changes them (the other layout, positions + 1, ``arange`` positions, a hard-coded
theta, the scaled frequencies or rotary_dim dropped, the attention factor dropped) or, for the
VJP, the forward rotation used as its gradient.
"""

from __future__ import annotations

import fnmatch
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import numpy_attn
from conformance.diagnosing import diagnose
from conformance.reporting import terminal
from conformance.running import backends, runner

Args = tuple[Any, dict[str, Any]]  # (positions, keyword arguments)


def _same(positions: Any, kw: dict[str, Any]) -> Args:
    return positions, kw


def _swap_layout(positions: Any, kw: dict[str, Any]) -> Args:
    other = "interleaved" if kw.get("layout", "half") == "half" else "half"
    return positions, {**kw, "layout": other}


def _one_based(positions: Any, kw: dict[str, Any]) -> Args:
    return np.asarray(positions) + 1, kw


def _arange(positions: Any, kw: dict[str, Any]) -> Args:
    p = np.asarray(positions)
    return np.broadcast_to(np.arange(p.shape[-1]), p.shape), kw


def _theta_10000(positions: Any, kw: dict[str, Any]) -> Args:
    return positions, {**kw, "theta": 10000.0}


def _no_inv_freq(positions: Any, kw: dict[str, Any]) -> Args:
    return positions, {k: v for k, v in kw.items() if k != "inv_freq"}


def _all_dims(positions: Any, kw: dict[str, Any]) -> Args:
    return positions, {k: v for k, v in kw.items() if k not in ("rotary_dim", "inv_freq")}


def _no_factor(positions: Any, kw: dict[str, Any]) -> Args:
    return positions, {k: v for k, v in kw.items() if k != "attention_factor"}


def _module(name: str, change: Callable[[Any, dict[str, Any]], Args], *,
            frequencies: Callable[[dict[str, Any]], dict[str, Any]] = dict,
            no_factor: bool = False, forward_vjp: bool = False) -> types.ModuleType:
    """numpy_attn's attention and rotary functions with ``change`` applied to the rotation's
    arguments and ``frequencies`` to ``rope_frequencies``' keyword arguments."""
    module = types.ModuleType(name)
    module.scaled_dot_product_attention = numpy_attn.scaled_dot_product_attention

    def rotary_embedding(x: Any, positions: Any, **kw: Any) -> Any:
        positions, kw = change(positions, kw)
        return numpy_attn.rotary_embedding(x, positions, **kw)

    def rotary_embedding_vjp(x: Any, positions: Any, grad_output: Any, **kw: Any) -> Any:
        positions, kw = change(positions, kw)
        if forward_vjp:
            return numpy_attn.rotary_embedding(grad_output, positions, **kw)
        return numpy_attn.rotary_embedding_vjp(x, positions, grad_output, **kw)

    def rope_frequencies(head_dim: int, **kw: Any) -> Any:
        inv, factor = numpy_attn.rope_frequencies(head_dim, **frequencies(kw))
        return inv, 1.0 if no_factor else factor

    module.rotary_embedding = rotary_embedding
    module.rotary_embedding_vjp = rotary_embedding_vjp
    module.rope_frequencies = rope_frequencies
    return module


def _no_scaling(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if k != "scaling"}


def _theta_kw(kw: dict[str, Any]) -> dict[str, Any]:
    return {**kw, "theta": 10000.0}


#: bug → (the module's arguments, the case that shows it, the diagnosis's name).
PLANTED: dict[str, tuple[dict[str, Any], str, str]] = {
    "layout_swapped": ({"change": _swap_layout}, "rotary_half", "rotary layout swapped"),
    "positions_off_by_one": ({"change": _one_based}, "rotary_half", "positions off by one"),
    "positions_restarted": ({"change": _arange}, "rotary_partial_decode",
                            "positions restarted at 0 for the chunk"),
    "packed_not_restarted": ({"change": _arange}, "rotary_packed_positions",
                             "positions not restarted per sequence in the packed batch"),
    "theta_wrong": ({"change": _theta_10000, "frequencies": _theta_kw},
                    "rotary_interleaved_partial", "base theta wrong"),
    "scaling_ignored": ({"change": _no_inv_freq, "frequencies": _no_scaling},
                        "rope_linear_interleaved", "scaling ignored"),
    "rotary_dim_ignored": ({"change": _all_dims}, "rotary_interleaved_partial",
                           "rotary_dim ignored"),
    "attention_factor_forgotten": ({"change": _no_factor, "no_factor": True}, "rope_longrope",
                                   "attention factor forgotten"),
    "vjp_not_transposed": ({"change": _same, "forward_vjp": True}, "rotary_half",
                           "VJP not transposed"),
}


def _run(name: str, module: types.ModuleType, case: str, dtypes: tuple[str, ...]) -> Any:
    backends.register(backends.from_module(module, name=name))
    try:
        return runner.run([name], [case], list(dtypes), check_errors=False, hypothesis=0)
    finally:
        backends.unregister(name)


def _names(cell: Any) -> list[str]:
    return [diagnose.short(r) for reasons in cell.reasons for r in diagnose.split(reasons)]


@pytest.mark.parametrize("pattern", ["rotary_*", "rope_*"])
def test_the_module_without_a_mistake_passes_every_rotary_case(pattern: str) -> None:
    result = _run("planted_none", _module("planted_none", _same), pattern, ("float32",))
    cases = {c.case for c in result.cells}
    assert {case for _, case, _ in PLANTED.values() if fnmatch.fnmatch(case, pattern)} <= cases
    assert all(c.status == "ok" for c in result.cells), [
        (c.case, c.status, c.detail) for c in result.cells if c.status != "ok"]


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_each_planted_mistake_fails_with_its_diagnosis(bug: str) -> None:
    """The float32 cell fails, every failing step names the mistake, and the headline names it
    alone."""
    kwargs, case, name = PLANTED[bug]
    result = _run(f"planted_{bug}", _module(f"planted_{bug}", **kwargs), case, ("float32",))
    (cell,) = result.cells
    assert cell.status == "FAIL", (cell.status, cell.detail)
    assert set(_names(cell)) == {name}, cell.reasons
    failed = [s for s in cell.steps if not s.passed]
    assert failed and all(name in (s.note or "") for s in failed), failed
    headline = " ".join(terminal.text(result).split("\n\n")[0].split())
    assert headline == f"FAIL: planted_{bug}: {name} (1 case)", headline


@pytest.mark.slow
def test_the_layout_swap_is_named_in_every_dtype() -> None:
    """Half precision's looser tolerance still tells the layouts apart."""
    kwargs, case, name = PLANTED["layout_swapped"]
    result = _run("planted_layout", _module("planted_layout", **kwargs), case,
                  ("float64", "float32", "float16", "bfloat16"))
    assert [c.status for c in result.cells] == ["FAIL"] * 4
    assert all(set(_names(c)) == {name} for c in result.cells)
