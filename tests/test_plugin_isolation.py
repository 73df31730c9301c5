"""A checked module runs isolated (``conformance.running.module_worker``): adversarial modules,
written as real files and checked through ``python -m conformance``'s ``main``, cannot end, hang or
crash the run, nor change the arrays the other columns and the expected values share.

* ``sys.exit(0)`` in a call fails that cell (and the bad-input checks it meets); the worker
  survives and serves the rest of the run, in one process other than the harness's;
* ``query *= 2`` after computing the right answer: the module's cells name the mutation, the
  numpy column beside it stays ok, the property checks fail on it too;
* a call that sleeps forever is a ``timeout`` cell after ``--timeout 2``; the run goes on;
* ``os._exit(3)`` fails that cell with the exit code; a new worker runs the next cell;
* a module given as a module object runs in-process with the same guard (no time limit).

Each command runs 1-2 small cases in float32 (the worker starts in well under a second).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import textwrap
import time
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from subprocesses import timeout

import numpy_attn
from conformance import golden
from conformance.__main__ import main
from conformance.cases import catalogue as cases
from conformance.cases import expected
from conformance.running import backends, module_worker, runner
from conformance.usage import UsageError

SDPA = "scaled_dot_product_attention"
#: Property examples where Hypothesis is installed.
EXAMPLES = 3 if importlib.util.find_spec("hypothesis") else 0


_WRITTEN: list[str] = []


@pytest.fixture(autouse=True)
def _forget_plugins() -> Iterator[None]:
    """Each test's modules are forgotten afterwards, so their worker processes end now."""
    yield
    while _WRITTEN:
        backends.unregister(_WRITTEN.pop())
    gc.collect()


def _plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, body: str) -> str:
    """Write ``name.py`` holding ``body`` (after a header that logs each call's process id to
    ``name.pids``) and make it importable; returns the module name."""
    _WRITTEN.append(name)
    header = f"""
        import os, sys, time
        import numpy_attn
        PIDS = {str(tmp_path / f"{name}.pids")!r}

        def log():
            with open(PIDS, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
    """
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(header) + textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _pids(tmp_path: Path, name: str) -> list[int]:
    path = tmp_path / f"{name}.pids"
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _run(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
         ) -> tuple[int, str, dict]:
    """``main(args + --json)``: exit code, stdout and the JSON report."""
    report = tmp_path / "report.json"
    code = main([*args, "--json", str(report)])
    return code, capsys.readouterr().out, json.loads(report.read_text())


def _cells(data: dict, column: str) -> dict[str, dict]:
    return {c["case"]: c for c in data["cells"] if c["column"] == column}


ONE_CASE = ["--case", "seed_example", "--dtype", "float32"]
#: Run in this order: "self" (4-D inputs, on which the modules below misbehave), then
#: "seed_example" (2-D inputs (6, 2), on which they conform).
TWO_CASES = ["--case", "seed_example", "--case", "self", "--dtype", "float32"]


@pytest.mark.slow
def test_sys_exit_in_a_call_fails_that_cell_and_the_run_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    name = _plugin(tmp_path, monkeypatch, "exiting_attention", f"""
        def {SDPA}(query, key, value, **kw):
            log()
            if getattr(query, "ndim", 0) == 4:
                sys.exit(0)
            return numpy_attn.{SDPA}(query, key, value, **kw)
    """)
    code, out, data = _run(["--backend", name, *TWO_CASES, "--hypothesis", "0"], tmp_path,
                           capsys)
    assert code == 1, out
    reason = f"SystemExit(0) raised in {SDPA}"
    assert " ".join(out.split()).startswith(f"FAIL: {name}: {reason} (1 case)")
    cells = _cells(data, name)
    assert cells["self"]["status"] == "error"
    assert cells["self"]["detail"] == reason
    assert cells["seed_example"]["status"] == "ok"
    assert "smallest failing case" in out  # the shrinker calls it too, guarded
    # the bad-input checks on 4-D inputs meet the exit as well: those checks fail, others pass
    errors = [e for e in data["errors"] if e["backend"] == name]
    assert any(e["problem"] == reason and e["raised"] == "SystemExit" for e in errors)
    assert any(e["passed"] for e in errors)
    pids = _pids(tmp_path, name)
    assert len(pids) > 10 and len(set(pids)) == 1  # one worker for the whole run ...
    assert pids[0] != os.getpid()  # ... which is not the harness's process


