"""The terminal report's page and full report (``terminal.text`` chooses): the summary, the
matrix, the failing cells and the known differences of a run of the spec backends and peers;
``full`` (``--verbose``) every cell. The views are described in ``terminal``'s docstring.
"""

from __future__ import annotations

import math
import re

from .. import spec
from ..comparing.results import NOT_CHECKED, Cell, Column, ErrorResult, RunResult
from ..words import plural
from .sections import (
    CELL_WIDTH,
    FAILING,
    cell_text,
    errors_section,
    failure_text,
    failures,
    known_section,
    legend,
    missing_section,
    properties_text,
    summary_lines,
)
from .textwidth import DEFAULT_WIDTH, fit, panels

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
    rows_text = (f"{plural(cases, 'case')} × {plural(dtypes, 'dtype')}" if _grid(result.rows)
                 else f"{plural(len(result.rows), 'row')} (case × dtype)")
    short = "; ".join(f"{labels[h]}: {h}" for h in heads if labels[h] != h)
    lines = [fit(f"summary: {rows_text} per column; peers never decide "
                 f"the verdict; {R_LEGEND}" + (f"; {short}" if short else ""), width),
             f"{'column':<{name_w}} {'key':<5}" + "".join(f"{labels[h]:>{wide[h]}}"
                                                         for h in heads)]
    for col in result.columns:
        name = col.name if len(col.name) <= name_w else col.name[: name_w - 1] + "…"
        lines.append(f"{name:<{name_w}} {keys[col.name]:<5}"
                     + "".join(f"{rows[col.name][h]:>{wide[h]}}" for h in heads))
    return "\n".join(lines)


def _grid(rows: list[tuple[str, str]]) -> bool:
    """True when ``rows`` are every case in every dtype of the run (a matrix of dtypes)."""
    cases = dict.fromkeys(case for case, _ in rows)
    dtypes = dict.fromkeys(d for _, d in rows)
    return len(rows) == len(cases) * len(dtypes)


def matrix(result: RunResult, width: int = DEFAULT_WIDTH) -> str:
    """Cases × columns, one glyph per dtype, or one per row "case dtype" when the rows are not
    every case in every dtype (the quick profile); the legend (glyphs present only) first. In
    a panel of columns, the rows where every one of them is n/a are left out and counted."""
    names = [c.name for c in result.columns]
    grid = {(c.case, c.dtype, c.column): c.status for c in result.cells}
    if _grid(result.rows):
        dtypes = list(dict.fromkeys(d for _, d in result.rows))
        rows = {case: [(case, d) for d in dtypes]
                for case in dict.fromkeys(case for case, _ in result.rows)}
        what = f"one glyph per dtype ({' '.join(dtypes)}) in each cell"
    else:
        dtypes = [""]
        rows = {f"{case} {dtype}": [(case, dtype)] for case, dtype in result.rows}
        what = "one glyph per case × dtype"
    keys = column_keys(names, max(len(dtypes), 4))
    present = [s for s in GLYPHS if s in grid.values()]
    legend = "  ".join(f"{GLYPHS[s]} {LEGEND[s]}" for s in present)
    lines = [fit(f"matrix: {what}: {legend}", width)]
    widths = [max(len(dtypes), len(keys[n])) for n in names]
    label = min(max([len(r) for r in rows] + [4]), max(width - max(widths) - 1, 8))
    for number, panel in enumerate(panels(label, widths, width)):
        if number:
            lines.append("")
        lines.append(("case".ljust(label) + " " + " ".join(
            keys[names[i]].ljust(widths[i]) for i in panel)).rstrip())
        hidden = 0
        for name, cells in rows.items():
            statuses = [[grid.get((case, d, names[i]), "") for case, d in cells] for i in panel]
            if number and all(s in ("n/a", "") for row in statuses for s in row):
                hidden += 1
                continue
            row = ["".join(GLYPHS.get(s, " ") for s in row).ljust(widths[i])
                   for row, i in zip(statuses, panel, strict=True)]
            name = name if len(name) <= label else name[: label - 1] + "…"
            lines.append((name.ljust(label) + " " + " ".join(row)).rstrip())
        if hidden:
            lines.append(f"({plural(hidden, 'more row')}: n/a in every column of this panel)")
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
    lines = [fit(f"known differences: {plural(known, 'peer cell')}, each verified (the peer "
                 f"matches the alternative semantics its entry of spec.KNOWN_DIFFERENCES names; "
                 f"r: the worst distance to it); why each peer differs: --verbose", width)]
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
            parts.append(f"… and {plural(len(cells) - MAX_FAILURES, f'more {what} cell')}: "
                         f"--verbose")
    return "\n".join(parts)


def page(result: RunResult, width: int = DEFAULT_WIDTH) -> str:
    """The default report of ``result`` (the page: this module's docstring), every line
    within ``width`` but runnable code."""
    parts = [column_summary(result, width), matrix(result, width)] if result.cells else []
    for section in (failing_cells(result, width), known_differences(result, width),
                    fit(errors_section(result), width),
                    properties_text(result, width), missing_section(result, width),
                    summary_lines(result, width) + _then(profile_lines(result, width))):
        if section:
            parts.append(section)
    return "\n\n".join(parts)


