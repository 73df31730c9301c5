"""A ``LocateResult`` as text: the verdict first, then the stages, the first parting stage's
error per position and the shrunk input (``python -m conformance locate``)."""

from __future__ import annotations

import textwrap
from typing import Any


def _number(value: float) -> str:
    return "inf" if value == float("inf") else f"{value:.2g}"


def text(result: Any, width: int = 100) -> str:
    """A ``locate.LocateResult`` in lines of at most ``width`` characters (the per-position
    list wraps)."""
    head = f"locate: A = {result.a}, B = {result.b}"
    if result.problem:
        return "\n".join([head, *textwrap.wrap(f"cannot compare: {result.problem}", width)])
    causal = "causal" if result.is_causal else "not causal"
    lines = [head, f"inputs: batch {result.batch}, seq {result.seq}, {result.dtype}, {causal}"]
    lines += [f"note: {n}" for n in result.notes]
    if result.agree:
        lines.append(f"verdict: they agree at every stage ({len(result.stages)} compared)")
    else:
        lines.append(f"verdict: they part first at {result.first!r}: {result.verdict}")
    lines += ["", f"{'stage':<10} {'max |B-A|':>10} {'/ bound':>9}  result"]
    for stage in result.stages:
        mark = "ok" if stage.passed else "PARTS" + ("  <- first" if stage.stage ==
                                                     result.first else "")
        note = f"  ({stage.note})" if stage.note else ""
        lines.append(f"{stage.stage:<10} {_number(stage.max_abs):>10} "
                     f"{_number(stage.ratio):>9}  {mark}{note}"[:width])
    first = result.stage(result.first) if result.first else None
    if first is not None and first.per_position:
        cells = " ".join(f"{p}:{_number(r)}" for p, r in enumerate(first.per_position))
        lines += ["", f"{first.stage}, worst |B-A| / bound per position:"]
        lines += textwrap.wrap(cells, width, initial_indent="  ", subsequent_indent="  ")
    if result.shrunk:
        shrunk = result.shrunk
        row = "" if shrunk["row"] is None else f" (row {shrunk['row']})"
        lines.append(f"shrunk input: batch {shrunk['batch']}{row}, seq {shrunk['seq']} "
                     f"(positions {shrunk['positions'][0]}..{shrunk['positions'][-1]}) "
                     f"still parts first at {result.first!r}")
    return "\n".join(lines)
