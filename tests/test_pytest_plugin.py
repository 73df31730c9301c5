"""The pytest plugin (``conformance.suite``): the check as pytest items in a user's own CI.

Runs of ``python -m pytest --pyargs conformance.suite`` in a subprocess (each within a time
limit, ``plugin_runs``) on the examples: a correct module passes and a wrong one fails with the
harness's diagnosis and, in the summary, a reproducer, both under ``-n 2`` (pytest-xdist);
``-k`` selects exactly the items it names and ``--junitxml`` lists them; no module, or a module
that supports nothing selected, is never a pass. Each run selects one or two cases × dtypes to
stay short. The expected items and outcomes come from the harness's own run of the same module
(``runner.run_cell``, ``runner.run_errors``), computed here in process: the plugin must agree
with the report. In process, a ``Suite`` on module objects: the plugin contract (declared
unsupported, not provided, layout) and the cell computed once for all its step items. The
profiles: ``test_pytest_plugin_profiles.py``; the failures by diagnosis:
``test_pytest_plugin_failures.py``.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import types
import xml.etree.ElementTree as ET
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness_helpers import NEEDS_HYPOTHESIS, _expected
from plugin_runs import counts, module_backend, run_suite

from conformance.reporting.groups import LAYOUT_REASONS
from conformance.running import backends, errors, runner
from conformance.running.steps import steps_for
from conformance.suite import outcomes, summary
from conformance.suite.plugin import cell_scope

needs_xdist = pytest.mark.skipif(importlib.util.find_spec("xdist") is None,
                                 reason="needs pytest-xdist: pip install -r requirements-test.txt")


# ------------------------------------------------------------------------------ subprocess


@pytest.mark.slow
@needs_xdist
def test_a_correct_module_passes_under_xdist() -> None:
    """examples.sdpa_only on seed_example, every dtype, ``-n 2``: exit 0, every step, bad
    input and property check the harness checks passes, the rest is skipped, none fails."""
    result = run_suite("--attention-backend", "examples.sdpa_only", "--attention-case",
                       "seed_example", "--attention-hypothesis", "20", "-n", "2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    backend = module_backend("examples.sdpa_only")
    cells = [runner.run_cell(backend, _expected("seed_example", d)) for d in backends.DTYPES]
    steps = sum(len(steps_for(_expected("seed_example", d))) for d in backends.DTYPES)
    passed = sum(s.passed for c in cells for s in c.steps)
    bad = sum(r.passed for r in runner.run_errors([backend], []))
    assert passed == 12 and bad > 30  # output, output_weights, lse in 4 dtypes; bad inputs
    total = steps + len(errors.ERROR_CASES) + 1
    assert counts(result.stdout) == {"passed": passed + bad + 1,
                                     "skipped": total - passed - bad - 1}, result.stdout[-2000:]


@pytest.mark.slow
@needs_xdist
def test_a_wrong_module_fails_with_the_diagnosis_under_xdist() -> None:
    """examples.wrong_attention on padding in float32, ``-n 2``: exactly the steps the harness
    fails fail, each in two lines ("mask polarity flipped" and the harness's rerun command);
    the summary, printed by xdist's controller, names the diagnosis once with their count and
    the smallest failing case as a script; the other items pass."""
    result = run_suite("--attention-backend", "examples.wrong_attention", "--attention-case",
                       "padding", "--attention-dtype", "float32", "-k", "test_cell", "-n", "2",
                       "-rf")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    cell = runner.run_cell(module_backend("examples.wrong_attention"),
                           _expected("padding", "float32"))
    failing = {s.step for s in cell.steps if not s.passed}
    assert {"output", "output_weights", "masked_scores"} <= failing
    reported = set(re.findall(r"FAILED \S+::test_cell\[padding-float32-(\w+)\]", result.stdout))
    assert reported == failing, result.stdout[-3000:]
    assert counts(result.stdout) == {"failed": len(failing),  # xdist counts no deselected
                                     "passed": len(cell.steps) - len(failing)}
    out = result.stdout
    rerun = ("rerun: python -m conformance --case padding --dtype float32 --backend "
             "examples.wrong_attention")
    for step in failing:
        head = f"examples.wrong_attention · padding · float32 · {step}: mask polarity flipped"
        assert f"{head}\n{rerun}\n" in out, step
    section = out.split(summary.TITLE)[1]
    assert re.findall(r"^\d\. .*", section, re.M) == [
        f"1. mask polarity flipped: {len(failing)} failing item(s) in 1 case(s) (float32): "
        "padding"]
    assert out.count("smallest failing case (") == 1
    assert "attn.module.mask_scores(" in section or \
        "attn.module.scaled_dot_product_attention(" in section


@pytest.mark.slow
def test_k_selects_and_junitxml_lists_exactly_the_selected_items(tmp_path: Path) -> None:
    """``-k`` on the ids (case-dtype-step) and ``--junitxml``: the XML's test cases are exactly
    the selected items, named as the ids say, all passing for a correct module."""
    xml = tmp_path / "report.xml"
    result = run_suite("--attention-backend", "examples.sdpa_only", "--attention-case", "gqa",
                       "-k", "float32 and not weights and not grad", f"--junitxml={xml}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    chosen = {f"test_cell[gqa-float32-{s.name}]" for s in steps_for(_expected("gqa", "float32"))
              if "weights" not in s.name and "grad" not in s.name}
    assert len(chosen) == 6  # scores, masked_scores, output, lse, blockwise_output and _lse
    cases = {tc.get("name"): tc for tc in ET.parse(xml).getroot().iter("testcase")}
    assert set(cases) == chosen
    assert {tc.get("classname") for tc in cases.values()} == {"conformance.suite.checks"}
    outcome = {name: "skipped" if tc.find("skipped") is not None else
               "failed" if tc.find("failure") is not None else "passed"
               for name, tc in cases.items()}
    assert outcome == {n: "passed" if n.endswith(("-output]", "-lse]")) else "skipped"
                       for n in chosen}


@pytest.mark.slow
def test_no_module_or_nothing_checked_is_never_a_pass(tmp_path: Path) -> None:
    """No module named: one line, exit code 4, nothing run. A module that declares every dtype
    unsupported (and the bad inputs): every item skipped, said so, exit code 5."""
    result = run_suite("--attention-case", "seed_example", cwd=tmp_path)
    assert result.returncode == 4
    assert "ERROR: no module to check: give --attention-backend MODULE or set " \
           "ATTENTION_BACKEND=MODULE" in result.stderr
    (tmp_path / "nothing_supported.py").write_text(
        'UNSUPPORTED = {"float64", "float32", "bfloat16", "float16", "errors"}\n\n\n'
        "def scaled_dot_product_attention(query, key, value, **options):\n"
        "    raise NotImplementedError\n")
    env = {**os.environ, "ATTENTION_BACKEND": "nothing_supported"}
    result = run_suite("--attention-case", "seed_example", cwd=tmp_path, env=env)
    assert result.returncode == 5, result.stdout[-2000:]
    total = sum(len(steps_for(_expected("seed_example", d))) for d in backends.DTYPES)
    assert counts(result.stdout) == {"skipped": total + len(errors.ERROR_CASES) + 1}
    assert "nothing was checked on nothing_supported" in result.stdout


# ------------------------------------------------------------------------------ in process


def _seq_first(query: Any, key: Any, value: Any, *, scale: float | None = None,
               **options: Any) -> Any:
    """docs/checking.md's minimal module: query, key, value (..., seq, heads, head_dim)."""
    q, k, v = (np.swapaxes(np.asarray(x, np.float64), -3, -2) for x in (query, key, value))
    scores = q @ np.swapaxes(k, -1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.swapaxes(weights @ v, -3, -2).astype(np.asarray(query).dtype)


UNSUPPORTED = {"mask", "bias", "causal", "window", "dropout", "softcap", "grouped_query",
               "2d_inputs", "return_weights", "sinks", "lse", "errors"}


def _fake(name: str, **attrs: Any) -> backends.Backend:
    module = types.ModuleType(name)
    for key, value in {"scaled_dot_product_attention": _seq_first,
                       "UNSUPPORTED": UNSUPPORTED, **attrs}.items():
        setattr(module, key, value)
    return backends.from_module(module)


def test_the_contract_skips_with_the_reason_and_a_cell_runs_once(monkeypatch) -> None:  # noqa: ANN001
    """A bshd module declaring what it leaves out: its steps pass, a case with a declared
    feature, a step needing the weights, a function it lacks, the bad inputs and the property
    checks are skipped with the reason; asking for three steps of a cell runs it once."""
    calls: list[tuple[str, str]] = []
    run_cell = runner.run_cell

    def counted(backend: backends.Backend, exp: Any, **kwargs: Any) -> Any:
        calls.append((exp.case, exp.dtype))
        return run_cell(backend, exp, **kwargs)

    monkeypatch.setattr(runner, "run_cell", counted)
    suite = outcomes.Suite(_fake("bshd_doc", LAYOUT="bshd"), cases=["self", "padding"],
                           dtypes=["float32"], hypothesis=5)
    got = {step: suite.step_outcome("self", "float32", step)
           for step in ("output", "output_weights", "scores")}
    assert got["output"] == outcomes.Outcome(outcomes.PASSED)
    assert got["output_weights"] == outcomes.Outcome(outcomes.SKIPPED,
                                                     "declared unsupported: return_weights")
    assert got["scores"] == outcomes.Outcome(outcomes.SKIPPED, "not provided: attention_scores")
    assert suite.step_outcome("padding", "float32", "output") == outcomes.Outcome(
        outcomes.SKIPPED, "declared unsupported: mask")
    assert calls == [("self", "float32"), ("padding", "float32")]
    assert suite.bad_input_outcome("mask_not_bool") == outcomes.Outcome(
        outcomes.SKIPPED, "declared unsupported: errors")
    props = suite.properties_outcome()
    assert props.status == outcomes.SKIPPED and "return_weights" in props.message


def test_a_module_in_the_other_layout_is_told_the_fix() -> None:
    """The same module without ``LAYOUT = "bshd"``: its steps fail with the verdict's layout
    diagnosis (found by rerunning the cell transposed), whose fix the summary prints in full,
    with no shrunk case."""
    suite = outcomes.Suite(_fake("bshd_undeclared"), cases=["self"], dtypes=["float32"])
    got = suite.step_outcome("self", "float32", "output")
    assert got.status == outcomes.FAILED
    first = got.message.splitlines()[0]
    assert first == 'bshd_undeclared · self · float32 · output: wrong layout, set LAYOUT = "bshd"'
    assert got.failure.layout and got.failure.reasons == LAYOUT_REASONS["bhsd"]
    text = "\n".join(summary.section(suite, [("checks.py::test_cell[self-float32-output]",
                                               got.failure)], 100))
    assert "Add LAYOUT = \"bshd\" to the module" in text.replace("\n     ", " ")
    assert "first failure: output of bshd_undeclared" in text
    assert "smallest failing case" not in text


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("hypothesis") is None, reason=NEEDS_HYPOTHESIS)
def test_a_failing_step_reproduces_and_the_property_checks_fail_with_code() -> None:
    """examples.wrong_attention on causal_bottom_right: the output step names the wrong causal
    alignment and the rerun command, and its smallest failing case (what the summary prints of
    it), run as printed, shows the module's output apart from the float64 reference; the
    property checks fail with a runnable minimal example."""
    suite = outcomes.Suite(module_backend("examples.wrong_attention"),
                           cases=["causal_bottom_right"], dtypes=["float32"], hypothesis=10)
    got = suite.step_outcome("causal_bottom_right", "float32", "output")
    assert got.status == outcomes.FAILED
    assert got.message == ("examples.wrong_attention · causal_bottom_right · float32 · output: "
                           "wrong causal alignment\nrerun: python -m conformance --case "
                           "causal_bottom_right --dtype float32 --backend "
                           "examples.wrong_attention")
    lines, code = suite.example(got.failure)
    assert lines[-1].startswith("smallest failing case (output; ") and code
    printed = io.StringIO()
    with redirect_stdout(printed):
        exec(compile(code, "reproducer", "exec"), {})
    actual, want = (line.split(":", 1)[1] for line in printed.getvalue().splitlines())
    assert actual.strip() != want.strip(), printed.getvalue()
    props = suite.properties_outcome()
    assert props.status == outcomes.FAILED
    assert "FAIL hypothesis · examples.wrong_attention" in props.message
    assert "minimal reproducer (runnable)" in props.message


def test_xdist_keeps_a_cells_steps_together() -> None:
    """The scope of a step item is its case × dtype; any other item is its own scope."""
    base = "conformance/suite/checks.py::"
    assert cell_scope(base + "test_cell[gqa-float32-output]") == \
        cell_scope(base + "test_cell[gqa-float32-grad_query]") == base + "test_cell[gqa-float32"
    assert cell_scope(base + "test_cell[gqa-float16-output]") != base + "test_cell[gqa-float32"
    assert cell_scope(base + "test_bad_input[mask_not_bool]") == \
        base + "test_bad_input[mask_not_bool]"
    assert cell_scope("tests/test_x.py::test_cell[a-b]") == "tests/test_x.py::test_cell[a-b]"
