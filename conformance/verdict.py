"""The focused report of a run that checks a module of the user's ("plugin"; ``plugins``).

``text(result)`` prints, in this order:

1. a one-line verdict that names each bug (the diagnosis of each group of failures);
2. per group of failing cells (same column, same diagnosis or, without one, the same failing
   steps): the features it involves, the cases and dtypes, the first failure explained, the
   smallest failing case ``shrink`` finds as a runnable script, and the rerun command;
3. a compact table: one row per case, one column per backend, each cell summarised over the
   dtypes (``ok 0.31``, ``FAIL f16``, ``unsupported``);
4. per checked module: the features checked, those declared unsupported, the functions it does
   not provide (once, never as failures); the bad-input and property lines;
5. the summary line (``PASS: …`` / ``FAIL: …``) of ``report.summary``.

``--verbose`` prints ``report.text`` (every cell, every failure) followed by item 4. A run
without a checked module prints ``report.text`` unchanged.
"""

from __future__ import annotations

import textwrap

from . import plugins, report, spec
from .results import NOT_CHECKED, Cell, Column, RunResult
from .shrink import reproducer, shape_text, shrink

#: At most this many groups of failures are explained; the rest are counted.
MAX_GROUPS = 6
SHORT_DTYPE = {"float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16"}
_DTYPE_ORDER = ("float32", "float64", "bfloat16", "float16")


def checked_columns(result: RunResult) -> list[Column]:
    """The columns of checked modules (``backends.from_module``)."""
    return [c for c in result.columns
            if c.backend is not None and c.backend.contract is not None]


def _short(reason: str) -> str:
    return reason.split(":")[0].split(";")[0].strip()


def _group_key(cell: Cell) -> tuple[str, str, str]:
    if cell.reasons:
        return cell.column, cell.status, cell.reasons[0]
    if cell.status == "error":
        return cell.column, "error", cell.detail.split(":")[0]
    failing = ", ".join(s.step for s in cell.steps if s.error or not s.passed)
    return cell.column, cell.status, f"no diagnosis; fails {failing}"


def groups(result: RunResult) -> dict[tuple[str, str, str], list[Cell]]:
    """Failing backend cells by (column, status, diagnosis), the largest group first."""
    out: dict[tuple[str, str, str], list[Cell]] = {}
    for cell in result.cells:
        if cell.spec_backend and cell.status in ("FAIL", "error"):
            out.setdefault(_group_key(cell), []).append(cell)
    return dict(sorted(out.items(), key=lambda kv: -len({c.case for c in kv[1]})))


def _representative(cells: list[Cell]) -> Cell:
    return min(cells, key=lambda c: ("non_finite" in c.features,
                                     _DTYPE_ORDER.index(c.dtype) if c.dtype in _DTYPE_ORDER
                                     else 9))


def _dtypes_text(cells: list[Cell], all_dtypes: list[str]) -> str:
    dtypes = [d for d in all_dtypes if any(c.dtype == d for c in cells)]
    return "every dtype" if dtypes == all_dtypes else ", ".join(dtypes)


def explain_group(result: RunResult, number: int, cells: list[Cell], reason: str) -> str:
    """One group of failures: features, cases, first failure, smallest case, rerun."""
    col = next(c for c in result.columns if c.name == cells[0].column)
    cell = _representative(cells)
    cases = list(dict.fromkeys(c.case for c in cells))
    all_dtypes = list(dict.fromkeys(d for _, d in result.rows))
    failing = [s for s in cell.steps if s.error or not s.passed]
    exp = result.expectations.get((cell.case, cell.dtype))
    small = None
    if col.backend is not None and exp is not None and failing and exp.kind == "sdpa":
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
    lines = [f"{number}. {label} · {col.name}: {len(cases)} case(s) fail "
             f"({_dtypes_text(cells, all_dtypes)}): {', '.join(cases)}"]
    if cell.reasons:
        lines += textwrap.wrap(f"why: {reason}", 96, initial_indent="   ",
                               subsequent_indent="     ")
    if cell.status == "error" and not cell.steps:
        lines.append(f"   error: {cell.detail}")
    if failing:
        first = report.explain_step(cell, failing[0]).split("\n    why:")[0]
        lines.append("   first failure: " + first.replace("\n", "\n   "))
    if small is not None and failing:
        where = f"{shape_text(small)}; {small.dtype}"
        opts = {k: v for k, v in small.data.options.items()}
        lines.append(f"   smallest failing case ({failing[0].step}; {where}"
                     + (f"; {opts}" if opts else "") + "), runnable:")
        code = reproducer(col.backend, small, failing[0].step, _short(reason))
        lines.append(textwrap.indent(code, "     "))
    lines.append(f"   rerun: {cell.rerun}")
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

    bad = by.get("FAIL", []) + by.get("error", [])
    if bad:
        tag = "FAIL" if "FAIL" in by else "error"
        others = [c for c in cells if c not in bad]
        return tag + ("" if not others else " " + ",".join(SHORT_DTYPE.get(c.dtype, c.dtype)
                                                           for c in bad))
    parts = []
    ok = by.get("ok", [])
    if ok:
        parts.append(f"ok {report.cell_text(max(ok, key=lambda c: c.ratio or 0.0))[3:]}")
    for status, short in (("unsupported", "unsup."), ("not provided", "not provided"),
                          ("n/a", "n/a")):
        if status in by:
            parts.append(short + (where(status) if ok else ""))
    if "known" in by:
        parts.append(report.cell_text(by["known"][0], 24))
    return ", ".join(parts)


