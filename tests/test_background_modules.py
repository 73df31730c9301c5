"""The suite's second pytest process (``background_modules``): what its stand-ins report.

A test that runs in the second process must report there exactly what it did there: a pass,
a skip with its reason, a failure with its text and the command that reruns it; a second
process that dies or reports nothing for a test fails that test with the reason, never a pass.
"""

from __future__ import annotations

import os
import types

import background_lane
import background_modules
import pytest

MODULE = '''
import pytest
import helper_on_the_path  # found through the caller's PYTHONPATH

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown broke too")

def test_passes():
    assert helper_on_the_path.TWO == 2

def test_fails(broken_teardown):
    assert [1, 2] == [1, 3], "the lists differ"

def test_skips():
    pytest.skip("needs something absent")

@pytest.mark.xfail(reason="a known bug")
def test_expected_failure():
    assert False
'''


def _second(tmp_path, text: str, names: list[str]) -> dict[str, dict[str, str]]:
    (tmp_path / "test_tiny.py").write_text(text)
    (tmp_path / "lib").mkdir(exist_ok=True)
    (tmp_path / "lib" / "helper_on_the_path.py").write_text("TWO = 2\n")
    second = background_modules.Second(root=tmp_path)
    second.nodeids = [f"test_tiny.py::{name}" for name in names]
    return second.run()


def test_the_second_process_reports_each_outcome_with_its_text(tmp_path, monkeypatch) -> None:
    """A pass (its module imports through the caller's ``PYTHONPATH``), a failure in the call
    and in the teardown (both texts), a skip and an expected failure (skips with reasons)."""
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "lib"))
    rows = _second(tmp_path, MODULE, ["test_passes", "test_fails", "test_skips",
                                      "test_expected_failure"])
    assert rows == {
        "test_tiny.py::test_passes": {"outcome": "passed", "text": ""},
        "test_tiny.py::test_fails": rows["test_tiny.py::test_fails"],
        "test_tiny.py::test_skips": {"outcome": "skipped",
                                     "text": "Skipped: needs something absent"},
        "test_tiny.py::test_expected_failure": {"outcome": "skipped", "text": "xfail: a known bug"}}
    failed = rows["test_tiny.py::test_fails"]
    assert failed["outcome"] == "failed" and failed["text"].startswith("[call] ")
    assert "the lists differ" in failed["text"]
    assert "\n[teardown] " in failed["text"] and "teardown broke too" in failed["text"]


def test_a_second_process_that_dies_reports_nothing_and_says_why(tmp_path) -> None:
    """Its exit status and the end of its output, as text, in the failure."""
    with pytest.raises(AssertionError, match=r"exit 3\) reported nothing"):
        _second(tmp_path, "import os\nos._exit(3)\n", ["test_x"])
    second = background_modules.Second(root=tmp_path)
    second.nodeids = ["--no-such-option"]  # pytest stops before it configures its plugins
    with pytest.raises(AssertionError, match=r"exit 4\) reported nothing") as failure:
        second.run()
    assert any(line.endswith("unrecognized arguments: --no-such-option")
               for line in str(failure.value).splitlines())  # pytest's stderr, as text


def test_a_second_process_that_hangs_is_killed_and_says_so(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(background_modules, "TIMEOUT", 2)
    hanging = "import sys, time\nprint('hanging here', flush=True)\ntime.sleep(60)\n"
    with pytest.raises(AssertionError, match=r"exit killed after 2 s\) reported nothing") as hung:
        _second(tmp_path, hanging, ["test_x"])
    assert str(hung.value).endswith("reported nothing:\n")  # pytest had printed nothing yet


def _lane_giving(outcomes: dict):
    """``LANE.result`` that checks it is asked for the second process's job, and gives
    ``outcomes``."""
    def result(name, run, **options):
        assert (name, run, options) == (background_modules.JOB, background_modules.SECOND.run, {})
        return outcomes
    return result


@pytest.mark.parametrize("row", [None, {"outcome": "failed", "text": "assert 1 == 2"}])
def test_a_stand_in_fails_when_the_test_failed_or_has_no_outcome(monkeypatch, row) -> None:
    outcomes = {} if row is None else {"tests/test_x.py::test_y": row}
    monkeypatch.setattr(background_lane.LANE, "result", _lane_giving(outcomes))
    stand_in = types.SimpleNamespace(nodeid="tests/test_x.py::test_y")
    with pytest.raises(background_modules.RemoteFailure) as failure:
        background_modules.Stand_in.runtest(stand_in)
    assert ("assert 1 == 2" if row else "no outcome") in str(failure.value)
    if row:
        assert "python -m pytest 'tests/test_x.py::test_y'" in str(failure.value)


def test_a_stand_in_skips_with_the_reason_and_passes_a_pass(monkeypatch) -> None:
    outcomes = {"a::skipped": {"outcome": "skipped", "text": "no GPU"},
                "a::passed": {"outcome": "passed", "text": ""}}
    monkeypatch.setattr(background_lane.LANE, "result", _lane_giving(outcomes))
    with pytest.raises(pytest.skip.Exception, match="no GPU"):
        background_modules.Stand_in.runtest(types.SimpleNamespace(nodeid="a::skipped"))
    assert background_modules.Stand_in.runtest(types.SimpleNamespace(nodeid="a::passed")) is None


def test_plan_puts_stand_ins_for_the_jax_modules_only_in_a_mixed_run(request, monkeypatch):
    """A run with JAX-module tests and others: the others stay in order, each JAX test gets a
    stand-in of the same node id, planned for the second process. Only JAX tests, none, or
    mutmut's run (``MUTANT_UNDER_TEST``): nothing moves."""
    monkeypatch.setattr(background_modules, "SECOND", background_modules.Second())
    monkeypatch.setattr(background_modules, "under_mutmut", lambda: False)
    jax_module = pytest.Module.from_parent(request.session,
                                           path=request.config.rootpath / "tests/test_jax_x.py")
    here = [pytest.Function.from_parent(request.node.parent, name=f"test_{n}",
                                        callobj=lambda: None) for n in "ab"]
    away = [pytest.Function.from_parent(jax_module, name="test_c", callobj=lambda: None)]
    assert [background_modules.offloadable(i) for i in here + away] == [False, False, True]
    kept, stand_ins = background_modules.plan([here[0], *away, here[1]])
    assert kept == here
    assert [s.nodeid for s in stand_ins] == ["tests/test_jax_x.py::test_c"]
    assert isinstance(stand_ins[0], background_modules.Stand_in)
    assert background_modules.SECOND.nodeids == ["tests/test_jax_x.py::test_c"]
    for alone in (here, away):
        assert background_modules.plan(alone) == (alone, [])
    monkeypatch.setattr(background_modules, "under_mutmut", lambda: True)
    assert background_modules.plan([*here, *away]) == ([*here, *away], [])


def test_under_mutmut_reads_mutmuts_variable(monkeypatch) -> None:
    assert background_modules.under_mutmut() == ("MUTANT_UNDER_TEST" in os.environ)
    monkeypatch.setenv("MUTANT_UNDER_TEST", "")
    assert background_modules.under_mutmut()
    monkeypatch.delenv("MUTANT_UNDER_TEST")
    assert not background_modules.under_mutmut()
