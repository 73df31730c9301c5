"""What a user sees: the compact table, failure explanations, JSON, Markdown and plots.

Cells read ``ok 0.31`` (passed; worst error is 0.31 of the tolerance), ``FAIL 2e+03``,
``known: top-left (0.12)`` (a peer's difference of ``spec.KNOWN_DIFFERENCES``, verified: the peer
matches the entry's alternative semantics, 0.12 of the tolerance away from it), ``unexp.
2e+03/40`` (a peer that fails the spec and that no entry explains: 2e+03 from the spec, 40 from
the closest alternative), ``n/a`` (the column cannot express the case), ``error`` (the
implementation raised), ``unsupported`` or ``not provided`` (a checked module's contract,
``plugins``); ``legend`` says so under the table. The focused report of a checked module is
``verdict``'s. Only spec/user backends decide the exit code; peers are context. The report only
reads ``results.RunResult``.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from . import spec
from .compare import StepResult
from .results import NOT_CHECKED, Cell, RunResult

CELL_WIDTH = 22  # "known: top-left (0.12)" in full


def _num(x: float | None) -> str:
    if x is None:
        return ""
    if math.isinf(x):
        return "inf"
    return f"{x:.2f}" if x < 100 else f"{x:.0e}"


def cell_text(cell: Cell, width: int = CELL_WIDTH) -> str:
    """The short text of one cell."""
    if cell.status == "ok":
        text = f"ok {_num(cell.ratio)}"
    elif cell.status == "FAIL":
        text = f"FAIL {_num(cell.ratio)}"
    elif cell.status == "known":  # keep the distance in sight when the label is cut
        label, _, distance = f"known: {cell.detail}".rpartition(" (")
        distance = f" ({distance}"
        if len(label) + len(distance) > width:
            label = label[: max(width - len(distance) - 1, 0)] + "…"
        text = label + distance
    elif cell.status == "unexpected":
        spec_part = _num(cell.ratio) if cell.ratio is not None else "raised"
        text = f"unexp. {spec_part}/{_num(cell.alternative_ratio) or '-'}"
    elif cell.status == "error":
        text = "error: " + cell.detail.split(":")[0]
    else:
        text = cell.status
    return text if len(text) <= width else text[: width - 1] + "…"


def _grid(result: RunResult) -> dict[tuple[str, str, str], Cell]:
    return {(c.case, c.dtype, c.column): c for c in result.cells}


def table(result: RunResult) -> str:
    """Rows: case × dtype; columns: backends and peers."""
    grid = _grid(result)
    names = [c.name for c in result.columns]
    label_width = max([len(f"{c} {d}") for c, d in result.rows] + [10])
    widths = [max(CELL_WIDTH, len(n)) for n in names]
    head = "case".ljust(label_width) + " " + " ".join(
        n.ljust(w) for n, w in zip(names, widths, strict=True))
    lines = [head, "-" * len(head)]
    for case, dtype in result.rows:
        cells = [cell_text(grid[(case, dtype, n)], w) if (case, dtype, n) in grid else ""
                 for n, w in zip(names, widths, strict=True)]
        lines.append(f"{case} {dtype}".ljust(label_width) + " "
                     + " ".join(t.ljust(w) for t, w in zip(cells, widths, strict=True)).rstrip())
    return "\n".join(lines)


def legend() -> str:
    """What the number after ``ok``/``FAIL`` means, with the tolerance formula."""
    return textwrap.fill(
        "legend: ok/FAIL r: r = worst |actual - expected| / bound over the cell's steps (r <= 1 "
        "passes), bound = atol + rtol·|expected| + k·e, e = the error of a naive implementation "
        "in the same dtype on the same inputs (spec.TOLERANCES); NaN, ±inf and required zeros "
        "must match exactly (r = inf: they do not). known: a (r): a peer's difference a of "
        "spec.KNOWN_DIFFERENCES, verified: r = worst ratio of the peer to the alternative "
        "semantics the entry names (r <= 1); unexp. s/a: a peer that fails the spec and that no "
        "entry explains: s = worst ratio to the spec ('raised': it raised), a = to the closest "
        "alternative ('-': no entry covers the cell); n/a: "
        "the column cannot express the case; unsupported: a checked module declares a feature "
        "of the case unsupported (or raised NotImplementedError); not provided: it defines none "
        "of the cell's functions.", width=100, subsequent_indent="  ")


def _fmt_value(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def explain_step(cell: Cell, step: StepResult) -> str:
    """A failure message that makes sense without reading code."""
    where = f"{step.step} of {cell.column}, case {cell.case}, {cell.dtype}"
    if step.error:
        return f"{where}: raised {step.error}"
    worst = ("outside any tolerance" if math.isinf(step.ratio)
             else f"worst error {_num(step.ratio)} x the tolerance")
    lines = [f"{where}: {worst}"]
    if step.index is not None:
        exact = step.expected is not None and (math.isinf(step.expected) or step.note.startswith(
            "must be exactly 0"))
        tol = "exactly" if exact else f"tolerance {_fmt_value(step.bound)}"
        lines.append(f"    at index {step.index}: actual {_fmt_value(step.actual)}, expected "
                     f"{_fmt_value(step.expected)} (float64 reference), {tol}")
    if step.note:
        lines.append(f"    why: {step.note}")
    return "\n".join(lines)


def failures(result: RunResult, *, include_peers: bool = True) -> str:
    """Every failing cell, step by step, with the command that reruns it."""
    out = []
    for cell in result.cells:
        if cell.status not in ("FAIL", "error", "timeout", "unexpected"):
            continue
        if not cell.spec_backend and not include_peers:
            continue
        tag = "FAIL" if cell.spec_backend else "peer differs (unexpected, not counted)"
        out.append(f"{tag}: {cell.column} · {cell.case} · {cell.dtype}")
        if cell.status == "unexpected":
            out.append(f"  {cell.detail}")
        if cell.status in ("error", "timeout") and not cell.steps:
            out.append(f"  {cell.status}: {cell.detail}")
        for step in cell.steps:
            if step.error or not step.passed:
                out.append("  " + explain_step(cell, step).replace("\n", "\n  "))
        out.append(f"  rerun: {cell.rerun}")
    return "\n".join(out)


def known_section(result: RunResult) -> str:
    """The known differences the run met, per peer: each combination of entries that explained
    cells (how many, the worst distance to the alternative), then each entry's reason once."""
    seen: dict[str, dict[tuple[str, ...], list[Cell]]] = {}
    for cell in result.cells:
        if cell.status == "known":
            seen.setdefault(cell.column, {}).setdefault(cell.alternatives, []).append(cell)
    lines = []
    for peer, combos in seen.items():
        parts = [f"{' + '.join(shorts)} ({len(cells)} cells, worst distance "
                 f"{_num(max(c.alternative_ratio or 0.0 for c in cells))})"
                 for shorts, cells in combos.items()]
        lines.append(textwrap.fill(f"known: {peer}: " + "; ".join(parts), width=100,
                                   subsequent_indent="    "))
        entries = {e.get("short", e["differs"]): e for e in spec.KNOWN_DIFFERENCES.get(peer, [])}
        for short in dict.fromkeys(s for shorts in combos for s in shorts):
            entry = entries.get(short, {})
            lines.append(f"    {short}: {entry.get('differs', '')} (alternative: "
                         f"{entry.get('alternative', '?')})\n      why: {entry.get('why', '')}")
    return "\n".join(lines)


