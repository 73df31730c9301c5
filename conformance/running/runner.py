"""Running the harness: every case × dtype × column, plus the bad-input and property checks.

``run`` is what ``python -m conformance run`` does: it resolves the columns (spec backends,
user modules, peers), computes each case's ``Expected`` once per dtype, runs every column on it
(``run_cell`` for a backend, ``run_peer_cell`` for a peer), then feeds the bad inputs of
``errors`` and the property checks of ``properties`` to every backend;
everything lands in one ``RunResult`` for the report. ``golden.check`` runs the same
``run_expectations`` on expectations loaded from files. A checked module's contract
(``plugins.Contract``) decides which steps, bad inputs and property examples it gets; what it
leaves out is reported as unsupported or not provided, never as failed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import time
import types
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import peers as peers_mod
from ..cases import catalogue as cases_mod
from ..cases.expected import Expected, expected
from ..comparing.compare import StepResult, compare_step
from ..comparing.results import (
    BackendProperties,
    Cell,
    Column,
    ErrorResult,
    NotApplicable,
    PropertyResult,
    RunResult,
    error_text,
    rerun_command,
)
from ..diagnosing import alternatives
from ..diagnosing.diagnose import diagnose
from ..usage import UsageError
from . import backends as backends_mod
from . import errors as errors_mod
from . import plugins
from .backends import Backend
from .guard import PluginFault
from .module_worker import DEFAULT_TIMEOUT_S, calling, check_timeout
from .progress import Progress
from .room import Room
from .steps import STEPS, Execution, Step, steps_for


def judge(exp: Expected, step: str, actual: np.ndarray, result_dtype: str | None,
          reasons: list[str] | None = None) -> StepResult:
    """``compare`` one step's result with ``exp``; a failure gets ``diagnose``'s reasons
    (also appended to ``reasons`` when given)."""
    res = compare_step(exp, step, actual, result_dtype)
    with np.errstate(all="ignore"):
        if not res.passed:
            why = diagnose(exp, step, actual)
            if why:
                res.note = f"{res.note}; {why}" if res.note else why
                if reasons is not None and why not in reasons:
                    reasons.append(why)
    return res


def _lacks(exe: Execution, step: Step) -> list[str]:
    """What ``step`` calls (``Step.needs``) that a checked module does not define."""
    out = []
    for name in step.needs(exe):
        cls, _, method = name.partition(".")
        if not exe.backend.provides(cls) or (
                method and not hasattr(getattr(exe.module, cls), method)):
            out.append(name)
    return out


def run_cell(backend: Backend, exp: Expected, *, column: str | None = None,
             steps: Iterable[str] | None = None) -> Cell:
    """Run every applicable step of one case on one backend and compare each.

    A checked module (``backend.contract``) runs only the steps whose functions it defines
    (the others are listed in ``Cell.skipped``); a case using a feature it declares
    unsupported, or a step raising ``NotImplementedError``, makes the cell "unsupported".
    A ``PluginFault`` (a call that mutates its input, raises ``SystemExit``) fails its step,
    the fault the diagnosis; one that hangs or kills its worker ends the cell ("timeout" or
    "error", no steps, so the report never shrinks it)."""
    column = column or backend.name
    cell = Cell(exp.case, exp.dtype, column, rerun=rerun_command(exp.case, exp.dtype, column),
                features=plugins.features(exp.data.arrays, exp.data.options, exp.dtype,
                                          exp.data.finite))
    exe = Execution(backend, exp)
    chosen = steps_for(exp, steps)
    _ = backend.module  # imported: a checked module's contract is known from here on
    contract = backend.contract
    if contract is not None:
        declared = sorted(contract.unsupported & cell.features)
        if declared:
            cell.status, cell.ratio = "unsupported", None
            cell.detail = f"declared unsupported: {', '.join(declared)}"
            return cell
        chosen = [s for s in chosen if s.feature not in contract.unsupported]
        missing = {s.name: _lacks(exe, s) for s in chosen}
        cell.skipped = tuple(name for name, lacks in missing.items() if lacks)
        chosen = [s for s in chosen if not missing[s.name]]
        if not chosen:
            lacks = dict.fromkeys(n for names in missing.values() for n in names)
            cell.status, cell.ratio = "not provided", None
            cell.detail = f"not provided: {', '.join(lacks)}"
            return cell
    exe.prefetch(call for step in chosen for call in step.calls(exe))
    unsupported = ""
    for step in chosen:
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                actual = step.run(exe)
        except PluginFault as fault:
            if fault.reason not in cell.reasons:
                cell.reasons.append(fault.reason)
            if fault.fatal:
                cell.steps, cell.status, cell.ratio = [], fault.status, None
                cell.detail = fault.reason
                return cell
            cell.steps.append(StepResult(step.name, float("inf"), False, error=fault.reason))
            continue
        except NotApplicable as exc:
            cell.status, cell.detail, cell.ratio = "n/a", str(exc), None
            return cell
        except NotImplementedError as exc:
            unsupported = unsupported or f"{step.name}: {error_text(exc)}"
            continue
        except Exception as exc:  # noqa: BLE001 - any failure of a backend is a result
            cell.steps.append(StepResult(step.name, float("inf"), False, error=error_text(exc)))
            continue
        res = judge(exp, step.name, actual, step.result_dtype if exp.kind != "module" else None,
                    cell.reasons)
        cell.steps.append(res)
    cell.finish()
    if unsupported and cell.status == "ok":
        cell.status, cell.ratio, cell.detail = "unsupported", None, unsupported
    return cell


def run_peer_cell(peer: peers_mod.Peer, exp: Expected) -> Cell:
    """Run a peer on one case × dtype. A failure is "known" only when the alternative semantics
    of the entries of ``spec.KNOWN_DIFFERENCES`` that cover it reproduce what the peer returned
    (or raised), else "unexpected" (``alternatives.classify``); peers never fail the run."""
    cell = Cell(exp.case, exp.dtype, peer.name, spec_backend=False,
                rerun=rerun_command(exp.case, exp.dtype, peer.name))
    results, raised = None, None
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            results = peer.compute(exp)
    except NotApplicable as exc:
        cell.status, cell.detail, cell.ratio = "n/a", str(exc), None
        return cell
    except Exception as exc:  # noqa: BLE001 - a peer failing is a result
        raised = exc
        cell.status, cell.detail, cell.ratio = "error", error_text(exc), None
    else:
        cell.steps = [judge(exp, s, x, STEPS[s].result_dtype) for s, x in results.items()]
        cell.finish()
    if cell.status in ("FAIL", "error"):
        alternatives.classify(cell, peer.name, exp, results, raised)
    return cell


def computing_order(columns: list[Column]) -> list[Column]:
    """The backend columns in the order they are computed: those that do not compile first
    (numpy, torch, a checked module: seconds), then those that do (JAX: most of a run), each
    group in the report's order; so the first backend verdicts come while JAX still runs."""
    own = [c for c in columns if c.backend is not None]
    return sorted(own, key=lambda c: c.backend.compiles)


