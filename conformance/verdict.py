"""The focused report of a run that checks a module of the user's ("plugin"; ``plugins``).

``text(result)`` prints, in this order:

1. a one-line verdict that names each bug (the diagnosis of each group of failures), the
   failing bad inputs by kind (``report.bad_inputs_text``) and failing property checks;
2. per group of failing cells (``groups``: one bug, one group): the features it involves, the
   cases and dtypes, the first failure explained, the smallest failing case ``shrink`` finds as
   a runnable script, and the rerun command;
3. a compact table: one row per case, one column per backend, each cell summarised over the
   dtypes (``ok 0.31``, ``FAIL f16``, ``unsupported``);
4. per checked module: the features checked, those declared unsupported, the functions it does
   not provide (once, never as failures); the bad-input and property lines;
5. the summary line (``PASS: …`` / ``FAIL: …``) of ``report.summary``.

Grouping: a cell may carry several diagnoses (one per failed step, each possibly joined with
others: ``diagnose.split``); it joins the group of the diagnosis, by name (``diagnose.short``),
that the most cases of its column share, so one bug seen through different steps or extra
symptoms (a NaN case) is one group. Cells without a diagnosis group by the error raised or the
failing steps.

A wrong layout is diagnosed by rerunning: ``layout_symptoms`` reruns each failing case of a
checked module with query, key, value (and the results) transposed (``transposed``); the cells
that then pass form one group that names the fix (``set LAYOUT = "bshd"``, or removing it).
One cell per case is rerun first; when it passes, the case's other failing dtypes that failed
the same way (same error type, or the same failing steps) join it without a rerun, the others
are rerun; after ``LAYOUT_GIVE_UP`` cases that fail transposed too, with none passing, the
column is left. A rerun costs what the cell cost: the reruns stay a fraction of the run.

``--verbose`` prints ``report.text`` (every cell, every failure) followed by item 4. A run
without a checked module prints ``terminal.text`` (``--verbose``: ``report.text``). Every line
fits ``width`` (``--width``; 100 by default), but a runnable reproducer's code: a long line is
wrapped at spaces (``textwidth.fit``), the table's columns continue in panels.
"""

from __future__ import annotations

import dataclasses
import textwrap

from . import plugins, report, spec, terminal
from .backends import Backend
from .diagnose import short, split
from .results import NOT_CHECKED, Cell, Column, RunResult
from .runner import run_cell
from .shrink import reproducer, shape_text, shrink
from .textwidth import DEFAULT_WIDTH, fit, fit_code, fit_command, panels

#: At most this many groups of failures are explained; the rest are counted.
MAX_GROUPS = 6
SHORT_DTYPE = {"float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16"}
_DTYPE_ORDER = ("float32", "float64", "bfloat16", "float16")
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
                for cell in sorted(cells, key=lambda c: _DTYPE_ORDER.index(c.dtype)
                                   if c.dtype in _DTYPE_ORDER else 9):
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


def _diagnoses(cell: Cell) -> list[str]:
    """The single diagnoses of a cell's failed steps, one per name, first one first."""
    out: dict[str, str] = {}
    for reasons in cell.reasons:
        for reason in split(reasons):
            out.setdefault(short(reason), reason)
    return list(out.values())


def groups(result: RunResult, layout: dict[tuple[str, str, str], str] | None = None
           ) -> dict[tuple[str, str, str], list[Cell]]:
    """Failing backend cells by (column, status, diagnosis), the largest group first: one bug,
    one group. ``layout`` (``layout_symptoms``) puts its cells in one group per column."""
    layout = layout or {}
    failing = [c for c in result.cells
               if c.spec_backend and c.status in ("FAIL", "error", "timeout")]
    cases: dict[tuple[str, str], set[str]] = {}  # (column, diagnosis name) -> cases
    for cell in failing:
        for reason in _diagnoses(cell):
            cases.setdefault((cell.column, short(reason)), set()).add(cell.case)
    texts: dict[tuple[str, str], str] = {}  # the first full text of each name
    out: dict[tuple[str, str, str], list[Cell]] = {}
    for cell in failing:
        reasons = _diagnoses(cell)
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


def _representative(cells: list[Cell]) -> Cell:
    return min(cells, key=lambda c: ("non_finite" in c.features,
                                     _DTYPE_ORDER.index(c.dtype) if c.dtype in _DTYPE_ORDER
                                     else 9))


def _dtypes_text(cells: list[Cell], all_dtypes: list[str]) -> str:
    dtypes = [d for d in all_dtypes if any(c.dtype == d for c in cells)]
    return "every dtype" if dtypes == all_dtypes else ", ".join(dtypes)


