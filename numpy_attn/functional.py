"""Scaled dot-product attention, step by step, in NumPy.

The pipeline (``conformance/spec.py``): scores → soft-cap → + bias → mask → softmax → dropout →
weighted sum of values. Every step is a public function, so every intermediate can be printed
and compared; ``scaled_dot_product_attention`` validates its inputs once and runs them all.

Precision: float16 and bfloat16 are computed in float32; float32 stays float32 (Python floats
only, never NumPy float64 scalars, so nothing is promoted); float64 stays float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _checks
from .masks import _positions

NEG_INF = -np.inf


def _dtype_name(x: Any) -> str:
    return np.asarray(x).dtype.name


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _to_compute(x: np.ndarray) -> np.ndarray:
    """Half types up to float32; float32 and float64 unchanged (no copy)."""
    return x.astype(_checks.compute_dtype(x.dtype.name), copy=False)


def _group_heads(x: np.ndarray, groups: int) -> np.ndarray:
    """``(..., heads, T, D)`` → ``(..., kv_heads, groups, T, D)``: query head ``h`` is
    ``(h // groups, h % groups)``, so it meets kv head ``h // groups``."""
    return x.reshape(x.shape[:-3] + (x.shape[-3] // groups, groups) + x.shape[-2:])


def _groups(x_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> int:
    return x_shape[-3] // kv_shape[-3] if len(x_shape) >= 3 else 1


# ------------------------------------------------------------------------------------------
# Unchecked steps: the public functions and scaled_dot_product_attention validate, then call
# these. Each returns a fresh array it owns, so later steps may work in place.
# ------------------------------------------------------------------------------------------


def _scores(query: np.ndarray, key: np.ndarray, scale: float, softcap: float | None) -> np.ndarray:
    query = _to_compute(query) * scale  # (..., heads, q_len, head_dim); scaling q is cheapest
    key = _to_compute(key)  # (..., kv_heads, kv_len, head_dim)
    groups = _groups(query.shape, key.shape)
    if groups > 1:  # grouped-query: (..., kv_heads, groups, q_len, head_dim)
        query = _group_heads(query, groups)
        key = key[..., None, :, :]  # (..., kv_heads, 1, kv_len, head_dim)
    scores = query @ np.swapaxes(key, -1, -2)  # (..., [kv_heads, groups,] q_len, kv_len)
    scores = scores.reshape(_merged(scores.shape, groups))  # (..., heads, q_len, kv_len)
    if softcap is not None:
        scores *= 1.0 / softcap
        np.tanh(scores, out=scores)
        scores *= softcap
    return scores


def _merged(shape: tuple[int, ...], groups: int) -> tuple[int, ...]:
    """Undo ``_group_heads``: ``(..., kv_heads, groups, T, S)`` → ``(..., heads, T, S)``."""
    if groups == 1:
        return shape
    return shape[:-4] + (shape[-4] * shape[-3],) + shape[-2:]


def _allowed(
    q_len: int,
    kv_len: int,
    mask: np.ndarray | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
) -> np.ndarray | None:
    """AND of the boolean mask, the causal rule and the window; None when all are absent."""
    offset = _checks.causal_offset(causal_alignment, q_len, kv_len)
    allowed = mask
    if is_causal or window is not None:
        distance = _positions(q_len, kv_len, offset)  # (q_len, kv_len): j - (i + offset)
        structural = np.ones((q_len, kv_len), dtype=bool)
        if is_causal:
            structural &= distance <= 0
        if window is not None:
            left, right = window
            if left is not None:
                structural &= distance >= -left
            if right is not None:
                structural &= distance <= right
        allowed = structural if allowed is None else allowed & structural
    return allowed


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
        np.copyto(scores, NEG_INF, where=~allowed)
    return scores


def _softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in place; rows that are all ``-inf`` become exactly 0."""
    row_max = scores.max(axis=-1, keepdims=True, initial=NEG_INF)  # (..., q_len, 1)
    row_max[row_max == NEG_INF] = 0.0  # fully masked row: exp(-inf - 0) = 0, no NaN
    scores -= row_max
    np.exp(scores, out=scores)
    row_sum = scores.sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    row_sum[row_sum == 0.0] = 1.0  # 0 / 1 = 0 for fully masked rows
    scores /= row_sum
    return scores


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
# Validation helpers
# ------------------------------------------------------------------------------------------


def _check_mask_bias(
    fn: str, mask: Any, bias: Any, target: tuple[int, ...]
) -> tuple[np.ndarray | None, np.ndarray | None]:
    if mask is not None:
        mask = np.asarray(mask)
        _checks.check_bool(fn, "mask", mask.dtype.name)
        _checks.check_broadcast(fn, "mask", mask.shape, target, "scores")
    if bias is not None:
        bias = np.asarray(bias)
        _checks.check_bias_dtype(fn, bias.dtype.name)
        _checks.check_broadcast(fn, "bias", bias.shape, target, "scores")
    return mask, bias


def _check_dropout_mask(fn: str, dropout_mask: Any, target: tuple[int, ...]) -> np.ndarray | None:
    if dropout_mask is None:
        return None
    dropout_mask = np.asarray(dropout_mask)
    _checks.check_bool(fn, "dropout_mask", dropout_mask.dtype.name)
    _checks.check_broadcast(fn, "dropout_mask", dropout_mask.shape, target, "weights")
    return dropout_mask


def _check_structure(
    fn: str, is_causal: bool, causal_alignment: str, window: Any
) -> tuple[int | None, int | None] | None:
    _checks.check_alignment(fn, causal_alignment)
    return None if window is None else _checks.check_window(fn, window)


def _check_scores_array(fn: str, name: str, x: Any) -> np.ndarray:
    x = np.asarray(x)
    _checks.check_float_inputs(fn, **{name: x.dtype.name})
    _checks.check_rank(fn, **{name: x.shape})
    return x


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
    query, key = np.asarray(query), np.asarray(key)
    _checks.check_float_inputs(fn, query=query.dtype.name, key=key.dtype.name)
    _checks.check_query_key(fn, query.shape, key.shape)
    scale = _checks.check_scale(fn, scale, query.shape[-1])
    softcap = _checks.check_softcap(fn, softcap)
    return _scores(query, key, scale, softcap)


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
    scores = _check_scores_array(fn, "scores", scores)
    mask, bias = _check_mask_bias(fn, mask, bias, scores.shape)
    window = _check_structure(fn, is_causal, causal_alignment, window)
    scores = scores.astype(_checks.compute_dtype(scores.dtype.name), copy=True)
    return _mask_scores(scores, mask, bias, is_causal, causal_alignment, window)


def attention_weights(scores: Any) -> np.ndarray:
    """Softmax over keys; a fully masked row (all ``-inf``) gives exactly 0.

    Args:
      scores: ``(..., q_len, kv_len)``.

    Returns:
      ``(..., q_len, kv_len)`` in the compute dtype; rows sum to 1 or are all 0.
    """
    fn = "attention_weights"
    scores = _check_scores_array(fn, "scores", scores)
    return _softmax(scores.astype(_checks.compute_dtype(scores.dtype.name), copy=True))


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
    weights = _check_scores_array(fn, "weights", weights)
    dropout_p = _checks.check_dropout(fn, dropout_p, dropout_mask is not None)
    dropout_mask = _check_dropout_mask(fn, dropout_mask, weights.shape)
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
    weights, value = np.asarray(weights), np.asarray(value)
    _checks.check_float_inputs(fn, weights=_checks.compute_dtype(weights.dtype.name),
                               value=_checks.compute_dtype(value.dtype.name))
    _checks.check_weights_value(fn, weights.shape, value.shape)
    return _output(_to_compute(weights), value)


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
    weights = _check_scores_array(fn, "weights", weights)
    _checks.check_alignment(fn, causal_alignment)
    q_len, kv_len = weights.shape[-2:]
    offset = _checks.causal_offset(causal_alignment, q_len, kv_len)
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
    query, key, value = np.asarray(query), np.asarray(key), np.asarray(value)
    dtype = _checks.check_float_inputs(
        fn, query=query.dtype.name, key=key.dtype.name, value=value.dtype.name
    )
    _checks.check_query_key(fn, query.shape, key.shape)
    _checks.check_key_value(fn, key.shape, value.shape)
    target = _checks.scores_shape(query.shape, key.shape)
    mask, bias = _check_mask_bias(fn, mask, bias, target)
    window = _check_structure(fn, is_causal, causal_alignment, window)
    scale = _checks.check_scale(fn, scale, query.shape[-1])
    softcap = _checks.check_softcap(fn, softcap)
    dropout_p = _checks.check_dropout(fn, dropout_p, dropout_mask is not None)
    dropout_mask = _check_dropout_mask(fn, dropout_mask, target)

    scores = _scores(query, key, scale, softcap)  # (..., heads, q_len, kv_len)
    scores = _mask_scores(scores, mask, bias, is_causal, causal_alignment, window)
    weights = _softmax(scores)  # (..., heads, q_len, kv_len), in place
    kept = _dropout(weights, dropout_p, dropout_mask, rng) if dropout_p > 0 else weights
    output = _output(kept, value).astype(dtype, copy=False)  # (..., heads, q_len, v_dim)
    if return_weights:
        return output, weights.astype(dtype, copy=False)
    return output
