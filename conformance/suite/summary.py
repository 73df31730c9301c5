"""The plugin's terminal summary: the failed cell steps grouped by diagnosis, one bug per group.

A bug of the checked module fails many items (every step of every case × dtype it touches);
each failed item says only its diagnosis and the rerun command (``outcomes.Suite``), and this
section, "attention conformance: failures by diagnosis", explains each bug once::

    1. mask polarity flipped: 53 failing item(s) in 13 case(s) (float32, float64, …): padding, …
       why: mask polarity flipped: the implementation treats True as 'masked out'; …
       e.g. conformance/suite/checks.py::test_cell[padding-float32-output]
       first failure: output of examples.wrong_attention, case padding, float32: …
       smallest failing case (output; query (1, 1, 2, 1), …; float32; …), runnable:
           <the script>
       rerun: python -m conformance --case padding --dtype float32 --backend …

The grouping is the harness's own (``reporting.groups.groups``, as the terminal's focused report
and the HTML page use it): the items' ``Failure``\\ s (sent from xdist's workers in the reports'
``user_properties``) are put back together as one ``Cell`` per case × dtype, so a cell whose
steps give several diagnoses joins the group of the diagnosis the most cases share, and a
wrong layout is one group. The example of a group is its first case in its first dtype
(``groups.DTYPE_ORDER``, then the run's order), its step the first with the group's diagnosis;
its first failure and smallest failing case are computed in the process that prints the section
(``Suite.example``: one cell and one shrinking per group, for at most ``groups.MAX_GROUPS``).
"""

from __future__ import annotations

import math
import sys
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..comparing.compare import StepResult
from ..comparing.results import Cell, RunResult
from ..diagnosing.diagnose import short, split
from ..reporting import groups as groups_mod
from ..reporting.textwidth import fit, fit_code, fit_command, resolve_width
from ..running.steps import STEPS
from .outcomes import Failure

#: The section's title.
TITLE = "attention conformance: failures by diagnosis"


@dataclass(frozen=True)
class Group:
    """One bug: its diagnosis (full text; a layout's reason, an error's type, or "no
    diagnosis; fails …") and its failed items, ``(node id, Failure)`` in the run's order."""

    diagnosis: str
    items: list[tuple[str, Failure]]

    @property
    def cases(self) -> list[str]:
        """The group's cases, in the run's order."""
        return list(dict.fromkeys(f.case for _, f in self.items))

    @property
    def dtypes(self) -> list[str]:
        """The group's dtypes, in the run's order."""
        return list(dict.fromkeys(f.dtype for _, f in self.items))

    def example(self) -> tuple[str, Failure]:
        """The item the section explains: the first case × dtype in ``groups.DTYPE_ORDER``
        (then the run's order), its first step with the group's diagnosis (else its first)."""
        def rank(dtype: str) -> int:
            order = groups_mod.DTYPE_ORDER
            return order.index(dtype) if dtype in order else len(order)

        first = min(self.items, key=lambda item: rank(item[1].dtype))[1]
        same = [item for item in self.items
                if (item[1].case, item[1].dtype) == (first.case, first.dtype)]
        name = short(self.diagnosis)
        return next((item for item in same
                     if name in (short(r) for r in split(item[1].reasons))), same[0])


def failures(reports: Iterable[Any]) -> list[tuple[str, Failure]]:
    """``(node id, Failure)`` of each report that carries one (``Failure.from_properties``)."""
    found = ((getattr(r, "nodeid", ""), Failure.from_properties(getattr(r, "user_properties", ())))
             for r in reports)
    return [(nodeid, failure) for nodeid, failure in found if failure is not None]


def _cells(items: list[tuple[str, Failure]], column: str) -> list[Cell]:
    """One ``Cell`` per case × dtype of ``items``, as ``groups.groups`` reads a cell: its
    status, its failed steps, the diagnoses of its failed steps (``reasons``), the first error."""
    cells: dict[tuple[str, str], Cell] = {}
    for _, f in items:
        cell = cells.setdefault((f.case, f.dtype), Cell(f.case, f.dtype, column, status=f.status,
                                                        rerun=f.rerun))
        cell.steps.append(StepResult(f.step, math.inf, False, error=f.error))
        if f.reasons and not f.layout and f.reasons not in cell.reasons:
            cell.reasons.append(f.reasons)
        cell.detail = cell.detail or f.error
    return list(cells.values())