def errors_section(result: RunResult) -> str:
    """One line for the error-conformance check, plus every failure."""
    if not result.errors:
        return ""
    bad = [e for e in result.errors if not e.passed]
    backends = sorted({e.backend for e in result.errors})
    cases = sorted({e.case for e in result.errors})
    lines = [f"errors: {len(result.errors) - len(bad)}/{len(result.errors)} bad inputs raise the "
             f"spec's exception naming the argument ({len(cases)} cases × "
             f"{', '.join(backends)})"]
    for e in bad:
        lines.append(f"  FAIL errors · {e.backend} · {e.case}: {e.problem}"
                     + (f" (message: {e.message[:160]!r})" if e.message else ""))
    return "\n".join(lines)


#: The kinds of a failing bad-input check, in the order the headline names them.
_BAD_INPUT_KINDS = ("raise the wrong type", "raise nothing",
                    "raise the right type with a message that does not name the function and "
                    "the argument")


def bad_inputs_text(result: RunResult) -> str:
    """``bad inputs: 3 of 40 raise the wrong type, 1 of 40 raise nothing``: the failing
    bad-input checks of the spec/user backends, by kind ("" when none fails)."""
    checked = [e for e in result.errors if e.spec_backend]
    counts = dict.fromkeys(_BAD_INPUT_KINDS, 0)
    for e in checked:
        if not e.passed:
            kind = 1 if not e.raised else 0 if e.raised != e.expected else 2
            counts[_BAD_INPUT_KINDS[kind]] += 1
    parts = [f"{n} of {len(checked)} {kind}" for kind, n in counts.items() if n]
    return "bad inputs: " + ", ".join(parts) if parts else ""


