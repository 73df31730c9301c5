"""jax_attn under JAX's transformations: jit equals eager and the float64 reference, vmap
equals the batched call (step functions and mask builders too), no retracing for the same
shapes, mask builders under jit, fully masked rows exactly 0 under jit (where jax.nn is not).

Expected values come from ``conformance.cases.reference`` (float64); never from jax_attn itself.
Shapes are shared (``jax_inputs``) and small, since every new shape is a new XLA compilation.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="pip install jax")

import jax.numpy as jnp  # noqa: E402
from jax_inputs import BIAS, KEEP, MASK, K, Q, V, _jitted, _ref  # noqa: E402

import jax_attn as ja  # noqa: E402

# float64 inputs stay float64: x64 on for each test here (conftest.x64_on), never for the run
pytestmark = pytest.mark.usefixtures("x64_on")


CONFIGS = {
    "plain": {},
    "causal_top_left": {"is_causal": True},
    "causal_bottom_right": {"is_causal": True, "causal_alignment": "bottom_right"},
    "window": {"window": (1, 2)},
    "window_bottom_right_causal": {
        "is_causal": True, "causal_alignment": "bottom_right", "window": (2, None)
    },
    "mask_bias_softcap": {"mask": MASK, "bias": BIAS, "softcap": 2.5, "scale": 0.7},
    "dropout_mask": {"mask": MASK, "dropout_p": 0.25, "dropout_mask": KEEP},
}
ARRAY_KWARGS = ("mask", "bias", "dropout_mask")


def _split(config):
    """(array kwargs, static kwargs) of a config."""
    arrays = {k: v for k, v in config.items() if k in ARRAY_KWARGS}
    static = {k: v for k, v in config.items() if k not in ARRAY_KWARGS}
    return arrays, static


# ------------------------------------------------------------------------------ jit / vmap


@pytest.mark.parametrize("name", list(CONFIGS))
def test_jit_equals_eager_and_reference(name):
    arrays, static = _split(CONFIGS[name])
    eager_out, eager_w = ja.scaled_dot_product_attention(
        Q, K, V, return_weights=True, **arrays, **static
    )
    fn = _jitted(tuple(sorted({**static, "return_weights": True}.items())))
    jit_out, jit_w = fn(jnp.asarray(Q), jnp.asarray(K), jnp.asarray(V), **arrays)
    np.testing.assert_allclose(jit_out, eager_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(jit_w, eager_w, rtol=1e-12, atol=1e-12)
    expected = _ref(Q, K, V, **CONFIGS[name])
    np.testing.assert_allclose(jit_out, expected.output, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(jit_w, expected.weights, rtol=1e-10, atol=1e-10)


def test_fully_masked_row_is_exactly_zero_under_jit():
    out, weights = _jitted((("return_weights", True),))(Q, K, V, mask=MASK)
    assert np.all(np.asarray(out)[0, :, 2] == 0.0)
    assert np.all(np.asarray(weights)[0, :, 2] == 0.0)
    # jax.nn.dot_product_attention gives mean(value) there: the reason for the explicit path.
    v_wide = np.concatenate([V] * 3, -1)[..., :8]  # jax.nn needs v_dim == head_dim
    bthd = [jnp.swapaxes(jnp.asarray(x), 1, 2) for x in (Q, K, v_wide)]
    theirs = jax.nn.dot_product_attention(*bthd, mask=jnp.asarray(MASK), implementation="xla")
    assert np.abs(np.asarray(theirs)[0, 2]).max() > 0.0


def test_vmap_over_batch_equals_batched_call():
    mapped = jax.vmap(functools.partial(ja.scaled_dot_product_attention, is_causal=True))
    np.testing.assert_allclose(
        mapped(Q, K, V), ja.scaled_dot_product_attention(Q, K, V, is_causal=True), rtol=1e-12
    )
    # mask mapped along the batch, bias shared (in_axes None), weights returned
    mapped = jax.vmap(
        lambda q, k, v, m, b: ja.scaled_dot_product_attention(
            q, k, v, mask=m, bias=b, return_weights=True
        ),
        in_axes=(0, 0, 0, 0, None),
    )
    out, weights = mapped(Q, K, V, MASK, BIAS)
    expected = _ref(Q, K, V, mask=MASK, bias=BIAS)
    np.testing.assert_allclose(out, expected.output, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(weights, expected.weights, rtol=1e-10, atol=1e-10)


def test_vmap_of_step_functions_and_masks():
    scores = jax.vmap(ja.attention_scores)(Q[:, 0], K[:, 0])  # per-example (q_len, head_dim)
    np.testing.assert_allclose(scores, _ref(Q[:, 0], K[:, 0], V[:, 0]).scores, rtol=1e-12)
    lengths = jnp.asarray([3, 6], dtype=jnp.int32)
    masks = jax.vmap(lambda n: ja.padding_mask(n[None], 6))(lengths)  # traced lengths
    np.testing.assert_array_equal(masks[:, 0, 0, 0], np.arange(6)[None, :] < np.array([[3], [6]]))


def test_no_retracing_for_same_shapes():
    traces = []

    @functools.partial(jax.jit, static_argnames=("is_causal",))
    def attend(q, k, v, mask, is_causal=False):
        traces.append(q.shape)  # runs at trace time only
        return ja.scaled_dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)

    attend(Q, K, V, MASK)
    attend(Q + 1.0, K * 2.0, V, ~MASK)
    assert len(traces) == 1
    attend(Q, K, V, MASK, is_causal=True)  # a new static option: one new trace
    attend(Q - 1.0, K, V, MASK, is_causal=True)
    assert len(traces) == 2
    attend(Q[:1], K[:1], V[:1], MASK[:1])  # a new shape: one new trace
    assert len(traces) == 3


def test_mask_builders_under_jit():
    causal = jax.jit(ja.causal_mask, static_argnums=(0, 1), static_argnames=("offset",))
    np.testing.assert_array_equal(causal(2, 4, offset=2), [[1, 1, 1, 0], [1, 1, 1, 1]])
    window = jax.jit(ja.sliding_window_mask, static_argnums=(0, 1, 2))
    np.testing.assert_array_equal(window(3, 3, (1, 0)), [[1, 0, 0], [1, 1, 0], [0, 1, 1]])
    padding = jax.jit(ja.padding_mask, static_argnames=("kv_len", "q_len"))
    got = padding(np.array([2, 0]), kv_len=3, q_lengths=np.array([1, 2]), q_len=2)
    np.testing.assert_array_equal(got[0, 0], [[1, 1, 0], [0, 0, 0]])
    np.testing.assert_array_equal(got[1, 0], [[0, 0, 0], [0, 0, 0]])
    assert ja.causal_mask(2, 2, device="cpu").devices() == {jax.devices("cpu")[0]}
    with pytest.raises(ValueError, match="device"):
        ja.causal_mask(2, 2, device="no-such-platform")
