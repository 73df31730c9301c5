"""The steps of numpy_attn's pipeline, unchecked: scores, soft-cap, mask, softmax, dropout and
output (``conformance/spec/functions.py``); the softmax with the sinks and each row's
log-sum-exp, and the merging of partial results over disjoint keys (``spec.SINKS``,
``spec.MERGING``: the online softmax's step, the ring's and the paged decoder's); and the
gradient helpers for grouped heads and broadcast inputs. Nothing here validates: the public
functions (``functional.py`` and the others) check their inputs once, with ``attention_rules``,
then call these. Imports: ``_arrays`` and ``_masking`` (the mask step applies the band and the
mods).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ._arrays import _group_heads, _groups, _merged, _to_compute
from ._masking import NEG_INF, _allowed, _Mods, _mods_scores

# ------------------------------------------------------------------------------------------
# The steps, unchecked: each returns a fresh array (numpy: one it owns, so later steps may
# work in place). The public functions validate, then call these.
# ------------------------------------------------------------------------------------------


def _scores(query: np.ndarray, key: np.ndarray, scale: float, softcap: float | None) -> np.ndarray:
    """``(query @ keyᵀ) · scale``, soft-capped: query ``(..., heads, q_len, head_dim)`` and key
    ``(..., kv_heads, kv_len, head_dim)`` give ``(..., heads, q_len, kv_len)`` in the compute
    dtype (query head ``h`` meets kv head ``h // groups``)."""
    query = _to_compute(query) * scale  # (..., heads, q_len, head_dim); scaling q is cheapest
    key = _to_compute(key)  # (..., kv_heads, kv_len, head_dim)
    groups = _groups(query.shape, key.shape)
    if groups > 1:  # grouped-query: (..., kv_heads, groups, q_len, head_dim)
        query = _group_heads(query, groups)
        key = key[..., None, :, :]  # (..., kv_heads, 1, kv_len, head_dim)
    scores = query @ np.swapaxes(key, -1, -2)  # (..., [kv_heads, groups,] q_len, kv_len)
    scores = scores.reshape(_merged(scores.shape, groups))  # (..., heads, q_len, kv_len)
    return _softcap(scores, softcap)


def _softcap(scores: np.ndarray, softcap: float | None) -> np.ndarray:
    """``softcap · tanh(scores / softcap)`` (in place); unchanged for None."""
    if softcap is not None:
        scores *= 1.0 / softcap
        np.tanh(scores, out=scores)
        scores *= softcap
    return scores


def _mask_scores(
    scores: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    mods: _Mods | None = None,
) -> np.ndarray:
    """``scores (..., heads, q_len, kv_len)`` plus ``bias`` (and ALiBi, then ``score_mod``:
    ``mods``), then ``-inf`` wherever a position is not allowed (``_allowed``: True in ``mask``
    = may attend); in place."""
    if bias is not None:
        scores += bias.astype(scores.dtype, copy=False)  # (..., heads, q_len, kv_len)
    scores = _mods_scores(scores, mods, 0, 0)
    q_len, kv_len = scores.shape[-2:]
    allowed = _allowed(q_len, kv_len, mask, is_causal, causal_alignment, window, mods)
    if allowed is not None:
        # replaced, not added: a NaN score at a masked position does not spread
        np.copyto(scores, NEG_INF, where=~allowed)
    return scores


def _softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in place; rows that are all ``-inf`` become exactly 0."""
    weights, row_sum = _unnormalised_softmax(scores)  # (..., q_len, kv_len), (..., q_len, 1)
    weights /= row_sum
    return weights


def _unnormalised_softmax(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``exp(scores - row max)`` (in place) and its row sums ``(..., q_len, 1)``; a row that is
    all ``-inf`` gives 0 and a row sum of 1, so dividing by it gives 0, never NaN."""
    row_max = scores.max(axis=-1, keepdims=True, initial=NEG_INF)  # (..., q_len, 1)
    row_max[row_max == NEG_INF] = 0.0  # fully masked row: exp(-inf - 0) = 0, no NaN
    scores -= row_max
    np.exp(scores, out=scores)
    row_sum = scores.sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    row_sum[row_sum == 0.0] = 1.0  # 0 / 1 = 0 for fully masked rows
    return scores, row_sum


def _dropout(
    weights: np.ndarray, dropout_p: float, dropout_mask: np.ndarray | None, rng: Any
) -> np.ndarray:
    """``weights (..., q_len, kv_len) · keep / (1 - dropout_p)``; the keep-mask (True = keep)
    is drawn from ``rng`` (a fresh ``default_rng()`` for None) when ``dropout_mask`` is None."""
    if dropout_mask is None:
        dropout_mask = _keep_mask(weights, dropout_p, rng)
    return weights * dropout_mask * (1.0 / (1.0 - dropout_p))


def _keep_mask(weights: np.ndarray, dropout_p: float, rng: Any) -> np.ndarray:
    """A keep-mask shaped like ``weights (..., q_len, kv_len)``: True (keep) with probability
    ``1 - dropout_p``, drawn from ``rng`` (a fresh ``default_rng()`` for None)."""
    rng = np.random.default_rng() if rng is None else rng
    return rng.random(weights.shape, dtype=np.float32) >= dropout_p


def _output(weights: np.ndarray, value: np.ndarray) -> np.ndarray:
    """``weights (..., heads, q_len, kv_len) @ value (..., kv_heads, kv_len, v_dim)`` with the
    grouped-query head mapping: ``(..., heads, q_len, v_dim)`` in the compute dtype."""
    value = _to_compute(value)  # (..., kv_heads, kv_len, v_dim)
    groups = _groups(weights.shape, value.shape)
    if groups > 1:
        weights = _group_heads(weights, groups)  # (..., kv_heads, groups, q_len, kv_len)
        value = value[..., None, :, :]  # (..., kv_heads, 1, kv_len, v_dim)
    output = weights.astype(value.dtype, copy=False) @ value
    return output.reshape(_merged(output.shape, groups))  # (..., heads, q_len, v_dim)


# ------------------------------------------------------------------------------------------
# Sinks, each row's log-sum-exp and merging partial results (spec.SINKS, spec.MERGING)
# ------------------------------------------------------------------------------------------


def _softmax_lse(scores: np.ndarray, sinks: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over the last axis (in place) and each row's log-sum-exp ``(..., q_len)``:
    ``scores (..., heads, q_len, kv_len)``; ``sinks (heads,)`` (or None) join every row's
    denominator as a column without a value (``spec.SINKS``), so the weights of a row sum to
    less than 1. A row that is all ``-inf`` gives weights 0 and, without a sink, lse ``-inf``."""
    row_max = scores.max(axis=-1, keepdims=True, initial=NEG_INF)  # (..., q_len, 1)
    if sinks is not None:  # the shift covers the sink too: exp(sink - max) <= 1
        sink = _sink_column(sinks, scores.ndim, scores.dtype)  # (heads, 1, 1)
        row_max = np.maximum(row_max, sink)
    row_max[row_max == NEG_INF] = 0.0  # fully masked row: exp(-inf - 0) = 0, no NaN
    scores -= row_max
    np.exp(scores, out=scores)
    row_sum = scores.sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    if sinks is not None:
        row_sum += np.exp(sink - row_max)
    with np.errstate(divide="ignore"):  # log(0) = -inf: a row without a key or a sink
        lse = (row_max + np.log(row_sum))[..., 0]  # (..., q_len)
    row_sum[row_sum == 0.0] = 1.0  # 0 / 1 = 0 for fully masked rows
    scores /= row_sum
    return scores, lse


def _sink_column(sinks: np.ndarray, ndim: int, dtype: Any) -> np.ndarray:
    """``(heads,)`` sink logits against rows ``(..., heads, q_len, 1)`` of rank ``ndim``:
    ``(heads, 1, 1)``, or ``(1, 1)`` for inputs without a heads axis, in ``dtype``."""
    sinks = sinks.astype(dtype, copy=False)
    return sinks.reshape(sinks.shape + (1, 1)) if ndim >= 3 else sinks.reshape(1, 1)


def _merge_attention(
    outputs: tuple[np.ndarray, ...], lses: tuple[np.ndarray, ...], sinks: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Partial results over disjoint key sets of the same rows, each an output
    ``(..., rows, v_dim)`` and its log-sum-exp ``(..., rows, 1)`` (``-inf``: no key), merged
    into the attention over every key set and its log-sum-exp (``spec.MERGING``; the online
    softmax's step). ``sinks (heads,)`` join the denominator once: a part whose output is 0."""
    lses = list(lses)
    if sinks is not None:
        lses.append(_sink_column(sinks, outputs[0].ndim, lses[0].dtype))
    row_max = functools.reduce(np.maximum, lses)  # (..., rows, 1)
    shift = np.where(row_max == NEG_INF, 0.0, row_max).astype(row_max.dtype)  # no -inf - -inf
    scales = [np.exp(lse - shift) for lse in lses]  # exp(lse_i - max) <= 1; 0 for no key
    total = functools.reduce(np.add, scales)
    with np.errstate(divide="ignore"):  # log(0) = -inf: no key in any part
        lse = shift + np.log(total)
    output = functools.reduce(np.add, [  # a part with lse -inf adds 0, even a NaN output
        a * np.where(part == NEG_INF, 0.0, out) for a, part, out in zip(scales, lses, outputs,
                                                                         strict=False)])
    return output / np.where(total == 0.0, 1.0, total).astype(total.dtype), lse


def _merge_partials(
    out_a: np.ndarray, lse_a: np.ndarray, out_b: np.ndarray, lse_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Two partial results over different keys of the same rows (``_merge_attention`` of two
    parts, the ring's and the causal pieces' step): outputs ``(..., rows, v_dim)``, lses
    ``(..., rows, 1)`` (``-inf``: no key)."""
    return _merge_attention((out_a, out_b), (lse_a, lse_b), None)


def _with_sinks(
    output: np.ndarray, lse: np.ndarray, sinks: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Rows finished over their keys by the online softmax, ``output (..., rows, v_dim)`` and
    ``lse (..., rows, 1)`` (``+inf`` for a row without a key, the tiles' convention), in the
    spec's terms: the sinks joined (``_merge_attention``) and ``-inf`` for a row without a key
    nor a sink."""
    lse = np.where(lse == np.inf, NEG_INF, lse).astype(lse.dtype)
    if sinks is None:
        return output, lse
    return _merge_attention((output,), (lse,), sinks)


def _sinks_grad(sinks: np.ndarray, lse: np.ndarray, row_dot: np.ndarray) -> np.ndarray:
    """``d sinks (heads,)`` in ``lse``'s dtype: ``-sum p_sink · row_dot`` over every axis but
    the heads, ``p_sink = exp(sink - lse)`` (0 where lse is ``±inf``: a row with no key nor
    sink); ``lse`` and ``row_dot = rowsum(dO ⊙ O) - dlse`` are ``(..., heads, rows, 1)``."""
    sink = _sink_column(sinks, lse.ndim, lse.dtype)
    with np.errstate(invalid="ignore"):
        p_sink = np.where(np.isinf(lse), 0.0, np.exp(sink - lse))  # (..., heads, rows, 1)
    terms = -p_sink * row_dot
    if lse.ndim < 3:  # no heads axis: one sink
        return terms.sum(keepdims=True).reshape(1).astype(lse.dtype)
    axes = tuple(a for a in range(terms.ndim) if a != terms.ndim - 3)
    return terms.sum(axis=axes).astype(lse.dtype)


# ------------------------------------------------------------------------------------------
# Gradients: grouped heads and broadcast inputs
# ------------------------------------------------------------------------------------------


def _matmul_grouped(a: np.ndarray, b: np.ndarray, groups: int) -> np.ndarray:
    """``a (..., heads, T, S) @ b (..., kv_heads, S, D)`` with the grouped-query head mapping."""
    if groups == 1:
        return a @ b
    product = _group_heads(a, groups) @ b[..., None, :, :]  # (..., kv_heads, groups, T, D)
    return product.reshape(a.shape[:-1] + (b.shape[-1],))  # (..., heads, T, D)


def _sum_groups(x: np.ndarray, groups: int) -> np.ndarray:
    """``(..., heads, T, D)`` → ``(..., kv_heads, T, D)``: add the query heads sharing a kv head."""
    if groups == 1:
        return x
    return _group_heads(x, groups).sum(axis=-3)


def _sum_to_shape(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``x`` over the axes along which an array of ``shape`` was broadcast to ``x.shape``."""
    leading = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(leading))) if leading else x
    stretched = tuple(axis for axis, size in enumerate(shape) if size == 1 and x.shape[axis] != 1)
    return x.sum(axis=stretched, keepdims=True) if stretched else x
