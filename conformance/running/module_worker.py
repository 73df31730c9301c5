"""A checked module given by its dotted path runs in a worker process (``Worker``).

A checked module ("plugin") runs isolated: it can neither change the harness's arrays nor end,
hang or crash the run (``docs/checking.md``, "Isolation"). Every call is guarded (``guard``);
a module given as a module object (the tests, the Python API) runs in the harness's process
(``guard.local_view``), one given by its dotted path (``--backend mypkg.attention``) here: in
one worker process (``workers.start``) for the whole run, each call within ``--timeout``
seconds (``DEFAULT_TIMEOUT_S``, ``check_timeout``, ``seconds_argument``).

* **one worker per module for the whole run**: started lazily, kept between calls, restarted
  only after it was killed or died; it ends itself after ``IDLE_EXIT_S`` without a call (saying
  so first, so a call sent at that moment is resent to a new worker) and when the harness
  exits or is gone (a watching thread);
* **time limit per call**: the harness waits ``Worker.timeout`` seconds for each answer
  (``--timeout``; None: no limit); then it kills the worker and the call is a ``PluginFault``
  with status "timeout" ("scaled_dot_product_attention did not return within 2 s"). A worker
  that dies (``os._exit``, a segfault) is a ``PluginFault`` naming its exit code. Both are
  ``fatal``: the next call starts a new worker. Each timeout says so on stderr, with what
  was being checked (``calling``): "mypkg.attention: a call did not return within 60 s
  (scaled_dot_product_attention, case gqa dtype float32); worker restarted (2nd time)";
* **a module that keeps hanging**: after ``TIMEOUTS_IN_A_ROW`` timeouts in a row it is not
  called again for the rest of the run: every later call is at once a ``PluginFault`` with
  status "timeout" and the rule as its reason ("3 calls in a row did not return within 60 s
  (--timeout 60): the rest of the run was not called"), so a module that hangs in every fresh
  worker ends the run in bounded time (about ``TIMEOUTS_IN_A_ROW`` × ``--timeout``);
* **importing**: the worker (``module_serve.serve``) imports the module by its path, with
  the harness's ``sys.path``; its first message is the module's contract, or its import
  error: a missing module or a broken contract is the same one-line ``UsageError`` as
  in-process, a failing import a ``PluginImportError`` with the worker's traceback; the
  import may take ``max(timeout, IMPORT_LIMIT_S)`` seconds;
* **objects**: functions and classes are called by name (``RemoteObject``); an object a call
  returns (a module instance, a KV cache) stays in the worker, which sends a ``Handle`` (its
  number, type name and methods), and the harness holds a ``RemoteObject`` whose methods are
  calls too; the worker forgets it when the harness drops the handle;
* **exceptions** the module raises come back with their class name, module, nearest built-in
  base class (``NotImplementedError`` stays one) and message (``exception_parts``); the
  harness never unpickles a class of the module, so it never imports the module itself.
  Warnings are ignored in the worker, as the harness runs every call of a backend.
* the worker's side of all this is ``module_serve``; this file is the harness's.

The runner turns a ``PluginFault`` into the cell's failure (status "error" or "timeout"), a
failed bad-input check or a failed property check; the run goes on.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import contextvars
import math
import pickle
import signal
import subprocess
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from ..usage import UsageError
from . import plugins, workers
from .guard import PluginFault
from .module_serve import Handle

#: Seconds one call of a checked module may take (``--timeout``; 0: no limit).
DEFAULT_TIMEOUT_S = 60.0
#: After this many calls in a row that did not return within ``--timeout``, a module is not
#: called again for the rest of the run: its remaining cells and checks are "timeout" at once,
#: their detail naming this rule (``Worker.call``; docs/checking.md, "Isolation"). A module
#: that hangs in every fresh worker then costs about this many time limits, not one per cell.
#: ``--timeout 0`` (no limit) never times out, so never stops calling.
TIMEOUTS_IN_A_ROW = 3


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


#: Importing the module may take at least this long, whatever the per-call limit.
IMPORT_LIMIT_S = 120.0
#: A worker with no call for this many seconds ends itself (the next call starts a new one).
IDLE_EXIT_S = 60.0
_ENTRY = "conformance.running.module_serve:serve"
#: What the harness checks while it calls, and where a timeout's line goes (``calling``).
_CALLING: contextvars.ContextVar[tuple[str, Callable[[str], None] | None]] = (
    contextvars.ContextVar("calling", default=("", None)))


@contextlib.contextmanager
def calling(where: str, say: Callable[[str], None] | None = None) -> Iterator[None]:
    """Within this block (in this thread), a call that times out names ``where`` ("case gqa
    dtype float32") in the line it writes, and ``say`` writes that line (default: stderr;
    the pytest plugin's is its terminal, which pytest's capture does not hide)."""
    token = _CALLING.set((where, say))
    try:
        yield
    finally:
        _CALLING.reset(token)


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``, ``22nd``."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


# ---------------------------------------------------------------------------- the harness side


_REBUILT: dict[tuple[str, str, type], type] = {}


def _rebuilt(name: str, module: str, base_name: str, text: str) -> Exception:
    """An exception of the worker, rebuilt: same class name and message, its built-in base."""
    base = getattr(builtins, base_name, Exception)
    if not (isinstance(base, type) and issubclass(base, Exception)):
        base = Exception
    cls = _REBUILT.get((name, module, base))
    if cls is None:
        def init(self: BaseException, message: str) -> None:
            BaseException.__init__(self, message)

        def text_of(self: BaseException) -> str:
            return str(self.args[0])

        try:
            cls = type(name, (base,), {"__module__": module, "__init__": init,
                                       "__str__": text_of})
        except TypeError:  # a base that cannot be subclassed
            cls = type(name, (Exception,), {"__module__": module, "__str__": text_of})
        _REBUILT[(name, module, base)] = cls
    return cls(text)


class _Bye(Exception):
    """The worker ended itself (idle) before reading the request: resend to a new one."""


class Worker:
    """The worker process of one checked module, seen from the harness (module docstring)."""

    def __init__(self, path: str, timeout: float | None = None) -> None:
        self.path = path
        self.timeout = timeout  # seconds per call; None: no limit
        self.contract: plugins.Contract | None = None
        self.entries: dict[str, tuple[str, ...]] = {}
        self.generation = 0  # how many workers were started
        self.pid: int | None = None
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._stopper: weakref.finalize | None = None
        self._lock = threading.Lock()
        self._held: weakref.WeakValueDictionary[int, RemoteObject] = (
            weakref.WeakValueDictionary())
        self._dropped: list[int] = []
        self.timeouts = 0  # calls that did not return in time, this run
        self.timeouts_in_a_row = 0  # ... since the last call that answered
        #: Why the module is not called any more (``TIMEOUTS_IN_A_ROW``); "" while it is.
        self.given_up = ""

    # -- the process ----------------------------------------------------------------------

    def _start(self) -> None:
        process, conn = workers.start(_ENTRY, self.path, str(IDLE_EXIT_S))
        stopper = weakref.finalize(self, workers.stop, process, conn)
        limit = None if self.timeout is None else max(self.timeout, IMPORT_LIMIT_S)
        try:
            if not conn.poll(limit):
                raise UsageError(f"importing {self.path!r} did not finish within {limit:g} s")
            reply = workers.receive(conn)
        except (EOFError, OSError):
            stopper()
            raise UsageError(f"importing {self.path!r} ended its worker process (exit code "
                             f"{process.returncode})") from None
        except BaseException:
            stopper()
            raise
        if reply[0] != "ready":
            stopper()
            if reply[0] == "import":
                raise plugins.PluginImportError(self.path, reply[1])
            raise UsageError(reply[1])
        self.contract = self.contract or reply[1]
        self.entries = self.entries or reply[2]
        self._process, self._conn, self._stopper = process, conn, stopper
        self.generation += 1
        self.pid = process.pid
        self._held = weakref.WeakValueDictionary()
        self._dropped = []

    def stop(self) -> None:
        """End the worker process now (the next call starts a new one)."""
        if self._stopper is not None:
            self._stopper()
        self._process = self._conn = self._stopper = None

    def start(self) -> None:
        """Start the worker unless it runs (the first start may raise ``UsageError``)."""
        if self._process is None or self._process.poll() is not None:
            self.stop()
            self._start()

    def _exit_code(self) -> str:
        process = self._process
        try:
            if process is not None:
                process.wait(2)
        except subprocess.TimeoutExpired:
            pass
        self.stop()
        code = process.returncode if process is not None else None
        if code is not None and code < 0:
            try:
                return f"{code} ({signal.Signals(-code).name})"
            except ValueError:
                pass
        return str(code)

    # -- one call -------------------------------------------------------------------------

    def _outgoing(self, x: Any) -> Any:
        if isinstance(x, RemoteObject):
            if isinstance(x.handle, str):
                return x.handle
            if x.generation != self.generation:
                raise PluginFault(f"{x.label} was made by a worker process that has ended "
                                  f"since")
            return x.handle
        if type(x) in (tuple, list):
            return type(x)(self._outgoing(v) for v in x)
        if type(x) is dict:
            return {k: self._outgoing(v) for k, v in x.items()}
        return x

    def _incoming(self, x: Any) -> Any:
        if isinstance(x, Handle):
            held = self._held.get(x.number)
            if x.number in self._dropped:  # dropped, but not yet forgotten by the worker
                self._dropped.remove(x.number)
            if held is None:
                held = RemoteObject(self, x, x.label, x.methods)
                self._held[x.number] = held
                weakref.finalize(held, self._dropped.append, x.number)
            return held
        if type(x) in (tuple, list):
            return type(x)(self._incoming(v) for v in x)
        if type(x) is dict:
            return {k: self._incoming(v) for k, v in x.items()}
        return x

    def _answer(self, data: bytes, label: str) -> tuple[Any, ...]:
        """Send one request and wait for its answer, within the time limit."""
        conn = self._conn
        try:
            conn.send_bytes(data)
        except OSError:
            pass  # the worker is gone: what it said last (bye?) or EOF tells why
        if not conn.poll(self.timeout):
            self.stop()
            raise self._timed_out(label)
        try:
            reply = workers.receive(conn)
        except (EOFError, OSError, pickle.UnpicklingError):
            self.timeouts_in_a_row = 0
            raise PluginFault(f"the worker process died with exit code {self._exit_code()} in "
                              f"{label}", fatal=True) from None
        if reply[0] == "bye":
            raise _Bye
        self.timeouts_in_a_row = 0
        return reply

    def _timed_out(self, label: str) -> PluginFault:
        """The fault of a call that did not return in time (its worker already killed), after
        the line on stderr that says so; the ``TIMEOUTS_IN_A_ROW``-th in a row gives up."""
        self.timeouts += 1
        self.timeouts_in_a_row += 1
        limit = f"{self.timeout:g} s"
        where, say = _CALLING.get()
        where = ", ".join(w for w in (label, where) if w)
        if self.timeouts_in_a_row >= TIMEOUTS_IN_A_ROW:
            self.given_up = (f"{self.timeouts_in_a_row} calls in a row did not return within "
                             f"{limit} (--timeout {self.timeout:g}): the rest of the run was "
                             f"not called")
            then = (f"{self.timeouts_in_a_row} calls in a row did not return: not restarted, "
                    f"the rest of the run is not called")
        else:
            then = f"worker restarted ({ordinal(self.timeouts)} time)"
        line = f"{self.path}: a call did not return within {limit} ({where}); {then}"
        if say is None:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        else:
            say(line)
        return PluginFault(f"{label} did not return within {limit} (--timeout "
                           f"{self.timeout:g})", status="timeout", fatal=True)

    def call(self, target: RemoteObject, method: str | None, args: tuple[Any, ...],
             kwargs: dict[str, Any], label: str) -> Any:
        """``target.method(*args, **kwargs)`` in the worker (``method`` None: ``target``
        itself), guarded there; a ``PluginFault`` when it fails beyond raising."""
        with self._lock:
            if self.given_up:
                raise PluginFault(self.given_up, status="timeout", fatal=True)
            for _ in range(3):
                try:
                    self.start()
                except UsageError as exc:
                    raise PluginFault(f"the worker process for {label} could not be started "
                                      f"again: {exc}", fatal=True) from None
                dropped = self._dropped[:]  # finalizers may append meanwhile: keep those
                data = workers.encode((self._outgoing(target), method, self._outgoing(args),
                                     self._outgoing(kwargs), dropped))
                del self._dropped[:len(dropped)]
                try:
                    reply = self._answer(data, label)
                except _Bye:
                    self.stop()
                    continue
                break
            else:  # pragma: no cover - three workers in a row ended before reading a call
                raise PluginFault(f"the worker process keeps ending before {label}", fatal=True)
            if reply[0] == "ok":
                return self._incoming(reply[1])
        if reply[0] == "fault":
            raise PluginFault(reply[1], raised=reply[2])
        raise _rebuilt(*reply[1])

    def view(self) -> types.ModuleType:
        """The module as the harness calls it: each function and class of its contract a
        ``RemoteObject`` (starts the worker: ``UsageError`` for a module that does not
        import; sets ``contract``)."""
        with self._lock:
            self.start()
        view = types.ModuleType(self.path)
        for name, methods in sorted(self.entries.items()):
            setattr(view, name, RemoteObject(self, name, name, methods))
        return view


class RemoteObject:
    """A function, class or object of the module that lives in the worker: calling it, or a
    method of it, is a call there (``Worker.call``); its methods are known, nothing else."""

    __slots__ = ("__weakref__", "generation", "handle", "label", "methods", "worker")

    def __init__(self, worker: Worker, handle: str | Handle, label: str,
                 methods: tuple[str, ...]) -> None:
        self.worker, self.handle, self.label, self.methods = worker, handle, label, methods
        self.generation = worker.generation

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The call, in the worker."""
        return self.worker.call(self, None, args, kwargs, self.label)

    def __getattr__(self, name: str) -> Any:
        if name not in self.methods:
            if isinstance(self.handle, Handle) and not name.startswith("_"):
                # an object's data attribute (a QuantizedArray's codes): read in the worker
                return self.worker.call(self, "." + name, (), {}, f"{self.label}.{name}")
            raise AttributeError(f"{self.label} has no method {name!r} (only methods are "
                                 f"reachable in the worker process)")

        def method(*args: Any, **kwargs: Any) -> Any:
            return self.worker.call(self, name, args, kwargs, f"{self.label}.{name}")

        return method

    def __repr__(self) -> str:
        return f"<{self.label} in the worker process of {self.worker.path}>"


__all__ = ["DEFAULT_TIMEOUT_S", "IDLE_EXIT_S", "IMPORT_LIMIT_S", "TIMEOUTS_IN_A_ROW",
           "RemoteObject", "Worker", "calling", "check_timeout", "ordinal", "seconds_argument"]