def explain_group(result: RunResult, number: int, cells: list[Cell], reason: str,
                  width: int = DEFAULT_WIDTH) -> str:
    """One group of failures: features, cases, first failure, smallest case, rerun; each line
    within ``width`` but the smallest case's code."""
    col = next(c for c in result.columns if c.name == cells[0].column)
    cell = _representative(cells)
    cases = list(dict.fromkeys(c.case for c in cells))
    all_dtypes = list(dict.fromkeys(d for _, d in result.rows))
    failing = [s for s in cell.steps if s.error or not s.passed]
    exp = result.expectations.get((cell.case, cell.dtype))
    small = None
    wrong_layout = reason in LAYOUT_REASONS.values()
    if col.backend is not None and exp is not None and failing and exp.kind == "sdpa" \
            and not wrong_layout:
        small = shrink(col.backend, exp, [failing[0].step], cell.status,
                       reason if cell.reasons else "")
    dtypes = set(SHORT_DTYPE)
    if small is not None:
        used = plugins.features(small.data.arrays, small.data.options, small.dtype,
                                small.data.finite) - dtypes
    else:
        used = cell.features - dtypes
    if {c.dtype for c in cells} != set(all_dtypes) and small is not None \
            and small.dtype == cell.dtype:
        used |= {cell.dtype}
    label = ", ".join(f for f in spec.PLUGIN_FEATURES if f in used) or "every input"
    label = "layout" if wrong_layout else label
    lines = [fit(f"{number}. {label} · {col.name}: {len(cases)} case(s) fail "
                 f"({_dtypes_text(cells, all_dtypes)}): {', '.join(cases)}", width)]
    if cell.reasons or wrong_layout:
        lines += textwrap.wrap(f"why: {reason}", width - 4, initial_indent="   ",
                               subsequent_indent="     ")
    if cell.status == "error" and not cell.steps:
        lines.append(fit(f"   error: {cell.detail}", width))
    if failing:
        first = report.explain_step(cell, failing[0]).split("\n    why:")[0]
        lines.append(fit("   first failure: " + first.replace("\n", "\n   "), width))
    if small is not None and failing:
        where = f"{shape_text(small)}; {small.dtype}"
        opts = {k: v for k, v in small.data.options.items()}
        lines.append(fit(f"   smallest failing case ({failing[0].step}; {where}"
                         + (f"; {opts}" if opts else "") + "), runnable:", width))
        code = reproducer(col.backend, small, failing[0].step, short(reason))
        lines.append(textwrap.indent(fit_code(code, width - 5), "     "))
    lines.append(fit_command(f"   rerun: {cell.rerun}", width))
    return "\n".join(lines)


def _summary_cell(cells: list[Cell]) -> str:
    """One table cell summarising a case's dtypes."""
    if not cells:
        return ""
    by = {s: [c for c in cells if c.status == s] for s in {c.status for c in cells}}

    def where(status: str) -> str:
        got = by.get(status, [])
        return "" if len(got) == len(cells) else " " + ",".join(SHORT_DTYPE.get(c.dtype, c.dtype)
                                                                for c in got)

    bad = by.get("FAIL", []) + by.get("error", []) + by.get("timeout", [])
    if bad:
        tag = next(s for s in ("FAIL", "error", "timeout") if s in by)
        others = [c for c in cells if c not in bad]
        return tag + ("" if not others else " " + ",".join(SHORT_DTYPE.get(c.dtype, c.dtype)
                                                           for c in bad))
    parts = []
    ok = by.get("ok", [])
    if ok:
        parts.append(f"ok {report.cell_text(max(ok, key=lambda c: c.ratio or 0.0))[3:]}")
    for status, tag in (("unsupported", "unsup."), ("not provided", "not provided"),
                        ("n/a", "n/a")):
        if status in by:
            parts.append(tag + (where(status) if ok else ""))
    if "known" in by:
        parts.append(report.cell_text(by["known"][0], 24))
    return ", ".join(parts)


def table(result: RunResult, width: int = DEFAULT_WIDTH) -> str:
    """One row per case, one column per backend or peer, each cell over the run's dtypes;
    rows whose every cell is "not provided" are left out (the contract lines list them); the
    columns that do not fit ``width`` continue in another panel."""
    names = [c.name for c in result.columns]
    by: dict[tuple[str, str], list[Cell]] = {}
    for cell in result.cells:
        by.setdefault((cell.case, cell.column), []).append(cell)
    cases = list(dict.fromkeys(case for case, _ in result.rows))
    shown = [case for case in cases
             if any(c.status != "not provided" for n in names for c in by.get((case, n), []))]
    label = min(max([len(c) for c in shown] + [4]), max(width - 24, 8))
    widths = [min(max(22, len(n)), width - label - 2) for n in names]
    lines: list[str] = []
    for panel in panels(label, widths, width, gap=2):
        head = ("case".ljust(label) + "  " + "  ".join(
            names[i][:widths[i]].ljust(widths[i]) for i in panel)).rstrip()
        lines += ([""] if lines else []) + [head, "-" * len(head)]
        for case in shown:
            texts = [_summary_cell(by.get((case, names[i]), []))[:widths[i]] for i in panel]
            lines.append((case[:label].ljust(label) + "  " + "  ".join(
                t.ljust(widths[i]) for t, i in zip(texts, panel, strict=True))).rstrip())
    dtypes = ", ".join(dict.fromkeys(d for _, d in result.rows))
    lines += textwrap.wrap(f"each cell over {dtypes}: ok r: r = worst error / tolerance (at "
                           f"most 1 passes); FAIL f16: fails in float16; unsup.: unsupported; "
                           f"--verbose: every cell", width)
    return "\n".join(lines)


