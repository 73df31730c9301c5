"""The report's sections, the same words in every format (terminal, Markdown, JSON, HTML).

Cells read ``ok 0.31`` (passed; worst error is 0.31 of the tolerance), ``FAIL 2e+03``,
``known: top-left (0.12)`` (a peer's difference of ``spec.KNOWN_DIFFERENCES``, verified: the peer
matches the entry's alternative semantics, 0.12 of the tolerance away from it), ``unexp.
2e+03/40`` (a peer that fails the spec and that no entry explains: 2e+03 from the spec, 40 from
the closest alternative), ``n/a`` (the column cannot express the case), ``error`` (the
implementation raised), ``unsupported`` or ``not provided`` (a checked module's contract,
``running.plugins``); ``legend`` says so under the table. Only spec/user backends decide the
exit code; peers are context. The sections only read ``comparing.results.RunResult`` (and, for
``missing_section``, which packages are installed now): each failing cell explained step by
step with its rerun command (``failure_text``), the known differences met, the bad inputs, the
property checks, the missing packages and the summary line (``summary``, ``summary_lines``).
Every line but a runnable reproducer fits ``width`` (``textwidth.fit``).
"""

from __future__ import annotations

import importlib.util
import math
import textwrap

from .. import peers, spec, usage
from ..comparing.compare import StepResult
from ..comparing.results import NOT_CHECKED, Cell, RunResult
from ..words import plural
from .textwidth import fit, fit_code, fit_command

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


def legend(width: int = 100) -> str:
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
        "of the cell's functions.", width=width, subsequent_indent="  ")


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


#: The statuses ``failures`` explains: a spec/user backend's failures, a peer's "unexpected".
FAILING = ("FAIL", "error", "timeout", "unexpected")


def failure_text(cell: Cell, width: int | None = None) -> str:
    """One failing cell (a status of ``FAILING``), step by step, with its rerun command (to
    fit ``width``, broken with ``\\``)."""
    tag = "FAIL" if cell.spec_backend else "peer differs (unexpected, not counted)"
    out = [f"{tag}: {cell.column} · {cell.case} · {cell.dtype}"]
    if cell.status == "unexpected":
        out.append(f"  {cell.detail}")
    if cell.status in ("error", "timeout") and not cell.steps:
        out.append(f"  {cell.status}: {cell.detail}")
    for step in cell.steps:
        if step.error or not step.passed:
            out.append("  " + explain_step(cell, step).replace("\n", "\n  "))
    return "\n".join([fit("\n".join(out), width), fit_command(f"  rerun: {cell.rerun}", width)])


def failures(result: RunResult, *, include_peers: bool = True, width: int | None = None) -> str:
    """Every failing cell, step by step, with the command that reruns it (``failure_text``)."""
    return "\n".join(failure_text(c, width) for c in result.cells if c.status in FAILING
                     and (c.spec_backend or include_peers))