def by_diagnosis(items: list[tuple[str, Failure]], column: str,
                 rows: list[tuple[str, str]]) -> list[Group]:
    """The failed items of the module ``column`` grouped by bug with ``groups.groups``, the
    largest group first; ``rows`` (case, dtype) is the run's order, the items are put in it
    (and a cell's in ``STEPS``' order, the collection's), whatever order xdist's workers
    reported them in."""
    order = {row: i for i, row in enumerate(rows)}
    steps = {name: i for i, name in enumerate(STEPS)}
    items = sorted(items, key=lambda item: (order.get((item[1].case, item[1].dtype), len(order)),
                                            steps.get(item[1].step, len(steps))))
    layout = {(f.case, f.dtype, column): f.reasons for _, f in items if f.layout}
    found = groups_mod.groups(RunResult([], _cells(items, column), {}, list(rows)), layout)
    out = []
    for (_, _, diagnosis), cells in found.items():
        keys = {(c.case, c.dtype) for c in cells}
        out.append(Group(diagnosis, [item for item in items
                                     if (item[1].case, item[1].dtype) in keys]))
    return out


def explain(number: int, group: Group, example: tuple[list[str], str], width: int) -> list[str]:
    """One group as the section prints it: the diagnosis by name with its count of failed
    items, cases and dtypes; the diagnosis in full; the example item, what ``Suite.example``
    says of it (the first failure and the smallest failing case, the script apart) and the
    command that reruns its cell."""
    nodeid, failure = group.example()
    head = (f"{number}. {short(group.diagnosis) or group.diagnosis}: {len(group.items)} failing "
            f"item(s) in {len(group.cases)} case(s) ({', '.join(group.dtypes)}): "
            f"{', '.join(group.cases)}")
    lines = [fit(head, width)]
    if short(group.diagnosis) != group.diagnosis:
        lines += textwrap.wrap(f"why: {group.diagnosis}", width - 3, initial_indent="   ",
                               subsequent_indent="     ")
    lines.append(f"   e.g. {nodeid.rpartition('::')[2]}")  # whole: -k takes it
    texts, code = example
    lines += [fit("   " + text.replace("\n", "\n   "), width) for text in texts]
    if code:  # broken only where Python allows: it runs as printed
        lines.append(textwrap.indent(fit_code(code, width - 7), "       "))
    lines.append(fit_command(f"   rerun: {failure.rerun}", width))
    return lines


def section(suite: Any, items: list[tuple[str, Failure]], width: int | None = None
            ) -> list[str]:
    """The section's lines (without its title) for the failed items of ``suite`` (an
    ``outcomes.Suite``): each group of ``by_diagnosis`` up to ``groups.MAX_GROUPS`` explained
    (``explain``), then how many more groups there are. ``width`` None: the harness's report's
    (``textwidth.resolve_width`` on the process's standard output: 100 columns, fewer on a
    narrower terminal)."""
    width = resolve_width(None, sys.__stdout__) if width is None else width
    found = by_diagnosis(items, suite.name, suite.rows)
    lines: list[str] = []
    for number, group in enumerate(found[:groups_mod.MAX_GROUPS], 1):
        try:
            example = suite.example(group.example()[1])
        except Exception as exc:  # noqa: BLE001 - the grouping is still worth printing
            example = [f"first failure: not computed here ({type(exc).__name__}: {exc})"], ""
        lines += explain(number, group, example, width)
    rest = found[groups_mod.MAX_GROUPS:]
    if rest:
        lines.append(fit(f"… and {len(rest)} more group(s) of failures "
                         f"({sum(len(g.items) for g in rest)} item(s)): "
                         + "; ".join(short(g.diagnosis) or g.diagnosis for g in rest), width))
    return lines


__all__ = ["TITLE", "Group", "by_diagnosis", "explain", "failures", "section"]
