"""The terminal report: ``text(result, verbose, width)``, the one renderer of a run as text.

It prints one of three views, every line within ``width`` columns (``--width``, 100 by default)
but a runnable reproducer's code, which stays runnable (a long line is wrapped at spaces,
``textwidth.fit``; tables continue in panels, ``textwidth.panels``):

* **the page** (``page``), a run of the spec backends and peers, in this order:

  1. **summary**: one row per column (backend or peer): its key in the matrix, how many of its
     cells are ok, known, unexpected, n/a, failing (FAIL, error or timeout) and not checked
     (unsupported or not provided), and the worst ratio r of its ok cells (``R_LEGEND``);
  2. **the matrix**: one row per case, one cell per column, one glyph per dtype in the run's
     dtype order (``GLYPHS``, whose legend comes once, above it); a column's header is its key
     (``KEYS`` for the project's columns, else derived from the name, ``column_keys``), which
     the summary maps to the name;
  3. the failing cells of the spec/user backends, step by step, then the peers' unexpected
     cells (the first ``MAX_FAILURES`` of each, the others counted; ``--verbose``: all);
  4. **the known differences**, each once over every peer (``spec.KNOWN_DIFFERENCES`` grouped
     by their ``short`` name): what differs, the alternative semantics that explain it, and per
     peer the cells it explains and their worst distance to the alternative (a cell explained
     by two entries counts under both); each peer's reason (``why``) is ``--verbose``'s;
  5. the bad-input line, the property checks, the missing packages and the summary line(s),
     whose last line starts with ``PASS:`` or ``FAIL:`` (``sections.summary_lines``);

* **the full report** (``full``, ``--verbose``): every cell's text (``sections.cell_text``) in a
  table of ``case dtype`` rows (``full_table``), every failing step, each peer's known
  differences with their reasons;

* **the focused report** (``focused``) of a run that checks a module of the user's ("plugin";
  ``running.plugins``), in this order:

  1. a one-line verdict that names each bug (the diagnosis of each group of failures,
     ``groups``), the failing bad inputs by kind (``sections.bad_inputs_text``) and failing
     property checks (``headline``);
  2. per group of failing cells (the first ``groups.MAX_GROUPS``): the features it involves,
     the cases and dtypes, the first failure explained, the smallest failing case ``shrink``
     finds as a runnable script, and the rerun command (``explain_group``); a wrong layout,
     found by rerunning (``groups.layout_symptoms``), is one group that names the fix;
  3. a compact table: one row per case, one column per backend, each cell summarised over the
     dtypes (``ok 0.31``, ``FAIL f16``, ``unsupported``; ``case_table``);
  4. per checked module: the features checked, those declared unsupported, the functions it
     does not provide (once, never as failures; ``contract_section``); the bad-input and
     property lines;
  5. the summary line (``PASS: …`` / ``FAIL: …``) of ``sections.summary``.

  With ``--verbose``: the full report followed by item 4.
"""

from __future__ import annotations

import math
import re
import textwrap

from .. import spec
from ..comparing.results import NOT_CHECKED, Cell, RunResult
from ..diagnosing.diagnose import short
from ..running import plugins
from .groups import (
    DTYPE_ORDER,
    LAYOUT_REASONS,
    MAX_GROUPS,
    checked_columns,
    groups,
    layout_symptoms,
)
from .sections import (
    CELL_WIDTH,
    FAILING,
    bad_inputs_text,
    cell_text,
    errors_section,
    explain_step,
    failure_text,
    failures,
    known_section,
    legend,
    missing_section,
    properties_text,
    summary_lines,
)
from .shrink import reproducer, shape_text, shrink
from .textwidth import DEFAULT_WIDTH, fit, fit_code, fit_command, panels


def text(result: RunResult, verbose: bool = False, width: int = DEFAULT_WIDTH) -> str:
    """The report of ``result``: ``focused`` when it checks a module, else ``page``
    (``verbose``: ``full``); each line within ``width`` but runnable code."""
    if checked_columns(result):
        return focused(result, verbose, width)
    return full(result, width) if verbose else page(result, width)


# ---------------------------------------------------------------------------- the page


#: One glyph per cell status, in the legend's order (pytest's: ``.`` passes, ``F`` fails).
GLYPHS = {"ok": ".", "known": "k", "unexpected": "!", "FAIL": "F", "error": "E",
          "timeout": "T", "n/a": "-", "unsupported": "u", "not provided": "p"}