def run_columns(columns: list[Column], expectations: Iterable[Expected], *,
                progress: Progress | None = None,
                rerun: Callable[[str, str, str], str] = rerun_command,
                room: type[Room] = Room,
                column_done: Callable[[Column, list[Cell]], None] | None = None) -> RunResult:
    """Every expectation × column, computed in ``room`` (``running.room``: where and when each
    cell is computed; ``Room``: here, each when its turn comes): each backend column on every
    expectation in ``computing_order``, ``column_done(column, its cells)`` after each, then the
    peers, expectation by expectation. ``rerun(case, dtype, column)`` is each cell's rerun
    command. Returns a ``RunResult`` without errors or properties, its cells in the run's order
    (case by case, column by column, as ``columns``)."""
    result = RunResult(columns, [], {}, [])
    with room(columns, expectations, run_peer_cell) as cells:
        def cell(col: Column, exp: Expected) -> Cell:  # a peer's through the room
            if progress:
                progress.running(col, exp)
            with calling(f"case {exp.case} dtype {exp.dtype}"):  # named if a call hangs
                out = cells.cell(col.peer, exp) if col.kind == "peer" else run_cell(
                    col.backend, exp, column=col.name)
            out.rerun = rerun(exp.case, exp.dtype, col.name)
            if progress:
                progress.done(col)
            return out

        exps = list(cells.expectations)
        for exp in exps:
            result.rows.append((exp.case, exp.dtype))
            result.expectations[(exp.case, exp.dtype)] = exp
        for col in computing_order(columns):
            if col.backend.compiles and room.compile_threads > 1:
                done = _in_threads(cells, col, exps, cell, room.compile_threads)
            else:
                done = [cells.add(col, exp, functools.partial(cell, col, exp)) for exp in exps]
            if column_done is not None:
                column_done(col, [c for c in done if c is not None])
        for exp in exps:
            for col in columns:
                if col.backend is None:
                    cells.add(col, exp, functools.partial(cell, col, exp))
        computed = cells.ordered(cell)
    place = {(col.name, e.case, e.dtype): (i, j) for i, e in enumerate(exps)
             for j, col in enumerate(columns)}
    result.cells = sorted(computed, key=lambda c: place[(c.column, c.case, c.dtype)])
    return result


