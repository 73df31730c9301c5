"""jax_attn's numbers: dtypes under jit within the harness's tolerance rule (x64 off, JAX's
default, and on), the explicit path's HIGHEST matmul precision, dropout keys (deterministic
per key, an explicit keep-mask equals the reference), and random configurations
(hypothesis) against the float64 reference.

Expected values come from ``conformance.cases.reference`` (float64) and
``conformance.comparing.compare``; never from jax_attn itself.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="pip install jax")

import jax.numpy as jnp  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from jax_inputs import (  # noqa: E402
    BIAS,
    HALF,
    KEEP,
    MASK,
    K,
    Q,
    V,
    _assert_matches_reference,
    _f64,
    _jitted,
    _ref,
)

import jax_attn as ja  # noqa: E402

# float64 inputs stay float64: x64 on for each test here (conftest.x64_on), never for the run
pytestmark = pytest.mark.usefixtures("x64_on")


# ------------------------------------------------------------------------------ dtypes, precision


@pytest.mark.parametrize("dtype", HALF + ("float32",))
def test_dtypes_under_jit(dtype, x64):
    """Forward output and weights under jit, x64 off (JAX's default) and on: the input dtype
    kept, within the harness's tolerance of the float64 reference computed in NumPy."""
    arrays = [jnp.asarray(x, dtype) for x in (Q, K, V)]
    bias = jnp.asarray(BIAS, dtype)
    out, weights = _jitted((("is_causal", True), ("return_weights", True)))(
        *arrays, mask=MASK, bias=bias
    )
    assert out.dtype == jnp.dtype(dtype) and weights.dtype == jnp.dtype(dtype)
    inputs = {"query": arrays[0], "key": arrays[1], "value": arrays[2], "mask": MASK, "bias": bias}
    _assert_matches_reference(out, "output", dtype, inputs, is_causal=True)
    _assert_matches_reference(weights, "output_weights", dtype, inputs, is_causal=True)
    assert np.all(_f64(out)[0, :, 2] == 0.0)
    scores = jax.jit(ja.attention_scores)(arrays[0], arrays[1])
    assert scores.dtype == jnp.dtype("float32" if dtype in HALF else dtype)


def _dot_precisions(jaxpr):
    """Precision of every dot_general in a jaxpr, nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None:
                found += _dot_precisions(getattr(inner, "jaxpr", inner))
    return found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_explicit_path_pins_highest_precision(dtype):
    q, k, v = (jnp.asarray(x, dtype) for x in (Q, K, V))
    module = ja.SelfAttention(8, 4, 3, rng=jax.random.key(0))
    for fn, args in [
        (lambda q, k, v: ja.scaled_dot_product_attention(q, k, v, mask=MASK), (q, k, v)),
        (module, (q[0, 0],)),
    ]:
        with jax.default_matmul_precision("bfloat16"):
            precisions = _dot_precisions(jax.make_jaxpr(fn)(*args).jaxpr)
        highest = jax.lax.Precision.HIGHEST
        assert precisions and all(p == (highest, highest) for p in precisions), precisions


# ------------------------------------------------------------------------------ dropout


def test_dropout_needs_a_key_and_is_deterministic_per_key():
    with pytest.raises(ValueError, match="rng"):
        ja.scaled_dot_product_attention(Q, K, V, dropout_p=0.5)
    with pytest.raises(ValueError, match="rng"):
        ja.apply_dropout(jnp.ones((2, 3)), 0.5)
    weights = jnp.full((64, 64), 0.5)
    fn = jax.jit(ja.apply_dropout, static_argnums=(1,))
    a = np.asarray(fn(weights, 0.25, rng=jax.random.key(1)))
    b = np.asarray(fn(weights, 0.25, rng=jax.random.key(1)))
    c = np.asarray(fn(weights, 0.25, rng=jax.random.PRNGKey(2)))  # legacy uint32 keys work too
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert set(np.unique(a)) <= {0.0, 0.5 / 0.75}
    assert abs((a == 0).mean() - 0.25) < 0.05  # 4096 draws: 6 standard deviations
    # an explicit keep-mask gives exactly the reference's result
    out = ja.scaled_dot_product_attention(Q, K, V, dropout_p=0.25, dropout_mask=KEEP)
    expected = _ref(Q, K, V, dropout_p=0.25, dropout_mask=KEEP)
    np.testing.assert_allclose(out, expected.output, rtol=1e-10, atol=1e-10)


def _assert_no_nan(*arrays):
    for array in arrays:
        assert not np.isnan(_f64(array)).any()


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
    q_len=st.integers(1, 4),
    kv_len=st.integers(1, 4),
    is_causal=st.booleans(),
    alignment=st.sampled_from(["top_left", "bottom_right"]),
    window=st.sampled_from([None, (0, 0), (1, None), (None, 1)]),
    seed=st.integers(0, 2**16),
)
def test_random_configurations_match_reference(
    heads, q_len, kv_len, is_causal, alignment, window, seed
):
    gen = np.random.default_rng(seed)
    h, kvh = heads
    q = gen.standard_normal((h, q_len, 3))
    k = gen.standard_normal((kvh, kv_len, 3))
    v = gen.standard_normal((kvh, kv_len, 2))
    mask = gen.random((1, q_len, kv_len)) > 0.3
    options = dict(mask=mask, is_causal=is_causal, causal_alignment=alignment, window=window)
    out, weights = ja.scaled_dot_product_attention(q, k, v, return_weights=True, **options)
    expected = _ref(q, k, v, **options)
    np.testing.assert_allclose(out, expected.output, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(weights, expected.weights, rtol=1e-10, atol=1e-12)
    _assert_no_nan(out, weights)
