"""The one tolerance rule: a step's result against its float64 expected value.

``compare`` is used by the harness's cells, the peers, the golden-vector check, the property
checks and the walkthrough. A step passes when, everywhere,

    |actual - expected| <= bound = atol + rtol·|expected| + k·e      (spec.TOLERANCES[dtype])

with ``e`` the naive implementation's error on the same inputs (``conformance.cases.naive``), and
when exact values are exact: NaN where the expected value is NaN, the same ``±inf`` where it is
infinite, exactly 0 at the ``zeros`` positions; ``unspecified`` positions accept any value.
The step's ratio is the worst ``|actual - expected| / bound`` (``inf`` for an exact value
missed): at most 1 passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import spec
from ..cases.dtypes import numpy_dtype
from ..cases.expected import Expected


@dataclass
class StepResult:
    """One step of one cell: the worst error relative to its tolerance, and where."""

    step: str
    ratio: float  # worst |actual - expected| / bound; inf for an exact value missed
    passed: bool
    index: tuple[int, ...] | None = None
    actual: float | None = None
    expected: float | None = None
    bound: float | None = None
    note: str = ""
    error: str = ""  # the backend raised


def tolerance(dtype: str) -> dict[str, float]:
    """``spec.TOLERANCES[dtype]``: k, atol, rtol."""
    return spec.TOLERANCES[dtype]


def bound(expected_value: np.ndarray, baseline: float, dtype: str) -> np.ndarray:
    """``atol + rtol·|expected| + k·e``, shaped like ``expected_value``."""
    tol = tolerance(dtype)
    e = baseline if np.isfinite(baseline) else 0.0
    with np.errstate(invalid="ignore"):
        return tol["atol"] + tol["rtol"] * np.abs(expected_value) + tol["k"] * e


def _why_exact(a: float, e: float) -> str:
    if np.isnan(e):
        return "must be NaN (the spec's IEEE rule: a NaN/Inf input reaches this position)"
    if np.isnan(a):
        return "NaN where the reference is finite"
    if np.isinf(e):
        return "the reference is -inf (masked) here" if e < 0 else "the reference is +inf here"
    return "non-finite value where the reference is finite"


def compare(step: str, actual: Any, expected_value: np.ndarray, baseline: float, dtype: str,
            zeros: np.ndarray | None = None, result_dtype: str | None = None,
            unspecified: np.ndarray | None = None) -> StepResult:
    """Compare one step's result with its float64 expected value under ``spec.TOLERANCES``.

    Args:
      step: the step's name, for the result.
      actual: the backend's result, any float dtype, shaped like ``expected_value``.
      expected_value: float64; NaN and ``±inf`` must be matched exactly.
      baseline: the naive implementation's error ``e`` for this step.
      dtype: the input dtype (selects the tolerance row).
      zeros: bool, broadcastable: positions that must be exactly 0.
      result_dtype: ``"input"`` or ``"compute"``: the dtype the spec requires of ``actual``.
      unspecified: bool, broadcastable: positions where any value passes.
    """
    actual = np.asarray(actual)
    e = np.asarray(expected_value, dtype=np.float64)
    if actual.shape != e.shape:
        return StepResult(step, float("inf"), False,
                          note=f"shape {actual.shape}, expected {e.shape}")
    a = actual.astype(np.float64)
    limit = np.broadcast_to(bound(e, baseline, dtype), e.shape)
    with np.errstate(all="ignore"):
        exact = np.where(np.isnan(e), np.isnan(a), a == e)  # NaN and ±inf must match
        ratio = np.where(np.isfinite(e), np.abs(a - e) / limit, np.where(exact, 0.0, np.inf))
    ratio = np.where(np.isnan(ratio), np.inf, ratio)  # NaN where a finite value is expected
    note = ""
    if zeros is not None:
        nonzero = np.broadcast_to(zeros, a.shape) & (a != 0)
        if unspecified is not None:
            nonzero = nonzero & ~np.broadcast_to(unspecified, a.shape)
        if nonzero.any():
            ratio = np.where(nonzero, np.inf, ratio)
            note = "must be exactly 0 (masked position or fully masked row)"
    if unspecified is not None:
        ratio = np.where(np.broadcast_to(unspecified, a.shape), 0.0, ratio)
    if ratio.size == 0:
        return StepResult(step, 0.0, True)
    flat = int(np.argmax(ratio))
    index = tuple(int(i) for i in np.unravel_index(flat, ratio.shape))
    worst = float(ratio.flat[flat])
    if not note and not np.isfinite(worst):
        note = _why_exact(float(a.flat[flat]), float(e.flat[flat]))
    passed = worst <= 1.0
    if result_dtype is not None:
        want = np.dtype(numpy_dtype(dtype if result_dtype == "input"
                                    else spec.COMPUTE_DTYPE[dtype]))
        if actual.dtype != want:
            passed = False
            note = (note + "; " if note else "") + (
                f"dtype {actual.dtype.name}, the spec requires {want.name}")
    return StepResult(step, worst, passed, index, float(a.flat[flat]), float(e.flat[flat]),
                      float(limit.flat[flat]), note)


def compare_step(exp: Expected, step: str, actual: Any, result_dtype: str | None = None
                 ) -> StepResult:
    """``compare`` a result of ``step`` with ``exp``: its value, baseline error, exact zeros and
    unspecified positions."""
    with np.errstate(all="ignore"):
        return compare(step, actual, exp.values[step], exp.baseline[step], exp.dtype,
                       exp.zeros.get(step), result_dtype, exp.unspecified.get(step))


__all__ = ["StepResult", "bound", "compare", "compare_step", "tolerance"]
