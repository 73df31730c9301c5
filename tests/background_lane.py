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
  collected tests in one thread, one after another, the largest first (the marker's ``mib``:
  about how much memory the job's processes hold), while the suite's process is smallest;
* the test calls ``LANE.result(name, BACKGROUND[name])``: the job's value (or its exception,
  raised again), waiting at most ``TIMEOUT`` seconds; a job that was not planned (the test runs
  alone, or in a pytest-xdist worker) is computed then, in the test, as before;
* a test that would wait does work instead: it runs its job itself when the lane is busy with
  another, or else the lane's next job not begun (each job runs exactly once, in whichever
  thread claims it first), so at the end of a run both cores work until the jobs are done;
* ``conftest`` moves the test modules that read jobs to the end of the run (their other tests
  are quick), so the suite's process works through everything else while the lane computes.

Memory: a job starts only while the suite's process and its children (the peers' workers, the
other thread's job) together with the job's ``mib`` stay within ``BUDGET_MIB``, or (in the
lane's thread) when a test already waits for it: the run's peak stays near the suite's own plus
one or two jobs that fit, instead of the sum of everything at once. Every job bounds its own
subprocesses (their timeouts), so a hung job ends; the lane's wait is bounded too, and its
message names the job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

#: Seconds a test waits for its job (the jobs of a run take about 3 minutes together on 2 cores).
TIMEOUT = 900.0
#: A job starts while this process and its children hold at most this many MiB less the job's
#: own ``mib`` (or a test waits for it, or it has waited ``GATE_WAIT`` seconds).
BUDGET_MIB = 2300
GATE_WAIT = 120.0
#: The ``mib`` of a job whose marker gives none.
DEFAULT_MIB = 700


def tree_mib(root: int | None = None) -> float | None:
    """Resident MiB of process ``root`` (default: this one) and all its descendants (Linux
    ``/proc``), or None where unknown."""
    root = os.getpid() if root is None else root
    try:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        parent = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                children.setdefault(parent, []).append(int(entry))
        total, todo = 0, [root]
        while todo:
            pid = todo.pop()
            todo += children.get(pid, [])
            try:
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1])
            except (OSError, ValueError, IndexError):
                continue
        return total * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


def imported_with(package: str, other: str, cwd: str | os.PathLike | None = None
                  ) -> subprocess.CompletedProcess:
    """A job's usual body: ``import package`` in a fresh interpreter, which prints whether
    ``other`` is then in ``sys.modules`` (``True``/``False``)."""
    code = f"import sys, {package}; print({other!r} in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


class _Job:
    def __init__(self, name: str, run: Callable[[], Any], mib: float) -> None:
        self.name, self.run, self.mib = name, run, mib
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0  # the job's own time
        self.waited = 0.0  # how long its tests waited for it
        self.gated = 0.0  # how long it waited for memory before it started
        self.wanted = threading.Event()  # a test waits for it
        self.started = False  # claimed by the lane's thread or a waiting test (``_claim``)
        self.ran_in = ""  # "lane" or "test"


class Lane:
    """Jobs run one after another in a daemon thread (``LANE``: the suite's)."""

    def __init__(self) -> None:
        self.jobs: dict[str, _Job] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self, jobs: list[tuple[str, Callable[[], Any], float]]) -> None:
        """Run ``jobs`` (name, function, MiB), the largest first, in one thread started now."""
        if self._thread is not None or not jobs:
            return
        jobs = sorted(jobs, key=lambda job: -job[2])
        self.jobs = {name: _Job(name, run, mib) for name, run, mib in jobs}
        self._thread = threading.Thread(target=self._work, name="background lane", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        for job in self.jobs.values():
            began = time.monotonic()
            while not (self._stopping.is_set() or job.wanted.is_set() or job.started
                       or time.monotonic() - began > GATE_WAIT):
                mib = tree_mib()
                if mib is None or mib + job.mib <= BUDGET_MIB:
                    break
                job.wanted.wait(0.5)
            job.gated = time.monotonic() - began
            if self._stopping.is_set():
                if self._claim(job):
                    job.error = RuntimeError(f"background job {job.name!r}: the session ended")
                    job.done.set()
            elif self._claim(job):
                self._run(job, "lane")

    def _claim(self, job: _Job) -> bool:
        """Mark ``job`` started; False when it already was (by the other thread)."""
        with self._lock:
            if job.started:
                return False
            job.started = True
            return True

    def _help(self, wanted: _Job) -> bool:
        """Run ``wanted`` here if it is not begun, or else the lane's first job not begun,
        whichever first fits in the memory budget; False when none was run."""
        for job in [wanted, *self.jobs.values()]:
            if not job.started:
                mib = tree_mib()
                if (mib is None or mib + job.mib <= BUDGET_MIB) and self._claim(job):
                    self._run(job, "test")
                    return True
        return False

    @staticmethod
    def _run(job: _Job, where: str) -> None:
        began = time.monotonic()
        try:
            job.value = job.run()
        except BaseException as error:  # noqa: BLE001 - raised again in the test
            job.error = error
        job.seconds, job.ran_in = time.monotonic() - began, where
        job.done.set()
        if where == "test" and isinstance(job.error, (KeyboardInterrupt, SystemExit)):
            raise job.error

    def result(self, name: str, run: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
        """The value of job ``name``, waiting for it at most ``timeout`` seconds; ``run()``
        computed here when the job was not planned. Raises the job's own exception, or
        ``AssertionError`` naming the job when it gives no result in time."""
        job = self.jobs.get(name)
        if job is None:
            return run()
        job.wanted.set()
        began = time.monotonic()
        # Waiting, this thread would leave a core idle (the end of a run): it runs the job
        # itself while the lane is busy with another, or else the lane's next job not begun,
        # whichever the memory budget allows, and waits only when there is none.
        while not job.done.is_set() and time.monotonic() - began < timeout:
            if not self._help(job):
                job.done.wait(0.25)
        finished = job.done.wait(max(0.0, timeout - (time.monotonic() - began)))
        job.waited += time.monotonic() - began
        if not finished:
            raise AssertionError(f"background job {name!r}: no result after {timeout:.0f} s")
        if job.error is not None:
            raise job.error
        return job.value

    def make_room(self, mib: float, timeout: float = 60.0) -> None:
        """Before the suite's process starts children of its own that hold about ``mib`` MiB
        (a browser, say): wait, at most ``timeout`` seconds, while a job runs and the process
        tree plus ``mib`` would pass ``BUDGET_MIB``."""
        began = time.monotonic()
        while time.monotonic() - began < timeout and any(
                job.started and not job.done.is_set() for job in self.jobs.values()):
            total = tree_mib()
            if total is None or total + mib <= BUDGET_MIB:
                return
            time.sleep(0.25)

    def summary(self) -> str:
        """One line per job: its time, its wait for memory, and its tests' wait for it."""
        return "\n".join(f"{job.seconds:6.1f} s (after {job.gated:5.1f} s for memory), "
                         f"its tests waited {job.waited:5.1f} s, in the {job.ran_in or '-':4}: "
                         f"{job.name}"
                         for job in self.jobs.values() if job.done.is_set())

    def stop(self) -> None:
        """Skip the jobs not begun yet (the session ends; a running job ends by its own
        subprocess timeouts)."""
        self._stopping.set()


#: The suite's lane (``conftest`` starts it, tests read it).
LANE = Lane()
