"""What each item of the pytest plugin checks and says, with the harness's own machinery.

A ``Suite`` is one checked module in one process (one per pytest process, one per xdist worker);
its rows (case × dtype) come from a profile (``running.profiles``: ``quick``, the default, or
``full``) or, when cases or dtypes are selected, from the whole catalogue, as ``python -m
conformance`` chooses them (``runner.run``). It computes everything once and hands each item
its ``Outcome``:

* **a case × dtype × step item**: the case's ``Expected`` (``expected.expected``) and its
  ``Cell`` (``runner.run_cell`` on that one expectation, every applicable step at once), each
  computed once per process and shared by the cell's step items; the item passes or fails as
  its ``StepResult`` does (``runner.judge``: ``compare`` and ``diagnose``). A failing step says
  two lines, its diagnosis and the command that reruns the cell in the harness's report, and
  carries a ``Failure``: what the plugin's summary groups by (``summary``), where each bug is
  explained once, with its first failure and its smallest failing case (``example``). A failing
  sdpa cell of a checked module is also rerun transposed (``groups.transposed``), and when that
  passes the diagnosis is the wrong layout (``groups.LAYOUT_REASONS``), as in the verdict;
* **a bad-input item**: ``runner.run_errors`` on the module, once per process, and the one
  ``ErrorResult`` of the item's ``errors.ERROR_CASES`` entry;
* **the property item**: ``properties.run`` on ``runner.property_view`` of the module.

The plugin contract applies as in the report: a cell, step or bad input that uses a feature the
module declares in ``UNSUPPORTED`` (or that raised ``NotImplementedError``) is skipped with the
reason, one that calls a function the module does not define is skipped as not provided, and a call
that hangs or kills the module's worker fails (``running.module_worker``). Standard library, NumPy
and the harness only: ``checks`` turns outcomes into pytest's pass, skip and fail.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..cases import catalogue as cases_mod
from ..cases.expected import Expected, expected
from ..comparing.results import (
    BackendProperties,
    Cell,
    Column,
    ErrorResult,
    PropertyResult,
    StepResult,
)
from ..diagnosing.diagnose import SEPARATOR, short
from ..reporting import groups
from ..reporting.sections import explain_step
from ..reporting.shrink import reproducer, shape_text, shrink
from ..running import backends as backends_mod
from ..running import errors as errors_mod
from ..running import plugins, profiles, properties, runner
from ..running.backends import Backend
from ..running.module_worker import DEFAULT_TIMEOUT_S, PluginFault, check_timeout
from ..running.steps import STEPS, Execution, steps_for
from ..usage import UsageError

PASSED, SKIPPED, FAILED = "passed", "skipped", "failed"


@dataclass(frozen=True)
class Failure:
    """A failed step of a cell, as the plugin's summary groups it (``summary``): travels from
    the process that ran the item (an xdist worker) to the one that prints the summary as the
    report's ``user_properties`` (``properties``, ``from_properties``)."""

    case: str
    dtype: str
    step: str
    #: The cell's status: FAIL, error or timeout.
    status: str
    #: The step's diagnoses (``Suite.failure``), joined with ``diagnose.SEPARATOR``; the
    #: layout's reason (``layout``); or "" when the harness has none.
    reasons: str
    #: What the module raised ("" when it returned a wrong value).
    error: str
    #: The command that reruns the cell in the harness's report.
    rerun: str
    #: True when ``reasons`` is ``groups.LAYOUT_REASONS``' (found by rerunning transposed).
    layout: bool = False

    PREFIX = "attention_"

    def properties(self) -> list[tuple[str, str]]:
        """The failure as ``(name, text)`` pairs for an item's ``user_properties`` (which xdist
        sends to the controller and ``--junitxml`` writes as properties)."""
        return [(self.PREFIX + f.name, str(getattr(self, f.name))) for f in fields(self)]

    @classmethod
    def from_properties(cls, pairs: Any) -> Failure | None:
        """The ``Failure`` ``properties`` wrote into a report's ``user_properties``; None when
        the report carries none (it passed, or is not a failed cell step)."""
        got = {name.removeprefix(cls.PREFIX): value for name, value in pairs or ()
               if str(name).startswith(cls.PREFIX)}
        if {f.name for f in fields(cls)} - set(got):
            return None
        return cls(**{**got, "layout": got["layout"] == "True"})


