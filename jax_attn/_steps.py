"""The unchecked steps of the pipeline: scores, soft-cap, mask, softmax, dropout and the weighted
sum of values; the sinks, each row's log-sum-exp and the merging of partial results over
disjoint keys (``spec.SINKS``, ``spec.MERGING``: the online softmax's step, the ring's and the
paged decoder's); and the gradient helpers of the hand-written backward passes (``_tiles.py``,
the blocked fast path). The steps take arrays that the public functions have already
validated (``functional.py`` does, with ``attention_rules``); the mask step asks
``_masking.py`` which positions may attend. Imports run one way: ``_arrays < _masking <
_steps < _tiles < _fast`` (see ``_arrays.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ._arrays import _group_heads, _groups, _merged, _to_compute
from ._masking import _allowed, _Mods, _mods_scores

NEG_INF = -jnp.inf
HIGHEST = jax.lax.Precision.HIGHEST


# ------------------------------------------------------------------------------------------
# The steps, unchecked: each returns a fresh array (JAX arrays are immutable; XLA fuses
# the steps under jit). The public functions validate, then call these.
# ------------------------------------------------------------------------------------------


def _scores(query: jax.Array, key: jax.Array, scale: float, softcap: float | None) -> jax.Array:
    query = _to_compute(query) * scale  # (..., heads, q_len, head_dim); scaling q is cheapest
    key = _to_compute(key)  # (..., kv_heads, kv_len, head_dim)
    groups = _groups(query.shape, key.shape)
    if groups > 1:  # grouped-query: (..., kv_heads, groups, q_len, head_dim)
        query = _group_heads(query, groups)
        key = key[..., None, :, :]  # (..., kv_heads, 1, kv_len, head_dim)
    # matmul with the transposed key: XLA folds the transpose into the dot's dimension numbers
    scores = jnp.matmul(query, jnp.swapaxes(key, -1, -2), precision=HIGHEST)  # (..., q, kv)
    scores = scores.reshape(_merged(scores.shape, groups))  # (..., heads, q_len, kv_len)
    return _softcap(scores, softcap)


def _softcap(scores: jax.Array, softcap: float | None) -> jax.Array:
    """``softcap · tanh(scores / softcap)``; unchanged for None."""
    if softcap is not None:
        scores = jnp.tanh(scores * (1.0 / softcap)) * softcap  # no in-place ops in JAX
    return scores


def _mask_scores(
    scores: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    mods: _Mods | None = None,
) -> jax.Array:
    """``scores (..., heads, q_len, kv_len)`` plus ``bias`` (and ALiBi, then ``score_mod``:
    ``mods``), then ``-inf`` wherever a position is not allowed (``_allowed``)."""
    if bias is not None:
        scores = scores + bias.astype(scores.dtype)  # (..., heads, q_len, kv_len)
    q_len, kv_len = scores.shape[-2:]
    allowed = _allowed(q_len, kv_len, mask, is_causal, causal_alignment, window, mods)
    if allowed is not None and mods is not None and mods.score_mod is not None:
        scores = _masked_gradient_zero(scores, allowed)  # score_mod's NaN there: gradient 0
    scores = _mods_scores(scores, mods, 0, 0)
    if allowed is not None:
        # replaced, not added: a NaN score at a masked position does not spread; and where,
        # not scores + log(mask): the gradient at a masked position is exactly 0
        scores = jnp.where(allowed, scores, NEG_INF)
    return scores


@jax.custom_vjp
def _masked_gradient_zero(scores: jax.Array, allowed: jax.Array) -> jax.Array:
    """``scores`` as they are; their gradient exactly 0 where ``allowed`` is False, by
    ``where``: a ``score_mod`` that is NaN (or infinite) only at masked positions gives a
    masked score, whose cotangent 0 times the mod's NaN derivative would be NaN."""
    return scores


def _masked_gradient_zero_fwd(scores: jax.Array, allowed: jax.Array) -> tuple:
    return scores, allowed


def _masked_gradient_zero_bwd(allowed: jax.Array, grad: jax.Array) -> tuple:
    return jnp.where(allowed, grad, jnp.zeros_like(grad)), None


_masked_gradient_zero.defvjp(_masked_gradient_zero_fwd, _masked_gradient_zero_bwd)


def _softmax(scores: jax.Array) -> jax.Array:
    """Softmax over the last axis; rows that are all ``-inf`` become exactly 0."""
    weights, row_sum = _unnormalised_softmax(scores)  # (..., q_len, kv_len), (..., q_len, 1)
    return weights / row_sum


