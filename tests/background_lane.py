"""The suite's background lane: its subprocess-heavy work, one job at a time, on the core the
suite's own process leaves idle.

The suite's process runs its tests one after another on one core. A few tests spend most of
their time waiting for subprocesses of their own: the documentation's snippets (one fresh
interpreter with every framework), context parallelism's JAX mesh and torch gloo ranks, the
ring's memory analyses, the grid's JAX column (``background_column``). Waiting, that process
leaves both cores to them; afterwards, the other core idles again. So those parts are *jobs*:

* a test module names its jobs in a dict ``BACKGROUND`` (name → a function with no arguments
  that returns what the test checks), and each test that reads one is marked
  ``@pytest.mark.background("name")``;
* after collection (``conftest.pytest_collection_modifyitems``) the lane runs the jobs of the
  collected tests in one thread, one after another, in the order of the first test that needs
  each, so that a job is usually done when its test comes;
* the test calls ``LANE.result(name, BACKGROUND[name])``: the job's value (or its exception,
  raised again), waiting at most ``TIMEOUT`` seconds; a job that was not planned (the test runs
  alone, or in a pytest-xdist worker) is computed then, in the test, as before.

One job at a time keeps the run's memory at the suite's process plus the largest job, instead
of several jobs' worth at once. Every job bounds its own subprocesses (their timeouts), so a
hung job ends; the lane's wait is bounded too, and its message names the job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

#: Seconds a test waits for its job (the jobs of a run take about 3 minutes together on 2 cores).
TIMEOUT = 900.0


class _Job:
    def __init__(self, name: str, run: Callable[[], Any]) -> None:
        self.name, self.run = name, run
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0  # the job's own time
        self.waited = 0.0  # how long its tests waited for it


class Lane:
    """Jobs run one after another in a daemon thread (``LANE``: the suite's)."""

    def __init__(self) -> None:
        self.jobs: dict[str, _Job] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, jobs: list[tuple[str, Callable[[], Any]]]) -> None:
        """Run ``jobs`` (name, function) in this order, in one thread started now."""
        if self._thread is not None or not jobs:
            return
        self.jobs = {name: _Job(name, run) for name, run in jobs}
        self._thread = threading.Thread(target=self._work, name="background lane", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        for job in self.jobs.values():
            if not self._stopping.is_set():
                began = time.monotonic()
                try:
                    job.value = job.run()
                except BaseException as error:  # noqa: BLE001 - raised again in the test
                    job.error = error
                job.seconds = time.monotonic() - began
            else:
                job.error = RuntimeError(f"background job {job.name!r}: the session ended")
            job.done.set()

    def result(self, name: str, run: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
        """The value of job ``name``, waiting for it at most ``timeout`` seconds; ``run()``
        computed here when the job was not planned. Raises the job's own exception, or
        ``AssertionError`` naming the job when it gives no result in time."""
        job = self.jobs.get(name)
        if job is None:
            return run()
        began = time.monotonic()
        finished = job.done.wait(timeout)
        job.waited += time.monotonic() - began
        if not finished:
            raise AssertionError(f"background job {name!r}: no result after {timeout:.0f} s")
        if job.error is not None:
            raise job.error
        return job.value

    def summary(self) -> str:
        """One line per job: its time and how long its tests waited for it."""
        return "\n".join(f"{job.seconds:6.1f} s, waited {job.waited:5.1f} s: {job.name}"
                         for job in self.jobs.values() if job.done.is_set())

    def stop(self) -> None:
        """Skip the jobs not begun yet (the session ends; a running job ends by its own
        subprocess timeouts)."""
        self._stopping.set()


#: The suite's lane (``conftest`` starts it, tests read it).
LANE = Lane()
