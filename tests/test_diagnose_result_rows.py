"""``conformance.diagnosing.diagnose``'s diagnoses that look at the result itself, called
directly: ``non_finite_rows`` (NaN spread or missing, NaN in fully masked rows, softmax
overflow), ``mean_of_value``, ``lse_mistakes`` (log2, fully masked rows at 0 or +inf, the sink left
out) and ``sink_in_numerator``.

Each test builds a wrong result by hand (the float64 reference, ``conformance.cases.reference``,
with the mistake written out in NumPy: NaN in fully masked rows, the mean of ``value``, an lse in
log2, a sink in the numerators, …) and asserts the diagnosis's full text, or none for a result that
is right or wrong in another way; expectations come from the mistake planted, never from the
diagnosis's output. Small cases, plain NumPy, no backend: a few seconds. The tests came from
mutation testing (docs/mutation.md).
"""

from __future__ import annotations

import numpy as np
import pytest
from diagnose_inputs import attend, expected_for_arrays, expected_of

from conformance.cases import catalogue as cases
from conformance.cases import expected
from conformance.diagnosing import diagnose

F32 = np.float32


# ------------------------------------------------------------------------------ non_finite_rows

NAN_SPREAD = ("NaN reached positions the spec keeps finite: masking must replace a masked score "
              "by -inf (NaN + -inf is NaN), and a NaN reaches only the rows that attend it")
NAN_ZERO = "a NaN/Inf input gave 0 where the spec's IEEE rule gives NaN (the row was treated " \
    "like a fully masked row)"
NAN_MISSING = "a NaN/Inf input did not reach positions the spec's IEEE rule makes NaN"
EMPTY_NAN = ("fully masked rows give NaN (softmax of a row of -inf, 0 / 0); the spec gives "
             "exactly 0")
NOT_FINITE = "non-finite values where the reference is finite"


def test_non_finite_rows_on_non_finite_inputs_names_nan_spread_or_missing() -> None:
    exp = expected_of("nan_query")
    ref = exp.values["output"]
    nan = np.isnan(ref)
    assert nan.any() and not nan.all()
    spread = ref.copy()
    spread[~nan.any(-1)] = np.nan  # every finite row NaN as well
    assert diagnose.non_finite_rows(exp, "output", spread) == NAN_SPREAD
    zero = np.where(nan, 0.0, ref)
    assert diagnose.non_finite_rows(exp, "output", zero) == NAN_ZERO
    three = np.where(nan, 3.0, ref)
    assert diagnose.non_finite_rows(exp, "output", three) == NAN_MISSING
    some_zero = three.copy()
    some_zero[tuple(np.argwhere(nan)[0])] = 0.0  # one of the missing NaNs 0, the others 3
    assert diagnose.non_finite_rows(exp, "output", some_zero) == NAN_MISSING
    assert diagnose.non_finite_rows(exp, "output", ref) == ""
    assert diagnose.non_finite_rows(exp, "output", ref + 1.0) == ""  # wrong, but not NaN
    lse = exp.values["lse"]  # a step without unspecified positions
    assert diagnose.non_finite_rows(exp, "lse", np.where(np.isnan(lse), lse, np.nan)
                                    ) == NAN_SPREAD
    assert diagnose.non_finite_rows(exp, "lse", np.where(np.isnan(lse), 1.0, lse)
                                    ) == NAN_MISSING


def test_non_finite_rows_spread_beats_missing_and_free_positions_take_any_value() -> None:
    exp = expected_of("nan_query")
    ref = exp.values["output"]
    nan = np.isnan(ref)
    both = np.where(nan, 0.0, np.nan)  # NaN moved: missing where due, spread elsewhere
    assert diagnose.non_finite_rows(exp, "output", both) == NAN_SPREAD
    causal = expected_of("nan_value_causal")
    free = causal.unspecified["output"]
    assert free.any()
    right = np.where(free, 1.0, causal.values["output"])  # finite where the spec allows any
    assert diagnose.non_finite_rows(causal, "output", right) == ""
    assert diagnose.non_finite_rows(causal, "output", np.where(free, 0.0, right)) == ""


