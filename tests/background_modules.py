"""The suite's JAX test modules in a second pytest process, while the suite's own process goes on.

Most of a JAX test's time is JAX tracing, lowering and compiling programs in single-threaded
Python, on one core. The background lane (``background_lane``) keeps the other core busy with
the subprocess-heavy jobs, and finishes well before the suite's process does. So when a run
collects the modules whose file name holds ``jax`` (``test_jax_*.py``,
``test_fast_backward_jax.py``, ``test_mutation_kills_jax*.py``) together with other tests,
those modules' selected tests run in a second ``python -m pytest`` started by a lane job
(``SECOND.run``: the same node ids, the same conftest, the same environment):

* in the suite's process each of those tests is a stand-in (``Stand_in``) with the same node id,
  which waits for the second process (``background_lane.LANE.result``, bounded) and reports
  that test's outcome there: passed, skipped with its reason, or failed with the second
  process's failure text and the command that reruns it alone;
* a second process that dies, hangs (``TIMEOUT``) or reports nothing for a test fails that
  test with the reason, never a pass;
* run alone (only those modules), in a pytest-xdist worker, or under mutmut (which must see
  each test run in its own process), they run in the suite's process as before.

The second process loads this module as a plugin (``-p background_modules``), which records
its outcomes (``Outcomes``) in the file ``ENV`` names; it offloads nothing itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

#: The environment variable that names the second process's outcome file.
ENV = "ATTENTION_SUITE_OUTCOMES"
#: The lane job's name, and about how much memory the second process holds (MiB; measured
#: 850 resident at its peak).
JOB = "the JAX test modules"
MIB = 1000
#: Seconds the second process may take.
TIMEOUT = 600
ROOT = Path(__file__).resolve().parent.parent


def offloadable(item: pytest.Item) -> bool:
    """Whether ``item`` belongs to a module that runs in the second process."""
    return isinstance(item, pytest.Function) and "jax" in item.path.name


class Outcomes:
    """The second process's side (a pytest plugin): every test's outcome, written to ``path``
    as JSON at the end of the session."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.rows: dict[str, dict[str, str]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        row = self.rows.setdefault(report.nodeid, {"outcome": "passed", "text": ""})
        if report.failed:
            row["outcome"] = "failed"
            row["text"] += f"[{report.when}] {report.longreprtext}\n"
        elif report.skipped and row["outcome"] == "passed":  # an expected failure: a skip
            reason = (f"xfail: {report.wasxfail}" if hasattr(report, "wasxfail")
                      else report.longrepr[2])
            row["outcome"], row["text"] = "skipped", reason

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        Path(self.path).write_text(json.dumps(self.rows))


def pytest_configure(config: pytest.Config) -> None:
    """As a plugin (``-p background_modules``, the second process): record every outcome
    in the file ``ENV`` names."""
    if os.environ.get(ENV):
        config.pluginmanager.register(Outcomes(os.environ[ENV]))


class Second:
    """The main process's side: the node ids to run (relative to ``root``), and the lane job
    that runs them."""

    def __init__(self, root: Path = ROOT) -> None:
        self.root = root
        self.nodeids: list[str] = []

    def run(self) -> dict[str, dict[str, str]]:
        """Run the planned tests in a second pytest process; their outcomes by node id.
        Raises ``AssertionError`` with the end of its output when it gives none."""
        here = str(Path(__file__).resolve().parent)
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                "-p", "background_modules", *self.nodeids]
        with tempfile.TemporaryDirectory(prefix="second-pytest-") as folder:
            outcomes = Path(folder, "outcomes.json")
            env = {**os.environ, ENV: str(outcomes), "PYTHONPATH": path}
            try:
                done = subprocess.run(args, cwd=self.root, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
                code, output = str(done.returncode), done.stdout
            except subprocess.TimeoutExpired as expired:  # its output is bytes, if any
                code = f"killed after {TIMEOUT} s"
                output = (expired.stdout or b"").decode(errors="replace")
            if not outcomes.exists():
                raise AssertionError(f"the second pytest process (exit {code}) reported "
                                     f"nothing:\n{output[-2000:]}")
            return json.loads(outcomes.read_text())


#: The suite's second process (``conftest`` plans it, the stand-ins read it).
SECOND = Second()


class RemoteFailure(Exception):
    """A test that failed in the second process (its failure text)."""


class Stand_in(pytest.Item):  # noqa: N801 - reads as what it is
    """A test of an offloaded module, in the suite's process: its outcome in the second."""

    def runtest(self) -> None:
        from background_lane import LANE

        row: Any = LANE.result(JOB, SECOND.run).get(self.nodeid)  # the lane's wait > TIMEOUT
        if row is None:
            raise RemoteFailure(f"the second pytest process gave no outcome for {self.nodeid}")
        if row["outcome"] == "skipped":
            pytest.skip(row["text"])
        if row["outcome"] == "failed":
            raise RemoteFailure(f"{row['text']}\n(in the second pytest process; rerun alone: "
                                f"python -m pytest '{self.nodeid}')")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: str | None = None) -> str:
        if isinstance(excinfo.value, RemoteFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, self.name


def under_mutmut() -> bool:
    """Whether mutmut runs this process's tests (it sets ``MUTANT_UNDER_TEST``)."""
    return "MUTANT_UNDER_TEST" in os.environ


def plan(items: list[pytest.Item]) -> tuple[list[pytest.Item], list[Stand_in]]:
    """``items`` split into those that stay and stand-ins for the offloadable ones, whose node
    ids are planned for ``SECOND``; no stand-ins when every item, or none, is offloadable, or
    under mutmut (every test must run where its mutant is active and traced)."""
    away = [item for item in items if offloadable(item)]
    if not away or len(away) == len(items) or under_mutmut():
        return items, []
    SECOND.nodeids = [item.nodeid for item in away]
    return ([item for item in items if not offloadable(item)],
            [Stand_in.from_parent(item.parent, name=item.name) for item in away])