@pytest.mark.slow
def test_a_module_that_mutates_its_input_is_named_and_the_numpy_column_stays_ok(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    name = _plugin(tmp_path, monkeypatch, "mutating_attention", f"""
        def {SDPA}(query, key, value, **kw):
            out = numpy_attn.{SDPA}(query, key, value, **kw)
            query *= 2  # the right answer, then the caller's query doubled
            return out
    """)
    args = ["--backend", name, "--backend", "numpy", *TWO_CASES, "--no-errors",
            "--hypothesis", str(EXAMPLES)]
    code, out, data = _run(args, tmp_path, capsys)
    assert code == 1
    reason = f"{SDPA} mutates its input `query` in place"
    assert " ".join(out.split()).startswith(f"FAIL: {name}: {reason} (2 cases)")
    assert {c["status"] for c in _cells(data, "numpy").values()} == {"ok"}
    for cell in _cells(data, name).values():
        assert cell["status"] == "error" and cell["detail"] == reason
    assert "mask polarity" not in out
    if EXAMPLES:
        props = {b["backend"]: b for b in data["properties"]["backends"]}
        assert props[name]["failure"] == reason and not props["numpy"]["failure"]


@pytest.mark.slow
def test_a_call_that_never_returns_is_a_timeout_cell(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    name = _plugin(tmp_path, monkeypatch, "hanging_attention", f"""
        def {SDPA}(query, key, value, **kw):
            log()
            while getattr(query, "ndim", 0) == 4:
                time.sleep(0.1)
            return numpy_attn.{SDPA}(query, key, value, **kw)
    """)
    start = time.perf_counter()
    code, out, data = _run(["--backend", name, *TWO_CASES, "--no-errors", "--hypothesis",
                            "0", "--timeout", "1"], tmp_path, capsys)
    took = time.perf_counter() - start
    assert code == 1 and 1 <= took < 30, (code, took)
    reason = f"{SDPA} did not return within 1 s (--timeout 1)"
    assert " ".join(out.split()).startswith(f"FAIL: {name}: {reason} (1 case)")
    cells = _cells(data, name)
    assert cells["self"]["status"] == "timeout"
    assert cells["self"]["detail"] == reason
    assert cells["seed_example"]["status"] == "ok"  # the run went on, in a new worker
    first, *rest = _pids(tmp_path, name)
    assert rest and first not in rest
    golden.export(tmp_path / "golden", ["self"], ["float32"])  # check: the same limit
    assert main(["check", str(tmp_path / "golden"), "--backend", name, "--timeout", "1"]) == 1
    assert f"{SDPA} did not return within 1 s (--timeout 1)" in capsys.readouterr().out


@pytest.mark.slow
def test_a_worker_that_dies_fails_its_cell_and_a_new_one_runs_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    name = _plugin(tmp_path, monkeypatch, "dying_attention", f"""
        def {SDPA}(query, key, value, **kw):
            log()
            if getattr(query, "ndim", 0) == 4:
                os._exit(3)
            return numpy_attn.{SDPA}(query, key, value, **kw)
    """)
    code, out, data = _run(["--backend", name, *TWO_CASES, "--no-errors", "--hypothesis",
                            "0"], tmp_path, capsys)
    assert code == 1
    reason = f"the worker process died with exit code 3 in {SDPA}"
    assert " ".join(out.split()).startswith(f"FAIL: {name}: {reason} (1 case)")
    cells = _cells(data, name)
    assert (cells["self"]["status"], cells["self"]["detail"]) == ("error", reason)
    assert cells["seed_example"]["status"] == "ok"
    first, *rest = _pids(tmp_path, name)
    assert rest and first not in rest


def test_timeout_must_not_be_negative(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--backend", "numpy", *ONE_CASE, "--timeout", "-1"])
    assert exit_.value.code == 2
    assert "argument --timeout: -1 is below the minimum, 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["check", "no_such_folder", "--backend", "numpy", "--timeout", "-0.5"])
    assert exit_.value.code == 2
    with pytest.raises(UsageError, match="--timeout is -1"):
        runner.run(["numpy"], ["seed_example"], ["float32"], timeout=-1)
    with pytest.raises(UsageError, match="--timeout is nan"):
        golden.check("no_such_folder", ["numpy"], timeout=float("nan"))


def test_an_exit_while_importing_is_an_import_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    name = _plugin(tmp_path, monkeypatch, "exit_on_import", "sys.exit(0)\n")
    assert main(["--backend", name, *ONE_CASE]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "SystemExit" in err
    assert err.strip().splitlines()[-1] == f"error: importing {name!r} failed (traceback above)"


@pytest.mark.slow
def test_an_idle_worker_ends_itself_and_the_next_call_starts_a_new_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = _plugin(tmp_path, monkeypatch, "idle_attention", f"""
        def {SDPA}(query, key, value, **kw):
            log()
            return numpy_attn.{SDPA}(query, key, value, **kw)
    """)
    monkeypatch.setattr(module_worker, "IDLE_EXIT_S", 0.3)
    worker = module_worker.Worker(name, timeout=timeout(10))
    sdpa = getattr(worker.view(), SDPA)
    q = np.arange(6.0).reshape(3, 2)
    want = numpy_attn.scaled_dot_product_attention(q, q, q)
    np.testing.assert_array_equal(sdpa(q, q, q), want)
    time.sleep(1.0)  # the worker says goodbye and ends
    np.testing.assert_array_equal(sdpa(q, q, q), want)  # resent to a new worker
    first, second = _pids(tmp_path, name)
    assert first != second and worker.generation == 2
    worker.stop()


def test_a_module_object_runs_in_process_with_the_same_guard() -> None:
    """``from_module(module_object)``: copies, mutation and SystemExit caught, in-process."""
    exp = expected.expected(cases.get("self"), "float32")
    query = exp.data.arrays["query"]
    before = query.copy()
    calls: list[int] = []

    def mutating(query, key, value, **kw):  # noqa: ANN001, ANN202
        calls.append(os.getpid())
        out = numpy_attn.scaled_dot_product_attention(query, key, value, **kw)
        query *= 2
        return out

    def exiting(query, key, value, **kw):  # noqa: ANN001, ANN202
        raise SystemExit(4)

    for fn, reason in ((mutating, f"{SDPA} mutates its input `query` in place"),
                       (exiting, f"SystemExit(4) raised in {SDPA}")):
        module = types.ModuleType(f"inprocess_{fn.__name__}")
        module.scaled_dot_product_attention = fn
        cell = runner.run_cell(backends.from_module(module), exp)
        assert cell.status == "error" and cell.reasons == [reason], cell
    assert calls and set(calls) == {os.getpid()}
    np.testing.assert_array_equal(query, before)  # the harness's array is untouched


# ---------------------------------------------------------------------- a module that keeps hanging

#: Five cases, more than ``module_worker.TIMEOUTS_IN_A_ROW``; in float32.
CASE_NAMES = ["self", "cross", "causal_top_left", "causal_bottom_right", "padding"]
FIVE_CASES = [*(a for c in CASE_NAMES for a in ("--case", c)), "--dtype", "float32"]
#: A module whose first call in each process never returns: every fresh worker hangs.
HANGS_FIRST = f"""
    FIRST = True

    def {SDPA}(query, key, value, **kw):
        global FIRST
        log()
        while FIRST:
            time.sleep(0.1)
        return numpy_attn.{SDPA}(query, key, value, **kw)
"""


def _given_up(limit: str) -> str:
    n = module_worker.TIMEOUTS_IN_A_ROW
    return (f"{n} calls in a row did not return within {limit} s (--timeout {limit}): the rest "
            f"of the run was not called")


@pytest.mark.slow
def test_a_module_that_hangs_in_every_worker_is_not_called_after_three_timeouts_in_a_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    name = _plugin(tmp_path, monkeypatch, "hangs_first_attention", HANGS_FIRST)
    n = module_worker.TIMEOUTS_IN_A_ROW
    report = tmp_path / "report.json"
    start = time.perf_counter()
    code = main(["--backend", name, *FIVE_CASES, "--hypothesis", "0", "--timeout", "1",
                 "--json", str(report)])
    took = time.perf_counter() - start
    assert code == 1 and took < timeout(n * 1 + 30), (code, took)  # not one limit per call
    captured = capsys.readouterr()
    restarts = [line for line in captured.err.splitlines() if "did not return" in line]
    assert len(restarts) == n, captured.err
    for i, line in enumerate(restarts[:-1], 1):
        assert line.startswith(f"{name}: a call did not return within 1 s ({SDPA}"), line
        assert line.endswith(f"); worker restarted ({module_worker.ordinal(i)} time)"), line
    assert restarts[-1].endswith(f"); {n} calls in a row did not return: not restarted, the "
                                 f"rest of the run is not called"), restarts[-1]
    cells = _cells(json.loads(report.read_text()), name)
    assert len(cells) == 5 and {c["status"] for c in cells.values()} == {"timeout"}
    details = sorted(c["detail"] for c in cells.values())
    hung = f"{SDPA} did not return within 1 s (--timeout 1)"
    assert details == sorted([hung] * n + [_given_up("1")] * (5 - n)), details
    assert _given_up("1") in " ".join(captured.out.split())  # the report says why
    pids = _pids(tmp_path, name)
    assert len(pids) == len(set(pids)) == n  # one call per worker, none after the rule


@pytest.mark.slow
def test_a_call_that_answers_starts_the_count_again_and_the_line_names_the_cell(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Timeouts count only in a row; the line on stderr names what ``calling`` says."""
    name = _plugin(tmp_path, monkeypatch, "hangs_on_4d_attention", f"""
        def {SDPA}(query, key, value, **kw):
            log()
            while query.ndim == 4:
                time.sleep(0.1)
            return numpy_attn.{SDPA}(query, key, value, **kw)
    """)
    monkeypatch.setattr(module_worker, "TIMEOUTS_IN_A_ROW", 2)
    limit = timeout(1.0)
    worker = module_worker.Worker(name, timeout=limit)
    sdpa = getattr(worker.view(), SDPA)
    q2, q4 = np.ones((3, 2)), np.ones((1, 1, 3, 2))
    hung = f"{SDPA} did not return within {limit:g} s (--timeout {limit:g})"
    for q, where in ((q4, "case a dtype float32"), (q2, ""), (q4, "case b dtype float16")):
        with module_worker.calling(where):
            if q.ndim == 2:
                np.testing.assert_array_equal(sdpa(q, q, q), q)
                continue
            with pytest.raises(module_worker.PluginFault) as fault:
                sdpa(q, q, q)
        assert (fault.value.status, fault.value.reason) == ("timeout", hung)
    assert not worker.given_up  # an answer came between the two timeouts
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"{name}: a call did not return within {limit:g} s ({SDPA}, case a dtype float32); "
        f"worker restarted (1st time)",
        f"{name}: a call did not return within {limit:g} s ({SDPA}, case b dtype float16); "
        f"worker restarted (2nd time)"]
    with pytest.raises(module_worker.PluginFault):
        sdpa(q4, q4, q4)  # the 2nd in a row: given up
    assert capsys.readouterr().err.endswith(
        "; 2 calls in a row did not return: not restarted, the rest of the run is not called\n")
    calls = len(_pids(tmp_path, name))
    with pytest.raises(module_worker.PluginFault) as fault:
        sdpa(q2, q2, q2)  # at once, uncalled
    assert (fault.value.status, fault.value.fatal) == ("timeout", True)
    assert fault.value.reason == (f"2 calls in a row did not return within {limit:g} s "
                                  f"(--timeout {limit:g}): the rest of the run was not called")
    assert len(_pids(tmp_path, name)) == calls and capsys.readouterr().err == ""
    worker.stop()


def test_ordinals() -> None:
    assert [module_worker.ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 112)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "112th"]


@pytest.mark.slow
def test_the_pytest_plugin_fails_fast_on_a_module_that_keeps_hanging(tmp_path: Path) -> None:
    from plugin_runs import ROOT, counts, run_suite

    (tmp_path / "always_hangs.py").write_text(textwrap.dedent(f"""
        import time

        def {SDPA}(query, key, value, **kw):
            while True:
                time.sleep(0.1)
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    n = module_worker.TIMEOUTS_IN_A_ROW
    cases = [a for c in CASE_NAMES for a in ("--attention-case", c)]
    start = time.perf_counter()
    result = run_suite("--attention-backend", "always_hangs", *cases, "--attention-dtype",
                       "float32", "--attention-no-errors", "--attention-timeout", "1",
                       "-p", "no:xdist", cwd=tmp_path, env=env)
    took = time.perf_counter() - start
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert took < timeout(n * 1 + 60), took
    assert counts(result.stdout)["failed"] >= 5, out
    assert out.count("worker restarted (") == n - 1, out
    assert f"{SDPA}, case self dtype float32); worker restarted (1st time)" in out, out
    assert _given_up("1") in out, out
