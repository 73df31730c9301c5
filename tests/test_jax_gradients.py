"""jax.grad of jax_attn: against central finite differences of numpy_attn in float64, exactly
0 on fully masked rows (no NaN, even when every key is masked), finite through the step
functions, and finite in half precision under jit.

Expected values come from numpy_attn in float64 and finite differences; never from jax_attn.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
from jax_inputs import GBIAS, GCOT, GK, GMASK, GQ, GV, HALF, _f64  # noqa: E402

import jax_attn as ja  # noqa: E402
import numpy_attn as na  # noqa: E402

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


@pytest.mark.parametrize("dtype", HALF)
def test_half_gradients_are_finite_under_jit(dtype):
    loss = _loss(ja.scaled_dot_product_attention, {"mask": GMASK})
    args = [jnp.asarray(a, dtype) for a in (GQ, GK, GV, GBIAS)]
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    for g, a in zip(grads, args, strict=True):
        assert g.dtype == a.dtype and np.isfinite(_f64(g)).all()
