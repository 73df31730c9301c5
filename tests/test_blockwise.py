"""blockwise_attention (online softmax in tiles) and its VJP, on every backend.

Expected values come from ``conformance.reference`` (float64, no tiles) with the padding mask
built from ``kv_lengths``, from finite differences on that reference, and from each backend's
plain ``scaled_dot_product_attention_vjp``; never from the blockwise code itself. Shapes are
small and shared, so JAX compiles few programs.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from numerics import finite_differences

from conformance import reference

TOL = {"float64": 1e-10, "float32": 2e-5, "bfloat16": 2e-2, "float16": 3e-3}

# name → options; "q_len"/"kv_len" override the 5 queries over 7 keys of the default shape
FEATURES = {
    "plain": {},
    "causal_top_left": {"is_causal": True},
    "causal_bottom_right": {"is_causal": True, "causal_alignment": "bottom_right"},
    "causal_bottom_right_q_longer": {"is_causal": True, "causal_alignment": "bottom_right",
                                     "q_len": 7, "kv_len": 5},
    "window": {"window": (2, 1)},
    "window_causal": {"window": (1, None), "is_causal": True},
    "window_bottom_right": {"window": (0, 2), "causal_alignment": "bottom_right"},
    "softcap": {"softcap": 0.9},
    "scale": {"scale": 1.3},
    "bias_broadcast": {"bias": (4, 1, 7)},
    "bias_full": {"bias": (2, 4, 5, 7)},
    "kv_lengths": {"kv_lengths": (7, 3)},
    "kv_lengths_empty": {"kv_lengths": (0, 4), "is_causal": True},
    "gqa": {"kv_heads": 2},
    "mqa": {"kv_heads": 1, "v_dim": 3},
    "v_dim": {"v_dim": 6},
    "two_d": {"two_d": True, "is_causal": True},
    "three_d": {"three_d": True, "window": (1, 1)},
    "q_len_one": {"q_len": 1, "is_causal": True, "causal_alignment": "bottom_right"},
    "kv_len_one": {"kv_len": 1, "bias": (1, 1, 1)},
    "all_features": {"kv_heads": 2, "v_dim": 3, "softcap": 1.5, "bias": (2, 1, 5, 7),
                     "kv_lengths": (6, 2), "is_causal": True, "causal_alignment": "bottom_right",
                     "window": (3, 0), "scale": 0.5},
}


def _inputs(feature, dtype="float64", q_len=None, kv_len=None):
    """NumPy query, key, value, the blockwise keyword arguments, and the reference's (a
    padding ``mask`` instead of ``kv_lengths``)."""
    spec = FEATURES[feature]
    rng = np.random.default_rng(sum(map(ord, feature)))
    q_len = spec.get("q_len", 5) if q_len is None else q_len
    kv_len = spec.get("kv_len", 7) if kv_len is None else kv_len
    kv_heads = spec.get("kv_heads", 4)
    q = rng.standard_normal((2, 4, q_len, 8))
    k = rng.standard_normal((2, kv_heads, kv_len, 8))
    v = rng.standard_normal((2, kv_heads, kv_len, spec.get("v_dim", 8)))
    kw = {n: spec[n] for n in ("is_causal", "causal_alignment", "window", "softcap", "scale")
          if n in spec}
    ref_kw = dict(kw)
    if "bias" in spec:
        shape = spec["bias"][:-2] + (q_len if spec["bias"][-2] != 1 else 1,
                                     kv_len if spec["bias"][-1] != 1 else 1)
        kw["bias"] = ref_kw["bias"] = rng.standard_normal(shape)
    if "kv_lengths" in spec:
        lengths = np.minimum(np.array(spec["kv_lengths"]), kv_len)
        kw["kv_lengths"] = lengths
        ref_kw["mask"] = (np.arange(kv_len) < lengths[:, None])[:, None, None, :]
    if spec.get("two_d"):
        q, k, v = q[0, 0], k[0, 0], v[0, 0]
    if spec.get("three_d"):
        q, k, v = q[0], k[0], v[0]
    cast = lambda x: x.astype(_np_dtype(dtype))  # noqa: E731
    return cast(q), cast(k), cast(v), kw, ref_kw


def _np_dtype(name):
    from conformance.backends import numpy_dtype

    return numpy_dtype(name)


def _convert(backend, kw):
    return {n: backend.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}


def _blockwise(backend, q, k, v, kw, **blocks):
    out = backend.module.blockwise_attention(
        backend.asarray(q), backend.asarray(k), backend.asarray(v), **_convert(backend, kw),
        **blocks,
    )
    return backend.to_numpy(out)


def _expected(q, k, v, ref_kw):
    return reference.attention(q, k, v, **ref_kw).output  # float64 on the (rounded) inputs


# ------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_matches_reference(backend, feature):
    q, k, v, kw, ref_kw = _inputs(feature)
    got = _blockwise(backend, q, k, v, kw, block_q=2, block_kv=3)  # neither divides 5 or 7
    expected = _expected(q, k, v, ref_kw)
    assert got.shape == expected.shape and got.dtype == np.float64
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12, err_msg=feature)


@pytest.mark.parametrize(("block_q", "block_kv"), [(1, 1), (5, 7), (4, 2), (64, 64)])
def test_block_sizes(backend, block_q, block_kv):
    q, k, v, kw, ref_kw = _inputs("all_features")
    got = _blockwise(backend, q, k, v, kw, block_q=block_q, block_kv=block_kv)
    np.testing.assert_allclose(got, _expected(q, k, v, ref_kw), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", sorted(TOL))
def test_dtypes(backend, dtype):
    q, k, v, kw, ref_kw = _inputs("all_features", dtype)
    got = _blockwise(backend, q, k, v, kw, block_q=2, block_kv=3)
    assert got.dtype == _np_dtype(dtype), "returns the input dtype"
    expected = _expected(q, k, v, ref_kw)
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=TOL[dtype],
                               atol=TOL[dtype])


def test_fully_masked_rows_are_exactly_zero(backend):
    # bottom-right, 7 queries over 5 keys: queries 0 and 1 see no key; sequence 1 has no key
    q, k, v, kw, ref_kw = _inputs("causal_bottom_right_q_longer")
    kw["kv_lengths"] = np.array([5, 0])
    got = _blockwise(backend, q, k, v, kw, block_q=2, block_kv=2)
    assert not np.isnan(got).any()
    assert (got[:, :, :2] == 0).all() and (got[1] == 0).all()
    assert (got[0, :, 2:] != 0).any()


def test_empty_axes(backend):
    q = np.zeros((1, 2, 0, 4))
    k = np.ones((1, 2, 3, 4))
    assert _blockwise(backend, q, k, k, {}).shape == (1, 2, 0, 4)
    got = _blockwise(backend, np.ones((1, 2, 3, 4)), q, q, {})
    assert got.shape == (1, 2, 3, 4) and (got == 0).all()  # no key at all: fully masked rows


def test_validation(backend):
    fn = backend.module.blockwise_attention
    x = backend.asarray(np.ones((2, 1, 3, 4)))
    with pytest.raises(ValueError, match=r"blockwise_attention: kv_lengths must be ints shaped"):
        fn(x, x, x, kv_lengths=backend.asarray(np.array([1, 2, 3])))
    with pytest.raises(ValueError, match=r"kv_lengths must lie in \[0, 3\]"):
        fn(x, x, x, kv_lengths=backend.asarray(np.array([1, 4])))
    with pytest.raises(ValueError, match=r"block_q must be an int >= 1; got block_q=0"):
        fn(x, x, x, block_q=0)
    with pytest.raises(ValueError, match=r"blockwise_attention: bias must be broadcastable"):
        fn(x, x, x, bias=backend.asarray(np.ones((5, 3))))
    with pytest.raises(ValueError, match="causal_alignment must be"):
        fn(x, x, x, causal_alignment="left")
    with pytest.raises(TypeError, match="blockwise_attention: inputs must share one dtype"):
        fn(x, x, backend.asarray(np.ones((2, 1, 3, 4), np.float32)))


def test_plan_skips_masked_tiles():
    from attention_rules import band as _band
    from attention_rules import plan as _plan

    lo, hi = _band(1024, 1024, True, "top_left", None)
    tiles = sum(len(blocks) for *_, blocks in _plan(1024, 1024, 128, 128, lo, hi))
    assert tiles == 8 * 9 // 2  # the causal lower triangle of 8 × 8 tiles, diagonal included
    lo, hi = _band(1024, 1024, False, "top_left", (128, 0))
    plan = _plan(1024, 1024, 128, 128, lo, hi)
    assert sum(len(blocks) for *_, blocks in plan) == 8 + 7  # a band two tiles wide
    assert all(partial for *_, blocks in plan for _, _, partial in blocks)


def test_numpy_extra_memory_is_a_few_tiles():
    import numpy_attn

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 4096, 16), dtype=np.float32) for _ in range(3))
    tracemalloc.start()
    try:
        numpy_attn.blockwise_attention(q, k, v, is_causal=True, block_q=256, block_kv=256)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the plain scores would be 4096² × 4 B = 64 MiB; a tile is 256 KiB, the output 256 KiB
    assert peak < 4 * 2**20, f"peak {peak / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------ gradients

GRAD_FEATURES = ("causal_bottom_right_q_longer", "window_causal", "bias_broadcast",
                 "kv_lengths_empty", "mqa", "all_features")  # all_features: softcap, scale…
_FD_CACHE: dict = {}


def _small(feature):
    """A smaller problem for finite differences: batch 2, heads 4, q_len 3, kv_len 4."""
    spec = FEATURES[feature]
    q_len, kv_len = (4, 3) if spec.get("q_len", 5) > spec.get("kv_len", 7) else (3, 4)
    q, k, v, kw, ref_kw = _inputs(feature, q_len=q_len, kv_len=kv_len)
    q, k, v = q[..., :4], k[..., :4], v
    grad_out = np.random.default_rng(7).standard_normal(q.shape[:-1] + v.shape[-1:])
    return q, k, v, grad_out, kw, ref_kw


def _reference_grads(feature):
    if feature not in _FD_CACHE:
        q, k, v, grad_out, kw, ref_kw = _small(feature)

        def loss():
            return float((reference.attention(q, k, v, **ref_kw).output * grad_out).sum())

        arrays = {"query": q, "key": k, "value": v}
        if "bias" in ref_kw:
            arrays["bias"] = ref_kw["bias"]
        _FD_CACHE[feature] = {name: finite_differences(loss, x) for name, x in arrays.items()}
    return _FD_CACHE[feature]


def _blockwise_vjp(backend, q, k, v, grad_out, kw, **blocks):
    grads = backend.module.blockwise_attention_vjp(
        *(backend.asarray(x) for x in (q, k, v, grad_out)), **_convert(backend, kw), **blocks
    )
    return [None if g is None else backend.to_numpy(g) for g in grads]


@pytest.mark.parametrize("feature", GRAD_FEATURES)
def test_vjp_matches_finite_differences(backend, feature):
    q, k, v, grad_out, kw, _ = _small(feature)
    expected = _reference_grads(feature)
    grads = _blockwise_vjp(backend, q, k, v, grad_out, kw, block_q=2, block_kv=3)
    for name, grad in zip(("query", "key", "value", "bias"), grads, strict=True):
        if name not in expected:
            assert grad is None, f"{name}: gradient without a bias"
            continue
        assert grad.shape == expected[name].shape, name
        assert np.isfinite(grad).all(), f"d{name} not finite"
        np.testing.assert_allclose(grad, expected[name], rtol=1e-6, atol=1e-7,
                                   err_msg=f"{backend.name} d{name}, {feature}")


@pytest.mark.parametrize("dtype", ["float32"])  # float64: finite differences above
def test_vjp_matches_plain_vjp(backend, dtype):
    q, k, v, kw, ref_kw = _inputs("all_features", dtype)
    grad_out = np.random.default_rng(3).standard_normal(q.shape[:-1] + v.shape[-1:])
    grad_out = grad_out.astype(dtype)
    plain_kw = {n: x for n, x in ref_kw.items()}
    plain_kw["bias"] = plain_kw["bias"].astype(dtype)
    kw["bias"] = plain_kw["bias"]
    expected = backend.module.scaled_dot_product_attention_vjp(
        *(backend.asarray(x) for x in (q, k, v, grad_out)), **_convert(backend, plain_kw)
    )
    got = _blockwise_vjp(backend, q, k, v, grad_out, kw, block_q=2, block_kv=4)
    for name, g, e in zip(("query", "key", "value", "bias"), got, expected, strict=True):
        e = backend.to_numpy(e)
        assert g.dtype == e.dtype == np.dtype(dtype), name
        np.testing.assert_allclose(g, e, rtol=TOL[dtype], atol=TOL[dtype], err_msg=name)


def test_vjp_half_precision(backend):
    q, k, v, kw, ref_kw = _inputs("causal_bottom_right", "bfloat16")
    grad_out = np.ones(q.shape[:-1] + v.shape[-1:], q.dtype)
    got = _blockwise_vjp(backend, q, k, v, grad_out, kw, block_q=2, block_kv=3)
    expected = _reference_grads_plain(q, k, v, grad_out, ref_kw)
    for g, e in zip(got[:3], expected, strict=True):
        assert g.dtype == q.dtype
        np.testing.assert_allclose(g.astype(np.float64), e, rtol=5e-2, atol=5e-2)


def _reference_grads_plain(q, k, v, grad_out, ref_kw):
    """numpy_attn's hand-written plain backward in float64: an independent computation."""
    import numpy_attn

    cast = [x.astype(np.float64) for x in (q, k, v, grad_out)]
    return numpy_attn.scaled_dot_product_attention_vjp(*cast, **ref_kw)[:3]


# ------------------------------------------------------------------------------ JAX


def test_jax_jits_once_and_differentiates():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import jax_attn

    traces = []

    @jax.jit
    def loss(q, k, v, lengths):
        traces.append(1)
        out = jax_attn.blockwise_attention(q, k, v, kv_lengths=lengths, is_causal=True,
                                           block_q=2, block_kv=3)
        return (out**2).sum()

    q, k, v, kw, ref_kw = _inputs("kv_lengths", "float32")
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    first = loss(q, k, v, jnp.asarray(kw["kv_lengths"]))
    loss(q + 1, k, v, jnp.asarray(np.array([2, 5])))  # other values, same shapes
    assert len(traces) == 1, "compiled once for one set of shapes"
    expected = (_expected(q, k, v, {**ref_kw, "is_causal": True}) ** 2).sum()
    np.testing.assert_allclose(float(first), expected, rtol=1e-5)
    grads = grad(q, k, v, jnp.asarray(kw["kv_lengths"]))
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