def peer_counts(cells: list[Cell]) -> dict[str, int]:
    """ok / known / n/a / unexpected (or FAIL or error) counts of peer cells."""
    statuses = [c.status for c in cells]
    return {"ok": statuses.count("ok"), "known": statuses.count("known"),
            "n/a": statuses.count("n/a"),
            "unexpected": statuses.count("unexpected") + statuses.count("FAIL")
            + statuses.count("error")}


def summary(result: RunResult) -> str:
    """The last line: counts (backend cells, bad inputs, property examples), missing backends,
    verdict."""
    spec_cells = [c for c in result.cells if c.spec_backend]
    peer_cells = [c for c in result.cells if not c.spec_backend]

    def count(cells: list[Cell], status: str) -> int:
        return sum(c.status == status for c in cells)

    checked = [c for c in spec_cells if c.status not in NOT_CHECKED]
    parts = [f"{count(checked, 'ok')}/{len(checked)} backend cells pass"]
    if len(checked) < len(spec_cells):
        parts.append(f"{len(spec_cells) - len(checked)} not checked (unsupported or not "
                     f"provided)")
    bad_inputs = [e for e in result.errors if e.spec_backend]
    if bad_inputs:
        parts.append(f"{sum(e.passed for e in bad_inputs)}/{len(bad_inputs)} bad inputs raise "
                     f"the spec's error")
    if peer_cells:
        counts = peer_counts(peer_cells)
        parts.append(f"peers: {counts['ok']} ok, {counts['known']} known, {counts['n/a']} n/a, "
                     f"{counts['unexpected']} unexpected")
    if result.properties is not None:
        parts.append(result.properties.summary())
    parts.append(f"{result.seconds:.1f} s")
    verdict = "PASS" if result.ok else "FAIL"
    return f"{verdict}: " + "; ".join(parts)


def missing_section(result: RunResult) -> str:
    """Which backends/peers were not installed, and how to install them."""
    return "\n".join(f"missing: {name} (install: {how})" for name, how in result.missing.items())


def text(result: RunResult) -> str:
    """The whole terminal report."""
    parts = [table(result), legend()] if result.cells else []
    for section in (failures(result), known_section(result), errors_section(result),
                    result.properties.text() if result.properties is not None else "",
                    missing_section(result), summary(result)):
        if section:
            parts.append(section)
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------ files


def _jsonable(x: Any) -> Any:
    if isinstance(x, float):
        return None if math.isnan(x) else ("inf" if math.isinf(x) else x)
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (np.integer, np.floating)):
        return _jsonable(x.item())
    return x


