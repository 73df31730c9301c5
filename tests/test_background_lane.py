"""The background lane (``background_lane``): jobs in order, each run exactly once, in the lane's
thread or in a test that waits for it while the lane is busy; values and errors reach the test;
the memory budget holds a waiting test back; waits are bounded."""

from __future__ import annotations

import threading

import background_lane
import pytest
from background_lane import Lane


def _lane_busy_with_first_job(runs: list[str]) -> tuple[Lane, threading.Event]:
    """A lane whose thread is inside job "first" (largest ``mib``, so it runs first) until the
    returned event is set; job "second" (which records the thread that runs it) waits behind."""
    busy, go = threading.Event(), threading.Event()

    def first() -> str:
        busy.set()
        assert go.wait(10), "the test never released the lane"
        runs.append("first")
        return "one"

    def second() -> str:
        runs.append(threading.current_thread().name)
        return "two"

    lane = Lane()
    lane.start([("second", second, 10), ("first", first, 20)])
    assert busy.wait(10), "the lane's thread did not start its first job"
    return lane, go


def test_a_test_waiting_while_the_lane_is_busy_runs_the_job_itself(monkeypatch):
    monkeypatch.setattr(background_lane, "BUDGET_MIB", 10**9)  # whatever the suite holds now
    runs: list[str] = []
    lane, go = _lane_busy_with_first_job(runs)
    try:
        assert lane.result("second", lambda: "not planned") == "two"
        assert runs == [threading.current_thread().name]  # here, while "first" still holds
        assert lane.jobs["second"].ran_in == "test"
    finally:
        go.set()
    assert lane.result("first", lambda: "not planned") == "one"
    assert lane.jobs["first"].ran_in == "lane"
    lane._thread.join(10)
    assert runs == [threading.current_thread().name, "first"]  # each exactly once
    assert "in the test: second" in lane.summary() and "in the lane: first" in lane.summary()


def test_waiting_for_the_lanes_job_the_test_runs_the_next_one_meanwhile(monkeypatch):
    monkeypatch.setattr(background_lane, "BUDGET_MIB", 10**9)
    busy, go, runs = threading.Event(), threading.Event(), []

    def first() -> str:
        busy.set()
        assert go.wait(10), "the test never released the lane"
        return "one"

    def second() -> str:  # the test runs it while "first" holds the lane, then frees the lane
        runs.append(("second", threading.current_thread().name))
        go.set()
        return "two"

    def third() -> str:
        runs.append(("third", threading.current_thread().name))
        return "three"

    lane = Lane()
    lane.start([("first", first, 30), ("second", second, 20), ("third", third, 10)])
    assert busy.wait(10)
    assert lane.result("first", lambda: "not planned") == "one"
    assert runs[0] == ("second", threading.current_thread().name)
    assert lane.result("second", lambda: "x") == "two"
    assert lane.result("third", lambda: "x") == "three"
    assert sorted(name for name, _ in runs) == ["second", "third"]  # each exactly once


def test_over_the_memory_budget_the_waiting_test_leaves_the_job_to_the_lane(monkeypatch):
    runs: list[str] = []
    lane, go = _lane_busy_with_first_job(runs)
    monkeypatch.setattr(background_lane, "BUDGET_MIB", -1)  # from now on nothing fits
    releaser = threading.Timer(0.3, go.set)
    releaser.start()
    assert lane.result("second", lambda: "not planned") == "two"
    assert runs == ["first", "background lane"]  # the lane's thread, after its first job
    assert lane.jobs["second"].ran_in == "lane"
    releaser.join()


def test_a_job_the_lane_already_runs_is_waited_for_not_run_again():
    started, go, calls = threading.Event(), threading.Event(), []

    def job() -> int:
        calls.append(1)
        started.set()
        assert go.wait(10)
        return 7

    lane = Lane()
    lane.start([("only", job, 1)])
    assert started.wait(10)
    threading.Timer(0.2, go.set).start()
    assert lane.result("only", lambda: 0) == 7
    assert calls == [1]


def test_a_jobs_error_is_raised_in_the_test_and_a_late_job_names_itself():
    def broken() -> None:
        raise ValueError("the job's own error")

    lane = Lane()
    lane.start([("broken", broken, 1)])
    with pytest.raises(ValueError, match="the job's own error"):
        lane.result("broken", lambda: None)

    began, hold = threading.Event(), threading.Event()

    def slow_job() -> None:
        began.set()
        hold.wait(10)

    slow = Lane()
    slow.start([("slow", slow_job, 1)])
    assert began.wait(10)  # the lane's thread has it: the test only waits
    try:
        with pytest.raises(AssertionError, match="'slow': no result after 0 s"):
            slow.result("slow", lambda: None, timeout=0.2)
    finally:
        hold.set()


def test_an_unplanned_job_is_computed_in_the_test():
    assert Lane().result("anything", lambda: 42) == 42