def _then(lines: str) -> str:
    return "\n" + lines if lines else ""


# ---------------------------------------------------------------------------- the verdict first


def backend_verdict(column: Column, cells: list[Cell], errors: list[ErrorResult],
                    seconds: float, width: int = DEFAULT_WIDTH) -> str:
    """One backend's verdict, printed as soon as its cells and bad inputs are done (before the
    peers and the report): PASS or FAIL with its counts and time; a FAIL names the diagnoses
    (most cells first) and the rerun command of one failing cell; "nothing checked" when every
    cell was unsupported or not provided and no bad input ran."""
    checked = [c for c in cells if c.status not in ("n/a", *NOT_CHECKED)]
    failing = [c for c in checked if c.status in FAILING]
    bad = [e for e in errors if not e.passed]
    counts = f"{len(checked) - len(failing)}/{len(checked)} cells"
    if errors:
        counts += f", {len(errors) - len(bad)}/{len(errors)} bad inputs"
    if not checked and not errors:
        return fit(f"{column.name}: NOTHING CHECKED: every cell is "
                   f"{' or '.join(sorted({c.status for c in cells})) or 'absent'} "
                   f"({seconds:.1f} s)", width)
    if not failing and not bad:
        return fit(f"{column.name}: PASS, {counts} ({seconds:.1f} s)", width)
    lines = [f"{column.name}: FAIL, {counts} ({seconds:.1f} s)"]
    why: dict[str, set[str]] = {}
    for cell in failing:
        why.setdefault(cell.reasons[0] if cell.reasons else "no diagnosis", set()).add(cell.case)
    for reason, cases in sorted(why.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  {reason} ({plural(len(cases), 'case')})")
    if bad:
        lines.append(f"  bad inputs: {plural(len(bad), 'check')} fail, e.g. {bad[0].case}")
    if failing:
        lines.append(f"  rerun one: {failing[0].rerun}")
    return "\n".join(fit(line, width) for line in lines)


def profile_lines(result: RunResult, width: int = DEFAULT_WIDTH) -> str:
    """For a run of the quick profile (``spec.PROFILES``): what ``--full`` adds (rows of case ×
    dtype, peer columns, property examples) and the command; "" for any other run."""
    if result.profile != "quick":
        return ""
    from ..cases import catalogue
    from ..cases.dtypes import DTYPES
    from ..peers import PEERS
    from ..running import profiles

    every = len(catalogue.CASES) * len(DTYPES)
    ran = {c.name for c in result.columns}
    peers = any(c.kind == "peer" for c in result.columns)  # (none beside a checked module)
    more = [p.name for p in PEERS if peers and p.name not in ran and p.available()]
    cases = len({case for case, _ in result.rows})
    adds = [f"{plural(every - len(result.rows), 'more row')} ({len(catalogue.CASES)} cases × "
            f"{len(DTYPES)} dtypes)"]
    if more:
        adds.append(f"{plural(len(more), 'more peer column')} ({', '.join(more)})")
    adds.append(f"{profiles.FULL_PROPERTY_EXAMPLES} property-based examples per backend")
    return fit(f"quick profile: {plural(len(result.rows), 'row')} ({cases} cases), chosen to "
               f"use every spec feature on every backend; --full adds {'; '.join(adds)}. "
               f"For CI: python -m conformance --full", width)


# ---------------------------------------------------------------------------- the full report


def full_table(result: RunResult, width: int | None = None) -> str:
    """Rows: case × dtype; columns: backends and peers, in panels that fit ``width`` (None:
    one panel, as wide as it takes)."""
    grid = {(c.case, c.dtype, c.column): c for c in result.cells}
    names = [c.name for c in result.columns]
    label_width = max([len(f"{c} {d}") for c, d in result.rows] + [10])
    widths = [max(CELL_WIDTH, len(n)) for n in names]
    if width is not None:  # a long case name is cut (…) so that one cell fits beside it
        label_width = max(min(label_width, width - max(widths) - 1), 10)
    blocks = []
    for panel in panels(label_width, widths, width):
        head = ("case".ljust(label_width) + " " + " ".join(
            names[i].ljust(widths[i]) for i in panel)).rstrip()
        lines = [head, "-" * len(head)]
        for case, dtype in result.rows:
            label = f"{case} {dtype}"
            if len(label) > label_width:
                label = case[: label_width - len(dtype) - 2] + "… " + dtype
            lines.append((label.ljust(label_width) + " " + " ".join(
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
                    missing_section(result, width),
                    summary_lines(result, width) + _then(profile_lines(result, width))):
        if section:
            parts.append(section)
    return "\n\n".join(parts)


__all__ = ["GLYPHS", "KEYS", "MAX_FAILURES", "R_LEGEND", "column_keys", "column_summary",
           "failing_cells", "full", "full_table", "known_differences", "matrix", "page"]
