"""The pytest plugin's failures by diagnosis: short items, each bug explained once.

A failed cell item says two lines (its diagnosis, the rerun command) and carries a ``Failure``
in its ``user_properties``, the way it reaches xdist's controller; the terminal summary
"attention conformance: failures by diagnosis" groups the failures as the harness's report
groups its cells (``reporting.groups.groups``) and explains each group once: its count of
items, one example item, its first failure, its smallest failing case and the rerun command.
In process on hand-made failures, on ``examples.wrong_attention`` (two planted bugs) and on a
module whose results come back in float64 (a diagnosis of the steps' notes), and in a child
pytest on ``examples.wrong_attention``'s quick profile (slow).
"""

from __future__ import annotations

import re
import types
from typing import Any

import numpy as np
import pytest
from plugin_runs import counts, module_backend, run_suite

import numpy_attn
from conformance.reporting.groups import LAYOUT_REASONS
from conformance.running import backends
from conformance.suite import outcomes, summary
from conformance.suite.outcomes import Failure

MASK = "mask polarity flipped: the implementation treats True as 'masked out'"
NAN = "NaN in fully masked rows: the rows that may attend to nothing must give 0"
RERUN = "python -m conformance --case {} --dtype {} --backend m"


def _failure(case: str, dtype: str, step: str, reasons: str = MASK, *, status: str = "FAIL",
             error: str = "", layout: bool = False) -> tuple[str, Failure]:
    failure = Failure(case, dtype, step, status, reasons, error, RERUN.format(case, dtype),
                      layout)
    return f"checks.py::test_cell[{case}-{dtype}-{step}]", failure


def test_a_failure_travels_in_the_items_user_properties() -> None:
    """``properties`` and back, also as xdist hands them over (lists, not tuples); a report
    without them (a pass, a bad input) carries no failure."""
    _, failure = _failure("padding", "float32", "output", layout=True)
    pairs = failure.properties()
    assert all(name.startswith("attention_") and isinstance(v, str) for name, v in pairs)
    assert Failure.from_properties(pairs) == failure
    assert Failure.from_properties([list(p) for p in pairs]) == failure
    assert Failure.from_properties([]) is None
    assert Failure.from_properties([("attention_case", "padding"), ("other", "x")]) is None


def test_failures_group_by_bug_as_the_harness_groups_cells() -> None:
    """One group per bug, the largest first, each with all its items: a cell whose steps give
    two diagnoses joins the one more cases share; a wrong layout is one group; an error
    without a diagnosis groups by the error's type."""
    items = [
        _failure("padding", "float32", "output"),
        _failure("padding", "float32", "output_weights"),
        _failure("padding", "float64", "output"),
        _failure("kv_lengths", "float32", "output"),
        _failure("fully_masked_rows", "float32", "output", f"{NAN}; also: {MASK}"),
        _failure("fully_masked_rows", "float32", "lse", NAN),
        _failure("self", "float32", "output", LAYOUT_REASONS["bhsd"], layout=True),
        _failure("self", "float32", "lse", LAYOUT_REASONS["bhsd"], layout=True),
        _failure("gqa", "float32", "output", "", status="error", error="ValueError: shapes"),
    ]
    rows = [(c, d) for c in ("padding", "kv_lengths", "fully_masked_rows", "self", "gqa")
            for d in ("float64", "float32")]
    found = summary.by_diagnosis(items, "m", rows)
    got = {g.diagnosis: [nodeid.split("[")[1] for nodeid, _ in g.items] for g in found}
    assert got == {
        MASK: ["padding-float64-output]", "padding-float32-output]",
               "padding-float32-output_weights]", "kv_lengths-float32-output]",
               "fully_masked_rows-float32-output]", "fully_masked_rows-float32-lse]"],
        LAYOUT_REASONS["bhsd"]: ["self-float32-output]", "self-float32-lse]"],
        "ValueError": ["gqa-float32-output]"],
    }
    assert list(got)[0] == MASK  # the most cases first
    assert found[0].example()[0] == "checks.py::test_cell[padding-float32-output]"
    assert found[0].cases == ["padding", "kv_lengths", "fully_masked_rows"]
    assert found[0].dtypes == ["float64", "float32"]


