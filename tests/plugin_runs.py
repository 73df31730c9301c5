"""The pytest plugin's tests' runs: ``python -m pytest --pyargs conformance.suite`` in a child
process (``run_suite``), pytest's closing counts (``counts``) and a repository module as a
checked ``Backend`` in this process (``module_backend``)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

from subprocesses import timeout

from conformance.running import backends

ROOT = Path(__file__).resolve().parents[1]
SUITE = ["--pyargs", "conformance.suite", "-p", "no:cacheprovider", "-q"]


def run_suite(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess:
    """``python -m pytest --pyargs conformance.suite ARGS`` (within 180 s on a quiet machine).

    ``CI`` and ``BUILD_NUMBER`` are dropped from the environment: with either set, pytest prints
    each failure's whole message again in the short summary, so the counts below would depend
    on where the suite runs."""
    env = dict(os.environ if env is None else env)
    for name in ("CI", "BUILD_NUMBER"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "pytest", *SUITE, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout(180))


def counts(out: str) -> dict[str, int]:
    """pytest's closing line as ``{"passed": 44, "skipped": 57, …}``."""
    last = out.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|deselected"
                                                   r"|errors?|tests? collected)", last)}


def module_backend(path: str) -> backends.Backend:
    """A module of the repository as a ``Backend`` run in this process."""
    return backends.from_module(importlib.import_module(path))
