"""What a run produces: cells, bad-input results, property results and the whole run.

Every producer (``runner``, ``peers``, ``errors``, ``properties``, ``golden``) fills these types;
the reports (``conformance.reporting``) only read them. A cell is one (case, dtype, column) of the
report: its status, the worst ratio over its steps (``compare.StepResult``) and a detail text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import spec
from ..cases.expected import Expected
from ..words import plural
from .compare import StepResult

#: Statuses of a checked module's cells that were not run: a declared-unsupported feature (or
#: ``NotImplementedError``), or no function of the module computes any of the cell's steps.
NOT_CHECKED = ("unsupported", "not provided")


class NotApplicable(Exception):
    """A column cannot express a case (e.g. a peer without soft-capping): the cell is n/a."""


@dataclass
class Cell:
    """One (case, dtype, column) of the report."""

    case: str
    dtype: str
    column: str
    #: ok | FAIL | error | timeout (a checked module's call that did not return in time:
    #: ``running.module_worker``) | n/a | unsupported | not provided; a peer's failure becomes known
    #: (its known difference verified) or unexpected (``alternatives.classify``).
    status: str = "ok"
    ratio: float | None = 0.0  # worst ratio to the spec over the steps
    steps: list[StepResult] = field(default_factory=list)
    detail: str = ""  # error text, n/a reason, known-difference text or diagnosis
    spec_backend: bool = True
    rerun: str = ""
    #: A checked module: the steps not run because it does not define their function.
    skipped: tuple[str, ...] = ()
    #: The names of ``spec.PLUGIN_FEATURES`` the case uses.
    features: frozenset[str] = frozenset()
    #: The diagnoses of the failed steps (``diagnose``), first one first.
    reasons: list[str] = field(default_factory=list)
    #: A known or unexpected peer cell: the shorts of the entries of ``spec.KNOWN_DIFFERENCES``
    #: whose alternatives explain it (unexpected: the closest combination tried) …
    alternatives: tuple[str, ...] = ()
    #: … and the worst ratio of its failing steps to that alternative (None: no entry covers it).
    alternative_ratio: float | None = None

    @property
    def failed(self) -> bool:
        """True when this cell makes the run fail (a spec backend that did not pass)."""
        return self.spec_backend and self.status not in ("ok", "n/a", *NOT_CHECKED)

    def finish(self) -> Cell:
        """Set status, ratio and detail from the steps; returns the cell."""
        errors = [s for s in self.steps if s.error]
        finite = [s.ratio for s in self.steps if not s.error]
        self.ratio = max(finite) if finite else None
        if errors and not finite:
            self.status, self.detail = "error", errors[0].error
        elif errors or any(not s.passed for s in self.steps):
            self.status = "FAIL"
            notes = [f"{s.step}: {s.error or s.note}" for s in self.steps
                     if (s.error or not s.passed) and (s.error or s.note)]
            self.detail = " | ".join(notes)
        return self


def rerun_command(case: str, dtype: str, column: str) -> str:
    """The command that reruns one cell."""
    return f"python -m conformance --case {case} --dtype {dtype} --backend {column}"


def error_text(exc: BaseException) -> str:
    """``Type: message``, first line only, at most 300 characters."""
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def known_differences(peer: str, case: str, dtype: str) -> list[dict[str, Any]]:
    """The entries of ``spec.KNOWN_DIFFERENCES`` that cover ``peer`` on ``case`` (a name the
    entry lists) in ``dtype`` (every dtype when the entry names none), in their order."""
    return [entry for entry in spec.KNOWN_DIFFERENCES.get(peer, [])
            if case in entry["cases"] and dtype in entry.get("dtypes", (dtype,))]


@dataclass
class ErrorResult:
    """One bad input (``errors.ERROR_CASES``) on one backend."""

    case: str
    backend: str
    expected: str
    raised: str  # exception type name, or "" when nothing was raised
    message: str
    passed: bool
    problem: str = ""
    spec_backend: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class BackendProperties:
    """The outcome of the property checks on one backend (``properties.run_backend``)."""

    backend: str
    examples: int = 0  # run: the passing ones, and the failing one where one fails
    failure: str = ""
    reproducer: str = ""
    worst_ratio: float = 0.0  # worst compare ratio over the passing examples
    seconds: float = 0.0
    failure_ratio: float | None = None  # the minimal failing example's; None: not a comparison
    shrink_calls: int = 0  # calls Hypothesis made shrinking the failure (not in ``examples``)
    rejected: int = 0  # examples rejected (NotImplementedError; not in ``examples``)
    note: str = ""  # why no example ran, where none did

    def line(self) -> str:
        """``hypothesis · numpy: ok, 100 examples, worst ratio 0.31, 1.2 s``; a failure names
        the failing example's ratio apart from the passing examples' worst."""
        extra = f", {self.rejected} rejected (NotImplementedError)" if self.rejected else ""
        head = f"hypothesis · {self.backend}: "
        if self.note:
            return head + self.note
        if not self.failure:
            return (head + f"ok, {plural(self.examples, 'example')}, worst ratio "
                    f"{self.worst_ratio:.2f}"
                    f"{extra}, {self.seconds:.1f} s")
        if not self.examples:  # the checks ended before an example completed (a fault)
            return head + f"FAIL before any example completed, {self.seconds:.1f} s"
        ratio = (f"the failing example: worst error {self.failure_ratio:.3g} x the tolerance"
                 if self.failure_ratio is not None else "the failing example raised or broke a "
                 "property other than the tolerance")
        passed = self.examples - 1
        before = (f"; the {plural(passed, 'example')} before it passed (worst ratio "
                  f"{self.worst_ratio:.2f})" if passed else "")
        return (head + f"FAIL at example {self.examples}: {ratio}{before}; "
                f"{plural(self.shrink_calls, 'more call')} to shrink it{extra}, "
                f"{self.seconds:.1f} s")


@dataclass
class PropertyResult:
    """The outcome of ``--hypothesis N``: N examples per backend."""

    n: int
    backends: list[BackendProperties] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when no backend failed a property."""
        return not any(b.failure for b in self.backends)

    def summary(self) -> str:
        """A short part of the summary line."""
        bad = [b.backend for b in self.backends if b.failure]
        total = sum(b.examples for b in self.backends)
        verdict = f"FAIL on {', '.join(bad)}" if bad else "ok"
        return f"hypothesis: {plural(total, 'example')}, {verdict}"

    def text(self) -> str:
        """One line per backend, and each failure with its minimal reproducer."""
        lines = []
        for b in self.backends:
            lines.append(b.line())
            if b.failure:
                lines.append(f"FAIL hypothesis · {b.backend}: {b.failure}\n"
                             f"  minimal reproducer (runnable):\n\n{b.reproducer}\n")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the JSON report."""
        return {"n": self.n, "backends": [vars(b) for b in self.backends]}


@dataclass
class Column:
    """A report column: a spec/user backend (``backend``), or a peer (``peer``)."""

    name: str
    kind: str  # "backend" or "peer"
    backend: Any = None  # backends.Backend
    peer: Any = None  # peers.Peer


@dataclass
class RunResult:
    """Everything a run produced, for the report."""

    columns: list[Column]
    cells: list[Cell]
    missing: dict[str, str]  # column (or tool) → how to install
    rows: list[tuple[str, str]]  # (case, dtype) in order
    expectations: dict[tuple[str, str], Expected] = field(default_factory=dict)
    errors: list[ErrorResult] = field(default_factory=list)
    properties: PropertyResult | None = None
    seconds: float = 0.0
    #: What a checked module's contract left out of the bad-input and property checks.
    notes: list[str] = field(default_factory=list)
    #: The profile that chose the rows, peers and property examples (``spec.PROFILES``), or ""
    #: for a run that was given them (``golden.check``, a test).
    profile: str = ""

    @property
    def checked(self) -> int:
        """How many checks ran: cells compared (not n/a, unsupported or not provided), bad
        inputs tried and property examples run. 0 means the run proves nothing."""
        cells = sum(c.status not in ("n/a", *NOT_CHECKED) for c in self.cells)
        examples = sum(b.examples for b in self.properties.backends) if self.properties else 0
        return cells + len(self.errors) + examples

    def nothing_checked(self) -> str:
        """Why nothing was checked (one line), or "" when something was."""
        if self.checked:
            return ""
        if not self.cells:
            return "nothing was checked: no case × dtype was run"
        statuses = sorted({c.status for c in self.cells})
        return (f"nothing was checked: all {plural(len(self.cells), 'cell')} are "
                f"{' or '.join(statuses)} (--verbose shows why)")

    @property
    def ok(self) -> bool:
        """True when every spec/user backend cell passed (and errors/properties conform)."""
        cells_ok = not any(c.failed for c in self.cells)
        errors_ok = all(e.passed for e in self.errors if e.spec_backend)
        props_ok = self.properties is None or self.properties.passed
        return cells_ok and errors_ok and props_ok


__all__ = ["NOT_CHECKED", "BackendProperties", "Cell", "Column", "ErrorResult", "NotApplicable",
           "PropertyResult", "RunResult", "error_text", "known_differences", "rerun_command"]