def test_a_planted_bug_is_explained_once_and_its_items_are_short() -> None:
    """examples.wrong_attention on one case of each planted bug: each failed item is two lines
    (its diagnosis, the rerun command); the summary names each diagnosis once, with the count
    of its items, one example, its smallest failing case as a script that compiles, and the
    example's rerun command."""
    suite = outcomes.Suite(module_backend("examples.wrong_attention"),
                           cases=["padding", "causal_bottom_right"], dtypes=["float32"])
    items, named = [], {}
    for case, dtype, step in suite.cell_steps():
        got = suite.step_outcome(case, dtype, step)
        if got.status == outcomes.FAILED:
            head, rerun = got.message.split("\n")
            name = head.split(f"{case} · {dtype} · {step}: ")[1]
            assert rerun == f"rerun: {got.failure.rerun}"
            named[name] = named.get(name, 0) + 1
            items.append((f"checks.py::test_cell[{case}-{dtype}-{step}]", got.failure))
    assert set(named) == {"mask polarity flipped", "wrong causal alignment"}
    text = "\n".join(summary.section(suite, items, 100))
    titles = re.findall(r"^\d\. ([^:]+): (\d+) failing item\(s\)", text, re.M)
    assert dict((name, int(n)) for name, n in titles) == named
    assert text.count("smallest failing case (") == 2
    assert text.count("   rerun: python -m conformance --case ") == 2
    for script in text.split("runnable:\n")[1:]:
        code = script.split("\n   rerun: ")[0].replace("\n       ", "\n")
        compile(code.removeprefix("       "), "reproducer", "exec")


def _float64_results(query: Any, key: Any, value: Any, **options: Any) -> Any:
    """numpy_attn's attention with its results in float64, whatever the inputs' dtype."""
    out = numpy_attn.scaled_dot_product_attention(query, key, value, **options)
    if isinstance(out, tuple):
        return tuple(np.asarray(x, np.float64) for x in out)
    return np.asarray(out, np.float64)


def test_a_diagnosis_of_the_steps_notes_names_the_item_and_its_group() -> None:
    """A module whose results come back in float64: no value is wrong, the steps' notes say
    the dtype; each failed item and the summary name it as the harness's report does (wrong
    result dtype), in one group."""
    module = types.ModuleType("float64_results")
    module.scaled_dot_product_attention = _float64_results
    suite = outcomes.Suite(backends.from_module(module), cases=["self"], dtypes=["float32"])
    items = []
    for case, dtype, step in suite.cell_steps():
        got = suite.step_outcome(case, dtype, step)
        if got.status == outcomes.FAILED:
            assert got.message.startswith(f"float64_results · self · float32 · {step}: wrong "
                                          f"result dtype\n"), got.message
            items.append((f"checks.py::test_cell[self-float32-{step}]", got.failure))
    assert items
    text = "\n".join(summary.section(suite, items, 100))
    assert re.findall(r"^\d\. .*", text, re.M) == [
        f"1. wrong result dtype: {len(items)} failing item(s) in 1 case(s) (float32): self"]


@pytest.mark.slow
def test_the_summary_lists_each_diagnosis_once_with_its_count() -> None:
    """examples.wrong_attention in the default (quick) profile, in a child pytest: each failed
    item's text is its diagnosis and rerun command; the summary lists each diagnosis once,
    with as many items as name it, before pytest's short summary."""
    result = run_suite("--attention-backend", "examples.wrong_attention")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    failures, section = out.split("= FAILURES =")[1].split(summary.TITLE)
    blocks = re.split(r"\n_{3,} test_\w+\[[^\]]+\] _{3,}\n", "\n" + failures.split("\n", 1)[1])
    blocks = [b.strip("\n= ") for b in blocks if b.strip("\n= ")]
    assert len(blocks) == counts(out)["failed"]
    named: dict[str, int] = {}
    for block in blocks:
        if "· bad input" in block or block.startswith("FAIL hypothesis"):
            continue
        head, rerun = block.split("\n")
        assert rerun.startswith("rerun: python -m conformance --case ")
        name = head.split(": ", 1)[1]
        named[name] = named.get(name, 0) + 1
    titles = re.findall(r"^\d\. ([^:]+): (\d+) failing item\(s\)", section, re.M)
    assert dict((name, int(n)) for name, n in titles) == named
    assert len(titles) == len(named) == 2
    assert "short test summary info" in section