def contract_section(result: RunResult, width: int = DEFAULT_WIDTH) -> str:
    """Per checked module: features checked, unsupported, not provided (lines within
    ``width``)."""
    lines = []
    for col in checked_columns(result):
        contract = col.backend.contract
        cells = [c for c in result.cells if c.column == col.name]
        ran = [c for c in cells if c.status not in NOT_CHECKED]
        checked = set().union(*(c.features for c in ran)) if ran else set()
        if any(s.step == "output_weights" for c in ran for s in c.steps):
            checked.add("return_weights")
        if any(e.backend == col.name for e in result.errors):
            checked.add("errors")
        raised = sorted({c.case for c in cells if c.status == "unsupported"
                         and not c.detail.startswith("declared")})
        skipped = sorted({c.case for c in cells if c.status == "not provided"})
        steps = list(dict.fromkeys(s for c in ran for s in c.skipped))
        lines.append(f"{col.name} (layout {contract.layout}):")
        lines += textwrap.wrap(
            "features checked: " + (", ".join(f for f in spec.PLUGIN_FEATURES if f in checked)
                                    or "none"), width - 2, initial_indent="  ",
            subsequent_indent="    ")
        lines.append("  declared unsupported: " + (", ".join(
            f for f in spec.PLUGIN_FEATURES if f in contract.unsupported) or "none"))
        if raised:
            lines.append(f"  raised NotImplementedError: {len(raised)} case(s): "
                         f"{', '.join(raised)}")
        if contract.not_provided:
            what = (f"; not run: {len(steps)} step(s) ({', '.join(steps)})" if steps else "")
            what += f" and {len(skipped)} case(s) ({', '.join(skipped)})" if skipped else ""
            lines += textwrap.wrap("not provided (optional): "
                                   + ", ".join(contract.not_provided) + what, width - 2,
                                   initial_indent="  ", subsequent_indent="    ")
    return fit("\n".join(lines), width)


def headline(result: RunResult, found: dict[tuple[str, str, str], list[Cell]]) -> str:
    """The first line: the verdict, naming each bug, the failing bad inputs by kind and the
    failing property checks."""
    names = ", ".join(c.name for c in checked_columns(result))
    if result.ok:
        ran = sum(c.spec_backend and c.status not in NOT_CHECKED for c in result.cells)
        return f"PASS: {names} conforms to the spec on everything it provides ({ran} cells)"
    bugs = [f"{short(reason)} ({len({c.case for c in cells})} case(s))"
            for (_, _, reason), cells in found.items()]
    bad_inputs = report.bad_inputs_text(result)
    if bad_inputs:
        bugs.append(bad_inputs)
    if result.properties is not None and not result.properties.passed:
        failed = [b.backend for b in result.properties.backends if b.failure]
        bugs.append(f"property checks fail on {', '.join(failed)} (below)")
    return f"FAIL: {names}: " + "; ".join(bugs or ["see below"])


def text(result: RunResult, verbose: bool = False, width: int = DEFAULT_WIDTH) -> str:
    """The report of ``result``: focused when it checks a module, ``terminal.text`` otherwise
    (``verbose``: ``report.text``); each line within ``width`` but runnable code."""
    if not checked_columns(result):
        return report.text(result, width) if verbose else terminal.text(result, width)
    contract = contract_section(result, width)
    if verbose:
        full = report.text(result, width).rsplit("\n\n", 1)
        return "\n\n".join([full[0], contract, *(fit(n, width) for n in result.notes), full[-1]])
    found = groups(result, layout_symptoms(result))
    parts = [fit(headline(result, found), width)]
    for i, (key, cells) in enumerate(list(found.items())[:MAX_GROUPS], 1):
        parts.append(explain_group(result, i, cells, key[2], width))
    if len(found) > MAX_GROUPS:
        parts.append(fit(f"… and {len(found) - MAX_GROUPS} more group(s) of failures: --verbose "
                         f"shows every cell", width))
    if result.cells:
        parts.append(table(result, width))
    props = report.properties_text(result, width)
    if found and props:  # the groups above explain the bug: the property failure in one line
        props = "\n".join(fit(b.line(), width) for b in result.properties.backends)
        if not result.properties.passed:
            props += "\n  (--verbose: its minimal reproducer)"
    errors = "\n".join([report.errors_section(result), *result.notes]).strip()
    for section in (contract, fit(errors, width), props, report.missing_section(result, width),
                    report.summary_lines(result, width)):
        if section:
            parts.append(section)
    return "\n\n".join(parts)


__all__ = ["LAYOUT_GIVE_UP", "LAYOUT_REASONS", "MAX_GROUPS", "checked_columns", "contract_section",
           "explain_group", "groups", "headline", "layout_symptoms", "table", "text",
           "transposed"]
