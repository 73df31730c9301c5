"""The HTML report's data: one plain, JSON-ready dict built from a ``results.RunResult``.

``page_data(result)`` is everything the page shows, and the page shows nothing else: the
columns (backends and peers), cases and dtypes in the run's order, one entry per cell (status,
worst ratio, detail, rerun command, features, each step against its tolerance), the known
differences of ``spec.KNOWN_DIFFERENCES`` the cells name (with the meaning of each alternative,
``spec.KNOWN_ALTERNATIVES``), the smallest failing case of each group of failures, the
summary, the bad-input and property-check results, the missing packages and the pictures,
and the seed article's example with each step's numbers (``article.example``).

Choices the issue leaves open:

* **reproducers**: failing cells of spec/user backends are grouped as the focused terminal
  report groups them (``groups.groups``: one bug, one group) and one cell per group is shrunk
  (``shrink.shrink``, ``shrink.reproducer``), for the first ``grouping.MAX_GROUPS`` groups;
  every cell of a group shows that group's script, with the case it was shrunk from. Peers are
  context, not checked code: their cells get no reproducer, only the rerun command; nor do
  timeouts (each try could wait the whole time limit). The layout rerun of the terminal report
  (``groups.layout_symptoms``) is not repeated here, and the shrinking is redone (the terminal
  report's is not kept): ``--html`` costs what the focused report's shrinking costs once more;
* **numbers** keep 6 significant digits (4 for ratios); ``inf``, ``-inf`` and NaN, which
  JSON cannot hold, are the strings ``"inf"``, ``"-inf"`` and ``"nan"``;
* every string may come from a plugin (an error message, a module's name): the page inserts
  them as text, never as markup, and ``page.blob`` escapes ``<``, ``>`` and ``&`` in the blob.
"""

from __future__ import annotations

import math
from typing import Any

from ... import spec
from ...comparing.results import Cell, RunResult, error_text
from ...diagnosing.diagnose import short
from .. import groups as grouping
from .. import sections
from ..shrink import reproducer, shape_text, shrink
from . import article

#: The statuses in the order the page's filters and summary list them.
STATUSES = ("ok", "known", "n/a", "unsupported", "not provided", "unexpected", "FAIL", "error",
            "timeout")
#: Statuses that count as failing in the summary (a peer's ``unexpected`` included).
FAILING = ("FAIL", "error", "timeout", "unexpected")
_DTYPE_ORDER = ("float64", "float32", "bfloat16", "float16")


