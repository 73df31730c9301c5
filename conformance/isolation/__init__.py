"""A checked module ("plugin") runs isolated: it can neither change the harness's arrays nor
end, hang or crash the run (``docs/checking.md``, "Isolation").

``backends.from_module`` builds a checked module's ``Backend`` on one of two views, both taking
and returning NumPy arrays, every call guarded (``guard``): copies of every array, a call that
mutates its input fails as such, a ``BaseException`` (``SystemExit``) fails the call:

* ``guard``: the guard itself, and ``local_view`` for a module given as a module object (the
  tests, the Python API): it runs in the harness's process, without a time limit;
* ``worker``: a module given by its dotted path (``--backend mypkg.attention``) runs in one
  worker process for the whole run, each call within ``--timeout`` seconds, the worker killed
  and restarted after a call that hangs and restarted after one that kills it; ``serve`` is
  that process's side.

The runner turns a ``PluginFault`` into the cell's failure (status "error" or "timeout"), a
failed bad-input check or a failed property check; the run goes on.
"""

from __future__ import annotations

import argparse
import math

from ..usage import UsageError
from .guard import Guard, LocalObject, PluginFault, Seed, local_view
from .serve import IDLE_EXIT_S
from .worker import IMPORT_LIMIT_S, RemoteObject, Worker

#: Seconds one call of a checked module may take (``--timeout``; 0: no limit).
DEFAULT_TIMEOUT_S = 60.0


def check_timeout(seconds: float) -> float | None:
    """``--timeout``'s value as the worker's limit: None for 0 or infinity (no limit); a
    negative, NaN or non-number value is a ``UsageError``."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or math.isnan(
            seconds) or seconds < 0:
        raise UsageError(f"--timeout is {seconds!r}; expected seconds >= 0 (0: no limit)")
    return None if seconds == 0 or math.isinf(seconds) else float(seconds)


def seconds_argument(text: str) -> float:
    """The ``argparse`` type of ``--timeout``: seconds ``>= 0`` (0: no limit), otherwise
    argparse's one-line error, exit code 2 (as ``usage.at_least`` for counts)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if math.isnan(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is below the minimum, 0 (0: no limit)")
    return value


__all__ = ["DEFAULT_TIMEOUT_S", "IDLE_EXIT_S", "IMPORT_LIMIT_S", "Guard", "LocalObject",
           "PluginFault", "RemoteObject", "Seed", "Worker", "check_timeout", "local_view",
           "seconds_argument"]
