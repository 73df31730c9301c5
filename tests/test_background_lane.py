"""The background lane (``background_lane``): jobs in order, each run exactly once, in the lane's
thread or in a test that waits for it while the lane is busy; values and errors reach the test;
the memory budget holds a waiting test back; waits are bounded."""

from __future__ import annotations

import os
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


# Mutation testing (docs/mutation.md): the memory gate, the lane's stop, the waits' bounds and
# the figures of ``summary``, each checked without timing (a spy on ``tree_mib`` and on the
# events' waits), so that no test depends on how fast the machine is.


class _RecordingEvent(threading.Event):
    """An event that records the timeout of every ``wait``."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        return super().wait(timeout)


def _held_lane(second, second_mib: float = 10) -> tuple[Lane, threading.Event]:
    """A lane inside job "first" (10 MiB more than ``second``, so first) until the returned
    event is set; ``second`` next."""
    busy, go = threading.Event(), threading.Event()

    def first() -> str:
        busy.set()
        assert go.wait(10), "the test never released the lane"
        return "one"

    lane = Lane()
    lane.start([("second", second, second_mib), ("first", first, second_mib + 10)])
    assert busy.wait(10), "the lane's thread did not start its first job"
    return lane, go


def test_a_stopped_lane_skips_the_jobs_not_begun_and_says_so():
    ran: list[str] = []
    lane, go = _held_lane(lambda: ran.append("second"))
    lane.stop()
    go.set()
    lane._thread.join(10)
    assert not lane._thread.is_alive() and ran == []
    second = lane.jobs["second"]
    assert second.done.is_set() and second.ran_in == ""
    with pytest.raises(RuntimeError, match="background job 'second': the session ended"):
        lane.result("second", lambda: None)
    lines = lane.summary().splitlines()
    assert len(lines) == 2 and lines[0].endswith("in the lane: first")  # the largest first
    assert lines[1].endswith("in the -   : second")
    for job in lane.jobs.values():  # the figures are durations, not clock readings
        assert 0.0 <= job.seconds < 60 and 0.0 <= job.gated < 60


def test_over_the_budget_the_lane_holds_a_job_no_test_waits_for(monkeypatch):
    monkeypatch.setattr(background_lane, "BUDGET_MIB", 1500)
    checks, checked, held = [], threading.Event(), [0.0]

    def spy() -> float:
        checks.append(threading.current_thread().name)
        if checks.count("background lane") >= 2:
            checked.set()
        return held[0]

    monkeypatch.setattr(background_lane, "tree_mib", spy)
    ran = threading.Event()
    lane, go = _held_lane(ran.set, second_mib=600)
    wanted = lane.jobs["second"].wanted = _RecordingEvent()
    checks.clear()
    held[0] = 1000.0  # with the job's 600 MiB, 1600 > 1500: it does not fit
    go.set()
    assert checked.wait(10), "the lane did not check the memory again and again"
    assert not ran.is_set() and not lane.jobs["second"].started
    assert wanted.timeouts[:1] == [0.5]  # it polls the memory every half second
    assert lane.result("second", lambda: None, timeout=10) is None  # a test waits: it runs
    assert ran.is_set() and lane.jobs["second"].ran_in == "lane"


def test_a_job_that_just_fits_the_budget_starts_at_once(monkeypatch):
    # 900 MiB held and a job of 600 make exactly the budget of 1500: it fits, in both threads.
    monkeypatch.setattr(background_lane, "BUDGET_MIB", 1500)
    held = [900.0]
    monkeypatch.setattr(background_lane, "tree_mib", lambda: held[0])
    ran = threading.Event()
    lane = Lane()
    lane.start([("only", ran.set, 600)])
    assert ran.wait(10), "the lane held a job that fits the budget"
    assert lane.jobs["only"].ran_in == "lane"

    held[0] = 0.0
    lane, go = _held_lane(lambda: "two", second_mib=600)
    held[0] = 900.0
    try:
        assert lane.result("second", lambda: None, timeout=10) == "two"
        assert lane.jobs["second"].ran_in == "test"
    finally:
        go.set()


def test_a_waiting_test_leaves_a_job_over_the_budget_to_the_lane(monkeypatch):
    # 1000 MiB held and a job of 600 pass the budget of 1500: the test does not run it (the
    # job's MiB count, not only what the process holds), the lane does once free.
    monkeypatch.setattr(background_lane, "BUDGET_MIB", 1500)
    held = [0.0]
    monkeypatch.setattr(background_lane, "tree_mib", lambda: held[0])
    lane, go = _held_lane(lambda: threading.current_thread().name, second_mib=600)
    held[0] = 1000.0
    threading.Timer(0.3, go.set).start()
    assert lane.result("second", lambda: None, timeout=10) == "background lane"
    assert lane.jobs["second"].ran_in == "lane"


def test_over_the_budget_a_waited_for_job_starts_in_the_lane_at_once(monkeypatch):
    lane, go = _held_lane(lambda: "two")
    monkeypatch.setattr(background_lane, "BUDGET_MIB", -1)  # from now on nothing fits
    threading.Timer(0.2, go.set).start()
    # GATE_WAIT is 120 s: only the test's wait lets the lane start it within 10 s
    assert lane.result("second", lambda: None, timeout=10) == "two"
    assert lane.jobs["second"].ran_in == "lane"


def test_the_lane_passes_over_a_job_a_test_took_even_over_the_budget(monkeypatch):
    held = [0.0]
    monkeypatch.setattr(background_lane, "tree_mib", lambda: held[0])
    busy, go = threading.Event(), threading.Event()

    def first() -> str:
        busy.set()
        assert go.wait(10)
        return "one"

    def second() -> str:  # run by the waiting test; then nothing fits any more
        held[0] = 10.0**9
        go.set()
        return "two"

    lane = Lane()
    lane.start([("first", first, 30), ("second", second, 20), ("third", lambda: "three", 10)])
    assert busy.wait(10)
    assert lane.result("first", lambda: None, timeout=10) == "one"
    assert lane.jobs["second"].ran_in == "test"
    # the lane skips "second" (taken) without waiting for memory, and reaches "third"
    assert lane.result("third", lambda: None, timeout=10) == "three"
    assert lane.jobs["third"].ran_in == "lane"


def test_an_interrupt_in_a_job_a_test_runs_for_the_lane_reaches_the_test(monkeypatch):
    monkeypatch.setattr(background_lane, "BUDGET_MIB", 10**9)
    go = None

    def second() -> None:
        go.set()
        raise SystemExit(3)

    lane, go = _held_lane(second)
    with pytest.raises(SystemExit):
        lane.result("first", lambda: None, timeout=10)  # it ran "second" meanwhile
    assert lane.jobs["second"].ran_in == "test"


def test_a_waiting_test_polls_and_its_waits_add_up(monkeypatch):
    began, held = threading.Event(), threading.Event()

    def slow() -> bool:
        began.set()
        return held.wait(10)

    lane = Lane()
    lane.start([("slow", slow, 1)])
    assert began.wait(10)  # the lane's thread has it: the test only waits
    job = lane.jobs["slow"]
    done = job.done = _RecordingEvent()
    try:
        with pytest.raises(AssertionError, match="'slow': no result after 0 s"):
            lane.result("slow", lambda: None, timeout=0.2)
        # polls of 0.25 s while the time lasts, then a last look, which does not wait
        assert done.timeouts[:-1] and set(done.timeouts[:-1]) == {0.25}
        assert done.timeouts[-1] == 0.0
        first_wait = job.waited
        assert 0.2 <= first_wait < 60
    finally:
        held.set()
    assert lane.result("slow", lambda: None, timeout=10) is True
    assert job.waited >= first_wait  # the second wait adds to the first


def test_a_waiting_test_with_nothing_to_run_does_not_spin(monkeypatch):
    calls: list[str] = []

    def spy() -> float:
        calls.append(threading.current_thread().name)
        return 0.0

    lane, go = _held_lane(lambda: "two")
    monkeypatch.setattr(background_lane, "BUDGET_MIB", -1)  # "second" never fits in the test
    monkeypatch.setattr(background_lane, "tree_mib", spy)
    threading.Timer(0.3, go.set).start()
    assert lane.result("first", lambda: None, timeout=10) == "one"
    mine = calls.count(threading.current_thread().name)
    assert 1 <= mine < 200  # one look every 0.25 s, not a busy loop
    lane.result("second", lambda: None, timeout=10)


def test_make_room_waits_while_a_job_runs_and_the_tree_would_pass_the_budget(monkeypatch):
    monkeypatch.setattr(background_lane, "BUDGET_MIB", 1500)
    lane, go = _held_lane(lambda: "two")
    held, sleeps = [1000.0], []

    def sleep(seconds: float) -> None:  # the job's memory goes down after two looks
        sleeps.append(seconds)
        held[0] = 900.0 if len(sleeps) >= 2 else 1000.0

    monkeypatch.setattr(background_lane, "tree_mib", lambda: held[0])
    monkeypatch.setattr(background_lane.time, "sleep", sleep)
    try:
        lane.make_room(600, timeout=10)  # 1600 > 1500, then 1500: fits exactly
        assert sleeps == [0.25, 0.25]
        held[0], sleeps[:] = 10.0**9, []
        monkeypatch.setattr(background_lane, "tree_mib", lambda: None)  # unknown: no wait
        lane.make_room(600, timeout=10)
        assert sleeps == []
    finally:
        go.set()
    lane._thread.join(10)  # both jobs done
    assert lane.jobs["first"].done.is_set() and lane.jobs["second"].done.is_set()
    monkeypatch.setattr(background_lane, "tree_mib", lambda: 10.0**9)
    lane.make_room(600, timeout=10)  # no job runs: nothing to wait for
    assert sleeps == []


def test_make_room_waits_at_most_its_timeout(monkeypatch):
    lane, go = _held_lane(lambda: "two")
    monkeypatch.setattr(background_lane, "BUDGET_MIB", -1)
    try:
        lane.make_room(600, timeout=0.2)  # returns, though the job holds on
        assert not lane.jobs["first"].done.is_set()
    finally:
        go.set()
    lane.result("second", lambda: None, timeout=10)

def test_tree_mib_counts_this_process_and_nothing_for_a_process_that_is_not():
    with open("/proc/self/status") as f:  # another source than tree_mib's /proc/<pid>/statm
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
    assert 0.75 * rss <= background_lane.tree_mib() <= physical  # and its children, if any
    assert background_lane.tree_mib(2**22 + 1) == 0.0  # above Linux's largest pid


@pytest.fixture(autouse=True)
def _memory_of_nothing(monkeypatch, request):
    """Every test of this file but the one above sees a process tree of 0 MiB unless it sets its
    own: the suite's real tree (the lane's jobs, the peers' workers) must not hold their jobs."""
    if "tree_mib" not in request.node.name:
        monkeypatch.setattr(background_lane, "tree_mib", lambda root=None: 0.0)
