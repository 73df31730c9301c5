"""Every call of a checked module, guarded, in the process that holds the module (``Guard``).

The harness hands a checked module ("plugin") NumPy arrays and reads NumPy arrays back; the
``Guard`` stands between them, in the harness's own process for a module given as a module
object (``local_view``) and inside the worker process for one given by its dotted path
(``module_worker``):

* **copies**: every NumPy array of a call, nested in tuples, lists and dicts too, is copied
  before the module sees it, so the module never holds the harness's arrays (which other
  columns and the expected values share); the top-level arrays, and those of a top-level list
  or tuple (``merge_attention``'s ``outputs`` and ``lses``), are then converted with the
  module's ``asarray`` when it defines one. Results are copied too, the module's own arrays
  read back with its ``to_numpy`` (default ``numpy.asarray``);
* **mutation**: after the call each top-level array argument, read back with ``to_numpy``,
  must hold the bits it was given, else the call is a ``PluginFault``: "scaled_dot_product_
  attention mutates its input `query` in place". Arrays inside containers (a KV cache made of
  arrays, a dict of weights) are copied but not checked: a module may update its own cache;
* **BaseException**: ``SystemExit``, ``GeneratorExit`` or any other ``BaseException`` the
  module raises is a ``PluginFault`` ("SystemExit(0) raised in scaled_dot_product_attention").
  ``KeyboardInterrupt`` is the user's Ctrl-C in the harness's process and propagates there; in
  the worker (which ignores SIGINT) the module raised it itself, so it is a fault. Ordinary
  exceptions propagate unchanged: they are the module's answer (``NotImplementedError`` means
  unsupported; the bad-input checks judge the others);
* **objects**: a result that is neither data nor an array (a ``SelfAttention`` instance, a KV
  cache) stays an object; ``wrap`` decides how the caller holds it (here a ``LocalObject``
  whose methods are guarded calls too; in the worker a handle).

``PluginFault`` derives from ``BaseException`` so that code judging the module's own exceptions
(``except Exception`` in the bad-input and property checks) never takes it for an answer.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import plugins

#: A call's data leaves that pass unchanged (besides NumPy arrays and scalars).
_PLAIN = (type(None), bool, int, float, complex, str, bytes, np.generic)


class PluginFault(BaseException):
    """A call of a checked module that failed beyond raising an exception: it mutated its
    input, raised a ``BaseException`` (``raised``: its class name), did not return in time
    (``status`` "timeout") or its worker process died. ``fatal``: the worker was stopped, so
    the cell ends here."""

    def __init__(self, reason: str, status: str = "error", fatal: bool = False,
                 raised: str = "") -> None:
        super().__init__(reason)
        self.reason, self.status, self.fatal, self.raised = reason, status, fatal, raised


@dataclass(frozen=True)
class Seed:
    """``backend.rng(seed)`` of a checked module: becomes ``module.rng(seed)`` (default
    ``numpy.random.default_rng(seed)``) where the module runs."""

    seed: int


def exception_call(exc: BaseException, limit: int = 120) -> str:
    """``SystemExit(0)``: an exception as its constructor call, on one line (at most ``limit``
    characters of arguments)."""
    args = ", ".join(repr(a) for a in exc.args)
    return f"{type(exc).__name__}({args if len(args) <= limit else args[:limit] + '…'})"


def _argument_names(fn: Any, positions: list[int | str]) -> list[str]:
    """The parameter names of ``fn`` at these positions (keywords as they are)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = []
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        positional.append(p.name)
    return [p if isinstance(p, str) else positional[p] if p < len(positional)
            else f"argument {p + 1}" for p in positions]


