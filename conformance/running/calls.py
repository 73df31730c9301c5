"""Backend calls as data (``Call``), several made in one compiled program (``prefetch``), and
the calls of a packed batch (``varlen``).

A ``Call`` is ``fn(*args, **kwargs)`` on NumPy arrays: keyword arguments that are arrays (or a
tuple of arrays: ``segment_ids=(q_ids, kv_ids)``) are inputs of a compiled program, every other
keyword argument is static (the program is specialised to it: flags, numbers, a mod). On a
backend that compiles (JAX), ``prefetch`` runs the calls of every step of a case in one program.

``varlen`` runs ``varlen_attention`` (its output, and with ``return_lse=True`` its lse) and
``varlen_attention_vjp`` on a varlen case. The offsets (``cu_seq_q``, ``cu_seq_k``,
``seqused_k``) are the backend's arrays closed over by the function it runs, never inputs of a
compiled program: ``spec.VARLEN_COMPUTATION`` groups the sequences by their lengths only when
the offsets are known on the host, so under ``jax.jit`` a traced offset would check the masked
fallback instead of the path users get. ``max_q``, ``max_k``, ``window_size``, ``enable_gqa``,
``scale`` and ``softcap`` are static; query, key, value, ``grad_output`` and ``sinks`` inputs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cases.expected import Expected
from . import composite
from .backends import Backend


def _arrays(v: Any) -> bool:
    """An array, or a tuple or list of arrays (an input of a compiled program)."""
    if isinstance(v, (tuple, list)):
        return bool(v) and all(isinstance(x, np.ndarray) for x in v)
    return isinstance(v, np.ndarray)


@dataclass(frozen=True)
class Call:
    """One call of a backend function: ``fn(*args, **kwargs)`` on NumPy arrays; the keyword
    arguments that are not arrays (nor tuples of arrays) are static (a compiled program is
    specialised to them)."""

    key: str  # the execution's cache key
    fn: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def static(self) -> tuple[str, ...]:
        """The names of the static keyword arguments."""
        return tuple(sorted(k for k, v in self.kwargs.items() if not _arrays(v)))


def prefetch(backend: Backend, cache: dict[str, Any], calls: Iterable[Call]) -> None:
    """On a compiling backend, make every call not yet in ``cache`` in one compiled program
    and store the NumPy results there; on any failure store nothing (each step then calls on
    its own and reports its own error)."""
    todo = [c for c in calls if c.key not in cache]
    if not backend.compiles or len(todo) < 2:
        return
    arrays: list[np.ndarray] = []

    def slot(x: Any) -> tuple[str, Any]:
        if isinstance(x, (tuple, list)) and _arrays(x):
            return ("tuple", tuple(slot(v) for v in x))
        if not isinstance(x, np.ndarray):
            return ("static", x)
        for i, known in enumerate(arrays):
            if known is x:
                return ("array", i)
        arrays.append(x)
        return ("array", len(arrays) - 1)

    layout = tuple((c.fn, tuple(slot(a) for a in c.args),
                    tuple(sorted((k, slot(v)) for k, v in c.kwargs.items()))) for c in todo)
    module = backend.module

    def build() -> Callable[..., Any]:
        def together(*xs: Any) -> tuple[Any, ...]:
            def value(s: tuple[str, Any]) -> Any:
                if s[0] == "tuple":
                    return tuple(value(v) for v in s[1])
                return xs[s[1]] if s[0] == "array" else s[1]

            return tuple(getattr(module, fn)(*(value(s) for s in args),
                                             **{k: value(s) for k, s in kwargs})
                         for fn, args, kwargs in layout)

        return together

    try:
        functions = tuple(id(getattr(module, c.fn)) for c in todo)  # a patched one: anew
        fn = backend.compiled(("together", layout, functions), build)
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            results = fn(*(composite.to_backend(backend, x) for x in arrays))
    except Exception:  # noqa: BLE001 - each step then calls on its own and says why
        return
    for call, res in zip(todo, results, strict=True):
        cache[call.key] = to_numpy(backend, res)


def to_numpy(backend: Backend, result: Any) -> Any:
    """Backend array (or a tuple of them, None entries kept) → NumPy."""
    if isinstance(result, tuple):
        return tuple(None if x is None else backend.to_numpy(x) for x in result)
    return backend.to_numpy(result)


# ------------------------------------------------------------------------------ varlen

#: What ``varlen`` computes: the function and whether it returns the lse.
VARLEN_CALLS = {"forward": ("varlen_attention", False), "lse": ("varlen_attention", True),
                "vjp": ("varlen_attention_vjp", False)}
#: The offsets of a varlen case, closed over (host values, see the module docstring).
HOST = ("cu_seq_q", "cu_seq_k", "seqused_k")
#: The static options of a varlen case.
STATIC = ("max_q", "max_k", "window_size", "enable_gqa", "scale", "softcap")


def varlen(backend: Backend, exp: Expected, whats: tuple[str, ...]) -> tuple[Any, ...]:
    """The NumPy results of ``whats`` (keys of ``VARLEN_CALLS``) on a varlen case, made in one
    program (one compilation on JAX)."""
    a, o = exp.data.arrays, exp.data.options
    module = backend.module
    host = {n: backend.asarray(a[n]) for n in HOST if n in a}
    static = {k: tuple(v) if isinstance(v, list) else v for k, v in o.items()
              if k in STATIC and v is not None}
    sinks = a.get("sinks")

    def build() -> Callable[..., Any]:
        def run(query: Any, key: Any, value: Any, grad_output: Any, sinks: Any) -> tuple:
            extra = {"sinks": sinks} if sinks is not None else {}
            out = []
            for what in whats:
                fn, lse = VARLEN_CALLS[what]
                grad = (grad_output,) if what == "vjp" else ()
                flag = {"return_lse": True} if lse else {}
                out.append(getattr(module, fn)(query, key, value, *grad, **host, **static,
                                               **extra, **flag))
            return tuple(out)

        return run

    digest = tuple((n, np.asarray(a[n]).tobytes()) for n in HOST if n in a)
    functions = tuple(id(getattr(module, VARLEN_CALLS[w][0])) for w in whats)
    fn = backend.compiled(("varlen", whats, digest, tuple(sorted(static.items())), sinks is None,
                           functions), build)
    grad = a.get("grad_output") if "vjp" in whats else None
    results = fn(*(backend.asarray(x) for x in (a["query"], a["key"], a["value"])),
                 backend.asarray(grad), backend.asarray(sinks))
    return tuple(to_numpy(backend, r) for r in results)


__all__ = ["HOST", "STATIC", "VARLEN_CALLS", "Call", "prefetch", "to_numpy", "varlen"]
