"""Adapters between NumPy arrays and each backend, imported lazily.

The harness generates every input once with NumPy and hands each backend the same bits through
``Backend.asarray``; results come back through ``Backend.to_numpy``. Only ``numpy_attn`` is
needed to run anything; JAX and PyTorch are imported the first time their backend is used.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.machinery
import os
import sys
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from ..cases.dtypes import BFLOAT16, DTYPES, numpy_dtype  # noqa: F401 - backends.DTYPES as before
from ..usage import UsageError
from . import module_worker, plugins
from .guard import Seed, local_view


class BackendUnavailable(ImportError):
    """A backend's framework is not installed."""


@dataclass
class Backend:
    """How the harness talks to one implementation of the spec."""

    name: str
    module_name: str
    install: str
    _asarray: Callable[[np.ndarray], Any]
    _to_numpy: Callable[[Any], np.ndarray]
    _rng: Callable[[int], Any]
    _prepare: Callable[[], None] = field(default=lambda: None)
    _module: ModuleType | None = None
    #: ``(function, static_argnames) -> compiled function``; None runs functions as they are.
    _compile: Callable[[Callable[..., Any], tuple[str, ...]], Callable[..., Any]] | None = None
    #: Frees what compiling kept (called between cases); None when nothing is kept.
    _release: Callable[[], None] | None = None
    _compiled: dict[Hashable, Callable[..., Any]] = field(default_factory=dict, repr=False)
    #: A checked module's import (``from_module``): raises ``UsageError``, never ImportError.
    _import: Callable[[], ModuleType] | None = None
    #: What a checked module provides and declares (``plugins.Contract``); None for numpy,
    #: jax and torch, which provide everything.
    contract: plugins.Contract | None = None
    #: A checked module given by its path: the worker process it runs in (``module_worker``).
    _worker: module_worker.Worker | None = None

    @property
    def module(self) -> ModuleType:
        """The backend's package, imported on first use."""
        if self._module is None and self._import is not None:
            self._module = self._import()
        if self._module is None:
            try:
                self._prepare()
                self._module = importlib.import_module(self.module_name)
            except ImportError as exc:
                raise BackendUnavailable(
                    f"backend {self.name!r} needs {exc.name or self.module_name}: {self.install}"
                ) from exc
        return self._module

    def provides(self, name: str) -> bool:
        """True when the backend defines ``name`` (a function or module of the spec)."""
        _ = self.module
        return self.contract is None or name in self.contract.provided

    def available(self) -> bool:
        """True when the backend imports."""
        try:
            _ = self.module
        except BackendUnavailable:
            return False
        return True

    def asarray(self, x: Any) -> Any:
        """A NumPy array (or None) as this backend's array, same dtype and bits."""
        if x is None:
            return None
        _ = self.module  # make sure the framework is configured first
        return self._asarray(np.asarray(x))

    def to_numpy(self, x: Any) -> np.ndarray:
        """This backend's array as a NumPy array, same dtype."""
        return self._to_numpy(x)

    def rng(self, seed: int) -> Any:
        """The backend's random source for dropout and initialisation, seeded."""
        _ = self.module
        return self._rng(seed)

    @property
    def compiles(self) -> bool:
        """True when the backend compiles whole calls (JAX): the harness then groups calls."""
        return self._compile is not None

    def compiled(self, key: Hashable, build: Callable[[], Callable[..., Any]],
                 static: tuple[str, ...] = ()) -> Callable[..., Any]:
        """``build()``, compiled once per ``key`` where the backend compiles (``jax.jit`` with
        ``static`` as its static argument names, one program per input signature); ``build()``
        itself elsewhere.

        Compiling a whole call once is far cheaper in JAX than running it eagerly, which
        compiles and dispatches every primitive separately.
        """
        if self._compile is None:
            return build()
        cached = self._compiled.get(key)
        if cached is None:
            cached = self._compiled[key] = self._compile(build(), static)
        return cached

    def function(self, name: str, static: tuple[str, ...] = ()) -> Callable[..., Any]:
        """``module.name``, compiled where the backend compiles (see ``compiled``)."""
        fn = getattr(self.module, name)
        return self.compiled(("function", name, static, id(fn)), lambda: fn, static)

    def set_timeout(self, seconds: float | None) -> None:
        """Seconds one call of a checked module run in a worker process may take (None: no
        limit); the spec's backends and a module given as a module object have none."""
        if self._worker is not None:
            self._worker.timeout = seconds

    def release(self) -> None:
        """Free compiled programs the harness no longer needs (between cases)."""
        self._compiled.clear()
        if self._release is not None:
            self._release()