def known_section(result: RunResult) -> str:
    """The known differences the run met, per peer: each combination of entries that explained
    cells (how many, the worst distance to the alternative), then each entry's reason once."""
    seen: dict[str, dict[tuple[str, ...], list[Cell]]] = {}
    for cell in result.cells:
        if cell.status == "known":
            seen.setdefault(cell.column, {}).setdefault(cell.alternatives, []).append(cell)
    lines = []
    for peer, combos in seen.items():
        parts = [f"{' + '.join(shorts)} ({plural(len(cells), 'cell')}, worst distance "
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
    names = sorted({e.backend for e in result.errors})
    cases = sorted({e.case for e in result.errors})
    lines = [f"errors: {len(result.errors) - len(bad)}/{len(result.errors)} bad inputs raise the "
             f"spec's exception naming the argument ({plural(len(cases), 'case')} × "
             f"{', '.join(names)})"]
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


def summary_parts(result: RunResult) -> dict[str, str]:
    """The parts of the summary line, by name: ``cells``, ``not_checked``, ``bad_inputs``,
    ``peers``, ``properties``, ``seconds`` (only those the run has)."""
    spec_cells = [c for c in result.cells if c.spec_backend]
    peer_cells = [c for c in result.cells if not c.spec_backend]
    checked = [c for c in spec_cells if c.status not in NOT_CHECKED]
    parts = {"cells": f"{sum(c.status == 'ok' for c in checked)}/{len(checked)} backend cells "
                      f"pass" if spec_cells or not peer_cells else "no backend column (peers only)"}
    if len(checked) < len(spec_cells):
        parts["not_checked"] = (f"{len(spec_cells) - len(checked)} not checked (unsupported or "
                                f"not provided)")
    bad_inputs = [e for e in result.errors if e.spec_backend]
    if bad_inputs:
        parts["bad_inputs"] = (f"{sum(e.passed for e in bad_inputs)}/{len(bad_inputs)} bad "
                               f"inputs raise the spec's error")
    if peer_cells:
        counts = peer_counts(peer_cells)
        parts["peers"] = (f"peers: {counts['ok']} ok, {counts['known']} known, {counts['n/a']} "
                          f"n/a, {counts['unexpected']} unexpected")
    if result.properties is not None:
        parts["properties"] = result.properties.summary()
    parts["seconds"] = f"{result.seconds:.1f} s"
    return parts


def summary(result: RunResult) -> str:
    """The last line: counts (backend cells, bad inputs, property examples), missing backends,
    verdict."""
    return ("PASS" if result.ok else "FAIL") + ": " + "; ".join(summary_parts(result).values())


def summary_lines(result: RunResult, width: int | None) -> str:
    """``summary`` to fit ``width``: when it does not, the last line keeps the verdict, the
    backend cells, the bad inputs and the time, and the other parts (peers, property
    examples, cells not checked) come on the line(s) above it."""
    line = summary(result)
    if width is None or len(line) <= width:
        return line
    parts = summary_parts(result)
    last = ("PASS" if result.ok else "FAIL") + ": " + "; ".join(
        parts[k] for k in ("cells", "bad_inputs", "seconds") if k in parts)
    above = "; ".join(v for k, v in parts.items() if k not in ("cells", "bad_inputs", "seconds"))
    return fit(above, width) + "\n" + fit(last, width)


def _packages(name: str) -> tuple[str, ...]:
    """The packages a missing column needs: a peer's, or the framework a spec backend or tool
    (``hypothesis``) is named after."""
    peer = next((p for p in peers.PEERS if p.name == name), None)
    if peer is not None:
        return (peer.framework, *peer.requires)
    return (name,) if name in usage.INSTALL else ()


def missing_section(result: RunResult, width: int | None = None) -> str:
    """What was not installed, one line per missing package: what it would add (columns, the
    property checks) and its one install command (``usage.INSTALL``), for the packages that
    are missing now (a column whose other packages are installed names only the missing ones);
    then the command that installs everything. A column whose packages are all found keeps
    its own hint."""
    needs: dict[str, list[str]] = {}
    hints: dict[str, str] = {}
    other = []
    for name, how in result.missing.items():
        absent = [p for p in _packages(name) if importlib.util.find_spec(p) is None]
        for package in absent:
            needs.setdefault(package, []).append(name)
            hints.setdefault(package, usage.INSTALL.get(package, how))
        if not absent:
            other.append(f"missing: {name} (install: {how})")
    lines = [f"missing: {package} (" + ("the property checks" if names == ["hypothesis"]
                                        else ", ".join(names)) + f"); install: {hints[package]}"
             for package, names in needs.items()]
    if lines:
        lines.append("everything at once, from a clone: pip install -r requirements.txt")
    return fit("\n".join(other + lines), width)


def properties_text(result: RunResult, width: int | None = None) -> str:
    """The property checks: one line per backend, each failure with its minimal reproducer
    (``results.PropertyResult.text``), the lines fitted to ``width`` but the code kept."""
    if result.properties is None:
        return ""
    lines = []
    for b in result.properties.backends:
        lines.append(fit(b.line(), width))
        if b.failure:
            lines.append(fit(f"FAIL hypothesis · {b.backend}: {b.failure}", width))
            lines.append(f"  minimal reproducer (runnable):\n\n{fit_code(b.reproducer, width)}\n")
    return "\n".join(lines)
