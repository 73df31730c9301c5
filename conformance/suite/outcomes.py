"""What each item of the pytest plugin checks and says, with the harness's own machinery.

A ``Suite`` is one checked module in one process (one per pytest process, one per xdist worker);
it computes everything once and hands each item its ``Outcome``:

* **a case × dtype × step item**: the case's ``Expected`` (``expected.expected``) and its
  ``Cell`` (``runner.run_cell`` on that one expectation, every applicable step at once), each
  computed once per process and shared by the cell's step items; the item passes or fails as
  its ``StepResult`` does (``runner.judge``: ``compare`` and ``diagnose``). A failing step says
  the diagnosis, the first failure (``explain_step``), the smallest failing case
  ``shrink.shrink`` finds for that step and diagnosis as a runnable script
  (``shrink.reproducer``) and the command that reruns the cell in the harness's report; a
  failing sdpa cell of a checked module is also rerun transposed (``groups.transposed``), and
  when that passes the diagnosis is the wrong layout (``groups.LAYOUT_REASONS``), not shrunk,
  as in the verdict;
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

import importlib.util
import textwrap
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cases import catalogue as cases_mod
from ..cases.expected import Expected, expected
from ..comparing.results import BackendProperties, Cell, ErrorResult, PropertyResult, StepResult
from ..diagnosing.diagnose import short
from ..reporting import groups
from ..reporting.sections import explain_step
from ..reporting.shrink import reproducer, shape_text, shrink
from ..running import backends as backends_mod
from ..running import errors as errors_mod
from ..running import plugins, properties, runner
from ..running.backends import Backend
from ..running.module_worker import DEFAULT_TIMEOUT_S, PluginFault, check_timeout
from ..running.steps import STEPS, Execution, steps_for
from ..usage import UsageError

PASSED, SKIPPED, FAILED = "passed", "skipped", "failed"


@dataclass(frozen=True)
class Outcome:
    """An item's result: ``status`` (``PASSED``, ``SKIPPED`` or ``FAILED``) and its text (the
    skip reason, or the whole failure message)."""

    status: str
    message: str = ""


def _value(x: Any) -> str:
    """A bad input's argument in a few words: ``float32 (2, 4, 5, 8)``, or its repr."""
    if isinstance(x, np.ndarray):
        return f"{x.dtype} {tuple(x.shape)}"
    text = repr(x)
    return text if len(text) <= 40 else f"{type(x).__name__} ({len(x)} entries)"


class Suite:
    """One checked module in this process: the selected cases × dtypes, their cells, the bad
    inputs and the property checks, each computed once (see the module docstring).

    ``backend``: a dotted module path (``mypkg.attention``, run isolated in a worker process as
    ``python -m conformance --backend`` runs it), a spec backend's name, or a ``Backend``;
    None when the run names none (``missing`` then says what to give). ``cases``: glob patterns
    as ``--case`` (None: every case); ``dtypes`` (None: all four); ``hypothesis``: examples of
    the property checks (0: skipped); ``timeout``: seconds per call of a module in a worker
    (0: no limit). A bad selection or timeout is a ``UsageError`` naming the option.
    """

    def __init__(self, backend: str | Backend | None, *, cases: list[str] | None = None,
                 dtypes: list[str] | None = None, hypothesis: int = 0,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        try:
            self.cases = [c.name for c in cases_mod.select(cases)]
        except UsageError as exc:
            raise UsageError(f"--attention-case: {exc}") from None
        unknown = [d for d in dtypes or () if d not in backends_mod.DTYPES]
        if unknown:
            raise UsageError(f"--attention-dtype {unknown[0]!r} is not a dtype of the spec; "
                             f"expected one of {', '.join(backends_mod.DTYPES)}")
        self.dtypes = list(dict.fromkeys(dtypes or backends_mod.DTYPES))
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
        """``(case, dtype, step)`` of every compared step of the selected cases × dtypes, in
        the report's order; the same in every process (the inputs are seeded)."""
        return [(case, dtype, step.name) for case in self.cases for dtype in self.dtypes
                for step in steps_for(self.expectation(case, dtype))]

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
            return Outcome(FAILED, f"{self.name} · {case} · {dtype} · {step}: {cell.status}: "
                                   f"{cell.detail} (the cell ended at that call)\n"
                                   f"rerun the cell in the harness's report: {cell.rerun}")
        result = next((s for s in cell.steps if s.step == step), None)
        if result is None:
            return Outcome(SKIPPED, f"unsupported: {step} raised NotImplementedError")
        if result.passed and not result.error:
            return Outcome(PASSED)
        return Outcome(FAILED, self.failure_text(cell, result))

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

    def smallest(self, exp: Expected, result: StepResult, why: str) -> str:
        """``shrink.shrink`` for one failed step (same status, same diagnosis), printed as
        ``shrink.reproducer``'s script under a line naming its shapes and dtype."""
        status = "error" if result.error else "FAIL"
        try:
            small = shrink(self.backend, exp, [result.step], status, why)
            code = reproducer(self.backend, small, result.step, short(why) if why else "")
        except Exception as exc:  # noqa: BLE001 - the failure itself is still reported
            return f"smallest failing case: not found ({type(exc).__name__}: {exc})"
        options = f"; {small.data.options}" if small.data.options else ""
        return (f"smallest failing case ({result.step}; {shape_text(small)}; {small.dtype}"
                f"{options}), runnable:\n" + textwrap.indent(code, "    "))

    def failure_text(self, cell: Cell, result: StepResult) -> str:
        """The message of a failed step: what failed and why (the diagnosis), the first
        failure, the smallest failing case as a script (sdpa cases), the rerun command."""
        exp = self.expectation(cell.case, cell.dtype)
        why = self.diagnosis(cell, result)
        layout = self.layout_reason(cell.case, cell.dtype)
        name = short(layout or why) or (f"raised {result.error.split(':')[0]}" if result.error
                                         else "no diagnosis")
        lines = [f"{self.name} · {cell.case} · {cell.dtype} · {result.step}: {name}",
                 explain_step(cell, result)]
        if layout:
            lines += textwrap.wrap(f"why: {layout}", 96, subsequent_indent="  ")
        elif exp.kind == "sdpa":
            lines.append(self.smallest(exp, result, why))
        lines.append(f"rerun the cell in the harness's report: {cell.rerun}")
        return "\n".join(lines)

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

    def properties_outcome(self) -> Outcome:
        """The property checks (``hypothesis`` examples): passed, skipped (0 examples,
        Hypothesis not installed, nothing the contract lets them draw) or failed with the
        minimal failing example as code."""
        if not self.hypothesis:
            return Outcome(SKIPPED, "--attention-hypothesis 0: no property checks")
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


__all__ = ["FAILED", "PASSED", "SKIPPED", "Outcome", "Suite"]