# ---------------------------------------------------------------------------- numpy


def _numpy_backend() -> Backend:
    return Backend(
        name="numpy",
        module_name="numpy_attn",
        install="pip install numpy ml_dtypes",
        _asarray=lambda x: x,
        _to_numpy=np.asarray,
        _rng=np.random.default_rng,
    )


# ---------------------------------------------------------------------------- jax


def jax_cache_env() -> dict[str, str]:
    """The harness's persistent JAX compilation cache as the environment variables JAX reads
    at import (for a subprocess, or a process that sets them before importing JAX): the folder
    ``ATTENTION_JAX_CACHE`` names (default ``~/.cache/attention-three-ways/jax``), every
    program cached; empty when ``ATTENTION_JAX_CACHE=off``."""
    cache = os.environ.get("ATTENTION_JAX_CACHE", os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
        "attention-three-ways", "jax"))
    if cache == "off":
        return {}
    return {"JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def jax_prepare() -> None:
    """Configure JAX for the harness: float64 enabled, persistent compilation cache."""
    import jax

    # The harness compares float64 inputs too, which JAX refuses unless x64 is enabled.
    jax.config.update("jax_enable_x64", True)
    # The harness runs every backend eagerly on many small shapes: most of JAX's time is
    # compiling them. A persistent compilation cache makes every run after the first fast.
    # ATTENTION_JAX_CACHE=off turns it off; a path puts it elsewhere.
    cache = jax_cache_env()
    if cache and jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", cache["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _jax_asarray(x: np.ndarray) -> Any:
    # device_put, not jnp.asarray: outside a trace jnp.asarray of a NumPy array runs a compiled
    # identity program (``lax.stage``), one per shape and dtype (224 fewer programs in the JAX
    # column); device_put copies, with the same dtype, shape and weak type.
    import jax

    return jax.device_put(x)


def _jax_to_numpy(x: Any) -> np.ndarray:
    return np.asarray(x)


def _jax_rng(seed: int) -> Any:
    import jax

    return jax.random.key(seed)


def _jax_compile(fn: Callable[..., Any], static: tuple[str, ...]) -> Callable[..., Any]:
    import jax

    return jax.jit(fn, static_argnames=static)


#: JAX keeps every compiled program (about 1.5 MB each on CPU); above this many MiB of resident
#: memory the harness drops them between cases (the persistent cache keeps them on disk).
JAX_RELEASE_ABOVE_MIB = 650


def resident_mib() -> float | None:
    """This process's resident memory in MiB (Linux ``/proc``), or None where unknown."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _jax_release() -> None:
    import gc

    import jax

    rss = resident_mib()
    if rss is not None and rss < JAX_RELEASE_ABOVE_MIB:
        return
    jax.clear_caches()
    gc.collect()
    try:  # glibc keeps freed memory in its arenas: hand it back to the system
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _jax_backend() -> Backend:
    return Backend(
        name="jax",
        module_name="jax_attn",
        install="pip install jax",
        _asarray=_jax_asarray,
        _to_numpy=_jax_to_numpy,
        _rng=_jax_rng,
        _prepare=jax_prepare,
        _compile=_jax_compile,
        _release=_jax_release,
    )


# ---------------------------------------------------------------------------- torch


def torch_asarray(x: np.ndarray) -> Any:
    """A NumPy array as a CPU torch tensor with the same dtype and bits (bfloat16 too)."""
    import torch

    if x.dtype == BFLOAT16:  # torch.from_numpy knows no bfloat16: move the bits
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x).copy())


def torch_to_numpy(x: Any) -> np.ndarray:
    """A torch tensor as a NumPy array with the same dtype and bits (bfloat16 via ml_dtypes)."""
    import torch

    x = x.detach().cpu()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(BFLOAT16)
    return x.numpy()


def _torch_rng(seed: int) -> Any:
    import torch

    return torch.Generator().manual_seed(seed)


def _torch_backend() -> Backend:
    return Backend(
        name="torch",
        module_name="torch_attn",
        install="pip install torch==2.13.0",
        _asarray=torch_asarray,
        _to_numpy=torch_to_numpy,
        _rng=_torch_rng,
    )


_FACTORIES = {"numpy": _numpy_backend, "jax": _jax_backend, "torch": _torch_backend}
_CACHE: dict[str, Backend] = {}

#: The spec's own backends, in report order.
SPEC_BACKENDS = tuple(_FACTORIES)


def get(name: str) -> Backend:
    """The adapter for ``"numpy"``, ``"jax"`` or ``"torch"`` (cached)."""
    if name not in _FACTORIES:
        raise UsageError(f"unknown backend {name!r}; expected one of {sorted(_FACTORIES)}")
    if name not in _CACHE:
        _CACHE[name] = _FACTORIES[name]()
    return _CACHE[name]


# ---------------------------------------------------------------------------- user modules


def from_module(module: ModuleType | str, name: str | None = None) -> Backend:
    """An adapter for any module implementing the spec's function names (``plugins``).

    ``module`` is a module object or a dotted import path (``"mypkg.attention"``), imported on
    first use. The module defines ``scaled_dot_product_attention`` and any of the spec's other
    functions and modules; it takes and returns NumPy arrays, or provides ``asarray(np_array)``
    and ``to_numpy(x)`` for its own array type, and optionally ``rng(seed)`` (default:
    ``numpy.random.default_rng``), ``UNSUPPORTED`` and ``LAYOUT`` (``spec.PLUGIN_CONTRACT``).

    The module runs isolated (``guard``): a dotted path in a worker process
    (``module_worker``), every call within ``set_timeout``'s limit; a module object in this
    process. Either way every call
    gets copies of its arrays and is checked for mutating them, and the backend takes and
    returns NumPy arrays: ``asarray`` and ``to_numpy`` are applied where the module runs, and
    ``rng(seed)`` is a ``guard.Seed`` that becomes the module's generator there.
    """
    path = module if isinstance(module, str) else module.__name__
    backend = Backend(
        name=name or path,
        module_name=path,
        install=f"make {path!r} importable (pip install it, or run from its folder)",
        _asarray=lambda x: x,
        _to_numpy=np.asarray,
        _rng=Seed,
    )
    if isinstance(module, str):
        worker = backend._worker = module_worker.Worker(path, module_worker.DEFAULT_TIMEOUT_S)

        def load() -> ModuleType:
            view = worker.view()  # starts the worker: UsageError when the module is broken
            backend.contract = worker.contract
            return view
    else:
        def load() -> ModuleType:
            backend.contract = plugins.contract_of(module, path)
            return local_view(plugins.view(module, backend.contract),
                                        backend.contract)

    backend._import = load
    return backend


def register(backend: Backend) -> Backend:
    """Make ``load(backend.name)`` return ``backend`` (e.g. a test's fake implementation)."""
    _CACHE[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    """Forget a backend added with ``register``."""
    _CACHE.pop(name, None)


def load(name: str) -> Backend:
    """A spec backend by name (``"numpy"``, ``"jax"``, ``"torch"``) or a user module by path."""
    if name in _FACTORIES:
        return get(name)
    if name not in _CACHE and plugins.file_path_hint(name):  # before a worker starts
        raise UsageError(plugins.file_path_hint(name))
    if name not in _CACHE:
        _CACHE[name] = from_module(name)
    return _CACHE[name]


# ---------------------------------------------------------------------------- reproducers


def import_folder(module_name: str) -> str | None:
    """The folder that makes ``import module_name`` work (the ``sys.path`` entry it imports
    from), derived from the module's file and dotted name: the imported module's
    ``__file__``, else (a checked module runs in a worker, never imported here) the file of its
    top-level package as the import system finds it on ``sys.path``, without running it. None
    for a module without a file (built in memory) or one not found."""
    module = sys.modules.get(module_name)
    name, file = module_name, getattr(module, "__file__", None)
    if file is None:
        name = module_name.partition(".")[0]
        spec = importlib.machinery.PathFinder.find_spec(name)
        if spec is None:
            return None
        if not spec.has_location:  # a namespace package: the folder above its first folder
            locations = list(spec.submodule_search_locations or [])
            return str(Path(locations[0]).resolve().parent) if locations else None
        file = spec.origin
    path = Path(file).resolve()
    if path.stem == "__init__":  # a package: its folder is the module
        path = path.parent
    return str(path.parents[name.count(".")])


def load_lines(backend: Backend, variable: str) -> list[str]:
    """A script's lines that load ``backend`` as the harness calls it into ``variable``: for a
    checked module, first its ``import_folder`` on ``sys.path``, so the script runs from any
    folder."""
    folder = None if backend.name in SPEC_BACKENDS else import_folder(backend.module_name)
    lines = ["import sys",
             f"sys.path.insert(0, {folder!r})  # where `import {backend.module_name}` works"
             ] if folder is not None else []
    return [*lines, f"{variable} = backends.load({backend.name!r})  # the module as the harness "
                    "calls it"]