LEGEND = {"ok": "ok", "known": "known difference", "unexpected": "unexpected (a peer differs, "
          "no entry explains it)", "FAIL": "FAIL", "error": "error", "timeout": "timeout",
          "n/a": "n/a (the column cannot express the case)", "unsupported": "unsupported",
          "not provided": "not provided"}
#: What r is, once.
R_LEGEND = ("r = worst |actual - expected| / bound over a cell's steps (r <= 1 passes; bound: "
            "spec.TOLERANCES, --verbose gives the formula)")
#: The matrix's header of the project's own columns; any other column's key is derived.
KEYS = {"numpy": "np", "jax": "jax", "torch": "pt", "torch.sdpa": "sdpa", "torch.MHA": "MHA",
        "torch.MHA[sdpa]": "MHAs", "jax.nn": "jnn", "keras[numpy]": "k:np", "keras[jax]": "k:jx",
        "keras[torch]": "k:pt", "flax.nnx": "nnx", "transformers.eager": "hf:e",
        "transformers.sdpa": "hf:s", "transformers.gpt_oss": "hf:g", "torch.flex": "flex",
        "onnxruntime": "ort", "jax.nn[lengths]": "jnnL",
        "onnxruntime[nonpad]": "ortN"}
#: The failing backend cells (and unexpected peer cells) the default report explains step by
#: step; the others are counted (--verbose: all).
MAX_FAILURES = 12


def column_keys(names: list[str], size: int = 4) -> dict[str, str]:
    """A unique key of at most ``size`` characters per column name: ``KEYS``'s, else the
    name's first letters and digits (a number added where two would clash)."""
    keys: dict[str, str] = {}
    for name in names:
        key = KEYS.get(name, "")[:size] or re.sub(r"[^0-9A-Za-z]", "", name)[:size] or "col"
        n = 1
        while key in keys.values():
            n += 1
            key = key[: size - len(str(n))] + str(n)
        keys[name] = key
    return keys


def _ratio(x: float) -> str:
    """r as the report writes it: two decimals, ``1e+03`` from 100 on, ``inf``."""
    return "inf" if math.isinf(x) else f"{x:.2f}" if x < 100 else f"{x:.0e}"


def _items(items: list[str], width: int, indent: str) -> list[str]:
    """``items`` joined by ", " into lines of at most ``width`` (a comma included), never
    breaking an item that fits a line."""
    lines = [indent]
    for item in items:
        if lines[-1].strip() and len(lines[-1]) + len(item) + 3 > width:
            lines[-1] += ","
            lines.append(indent)
        lines[-1] += (", " if lines[-1].strip() else "") + item
    return [fit(line, width) for line in lines]


def _counts(cells: list[Cell]) -> dict[str, int]:
    statuses = [c.status for c in cells]
    return {"ok": statuses.count("ok"), "known": statuses.count("known"),
            "unexp.": statuses.count("unexpected"), "n/a": statuses.count("n/a"),
            "failing": sum(statuses.count(s) for s in ("FAIL", "error", "timeout")),
            "not checked": sum(statuses.count(s) for s in NOT_CHECKED)}


#: The summary's short headers, for a width the full ones do not fit.
SHORT_HEADS = {"ok": "ok", "known": "kn", "unexp.": "ux", "n/a": "na", "failing": "fl",
               "not checked": "nc", "worst r": "r"}


