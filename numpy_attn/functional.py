"""Scaled dot-product attention, step by step, in NumPy.

The pipeline (``conformance/spec/functions.py``): scores → soft-cap → + bias → mask → softmax →
dropout → weighted sum of values. Every step is a public function, so every intermediate can be
printed and compared; ``scaled_dot_product_attention`` validates its inputs once
(``attention_rules``) and runs them all through ``pipeline``. A public step checks its arguments
in one call (``_checked_...``, at the end of this file), then shows its math; the unchecked steps
live in ``_steps.py`` (shared with the tiles, the fast path and ``backward.py``).

Precision: float16 and bfloat16 are computed in float32; float32 stays float32 (Python floats
only, never NumPy float64 scalars, so nothing is promoted); float64 stays float64.

Fast path: for large inputs ``scaled_dot_product_attention`` runs the same steps blocked over
queries, on every core (``_fast/``: ``use_fast_path`` says when, ``fast_attention`` how).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import attention_rules as rules

from . import _fast
from ._arrays import _array, _check_scores, _describe, _describe_parts, _to_compute
from ._masking import _allowed, _describe_segments, _in_band, _Mods, _mods
from ._steps import (
    NEG_INF,
    _dropout,
    _keep_mask,
    _mask_scores,
    _merge_attention,
    _output,
    _scores,
    _softmax,
    _softmax_lse,
)

# ------------------------------------------------------------------------------------------
# Public steps
# ------------------------------------------------------------------------------------------


def attention_scores(
    query: Any, key: Any, *, scale: float | None = None, softcap: float | None = None
) -> np.ndarray:
    """Scaled, optionally soft-capped dot products: ``(query @ keyᵀ) · scale``.

    Args:
      query: ``(..., heads, q_len, head_dim)`` or ``(q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)`` or ``(kv_len, head_dim)``.
      scale: default ``head_dim ** -0.5``; ``1.0`` gives the article's unnormalised ω.
      softcap: positive cap: ``softcap · tanh(scores / softcap)``.

    Returns:
      ``(..., heads, q_len, kv_len)`` in the compute dtype.
    """
    query, key, scale, softcap = _checked_attention_scores(query, key, scale, softcap)
    scores = _scores(query, key, scale, None)  # (query · scale) @ keyᵀ, grouped heads
    if softcap is not None:  # softcap · tanh(scores / softcap): smoothly within ±softcap
        scores = np.tanh(scores * (1.0 / softcap)) * softcap
    return scores  # (..., heads, q_len, kv_len)


def mask_scores(
    scores: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
) -> np.ndarray:
    """Add ``bias``, then set every disallowed position to ``-inf``.

    A position is allowed when ``mask`` is True there (True = may attend), the causal rule
    ``j <= i + offset`` holds (if ``is_causal``) and the window holds (if ``window``).

    Args:
      scores: ``(..., heads, q_len, kv_len)`` or ``(q_len, kv_len)``.
      mask: boolean, broadcastable to ``scores``.
      bias: floating point, broadcastable to ``scores``.
      is_causal: apply the causal rule.
      causal_alignment: ``"top_left"`` (offset 0) or ``"bottom_right"`` (``kv_len - q_len``).
      window: ``(left, right)``: ``i + offset - left <= j <= i + offset + right``.

    Returns:
      ``(..., heads, q_len, kv_len)`` in the compute dtype.
    """
    scores, mask, bias, is_causal, causal_alignment, window = _checked_mask_scores(
        scores, mask, bias, is_causal, causal_alignment, window)
    if bias is not None:
        scores += bias.astype(scores.dtype, copy=False)  # (..., heads, q_len, kv_len)
    allowed = _allowed(*scores.shape[-2:], mask, is_causal, causal_alignment, window)
    if allowed is not None:  # replaced, not added: a NaN at a masked position spreads nowhere
        np.copyto(scores, NEG_INF, where=~allowed)
    return scores


def attention_weights(scores: Any) -> np.ndarray:
    """Softmax over keys; a fully masked row (all ``-inf``) gives exactly 0.

    Args:
      scores: ``(..., q_len, kv_len)``.

    Returns:
      ``(..., q_len, kv_len)`` in the compute dtype; rows sum to 1 or are all 0.
    """
    scores = _checked_attention_weights(scores)
    row_max = scores.max(axis=-1, keepdims=True, initial=NEG_INF)  # (..., q_len, 1)
    exp = np.exp(scores - np.where(row_max == NEG_INF, 0.0, row_max))  # fully masked: exp(-inf)
    row_sum = exp.sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    return exp / np.where(row_sum == 0.0, 1.0, row_sum)  # a fully masked row: 0 / 1 = 0


def apply_dropout(
    weights: Any, dropout_p: float, *, dropout_mask: Any = None, rng: Any = None
) -> np.ndarray:
    """Dropout of the weights: ``weights · keep / (1 - dropout_p)``.

    Args:
      weights: ``(..., q_len, kv_len)``.
      dropout_p: drop probability in ``[0, 1)``.
      dropout_mask: boolean keep-mask (True = keep), broadcastable to ``weights``.
      rng: ``numpy.random.Generator`` for the keep-mask when none is given
        (``None``: a fresh ``numpy.random.default_rng()``).

    Returns:
      ``(..., q_len, kv_len)``, same dtype as ``weights``.
    """
    weights, dropout_p, dropout_mask = _checked_apply_dropout(weights, dropout_p, dropout_mask)
    if dropout_p == 0.0:
        return weights
    keep = _keep_mask(weights, dropout_p, rng) if dropout_mask is None else dropout_mask
    return (weights * keep * (1.0 / (1.0 - dropout_p))).astype(weights.dtype, copy=False)


def attention_output(weights: Any, value: Any) -> np.ndarray:
    """Weighted sum of values, ``weights @ value``, with the grouped-query head mapping.

    Args:
      weights: ``(..., heads, q_len, kv_len)`` or ``(q_len, kv_len)``.
      value: ``(..., kv_heads, kv_len, v_dim)`` or ``(kv_len, v_dim)``.

    Returns:
      ``(..., heads, q_len, v_dim)`` in the compute dtype.
    """
    weights, value = _checked_attention_output(weights, value)
    return _output(weights, value)  # weights @ value, head h with kv head h // groups's values


def renormalized_causal_weights(weights: Any, *, causal_alignment: str = "top_left") -> np.ndarray:
    """The article's first causal method: zero the weights above the diagonal, renormalise.

    Equals masking the scores with ``-inf`` before the softmax wherever a row keeps a key;
    a row that keeps none gives 0 (not ``0 / 0``).

    Args:
      weights: ``(..., q_len, kv_len)`` softmax weights.
      causal_alignment: ``"top_left"`` or ``"bottom_right"``.

    Returns:
      ``(..., q_len, kv_len)``, same dtype as ``weights``.
    """
    fn = "renormalized_causal_weights"
    _check_scores(fn, "weights", weights)
    rules.check_alignment(fn, causal_alignment)
    weights = _array(weights)
    q_len, kv_len = weights.shape[-2:]
    lo, hi = rules.band(q_len, kv_len, True, causal_alignment, None)  # j - i <= offset
    masked = weights * _in_band(0, q_len, 0, kv_len, lo, hi)  # (..., q_len, kv_len)
    row_sum = masked.sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    row_sum[row_sum == 0] = 1
    return masked / row_sum


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
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
    rng: Any = None,
    return_weights: bool = False,
    sinks: Any = None,
    return_lse: bool = False,
    chunk_size: int | None = None,
    alibi_slopes: Any = None,
    segment_ids: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
) -> np.ndarray | tuple[np.ndarray, ...]:
    """Scaled dot-product attention: ``softmax(mask(q kᵀ · scale + bias)) @ v``.

    Args:
      query: ``(..., heads, q_len, head_dim)`` or ``(q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)`` or ``(kv_len, head_dim)``; ``heads`` must be
        a multiple of ``kv_heads`` (query head ``h`` uses kv head ``h // (heads // kv_heads)``).
      value: ``(..., kv_heads, kv_len, v_dim)`` or ``(kv_len, v_dim)``.
      mask: boolean, broadcastable to ``(..., heads, q_len, kv_len)``; True = may attend.
      bias: floating point, broadcastable to ``(..., heads, q_len, kv_len)``.
      is_causal: query ``i`` attends key ``j`` only if ``j <= i + offset``.
      causal_alignment: ``"top_left"`` (offset 0) or ``"bottom_right"`` (``kv_len - q_len``).
      window: ``(left, right)`` sliding window, aligned like the causal rule.
      scale: default ``head_dim ** -0.5``.
      softcap: ``softcap · tanh(scores / softcap)`` before the bias.
      dropout_p: dropout on the weights, in ``[0, 1)``.
      dropout_mask: boolean keep-mask broadcastable to the weights (True = keep).
      rng: ``numpy.random.Generator`` for dropout when no keep-mask is given.
      return_weights: also return the weights (before dropout).
      sinks: ``(heads,)`` sink logits (``(1,)`` for 2-D inputs): each joins its head's softmax
        denominators as a column without a value (GPT-OSS); the weights exclude it.
      return_lse: also return each row's log-sum-exp (natural log, of the denominator used:
        the sink included).
      chunk_size: chunked local attention: query ``i`` attends key ``j`` only if
        ``(i + offset) // chunk_size == j // chunk_size`` (``spec.CHUNKED``).
      alibi_slopes: ``(heads,)``: ``-slope_h · |i + offset - j|`` added after the soft-cap
        (``spec.ALIBI``; flash-attention's with ``causal_alignment="bottom_right"``).
      segment_ids: ints ``(..., seq)``, or a pair ``(..., q_len)`` and ``(..., kv_len)``: only
        equal ids attend each other (``spec.SEGMENT_IDS``).
      score_mod: ``score_mod(score, batch, head, q_idx, kv_idx) -> score`` after ALiBi, on
        NumPy arrays (``spec.SCORE_MOD``; the VJP needs its ``derivative``).
      mask_mod: ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` (``spec.MASK_MOD``); the
        fast path skips the blocks it masks entirely.

    Returns:
      ``(..., heads, q_len, v_dim)`` in the input dtype, and, in this order, with
      ``return_weights`` the weights ``(..., heads, q_len, kv_len)`` in the input dtype and with
      ``return_lse`` the lse ``(..., heads, q_len)`` in the compute dtype (``-inf`` on a fully
      masked row without sinks). Fully masked rows give 0.
    """
    fn = "scaled_dot_product_attention"
    args = rules.attention_arguments(
        fn, _describe(fn, "query", query), _describe(fn, "key", key),
        _describe(fn, "value", value), mask=_describe(fn, "mask", mask),
        bias=_describe(fn, "bias", bias), is_causal=is_causal, causal_alignment=causal_alignment,
        window=window, scale=scale, softcap=softcap, dropout_p=dropout_p,
        dropout_mask=_describe(fn, "dropout_mask", dropout_mask), return_weights=return_weights,
        sinks=_describe(fn, "sinks", sinks), return_lse=return_lse, chunk_size=chunk_size,
        alibi_slopes=_describe(fn, "alibi_slopes", alibi_slopes),
        segment_ids=_describe_segments(fn, segment_ids), score_mod=score_mod, mask_mod=mask_mod,
    )  # every rule of the spec, on shapes and dtype names: raises, or normalises the options
    query, key, value = _array(query), _array(key), _array(value)
    mask, bias, dropout_mask = _array(mask), _array(bias), _array(dropout_mask)
    mods = _mods(fn, args, query.shape, key.shape, alibi_slopes, rules.segment_pair(segment_ids))
    return pipeline(query, key, value, mask, bias, dropout_mask, rng, args, _array(sinks), mods)


def merge_attention(
    outputs: Any, lses: Any, *, sinks: Any = None
) -> tuple[np.ndarray, np.ndarray]:
    """Attention over the union of disjoint key sets, from the partial results over each set.

    With ``m = max_i lse_i``: ``lse = m + log(sum_i exp(lse_i - m))`` and ``output = sum_i
    exp(lse_i - lse) · outputs[i]`` (the online softmax's step); a part with lse ``-inf`` adds
    nothing, and when every part is ``-inf`` the output is 0 and the lse ``-inf``.

    Args:
      outputs: list or tuple of ``(..., heads, q_len, v_dim)`` partial outputs, one dtype.
      lses: list or tuple of their ``(..., heads, q_len)`` log-sum-exps (without sinks).
      sinks: ``(heads,)`` sink logits, applied once, here; or None.

    Returns:
      ``(output, lse)``: ``(..., heads, q_len, v_dim)`` in the outputs' dtype and
      ``(..., heads, q_len)`` in its compute dtype.
    """
    fn = "merge_attention"
    args = rules.merge_arguments(fn, _describe_parts(fn, "outputs", outputs),
                                 _describe_parts(fn, "lses", lses),
                                 sinks=_describe(fn, "sinks", sinks))
    parts = [_array(out).astype(args.compute, copy=False) for out in outputs]
    lse_parts = [_array(lse).astype(args.compute, copy=False)[..., None] for lse in lses]
    sinks = None if sinks is None else _array(sinks)
    output, lse = _merge_attention(tuple(parts), tuple(lse_parts), sinks)
    return output.astype(_array(outputs[0]).dtype, copy=False), lse[..., 0]


def pipeline(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    dropout_mask: np.ndarray | None,
    rng: Any,
    args: rules.Arguments,
    sinks: np.ndarray | None = None,
    mods: _Mods | None = None,
) -> np.ndarray | tuple[np.ndarray, ...]:
    """The whole pipeline on validated arrays (``scaled_dot_product_attention`` after its
    checks): a fast path where ``_fast.use_fast_path`` selects one (it computes the same steps),
    else the steps of ``_steps`` one by one.

    Args:
      query: ``(..., heads, q_len, head_dim)`` or ``(q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)`` or ``(kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)`` or ``(kv_len, v_dim)``.
      mask: boolean, broadcastable to ``(..., heads, q_len, kv_len)`` (True = may attend), or
        None.
      bias: broadcastable to ``(..., heads, q_len, kv_len)``, or None.
      dropout_mask: boolean keep-mask broadcastable to the weights, or None.
      rng: ``numpy.random.Generator`` for dropout without a keep-mask, or None.
      args: the options as ``rules.attention_arguments`` normalised them.
      sinks: ``(heads,)`` sink logits, or None.
      mods: the chunk rule, ALiBi, segment ids and the mods (``_masking._mods``), or None.

    Returns:
      ``(..., heads, q_len, v_dim)`` in the input dtype, then with ``args.return_weights`` the
      weights ``(..., heads, q_len, kv_len)`` in the input dtype and with ``args.return_lse``
      the lse ``(..., heads, q_len)`` in the compute dtype.
    """
    path = _fast.use_fast_path(query, key, value, mask, bias, args)
    if path is not None:  # large inputs: the same steps, blocked over queries on every core
        return _fast.fast_attention(path, query, key, value, mask, bias, args, sinks, mods)
    scores = _scores(query, key, args.scale, args.softcap)  # (..., heads, q_len, kv_len)
    scores = _mask_scores(scores, mask, bias, args.is_causal, args.causal_alignment, args.window,
                          mods)
    lse = None
    if sinks is None and not args.return_lse:
        weights = _softmax(scores)  # (..., heads, q_len, kv_len), in place
    else:  # the sinks join each row's denominator; lse: (..., heads, q_len)
        weights, lse = _softmax_lse(scores, sinks)
    kept = _dropout(weights, args.dropout_p, dropout_mask, rng) if args.dropout_p > 0 else weights
    output = _output(kept, value).astype(query.dtype, copy=False)  # (..., heads, q_len, v_dim)
    results = (output,)  # output[, weights][, lse]
    if args.return_weights:
        results += (weights.astype(query.dtype, copy=False),)
    if args.return_lse:
        results += (lse,)
    return results if len(results) > 1 else output


# ------------------------------------------------------------------------------------------
# Validation of the public steps: one call each, the checked arrays and arguments out
# ------------------------------------------------------------------------------------------


def _checked_attention_scores(query: Any, key: Any, scale: float | None, softcap: float | None
                              ) -> tuple[np.ndarray, np.ndarray, float, float | None]:
    """``attention_scores``' arguments, checked (the scale: ``head_dim ** -0.5`` for None)."""
    fn = "attention_scores"
    q_shape, q_dtype = _describe(fn, "query", query)
    k_shape, k_dtype = _describe(fn, "key", key)
    rules.check_float_inputs(fn, query=q_dtype, key=k_dtype)
    rules.check_query_key(fn, q_shape, k_shape)
    scale = rules.check_scale(fn, scale, q_shape[-1])
    return _array(query), _array(key), scale, rules.check_softcap(fn, softcap)


def _checked_mask_scores(scores: Any, mask: Any, bias: Any, is_causal: bool,
                         causal_alignment: str, window: tuple | None) -> tuple:
    """``mask_scores``' arguments, checked; the scores in the compute dtype."""
    fn = "mask_scores"
    shape, dtype = _check_scores(fn, "scores", scores)
    rules.check_mask_bias(fn, _describe(fn, "mask", mask), _describe(fn, "bias", bias), shape)
    is_causal, causal_alignment, window = rules.check_structure(
        fn, is_causal, causal_alignment, window
    )
    scores = _array(scores).astype(rules.compute_dtype(dtype), copy=True)  # numpy: in place below
    return scores, _array(mask), _array(bias), is_causal, causal_alignment, window


def _checked_attention_weights(scores: Any) -> np.ndarray:
    """``attention_weights``' scores, checked, in the compute dtype."""
    _check_scores("attention_weights", "scores", scores)
    return _to_compute(_array(scores))


def _checked_apply_dropout(weights: Any, dropout_p: float, dropout_mask: Any) -> tuple:
    """``apply_dropout``' arguments, checked."""
    fn = "apply_dropout"
    shape, _ = _check_scores(fn, "weights", weights)
    dropout_p = rules.check_dropout(fn, dropout_p, dropout_mask is not None)
    rules.check_dropout_mask(fn, _describe(fn, "dropout_mask", dropout_mask), shape)
    weights, dropout_mask = _array(weights), _array(dropout_mask)
    return weights, dropout_p, dropout_mask


def _checked_attention_output(weights: Any, value: Any) -> tuple[np.ndarray, np.ndarray]:
    """``attention_output``' arguments, checked; the weights in the compute dtype."""
    fn = "attention_output"
    w_shape, w_dtype = _describe(fn, "weights", weights)
    v_shape, v_dtype = _describe(fn, "value", value)
    rules.check_float_inputs(
        fn, weights=rules.compute_dtype(w_dtype), value=rules.compute_dtype(v_dtype)
    )
    rules.check_weights_value(fn, w_shape, v_shape)
    return _to_compute(_array(weights)), _array(value)
