"""jax.grad of jax_attn: against central finite differences of numpy_attn in float64, exactly
0 on fully masked rows (no NaN, even when every key is masked), finite through the step
functions, and in float32, bfloat16 and float16 under jit (x64 off, JAX's default, and on)
within the harness's tolerance of the float64 reference VJP.

Expected values come from numpy_attn in float64, finite differences and
``conformance.cases.reference``; never from jax_attn.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="pip install jax")

import jax.numpy as jnp  # noqa: E402
from jax_inputs import GBIAS, GCOT, GK, GMASK, GQ, GV, HALF, _f64  # noqa: E402
from numerics import assert_vjp_matches_reference  # noqa: E402

import jax_attn as ja  # noqa: E402
import numpy_attn as na  # noqa: E402

# float64 inputs stay float64: x64 on for each test here (conftest.x64_on), never for the run
pytestmark = pytest.mark.usefixtures("x64_on")


# ------------------------------------------------------------------------------ gradients


GRAD_CONFIGS = {
    "causal_bottom_right": {"is_causal": True, "causal_alignment": "bottom_right"},
    "window": {"window": (1, 1)},
    "softcap": {"softcap": 1.5, "scale": 1.3},
    "fully_masked_row": {"mask": GMASK},
    "causal_top_left_dropout_mask": {
        "is_causal": True, "dropout_p": 0.5, "dropout_mask": GMASK[..., ::-1, :]
    },
}


def _loss(sdpa, config):
    def loss(q, k, v, bias):
        return (sdpa(q, k, v, bias=bias, **config) * GCOT).sum()

    return loss


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GRAD_CONFIGS))
def test_grad_matches_central_differences_of_numpy_attn(name):
    config = GRAD_CONFIGS[name]
    grads = jax.grad(_loss(ja.scaled_dot_product_attention, config), argnums=(0, 1, 2, 3))(
        GQ, GK, GV, GBIAS
    )
    loss_np = _loss(na.scaled_dot_product_attention, config)
    args = [GQ, GK, GV, GBIAS]
    directions = np.random.default_rng(7)
    eps = 1e-6
    for index, grad in enumerate(grads):
        grad = np.asarray(grad)
        assert grad.shape == args[index].shape and np.isfinite(grad).all()
        for _ in range(3):  # directional derivatives along random directions
            d = directions.standard_normal(args[index].shape)
            plus, minus = list(args), list(args)
            plus[index], minus[index] = args[index] + eps * d, args[index] - eps * d
            fd = (loss_np(*plus) - loss_np(*minus)) / (2 * eps)
            np.testing.assert_allclose((grad * d).sum(), fd, rtol=1e-6, atol=1e-8, err_msg=name)


def test_fully_masked_row_gradient_is_exactly_zero():
    loss = _loss(ja.scaled_dot_product_attention, {"mask": GMASK})
    gq, gk, gv, gbias = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(GQ, GK, GV, GBIAS)
    assert np.all(np.asarray(gq)[0, :, 1] == 0.0)
    assert np.all(np.asarray(gbias)[0, :, 1] == 0.0)
    assert np.all(np.asarray(gbias)[0, :, 2, 3] == 0.0)  # a single masked position
    for g in (gq, gk, gv, gbias):
        assert np.isfinite(np.asarray(g)).all()
    # every key masked for every query: all gradients exactly 0, no NaN
    nothing = np.zeros_like(GMASK)
    grads = jax.grad(_loss(ja.scaled_dot_product_attention, {"mask": nothing}), (0, 1, 2, 3))(
        GQ, GK, GV, GBIAS
    )
    assert all(np.all(np.asarray(g) == 0.0) for g in grads)


def test_step_function_gradients_are_finite_on_empty_rows():
    scores = jnp.asarray(GBIAS)

    def loss(s):
        masked = ja.mask_scores(s, mask=GMASK, is_causal=True)
        weights = ja.attention_weights(masked)
        renorm = ja.renormalized_causal_weights(weights, causal_alignment="bottom_right")
        return (weights * renorm).sum()

    grad = np.asarray(jax.grad(loss)(scores))
    assert np.isfinite(grad).all()
    assert np.all(grad[0, :, 1] == 0.0)


@pytest.mark.parametrize("dtype", ("float32",) + HALF)
def test_low_precision_gradients_under_jit_match_reference(dtype, x64):
    """jax.grad under jit in float32, bfloat16 and float16, x64 off (JAX's default) and on:
    every gradient keeps its input's dtype and is within the harness's tolerance of the
    float64 reference VJP computed in NumPy (query row 1 masked: its gradient exactly 0)."""
    q, k, v, bias, cot = (jnp.asarray(a, dtype) for a in (GQ, GK, GV, GBIAS, GCOT))

    def loss(q, k, v, bias):
        out = ja.scaled_dot_product_attention(q, k, v, bias=bias, mask=GMASK, is_causal=True,
                                              causal_alignment="bottom_right")
        return (out * cot).sum()  # d loss / d out = cot, exactly

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    for g, a in zip(grads, (q, k, v, bias), strict=True):
        assert g.dtype == a.dtype
    arrays = {"query": q, "key": k, "value": v, "bias": bias, "mask": GMASK, "grad_output": cot}
    assert_vjp_matches_reference(grads, arrays, dtype, f"x64={x64}", is_causal=True,
                                 causal_alignment="bottom_right")
    assert np.all(_f64(grads[0])[0, :, 1] == 0.0)