def column_summary(result: RunResult, width: int = DEFAULT_WIDTH) -> str:
    """One row per column: key, counts by status, the worst r of its ok cells (short headers,
    explained in a line, where the full ones do not fit ``width``)."""
    keys = column_keys([c.name for c in result.columns])
    by: dict[str, list[Cell]] = {}
    for cell in result.cells:
        by.setdefault(cell.column, []).append(cell)
    rows = {c.name: _counts(by.get(c.name, [])) for c in result.columns}
    for col in result.columns:
        ok = [c.ratio for c in by.get(col.name, []) if c.status == "ok" and c.ratio is not None]
        rows[col.name]["worst r"] = _ratio(max(ok)) if ok else "-"  # type: ignore[assignment]
    heads = ["ok", "known", "unexp.", "n/a", "failing"]
    heads += ["not checked"] if any(n["not checked"] for n in rows.values()) else []
    heads.append("worst r")
    longest = max([len(c.name) for c in result.columns] + [6])
    labels = {h: h for h in heads}
    wide = {h: max(len(h), *(len(str(n[h])) for n in rows.values())) + 1 for h in heads}
    if longest + 6 + sum(wide.values()) > width:
        labels = {h: SHORT_HEADS[h] for h in heads}
        wide = {h: max(len(labels[h]), *(len(str(n[h])) for n in rows.values())) + 1
                for h in heads}
    name_w = max(min(longest, width - 6 - sum(wide.values())), 6)
    cases = len(dict.fromkeys(case for case, _ in result.rows))
    dtypes = len(dict.fromkeys(d for _, d in result.rows))
    short = "; ".join(f"{labels[h]}: {h}" for h in heads if labels[h] != h)
    lines = [fit(f"summary: {cases} case(s) × {dtypes} dtype(s) per column; peers never decide "
                 f"the verdict; {R_LEGEND}" + (f"; {short}" if short else ""), width),
             f"{'column':<{name_w}} {'key':<5}" + "".join(f"{labels[h]:>{wide[h]}}"
                                                         for h in heads)]
    for col in result.columns:
        name = col.name if len(col.name) <= name_w else col.name[: name_w - 1] + "…"
        lines.append(f"{name:<{name_w}} {keys[col.name]:<5}"
                     + "".join(f"{rows[col.name][h]:>{wide[h]}}" for h in heads))
    return "\n".join(lines)


def matrix(result: RunResult, width: int = DEFAULT_WIDTH) -> str:
    """Cases × columns, one glyph per dtype; the legend (glyphs present only) first."""
    names = [c.name for c in result.columns]
    dtypes = list(dict.fromkeys(d for _, d in result.rows))
    cases = list(dict.fromkeys(case for case, _ in result.rows))
    grid = {(c.case, c.dtype, c.column): c.status for c in result.cells}
    keys = column_keys(names, max(len(dtypes), 4))
    present = [s for s in GLYPHS if s in grid.values()]
    legend = "  ".join(f"{GLYPHS[s]} {LEGEND[s]}" for s in present)
    lines = [fit(f"matrix: one glyph per dtype ({' '.join(dtypes)}) in each cell: {legend}",
                 width)]
    widths = [max(len(dtypes), len(keys[n])) for n in names]
    label = min(max([len(c) for c in cases] + [4]), max(width - max(widths) - 1, 8))
    for number, panel in enumerate(panels(label, widths, width)):
        if number:
            lines.append("")
        lines.append(("case".ljust(label) + " " + " ".join(
            keys[names[i]].ljust(widths[i]) for i in panel)).rstrip())
        for case in cases:
            row = [("".join(GLYPHS.get(grid.get((case, d, names[i]), ""), " ") for d in dtypes)
                    ).ljust(widths[i]) for i in panel]
            name = case if len(case) <= label else case[: label - 1] + "…"
            lines.append((name.ljust(label) + " " + " ".join(row)).rstrip())
    return "\n".join(lines)


def known_differences(result: RunResult, width: int = DEFAULT_WIDTH) -> str:
    """Each known difference the run met, once: what differs, its alternative, and per peer
    the cells it explains (``n`` cells, worst distance ``r`` to the alternative)."""
    met: dict[str, dict[str, list[Cell]]] = {}  # short -> peer -> cells
    for cell in result.cells:
        if cell.status == "known":
            for short in cell.alternatives:
                met.setdefault(short, {}).setdefault(cell.column, []).append(cell)
    if not met:
        return ""
    known = sum(c.status == "known" for c in result.cells)
    lines = [fit(f"known differences: {known} peer cells, each verified (the peer matches the "
                 f"alternative semantics its entry of spec.KNOWN_DIFFERENCES names; r: the "
                 f"worst distance to it); why each peer differs: --verbose", width)]
    for short, by_peer in sorted(met.items(), key=lambda kv: -sum(map(len, kv[1].values()))):
        entries = [e for peer in by_peer for e in spec.KNOWN_DIFFERENCES.get(peer, [])
                   if e.get("short", e["differs"]) == short]
        differs = " | ".join(dict.fromkeys(e["differs"] for e in entries))
        alternative = " | ".join(dict.fromkeys(str(e.get("alternative", "?")) for e in entries))
        lines.append(fit(f"  {short}: {differs} (alternative: {alternative})", width))
        lines += _items([f"{peer} {len(cells)} (r "
                         f"{_ratio(max(c.alternative_ratio or 0.0 for c in cells))})"
                         for peer, cells in by_peer.items()], width, "    ")
    return "\n".join(lines)