@dataclass(frozen=True)
class Outcome:
    """An item's result: ``status`` (``PASSED``, ``SKIPPED`` or ``FAILED``), its text (the
    skip reason, or the failure message) and, for a failed cell step, its ``Failure``."""

    status: str
    message: str = ""
    failure: Failure | None = None


def _value(x: Any) -> str:
    """A bad input's argument in a few words: ``float32 (2, 4, 5, 8)``, or its repr."""
    if isinstance(x, np.ndarray):
        return f"{x.dtype} {tuple(x.shape)}"
    text = repr(x)
    return text if len(text) <= 40 else f"{type(x).__name__} ({len(x)} entries)"


class Suite:
    """One checked module in this process: its rows (case × dtype), their cells, the bad inputs
    and the property checks, each computed once (see the module docstring).

    ``backend``: a dotted module path (``mypkg.attention``, run isolated in a worker process as
    ``python -m conformance --backend`` runs it), a spec backend's name, or a ``Backend``;
    None when the run names none (``missing`` then says what to give). ``profile``: a name of
    ``spec.PROFILES``, which gives the rows and the property examples when ``cases`` and
    ``dtypes`` are None. ``cases``: glob patterns as ``--case``, ``dtypes``: dtype names; either
    selects from the whole catalogue (the matching cases, or all; the dtypes, or all four),
    whatever the profile. ``hypothesis``: examples of the property checks (0: skipped; None:
    the profile's, 0 when cases or dtypes are selected, as ``runner.run``); ``timeout``:
    seconds per call of a module in a worker (0: no limit). A bad profile, selection or
    timeout is a ``UsageError`` naming the option.
    """

    def __init__(self, backend: str | Backend | None, *, profile: str = "quick",
                 cases: list[str] | None = None, dtypes: list[str] | None = None,
                 hypothesis: int | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        try:
            self.profile = profiles.get(profile)
        except ValueError as exc:
            raise UsageError(f"--attention-profile: {exc}") from None
        try:
            cases_mod.select(cases)  # an unknown case: the option named
        except UsageError as exc:
            raise UsageError(f"--attention-case: {exc}") from None
        unknown = [d for d in dtypes or () if d not in backends_mod.DTYPES]
        if unknown:
            raise UsageError(f"--attention-dtype {unknown[0]!r} is not a dtype of the spec; "
                             f"expected one of {', '.join(backends_mod.DTYPES)}")
        #: True when cases or dtypes were named: the rows are not the profile's.
        self.selecting = bool(cases or dtypes)
        self._examples_given = hypothesis is not None
        self._choice = (cases, dtypes, hypothesis)
        self._rows: list[tuple[str, str]] | None = None
        _, hypothesis = profiles.choose(self.profile, cases, dtypes, hypothesis)
        if isinstance(hypothesis, bool) or not isinstance(hypothesis, int) or hypothesis < 0:
            raise UsageError(f"--attention-hypothesis is {hypothesis!r}; expected an integer "
                             f">= 0 (0: no property checks)")
        self.hypothesis = hypothesis
        try:
            self.limit = check_timeout(timeout)
        except UsageError:
            raise UsageError(f"--attention-timeout is {timeout!r}; expected seconds >= 0 "
                             f"(0: no limit)") from None
        self._source = backend
        self._backend: Backend | None = None
        self._expected: dict[tuple[str, str], Expected] = {}
        self._cells: dict[tuple[str, str], Cell] = {}
        self._layout: dict[tuple[str, str], str] = {}
        self._errors: list[ErrorResult] | None = None
        self._last_case = ""

    # ------------------------------------------------------------------ the module

    @property
    def name(self) -> str | None:
        """The checked module's name as the report shows it (None: none given)."""
        if self._source is None:
            return None
        return self._source if isinstance(self._source, str) else self._source.name

    @property
    def backend(self) -> Backend:
        """The module's ``Backend`` (``backends.load``), with the per-call time limit."""
        if self._backend is None:
            if self._source is None:
                raise UsageError("no module to check")
            self._backend = (backends_mod.load(self._source) if isinstance(self._source, str)
                             else self._source)
            self._backend.set_timeout(self.limit)
        return self._backend

    @property
    def rows(self) -> list[tuple[str, str]]:
        """The (case, dtype) rows of the run (``profiles.choose``): in the quick profile, the
        cover of what the module supports (its contract read once the module is loaded)."""
        if self._rows is None:
            lacks = []
            if self._source is not None:
                contract = self.backend.contract if self.backend.module is not None else None
                lacks = [contract.unsupported] if contract is not None else []
            self._rows = profiles.choose(self.profile, *self._choice, lacks)[0]
        return self._rows

    def load(self) -> None:
        """Import the module now (its worker started): a module that does not exist or breaks
        the contract is a ``UsageError``, one whose import raises a ``PluginImportError``
        carrying the traceback."""
        _ = self.backend.module

    # ------------------------------------------------------------------ what is collected

    def expectation(self, case: str, dtype: str) -> Expected:
        """The case's ``Expected`` in ``dtype``, computed once."""
        key = (case, dtype)
        if key not in self._expected:
            self._expected[key] = expected(cases_mod.get(case), dtype)
        return self._expected[key]

    def cell_steps(self) -> list[tuple[str, str, str]]:
        """``(case, dtype, step)`` of every compared step of the rows, in their order; the same
        in every process (the profile is chosen by rule, the inputs are seeded)."""
        return [(case, dtype, step.name) for case, dtype in self.rows
                for step in steps_for(self.expectation(case, dtype))]

    def scope(self) -> str:
        """What the run checks, in words, for pytest's header: the profile (or the selection)
        with its rows and property examples, and what the full profile adds to quick."""
        every = len(cases_mod.CASES) * len(backends_mod.DTYPES)
        examples = f"{self.hypothesis} property examples"
        if self.selecting:
            return (f"cases/dtypes selected from the whole catalogue: {len(self.rows)} of "
                    f"{every} case × dtype rows, {examples}")
        text = f"profile {self.profile.name}: {len(self.rows)} case × dtype rows, {examples}"
        if self.profile.rows is None:
            return text + " (every case in every dtype)"
        full = profiles.get("full")
        return (f"{text}; --attention-profile full adds the other {every - len(self.rows)} rows "
                f"(every case in every dtype) and {full.hypothesis} property examples")

    @staticmethod
    def bad_inputs() -> list[str]:
        """The names of the bad inputs (``errors.ERROR_CASES``)."""
        return [c.name for c in errors_mod.ERROR_CASES]

    # ------------------------------------------------------------------ cells

    def cell(self, case: str, dtype: str) -> Cell:
        """``runner.run_cell`` on the case × dtype, once; a new case first lets the backend
        free what it compiled for the previous one (as ``runner.run_columns``)."""
        key = (case, dtype)
        if key not in self._cells:
            if self._last_case and self._last_case != case:
                self.backend.release()
            self._last_case = case
            self._cells[key] = runner.run_cell(self.backend, self.expectation(case, dtype))
        return self._cells[key]

    def step_outcome(self, case: str, dtype: str, step: str) -> Outcome:
        """One compared step of one cell: passed, skipped (unsupported, not provided, n/a) or
        failed with ``failure_text``."""
        cell = self.cell(case, dtype)
        contract = self.backend.contract
        if not cell.steps and cell.status in ("unsupported", "not provided"):
            declared = cell.detail.startswith(("declared", "not provided"))
            return Outcome(SKIPPED, cell.detail if declared else f"unsupported: {cell.detail}")
        if not cell.steps and cell.status == "n/a":
            return Outcome(SKIPPED, f"n/a: {cell.detail}")
        feature = STEPS[step].feature
        if contract is not None and feature in contract.unsupported:
            return Outcome(SKIPPED, f"declared unsupported: {feature}")
        if step in cell.skipped:
            needs = STEPS[step].needs(Execution(self.backend, self.expectation(case, dtype)))
            return Outcome(SKIPPED, f"not provided: {needs[-1]}")
        if not cell.steps and cell.status in ("error", "timeout"):  # the worker was stopped
            failure = Failure(case, dtype, step, cell.status, "", cell.detail, cell.rerun)
            return Outcome(FAILED, f"{self.name} · {case} · {dtype} · {step}: {cell.status}: "
                                   f"{cell.detail} (the cell ended at that call)\n"
                                   f"rerun: {cell.rerun}", failure)
        result = next((s for s in cell.steps if s.step == step), None)
        if result is None:
            return Outcome(SKIPPED, f"unsupported: {step} raised NotImplementedError")
        if result.passed and not result.error:
            return Outcome(PASSED)
        failure = self.failure(cell, result)
        return Outcome(FAILED, f"{self.name} · {case} · {dtype} · {step}: {self.name_of(failure)}"
                               f"\nrerun: {cell.rerun}", failure)

    def layout_reason(self, case: str, dtype: str) -> str:
        """``groups.LAYOUT_REASONS``' text when the failing sdpa cell of a checked module
        passes once rerun transposed (``groups.transposed``), else ""; once per cell."""
        key = (case, dtype)
        exp = self.expectation(case, dtype)
        if key not in self._layout:
            self._layout[key] = ""
            if self.backend.contract is not None and exp.kind == "sdpa":
                other = groups.transposed(self.backend)
                try:
                    if runner.run_cell(other, exp).status == "ok":
                        self._layout[key] = groups.LAYOUT_REASONS[self.backend.contract.layout]
                finally:
                    other.release()
        return self._layout[key]

    @staticmethod
    def diagnosis(cell: Cell, result: StepResult) -> str:
        """The diagnosis of one failed step (``runner.judge`` put it in its note, a fault in its
        error), as the cell's ``reasons`` hold it; "" when the harness has none."""
        return next((r for r in cell.reasons
                     if r in (result.note or "") or r == result.error), "")

    def failure(self, cell: Cell, result: StepResult) -> Failure:
        """The ``Failure`` of a failed step: the layout's diagnosis when the cell passes rerun
        transposed (``layout_reason``), else the step's diagnoses as the harness's report reads
        a cell's (``groups.cell_diagnoses`` on the cell with this step alone: its value's
        diagnosis, then what its note and error say, an ignored keyword the module swallows
        turned into the fix), joined as ``diagnose`` joins them."""
        layout = self.layout_reason(cell.case, cell.dtype)
        if layout:
            return Failure(cell.case, cell.dtype, result.step, cell.status, layout,
                           result.error, cell.rerun, layout=True)
        why = self.diagnosis(cell, result)
        alone = dataclasses.replace(cell, steps=[result], reasons=[why] if why else [])
        fn = groups.sdpa_function(Column(self.name or "", "backend", backend=self.backend))
        return Failure(cell.case, cell.dtype, result.step, cell.status,
                       SEPARATOR.join(groups.cell_diagnoses(alone, fn)), result.error,
                       cell.rerun)

    @staticmethod
    def name_of(failure: Failure) -> str:
        """A failure's diagnosis by name (``diagnose.short``: ``mask polarity flipped``), or
        what the module raised, or "no diagnosis"."""
        if failure.reasons:
            return short(failure.reasons)
        return f"raised {failure.error.split(':')[0]}" if failure.error else "no diagnosis"

    def example(self, failure: Failure) -> tuple[list[str], str]:
        """A failure explained in full, for the one example of its group in the summary
        (``summary``): the lines saying its first failure (``explain_step``) and, for an sdpa
        case not failing by its layout, the smallest failing case ``shrink.shrink`` finds for
        that step and diagnosis, with ``shrink.reproducer``'s script apart ("" when none). The
        cell and the shrinking are computed here, once per group; ([], "") when the step no
        longer fails."""
        cell = self.cell(failure.case, failure.dtype)
        result = next((s for s in cell.steps if s.step == failure.step), None)
        if result is None or (result.passed and not result.error):
            return [], ""
        first = explain_step(cell, result).split("\n    why:")[0]  # the why is the group's
        lines = [f"first failure: {first}"]
        exp = self.expectation(failure.case, failure.dtype)
        if exp.kind != "sdpa" or failure.layout:
            return lines, ""
        why = self.diagnosis(cell, result)
        try:
            small = shrink(self.backend, exp, [result.step], "error" if result.error else "FAIL",
                           why)
            code = reproducer(self.backend, small, result.step, short(why) if why else "")
        except Exception as exc:  # noqa: BLE001 - the failure itself is still reported
            return [*lines, f"smallest failing case: not found ({type(exc).__name__}: {exc})"], ""
        options = f"; {small.data.options}" if small.data.options else ""
        return [*lines, f"smallest failing case ({result.step}; {shape_text(small)}; "
                        f"{small.dtype}{options}), runnable:"], code

    # ------------------------------------------------------------------ bad inputs

    def bad_input_outcome(self, name: str) -> Outcome:
        """One bad input: passed, skipped (declared unsupported, not provided) or failed with
        what the module raised and what the spec requires."""
        if self._errors is None:
            self._errors = runner.run_errors([self.backend], [])
        case = next(c for c in errors_mod.ERROR_CASES if c.name == name)
        found = next((r for r in self._errors if r.case == name), None)
        if found is None:  # run_errors left it out: the contract says why
            unsupported = self.backend.contract.unsupported if self.backend.contract else set()
            declared = {"errors"} & unsupported or plugins.call_features(*case.args()) & unsupported
            if declared:
                return Outcome(SKIPPED, f"declared unsupported: {', '.join(sorted(declared))}")
            return Outcome(SKIPPED, f"not provided: {case.fn}")
        if found.passed:
            return Outcome(PASSED)
        args, kwargs = case.args()
        call = ", ".join([_value(a) for a in args]
                         + [f"{k}={_value(v)}" for k, v in kwargs.items()])
        lines = [f"{self.name} · bad input {name}: {found.problem}",
                 f"  the call: {case.fn}({call})",
                 f"  the spec (ERRORS): {case.rule} -> {case.exception}, the message starting "
                 f"'{case.fn}:' and naming {', '.join(case.names)}"]
        if found.raised:
            lines.append(f"  raised {found.raised}: {found.message[:300]!r}")
        return Outcome(FAILED, "\n".join(lines))

    # ------------------------------------------------------------------ property checks

    def no_properties(self) -> str:
        """Why the property checks do not run (0 examples), and how to run them."""
        if self._examples_given:
            return "--attention-hypothesis 0: no property checks"
        if self.selecting:
            return ("cases or dtypes selected: no property checks (--attention-hypothesis N "
                    "runs them)")
        return (f"profile {self.profile.name}: no property checks (--attention-profile full or "
                f"--attention-hypothesis N runs them)")

    def properties_outcome(self) -> Outcome:
        """The property checks (``hypothesis`` examples): passed, skipped (0 examples,
        Hypothesis not installed, nothing the contract lets them draw) or failed with the
        minimal failing example as code."""
        if not self.hypothesis:
            return Outcome(SKIPPED, self.no_properties())
        if importlib.util.find_spec("hypothesis") is None:
            return Outcome(SKIPPED, "pip install hypothesis (for the property checks)")
        notes: list[str] = []
        view = runner.property_view(self.backend, notes)
        if view is None:
            return Outcome(SKIPPED, notes[0] if notes else "no property checks")
        try:
            outcome = properties.run([view], self.hypothesis).backends[0]
        except PluginFault as fault:  # a call that hung or killed the worker
            outcome = BackendProperties(self.backend.name, failure=fault.reason, reproducer=(
                f"# no reproducer; rerun: python -m conformance --backend {self.name} "
                f"--hypothesis {self.hypothesis}"))
        if outcome.note:
            return Outcome(SKIPPED, outcome.note)
        if outcome.failure:
            return Outcome(FAILED, PropertyResult(self.hypothesis, [outcome]).text())
        return Outcome(PASSED)


__all__ = ["FAILED", "PASSED", "SKIPPED", "Failure", "Outcome", "Suite"]
