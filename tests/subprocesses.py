"""The tests' child processes: how long one may take, and the fresh-interpreter import check.

A child's time limit is what it needs on a quiet machine, with a wide margin, times the
machine's load per core when that is above 1 (``timeout``): under ``-n auto`` on a machine
busy with other work, a child gets the time its share of the cores needs, and a child that
hangs still ends.
"""

from __future__ import annotations

import os
import subprocess
import sys


def timeout(seconds: float) -> float:
    """``seconds`` (a quiet machine's limit) scaled by the load per core (1-minute load
    average over the cores) when it is above 1."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return seconds
    return seconds * max(1.0, load / (os.cpu_count() or 1))


def imported_with(package: str, other: str, cwd: str | os.PathLike | None = None
                  ) -> subprocess.CompletedProcess:
    """``import package`` in a fresh interpreter, which prints whether ``other`` is then in
    ``sys.modules`` (``True``/``False``)."""
    code = f"import sys, {package}; print({other!r} in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout(120))
