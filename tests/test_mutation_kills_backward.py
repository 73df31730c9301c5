"""Tests that kill the mutants of ``numpy_attn/backward.py``'s explicit VJP and optimisers.

Part of the mutation round of ``tests/test_mutation_kills_vjp.py`` (docs/mutation.md): the
explicit steps' ``score_mod`` derivative (taken after the bias and ALiBi, at the tile's
positions), ``sgd_step`` and ``Adam``'s defaults. Expected values: the float64
``conformance.cases.reference.attention_vjp`` and the optimisers' formulas written out.
"""

from __future__ import annotations

import numpy as np
import pytest

import numpy_attn
from conformance.cases import reference


def _arrays(q_shape, k_shape, v_dim, seed=0):
    gen = np.random.default_rng(seed)
    q, k = gen.standard_normal(q_shape), gen.standard_normal(k_shape)
    v = gen.standard_normal(k_shape[:-1] + (v_dim,))
    return q, k, v, gen.standard_normal(q_shape[:-1] + (v_dim,))


def test_explicit_vjp_evaluates_the_score_mod_derivative_after_the_bias():
    """The explicit steps (small inputs): a soft-capping score_mod after a bias; its
    derivative is taken at ``S1 + bias``, as the float64 reference takes it."""
    q, k, v, grad_out = _arrays((1, 2, 5, 4), (1, 2, 6, 4), 3, seed=17)
    bias = np.random.default_rng(18).standard_normal((5, 6)) * 2.0
    mod = numpy_attn.masks.softcap_mod(1.5)
    got = numpy_attn.scaled_dot_product_attention_vjp(q * 2, k, v, grad_out, bias=bias,
                                                      score_mod=mod)
    want = reference.attention_vjp(q * 2, k, v, grad_out, bias=bias, score_mod=mod)
    for grad, name in zip(got, ("query", "key", "value", "bias"), strict=True):
        np.testing.assert_allclose(grad, getattr(want, name), rtol=1e-10, atol=1e-12,
                                   err_msg=name)


class _PerPosition:
    """A score_mod whose derivative depends on the positions: ``score · (1 + q/10 + k/20)``."""

    def __call__(self, score, batch, head, q_idx, kv_idx):
        return score * (1.0 + 0.1 * q_idx + 0.05 * kv_idx)

    def derivative(self, score, batch, head, q_idx, kv_idx):
        return np.broadcast_to(1.0 + 0.1 * q_idx + 0.05 * kv_idx, np.broadcast_shapes(
            np.shape(score), np.shape(q_idx), np.shape(kv_idx))).astype(score.dtype)


@pytest.mark.parametrize("mod", ["softcap", "per_position"])
def test_explicit_vjp_evaluates_the_score_mod_derivative_after_alibi(mod):
    """The explicit steps: ALiBi then a score_mod that is not additive; its derivative is
    taken at ``S1 + bias + ALiBi`` at the tile's own positions."""
    q, k, v, grad_out = _arrays((1, 2, 5, 4), (1, 2, 6, 4), 3, seed=19)
    score_mod = numpy_attn.masks.softcap_mod(1.5) if mod == "softcap" else _PerPosition()
    options = {"alibi_slopes": np.array([0.5, 1.0]), "bias": np.linspace(-1, 1, 6),
               "score_mod": score_mod}
    got = numpy_attn.scaled_dot_product_attention_vjp(q * 2, k, v, grad_out, **options)
    want = reference.attention_vjp(q * 2, k, v, grad_out, **options)
    for grad, name in zip(got, ("query", "key", "value", "bias"), strict=True):
        np.testing.assert_allclose(grad, getattr(want, name), rtol=1e-10, atol=1e-12,
                                   err_msg=name)


def test_sgd_step_and_adams_defaults_follow_their_formulas():
    """``sgd_step``: ``W - lr · dW`` in the weights' dtype; ``Adam()``: Kingma & Ba's update with
    torch's and optax's defaults (lr 1e-3, betas 0.9 and 0.999, eps 1e-8), two steps written
    out."""
    module = numpy_attn.SelfAttention(4, 3, 2, rng=np.random.default_rng(0))
    before = module.export_weights()
    gen = np.random.default_rng(20)
    grads = {k: gen.standard_normal(w.shape) for k, w in before.items()}
    after = numpy_attn.sgd_step(module, grads, 0.1).export_weights()
    for k, w in before.items():
        assert after[k].dtype == w.dtype, k
        np.testing.assert_allclose(after[k], w - 0.1 * grads[k], rtol=1e-5, atol=1e-6)
    module = module.load_weights({k: w.astype(np.float64) for k, w in before.items()})
    adam, steps = numpy_attn.Adam(), [grads, {k: g[::-1] * 0.5 for k, g in grads.items()}]
    for g in steps:
        module = adam.step(module, g)
    for k, w in before.items():
        g1, g2 = steps[0][k], steps[1][k]
        m = (0.9 * 0.1 * g1 + 0.1 * g2) / (1 - 0.9**2)
        s = (0.999 * 0.001 * g1**2 + 0.001 * g2**2) / (1 - 0.999**2)
        first = w - 1e-3 * g1 / (np.abs(g1) + 1e-8)
        want = first - 1e-3 * m / (np.sqrt(s) + 1e-8)
        np.testing.assert_allclose(module.export_weights()[k], want, rtol=1e-6, atol=1e-9)
