"""Behaviour of the functional API, on every backend, against hand goldens and float64.

Expected values come from hand computation (goldens) or from ``conformance.cases.reference``, an
independent float64 implementation; never from the backend under test. The inputs of the
pipeline tests are the conformance case catalogue (``conformance.cases``) and their tolerance
is the harness's one rule (``conformance.comparing.compare``: ``spec.TOLERANCES`` scaled by a naive
implementation's error in the same dtype). Every case × dtype × step through the harness is
``tests/test_harness_grid.py``'s; this file adds what the harness does not look at: the default
call's path (no ``return_weights``), floating-point warnings, and JAX with x64 off.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np
import pytest
from harness_helpers import _expected

from conformance.cases import catalogue as cases
from conformance.cases import expected, mods, reference
from conformance.comparing import compare
from conformance.running import backends

DTYPES = backends.DTYPES
# chunks, ALiBi, segment ids and mods: their default calls are tests/test_masks_and_mods.py's
SDPA_CASES = [case for case in cases.CASES
              if case.kind == "sdpa" and not mods.uses_mods(case.data())]


def _call(backend, fn_name, *arrays, **kwargs):
    """Call ``backend.module.fn_name`` on NumPy arrays; convert array results back."""
    fn = getattr(backend.module, fn_name)
    converted = [backend.asarray(a) if isinstance(a, np.ndarray) else a for a in arrays]
    kwargs = {
        k: backend.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()
    }
    result = fn(*converted, **kwargs)
    if isinstance(result, tuple):
        return tuple(None if r is None else backend.to_numpy(r) for r in result)
    return None if result is None else backend.to_numpy(result)


def _passes(exp, step, actual, what, result_dtype=None):
    """``compare.compare_step`` with a failure message that names the case and the place."""
    result = compare.compare_step(exp, step, actual, result_dtype)
    assert result.passed, (
        f"{step}: |diff| {result.ratio:.3g} × tolerance at {result.index} (got {result.actual}, "
        f"expected {result.expected}, bound {result.bound}) {result.note} [{what}]"
    )


# ------------------------------------------------------------------------------ mask builders


def test_causal_mask_golden(backend):
    got = _call(backend, "causal_mask", 3, 3)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    # bottom-right alignment of 2 queries over 4 keys: offset kv_len - q_len = 2
    got = _call(backend, "causal_mask", 2, 4, offset=2)
    np.testing.assert_array_equal(got, [[1, 1, 1, 0], [1, 1, 1, 1]])
    # top-left, 3 queries over 2 keys: row 2 sees keys 0..1
    got = _call(backend, "causal_mask", 3, 2)
    np.testing.assert_array_equal(got, [[1, 0], [1, 1], [1, 1]])


def test_sliding_window_mask_golden(backend):
    got = _call(backend, "sliding_window_mask", 4, 4, (1, 0))
    np.testing.assert_array_equal(
        got, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    )
    got = _call(backend, "sliding_window_mask", 3, 5, (0, None), offset=2)
    np.testing.assert_array_equal(got, [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1], [0, 0, 0, 0, 1]])


def test_padding_mask_golden(backend):
    got = _call(backend, "padding_mask", np.array([2, 3]), 4)
    assert got.shape == (2, 1, 1, 4)
    np.testing.assert_array_equal(got[:, 0, 0], [[1, 1, 0, 0], [1, 1, 1, 0]])
    got = _call(backend, "padding_mask", np.array([2, 1]), 3, q_lengths=np.array([1, 2]), q_len=2)
    assert got.shape == (2, 1, 2, 3)
    np.testing.assert_array_equal(got[0, 0], [[1, 1, 0], [0, 0, 0]])
    np.testing.assert_array_equal(got[1, 0], [[1, 0, 0], [1, 0, 0]])


def test_combine_masks(backend):
    causal = np.tril(np.ones((3, 3), dtype=bool))
    padding = np.array([True, True, False])[None, :]
    got = _call(backend, "combine_masks", causal, None, padding)
    np.testing.assert_array_equal(got, [[1, 0, 0], [1, 1, 0], [1, 1, 0]])
    assert backend.module.combine_masks(None, None) is None


# ------------------------------------------------------------------------------ steps


def test_scores_and_weights_hand_golden(backend):
    # query [0, √2] against identity keys: scores · 2**-0.5 = [0, 1] → weights [1, e] / (1 + e)
    query = np.array([[0.0, math.sqrt(2.0)]])
    key = np.eye(2)
    scores = _call(backend, "attention_scores", query, key)
    np.testing.assert_allclose(scores, [[0.0, 1.0]], atol=1e-15)
    weights = _call(backend, "attention_weights", scores)
    e = math.e
    np.testing.assert_allclose(weights, [[1 / (1 + e), e / (1 + e)]], rtol=1e-15)
    value = np.array([[1.0, 0.0], [0.0, 2.0]])
    out = _call(backend, "attention_output", weights, value)
    np.testing.assert_allclose(out, [[1 / (1 + e), 2 * e / (1 + e)]], rtol=1e-15)
    # scale=1.0 gives the article's unnormalised ω
    omega = _call(backend, "attention_scores", query, key, scale=1.0)
    np.testing.assert_allclose(omega, [[0.0, math.sqrt(2.0)]], atol=1e-15)


def test_softcap_golden(backend):
    query, key = np.array([[3.0]]), np.array([[1.0], [-10.0]])
    got = _call(backend, "attention_scores", query, key, scale=1.0, softcap=2.0)
    np.testing.assert_allclose(got, [[2 * math.tanh(1.5), 2 * math.tanh(-15.0)]], rtol=1e-14)


def test_mask_scores_golden(backend):
    scores = np.zeros((2, 3))
    bias = np.array([1.0, 2.0, 3.0])
    mask = np.array([[True, False, True], [True, True, True]])
    got = _call(backend, "mask_scores", scores, mask=mask, bias=bias, is_causal=True)
    ninf = -np.inf
    np.testing.assert_array_equal(got, [[1.0, ninf, ninf], [1.0, 2.0, ninf]])
    got = _call(backend, "mask_scores", scores, is_causal=True, causal_alignment="bottom_right")
    np.testing.assert_array_equal(got, [[0.0, 0.0, ninf], [0.0, 0.0, 0.0]])
    got = _call(backend, "mask_scores", np.zeros((3, 3)), window=(0, 1))
    np.testing.assert_array_equal(got, [[0, 0, ninf], [ninf, 0, 0], [ninf, ninf, 0]])


def test_weights_golden_and_empty_rows(backend):
    scores = np.array([[0.0, math.log(3.0)], [-np.inf, -np.inf], [5.0, -np.inf]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _call(backend, "attention_weights", scores)
    np.testing.assert_allclose(got, [[0.25, 0.75], [0.0, 0.0], [1.0, 0.0]], rtol=1e-15)
    assert (got[1] == 0).all()


def test_apply_dropout_with_keep_mask(backend):
    weights = np.array([[0.25, 0.75], [0.5, 0.5]])
    keep = np.array([[True, False], [True, True]])
    got = _call(backend, "apply_dropout", weights, 0.5, dropout_mask=keep)
    np.testing.assert_allclose(got, [[0.5, 0.0], [1.0, 1.0]], rtol=1e-15)
    same = _call(backend, "apply_dropout", weights, 0.0)
    np.testing.assert_array_equal(same, weights)


def test_apply_dropout_from_rng(backend):
    weights = np.ones((64, 256), dtype=np.float32)
    p = 0.25
    fn = backend.module.apply_dropout
    first = backend.to_numpy(fn(backend.asarray(weights), p, rng=backend.rng(7)))
    again = backend.to_numpy(fn(backend.asarray(weights), p, rng=backend.rng(7)))
    np.testing.assert_array_equal(first, again)  # same seed, same mask
    assert set(np.unique(first)) <= {0.0, np.float32(1 / (1 - p))}
    kept = (first > 0).mean()
    sigma = math.sqrt(p * (1 - p) / first.size)
    assert abs(kept - (1 - p)) < 6 * sigma, f"kept fraction {kept}, expected {1 - p}"


def test_renormalized_causal_weights_equals_masking(backend, rng):
    scores = rng.standard_normal((2, 5, 7))
    weights = reference.attention(scores, np.eye(7), np.eye(7), scale=1.0).weights  # softmax
    for alignment in ("top_left", "bottom_right"):
        got = _call(backend, "renormalized_causal_weights", weights, causal_alignment=alignment)
        # the reference's causal softmax of the same scores (identity keys: q @ kᵀ = scores)
        expected_weights = reference.attention(
            scores, np.eye(7), np.eye(7), scale=1.0, is_causal=True, causal_alignment=alignment
        ).weights
        np.testing.assert_allclose(got, expected_weights, rtol=1e-12, atol=1e-15)
    # 3 queries over 1 key, bottom-right (offset -2): rows 0 and 1 keep nothing → 0, not 0/0
    got = _call(
        backend, "renormalized_causal_weights", np.ones((3, 1)), causal_alignment="bottom_right"
    )
    np.testing.assert_array_equal(got, [[0.0], [0.0], [1.0]])


# ------------------------------------------------------------------------------ full pipeline


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_default_path_matches_float64_reference(backend, dtype):
    """Every sdpa case of the catalogue through the call a user makes (no ``return_weights``:
    the fast path where one is selected, torch_attn's SDPA on these shapes), eagerly, against
    the float64 reference under the harness's tolerance rule; finite inputs raise no
    floating-point warning. ``tests/test_harness_grid.py`` runs the same cases through the
    harness (``return_weights=True``, every step, compiled in JAX, x64 on); here JAX runs with
    x64 off (JAX's default) in float32, bfloat16 and float16."""
    failures = []
    with _jax_default_x64(backend, dtype):
        for case in SDPA_CASES:
            failures += _default_path_failures(backend, case, dtype)
    assert not failures, f"{backend.name} {dtype}, default path:\n" + "\n".join(failures)


def _jax_default_x64(backend, dtype):
    """x64 off (JAX's default, what users get) for JAX in the dtypes that need no float64."""
    if backend.name == "jax" and dtype != "float64":
        import jax

        return jax.enable_x64(False)
    return contextlib.nullcontext()


def _default_path_failures(backend, case, dtype):
    """What is wrong with the default call on one case (nothing: an empty list)."""
    exp = _expected(case.name, dtype)  # the harness's expectation, computed once a session
    arrays = cases.sdpa_arrays(exp.data.arrays)
    options = cases.sdpa_options(exp.data.options)
    with warnings.catch_warnings():
        if exp.data.finite:  # finite inputs compute without a floating-point warning
            warnings.simplefilter("error", RuntimeWarning)
        else:  # NaN and inf - inf: IEEE arithmetic, as the spec says
            warnings.simplefilter("ignore", RuntimeWarning)
        try:
            out = _call(backend, "scaled_dot_product_attention", **arrays, **options)
        except RuntimeWarning as warning:
            return [f"{case.name}: {warning}"]
    result = compare.compare_step(exp, "output", out, "input")
    if result.passed:
        return []
    return [f"{case.name}: |diff| {result.ratio:.3g} × tolerance at {result.index} (got "
            f"{result.actual}, expected {result.expected}, bound {result.bound}) "
            f"{result.note}"]


@pytest.mark.parametrize(
    "name", ["causal_bottom_right", "mask_and_bias", "softcap", "gqa", "nan_key_masked"]
)
def test_steps_match_reference(backend, name):
    data = cases.prepare_inputs(cases.get(name), "float64")
    exp = expected.expected_for(data, "sdpa", "float64", name, gradients=False)
    arrays, options = cases.sdpa_arrays(data.arrays), cases.sdpa_options(data.options)
    what = f"{backend.name}, case={name}"
    scores = _call(backend, "attention_scores", arrays["query"], arrays["key"],
                   scale=options.get("scale"), softcap=options.get("softcap"))
    _passes(exp, "scores", scores, what, result_dtype="compute")
    structure = {n: v for n, v in {**arrays, **options}.items()
                 if n in ("mask", "bias", "is_causal", "causal_alignment", "window")}
    masked = _call(backend, "mask_scores", scores, **structure)
    _passes(exp, "masked_scores", masked, what, result_dtype="compute")  # -inf exactly
    weights = _call(backend, "attention_weights", masked)
    _passes(exp, "weights", weights, what, result_dtype="compute")
    out = _call(backend, "attention_output", weights, arrays["value"])
    _passes(exp, "output", out, what, result_dtype="compute")


def test_empty_sequences(backend):
    q = np.ones((2, 3, 4))
    k = np.ones((2, 0, 4))
    v = np.ones((2, 0, 5))
    out = _call(backend, "scaled_dot_product_attention", q, k, v)
    np.testing.assert_array_equal(out, np.zeros((2, 3, 5)))


def test_huge_logits_do_not_overflow(backend):
    q = np.array([[1e4, -1e4]], dtype=np.float32)
    k = np.array([[1e4, 0.0], [-1e4, 0.0], [0.0, 1e4]], dtype=np.float32)
    v = np.eye(3, dtype=np.float32)
    out = _call(backend, "scaled_dot_product_attention", q, k, v, scale=1.0)
    np.testing.assert_array_equal(out, [[1.0, 0.0, 0.0]])


def test_float32_stays_float32_with_python_scalars(backend, rng):
    q = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    for kw in ({}, {"scale": 0.5}, {"softcap": 3.0}, {"bias": np.zeros((3, 3), np.float64)}):
        out, w = _call(backend, "scaled_dot_product_attention", q, q, q, return_weights=True, **kw)
        assert out.dtype == np.float32 and w.dtype == np.float32, kw


def test_half_steps_compute_in_float32(backend, rng):
    q = rng.standard_normal((3, 4)).astype(np.float16)
    scores = _call(backend, "attention_scores", q, q)
    assert scores.dtype == np.float32
    assert _call(backend, "attention_weights", scores).dtype == np.float32


# ------------------------------------------------------------------------------ edge rules


def test_head_dim_zero_gives_the_mean_of_value_over_allowed_keys(backend):
    """``spec.EMPTY_HEAD_DIM``: every score 0, default scale 1.0: uniform weights."""
    q, k = np.zeros((2, 3, 0), np.float32), np.zeros((2, 4, 0), np.float32)
    v = np.arange(16, dtype=np.float32).reshape(2, 4, 2)
    mask = np.array([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)  # row 2 fully masked
    mean = v.mean(axis=-2, keepdims=True)  # (2, 1, 2)
    got = _call(backend, "scaled_dot_product_attention", q, k, v)
    np.testing.assert_allclose(got, np.broadcast_to(mean, (2, 3, 2)), rtol=1e-6)
    got = _call(backend, "scaled_dot_product_attention", q, k, v, mask=mask)
    np.testing.assert_allclose(got[:, 0], v[:, :2].mean(axis=-2), rtol=1e-6)
    np.testing.assert_allclose(got[:, 1], v[:, 0], rtol=1e-6)
    assert (got[:, 2] == 0).all()
    causal = _call(backend, "scaled_dot_product_attention", q, k, v, is_causal=True, softcap=2.0)
    expected_rows = [v[:, : i + 1].mean(axis=-2) for i in range(3)]  # row i: keys 0..i
    np.testing.assert_allclose(causal, np.stack(expected_rows, axis=-2), rtol=1e-6)
    scores = _call(backend, "attention_scores", q, k)  # scale 1.0, not 0 ** -0.5
    assert scores.shape == (2, 3, 4) and (scores == 0).all()
    blockwise = _call(backend, "blockwise_attention", q, k, v, is_causal=True, block_q=2,
                      block_kv=3)
    np.testing.assert_allclose(blockwise, np.stack(expected_rows, axis=-2), rtol=1e-6)
    grads = _call(backend, "scaled_dot_product_attention_vjp", q, k, v, np.ones_like(got))
    assert grads[0].shape == q.shape and grads[1].shape == k.shape
    np.testing.assert_allclose(grads[2], np.full(v.shape, 3 / 4), rtol=1e-6)  # d mean / d v


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN and inf - inf: IEEE arithmetic
def test_non_finite_inputs_follow_the_ieee_rule(backend):
    """``spec.NON_FINITE`` with hand-made expectations: which rows become NaN."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 4, 3)).astype(np.float32)
    k = rng.standard_normal((2, 5, 3)).astype(np.float32)
    v = rng.standard_normal((2, 5, 2)).astype(np.float32)
    sdpa = "scaled_dot_product_attention"
    # NaN in query row 1 of sequence 0: that row only
    q_nan = q.copy()
    q_nan[0, 1, 2] = np.nan
    out = _call(backend, sdpa, q_nan, k, v)
    rows = np.isnan(out).any(-1)
    np.testing.assert_array_equal(rows, [[0, 1, 0, 0], [0, 0, 0, 0]])
    # NaN in key 3: causal rows 0-2 do not attend it (masked: replaced by -inf), row 3 does
    k_nan = k.copy()
    k_nan[1, 3, 0] = np.nan
    out = _call(backend, sdpa, q, k_nan, v, is_causal=True)
    np.testing.assert_array_equal(np.isnan(out).any(-1), [[0, 0, 0, 0], [0, 0, 0, 1]])
    mask = np.ones((4, 5), bool)
    mask[:, 3] = False  # nobody attends key 3: nothing is NaN
    assert not np.isnan(_call(backend, sdpa, q, k_nan, v, mask=mask)).any()
    # +inf in key 0 against positive query features: score +inf, every row attending it NaN
    q_pos, k_inf = np.abs(q) + 0.5, k.copy()
    k_inf[0, 0, :] = np.inf
    out = _call(backend, sdpa, q_pos, k_inf, v, window=(0, 0))  # row i attends key i only
    np.testing.assert_array_equal(np.isnan(out).any(-1), [[1, 0, 0, 0], [0, 0, 0, 0]])
    # -inf in key 4 against positive query features: score -inf, weight 0 (as if masked)
    k_minf = k.copy()
    k_minf[0, 4, :] = -np.inf
    out = _call(backend, sdpa, q_pos, k_minf, v)
    masked = _call(backend, sdpa, q_pos, k, v, mask=np.array([1, 1, 1, 1, 0], bool))
    np.testing.assert_allclose(out[0], masked[0], rtol=1e-6)
    # NaN in value row 2: every row with a non-zero weight on key 2
    v_nan = v.copy()
    v_nan[1, 2, 1] = np.nan
    out = _call(backend, sdpa, q, k, v_nan, is_causal=True)
    assert np.isnan(out[1, 2:, 1]).all() and not np.isnan(out[0]).any()
