"""Shared fixtures: every behavioural test runs on each backend that is installed.

CI installs all three frameworks, so nothing is skipped there; a NumPy-only machine runs the
NumPy backend and skips the others with the command that installs them.

JAX's float64 switch (``jax_enable_x64``) is never turned on for the whole run by a test file:
a test that needs float64 in JAX asks for ``x64_on`` (x64 on for that test only, with
``jax.enable_x64``), and a JAX check whose result could depend on the switch asks for ``x64``
and runs twice, with x64 off (JAX's default, what users get) and on. (The harness's JAX
adapter, ``conformance.backends.jax_prepare``, turns x64 on for the process when a test first
uses the ``jax`` backend; ``jax.enable_x64(False)`` still turns it off inside a test.)

Memory: JAX keeps every program it compiles (about 1.5 MB each on the CPU; a module of JAX tests
compiles hundreds), so ``release_memory`` drops them (``jax.clear_caches``) with torch.compile's
caches and unreachable objects, and hands freed memory back to the system (about a second):
after a test module that left the process ``RELEASE_MODULE_GROWTH_MIB`` above what it held
after the last release, and after any test that left it ``RELEASE_GROWTH_MIB`` above. The
whole run's peak is then about the largest module's, not the sum of every module's (a later
test that needs a dropped program compiles it again, or reads it from JAX's persistent cache
where the harness turned that on).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import importlib.util
import os
import sys
from collections.abc import Callable

import background_column
import background_lane
import numpy as np
import pytest

from conformance import backends

BACKEND_NAMES = backends.SPEC_BACKENDS


def _persistent_jax_cache() -> None:
    """JAX's persistent compilation cache for the whole run, set before any test imports JAX
    (through the environment, which JAX reads at import and subprocesses inherit): the
    harness's (``backends.jax_cache_env``; ``ATTENTION_JAX_CACHE=off`` turns it off).
    Programs compiled by an earlier run are read back instead of compiled (a JAX-heavy module
    such as test_performance_paths.py: 97 s cold, 19 s warm)."""
    if "jax" not in sys.modules:
        for name, value in backends.jax_cache_env().items():
            os.environ.setdefault(name, value)


_persistent_jax_cache()


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


#: Growth of resident memory (MiB) since the last release after which a test's teardown
#: releases memory again, and after which the end of a test module does.
RELEASE_GROWTH_MIB = 768
RELEASE_MODULE_GROWTH_MIB = 256
_FLOOR: dict[str, float] = {}  # resident MiB after the last release


def release_memory() -> None:
    """Drop JAX's compiled programs and torch.compile's caches (where those frameworks are
    imported), collect garbage, and hand freed memory back to the system (glibc)."""
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
    rss = backends.resident_mib()
    if rss is not None:
        _FLOOR["mib"] = rss


def _release_if_grown(limit_mib: float) -> None:
    """``release_memory`` when resident memory grew by more than ``limit_mib`` since the last
    release (reading ``/proc``: microseconds)."""
    rss = backends.resident_mib()
    if rss is not None and rss - _FLOOR.setdefault("mib", rss) > limit_mib:
        release_memory()


def end_peer_workers() -> None:
    """End the peers' worker processes a test module started (the Keras workers, one per Keras
    backend, about 0.5 GB each, and the background peer worker): a later module that needs them
    starts new ones, in the background, instead of the run holding them all to its end."""
    for name in ("conformance.peers.keras_ops", "conformance.peers.background"):
        module = sys.modules.get(name)
        if module is not None:
            module.close_workers()


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_a_module():
    """At the end of a test module: end the peers' workers and release what it grew by more
    than ``RELEASE_MODULE_GROWTH_MIB`` (its programs are not needed again)."""
    yield
    end_peer_workers()
    _release_if_grown(RELEASE_MODULE_GROWTH_MIB)


@pytest.fixture(autouse=True)
def _release_memory_after_a_test():
    """After a test: release once the process grew by more than ``RELEASE_GROWTH_MIB``."""
    yield
    _release_if_grown(RELEASE_GROWTH_MIB)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Plan the background lane (``background_lane``): the jobs of the collected tests marked
    ``background``, and the grid's JAX column (``background_column``) when JAX grid cells are
    collected, after moving the modules of the tests that read them to the end of the run; not
    in a pytest-xdist worker (each would run its own)."""
    if hasattr(config, "workerinput"):
        return
    jobs: dict[str, tuple[str, Callable[[], object], float]] = {}
    pairs = {(item.callspec.params["case"], item.callspec.params["dtype"]) for item in items
             if getattr(item, "originalname", "") == "test_backend_conforms"
             and item.callspec.params.get("backend") == "jax"}
    if importlib.util.find_spec("jax") is None:
        pairs = set()

    def reads(item: pytest.Item) -> bool:
        return item.get_closest_marker("background") is not None or (
            bool(pairs) and getattr(item, "originalname", "") == "test_backend_conforms")

    readers = {getattr(item, "module", None) for item in items if reads(item)}
    items[:] = ([item for item in items if getattr(item, "module", None) not in readers]
                + [item for item in items if getattr(item, "module", None) in readers])
    for item in items:
        for mark in item.iter_markers("background"):
            name = mark.args[0]
            jobs.setdefault(name, (name, item.module.BACKGROUND[name],
                                   mark.kwargs.get("mib", background_lane.DEFAULT_MIB)))
        if pairs and getattr(item, "originalname", "") == "test_backend_conforms":
            run = functools.partial(background_column.GRID.run, pairs)
            jobs.setdefault(background_column.JOB,
                            (background_column.JOB, run, background_lane.DEFAULT_MIB))
    if pairs:
        background_column.GRID.plan()
    background_lane.LANE.start(list(jobs.values()))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The background lane's jobs: each one's time and how long its tests waited for it."""
    summary = background_lane.LANE.summary()
    if summary:
        terminalreporter.write_sep("-", "background lane")
        terminalreporter.write_line(summary)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    background_lane.LANE.stop()
    background_column.GRID.stop()
