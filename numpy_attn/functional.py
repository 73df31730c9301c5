"""Scaled dot-product attention, step by step, in NumPy.

The pipeline (``conformance/spec.py``): scores → soft-cap → + bias → mask → softmax → dropout →
weighted sum of values. Every step is a public function, so every intermediate can be printed
and compared; ``scaled_dot_product_attention`` validates its inputs once (``attention_rules``)
and runs them all. The file reads top to bottom: the public steps, then the private helpers
they share with ``blockwise.py`` and with the fast path.

Precision: float16 and bfloat16 are computed in float32; float32 stays float32 (Python floats
only, never NumPy float64 scalars, so nothing is promoted); float64 stays float64.

Fast path: for large inputs ``scaled_dot_product_attention`` runs the same steps blocked over
queries, on every core (``_fast.py``: ``use_fast_path`` says when, ``fast_attention`` how).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import attention_rules as rules

from . import _fast
from .masks import _positions

NEG_INF = -np.inf


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
    fn = "attention_scores"
    q_shape, q_dtype = _describe(fn, "query", query)
    k_shape, k_dtype = _describe(fn, "key", key)
    rules.check_float_inputs(fn, query=q_dtype, key=k_dtype)
    rules.check_query_key(fn, q_shape, k_shape)
    scale = rules.check_scale(fn, scale, q_shape[-1])
    softcap = rules.check_softcap(fn, softcap)
    return _scores(_array(query), _array(key), scale, softcap)


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
    fn = "mask_scores"
    shape, dtype = _check_scores(fn, "scores", scores)
    rules.check_mask_bias(fn, _describe(fn, "mask", mask), _describe(fn, "bias", bias), shape)
    is_causal, causal_alignment, window = rules.check_structure(
        fn, is_causal, causal_alignment, window
    )
    scores = _array(scores).astype(rules.compute_dtype(dtype), copy=True)  # numpy: in place below
    return _mask_scores(scores, _array(mask), _array(bias), is_causal, causal_alignment, window)


def attention_weights(scores: Any) -> np.ndarray:
    """Softmax over keys; a fully masked row (all ``-inf``) gives exactly 0.

    Args:
      scores: ``(..., q_len, kv_len)``.

    Returns:
      ``(..., q_len, kv_len)`` in the compute dtype; rows sum to 1 or are all 0.
    """
    fn = "attention_weights"
    _, dtype = _check_scores(fn, "scores", scores)
    return _softmax(_array(scores).astype(rules.compute_dtype(dtype), copy=True))


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
    fn = "apply_dropout"
    shape, _ = _check_scores(fn, "weights", weights)
    dropout_p = rules.check_dropout(fn, dropout_p, dropout_mask is not None)
    rules.check_dropout_mask(fn, _describe(fn, "dropout_mask", dropout_mask), shape)
    weights, dropout_mask = _array(weights), _array(dropout_mask)
    if dropout_p == 0.0:
        return weights
    return _dropout(weights, dropout_p, dropout_mask, rng).astype(weights.dtype, copy=False)


def attention_output(weights: Any, value: Any) -> np.ndarray:
    """Weighted sum of values, ``weights @ value``, with the grouped-query head mapping.

    Args:
      weights: ``(..., heads, q_len, kv_len)`` or ``(q_len, kv_len)``.
      value: ``(..., kv_heads, kv_len, v_dim)`` or ``(kv_len, v_dim)``.

    Returns:
      ``(..., heads, q_len, v_dim)`` in the compute dtype.
    """
    fn = "attention_output"
    w_shape, w_dtype = _describe(fn, "weights", weights)
    v_shape, v_dtype = _describe(fn, "value", value)
    rules.check_float_inputs(
        fn, weights=rules.compute_dtype(w_dtype), value=rules.compute_dtype(v_dtype)
    )
    rules.check_weights_value(fn, w_shape, v_shape)
    return _output(_to_compute(_array(weights)), _array(value))


def renormalized_causal_weights(weights: Any, *, causal_alignment: str = "top_left") -> np.ndarray:
    """The article's second causal method: zero the weights above the diagonal, renormalise.

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
    offset = rules.causal_offset(causal_alignment, q_len, kv_len)
    masked = weights * (_positions(q_len, kv_len, offset) <= 0)  # (..., q_len, kv_len)
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
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
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

    Returns:
      ``(..., heads, q_len, v_dim)`` in the input dtype, and with ``return_weights`` the
      weights ``(..., heads, q_len, kv_len)`` in the input dtype. Fully masked rows give 0.
    """
    fn = "scaled_dot_product_attention"
    args = rules.attention_arguments(
        fn, _describe(fn, "query", query), _describe(fn, "key", key),
        _describe(fn, "value", value), mask=_describe(fn, "mask", mask),
        bias=_describe(fn, "bias", bias), is_causal=is_causal, causal_alignment=causal_alignment,
        window=window, scale=scale, softcap=softcap, dropout_p=dropout_p,
        dropout_mask=_describe(fn, "dropout_mask", dropout_mask), return_weights=return_weights,
    )  # every rule of the spec, on shapes and dtype names: raises, or normalises the options
    query, key, value = _array(query), _array(key), _array(value)
    mask, bias, dropout_mask = _array(mask), _array(bias), _array(dropout_mask)
    return _attention(query, key, value, mask, bias, dropout_mask, rng, args)


# ------------------------------------------------------------------------------------------
# The steps, unchecked: the public functions validate, then call these. Each returns a fresh
# array it owns, so later steps may work in place.
# ------------------------------------------------------------------------------------------


def _attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    dropout_mask: np.ndarray | None,
    rng: Any,
    args: rules.Arguments,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The whole pipeline on validated arrays: a fast path where ``_fast.use_fast_path``
    selects one (it computes the same steps), else the steps one by one."""
    path = _fast.use_fast_path(query, key, value, mask, bias, args)
    if path is not None:  # large inputs: the same steps, blocked over queries on every core
        return _fast.fast_attention(path, query, key, value, mask, bias, args)
    scores = _scores(query, key, args.scale, args.softcap)  # (..., heads, q_len, kv_len)
    scores = _mask_scores(scores, mask, bias, args.is_causal, args.causal_alignment, args.window)
    weights = _softmax(scores)  # (..., heads, q_len, kv_len), in place
    kept = _dropout(weights, args.dropout_p, dropout_mask, rng) if args.dropout_p > 0 else weights
    output = _output(kept, value).astype(query.dtype, copy=False)  # (..., heads, q_len, v_dim)
    if args.return_weights:
        return output, weights.astype(query.dtype, copy=False)
    return output