def test_non_finite_rows_names_nan_in_fully_masked_rows_only_when_only_they_are_nan() -> None:
    exp = expected_of("fully_masked_rows")
    empty = np.isneginf(exp.values["masked_scores"]).all(-1)
    assert empty.any() and not empty.all()
    for step in ("output", "weights", "output_weights"):
        actual = np.where(empty[..., None], np.nan, exp.values[step])
        assert diagnose.non_finite_rows(exp, step, actual) == EMPTY_NAN
        # one empty row NaN is enough; NaN in a row with keys is another fault
        one = exp.values[step].copy()
        one[tuple(np.argwhere(empty)[0])] = np.nan
        assert diagnose.non_finite_rows(exp, step, one) == EMPTY_NAN
        kept = tuple(np.argwhere(~empty)[0])
        one[kept] = np.nan
        assert diagnose.non_finite_rows(exp, step, one) == NOT_FINITE
    # a partially masked row: -inf in its scores, yet not an empty row; no overflow either
    partial = expected_of("mask_and_bias")
    actual = partial.values["output"].copy()
    actual[0, 0, 0, 0] = np.nan
    assert np.isneginf(partial.values["masked_scores"][0, 0, 0]).any()
    assert diagnose.non_finite_rows(partial, "output", actual) == NOT_FINITE
    for step in ("lse", "scores", "masked_scores"):  # not an output or weights step
        assert diagnose.non_finite_rows(exp, step, exp.values[step] * np.nan) == ""


def test_non_finite_rows_names_inf_and_softmax_overflow() -> None:
    exp = expected_of("self")
    actual = exp.values["output"].copy()
    actual[1, 2, 3, 4] = np.inf  # no NaN, an Inf where the reference is finite
    assert diagnose.non_finite_rows(exp, "output", actual) == NOT_FINITE
    assert diagnose.non_finite_rows(exp, "output", exp.values["output"]) == ""
    two_d = expected_of("two_d")  # an output of rank 2
    actual = two_d.values["output"].copy()
    actual[0] = np.nan
    assert diagnose.non_finite_rows(two_d, "output", actual) == NOT_FINITE
    huge = expected_of("huge_logits")
    big = np.abs(huge.values["masked_scores"]).max()
    assert big > 1000
    actual = huge.values["output"].copy()
    actual[0, 0, 0] = np.nan
    assert diagnose.non_finite_rows(huge, "output", actual) == (
        f"non-finite values with logits up to {big:.3g}: the softmax overflows (exp without "
        "subtracting the row maximum?)")


@pytest.mark.parametrize(("logit", "overflow"), [(80.0, False), (80.5, True), (-81.0, True)])
def test_non_finite_rows_calls_logits_above_80_an_overflow(logit: float, overflow: bool) -> None:
    """One query, two keys, scale 1: the scores are exactly ``logit`` and 1."""
    exp = expected_for_arrays({"query": np.array([[logit, 1.0]]),
                               "key": np.array([[1.0, 0.0], [0.0, 1.0]]),
                               "value": np.array([[1.0], [2.0]])}, scale=1.0)
    assert np.abs(exp.values["masked_scores"]).max() == abs(logit)
    text = diagnose.non_finite_rows(exp, "output", np.array([[np.nan]]))
    assert text == (f"non-finite values with logits up to {abs(logit):.3g}: the softmax "
                    "overflows (exp without subtracting the row maximum?)" if overflow
                    else NOT_FINITE)


# ------------------------------------------------------------------------------ mean_of_value

MEAN = "fully masked rows give the mean of value (uniform weights); the spec gives exactly 0"


