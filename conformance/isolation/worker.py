"""A checked module given by its dotted path runs in a worker process (``Worker``).

The worker is a fresh interpreter (``subprocess``, like multiprocessing's "spawn": JAX or torch
may be loaded in the harness, so the harness is never forked), started on the module's first
use. It imports the module by its path, with the harness's ``sys.path``, and answers one
request per call over a socket pair (``multiprocessing.connection``: pickled messages), each
call guarded there (``serve``, ``guard.Guard``). It is a plain ``python -c`` process, not a
``multiprocessing.Process``, so the harness's own ``__main__`` (a script calling the Python API,
a reproducer the report printed) is never run again in it.

* **one worker per module for the whole run**: started lazily, kept between calls, restarted
  only after it was killed or died; it ends itself after ``IDLE_EXIT_S`` without a call (saying
  so first, so a call sent at that moment is resent to a new worker) and when the harness
  exits;
* **time limit per call**: the harness waits ``Worker.timeout`` seconds for each answer
  (``--timeout``; None: no limit); then it kills the worker and the call is a ``PluginFault``
  with status "timeout" ("scaled_dot_product_attention did not return within 2 s"). A worker
  that dies (``os._exit``, a segfault) is a ``PluginFault`` naming its exit code. Both are
  ``fatal``: the next call starts a new worker;
* **importing**: the worker's first message is the module's contract, or its import error: a
  missing module or a broken contract is the same one-line ``UsageError`` as in-process, a
  failing import a ``PluginImportError`` with the worker's traceback; the import may take
  ``max(timeout, IMPORT_LIMIT_S)`` seconds;
* **objects**: functions and classes are called by name (``RemoteObject``); an object a call
  returns (a module instance, a KV cache) stays in the worker and the harness holds a handle
  whose methods are calls too; the worker forgets it when the harness drops the handle;
* **exceptions** the module raises come back with their class name, their nearest built-in
  base class (``NotImplementedError`` stays one) and their message; the harness never
  unpickles a class of the module, so it never imports the module itself.
"""

from __future__ import annotations

import builtins
import json
import pickle
import signal
import socket
import subprocess
import sys
import threading
import types
import weakref
from multiprocessing.connection import Connection
from typing import Any

from .. import plugins
from ..usage import UsageError
from .guard import PluginFault
from .serve import IDLE_EXIT_S, Handle

#: Importing the module may take at least this long, whatever the per-call limit.
IMPORT_LIMIT_S = 120.0
_BOOT = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
         "from conformance.isolation.serve import serve; serve(*sys.argv[2:])")


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


def _stop(process: subprocess.Popen, conn: Connection) -> None:
    """Close the connection and kill the process (at exit, on a timeout, when collected)."""
    conn.close()
    if process.poll() is None:
        process.kill()
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process that ignores SIGKILL
        pass


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

    # -- the process ----------------------------------------------------------------------

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, json.dumps(sys.path), str(theirs.fileno()),
                 self.path, str(IDLE_EXIT_S)], pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        stopper = weakref.finalize(self, _stop, process, conn)
        limit = None if self.timeout is None else max(self.timeout, IMPORT_LIMIT_S)
        try:
            if not conn.poll(limit):
                raise UsageError(f"importing {self.path!r} did not finish within {limit:g} s")
            reply = pickle.loads(conn.recv_bytes())
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
            raise PluginFault(f"{label} did not return within {self.timeout:g} s "
                              f"(--timeout {self.timeout:g})", status="timeout", fatal=True)
        try:
            reply = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError, pickle.UnpicklingError):
            raise PluginFault(f"the worker process died with exit code {self._exit_code()} in "
                              f"{label}", fatal=True) from None
        if reply[0] == "bye":
            raise _Bye
        return reply

    def call(self, target: RemoteObject, method: str | None, args: tuple[Any, ...],
             kwargs: dict[str, Any], label: str) -> Any:
        """``target.method(*args, **kwargs)`` in the worker (``method`` None: ``target``
        itself), guarded there; a ``PluginFault`` when it fails beyond raising."""
        with self._lock:
            for _ in range(3):
                try:
                    self.start()
                except UsageError as exc:
                    raise PluginFault(f"the worker process for {label} could not be started "
                                      f"again: {exc}", fatal=True) from None
                dropped = self._dropped[:]  # finalizers may append meanwhile: keep those
                data = pickle.dumps((self._outgoing(target), method, self._outgoing(args),
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
            raise AttributeError(f"{self.label} has no method {name!r} (only methods are "
                                 f"reachable in the worker process)")

        def method(*args: Any, **kwargs: Any) -> Any:
            return self.worker.call(self, name, args, kwargs, f"{self.label}.{name}")

        return method

    def __repr__(self) -> str:
        return f"<{self.label} in the worker process of {self.worker.path}>"


__all__ = ["IMPORT_LIMIT_S", "RemoteObject", "Worker"]
