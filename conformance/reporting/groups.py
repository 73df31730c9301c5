"""The failing cells of a run, grouped by bug: what the reports explain one group at a time.

``groups(result)``: the failing cells of the spec/user backends by (column, status, diagnosis),
the largest group first: one bug, one group. A cell may carry several diagnoses (one per failed
step, each possibly joined with others: ``diagnose.split``); it joins the group of the
diagnosis, by name (``diagnose.short``), that the most cases of its column share, so one bug
seen through different steps or extra symptoms (a NaN case) is one group. What the steps' notes
and errors say is a diagnosis too (a wrong result dtype, a keyword the module does not take:
``seams``), and an ignored keyword that a checked module's ``**kwargs`` swallows names the fix.
Cells without a diagnosis group by the error raised or the failing steps. The terminal's
focused report (``focused.focused``), the HTML page and the pytest plugin explain the first
``MAX_GROUPS``.

A wrong layout is diagnosed by rerunning: ``layout_symptoms`` reruns each failing case of a
checked module with query, key, value (and the results) transposed (``transposed``); the cells
that then pass form one group that names the fix (``set LAYOUT = "bshd"``, or removing it).
One cell per case is rerun first; when it passes, the case's other failing dtypes that failed
the same way (same error type, or the same failing steps) join it without a rerun, the others
are rerun; after ``LAYOUT_GIVE_UP`` cases that fail transposed too, with none passing, the
column is left. A rerun costs what the cell cost: the reruns stay a fraction of the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..comparing.results import Cell, Column, RunResult
from ..diagnosing import seams
from ..diagnosing.diagnose import short, split
from ..running import plugins
from ..running.backends import Backend
from ..running.guard import LocalObject
from ..running.module_worker import RemoteObject
from ..running.runner import run_cell

#: At most this many groups of failures are explained; the rest are counted.
MAX_GROUPS = 6
#: The dtypes in the order a group's representative cell and the layout's reruns take them.
DTYPE_ORDER = ("float32", "float64", "bfloat16", "float16")
#: ``layout_symptoms`` stops after this many failing cases that fail transposed too, when none
#: passed: a module with other bugs pays for at most this many reruns.
LAYOUT_GIVE_UP = 3
#: The diagnosis of a layout symptom, by the layout the module declares.
LAYOUT_REASONS = {
    "bhsd": 'wrong layout, set LAYOUT = "bshd": the module reads query, key and value as (..., '
            'seq, heads, head_dim) (flash-attention, jax.nn) without declaring it; each case of '
            'this group passes once they are handed over in that layout and the output is read '
            'back the same way. Add LAYOUT = "bshd" to the module (docs/checking.md, Layout)',
    "bshd": 'wrong layout, remove LAYOUT = "bshd": the module declares (..., seq, heads, '
            'head_dim) but reads query, key and value in the spec\'s (..., heads, seq, head_dim); '
            'each case of this group passes once they are not transposed',
}


def checked_columns(result: RunResult) -> list[Column]:
    """The columns of checked modules (``backends.from_module``)."""
    return [c for c in result.columns
            if c.backend is not None and c.backend.contract is not None]


def transposed(backend: Backend) -> Backend:
    """A checked module called in the other layout than its contract says: query, key, value
    (and grad_output) and the results of its attention functions swapped ``(..., heads, seq,
    dim)`` ↔ ``(..., seq, heads, dim)`` on top of the harness's usual view."""
    contract = backend.contract
    other = "bshd" if contract.layout == "bhsd" else "bhsd"
    view = plugins.view(backend.module, dataclasses.replace(contract, layout="bshd"))
    return dataclasses.replace(backend, _module=view, _import=None, _compiled={},
                               contract=dataclasses.replace(contract, layout=other))


def _signature(cell: Cell) -> tuple[str, ...]:
    """How a cell failed: its status and error type, or its failing steps."""
    if cell.status == "error":
        return ("error", cell.detail.split(":")[0])
    return (cell.status, *(s.step + ("!" if s.error else "") for s in cell.steps
                           if s.error or not s.passed))


