"""``conformance.comparing.compare``, the one tolerance rule, against hand-derived numbers.

Every expected ratio, bound and verdict here is worked out by hand from ``spec.TOLERANCES``
(float32: ``atol = 1e-7``, ``rtol = 0``, ``k = 10``; float64: ``atol = rtol = 1e-12``,
``k = 2``), never read back from the code under test. Plain NumPy, microseconds per test.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.comparing.compare import compare, compare_step


def test_float32_bound_is_atol_plus_k_times_the_naive_error() -> None:
    # bound = 1e-7 + 0·|e| + 10 · 2e-7 = 2.1e-6; an error of 1.05e-6 is half of it
    res = compare("output", np.array([2.0 + 1.05e-6]), np.array([2.0]), 2e-7, "float32")
    assert res.passed
    assert res.ratio == pytest.approx(0.5, rel=1e-6)
    assert res.bound == pytest.approx(2.1e-6, rel=1e-12)
    assert (res.index, res.expected) == ((0,), 2.0)


def test_float64_bound_has_a_relative_term() -> None:
    # bound = 1e-12 + 1e-12 · 1000 + 2 · 0 = 1.001e-9; an error of 2.002e-9 is twice the bound
    res = compare("lse", np.array([1000.0 + 2.002e-9]), np.array([1000.0]), 0.0, "float64")
    assert not res.passed
    assert res.ratio == pytest.approx(2.0, rel=1e-3)
    assert res.bound == pytest.approx(1.001e-9, rel=1e-12)


def test_a_nan_baseline_counts_as_no_naive_error() -> None:
    res = compare("output", np.array([1.0 + 5e-8]), np.array([1.0]), float("nan"), "float32")
    assert res.passed and res.bound == pytest.approx(1e-7, rel=1e-12)  # atol alone


def test_the_worst_position_is_reported_with_its_values() -> None:
    expected = np.zeros((2, 3))
    actual = expected.copy()
    actual[1, 2], actual[0, 1] = 4e-7, 2e-7  # ratios 4 and 2 against atol 1e-7
    res = compare("weights", actual, expected, 0.0, "float32")
    assert (res.passed, res.index, res.actual, res.expected) == (False, (1, 2), 4e-7, 0.0)
    assert res.ratio == pytest.approx(4.0, rel=1e-6)
    assert (res.step, res.note) == ("weights", "")


def test_exact_values_nan_and_infinities_must_match_exactly() -> None:
    expected = np.array([np.nan, -np.inf, np.inf, 1.0])
    res = compare("s", expected.copy(), expected, 0.0, "float32")
    assert (res.passed, res.ratio) == (True, 0.0)
    for position, wrong, why in (
            (0, 0.0, "must be NaN (the spec's IEEE rule: a NaN/Inf input reaches this position)"),
            (1, -1e30, "the reference is -inf (masked) here"),
            (2, -np.inf, "the reference is +inf here"),
            (3, np.nan, "NaN where the reference is finite")):
        actual = expected.copy()
        actual[position] = wrong
        res = compare("s", actual, expected, 0.0, "float32")
        assert (res.passed, res.ratio, res.index, res.note) == (False, np.inf, (position,), why)
    res = compare("s", np.array([1.0, np.inf]), np.array([1.0, 2.0]), 0.0, "float32")
    assert (res.passed, res.index, res.note) == (
        False, (1,), "non-finite value where the reference is finite")


def test_zeros_must_be_exact_and_unspecified_positions_pass() -> None:
    expected = np.array([0.0, 0.0, 1.0])
    actual = np.array([1e-9, 0.0, 1.0])  # within atol, but position 0 must be exactly 0
    zeros = np.array([True, True, False])
    res = compare("weights", actual, expected, 0.0, "float32", zeros=zeros)
    assert (res.passed, res.ratio, res.index) == (False, np.inf, (0,))
    assert res.note == "must be exactly 0 (masked position or fully masked row)"
    free = np.array([True, False, False])
    res = compare("weights", actual, expected, 0.0, "float32", zeros=zeros, unspecified=free)
    assert (res.passed, res.ratio, res.note) == (True, 0.0, "")
    res = compare("weights", np.array([5.0, 0.0, 1.0]), expected, 0.0, "float32",
                  unspecified=free)
    assert (res.passed, res.ratio) == (True, 0.0)


def test_shape_mismatch_and_empty_results() -> None:
    res = compare("output", np.zeros((2, 3)), np.zeros((3, 2)), 0.0, "float32")
    assert (res.step, res.passed, res.ratio, res.note) == (
        "output", False, np.inf, "shape (2, 3), expected (3, 2)")
    res = compare("lse", np.zeros((0, 3)), np.zeros((0, 3)), 0.0, "float32")
    assert (res.step, res.passed, res.ratio, res.index) == ("lse", True, 0.0, None)


def test_a_ratio_of_exactly_one_passes_and_above_fails() -> None:
    # float32 with no naive error: bound = atol = 1e-7 exactly as compare computes it
    res = compare("output", np.array([1e-7]), np.array([0.0]), 0.0, "float32")
    assert (res.passed, res.ratio) == (True, 1.0)
    res = compare("output", np.array([1.5e-7]), np.array([0.0]), 0.0, "float32")
    assert not res.passed and res.ratio == pytest.approx(1.5)


@pytest.mark.parametrize(("dtype", "result_dtype", "given", "ok"), [
    ("bfloat16", "compute", np.float32, True), ("bfloat16", "compute", np.float64, False),
    ("float16", "input", np.float16, True), ("float16", "input", np.float32, False),
    ("float32", None, np.float64, True)])
def test_result_dtype_is_checked_against_the_spec(dtype: str, result_dtype: str | None,
                                                  given: type, ok: bool) -> None:
    res = compare("output", np.array([1.0], given), np.array([1.0]), 0.0, dtype,
                  result_dtype=result_dtype)
    assert (res.passed, res.ratio) == (ok, 0.0)
    if not ok:
        want = "float32" if result_dtype == "compute" else dtype
        assert res.note == f"dtype {np.dtype(given).name}, the spec requires {want}"


def test_a_dtype_note_follows_a_value_note() -> None:
    res = compare("output", np.array([np.nan], np.float64), np.array([1.0]), 0.0, "float32",
                  result_dtype="input")
    assert res.note == ("NaN where the reference is finite; dtype float64, the spec requires "
                        "float32")


def test_compare_step_reads_values_baseline_zeros_and_unspecified_of_the_step() -> None:
    from conformance.cases import catalogue as cases
    from conformance.cases import expected

    exp = expected.expected(cases.get("fully_masked_rows"), "float32")
    weights = exp.values["weights"].astype(np.float32)
    res = compare_step(exp, "weights", weights, "input")
    assert (res.step, res.passed) == ("weights", True)
    assert not compare_step(exp, "weights", weights.astype(np.float64), "input").passed
    assert exp.zeros["weights"].any()
    broken = weights.copy()
    broken[np.broadcast_to(exp.zeros["weights"], broken.shape)] = 1e-30
    res = compare_step(exp, "weights", broken)
    assert (res.passed, res.note) == (False, "must be exactly 0 (masked position or fully "
                                             "masked row)")
    worst = 1e-7 + 10 * exp.baseline["weights"]  # the bound of the float32 row by hand
    near = exp.values["weights"] + np.where(exp.zeros["weights"], 0.0, 0.5 * worst)
    res = compare_step(exp, "weights", near)
    assert res.passed and res.ratio == pytest.approx(0.5, rel=1e-3)


def test_compare_step_lets_the_unspecified_positions_of_the_step_pass() -> None:
    """``inf_key``: an infinite key leaves 20 weights unspecified (the spec's NaN rule allows any
    value there)."""
    from conformance.cases import catalogue as cases
    from conformance.cases import expected

    exp = expected.expected(cases.get("inf_key"), "float32")
    free = np.broadcast_to(exp.unspecified["weights"], exp.values["weights"].shape)
    assert free.sum() == 20
    weights = np.where(free, 123.0, exp.values["weights"]).astype(np.float32)
    res = compare_step(exp, "weights", weights, "input")
    assert res.passed and res.index is not None and not free[res.index]
