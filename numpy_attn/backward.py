"""The backward pass of attention, written out by hand.

Forward (``functional.py``), with ``Z`` the dropout keep-mask and ``p`` its drop rate::

    S0 = (Q Kᵀ) · scale                 raw scores
    S1 = c · tanh(S0 / c)               soft-capped (S1 = S0 without softcap)
    S  = mask(S1 + bias)                -inf where not allowed
    P  = softmax(S)                     0 on fully masked rows
    P̃  = P ⊙ Z / (1 - p)               dropout
    O  = P̃ V

Backward, given ``dO`` (FlashAttention's derivation, Dao et al. 2022, appendix B.2)::

    dV = P̃ᵀ dO
    dP = (dO Vᵀ) ⊙ Z / (1 - p)
    dS = P ⊙ (dP - rowsum(dO ⊙ O))      rowsum(dO ⊙ O) = rowsum(P ⊙ dP), cheaper
    dbias = dS                           summed over the axes bias was broadcast along
    dS0 = dS ⊙ (1 - (S1 / c)²)           tanh' (dS0 = dS without softcap)
    dQ = dS0 K · scale
    dK = dS0ᵀ Q · scale

Masked positions have ``P = 0`` and so ``dS = 0``: no gradient flows through them, and a fully
masked row contributes exactly 0. A sink (``spec.SINKS``) is one more column of ``S`` whose value
is 0: ``P`` is normalised with it, ``dP`` is 0 there, so the formulas hold as written and
``dsink = -sum p_sink · rowsum(dO ⊙ O)``, ``p_sink = exp(sink - lse)``. ``merge_attention_vjp``
differentiates ``merge_attention`` by hand too. With grouped-query attention, the query heads
that share a key/value head add their ``dK`` and ``dV`` into it.

``scaled_dot_product_attention_vjp`` below is these formulas on whole ``(q_len, kv_len)``
arrays: the code to read. For large inputs (``_fast.use_fast_path``, the forward pass's rule)
it returns ``_fast.fast_attention_vjp`` instead: the same formulas tile by tile
(FlashAttention-2's backward: the weights recomputed from each row's log-sum-exp, fully masked
tiles skipped) on every core, with a few tiles of extra memory; both are tested equal
(``tests/test_fast_backward_numpy.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import attention_rules as rules

from . import _fast
from ._arrays import _array, _describe, _describe_parts, _groups, _to_compute
from ._masking import _add_alibi, _describe_segments, _mods, _mods_slope
from ._steps import (
    _mask_scores,
    _matmul_grouped,
    _merge_attention,
    _output,
    _scores,
    _sinks_grad,
    _softmax,
    _softmax_lse,
    _sum_groups,
    _sum_to_shape,
)


def scaled_dot_product_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    dropout_mask: Any = None,
    sinks: Any = None,
    chunk_size: int | None = None,
    alibi_slopes: Any = None,
    segment_ids: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
) -> tuple[np.ndarray | None, ...]:
    """Gradients of ``scaled_dot_product_attention`` with respect to its array inputs.

    Arguments are those of ``scaled_dot_product_attention`` (dropout needs its ``dropout_mask``:
    the backward pass must see the forward pass's keep-mask), plus:

    Args:
      query: ``(..., heads, q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)``.
      grad_output: ``(..., heads, q_len, v_dim)``, the gradient of a loss with respect to the
        output.
      sinks: ``(heads,)`` sink logits, or None. The sink is one more column of the softmax
        whose value is 0, so ``dP`` is 0 there, ``rowsum(dO ⊙ O)`` is unchanged and the
        formulas above hold with ``P`` normalised by the sink too; ``d sink = -sum p_sink ·
        rowsum(dO ⊙ O)`` over batch and queries, ``p_sink = exp(sink - lse)``.
      chunk_size, alibi_slopes, segment_ids, mask_mod: as in
        ``scaled_dot_product_attention``: ALiBi adds a constant (no gradient for the slopes),
        the rest mask, so the formulas hold as written.
      score_mod: between ``S1 + bias + ALiBi`` and the masking, so ``dS`` is multiplied by its
        derivative before the bias takes it: ``score_mod.derivative(score, batch, head, q_idx,
        kv_idx)`` (the ready-made score mods of ``numpy_attn.masks`` have one);
        NotImplementedError for a callable without one (``spec.SCORE_MOD``).

    Returns:
      ``(grad_query, grad_key, grad_value, grad_bias)`` with the shapes and dtype of query, key,
      value and bias; ``grad_bias`` is None without a bias; with ``sinks`` a fifth,
      ``grad_sinks (heads,)`` in the sinks' dtype.
    """
    fn = "scaled_dot_product_attention_vjp"
    args = rules.attention_arguments(
        fn, _describe(fn, "query", query), _describe(fn, "key", key),
        _describe(fn, "value", value), grad_output=_describe(fn, "grad_output", grad_output),
        mask=_describe(fn, "mask", mask), bias=_describe(fn, "bias", bias), is_causal=is_causal,
        causal_alignment=causal_alignment, window=window, scale=scale, softcap=softcap,
        dropout_p=dropout_p, dropout_mask=_describe(fn, "dropout_mask", dropout_mask),
        sinks=_describe(fn, "sinks", sinks), chunk_size=chunk_size,
        alibi_slopes=_describe(fn, "alibi_slopes", alibi_slopes),
        segment_ids=_describe_segments(fn, segment_ids), score_mod=score_mod, mask_mod=mask_mod,
    )  # every rule of the spec, once
    rules.check_mod_derivative(fn, args.score_mod)  # numpy: by hand, so it needs d score_mod
    query, key, value, grad_output = _array(query), _array(key), _array(value), _array(grad_output)
    mask, bias, dropout_mask = _array(mask), _array(bias), _array(dropout_mask)
    sinks = _array(sinks)
    mods = _mods(fn, args, query.shape, key.shape, alibi_slopes, rules.segment_pair(segment_ids))
    scale, softcap, dropout_p = args.scale, args.softcap, args.dropout_p
    path = _fast.use_fast_path(query, key, value, mask, bias, args)
    if path is not None:  # large inputs: the same gradients tile by tile, on every core
        return _fast.fast_attention_vjp(path, query, key, value, grad_output, mask, bias, args,
                                        sinks, mods)

    # Forward again, keeping what the backward pass needs.
    capped = _scores(query, key, scale, softcap)  # S1: (..., heads, q_len, kv_len)
    weights = _mask_scores(capped.copy(), mask, bias, args.is_causal, args.causal_alignment,
                           args.window, mods)
    if sinks is None:
        weights = _softmax(weights)  # P
    else:  # P, normalised with the sink; lse: (..., heads, q_len)
        weights, lse = _softmax_lse(weights, sinks)
    keep = 1.0 if dropout_p == 0 else dropout_mask * (1.0 / (1.0 - dropout_p))  # Z / (1 - p)
    dropped = weights * keep if dropout_p > 0 else weights  # P̃
    output = _output(dropped, value)  # O: (..., heads, q_len, v_dim)

    q, k, v = _to_compute(query), _to_compute(key), _to_compute(value)
    d_out = _to_compute(grad_output)
    groups = _groups(q.shape, k.shape)
    # dV = P̃ᵀ dO, summed over the query heads that share each kv head
    grad_value = _sum_groups(np.swapaxes(dropped, -1, -2) @ d_out, groups)
    # dP = (dO Vᵀ) ⊙ Z / (1 - p)
    grad_weights = _matmul_grouped(d_out, np.swapaxes(v, -1, -2), groups) * keep
    # dS = P ⊙ (dP - rowsum(dO ⊙ O))
    row_dot = (d_out * output).sum(axis=-1, keepdims=True)  # (..., heads, q_len, 1)
    grad_scores = weights * (grad_weights - row_dot)
    if args.score_mod is not None:  # dS ⊙ score_mod'(S1 + bias + ALiBi)
        pre = capped + bias.astype(capped.dtype, copy=False) if bias is not None else capped.copy()
        slope = _mods_slope(_add_alibi(pre, mods, 0, 0), mods, 0, 0)
        # where, not times: 0 where the weight is 0 (masked), even where the slope is NaN
        np.multiply(grad_scores, slope, out=grad_scores, where=weights != 0.0)
    # a copy: grad_scores is scaled in place below
    grad_bias = None if bias is None else np.array(_sum_to_shape(grad_scores, bias.shape))
    if softcap is not None:  # d/dx c·tanh(x/c) = 1 - tanh²(x/c) = 1 - (S1/c)²
        grad_scores *= 1.0 - np.square(capped * (1.0 / softcap))
    grad_scores *= scale
    grad_query = _matmul_grouped(grad_scores, k, groups)  # (..., heads, q_len, head_dim)
    grad_key = _sum_groups(np.swapaxes(grad_scores, -1, -2) @ q, groups)
    dtype = query.dtype
    grads = (grad_query.astype(dtype), grad_key.astype(dtype), grad_value.astype(dtype))
    grads += (None if grad_bias is None else grad_bias.astype(bias.dtype),)
    if sinks is None:
        return grads
    # d sink = -sum over batch and queries of p_sink · rowsum(dO ⊙ O), p_sink = exp(sink - lse)
    return grads + (_sinks_grad(sinks, lse[..., None], row_dot).astype(sinks.dtype),)


def merge_attention_vjp(
    outputs: Any, lses: Any, grad_output: Any, *, grad_lse: Any = None, sinks: Any = None
) -> tuple[tuple[np.ndarray, ...] | np.ndarray, ...]:
    """Gradients of ``merge_attention``, by hand.

    Forward: ``L = log(sum_i exp(lse_i) + exp(sink))``, ``a_i = exp(lse_i - L)``, ``O = sum_i
    a_i O_i``. Since ``d a_i / d lse_j = a_i (δ_ij - a_j)`` and ``dL / d lse_i = a_i``::

        dO_i    = a_i dO
        dlse_i  = a_i (rowsum(dO ⊙ (O_i - O)) + dL)
        dsink   = a_sink (dL - rowsum(dO ⊙ O))       summed over batch and queries

    A part with lse ``-inf`` has ``a_i = 0``: its gradients are 0 (no NaN, also when every
    part is ``-inf``).

    Args:
      outputs: list or tuple of ``(..., heads, q_len, v_dim)`` partial outputs.
      lses: list or tuple of their ``(..., heads, q_len)`` log-sum-exps.
      grad_output: ``(..., heads, q_len, v_dim)``: the merged output's cotangent.
      grad_lse: ``(..., heads, q_len)``: the merged lse's cotangent, or None (0).
      sinks: ``(heads,)`` sink logits, or None.

    Returns:
      ``(grad_outputs, grad_lses)``, tuples shaped and typed like ``outputs`` and ``lses``,
      and with ``sinks`` a third element, ``grad_sinks (heads,)`` in the sinks' dtype.
    """
    fn = "merge_attention_vjp"
    args = rules.merge_arguments(
        fn, _describe_parts(fn, "outputs", outputs), _describe_parts(fn, "lses", lses),
        sinks=_describe(fn, "sinks", sinks), grad_output=_describe(fn, "grad_output", grad_output),
        grad_lse=_describe(fn, "grad_lse", grad_lse),
    )
    parts = [_array(out).astype(args.compute, copy=False) for out in outputs]
    lse_parts = [_array(lse).astype(args.compute, copy=False)[..., None] for lse in lses]
    sinks = _array(sinks)
    output, lse = _merge_attention(tuple(parts), tuple(lse_parts), sinks)  # O, L: (..., q, 1)
    d_out = _array(grad_output).astype(args.compute, copy=False)  # (..., q_len, v_dim)
    d_lse = 0.0 if grad_lse is None else _array(grad_lse).astype(args.compute)[..., None]
    shift = np.where(lse == -np.inf, 0.0, lse).astype(lse.dtype)  # every part -inf: a_i = 0
    grad_outputs, grad_lses = [], []
    for out, part, given_out, given_lse in zip(parts, lse_parts, outputs, lses, strict=True):
        a = np.exp(part - shift)  # a_i: (..., q_len, 1)
        grad_outputs.append((a * d_out).astype(_array(given_out).dtype, copy=False))
        out = np.where(part == -np.inf, 0.0, out)  # no key: its output (even NaN) adds nothing
        grad = a * ((d_out * (out - output)).sum(axis=-1, keepdims=True) + d_lse)
        grad_lses.append(grad[..., 0].astype(_array(given_lse).dtype, copy=False))
    grads = (tuple(grad_outputs), tuple(grad_lses))
    if sinks is None:
        return grads
    row_dot = (d_out * output).sum(axis=-1, keepdims=True) - d_lse  # rowsum(dO ⊙ O) - dL
    return grads + (_sinks_grad(sinks, lse, row_dot).astype(sinks.dtype),)


# ------------------------------------------------------------------------------------------
# NumPy only: no autodiff, so the modules' backward passes and a minimal optimiser live here
# ------------------------------------------------------------------------------------------


def projection_grads(x: np.ndarray, grad_projected: np.ndarray) -> np.ndarray:
    """Gradient of ``W`` in ``y = x @ W``: ``xᵀ dy`` summed over every leading axis.

    Args:
      x: ``(..., seq, d_in)``.
      grad_projected: ``(..., seq, d_out)``.

    Returns:
      ``(d_in, d_out)``.
    """
    x2 = x.reshape(-1, x.shape[-1])  # (batch·seq, d_in)
    return x2.T @ grad_projected.reshape(-1, grad_projected.shape[-1])  # (d_in, d_out)


def sgd_step(module: Any, grads: dict[str, np.ndarray], learning_rate: float) -> Any:
    """One plain gradient-descent step: ``W ← W - learning_rate · dW`` for every weight.

    Args:
      module: any numpy_attn module.
      grads: weight name → gradient, as returned by the module's ``backward``.
      learning_rate: step size.

    Returns:
      the module, updated in place.
    """
    weights = module.export_weights()
    return module.load_weights(
        {name: w - learning_rate * grads[name].astype(w.dtype) for name, w in weights.items()}
    )


class Adam:
    """Adam (Kingma & Ba, 2015) over a module's weight dict, for NumPy-only training.

    ``step(module, grads)`` updates the module in place and returns it. Same update rule as
    ``torch.optim.Adam`` and ``optax.adam`` with default settings (no weight decay).
    """

    def __init__(
        self, learning_rate: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        self.learning_rate, self.betas, self.eps = learning_rate, betas, eps
        self.steps = 0
        self.first: dict[str, np.ndarray] = {}
        self.second: dict[str, np.ndarray] = {}

    def step(self, module: Any, grads: dict[str, np.ndarray]) -> Any:
        """Apply one Adam update of ``grads`` (weight name → gradient) to ``module``."""
        beta1, beta2 = self.betas
        self.steps += 1
        weights = module.export_weights()
        updated = {}
        for name, w in weights.items():
            g = grads[name].astype(w.dtype)
            m = self.first.get(name, np.zeros_like(w)) * beta1 + (1 - beta1) * g
            s = self.second.get(name, np.zeros_like(w)) * beta2 + (1 - beta2) * g * g
            self.first[name], self.second[name] = m, s
            m_hat = m / (1 - beta1**self.steps)
            s_hat = s / (1 - beta2**self.steps)
            updated[name] = w - self.learning_rate * m_hat / (np.sqrt(s_hat) + self.eps)
        return module.load_weights(updated)