def table(result: RunResult) -> str:
    """One row per case, one column per backend or peer, each cell over the run's dtypes;
    rows whose every cell is "not provided" are left out (the contract lines list them)."""
    names = [c.name for c in result.columns]
    by: dict[tuple[str, str], list[Cell]] = {}
    for cell in result.cells:
        by.setdefault((cell.case, cell.column), []).append(cell)
    cases = list(dict.fromkeys(case for case, _ in result.rows))
    shown = [case for case in cases
             if any(c.status != "not provided" for n in names for c in by.get((case, n), []))]
    label = max([len(c) for c in shown] + [4])
    widths = [max(22, len(n)) for n in names]
    head = "case".ljust(label) + "  " + "  ".join(n.ljust(w) for n, w in zip(names, widths,
                                                                             strict=True))
    lines = [head.rstrip(), "-" * len(head.rstrip())]
    for case in shown:
        texts = [_summary_cell(by.get((case, n), [])) for n in names]
        lines.append((case.ljust(label) + "  " + "  ".join(
            t.ljust(w) for t, w in zip(texts, widths, strict=True))).rstrip())
    dtypes = ", ".join(dict.fromkeys(d for _, d in result.rows))
    lines += textwrap.wrap(f"each cell over {dtypes}: ok r: r = worst error / tolerance (at "
                           f"most 1 passes); FAIL f16: fails in float16; unsup.: unsupported; "
                           f"--verbose: every cell", 100)
    return "\n".join(lines)


def contract_section(result: RunResult) -> str:
    """Per checked module: features checked, unsupported, not provided."""
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
                                    or "none"), 98, initial_indent="  ", subsequent_indent="    ")
        lines.append("  declared unsupported: " + (", ".join(
            f for f in spec.PLUGIN_FEATURES if f in contract.unsupported) or "none"))
        if raised:
            lines.append(f"  raised NotImplementedError: {len(raised)} case(s): "
                         f"{', '.join(raised)}")
        if contract.not_provided:
            what = (f"; not run: {len(steps)} step(s) ({', '.join(steps)})" if steps else "")
            what += f" and {len(skipped)} case(s) ({', '.join(skipped)})" if skipped else ""
            lines += textwrap.wrap("not provided (optional): "
                                   + ", ".join(contract.not_provided) + what, 98,
                                   initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)


def headline(result: RunResult, found: dict[tuple[str, str, str], list[Cell]]) -> str:
    """The first line: the verdict, naming each bug."""
    names = ", ".join(c.name for c in checked_columns(result))
    if result.ok:
        ran = sum(c.spec_backend and c.status not in NOT_CHECKED for c in result.cells)
        return f"PASS: {names} conforms to the spec on everything it provides ({ran} cells)"
    bugs = [f"{_short(reason)} ({len({c.case for c in cells})} case(s))"
            for (_, _, reason), cells in found.items()]
    other = [] if found else ["bad inputs or property checks (below)"]
    return f"FAIL: {names}: " + "; ".join(bugs + other)


def text(result: RunResult, verbose: bool = False) -> str:
    """The report of ``result``: focused when it checks a module, ``report.text`` otherwise."""
    if not checked_columns(result):
        return report.text(result)
    contract = contract_section(result)
    if verbose:
        full = report.text(result).rsplit("\n\n", 1)
        return "\n\n".join([full[0], contract, *result.notes, full[-1]])
    found = groups(result)
    parts = [headline(result, found)]
    for i, (key, cells) in enumerate(list(found.items())[:MAX_GROUPS], 1):
        parts.append(explain_group(result, i, cells, key[2]))
    if len(found) > MAX_GROUPS:
        parts.append(f"… and {len(found) - MAX_GROUPS} more group(s) of failures: --verbose "
                     f"shows every cell")
    if result.cells:
        parts.append(table(result))
    props = result.properties.text() if result.properties is not None else ""
    if found and props:  # the groups above explain the bug: the property failure in one line
        props = "\n".join(line for line in props.splitlines() if line.startswith("hypothesis"))
        if not result.properties.passed:
            props += "\n  (--verbose: its minimal reproducer)"
    for section in (contract, "\n".join([report.errors_section(result), *result.notes]).strip(),
                    props,
                    report.missing_section(result), report.summary(result)):
        if section:
            parts.append(section)
    return "\n\n".join(parts)


__all__ = ["MAX_GROUPS", "checked_columns", "contract_section", "explain_group", "groups",
           "headline", "table", "text"]
