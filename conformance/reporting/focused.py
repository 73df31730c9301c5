"""The terminal report's focused view (``terminal.text`` chooses it for a run that checks a
module of the user's): a verdict naming each bug, each group of failures explained with its
smallest failing case and rerun command, a compact case table and the module's contract. The
views are described in ``terminal``'s docstring.
"""

from __future__ import annotations

import textwrap

from .. import spec
from ..comparing.results import NOT_CHECKED, Cell, RunResult
from ..diagnosing.diagnose import short
from ..running import plugins
from ..words import plural
from .groups import (
    DTYPE_ORDER,
    LAYOUT_REASONS,
    MAX_GROUPS,
    cell_diagnoses,
    checked_columns,
    groups,
    layout_symptoms,
    sdpa_function,
)
from .overview import full, profile_lines
from .sections import (
    bad_inputs_text,
    cell_text,
    errors_section,
    explain_step,
    missing_section,
    properties_text,
    summary_lines,
)
from .shrink import reproducer, shape_text, shrink
from .textwidth import DEFAULT_WIDTH, fit, fit_code, fit_command, panels

# ---------------------------------------------------------------------------- the focused report


#: Each dtype's short name in the focused report's table and group titles.
SHORT_DTYPE = {"float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def _representative(cells: list[Cell]) -> Cell:
    return min(cells, key=lambda c: ("non_finite" in c.features,
                                     DTYPE_ORDER.index(c.dtype) if c.dtype in DTYPE_ORDER
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
    lines = [fit(f"{number}. {label} · {col.name}: {plural(len(cases), 'case')} "
                 f"{'fails' if len(cases) == 1 else 'fail'} "
                 f"({_dtypes_text(cells, all_dtypes)}): {', '.join(cases)}", width)]
    if reason in cell_diagnoses(cell, sdpa_function(col)) or wrong_layout:
        lines += textwrap.wrap(f"why: {reason}", width - 4, initial_indent="   ",
                               subsequent_indent="     ")
    if cell.status == "error" and not cell.steps:
        lines.append(fit(f"   error: {cell.detail}", width))
    if failing:
        first = explain_step(cell, failing[0]).split("\n    why:")[0]
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
        parts.append(f"ok {cell_text(max(ok, key=lambda c: c.ratio or 0.0))[3:]}")
    for status, tag in (("unsupported", "unsup."), ("not provided", "not provided"),
                        ("n/a", "n/a")):
        if status in by:
            parts.append(tag + (where(status) if ok else ""))
    if "known" in by:
        parts.append(cell_text(by["known"][0], 24))
    return ", ".join(parts)


def case_table(result: RunResult, width: int = DEFAULT_WIDTH) -> str:
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
            lines.append(f"  raised NotImplementedError: {plural(len(raised), 'case')}: "
                         f"{', '.join(raised)}")
        if contract.not_provided:
            what = (f"; not run: {plural(len(steps), 'step')} ({', '.join(steps)})"
                    if steps else "")
            what += (f" and {plural(len(skipped), 'case')} ({', '.join(skipped)})"
                     if skipped else "")
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
        if not ran:
            return (f"NOTHING CHECKED: {names}: no case ran (every case uses a feature it "
                    f"declares unsupported or does not provide); not a PASS")
        return (f"PASS: {names} conforms to the spec on everything it provides "
                f"({plural(ran, 'cell')})")
    bugs = [f"{short(reason)} ({plural(len({c.case for c in cells}), 'case')})"
            for (_, _, reason), cells in found.items()]
    bad_inputs = bad_inputs_text(result)
    if bad_inputs:
        bugs.append(bad_inputs)
    if result.properties is not None and not result.properties.passed:
        failed = [b.backend for b in result.properties.backends if b.failure]
        bugs.append(f"property checks fail on {', '.join(failed)} (below)")
    return f"FAIL: {names}: " + "; ".join(bugs or ["see below"])


def focused(result: RunResult, verbose: bool = False, width: int = DEFAULT_WIDTH) -> str:
    """The focused report of a run that checks a module (this module's docstring; ``verbose``:
    ``full`` and the contract lines); each line within ``width`` but runnable code."""
    contract = contract_section(result, width)
    if verbose:
        whole = full(result, width).rsplit("\n\n", 1)
        return "\n\n".join([whole[0], contract, *(fit(n, width) for n in result.notes),
                            whole[-1]])
    found = groups(result, layout_symptoms(result))
    parts = [fit(headline(result, found), width)]
    for i, (key, cells) in enumerate(list(found.items())[:MAX_GROUPS], 1):
        parts.append(explain_group(result, i, cells, key[2], width))
    if len(found) > MAX_GROUPS:
        parts.append(fit(f"… and {plural(len(found) - MAX_GROUPS, 'more group')} of "
                         f"failures: --verbose shows every cell", width))
    if result.cells:
        parts.append(case_table(result, width))
    props = properties_text(result, width)
    if found and props:  # the groups above explain the bug: the property failure in one line
        props = "\n".join(fit(b.line(), width) for b in result.properties.backends)
        if not result.properties.passed:
            props += "\n  (--verbose: its minimal reproducer)"
    errors = "\n".join([errors_section(result), *result.notes]).strip()
    tail = summary_lines(result, width)
    more = profile_lines(result, width)
    for section in (contract, fit(errors, width), props, missing_section(result, width),
                    tail + "\n" + more if more else tail):
        if section:
            parts.append(section)
    return "\n\n".join(parts)


__all__ = ["SHORT_DTYPE", "case_table", "contract_section", "explain_group", "focused",
           "headline"]