def _unnormalised_softmax(scores: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``exp(scores - row max)`` and its row sums ``(..., q_len, 1)``; a row that is all
    ``-inf`` gives 0 and a row sum of 1, so dividing by it gives 0, never NaN."""
    row_max = scores.max(axis=-1, keepdims=True, initial=NEG_INF)  # (..., q_len, 1)
    # softmax is shift-invariant, so stop_gradient is exact and keeps max's VJP out of the graph
    row_max = jax.lax.stop_gradient(row_max)
    row_max = jnp.where(row_max == NEG_INF, 0.0, row_max)  # fully masked: exp(-inf - 0) = 0
    scores = jnp.exp(scores - row_max)
    row_sum = scores.sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    row_sum = jnp.where(row_sum == 0.0, 1.0, row_sum)  # 0 / 1 = 0 for fully masked rows
    return scores, row_sum


def _dropout(
    weights: jax.Array, dropout_p: float, dropout_mask: jax.Array | None, rng: Any
) -> jax.Array:
    if dropout_mask is None:
        dropout_mask = _keep_mask(weights, dropout_p, rng)
    return weights * dropout_mask * (1.0 / (1.0 - dropout_p))


def _keep_mask(weights: jax.Array, dropout_p: float, rng: Any) -> jax.Array:
    """A keep-mask shaped like ``weights (..., q_len, kv_len)``: True (keep) with probability
    ``1 - dropout_p``, drawn from ``rng``, an explicit ``jax.random`` key (checked by
    ``_check_rng``), never hidden global state."""
    return jax.random.uniform(rng, weights.shape, dtype=jnp.float32) >= dropout_p


def _output(weights: jax.Array, value: jax.Array) -> jax.Array:
    value = _to_compute(value)  # (..., kv_heads, kv_len, v_dim)
    groups = _groups(weights.shape, value.shape)
    if groups > 1:
        weights = _group_heads(weights, groups)  # (..., kv_heads, groups, q_len, kv_len)
        value = value[..., None, :, :]  # (..., kv_heads, 1, kv_len, v_dim)
    output = jnp.matmul(weights.astype(value.dtype), value, precision=HIGHEST)  # explicit
    return output.reshape(_merged(output.shape, groups))  # (..., heads, q_len, v_dim)


# ------------------------------------------------------------------------------------------
# Sinks, each row's log-sum-exp and merging partial results (spec.SINKS, spec.MERGING)
# ------------------------------------------------------------------------------------------


def _softmax_lse(scores: jax.Array, sinks: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Softmax over the last axis and each row's log-sum-exp ``(..., q_len)``: ``scores
    (..., heads, q_len, kv_len)``; ``sinks (heads,)`` (or None) join every row's denominator
    as a column without a value (``spec.SINKS``). A row that is all ``-inf`` gives weights 0
    and, without a sink, lse ``-inf``; its gradients are 0, never NaN."""
    row_max = scores.max(axis=-1, keepdims=True, initial=NEG_INF)  # (..., q_len, 1)
    if sinks is not None:  # the shift covers the sink too: exp(sink - max) <= 1
        sink = _sink_column(sinks, scores.ndim, scores.dtype)  # (heads, 1, 1)
        row_max = jnp.maximum(row_max, sink)
    # shift-invariant (weights and lse alike): stop_gradient is exact
    row_max = jax.lax.stop_gradient(row_max)
    row_max = jnp.where(row_max == NEG_INF, 0.0, row_max)  # fully masked: exp(-inf - 0) = 0
    weights = jnp.exp(scores - row_max)
    row_sum = weights.sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    if sinks is not None:
        row_sum = row_sum + jnp.exp(sink - row_max)
    empty = row_sum == 0.0  # no key, no sink
    safe_sum = jnp.where(empty, 1.0, row_sum)  # where, not log(0): gradients stay finite
    lse = jnp.where(empty, NEG_INF, row_max + jnp.log(safe_sum))[..., 0]  # (..., q_len)
    return weights / safe_sum, lse


def _sink_column(sinks: jax.Array, ndim: int, dtype: Any) -> jax.Array:
    """``(heads,)`` sink logits against rows ``(..., heads, q_len, 1)`` of rank ``ndim``:
    ``(heads, 1, 1)``, or ``(1, 1)`` for inputs without a heads axis, in ``dtype``."""
    sinks = sinks.astype(dtype)
    return sinks.reshape(sinks.shape + (1, 1)) if ndim >= 3 else sinks.reshape(1, 1)


def _merge_attention(
    outputs: tuple[jax.Array, ...], lses: tuple[jax.Array, ...], sinks: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Partial results over disjoint key sets of the same rows, each an output
    ``(..., rows, v_dim)`` and its log-sum-exp ``(..., rows, 1)`` (``-inf``: no key), merged
    into the attention over every key set and its log-sum-exp (``spec.MERGING``; the online
    softmax's step). ``sinks (heads,)`` join the denominator once: a part whose output is 0.
    Differentiable: a part with lse ``-inf`` gets gradient 0."""
    lses = list(lses)
    if sinks is not None:
        lses.append(_sink_column(sinks, outputs[0].ndim, lses[0].dtype))
    row_max = jax.lax.stop_gradient(functools.reduce(jnp.maximum, lses))  # (..., rows, 1)
    shift = jnp.where(row_max == NEG_INF, 0.0, row_max)  # no -inf - -inf
    scales = [jnp.exp(lse - shift) for lse in lses]  # exp(lse_i - max) <= 1; 0 for no key
    total = functools.reduce(jnp.add, scales)
    empty = total == 0.0  # no key in any part
    safe_total = jnp.where(empty, 1.0, total)
    lse = jnp.where(empty, NEG_INF, shift + jnp.log(safe_total))
    output = functools.reduce(jnp.add, [  # a part with lse -inf adds 0, even a NaN output
        a * jnp.where(part == NEG_INF, 0.0, out) for a, part, out in zip(scales, lses, outputs,
                                                                         strict=False)])
    return output / safe_total, lse


def _merge_partials(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Two partial results over different keys of the same rows (``_merge_attention`` of two
    parts, the ring's and the causal pieces' step): outputs ``(..., rows, v_dim)``, lses
    ``(..., rows, 1)`` (``-inf``: no key)."""
    return _merge_attention((out_a, out_b), (lse_a, lse_b), None)


def _with_sinks(
    output: jax.Array, lse: jax.Array, sinks: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Rows finished over their keys by the online softmax, ``output (..., rows, v_dim)`` and
    ``lse (..., rows, 1)`` (``+inf`` for a row without a key, the tiles' convention), in the
    spec's terms: the sinks joined (``_merge_attention``) and ``-inf`` for a row without a key
    nor a sink."""
    lse = jnp.where(lse == jnp.inf, NEG_INF, lse)
    if sinks is None:
        return output, lse
    return _merge_attention((output,), (lse,), sinks)


def _sinks_grad(sinks: jax.Array, lse: jax.Array, row_dot: jax.Array) -> jax.Array:
    """``d sinks (heads,)`` in ``lse``'s dtype: ``-sum p_sink · row_dot`` over every axis but
    the heads, ``p_sink = exp(sink - lse)`` (0 where lse is ``±inf``: a row with no key nor
    sink); ``lse`` and ``row_dot = rowsum(dO ⊙ O) - dlse`` are ``(..., heads, rows, 1)`` (the
    blocked path's hand-written VJP)."""
    sink = _sink_column(sinks, lse.ndim, lse.dtype)
    p_sink = jnp.where(jnp.isinf(lse), 0.0, jnp.exp(sink - lse))  # (..., heads, rows, 1)
    terms = -p_sink * row_dot
    if lse.ndim < 3:  # no heads axis: one sink
        return terms.sum().reshape(1)
    return terms.sum(axis=tuple(a for a in range(terms.ndim) if a != terms.ndim - 3))


# ------------------------------------------------------------------------------------------
# Gradients: grouped heads and broadcast inputs
# ------------------------------------------------------------------------------------------


def _matmul_grouped(a: jax.Array, b: jax.Array, groups: int) -> jax.Array:
    """``a (..., heads, T, S) @ b (..., kv_heads, S, D)`` with the grouped-query head mapping."""
    if groups == 1:
        return jnp.matmul(a, b, precision=HIGHEST)
    product = jnp.matmul(_group_heads(a, groups), b[..., None, :, :], precision=HIGHEST)
    return product.reshape(a.shape[:-1] + (b.shape[-1],))  # (..., heads, T, D)


def _sum_groups(x: jax.Array, groups: int) -> jax.Array:
    """``(..., heads, T, D)`` → ``(..., kv_heads, T, D)``: add the query heads sharing a kv head."""
    if groups == 1:
        return x
    return _group_heads(x, groups).sum(axis=-3)


def _sum_to_shape(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sum ``x`` over the axes along which an array of ``shape`` was broadcast to ``x.shape``."""
    leading = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(leading))) if leading else x
    stretched = tuple(axis for axis, size in enumerate(shape) if size == 1 and x.shape[axis] != 1)
    return x.sum(axis=stretched, keepdims=True) if stretched else x