def _with_mean(exp: expected.Expected, offset: float = 0.0) -> np.ndarray:
    """``exp``'s output with its fully masked rows set to the mean of their kv head's values
    (query head h reads kv head h // (heads // kv_heads)), plus ``offset``."""
    ref = exp.values["output"]
    v = np.asarray(exp.data.arrays["value"], np.float64)
    if ref.ndim >= 3:
        heads, kv_heads = ref.shape[-3], v.shape[-3]
        v = np.take(v, [h // (heads // kv_heads) for h in range(heads)], axis=-3)
    mean = v.mean(-2, keepdims=True)  # (..., heads, 1, v_dim)
    empty = np.isneginf(exp.values["masked_scores"]).all(-1)[..., None]
    return np.where(empty, mean + offset, ref)


def _gqa_fully_masked(rank: int, size: float = 1.0) -> expected.Expected:
    """4 query heads over 2 kv heads (rank 4: a batch of 1; rank 3; rank 2: one head), rows
    (1, 2) and (3, 0) fully masked, values of about ``size``."""
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((4, 3, 2)), rng.standard_normal((2, 5, 2)), \
        rng.standard_normal((2, 5, 3)) * size
    mask = rng.random((4, 3, 5)) < 0.7
    mask[1, 2] = False
    mask[3, 0] = False
    arrays = {"query": q, "key": k, "value": v, "mask": mask}
    if rank == 4:
        arrays = {n: x[None] for n, x in arrays.items()}
    if rank == 2:
        arrays = {"query": q[1], "key": k[0], "value": v[0], "mask": mask[1]}
    return expected_for_arrays(arrays, "float32")


def test_mean_of_value_allows_a_relative_error_of_large_values() -> None:
    """Values of about 100 averaged in bfloat16 (relative error up to 2**-8): still named."""
    exp = _gqa_fully_masked(3, size=100.0)
    mean = _with_mean(exp)
    rows = np.isneginf(exp.values["masked_scores"]).all(-1)
    assert np.abs(mean[rows]).max() > 30  # 2**-8 of it: above 1e-2
    assert diagnose.mean_of_value(exp, "output", mean * (1 + 2.0 ** -8)) == MEAN


@pytest.mark.parametrize("make", [lambda: expected_of("fully_masked_rows"),
                                  lambda: _gqa_fully_masked(4), lambda: _gqa_fully_masked(3),
                                  lambda: _gqa_fully_masked(2)])
def test_mean_of_value_names_uniform_weights_in_fully_masked_rows(make: object) -> None:
    exp = make()
    assert diagnose.mean_of_value(exp, "output", _with_mean(exp)) == MEAN
    assert diagnose.mean_of_value(exp, "output", _with_mean(exp, 5e-3)) == MEAN
    assert diagnose.mean_of_value(exp, "output", _with_mean(exp, 0.5)) == ""
    assert diagnose.mean_of_value(exp, "output", exp.values["output"]) == ""
    nan = _with_mean(exp)
    nan[(0,) * nan.ndim] = np.nan  # a NaN elsewhere is another fault
    assert diagnose.mean_of_value(exp, "output", nan) == ""


def test_mean_of_value_needs_fully_masked_rows_and_an_output_step() -> None:
    exp = expected_of("mask_and_bias")  # masked positions, no fully masked row
    v = exp.data.arrays["value"].astype(np.float64)
    uniform = np.broadcast_to(v.mean(-2, keepdims=True), exp.values["output"].shape)
    assert diagnose.mean_of_value(exp, "output", uniform) == ""
    masked = expected_of("fully_masked_rows")
    weights = np.where(np.isneginf(masked.values["masked_scores"]).all(-1, keepdims=True),
                       1 / 7, masked.values["weights"])
    assert diagnose.mean_of_value(masked, "weights", weights) == ""
    merge = expected_of("merge_empty_split_sinks_gqa", "float64")  # no masked_scores step
    assert diagnose.mean_of_value(merge, "merge_output", merge.values["merge_output"] + 1) == ""


# ------------------------------------------------------------------------------ lse_mistakes

LOG2 = ("the lse is in log2 (log2-sum-exp2, as kernels keep it internally); the spec's lse is "
        "the natural log: multiply by ln 2")
EMPTY_LSE = ("fully masked rows give lse 0 or +inf; the spec gives -inf, so that a merge gives "
             "such a part no weight")
NO_SINK = ("the lse leaves the sink out: it is the log of the denominator actually used, "
           "exp(sink) included")


@pytest.mark.parametrize(("name", "step"), [("fully_masked_rows", "lse"), ("self", "lse"),
                                            ("kv_lengths", "blockwise_lse")])
def test_lse_mistakes_names_an_lse_in_log2(name: str, step: str) -> None:
    exp = expected_of(name)
    ref = exp.values[step]
    assert diagnose.lse_mistakes(exp, step, ref / np.log(2)) == LOG2
    assert diagnose.lse_mistakes(exp, step, ref) == ""
    assert diagnose.lse_mistakes(exp, step, ref + 1.0) == ""


def test_lse_mistakes_names_fully_masked_rows_at_zero_or_plus_inf() -> None:
    exp = expected_of("fully_masked_rows")
    ref = exp.values["lse"]
    empty = np.isneginf(ref)
    assert empty.any() and not empty.all()
    first = tuple(np.argwhere(empty)[0])
    for fill in (0.0, np.inf):
        assert diagnose.lse_mistakes(exp, "lse", np.where(empty, fill, ref)) == EMPTY_LSE
    mixed = np.where(empty, 0.0, ref)
    mixed[first] = np.inf
    assert diagnose.lse_mistakes(exp, "lse", mixed) == EMPTY_LSE
    # the other rows' values are not judged here, only that they are finite
    assert diagnose.lse_mistakes(exp, "lse", np.where(empty, 0.0, ref + 0.5)) == EMPTY_LSE
    other = mixed.copy()
    other[first] = 5.0  # neither 0 nor +inf
    assert diagnose.lse_mistakes(exp, "lse", other) == ""
    nan = np.where(empty, 0.0, ref)
    nan[tuple(np.argwhere(~empty)[0])] = np.nan
    assert diagnose.lse_mistakes(exp, "lse", nan) == ""
    # no fully masked row: an lse of 0 somewhere is no such mistake
    self = expected_of("self")
    zero = self.values["lse"].copy()
    zero[0, 0, 0] = 0.0
    assert diagnose.lse_mistakes(self, "lse", zero) == ""


def test_lse_mistakes_takes_any_finite_lse_in_the_other_rows() -> None:
    """Logits near the float64 maximum: a row's lse of 1.5e308 is finite (the sum of two such
    values is not)."""
    exp = expected_for_arrays({"query": np.array([[1e154], [1e154]]),
                               "key": np.array([[1.5e154], [1.0]]),
                               "value": np.array([[1.0], [2.0]]),
                               "mask": np.array([[True, True], [False, False]])}, scale=1.0)
    ref = exp.values["lse"]
    assert ref[0] > 1.4e308 and ref[1] == -np.inf
    with np.errstate(over="ignore"):  # the lse in log2 overflows
        assert diagnose.lse_mistakes(exp, "lse", np.array([1.5e308, 0.0])) == EMPTY_LSE


@pytest.mark.parametrize("name", ["sinks_fully_masked_rows", "sinks_gqa_kv_lengths",
                                  "sinks_causal_softcap"])
def test_lse_mistakes_names_an_lse_without_the_sink(name: str) -> None:
    exp = expected_of(name)
    no_sink = attend(exp, sinks=None).lse  # -inf for rows with no key
    assert not np.array_equal(no_sink, exp.values["lse"])
    assert diagnose.lse_mistakes(exp, "lse", no_sink.astype(F32).astype(np.float64)) == NO_SINK
    assert diagnose.lse_mistakes(exp, "lse", exp.values["lse"]) == ""


def test_lse_mistakes_without_sinks_and_outside_the_lse_steps_name_nothing() -> None:
    exp = expected_of("self")
    assert diagnose.lse_mistakes(exp, "output", exp.values["output"] / np.log(2)) == ""
    merge = expected_of("merge_two_splits", "float64")
    assert diagnose.lse_mistakes(merge, "merge_lse", merge.values["merge_lse"] / np.log(2)
                                 ) == ""
    gqa = expected_of("gqa")  # no sinks: the lse of the attention itself is no mistake
    assert diagnose.lse_mistakes(gqa, "lse", gqa.values["lse"] - 1.0) == ""


# ------------------------------------------------------------------------------ sink_in_numerator

SINK_NUM = ("the sink's term is added to every weight's numerator too: the sink belongs to the "
            "softmax denominator alone (it carries no value)")


def _sink_in_numerators(exp: expected.Expected) -> tuple[np.ndarray, np.ndarray]:
    """Weights ``exp(s_ij - lse) + exp(sink - lse)`` on the allowed keys (0 where masked, and
    where no column of the row is allowed) and their output."""
    a = exp.data.arrays
    lse = exp.values["lse"][..., None]
    sinks = np.asarray(a["sinks"], np.float64)
    sink = sinks[:, None, None] if lse.ndim >= 3 else sinks.reshape(1, 1)
    with np.errstate(all="ignore"):
        extra = np.where(np.isneginf(lse), 0.0, np.exp(sink - lse))
    allowed = ~np.isneginf(exp.values["masked_scores"])
    weights = np.where(allowed, exp.values["output_weights"] + extra, 0.0)
    v = np.asarray(a["value"], np.float64)
    if v.ndim >= 3:
        v = np.repeat(v, weights.shape[-3] // v.shape[-3], axis=-3)
    return weights, weights @ v


def _minus_inf_sink() -> expected.Expected:
    """sinks_fully_masked_rows with head 3's sink -inf: its fully masked rows have lse -inf."""
    data = cases.prepare_inputs(cases.get("sinks_fully_masked_rows"), "float64")
    sinks = data.arrays["sinks"].copy()
    sinks[3] = -np.inf
    return expected_for_arrays({**data.arrays, "sinks": sinks})


@pytest.mark.parametrize("make", [lambda: expected_of("sinks_fully_masked_rows"),
                                  lambda: expected_of("sinks_gqa_kv_lengths"), _minus_inf_sink])
def test_sink_in_numerator_names_the_sink_in_every_weight(make: object) -> None:
    exp = make()
    weights, output = _sink_in_numerators(exp)
    assert np.isfinite(output).all()
    steps = {"output": output, "output_weights": weights}
    if "blockwise_output" in exp.values:
        steps["blockwise_output"] = output
    with np.errstate(invalid="ignore"):  # exp(-inf - -inf) where lse is -inf, then replaced
        for step, actual in steps.items():
            assert diagnose.sink_in_numerator(exp, step, actual) == SINK_NUM
            assert diagnose.sink_in_numerator(exp, step, exp.values[step]) == ""
        assert diagnose.sink_in_numerator(exp, "weights", weights) == ""


def test_sink_in_numerator_takes_unbatched_inputs_and_needs_sinks() -> None:
    rng = np.random.default_rng(7)
    arrays = {"query": rng.standard_normal((4, 3, 2)), "key": rng.standard_normal((2, 5, 2)),
              "value": rng.standard_normal((2, 5, 3)), "sinks": rng.standard_normal(4),
              "bias": rng.standard_normal((3, 5)) * 2}
    exp = expected_for_arrays(arrays, is_causal=True)
    weights, output = _sink_in_numerators(exp)
    assert diagnose.sink_in_numerator(exp, "output", output) == SINK_NUM
    assert diagnose.sink_in_numerator(exp, "output_weights", weights) == SINK_NUM
    two_d = expected_for_arrays({"query": arrays["query"][0], "key": arrays["key"][0],
                                 "value": arrays["value"][0], "sinks": arrays["sinks"][:1],
                                 "bias": arrays["bias"]})
    weights, output = _sink_in_numerators(two_d)
    assert diagnose.sink_in_numerator(two_d, "output", output) == SINK_NUM
    plain = expected_of("self")
    assert diagnose.sink_in_numerator(plain, "output", plain.values["output"] + 1.0) == ""