class Guard:
    """Calls of one module (``module``: the module as the harness calls it, ``plugins.view``)
    with copies, mutation detection and ``BaseException`` caught.

    ``own_interrupts``: True in the harness's process (a ``KeyboardInterrupt`` is the user's
    and propagates), False in the worker (it is the module's own: a fault)."""

    def __init__(self, module: types.ModuleType, own_interrupts: bool = True) -> None:
        self.module = module
        self.own_interrupts = own_interrupts
        self._asarray = getattr(module, "asarray", None)
        self._to_numpy = getattr(module, "to_numpy", None)
        self._rng = getattr(module, "rng", None) or np.random.default_rng

    # -- the caller's objects -------------------------------------------------------------

    def wrap(self, obj: Any) -> Any:
        """How the caller holds an object the module returned: a ``LocalObject``."""
        return LocalObject(self, obj, type(obj).__name__)

    def unwrap(self, x: Any) -> Any:
        """The module's object behind what the caller passes back."""
        return x.target if isinstance(x, LocalObject) and x.guard is self else x

    # -- one call -------------------------------------------------------------------------

    def _argument(self, x: Any, top: bool, given: list[tuple[Any, np.ndarray, Any]],
                  where: int | str, convert: bool = False) -> Any:
        x = self.unwrap(x)
        if isinstance(x, Seed):
            return self._rng(x.seed)
        if isinstance(x, np.ndarray):
            copy = np.array(x, copy=True)
            if not top:
                return copy if not convert or self._asarray is None else self._asarray(copy)
            converted = copy if self._asarray is None else self._asarray(copy)
            given.append((where, x, converted))
            return converted
        if type(x) in (tuple, list):
            return type(x)(self._argument(v, False, given, where, convert=top) for v in x)
        if type(x) is dict:
            return {k: self._argument(v, False, given, where) for k, v in x.items()}
        return x

    def _array(self, x: Any) -> np.ndarray | None:
        """``x`` read back as a NumPy array (a copy), or None when it is no array."""
        if isinstance(x, np.ndarray):
            out = x
        elif self._to_numpy is not None:
            try:
                out = np.asarray(self._to_numpy(x))
            except Exception:  # noqa: BLE001 - not one of the module's arrays
                return None
        elif hasattr(x, "__array__") or hasattr(x, "__array_interface__"):
            try:
                out = np.asarray(x)
            except Exception:  # noqa: BLE001 - not an array after all
                return None
        else:
            return None
        return None if out.dtype.hasobject else np.array(out, copy=True)

    def result(self, x: Any) -> Any:
        """A result as the caller gets it: data and arrays (copies), objects ``wrap``-ped."""
        if isinstance(x, _PLAIN):
            return x
        if type(x) in (tuple, list):
            return type(x)(self.result(v) for v in x)
        if type(x) is dict:
            return {k: self.result(v) for k, v in x.items()}
        array = self._array(x)
        return self.wrap(x) if array is None else array

    def _mutated(self, fn: Any, given: list[tuple[Any, np.ndarray, Any]]) -> list[str]:
        changed = []
        for where, before, converted in given:
            after = self._array(converted)
            if after is not None and after.shape == before.shape and (
                    after.dtype == before.dtype and after.tobytes() != before.tobytes()):
                changed.append(where)
        return _argument_names(fn, changed) if changed else []

    def call(self, fn: Callable[..., Any], label: str, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)`` guarded (see the module docstring); ``label`` names the
        function in a fault (``scaled_dot_product_attention``, ``SelfAttention.forward``)."""
        given: list[tuple[Any, np.ndarray, Any]] = []
        try:
            out = fn(*(self._argument(a, True, given, i) for i, a in enumerate(args)),
                     **{k: self._argument(v, True, given, k) for k, v in kwargs.items()})
            mutated = self._mutated(fn, given)
            out = self.result(out)
        except PluginFault:
            raise
        except Exception:
            raise
        except KeyboardInterrupt as exc:
            if self.own_interrupts:
                raise
            raise PluginFault(f"{exception_call(exc)} raised in {label}",
                              raised=type(exc).__name__) from None
        except BaseException as exc:  # noqa: BLE001 - SystemExit & co. end the call, not us
            raise PluginFault(f"{exception_call(exc)} raised in {label}",
                              raised=type(exc).__name__) from None
        if mutated:
            names = ", ".join(f"`{n}`" for n in mutated)
            raise PluginFault(f"{label} mutates its input{'s' if len(mutated) > 1 else ''} "
                              f"{names} in place")
        return out


class LocalObject:
    """A function, class or object of a module held in the harness's process: calling it,
    or a method of it, is a guarded call (``Guard.call``)."""

    __slots__ = ("guard", "label", "target")

    def __init__(self, guard: Guard, target: Any, label: str) -> None:
        self.guard, self.target, self.label = guard, target, label

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The guarded call."""
        return self.guard.call(self.target, self.label, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(self.target, name)
        if callable(attr):
            return LocalObject(self.guard, attr, f"{self.label}.{name}")
        return self.guard.result(attr)

    def __repr__(self) -> str:
        return f"<{self.label} of a checked module, guarded>"


def local_view(module: types.ModuleType, contract: plugins.Contract) -> types.ModuleType:
    """The module as the harness calls it in its own process: each function and class of the
    contract a guarded ``LocalObject`` (``module``: ``plugins.view``'s, in the spec's
    layout); nothing else (``asarray``, ``to_numpy`` and ``rng`` are applied by the guard)."""
    guard = Guard(module)
    view = types.ModuleType(module.__name__, module.__doc__)
    for name in sorted(contract.provided):
        setattr(view, name, LocalObject(guard, getattr(module, name), name))
    return view


__all__ = ["Guard", "LocalObject", "PluginFault", "Seed", "exception_call", "local_view"]