def _in_threads(room: Room, col: Column, exps: list[Expected],
                cell: Callable[[Column, Expected], Cell], threads: int) -> list[Cell | None]:
    """The cells of ``col`` on ``exps`` computed ``threads`` at a time (``room.Threads``), a
    batch of ``room.BATCH`` after another, then handed to ``room`` in the run's order (so it
    frees each batch's programs with no thread running)."""
    out: list[Cell | None] = []
    batch = getattr(room, "BATCH", 16)
    with ThreadPoolExecutor(threads) as pool:
        for start in range(0, len(exps), batch):
            chunk = exps[start: start + batch]
            ready = [f.result() for f in [pool.submit(cell, col, exp) for exp in chunk]]
            out += [room.add(col, exp, functools.partial(lambda c: c, c))
                    for exp, c in zip(chunk, ready, strict=True)]
    return out


def resolve_backends(names: list[str] | None, timeout: float = DEFAULT_TIMEOUT_S
                     ) -> tuple[list[Column], dict[str, str]]:
    """Columns for backend names, peer names or dotted module paths. With ``names`` None: every
    spec backend (numpy, jax, torch) installed, the others returned with their install hint;
    a named one that is not installed is a ``UsageError`` (one line, before any work). A
    checked module's worker imports it within ``max(timeout, 120)`` seconds (0: no limit)."""
    limit, peer_names = check_timeout(timeout), {p.name for p in peers_mod.PEERS}
    columns, missing = [], {}
    for name in names or list(backends_mod.SPEC_BACKENDS):
        if name in peer_names:
            source: Any = peers_mod.get(name)
            column = Column(source.name, "peer", peer=source)
        else:
            source = backends_mod.load(name)  # a checked module: imported here (UsageError)
            source.set_timeout(limit)
            column = Column(source.name, "backend", backend=source)
        if source.available():
            columns.append(column)
        elif names:
            raise UsageError(f"backend {name!r} is not installed; install: {source.install}")
        else:
            missing[name] = source.install
    return columns, missing


def _error_check(backend: Backend, case: errors_mod.ErrorCase) -> ErrorResult:
    """``errors.check``; a call that fails beyond raising (``PluginFault``) fails the check."""
    try:
        return errors_mod.check(backend, case)
    except PluginFault as fault:
        return ErrorResult(case.name, backend.name, case.exception, fault.raised, "", False,
                           fault.reason)