def layout_symptoms(result: RunResult) -> dict[tuple[str, str, str], str]:
    """``(case, dtype, column) -> LAYOUT_REASONS[declared layout]`` for every failing sdpa cell
    of a checked module that passes when rerun transposed (``transposed``)."""
    found: dict[tuple[str, str, str], str] = {}
    for col in checked_columns(result):
        failing: dict[str, list[Cell]] = {}
        for cell in result.cells:
            exp = result.expectations.get((cell.case, cell.dtype))
            if cell.column == col.name and cell.status in ("FAIL", "error") and exp is not None \
                    and exp.kind == "sdpa":
                failing.setdefault(cell.case, []).append(cell)
        if not failing:
            continue
        other = transposed(col.backend)
        reason = LAYOUT_REASONS[col.backend.contract.layout]
        misses = 0
        try:
            for cells in failing.values():
                if misses >= LAYOUT_GIVE_UP and not found:
                    break
                passed: set[tuple[str, ...]] = set()  # the failures a rerun explained
                for cell in sorted(cells, key=lambda c: DTYPE_ORDER.index(c.dtype)
                                   if c.dtype in DTYPE_ORDER else 9):
                    if _signature(cell) not in passed:
                        exp = result.expectations[(cell.case, cell.dtype)]
                        if run_cell(other, exp, column=col.name).status != "ok":
                            misses += 0 if passed else 1
                            break  # the case's other dtypes are not tried
                        passed.add(_signature(cell))
                    found[(cell.case, cell.dtype, cell.column)] = reason
        finally:
            other.release()
    return found


def cell_diagnoses(cell: Cell, fn: Callable[..., Any] | None = None) -> list[str]:
    """The single diagnoses of a cell's failed steps, one per name, first one first: those
    of its values (``cell.reasons``), then those its steps' notes and errors carry (a wrong
    result dtype, a keyword not taken: ``seams.cell_reasons``); ``fn``, the checked module's
    ``scaled_dot_product_attention``, turns an ignored keyword its ``**kwargs`` swallows into
    the fix (``seams.swallowed``)."""
    out: dict[str, str] = {}
    for reasons in [*cell.reasons, *seams.cell_reasons(cell)]:
        for reason in split(reasons):
            reason = seams.swallowed(reason, fn)
            out.setdefault(short(reason), reason)
    return list(out.values())


def sdpa_function(col: Column | None) -> Callable[..., Any] | None:
    """A checked module's ``scaled_dot_product_attention`` (None for any other column)."""
    if col is None or col.backend is None or col.backend.contract is None:
        return None
    try:
        fn = getattr(col.backend.module, "scaled_dot_product_attention", None)
    except Exception:  # noqa: BLE001 - a module that cannot be imported has no signature
        return None
    if isinstance(fn, LocalObject):  # the guarded call: the module's own function
        return fn.target
    return None if isinstance(fn, RemoteObject) else fn  # a worker's: no signature here


def groups(result: RunResult, layout: dict[tuple[str, str, str], str] | None = None
           ) -> dict[tuple[str, str, str], list[Cell]]:
    """Failing backend cells by (column, status, diagnosis), the largest group first: one bug,
    one group. ``layout`` (``layout_symptoms``) puts its cells in one group per column."""
    layout = layout or {}
    failing = [c for c in result.cells
               if c.spec_backend and c.status in ("FAIL", "error", "timeout")]
    functions = {c.name: sdpa_function(c) for c in result.columns}
    cases: dict[tuple[str, str], set[str]] = {}  # (column, diagnosis name) -> cases
    for cell in failing:
        for reason in cell_diagnoses(cell, functions.get(cell.column)):
            cases.setdefault((cell.column, short(reason)), set()).add(cell.case)
    texts: dict[tuple[str, str], str] = {}  # the first full text of each name
    out: dict[tuple[str, str, str], list[Cell]] = {}
    for cell in failing:
        reasons = cell_diagnoses(cell, functions.get(cell.column))
        if (cell.case, cell.dtype, cell.column) in layout:
            key = (cell.column, "FAIL", layout[(cell.case, cell.dtype, cell.column)])
        elif reasons:  # the name most cases share; a tie goes to the cell's first diagnosis
            best = max(reasons, key=lambda r: len(cases[(cell.column, short(r))]))
            key = (cell.column, cell.status,
                   texts.setdefault((cell.column, short(best)), best))
        elif cell.status == "error":
            key = (cell.column, "error", cell.detail.split(":")[0])
        else:
            failed = ", ".join(s.step for s in cell.steps if s.error or not s.passed)
            key = (cell.column, cell.status, f"no diagnosis; fails {failed}")
        out.setdefault(key, []).append(cell)
    return dict(sorted(out.items(), key=lambda kv: -len({c.case for c in kv[1]})))


__all__ = ["DTYPE_ORDER", "LAYOUT_GIVE_UP", "LAYOUT_REASONS", "MAX_GROUPS", "cell_diagnoses",
           "checked_columns", "groups", "layout_symptoms", "sdpa_function", "transposed"]