def number(x: Any, digits: int = 6) -> float | str | None:
    """A float for JSON: ``digits`` significant digits; ``"inf"``, ``"-inf"``, ``"nan"`` for the
    values JSON cannot hold; None stays None."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return float(f"{x:.{digits}g}")


def _step(s: Any) -> dict[str, Any]:
    """One ``compare.StepResult`` as plain data (empty fields left out)."""
    out: dict[str, Any] = {"step": s.step, "ratio": number(s.ratio, 4), "passed": bool(s.passed)}
    if s.index is not None:
        out["index"] = [int(i) for i in s.index]
    for key, value in (("actual", s.actual), ("expected", s.expected), ("bound", s.bound)):
        if value is not None:
            out[key] = number(value)
    if s.note:
        out["note"] = s.note
    if s.error:
        out["error"] = s.error
    return out


def known_entries(result: RunResult) -> dict[str, list[dict[str, Any]]]:
    """peer → its entries of ``spec.KNOWN_DIFFERENCES`` that a known or unexpected cell of the
    run names: short, differs, alternative (and its meaning), why, cases, dtypes."""
    named: dict[str, set[str]] = {}
    for cell in result.cells:
        if cell.alternatives:
            named.setdefault(cell.column, set()).update(cell.alternatives)
    out: dict[str, list[dict[str, Any]]] = {}
    for peer, shorts in named.items():
        for entry in spec.KNOWN_DIFFERENCES.get(peer, []):
            label = entry.get("short", entry["differs"])
            if label in shorts:
                out.setdefault(peer, []).append({
                    "short": label, "differs": entry["differs"], "why": entry.get("why", ""),
                    "alternative": entry["alternative"],
                    "meaning": spec.KNOWN_ALTERNATIVES.get(entry["alternative"], ""),
                    "cases": list(entry["cases"]), "dtypes": list(entry.get("dtypes", ())),
                })
    return out


def _cell(cell: Cell, index: dict[str, dict[str, int]], group: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "column": index["column"][cell.column], "case": index["case"][cell.case],
        "dtype": index["dtype"][cell.dtype], "status": cell.status,
        "ratio": number(cell.ratio, 4), "spec_backend": cell.spec_backend,
        "steps": [_step(s) for s in cell.steps],
    }
    optional = {"detail": cell.detail, "rerun": cell.rerun, "features": sorted(cell.features),
                "skipped": list(cell.skipped), "reasons": list(cell.reasons),
                "alternatives": list(cell.alternatives)}
    out.update({k: v for k, v in optional.items() if v})
    if cell.alternative_ratio is not None:
        out["distance"] = number(cell.alternative_ratio, 4)
    if group is not None:
        out["group"] = group
    return out


def _shrunk(result: RunResult, cells: list[Cell], reason: str) -> dict[str, Any]:
    """The smallest failing case of one group, as ``focused.explain_group`` finds it."""
    col = next(c for c in result.columns if c.name == cells[0].column)
    cell = min(cells, key=lambda c: ("non_finite" in c.features,
                                     _DTYPE_ORDER.index(c.dtype) if c.dtype in _DTYPE_ORDER
                                     else 9))
    out: dict[str, Any] = {"column": col.name, "reason": reason, "status": cell.status,
                           "from_case": cell.case, "from_dtype": cell.dtype,
                           "cells": len(cells), "rerun": cell.rerun, "code": ""}
    failing = [s for s in cell.steps if s.error or not s.passed]
    exp = result.expectations.get((cell.case, cell.dtype))
    if cell.status == "timeout":  # each try could wait the whole time limit
        out["note"] = "a call timed out: timeouts are not shrunk; rerun the cell"
        return out
    if col.backend is None or exp is None or not failing:
        out["note"] = "nothing to shrink: no step of the cell ran"
        return out
    if exp.kind != "sdpa":
        out["note"] = (f"case {cell.case} is a {exp.kind} case: the harness shrinks "
                       "scaled_dot_product_attention cases only; rerun the cell")
        return out
    step = failing[0].step
    try:
        small = shrink(col.backend, exp, [step], cell.status, reason if cell.reasons else "")
        code = reproducer(col.backend, small, step, short(reason))
    except Exception as exc:  # noqa: BLE001 - a plugin may break while being shrunk
        out["note"] = f"shrinking failed: {error_text(exc)}"
        return out
    out.update(step=step, dtype=small.dtype, shapes=shape_text(small), code=code,
               options={k: repr(v) for k, v in small.data.options.items()})
    return out


def reproducers(result: RunResult) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """One shrunk reproducer per group of failing backend cells (``groups.groups``, the first
    ``grouping.MAX_GROUPS``; later groups get a note instead), and ``id(cell) → group``."""
    out: list[dict[str, Any]] = []
    member: dict[int, int] = {}
    for position, ((column, status, reason), cells) in enumerate(grouping.groups(result).items()):
        if position < grouping.MAX_GROUPS:
            entry = _shrunk(result, cells, reason)
        else:
            entry = {"column": column, "reason": reason, "status": status, "cells": len(cells),
                     "from_case": cells[0].case, "from_dtype": cells[0].dtype, "code": "",
                     "rerun": cells[0].rerun,
                     "note": f"only the first {grouping.MAX_GROUPS} groups of failures are "
                             "shrunk; rerun the cell"}
        out.append(entry)
        for cell in cells:
            member[id(cell)] = len(out) - 1
    return out, member


def _counts(cells: list[Cell]) -> dict[str, int]:
    return {s: n for s in STATUSES if (n := sum(c.status == s for c in cells))}


def page_data(result: RunResult, pictures: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the page shows, as plain JSON-ready data (``pictures``: ``pictures.embed``'s
    dict, or None for a page without them)."""
    names = [c.name for c in result.columns]
    cases = list(dict.fromkeys(case for case, _ in result.rows))
    dtypes = sorted({d for _, d in result.rows}, key=lambda d: _DTYPE_ORDER.index(d)
                    if d in _DTYPE_ORDER else 9)
    index = {"column": {n: i for i, n in enumerate(names)},
             "case": {n: i for i, n in enumerate(cases)},
             "dtype": {n: i for i, n in enumerate(dtypes)}}
    for cell in result.cells:  # a cell outside ``rows`` still gets a place in the grid
        for key, value in (("column", cell.column), ("case", cell.case), ("dtype", cell.dtype)):
            index[key].setdefault(value, len(index[key]))
    groups, member = reproducers(result)
    props, errors = result.properties, result.errors
    kinds = {c.name: c.kind for c in result.columns}
    return {
        "ok": result.ok,
        "summary": sections.summary(result),
        "seconds": number(result.seconds, 3),
        "columns": [{"name": n, "kind": kinds.get(n, "backend"),
                     "counts": _counts([x for x in result.cells if x.column == n])}
                    for n in index["column"]],
        "cases": list(index["case"]), "dtypes": list(index["dtype"]),
        "statuses": list(STATUSES), "failing": list(FAILING),
        "cells": [_cell(c, index, member.get(id(c))) for c in result.cells],
        "known": known_entries(result),
        "reproducers": groups,
        "tolerances": {d: {k: number(v) for k, v in row.items()}
                       for d, row in spec.TOLERANCES.items()},
        "legend": sections.legend(),
        "errors": {"total": len(errors), "passed": sum(e.passed for e in errors),
                   "failing": [{"backend": e.backend, "case": e.case, "expected": e.expected,
                                "raised": e.raised, "message": e.message[:500],
                                "problem": e.problem, "spec_backend": e.spec_backend}
                               for e in errors if not e.passed]},
        "properties": None if props is None else {
            "summary": props.summary(),
            "backends": [{"line": b.line(), "failure": b.failure, "reproducer": b.reproducer}
                         for b in props.backends]},
        "missing": dict(result.missing),
        "notes": list(result.notes),
        "pictures": pictures or {"available": False, "note": "pictures were not drawn"},
        "article": article.example(number),
    }


__all__ = ["FAILING", "STATUSES", "known_entries", "number", "page_data", "reproducers"]
