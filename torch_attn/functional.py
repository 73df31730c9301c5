"""Scaled dot-product attention, step by step, in PyTorch.

The pipeline (``conformance/spec.py``): scores → soft-cap → + bias → mask → softmax → dropout →
weighted sum of values. Every step is a public function, so every intermediate can be printed
and compared; ``scaled_dot_product_attention`` validates its inputs once (``attention_rules``)
and runs them all. The file reads top to bottom: the public steps, then the private helpers
they share with ``blockwise.py`` and with the fast path.

Precision: float16 and bfloat16 are computed in float32; float32 stays float32; float64 stays
float64. Every function keeps its inputs' device and supports autograd (fully masked rows have
a gradient of exactly 0) and ``torch.compile``.

Fast path: ``scaled_dot_product_attention`` hands what torch's fused
``torch.nn.functional.scaled_dot_product_attention`` computes exactly as the spec says to it
(``_fast.py``: ``use_fast_path`` says when, ``fast_attention`` how).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import attention_rules as rules

from . import _fast
from .masks import _as_tensor, _dtype_name, _positions

NEG_INF = float("-inf")


# ------------------------------------------------------------------------------------------
# Public steps
# ------------------------------------------------------------------------------------------


def attention_scores(
    query: Any, key: Any, *, scale: float | None = None, softcap: float | None = None
) -> torch.Tensor:
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
) -> torch.Tensor:
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
    scores = _to_compute(_array(scores))  # torch: no copy needed, _mask_scores is out of place
    return _mask_scores(scores, _array(mask), _array(bias), is_causal, causal_alignment, window)


def attention_weights(scores: Any) -> torch.Tensor:
    """Softmax over keys; a fully masked row (all ``-inf``) gives exactly 0.

    Args:
      scores: ``(..., q_len, kv_len)``.

    Returns:
      ``(..., q_len, kv_len)`` in the compute dtype; rows sum to 1 or are all 0.
    """
    fn = "attention_weights"
    _check_scores(fn, "scores", scores)
    return _softmax(_to_compute(_array(scores)))


def apply_dropout(
    weights: Any, dropout_p: float, *, dropout_mask: Any = None, rng: Any = None
) -> torch.Tensor:
    """Dropout of the weights: ``weights · keep / (1 - dropout_p)``.

    Args:
      weights: ``(..., q_len, kv_len)``.
      dropout_p: drop probability in ``[0, 1)``.
      dropout_mask: boolean keep-mask (True = keep), broadcastable to ``weights``.
      rng: ``torch.Generator`` (on ``weights``' device) for the keep-mask when none is given
        (``None``: torch's global generator, so ``torch.manual_seed`` applies).

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
    return _dropout(weights, dropout_p, dropout_mask, rng).to(weights.dtype)


def attention_output(weights: Any, value: Any) -> torch.Tensor:
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


def renormalized_causal_weights(
    weights: Any, *, causal_alignment: str = "top_left"
) -> torch.Tensor:
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
    masked = weights * (_positions(q_len, kv_len, offset, weights.device) <= 0)  # (..., q, kv)
    row_sum = masked.sum(dim=-1, keepdim=True)  # (..., q_len, 1)
    row_sum = torch.where(row_sum == 0, 1.0, row_sum)  # out of place, for autograd
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention: ``softmax(mask(q kᵀ · scale + bias)) @ v``.

    Uses torch's fused ``scaled_dot_product_attention`` where it follows the spec exactly
    (see ``_fast.py``), the explicit step-by-step composition otherwise.

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
      rng: ``torch.Generator`` for dropout when no keep-mask is given (``None``: global).
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
# The steps, unchecked: the public functions validate, then call these. None works in place,
# so autograd sees every step.
# ------------------------------------------------------------------------------------------


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    dropout_mask: torch.Tensor | None,
    rng: Any,
    args: rules.Arguments,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The whole pipeline on validated arrays: a fast path where ``_fast.use_fast_path``
    selects one (it computes the same steps), else the steps one by one."""
    path = _fast.use_fast_path(query, key, value, mask, bias, args)
    if path is not None:  # torch's fused kernel, where it computes exactly these steps
        return _fast.fast_attention(path, query, key, value, mask, bias, args)
    scores = _scores(query, key, args.scale, args.softcap)  # (..., heads, q_len, kv_len)
    scores = _mask_scores(scores, mask, bias, args.is_causal, args.causal_alignment, args.window)
    may_be_empty = mask is not None or bias is not None or args.is_causal or args.window is not None
    weights = _softmax(scores, may_be_empty)  # (..., heads, q_len, kv_len)
    kept = _dropout(weights, args.dropout_p, dropout_mask, rng) if args.dropout_p > 0 else weights
    output = _output(kept, value).to(query.dtype)  # (..., heads, q_len, v_dim)
    if args.return_weights:
        return output, weights.to(query.dtype)
    return output


def _scores(
    query: torch.Tensor, key: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    query = _to_compute(query) * scale  # (..., heads, q_len, head_dim); scaling q is cheapest
    key = _to_compute(key)  # (..., kv_heads, kv_len, head_dim)
    groups = _groups(query.shape, key.shape)
    if groups > 1:  # grouped-query: (..., kv_heads, groups, q_len, head_dim)
        query = _group_heads(query, groups)
        key = key[..., None, :, :]  # (..., kv_heads, 1, kv_len, head_dim)
    scores = query @ key.transpose(-1, -2)  # (..., [kv_heads, groups,] q_len, kv_len)
    scores = scores.reshape(_merged(scores.shape, groups))  # (..., heads, q_len, kv_len)
    return _softcap(scores, softcap)


def _softcap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap · tanh(scores / softcap)``; unchanged for None."""
    if softcap is not None:
        scores = torch.tanh(scores * (1.0 / softcap)) * softcap  # out of place, for autograd
    return scores


def _mask_scores(
    scores: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
) -> torch.Tensor:
    if bias is not None:
        scores = scores + bias.to(scores.device, scores.dtype)  # (..., heads, q_len, kv_len)
    q_len, kv_len = scores.shape[-2:]
    allowed = _allowed(q_len, kv_len, mask, is_causal, causal_alignment, window, scores.device)
    if allowed is not None:
        # replaced, not added: a NaN score at a masked position does not spread; gradient 0
        scores = scores.masked_fill(~allowed, NEG_INF)
    return scores


def _allowed(
    q_len: int,
    kv_len: int,
    mask: torch.Tensor | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    device: torch.device | None = None,
) -> torch.Tensor | None:
    """AND of the boolean mask, the causal rule and the window; None when all are absent."""
    allowed = None if mask is None else mask.to(device)  # torch: built on the inputs' device
    if is_causal or window is not None:
        lo, hi = rules.band(q_len, kv_len, is_causal, causal_alignment, window)
        structural = _in_band(0, q_len, 0, kv_len, lo, hi, device)  # (q_len, kv_len)
        allowed = structural if allowed is None else allowed & structural
    return allowed


def _in_band(
    q_start: int, rows: int, kv_start: int, keys: int, lo: float, hi: float,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``(rows, keys)`` bool: ``lo <= j - i <= hi`` for queries ``i`` from ``q_start`` and keys
    ``j`` from ``kv_start`` (``rules.band``: the causal rule and the window; ±inf unbounded)."""
    distance = (kv_start + torch.arange(keys, device=device))[None, :] - (
        q_start + torch.arange(rows, device=device))[:, None]  # torch: on the scores' device
    return (distance >= lo) & (distance <= hi)  # (rows, keys)


def _softmax(scores: torch.Tensor, rows_may_be_empty: bool = True) -> torch.Tensor:
    """Softmax over the last axis; rows that are all ``-inf`` become exactly 0 (so do their
    gradients: no ``-inf - -inf``, no ``0 / 0``). Without ``rows_may_be_empty`` (no mask, bias,
    causal rule or window could empty a row) torch's fused softmax computes the same weights
    in one pass instead of five."""
    if not rows_may_be_empty and scores.shape[-1] > 0:
        return torch.softmax(scores, dim=-1)
    weights, row_sum = _unnormalised_softmax(scores)  # (..., q_len, kv_len), (..., q_len, 1)
    return weights / row_sum


def _unnormalised_softmax(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(scores - row max)`` and its row sums ``(..., q_len, 1)``; a row that is all
    ``-inf`` gives 0 and a row sum of 1, so dividing by it gives 0, never NaN."""
    if scores.shape[-1] == 0:  # no key at all: amax of an empty axis is an error in torch
        return scores.clone(), scores.new_ones(scores.shape[:-1] + (1,))
    row_max = scores.detach().amax(dim=-1, keepdim=True)  # (..., q_len, 1); shift, no gradient
    row_max = torch.where(row_max == NEG_INF, 0.0, row_max)  # fully masked row: exp(-inf - 0)
    scores = torch.exp(scores - row_max)
    row_sum = scores.sum(dim=-1, keepdim=True)  # (..., q_len, 1)
    row_sum = torch.where(row_sum == 0.0, 1.0, row_sum)  # 0 / 1 = 0 for fully masked rows
    return scores, row_sum


def _dropout(
    weights: torch.Tensor, dropout_p: float, dropout_mask: torch.Tensor | None, rng: Any
) -> torch.Tensor:
    if dropout_mask is None:  # rng: a torch.Generator on weights' device, None = torch's global
        uniform = torch.rand(weights.shape, generator=rng, device=weights.device)
        dropout_mask = uniform >= dropout_p
    dropout_mask = dropout_mask.to(weights.device)  # a keep-mask made elsewhere joins weights
    return weights * dropout_mask * (1.0 / (1.0 - dropout_p))


def _output(weights: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    value = _to_compute(value)  # (..., kv_heads, kv_len, v_dim)
    groups = _groups(weights.shape, value.shape)
    if groups > 1:
        weights = _group_heads(weights, groups)  # (..., kv_heads, groups, q_len, kv_len)
        value = value[..., None, :, :]  # (..., kv_heads, 1, kv_len, v_dim)
    output = weights.to(value.dtype) @ value
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
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), _dtype_name(x)
    x = np.asarray(x)  # torch: NumPy arrays are welcome too, named as NumPy names them
    return tuple(x.shape), x.dtype.name


def _array(x: Any) -> torch.Tensor | None:
    """A validated input as a tensor (a tensor as is); None stays None."""
    return None if x is None else _as_tensor(x)


def _check_scores(fn: str, name: str, x: Any) -> rules.ArrayInfo:
    """A floating array of rank >= 2 (scores or weights); its ``(shape, dtype name)``."""
    shape, dtype = _describe(fn, name, x)
    rules.check_float_inputs(fn, **{name: dtype})
    rules.check_rank(fn, **{name: shape})
    return shape, dtype


def _to_compute(x: torch.Tensor) -> torch.Tensor:
    """Half types up to float32; float32 and float64 unchanged (no copy)."""
    return x.to(getattr(torch, rules.compute_dtype(_dtype_name(x))))


def _group_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
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
