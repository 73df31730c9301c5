"""Shared fixtures: every behavioural test runs on each backend that is installed.

CI installs all three frameworks, so nothing is skipped there; a NumPy-only machine runs the
NumPy backend and skips the others with the command that installs them.

JAX's float64 switch (``jax_enable_x64``) is never turned on for the whole run by a test file: a
test that needs float64 in JAX asks for ``x64_on`` (x64 on for that test only, with
``jax.enable_x64``), and a JAX check whose result could depend on the switch asks for ``x64`` and
runs twice, with x64 off (JAX's default, what users get) and on. (The harness's JAX adapter,
``conformance.running.backends.jax_prepare``, turns x64 on for the process when a test first uses
the ``jax`` backend; ``jax.enable_x64(False)`` still turns it off inside a test.)

Memory: JAX keeps every program it compiles for the life of the process (about 1.5 MB each on
the CPU; the grid's JAX column compiles over a thousand), and glibc keeps what Python frees in
the process. A pytest-xdist worker that ran every JAX test would pass 4 GB; so after a test
that left its worker ``RELEASE_GROWTH_MIB`` above what it held after the last release,
``_release_memory`` drops JAX's and torch.compile's compiled programs, collects the garbage and
hands the freed memory back to the system (``malloc_trim``; a fraction of a second). A worker
then stays below about 2 GB (with 512 MiB, the largest worker of a whole run peaked at
1.88–1.91 GB, too close to the limit; with 384, at 1.63–1.95 GiB from run to run, as the
workers draw different tests; hence 256). A later test that needs a dropped program
lowers it again, reading the compiled code back from JAX's persistent cache.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import types
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from conformance.running import backends

BACKEND_NAMES = backends.SPEC_BACKENDS


def _jax_environment() -> None:
    """JAX's settings for the whole run, set before any test imports JAX (through the
    environment, which JAX reads at import and subprocesses inherit):

    * the harness's persistent compilation cache (``backends.jax_cache_env``;
      ``ATTENTION_JAX_CACHE=off`` turns it off): programs compiled by an earlier run are read
      back instead of compiled (a JAX-heavy module such as test_performance_paths.py: 97 s
      cold, 19 s warm);
    * no Python traceback in the source locations of the programs it lowers
      (``JAX_TRACEBACK_IN_LOCATIONS_LIMIT=0``): the suite lowers about 7,000 small programs,
      and lowering is JAX's largest cost in it (80 s of the suite's process; 15 % less
      without the locations, which only error messages and HLO dumps read)."""
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")
        for name, value in backends.jax_cache_env().items():
            os.environ.setdefault(name, value)


_jax_environment()

# The fast paths' choices from the fixed table (attention_rules.FAST_PATHS), not measured on
# this machine: every run computes the same bits, and no test waits for a tuner
# (numpy_attn/_fast/tuning.py). ATTENTION_TUNING=alternate runs the suite under a second fixed
# choice; tests/test_tuning.py compares choices.
os.environ.setdefault("ATTENTION_TUNING", "off")


@pytest.fixture(params=BACKEND_NAMES)
def backend(request: pytest.FixtureRequest) -> backends.Backend:
    """A backend adapter (numpy, jax, torch); skipped when its framework is missing."""
    adapter = backends.get(request.param)
    if not adapter.available():
        pytest.skip(f"{request.param} not installed ({adapter.install})")
    return adapter


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261130)


@pytest.fixture
def x64_on():
    """JAX with x64 on for this test only (float64 arrays stay float64); skipped without JAX."""
    jax = pytest.importorskip("jax", reason="pip install jax")
    with jax.enable_x64(True):
        yield True


@pytest.fixture(params=[False, True], ids=["x64_off", "x64_on"])
def x64(request: pytest.FixtureRequest, x64_on: bool):
    """The test twice: JAX with x64 off (its default) and on; the value is the switch.

    Set up after ``x64_on`` (its argument), so a module that turns x64 on for every test
    (``pytestmark = pytest.mark.usefixtures("x64_on")``) still gets x64 off here."""
    import jax

    with jax.enable_x64(request.param):
        yield request.param


@pytest.fixture(params=["fast", "explicit"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """torch_attn's route: ``"fast"`` as it stands, ``"explicit"`` with the fast path switched
    off (``_fast.use_fast_path`` selects nothing). Shared by the torch autograd and fast-path
    tests; torch is imported only by a test that asks for it."""
    if request.param == "explicit":
        from torch_attn import _fast

        monkeypatch.setattr(_fast, "use_fast_path", lambda *args, **kwargs: None)
    return request.param


#: Growth of a worker's resident memory (MiB) since the last release after which a test's
#: teardown releases memory (module docstring).
RELEASE_GROWTH_MIB = 256
_AFTER_RELEASE: list[float] = []  # resident MiB after the last release (or at the first test)


def _resident_mib() -> float | None:
    """This process's resident memory in MiB (Linux ``/proc``), or None where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


@pytest.fixture
def registered() -> Iterator[Callable[..., backends.Backend]]:
    """Registers fake modules (``backends.load(name)`` finds them) and forgets them after."""
    names: list[str] = []

    def make(name: str, **attrs: object) -> backends.Backend:
        module = types.ModuleType(name)
        for key, value in attrs.items():
            setattr(module, key, value)
        names.append(name)
        return backends.register(backends.from_module(module, name=name))

    yield make
    for name in names:
        backends.unregister(name)


@pytest.fixture(autouse=True)
def _release_memory():
    """After a test: release memory when the worker grew by more than ``RELEASE_GROWTH_MIB``
    since the last release (module docstring)."""
    yield
    resident = _resident_mib()
    if resident is None:
        return
    if not _AFTER_RELEASE:
        _AFTER_RELEASE.append(resident)
    if resident - _AFTER_RELEASE[0] <= RELEASE_GROWTH_MIB:
        return
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    _AFTER_RELEASE[0] = _resident_mib() or resident