def run_errors(backend_list: list[Backend], notes: list[str]) -> list[ErrorResult]:
    """The bad inputs of ``errors`` on every backend; a checked module gets those
    of the functions it defines and the features it supports (the rest noted in ``notes``),
    a call of it that fails beyond raising failing that check (``_error_check``)."""
    out = errors_mod.run([b for b in backend_list if b.contract is None])
    for b in (b for b in backend_list if b.contract is not None):
        if "errors" in b.contract.unsupported:
            notes.append(f"bad inputs: not checked on {b.name} (declared unsupported: errors)")
            continue
        chosen = tuple(c for c in errors_mod.ERROR_CASES if b.provides(c.fn)
                       and not plugins.call_features(*c.args()) & b.contract.unsupported)
        out += [_error_check(b, c) for c in chosen]
        if len(chosen) < len(errors_mod.ERROR_CASES):
            notes.append(f"bad inputs: {len(chosen)} of {len(errors_mod.ERROR_CASES)} checked "
                         f"on {b.name} (the others call what it does not provide or support)")
    return out


def property_view(backend: Backend, notes: list[str]) -> Backend | None:
    """The backend as the property checks call it: a checked module's examples that use a
    feature it declares unsupported, or raise ``NotImplementedError``, are rejected (not
    failed); None when it cannot return the weights the properties compare. Its calls stay
    guarded: a ``PluginFault`` ends its property checks as their failure (``_properties``)."""
    _ = backend.module  # imported: a checked module's contract is known from here on
    contract = backend.contract
    if contract is None:
        return backend
    if "return_weights" in contract.unsupported:
        notes.append(f"hypothesis: not run on {backend.name} (the property checks compare the "
                     f"weights; declared unsupported: return_weights)")
        return None
    sdpa = backend.module.scaled_dot_product_attention

    def checked(query: Any, key: Any, value: Any, **kwargs: Any) -> Any:
        from hypothesis import reject

        if plugins.call_features((query, key, value), kwargs) & contract.unsupported:
            reject()
        try:
            return sdpa(query, key, value, **kwargs)
        except NotImplementedError:
            reject()

    view = types.ModuleType(backend.module.__name__)
    view.__dict__.update(vars(backend.module))
    view.scaled_dot_product_attention = checked
    return dataclasses.replace(backend, _module=view, _import=None, _compiled={})


def _properties(backend: Backend, n: int) -> BackendProperties:
    """``properties.run`` on one backend; a ``PluginFault`` (a call that hangs, mutates its
    input, raises ``SystemExit``) is the failure of its property checks."""
    from . import properties

    start = time.perf_counter()
    try:
        return properties.run([backend], n).backends[0]
    except PluginFault as fault:
        return BackendProperties(backend.name, failure=fault.reason, reproducer=(
            f"# no reproducer; rerun: python -m conformance --backend {backend.name} "
            f"--hypothesis {n}"), seconds=time.perf_counter() - start)


#: What ``run_expectations`` tells as soon as a backend column is done: the column, its cells
#: and its bad-input results (before the peers run).
BackendDone = Callable[[Column, list[Cell], list[ErrorResult]], None]