def _scores(query: np.ndarray, key: np.ndarray, scale: float, softcap: float | None) -> np.ndarray:
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
) -> np.ndarray:
    if bias is not None:
        scores += bias.astype(scores.dtype, copy=False)  # (..., heads, q_len, kv_len)
    q_len, kv_len = scores.shape[-2:]
    allowed = _allowed(q_len, kv_len, mask, is_causal, causal_alignment, window)
    if allowed is not None:
        # replaced, not added: a NaN score at a masked position does not spread
        np.copyto(scores, NEG_INF, where=~allowed)
    return scores


def _allowed(
    q_len: int,
    kv_len: int,
    mask: np.ndarray | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
) -> np.ndarray | None:
    """AND of the boolean mask, the causal rule and the window; None when all are absent."""
    allowed = mask
    if is_causal or window is not None:
        lo, hi = rules.band(q_len, kv_len, is_causal, causal_alignment, window)
        structural = _in_band(0, q_len, 0, kv_len, lo, hi)  # (q_len, kv_len)
        allowed = structural if allowed is None else allowed & structural
    return allowed


def _in_band(q_start: int, rows: int, kv_start: int, keys: int, lo: float, hi: float) -> np.ndarray:
    """``(rows, keys)`` bool: ``lo <= j - i <= hi`` for queries ``i`` from ``q_start`` and keys
    ``j`` from ``kv_start`` (``rules.band``: the causal rule and the window; ±inf unbounded)."""
    distance = (kv_start + np.arange(keys))[None, :] - (q_start + np.arange(rows))[:, None]
    return (distance >= lo) & (distance <= hi)  # (rows, keys)


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
    if dropout_mask is None:
        rng = np.random.default_rng() if rng is None else rng
        dropout_mask = rng.random(weights.shape, dtype=np.float32) >= dropout_p
    return weights * dropout_mask * (1.0 / (1.0 - dropout_p))


def _output(weights: np.ndarray, value: np.ndarray) -> np.ndarray:
    value = _to_compute(value)  # (..., kv_heads, kv_len, v_dim)
    groups = _groups(weights.shape, value.shape)
    if groups > 1:
        weights = _group_heads(weights, groups)  # (..., kv_heads, groups, q_len, kv_len)
        value = value[..., None, :, :]  # (..., kv_heads, 1, kv_len, v_dim)
    output = weights.astype(value.dtype, copy=False) @ value
    return output.reshape(_merged(output.shape, groups))  # (..., heads, q_len, v_dim)


# ------------------------------------------------------------------------------------------
# Arrays, dtypes and heads
# ------------------------------------------------------------------------------------------


def _describe(fn: str, name: str, x: Any) -> rules.ArrayInfo | None:
    """What the rules see of an input: ``(shape, dtype name)``; None for None. A Python list,
    tuple or scalar is refused (TypeError): it has no dtype of its own."""
    if x is None:
        return None
    rules.check_array(fn, name, x)
    x = np.asarray(x)
    return tuple(x.shape), x.dtype.name


def _array(x: Any) -> np.ndarray | None:
    """A validated input as a NumPy array (no copy); None stays None."""
    return None if x is None else np.asarray(x)


def _check_scores(fn: str, name: str, x: Any) -> rules.ArrayInfo:
    """A floating array of rank >= 2 (scores or weights); its ``(shape, dtype name)``."""
    shape, dtype = _describe(fn, name, x)
    rules.check_float_inputs(fn, **{name: dtype})
    rules.check_rank(fn, **{name: shape})
    return shape, dtype


def _to_compute(x: np.ndarray) -> np.ndarray:
    """Half types up to float32; float32 and float64 unchanged (no copy)."""
    return x.astype(rules.compute_dtype(x.dtype.name), copy=False)


def _group_heads(x: np.ndarray, groups: int) -> np.ndarray:
    """``(..., heads, T, D)`` → ``(..., kv_heads, groups, T, D)``: query head ``h`` is
    ``(h // groups, h % groups)``, so it meets kv head ``h // groups``."""
    return x.reshape(x.shape[:-3] + (x.shape[-3] // groups, groups) + x.shape[-2:])


def _groups(x_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> int:
    return x_shape[-3] // kv_shape[-3] if len(x_shape) >= 3 else 1


def _merged(shape: tuple[int, ...], groups: int) -> tuple[int, ...]:
    """Undo ``_group_heads``: ``(..., kv_heads, groups, T, S)`` → ``(..., heads, T, S)``."""
    if groups == 1:
        return shape
    return shape[:-4] + (shape[-4] * shape[-3],) + shape[-2:]
