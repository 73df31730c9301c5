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
* **verdict**: a failing run's banner names each group's diagnosis (``diagnose.short`` of
  the group's reason, the reason in full, its cases and cells) and its rerun command, then the
  failing bad inputs and property checks (``verdict``), as the terminal's headline does;
* **size**: the blob holds what a reader can open, once. A repeated string (a step's name or
  note, a cell's detail: an n/a reason is shared by hundreds of cells) is a place in ``texts``;
  a step is a list of ``STEP_FIELDS``, not an object naming them; a cell's rerun command is
  left out where it is ``RERUN`` filled in (every cell of a run, but ``check``'s); a cell's
  empty fields are left out. The page's script unpacks them when it loads;
* **numbers** keep 6 significant digits (4 for ratios); ``inf``, ``-inf`` and NaN, which
  JSON cannot hold, are the strings ``"inf"``, ``"-inf"`` and ``"nan"``;
* every string may come from a plugin (an error message, a module's name): the page inserts
  them as text, never as markup, and ``page.blob`` escapes ``<``, ``>`` and ``&`` in the blob.
"""

from __future__ import annotations

import math
from typing import Any

from ... import spec
from ...comparing.results import Cell, RunResult, error_text, rerun_command
from ...diagnosing.diagnose import short
from .. import groups as grouping
from .. import sections
from ..overview import column_keys
from ..shrink import reproducer, shape_text, shrink
from . import article

#: The statuses in the order the page's filters and summary list them.
STATUSES = ("ok", "known", "n/a", "unsupported", "not provided", "unexpected", "FAIL", "error",
            "timeout")
#: Statuses that count as failing in the summary (a peer's ``unexpected`` included).
FAILING = ("FAIL", "error", "timeout", "unexpected")
#: The fields of a compared step, in the order each step's list in the blob holds them.
STEP_FIELDS = ("step", "ratio", "passed", "index", "actual", "expected", "bound", "note", "error")
#: A cell's rerun command, ``results.rerun_command`` with its parts as ``{case}``, ``{dtype}``
#: and ``{column}``: the blob holds a cell's own only where it differs (``fill``).
RERUN = rerun_command("{case}", "{dtype}", "{column}")
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


class Texts:
    """The page's repeated strings (a step's name and note, a cell's detail), each kept once, in
    the blob's ``texts``; ``index(text)`` is where."""

    def __init__(self) -> None:
        self.strings: list[str] = []
        self._where: dict[str, int] = {}

    def index(self, text: str) -> int:
        """The place of ``text`` in ``strings``, appended the first time it is met."""
        if text not in self._where:
            self._where[text] = len(self.strings)
            self.strings.append(text)
        return self._where[text]


def fill(pattern: str, case: str, dtype: str, column: str) -> str:
    """``RERUN`` (or another pattern) with ``{case}``, ``{dtype}``, ``{column}`` replaced, in that
    order, every occurrence: what the page's script does to give a cell its rerun command."""
    return pattern.replace("{case}", case).replace("{dtype}", dtype).replace("{column}", column)


def _step(s: Any, texts: Texts) -> list[Any]:
    """One ``compare.StepResult`` as a list of ``STEP_FIELDS`` (the name and note as places in
    ``texts``, passed as 1 or 0, an absent field as None), trailing absent fields left out."""
    row = [texts.index(s.step), number(s.ratio, 4), int(bool(s.passed)),
           None if s.index is None else [int(i) for i in s.index],
           *(None if v is None else number(v) for v in (s.actual, s.expected, s.bound)),
           texts.index(s.note) if s.note else None, s.error or None]
    while row[-1] is None:
        row.pop()
    return row


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


def _cell(cell: Cell, index: dict[str, dict[str, int]], group: int | None,
          texts: Texts) -> dict[str, Any]:
    """One cell: its places in the columns, cases and dtypes, its status, and only the fields
    it has (the detail a place in ``texts``; the rerun command only where it is not
    ``RERUN``'s)."""
    out: dict[str, Any] = {
        "column": index["column"][cell.column], "case": index["case"][cell.case],
        "dtype": index["dtype"][cell.dtype], "status": cell.status,
    }
    if cell.ratio is not None:
        out["ratio"] = number(cell.ratio, 4)
    if cell.spec_backend:
        out["spec_backend"] = True
    lists = {"steps": [_step(s, texts) for s in cell.steps], "features": sorted(cell.features),
             "skipped": list(cell.skipped), "reasons": list(cell.reasons),
             "alternatives": list(cell.alternatives)}
    out.update({k: v for k, v in lists.items() if v})
    if cell.detail:
        out["detail"] = texts.index(cell.detail)
    if cell.rerun != fill(RERUN, cell.case, cell.dtype, cell.column):
        out["rerun"] = cell.rerun
    if cell.alternative_ratio is not None:
        out["distance"] = number(cell.alternative_ratio, 4)
    if group is not None:
        out["group"] = group
    return out


def _named(cells: list[Cell], reason: str) -> dict[str, Any]:
    """What the verdict banner names of one group: its column, its diagnosis (the full text and
    its name, ``diagnose.short``) and how many cases and cells it holds."""
    return {"column": cells[0].column, "reason": reason, "diagnosis": short(reason),
            "cases": len({c.case for c in cells}), "cells": len(cells)}


def _shrunk(result: RunResult, cells: list[Cell], reason: str) -> dict[str, Any]:
    """The smallest failing case of one group, as ``focused.explain_group`` finds it."""
    col = next(c for c in result.columns if c.name == cells[0].column)
    cell = min(cells, key=lambda c: ("non_finite" in c.features,
                                     _DTYPE_ORDER.index(c.dtype) if c.dtype in _DTYPE_ORDER
                                     else 9))
    out: dict[str, Any] = {**_named(cells, reason), "status": cell.status,
                           "from_case": cell.case, "from_dtype": cell.dtype,
                           "rerun": cell.rerun, "code": ""}
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
    for position, ((_, status, reason), cells) in enumerate(grouping.groups(result).items()):
        if position < grouping.MAX_GROUPS:
            entry = _shrunk(result, cells, reason)
        else:
            entry = {**_named(cells, reason), "status": status,
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


def verdict(result: RunResult) -> dict[str, Any]:
    """What the verdict banner adds to the summary line besides the groups of failing cells
    (``reproducers``): the failing bad inputs by kind (``sections.bad_inputs_text``, "" when
    none fails) and the backends whose property checks fail."""
    props = result.properties
    return {"bad_inputs": sections.bad_inputs_text(result),
            "properties": [] if props is None else [b.backend for b in props.backends
                                                    if b.failure]}


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
    texts = Texts()
    cells = [_cell(c, index, member.get(id(c)), texts) for c in result.cells]
    props, errors = result.properties, result.errors
    kinds = {c.name: c.kind for c in result.columns}
    keys = column_keys(list(index["column"]))
    return {
        "ok": result.ok,
        "summary": sections.summary(result),
        "verdict": verdict(result),
        "seconds": number(result.seconds, 3),
        "columns": [{"name": n, "key": keys[n], "kind": kinds.get(n, "backend"),
                     "counts": _counts([x for x in result.cells if x.column == n])}
                    for n in index["column"]],
        "cases": list(index["case"]), "dtypes": list(index["dtype"]),
        "statuses": list(STATUSES), "failing": list(FAILING),
        "cells": cells, "texts": texts.strings, "step_fields": list(STEP_FIELDS),
        "rerun": RERUN,
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


__all__ = ["FAILING", "RERUN", "STATUSES", "STEP_FIELDS", "Texts", "fill", "known_entries",
           "number", "page_data", "reproducers", "verdict"]