def run_expectations(columns: list[Column], expectations: Iterable[Expected],
                     missing: dict[str, str], *, total: int = 0, check_errors: bool = False,
                     hypothesis: int = 0, progress: bool | None = None,
                     rerun: Callable[[str, str, str], str] = rerun_command,
                     timeout: float = DEFAULT_TIMEOUT_S, room: type[Room] = Room,
                     backend_done: BackendDone | None = None) -> RunResult:
    """The cells of every expectation × column, with the bad-input checks (``check_errors``)
    of each backend column right after its cells (``backend_done`` then hears of it, before
    the peers run), then ``hypothesis`` property examples per backend column, in one
    ``RunResult``. A checked module run in a worker process gets ``timeout`` seconds per call
    (0: no limit; negative: ``UsageError``), in the cells, the bad-input and the property
    checks and the verdict's shrinking alike. ``room``: see ``run_columns``."""
    limit = check_timeout(timeout)
    for col in columns:
        if col.backend is not None:
            col.backend.set_timeout(limit)
    start = time.perf_counter()
    bar = Progress(columns, total, progress, room.elsewhere)
    notes: list[str] = []
    errors: dict[str, list[ErrorResult]] = {}

    def column_done(col: Column, cells: list[Cell]) -> None:
        errors[col.name] = run_errors([col.backend], notes) if check_errors else []
        if backend_done is not None:
            bar.clear()
            backend_done(col, cells, errors[col.name])

    try:
        result = run_columns(columns, expectations, progress=bar, rerun=rerun, room=room,
                             column_done=column_done)
    finally:
        bar.close()
    result.missing.update(missing)
    result.notes += notes
    backend_list = [c.backend for c in columns if c.backend is not None]
    if check_errors:  # in errors.run's order: case by case, backend by backend
        names = [e.name for e in errors_mod.ERROR_CASES]
        order = [c.name for c in columns]
        result.errors = sorted((e for found in errors.values() for e in found),
                               key=lambda e: (names.index(e.case), order.index(e.backend)))
    if hypothesis and backend_list:
        if importlib.util.find_spec("hypothesis") is None:
            result.missing["hypothesis"] = "pip install hypothesis (for the property checks)"
        else:
            checked = [property_view(b, result.notes) for b in backend_list]
            checked = [b for b in checked if b is not None]
            if checked:
                result.properties = PropertyResult(
                    hypothesis, [_properties(b, hypothesis) for b in checked])
    result.seconds = time.perf_counter() - start
    return result


def run(
    backend_names: list[str] | None = None,
    case_patterns: list[str] | None = None,
    dtypes: list[str] | None = None,
    *,
    profile: str = "quick",
    peers: bool | None = None,
    check_errors: bool = True,
    hypothesis: int | None = None,
    progress: bool | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    room: type[Room] = Room,
    backend_done: BackendDone | None = None,
) -> RunResult:
    """The whole conformance run, as ``python -m conformance run`` does it.

    ``profile`` (``spec.PROFILES``, ``running.profiles``): ``"quick"`` (the default) or
    ``"full"``; it decides the rows when neither ``case_patterns`` nor ``dtypes`` is given
    (else: the matching cases of the whole catalogue, in the given dtypes or all four), the
    peer columns, and the property examples when ``hypothesis`` is None (0 when cases or dtypes
    are selected). ``peers`` None: the profile's peers run when no backend is named.
    ``timeout``: seconds per call of a checked module given by its path (0: no limit; a
    negative value is a ``UsageError`` before any work). ``room``: where the cells are computed
    (``running.room``; the command line's full run: ``room.Ahead``), see ``run_columns``;
    ``backend_done``: see ``run_expectations``.
    """
    from . import profiles

    chosen = profiles.get(profile)
    columns, missing = resolve_backends(backend_names, timeout)  # timeout checked first
    if peers is None:
        peers = backend_names is None
    if peers:
        for peer in peers_mod.PEERS:
            if chosen.peers is not None and peer.name not in chosen.peers:
                continue
            if peer.available():
                columns.append(Column(peer.name, "peer", peer=peer))
            else:
                missing[peer.name] = peer.install
    selecting = bool(case_patterns or dtypes)
    lacks = [c.backend.contract.unsupported if c.backend.contract is not None else frozenset()
             for c in columns if c.backend is not None and c.backend.module is not None]
    rows, hypothesis = profiles.choose(chosen, case_patterns, dtypes, hypothesis, lacks)
    expectations = (expected(cases_mod.get(case), dtype) for case, dtype in rows)
    result = run_expectations(columns, expectations, missing, total=len(rows),
                              check_errors=check_errors, hypothesis=hypothesis,
                              progress=progress, timeout=timeout, room=room,
                              backend_done=backend_done)
    result.profile = "" if selecting else profile
    return result


__all__ = ["DEFAULT_TIMEOUT_S", "BackendDone", "check_timeout", "computing_order", "judge",
           "property_view", "resolve_backends", "run", "run_cell", "run_columns", "run_errors",
           "run_expectations", "run_peer_cell"]