def to_dict(result: RunResult) -> dict[str, Any]:
    """The full report as plain data."""
    return _jsonable({
        "ok": result.ok,
        "seconds": result.seconds,
        "columns": [{"name": c.name, "kind": c.kind} for c in result.columns],
        "peers": {c.name: peer_counts([x for x in result.cells if x.column == c.name])
                  for c in result.columns if c.kind == "peer"},
        "plugins": {c.name: {"layout": c.backend.contract.layout,
                             "unsupported": sorted(c.backend.contract.unsupported),
                             "not_provided": list(c.backend.contract.not_provided)}
                    for c in result.columns
                    if c.backend is not None and c.backend.contract is not None},
        "missing": result.missing,
        "notes": result.notes,
        "tolerances": spec.TOLERANCES,
        "cells": [{
            "case": c.case, "dtype": c.dtype, "column": c.column, "status": c.status,
            "ratio": c.ratio, "detail": c.detail, "spec_backend": c.spec_backend,
            "rerun": c.rerun, "skipped": list(c.skipped), "features": sorted(c.features),
            "alternatives": list(c.alternatives), "alternative_ratio": c.alternative_ratio,
            "steps": [{
                "step": s.step, "ratio": s.ratio, "passed": s.passed,
                "index": list(s.index) if s.index is not None else None,
                "actual": s.actual, "expected": s.expected, "tolerance": s.bound,
                "note": s.note, "error": s.error,
            } for s in c.steps],
        } for c in result.cells],
        "baseline_errors": {f"{case}/{dtype}": exp.baseline
                            for (case, dtype), exp in result.expectations.items()},
        "errors": [vars(e) for e in result.errors],
        "properties": result.properties.to_dict() if result.properties is not None else None,
        "summary": summary(result),
    })


def write_json(result: RunResult, path: str | Path) -> None:
    """``--json FILE``."""
    Path(path).write_text(json.dumps(to_dict(result), indent=1) + "\n")


def write_markdown(result: RunResult, path: str | Path) -> None:
    """``--markdown FILE``: the table as Markdown, then failures, known differences, errors."""
    grid = _grid(result)
    names = [c.name for c in result.columns]
    lines = ["# Conformance report", "", summary(result), "",
             "| case | dtype | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    for case, dtype in result.rows:
        cells = [cell_text(grid[(case, dtype, n)], 200).replace("|", "\\|")
                 if (case, dtype, n) in grid else "" for n in names]
        lines.append(f"| {case} | {dtype} | " + " | ".join(cells) + " |")
    for title, body in (("Failures", failures(result)), ("Known differences",
                                                          known_section(result)),
                        ("Errors", errors_section(result)), ("Missing", missing_section(result))):
        if body:
            lines += ["", f"## {title}", "", "```", body, "```"]
    Path(path).write_text("\n".join(lines) + "\n")


def write_plots(result: RunResult, directory: str | Path) -> list[Path]:
    """``--plot DIR``: attention-weight heatmaps per case, error-vs-dtype per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    order = ["float64", "float32", "bfloat16", "float16"]
    best: dict[str, Any] = {}
    for (case, dtype), exp in result.expectations.items():
        if "output_weights" in exp.values and (
                case not in best or order.index(dtype) < order.index(best[case].dtype)):
            best[case] = exp
    for case, exp in best.items():
        w = exp.values["output_weights"]
        w2 = w.reshape((-1,) + w.shape[-2:])[0]  # first batch and head
        fig, ax = plt.subplots(figsize=(4, 3.4))
        im = ax.imshow(w2, vmin=0, vmax=1, cmap="viridis")
        ax.set_title(f"{case}\nweights, first batch/head", fontsize=9)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        path = out / f"weights_{case}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    dtypes = sorted({c.dtype for c in result.cells}, key=order.index)
    for col in result.columns:
        fig, ax = plt.subplots(figsize=(5, 3.4))
        for step in ("scores", "masked_scores", "weights", "output", "output_weights"):
            ys = []
            for d in dtypes:
                vals = [s.ratio for c in result.cells if c.column == col.name and c.dtype == d
                        for s in c.steps if s.step == step and not s.error
                        and math.isfinite(s.ratio)]
                ys.append(max(vals) if vals else np.nan)
            if not all(np.isnan(ys)):
                ax.plot(dtypes, np.maximum(ys, 1e-6), marker="o", label=step)
        ax.axhline(1.0, color="red", linestyle="--", linewidth=1, label="tolerance")
        ax.set_yscale("log")
        ax.set_ylabel("worst error / tolerance")
        ax.set_title(f"{col.name}: error vs dtype (all cases)", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"errors_{col.name.replace('/', '_')}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written
