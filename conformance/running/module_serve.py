"""Inside the worker process of a checked module given by its dotted path (``module_worker``).

``serve`` is the worker's main loop: it imports the module with the harness's ``sys.path``,
sends its contract (or its import error) first, then answers one call per request until the
connection closes or no call came for ``idle`` seconds (saying "bye" first). Every call runs
under ``WorkerGuard``: an object a call returns (a module instance, a KV cache) stays here and
goes back as a ``Handle``; an exception goes back as its parts (``exception_parts``), so the
harness never unpickles a class of the module. A watching thread ends the worker when the
harness is gone. The harness's side is ``module_worker.Worker``.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
import types
import warnings
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ..usage import UsageError
from . import plugins, workers
from .guard import Guard, PluginFault


@dataclass(frozen=True)
class Handle:
    """An object that lives in the worker: its number, its type's name, its public methods."""

    number: int
    label: str = ""
    methods: tuple[str, ...] = ()


def _callable(obj: Any, name: str) -> bool:
    """Whether ``obj.name`` is callable; a property that raises (an empty cache's ``keys``)
    is no method."""
    try:
        return callable(getattr(obj, name, None))
    except Exception:  # noqa: BLE001 - the object's own property failing is not ours
        return False


def _methods(obj: Any) -> tuple[str, ...]:
    return tuple(n for n in dir(obj) if not n.startswith("_") and _callable(obj, n))


class WorkerGuard(Guard):
    """The guard inside the worker: objects become handles, handles objects again."""

    def __init__(self, module: types.ModuleType) -> None:
        super().__init__(module, own_interrupts=False)
        self.objects: dict[int, Any] = {}
        self.numbers: dict[int, int] = {}  # id(object) -> its handle's number
        self.made = 0

    def wrap(self, obj: Any) -> Handle:
        number = self.numbers.get(id(obj))
        if number is None:
            self.made = number = self.made + 1
            self.objects[number], self.numbers[id(obj)] = obj, number
        return Handle(number, type(obj).__name__, _methods(obj))

    def unwrap(self, x: Any) -> Any:
        if not isinstance(x, Handle):
            return x
        if x.number not in self.objects:
            raise LookupError(f"object {x.number} is not held by this worker process")
        return self.objects[x.number]

    def answer(self, request: tuple[Any, ...]) -> tuple[Any, ...]:
        """One request ``(target, method, args, kwargs, dropped)`` → ``("ok", value)``,
        ``("fault", reason)`` or ``("raise", exception)``."""
        target, method, args, kwargs, dropped = request
        for number in dropped:
            self.numbers.pop(id(self.objects.pop(number, None)), None)
        try:
            obj = self.unwrap(target) if isinstance(target, Handle) else getattr(self.module,
                                                                                 target)
            label = target.label if isinstance(target, Handle) else target
            if method is not None and method.startswith("."):  # a data attribute, read
                return ("ok", self.result(getattr(obj, method[1:])))
            fn = obj if method is None else getattr(obj, method)
            label = label if method is None else f"{label}.{method}"
            return ("ok", self.call(fn, label, args, kwargs))
        except PluginFault as fault:
            return ("fault", fault.reason, fault.raised)
        except Exception as exc:  # noqa: BLE001 - the module's answer, sent back
            return ("raise", exception_parts(exc))


def exception_parts(exc: Exception) -> tuple[str, str, str, str]:
    """``(class name, module, nearest built-in base class name, message)`` of an exception."""
    base = next(c for c in type(exc).__mro__ if c.__module__ == "builtins")
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a message that cannot be printed
        text = f"<unprintable {type(exc).__name__}>"
    return type(exc).__name__, type(exc).__module__, base.__name__, text


def _send(conn: Connection, message: tuple[Any, ...]) -> None:
    try:
        data = workers.encode(message)
    except Exception as exc:  # noqa: BLE001 - a result pickle cannot carry
        error = TypeError(f"the result cannot be sent back to the harness ({exc})")
        data = workers.encode(("raise", exception_parts(error)))
    conn.send_bytes(data)


def _orphaned(parent: int) -> None:
    """Watch the harness: when it is gone (killed, even in the middle of a call that hangs),
    end this process too."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def serve(fd: str, path: str, idle: str) -> None:
    """The worker's main loop (``Worker`` starts it): import ``path``, then answer calls on the
    connection ``fd`` until it closes or ``idle`` seconds pass without one."""
    conn = workers.connect(fd)  # SIGINT ignored: Ctrl-C is the harness's to handle
    threading.Thread(target=_orphaned, args=(os.getppid(),), daemon=True).start()
    warnings.simplefilter("ignore")  # as the harness runs every call of a backend
    np.seterr(all="ignore")
    try:
        module = plugins.import_plugin(path)
        contract = plugins.contract_of(module, path)
        guard = WorkerGuard(plugins.view(module, contract))
        entries = {n: _methods(getattr(guard.module, n)) for n in contract.provided}
    except plugins.PluginImportError as exc:
        _send(conn, ("import", exc.traceback))
        return
    except UsageError as exc:
        _send(conn, ("usage", str(exc)))
        return
    except BaseException:  # noqa: BLE001 - SystemExit at import time & co.
        _send(conn, ("import", traceback.format_exc()))
        return
    _send(conn, ("ready", contract, entries))
    try:
        while conn.poll(float(idle)):
            data = conn.recv_bytes()
            try:
                reply = guard.answer(workers.decode(data))
            except Exception as exc:  # noqa: BLE001 - a request this worker cannot read
                reply = ("raise", exception_parts(exc))
            _send(conn, reply)
        _send(conn, ("bye",))
    except (EOFError, OSError):  # the harness has gone
        return


__all__ = ["Handle", "WorkerGuard", "exception_parts", "serve"]