def failing_cells(result: RunResult, width: int = DEFAULT_WIDTH) -> str:
    """The spec/user backends' failing cells step by step, then the peers' unexpected cells:
    the first ``MAX_FAILURES`` of each, the others counted."""
    failing = [c for c in result.cells if c.spec_backend and c.status in FAILING]
    unexpected = [c for c in result.cells if not c.spec_backend and c.status in FAILING]
    parts = []
    for cells, what in ((failing, "failing"), (unexpected, "unexpected peer")):
        parts += [failure_text(c, width) for c in cells[:MAX_FAILURES]]
        if len(cells) > MAX_FAILURES:
            parts.append(f"… and {len(cells) - MAX_FAILURES} more {what} cell(s): --verbose")
    return "\n".join(parts)


def page(result: RunResult, width: int = DEFAULT_WIDTH) -> str:
    """The default report of ``result`` (the page: this module's docstring), every line
    within ``width`` but runnable code."""
    parts = [column_summary(result, width), matrix(result, width)] if result.cells else []
    for section in (failing_cells(result, width), known_differences(result, width),
                    fit(errors_section(result), width),
                    properties_text(result, width), missing_section(result, width),
                    summary_lines(result, width)):
        if section:
            parts.append(section)
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------- the full report


def full_table(result: RunResult, width: int | None = None) -> str:
    """Rows: case × dtype; columns: backends and peers, in panels that fit ``width`` (None:
    one panel, as wide as it takes)."""
    grid = {(c.case, c.dtype, c.column): c for c in result.cells}
    names = [c.name for c in result.columns]
    label_width = max([len(f"{c} {d}") for c, d in result.rows] + [10])
    widths = [max(CELL_WIDTH, len(n)) for n in names]
    blocks = []
    for panel in panels(label_width, widths, width):
        head = ("case".ljust(label_width) + " " + " ".join(
            names[i].ljust(widths[i]) for i in panel)).rstrip()
        lines = [head, "-" * len(head)]
        for case, dtype in result.rows:
            lines.append((f"{case} {dtype}".ljust(label_width) + " " + " ".join(
                (cell_text(grid[(case, dtype, names[i])], widths[i])
                 if (case, dtype, names[i]) in grid else "").ljust(widths[i])
                for i in panel)).rstrip())
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def full(result: RunResult, width: int | None = None) -> str:
    """The whole report, every cell and failing step (``--verbose``); ``width``: each line but
    runnable code fits it (None: as wide as it takes)."""
    parts = [full_table(result, width), legend(width or 100)] if result.cells else []
    for section in (failures(result, width=width), fit(known_section(result), width),
                    fit(errors_section(result), width), properties_text(result, width),
                    missing_section(result, width), summary_lines(result, width)):
        if section:
            parts.append(section)
    return "\n\n".join(parts)


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
    lines = [fit(f"{number}. {label} · {col.name}: {len(cases)} case(s) fail "
                 f"({_dtypes_text(cells, all_dtypes)}): {', '.join(cases)}", width)]
    if cell.reasons or wrong_layout:
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
        parts.append(fit(f"… and {len(found) - MAX_GROUPS} more group(s) of failures: --verbose "
                         f"shows every cell", width))
    if result.cells:
        parts.append(case_table(result, width))
    props = properties_text(result, width)
    if found and props:  # the groups above explain the bug: the property failure in one line
        props = "\n".join(fit(b.line(), width) for b in result.properties.backends)
        if not result.properties.passed:
            props += "\n  (--verbose: its minimal reproducer)"
    errors = "\n".join([errors_section(result), *result.notes]).strip()
    for section in (contract, fit(errors, width), props, missing_section(result, width),
                    summary_lines(result, width)):
        if section:
            parts.append(section)
    return "\n\n".join(parts)


__all__ = ["GLYPHS", "KEYS", "MAX_FAILURES", "R_LEGEND", "SHORT_DTYPE", "case_table",
           "column_keys", "column_summary", "contract_section", "explain_group", "failing_cells",
           "focused", "full", "full_table", "headline", "known_differences", "matrix", "page",
           "text"]
