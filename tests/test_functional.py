"""Behaviour of the functional API, on every backend, against hand goldens and float64.

Expected values come from hand computation (goldens) or from ``conformance.reference``, an
independent float64 implementation; never from the backend under test.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from conformance import backends, reference

# Absolute/relative tolerance of a backend result against the float64 reference, per dtype.
# float32 and the half types are dominated by rounding the result to that dtype.
TOL = {
    "float64": 1e-10,
    "float32": 2e-5,
    "bfloat16": 2e-2,
    "float16": 3e-3,
}
DTYPES = tuple(TOL)


def _call(backend, fn_name, *arrays, **kwargs):
    """Call ``backend.module.fn_name`` on NumPy arrays; convert array results back."""
    fn = getattr(backend.module, fn_name)
    converted = [backend.asarray(a) if isinstance(a, np.ndarray) else a for a in arrays]
    kwargs = {
        k: backend.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()
    }
    result = fn(*converted, **kwargs)
    if isinstance(result, tuple):
        return tuple(backend.to_numpy(r) for r in result)
    return None if result is None else backend.to_numpy(result)


def _close(actual, expected, dtype, what=""):
    tol = TOL[dtype]
    actual = np.asarray(actual, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert not np.isnan(actual).any(), f"{what}: NaN in result"
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol, err_msg=what)


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
    weights = _call(backend, "attention_weights", scores)
    for alignment in ("top_left", "bottom_right"):
        got = _call(backend, "renormalized_causal_weights", weights, causal_alignment=alignment)
        masked = _call(
            backend, "mask_scores", scores, is_causal=True, causal_alignment=alignment
        )
        expected = _call(backend, "attention_weights", masked)
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)
    # 3 queries over 1 key, bottom-right (offset -2): rows 0 and 1 keep nothing → 0, not 0/0
    got = _call(
        backend, "renormalized_causal_weights", np.ones((3, 1)), causal_alignment="bottom_right"
    )
    np.testing.assert_array_equal(got, [[0.0], [0.0], [1.0]])


# ------------------------------------------------------------------------------ full pipeline

B, H, TQ, TK, D = 2, 4, 5, 7, 8


def _case(name, rng):
    """Named inputs for scaled_dot_product_attention: (q, k, v, kwargs)."""
    q = rng.standard_normal((B, H, TQ, D))
    k = rng.standard_normal((B, H, TK, D))
    v = rng.standard_normal((B, H, TK, D))
    kw: dict = {}
    if name == "self":
        k = rng.standard_normal((B, H, TQ, D))
        v = rng.standard_normal((B, H, TQ, D))
    elif name == "cross":
        pass
    elif name == "causal_top_left":
        kw = {"is_causal": True}
    elif name == "causal_bottom_right":
        kw = {"is_causal": True, "causal_alignment": "bottom_right"}
    elif name == "causal_bottom_right_q_longer":  # q_len > kv_len: first rows are empty
        q, k, v = k, q, rng.standard_normal((B, H, TQ, D))
        kw = {"is_causal": True, "causal_alignment": "bottom_right"}
    elif name == "causal_top_left_q_longer":
        q, k, v = k, q, rng.standard_normal((B, H, TQ, D))
        kw = {"is_causal": True}
    elif name == "window":
        kw = {"window": (2, 1)}
    elif name == "window_causal":
        kw = {"window": (3, None), "is_causal": True, "causal_alignment": "bottom_right"}
    elif name == "mask":
        kw = {"mask": rng.random((B, 1, TQ, TK)) < 0.7}
    elif name == "padding":
        lengths = np.array([3, 7])
        kw = {"mask": (np.arange(TK) < lengths[:, None])[:, None, None, :]}
    elif name == "bias":
        kw = {"bias": rng.standard_normal((1, H, TQ, TK))}
    elif name == "mask_and_bias":
        kw = {"bias": rng.standard_normal((TQ, TK)), "mask": rng.random((TQ, TK)) < 0.6,
              "is_causal": True}
    elif name == "softcap":
        q = q * 5
        kw = {"softcap": 2.5}
    elif name == "gqa":
        k, v = k[:, :2], v[:, :2]
    elif name == "mqa":
        k, v = k[:, :1], v[:, :1]
    elif name == "v_dim":
        v = rng.standard_normal((B, H, TK, 3))
    elif name == "scale":
        kw = {"scale": 0.3}
    elif name == "dropout_mask":
        kw = {"dropout_p": 0.3, "dropout_mask": rng.random((B, H, TQ, TK)) >= 0.3}
    elif name == "fully_masked_rows":
        mask = rng.random((B, H, TQ, TK)) < 0.6
        mask[0, 1, 2] = False
        mask[1, :, 0] = False
        mask[1, 3] = False  # a fully masked head
        kw = {"mask": mask}
    elif name == "huge_logits":
        q = q * 1e2
        k = k * 1e2
        kw = {"scale": 1.0}
    elif name == "two_d":
        q, k, v = q[0, 0], k[0, 0], v[0, 0]
    elif name == "three_d":
        q, k, v = q[0], k[0, :2], v[0, :2]
        kw = {"is_causal": True}
    else:  # pragma: no cover
        raise KeyError(name)
    return q, k, v, kw


CASES = (
    "self", "cross", "causal_top_left", "causal_bottom_right", "causal_bottom_right_q_longer",
    "causal_top_left_q_longer", "window", "window_causal", "mask", "padding", "bias",
    "mask_and_bias", "softcap", "gqa", "mqa", "v_dim", "scale", "dropout_mask",
    "fully_masked_rows", "huge_logits", "two_d", "three_d",
)


def _cast(x, dtype):
    floating = isinstance(x, np.ndarray) and x.dtype.kind == "f"
    return x.astype(backends.numpy_dtype(dtype)) if floating else x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_sdpa_matches_float64_reference(backend, case, dtype):
    rng = np.random.default_rng(sum(map(ord, case)))
    q, k, v, kw = _case(case, rng)
    q, k, v = (_cast(x, dtype) for x in (q, k, v))
    if "bias" in kw:
        kw["bias"] = _cast(kw["bias"], dtype)
    # the reference sees exactly the bits the backend sees, upcast to float64
    ref = reference.attention(q, k, v, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out, weights = _call(
            backend, "scaled_dot_product_attention", q, k, v, return_weights=True, **kw
        )
    assert out.dtype == backends.numpy_dtype(dtype), f"output dtype {out.dtype} for {dtype} input"
    assert weights.dtype == backends.numpy_dtype(dtype)
    _close(out, ref.output, dtype, f"{backend.name} output, case={case}, dtype={dtype}")
    _close(weights, ref.weights, dtype, f"{backend.name} weights, case={case}, dtype={dtype}")
    if case == "fully_masked_rows":
        empty = ~np.asarray(kw["mask"]).any(-1)
        assert (out[empty] == 0).all() and (weights[empty] == 0).all()


@pytest.mark.parametrize("case", ("causal_bottom_right", "mask_and_bias", "softcap", "gqa"))
def test_steps_match_reference(backend, case):
    rng = np.random.default_rng(sum(map(ord, case)))
    q, k, v, kw = _case(case, rng)
    ref = reference.attention(q, k, v, **kw)
    scores = _call(backend, "attention_scores", q, k, softcap=kw.get("softcap"))
    _close(scores, ref.scores, "float64", f"{backend.name} scores, case={case}")
    structure = {n: kw[n] for n in ("mask", "bias", "is_causal", "causal_alignment", "window")
                 if n in kw}
    masked = _call(backend, "mask_scores", scores, **structure)
    finite = np.isfinite(ref.masked_scores)
    np.testing.assert_array_equal(np.isfinite(masked), finite)
    _close(masked[finite], ref.masked_scores[finite], "float64", f"masked scores, case={case}")
    weights = _call(backend, "attention_weights", masked)
    _close(weights, ref.weights, "float64", f"{backend.name} weights, case={case}")
    out = _call(backend, "attention_output", weights, v)
    _close(out, ref.output, "float64", f"{backend.name} output, case={case}")


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
