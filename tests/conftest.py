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
import time
from collections.abc import Callable

import background_column
import background_lane
import background_modules
import numpy as np
import pytest

from conformance import backends

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
#: releases memory again, and after which the end of a test module does (each release drops
#: programs that later tests lower again: with 512 for a module the run took 301 s against
#: 313 s with 256, one run each on 2 quiet cores, but its process tree peaked at 2.24 to 2.39
#: GiB of proportional memory against 2.10, too near the suite's 2.5 GB).
RELEASE_GROWTH_MIB = 768
RELEASE_MODULE_GROWTH_MIB = 256
#: Resident MiB above which a test's teardown also releases memory when the process tree
#: (the lane's jobs, the peers' workers) is over ``background_lane.BUDGET_MIB``: the process
#: holds about 900 MiB after a release (every framework imported). A release costs about a
#: second and the programs it drops are lowered again when needed, so it is not done blindly.
RELEASE_ABOVE_MIB = 1000
_FLOOR: dict[str, float] = {}  # resident MiB after the last release
_TREE_CHECKED = [-1.0]  # when _tree_over_budget last read the process tree


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
    release, or passed ``RELEASE_ABOVE_MIB`` while the whole process tree holds more than the
    lane's budget (and it grew by more than 128 MiB: a release that frees nothing is not
    repeated after every test). Reading ``/proc``: microseconds."""
    rss = backends.resident_mib()
    if rss is None:
        return
    grown = rss - _FLOOR.setdefault("mib", rss)
    if grown > limit_mib or rss > RELEASE_ABOVE_MIB and grown > 128 and _tree_over_budget():
        release_memory()


def _tree_over_budget() -> bool:
    """Whether this process and its children (the lane's jobs among them) hold more than the
    lane's ``BUDGET_MIB``; read at most once a second (``/proc`` of every process: ms)."""
    now = time.monotonic()
    if now - _TREE_CHECKED[0] < 1.0:
        return False
    _TREE_CHECKED[0] = now
    tree = background_lane.tree_mib()
    return tree is not None and tree > background_lane.BUDGET_MIB


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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Plan the background lane (``background_lane``) for the selected tests (after ``-k`` and
    ``-m``): the jobs of the tests marked ``background``, the grid's JAX column
    (``background_column``) when JAX grid cells are collected, and the second pytest process
    of the JAX test modules (``background_modules``), after moving the modules of the tests
    that read jobs to the end of the run, and the second process's stand-ins after them; not
    in a pytest-xdist worker (each would run its own) nor in the second process itself."""
    if hasattr(config, "workerinput") or os.environ.get(background_modules.ENV):
        return
    items[:], stand_ins = background_modules.plan(items)
    jobs: dict[str, tuple[str, Callable[[], object], float]] = {}
    pairs = {(item.callspec.params["case"], item.callspec.params["dtype"]) for item in items
             if getattr(item, "originalname", "") == "test_backend_conforms"
             and item.callspec.params.get("backend") == "jax"}
    if importlib.util.find_spec("jax") is None:
        pairs = set()

    def reads(item: pytest.Item) -> bool:
        return item.get_closest_marker("background") is not None or (
            bool(pairs) and getattr(item, "originalname", "") == "test_backend_conforms")

    def module(item: pytest.Item) -> object:  # the plugin's cell items have none
        return getattr(item, "module", None)

    readers = {module(item) for item in items if reads(item)}
    items[:] = ([item for item in items if module(item) not in readers]
                + [item for item in items if module(item) in readers])
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
    if stand_ins:
        jobs[background_modules.JOB] = (background_modules.JOB, background_modules.SECOND.run,
                                        background_modules.MIB)
    items += stand_ins
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
