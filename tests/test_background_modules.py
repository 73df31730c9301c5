"""The suite's second pytest process (``background_modules``): what its stand-ins report.

A test that runs in the second process must report there exactly what it did there: a pass,
a skip with its reason, a failure with its text and the command that reruns it; a second
process that dies or reports nothing for a test fails that test with the reason, never a pass.
"""

from __future__ import annotations

import types

import background_lane
import background_modules
import pytest

MODULE = '''
import pytest

def test_passes():
    assert 1 + 1 == 2

def test_fails():
    assert [1, 2] == [1, 3], "the lists differ"

def test_skips():
    pytest.skip("needs something absent")
'''


def _second(tmp_path, text: str, names: list[str]) -> dict[str, dict[str, str]]:
    (tmp_path / "test_tiny.py").write_text(text)
    second = background_modules.Second(root=tmp_path)
    second.nodeids = [f"test_tiny.py::{name}" for name in names]
    return second.run()


def test_the_second_process_reports_each_outcome_with_its_text(tmp_path) -> None:
    rows = _second(tmp_path, MODULE, ["test_passes", "test_fails", "test_skips"])
    assert {n: r["outcome"] for n, r in rows.items()} == {
        "test_tiny.py::test_passes": "passed", "test_tiny.py::test_fails": "failed",
        "test_tiny.py::test_skips": "skipped"}
    assert "the lists differ" in rows["test_tiny.py::test_fails"]["text"]
    assert rows["test_tiny.py::test_skips"]["text"].endswith("needs something absent")


def test_a_second_process_that_dies_reports_nothing_and_says_why(tmp_path) -> None:
    with pytest.raises(AssertionError, match=r"exit 3\) reported nothing"):
        _second(tmp_path, "import os\nos._exit(3)\n", ["test_x"])


@pytest.mark.parametrize("row", [None, {"outcome": "failed", "text": "assert 1 == 2"}])
def test_a_stand_in_fails_when_the_test_failed_or_has_no_outcome(monkeypatch, row) -> None:
    outcomes = {} if row is None else {"tests/test_x.py::test_y": row}
    monkeypatch.setattr(background_lane.LANE, "result", lambda *a, **k: outcomes)
    stand_in = types.SimpleNamespace(nodeid="tests/test_x.py::test_y")
    with pytest.raises(background_modules.RemoteFailure) as failure:
        background_modules.Stand_in.runtest(stand_in)
    assert ("assert 1 == 2" if row else "no outcome") in str(failure.value)
    if row:
        assert "python -m pytest 'tests/test_x.py::test_y'" in str(failure.value)


def test_a_stand_in_skips_with_the_reason_and_passes_a_pass(monkeypatch) -> None:
    outcomes = {"a::skipped": {"outcome": "skipped", "text": "no GPU"},
                "a::passed": {"outcome": "passed", "text": ""}}
    monkeypatch.setattr(background_lane.LANE, "result", lambda *a, **k: outcomes)
    with pytest.raises(pytest.skip.Exception, match="no GPU"):
        background_modules.Stand_in.runtest(types.SimpleNamespace(nodeid="a::skipped"))
    assert background_modules.Stand_in.runtest(types.SimpleNamespace(nodeid="a::passed")) is None


def test_plan_puts_stand_ins_for_the_jax_modules_only_in_a_mixed_run(request, monkeypatch):
    """A run with JAX-module tests and others: the others stay in order, each JAX test gets a
    stand-in of the same node id, planned for the second process. Only JAX tests, none, or
    mutmut's run (``MUTANT_UNDER_TEST``): nothing moves."""
    monkeypatch.setattr(background_modules, "SECOND", background_modules.Second())
    monkeypatch.delenv("MUTANT_UNDER_TEST", raising=False)
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
    monkeypatch.setenv("MUTANT_UNDER_TEST", "")
    assert background_modules.plan([*here, *away]) == ([*here, *away], [])
