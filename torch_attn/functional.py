"""Scaled dot-product attention, step by step, in PyTorch.

The pipeline (``conformance/spec.py``): scores → soft-cap → + bias → mask → softmax → dropout →
weighted sum of values. Every step is a public function, so every intermediate can be printed
and compared; ``scaled_dot_product_attention`` validates its inputs once and runs them all, or
hands them to ``torch.nn.functional.scaled_dot_product_attention`` (see ``_use_fast_path``).

Precision: float16 and bfloat16 are computed in float32; float32 stays float32; float64 stays
float64. Every function keeps its inputs' device and supports autograd (fully masked rows have
a gradient of exactly 0) and ``torch.compile``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from . import _checks
from .masks import _as_tensor, _dtype_name, _positions

NEG_INF = float("-inf")

# CPU SDPA gives fully masked rows an output and a gradient of exactly 0 (checked on torch 2.13
# by tests/test_torch_specific.py); other devices and older versions are not relied upon.
_CPU_SDPA_ZEROES_MASKED_ROWS = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape)


def _to_compute(x: torch.Tensor) -> torch.Tensor:
    """Half types up to float32; float32 and float64 unchanged (no copy)."""
    return x.to(getattr(torch, _checks.compute_dtype(_dtype_name(x))))


def _group_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(..., heads, T, D)`` → ``(..., kv_heads, groups, T, D)``: query head ``h`` is
    ``(h // groups, h % groups)``, so it meets kv head ``h // groups``."""
    return x.reshape(x.shape[:-3] + (x.shape[-3] // groups, groups) + x.shape[-2:])


def _groups(x_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> int:
    return x_shape[-3] // kv_shape[-3] if len(x_shape) >= 3 else 1


# ------------------------------------------------------------------------------------------
# Unchecked steps: the public functions and scaled_dot_product_attention validate, then call
# these. None works in place, so autograd sees every step.
# ------------------------------------------------------------------------------------------


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
    if softcap is not None:
        scores = scores * (1.0 / softcap)  # out of place: autograd needs the inputs of tanh
        scores = torch.tanh(scores)
        scores = scores * softcap
    return scores


def _merged(shape: tuple[int, ...], groups: int) -> tuple[int, ...]:
    """Undo ``_group_heads``: ``(..., kv_heads, groups, T, S)`` → ``(..., heads, T, S)``."""
    if groups == 1:
        return shape
    return shape[:-4] + (shape[-4] * shape[-3],) + shape[-2:]


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
    offset = _checks.causal_offset(causal_alignment, q_len, kv_len)
    allowed = None if mask is None else mask.to(device)  # built on the inputs' device
    if is_causal or window is not None:
        distance = _positions(q_len, kv_len, offset, device)  # (q_len, kv_len): j - (i + offset)
        structural = torch.ones((q_len, kv_len), dtype=torch.bool, device=device)
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
        scores = scores.masked_fill(~allowed, NEG_INF)  # gradient 0 where not allowed
    return scores


def _softmax(scores: torch.Tensor, rows_may_be_empty: bool = True) -> torch.Tensor:
    """Softmax over the last axis; rows that are all ``-inf`` become exactly 0 (so do their
    gradients: no ``-inf - -inf``, no ``0 / 0``). Without ``rows_may_be_empty`` (no mask, bias,
    causal rule or window could empty a row) torch's fused softmax computes the same weights
    in one pass instead of five."""
    if not rows_may_be_empty and scores.shape[-1] > 0:
        return torch.softmax(scores, dim=-1)
    if scores.shape[-1] == 0:  # no key at all: amax of an empty axis is an error in torch
        return scores.clone()
    row_max = scores.detach().amax(dim=-1, keepdim=True)  # (..., q_len, 1); shift, no gradient
    row_max = torch.where(row_max == NEG_INF, 0.0, row_max)  # fully masked row: exp(-inf - 0)
    scores = torch.exp(scores - row_max)
    row_sum = scores.sum(dim=-1, keepdim=True)  # (..., q_len, 1)
    row_sum = torch.where(row_sum == 0.0, 1.0, row_sum)  # 0 / 1 = 0 for fully masked rows
    return scores / row_sum


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
# The fast path: torch's fused scaled_dot_product_attention
# ------------------------------------------------------------------------------------------


def _use_fast_path(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    softcap: float | None,
    dropout_p: float,
    return_weights: bool,
) -> bool:
    """Whether ``scaled_dot_product_attention`` hands validated inputs to torch's fused
    ``torch.nn.functional.scaled_dot_product_attention`` (SDPA) rather than the composition.

    The explicit composition is used when SDPA cannot follow the spec:

    * ``return_weights=True``: SDPA does not return the weights;
    * ``dropout_p > 0``: SDPA draws its own keep-mask, not one from ``rng``/``dropout_mask``;
    * ``softcap``: SDPA has no soft-capping (it would have to come before the bias);
    * an empty axis (``q_len``, ``kv_len``, ``head_dim``, ``v_dim`` or a batch axis of size 0).

    Everything else takes SDPA (``_fast_attention``): the boolean mask, the causal rule in
    both alignments and the window become ONE explicit boolean ``attn_mask`` (SDPA's own
    ``is_causal`` only when ``q_len == kv_len`` with nothing else to combine, where both
    alignments coincide); a bias becomes one float ``attn_mask``, ``-inf`` where not allowed;
    grouped-query heads go through ``enable_gqa``; ``v_dim != head_dim`` and 2-D inputs are
    supported; float16/bfloat16 are given to SDPA as float32 copies (the spec's float32
    weighted sum: SDPA's half kernels round the weights to the half type before
    ``weights @ value``). Fully masked rows: on the CPU SDPA gives output and gradient exactly
    0 (torch >= 2.13, checked by the tests); on other devices they are given every key for
    the kernel and their output is zeroed afterwards, so no kernel meets an empty row.
    """
    if return_weights or dropout_p > 0.0 or softcap is not None:
        return False
    return query.numel() > 0 and key.numel() > 0 and value.numel() > 0


def _fast_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    scale: float,
) -> torch.Tensor:
    """The whole pipeline in one SDPA call; valid where ``_use_fast_path`` says so."""
    dtype = query.dtype
    query, key, value = _to_compute(query), _to_compute(key), _to_compute(value)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    sdpa_causal = is_causal and q_len == kv_len and mask is None and bias is None
    sdpa_causal = sdpa_causal and window is None  # top-left = bottom-right when q_len == kv_len
    attn_mask = None
    if not sdpa_causal:
        attn_mask = _allowed(
            q_len, kv_len, mask, is_causal, causal_alignment, window, query.device
        )
    if bias is not None:  # one float mask: bias where allowed, -inf elsewhere
        float_mask = bias.to(query.device, query.dtype)
        attn_mask = float_mask if attn_mask is None else float_mask.masked_fill(~attn_mask, NEG_INF)
    row_ok = None
    if attn_mask is not None and not (query.device.type == "cpu" and _CPU_SDPA_ZEROES_MASKED_ROWS):
        allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > NEG_INF
        row_ok = allowed.any(dim=-1, keepdim=True)  # (..., q_len, 1): the row keeps a key
        if attn_mask.dtype == torch.bool:
            attn_mask = attn_mask | ~row_ok  # a fully masked row attends everything...
        else:
            attn_mask = torch.where(row_ok, attn_mask, 0.0)
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, is_causal=sdpa_causal, scale=scale,
        enable_gqa=_groups(query.shape, key.shape) > 1,
    )  # (..., heads, q_len, v_dim)
    if row_ok is not None:
        output = torch.where(row_ok, output, 0.0)  # ...and is zeroed here, gradient 0 too
    return output.to(dtype)


# ------------------------------------------------------------------------------------------
# Validation helpers
# ------------------------------------------------------------------------------------------


def _check_mask_bias(
    fn: str, mask: Any, bias: Any, target: tuple[int, ...]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if mask is not None:
        mask = _as_tensor(mask)
        _checks.check_bool(fn, "mask", _dtype_name(mask))
        _checks.check_broadcast(fn, "mask", _shape(mask), target, "scores")
    if bias is not None:
        bias = _as_tensor(bias)
        _checks.check_bias_dtype(fn, _dtype_name(bias))
        _checks.check_broadcast(fn, "bias", _shape(bias), target, "scores")
    return mask, bias


def _check_dropout_mask(
    fn: str, dropout_mask: Any, target: tuple[int, ...]
) -> torch.Tensor | None:
    if dropout_mask is None:
        return None
    dropout_mask = _as_tensor(dropout_mask)
    _checks.check_bool(fn, "dropout_mask", _dtype_name(dropout_mask))
    _checks.check_broadcast(fn, "dropout_mask", _shape(dropout_mask), target, "weights")
    return dropout_mask


def _check_structure(
    fn: str, is_causal: bool, causal_alignment: str, window: Any
) -> tuple[int | None, int | None] | None:
    _checks.check_alignment(fn, causal_alignment)
    return None if window is None else _checks.check_window(fn, window)


def _check_scores_array(fn: str, name: str, x: Any) -> torch.Tensor:
    x = _as_tensor(x)
    _checks.check_float_inputs(fn, **{name: _dtype_name(x)})
    _checks.check_rank(fn, **{name: _shape(x)})
    return x


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
    query, key = _as_tensor(query), _as_tensor(key)
    _checks.check_float_inputs(fn, query=_dtype_name(query), key=_dtype_name(key))
    _checks.check_query_key(fn, _shape(query), _shape(key))
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
    scores = _check_scores_array(fn, "scores", scores)
    mask, bias = _check_mask_bias(fn, mask, bias, _shape(scores))
    window = _check_structure(fn, is_causal, causal_alignment, window)
    scores = _to_compute(scores)  # no copy needed: _mask_scores works out of place
    return _mask_scores(scores, mask, bias, is_causal, causal_alignment, window)


def attention_weights(scores: Any) -> torch.Tensor:
    """Softmax over keys; a fully masked row (all ``-inf``) gives exactly 0.

    Args:
      scores: ``(..., q_len, kv_len)``.

    Returns:
      ``(..., q_len, kv_len)`` in the compute dtype; rows sum to 1 or are all 0.
    """
    fn = "attention_weights"
    scores = _check_scores_array(fn, "scores", scores)
    return _softmax(_to_compute(scores))


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
    weights = _check_scores_array(fn, "weights", weights)
    dropout_p = _checks.check_dropout(fn, dropout_p, dropout_mask is not None)
    dropout_mask = _check_dropout_mask(fn, dropout_mask, _shape(weights))
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
    weights, value = _as_tensor(weights), _as_tensor(value)
    _checks.check_float_inputs(fn, weights=_checks.compute_dtype(_dtype_name(weights)),
                               value=_checks.compute_dtype(_dtype_name(value)))
    _checks.check_weights_value(fn, _shape(weights), _shape(value))
    return _output(_to_compute(weights), value)


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
    weights = _check_scores_array(fn, "weights", weights)
    _checks.check_alignment(fn, causal_alignment)
    q_len, kv_len = weights.shape[-2:]
    offset = _checks.causal_offset(causal_alignment, q_len, kv_len)
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

    Uses torch's fused ``scaled_dot_product_attention`` when it follows the spec exactly
    (see ``_use_fast_path``), the explicit step-by-step composition otherwise.

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
    query, key, value = _as_tensor(query), _as_tensor(key), _as_tensor(value)
    dtype = _checks.check_float_inputs(
        fn, query=_dtype_name(query), key=_dtype_name(key), value=_dtype_name(value)
    )
    _checks.check_query_key(fn, _shape(query), _shape(key))
    _checks.check_key_value(fn, _shape(key), _shape(value))
    target = _checks.scores_shape(_shape(query), _shape(key))
    mask, bias = _check_mask_bias(fn, mask, bias, target)
    window = _check_structure(fn, is_causal, causal_alignment, window)
    scale = _checks.check_scale(fn, scale, query.shape[-1])
    softcap = _checks.check_softcap(fn, softcap)
    dropout_p = _checks.check_dropout(fn, dropout_p, dropout_mask is not None)
    dropout_mask = _check_dropout_mask(fn, dropout_mask, target)
    if _use_fast_path(query, key, value, softcap, dropout_p, return_weights):  # torch's kernel
        return _fast_attention(
            query, key, value, mask, bias, is_causal, causal_alignment, window, scale
        )

    scores = _scores(query, key, scale, softcap)  # (..., heads, q_len, kv_len)
    scores = _mask_scores(scores, mask, bias, is_causal, causal_alignment, window)
    may_be_empty = mask is not None or bias is not None or is_causal or window is not None
    weights = _softmax(scores, may_be_empty)  # (..., heads, q_len, kv_len)
    kept = _dropout(weights, dropout_p, dropout_mask, rng) if dropout_p > 0 else weights
    output = _output(kept, value).to(getattr(torch, dtype))  # (..., heads, q_len, v_dim)
    if return_weights:
        return output, weights.to(getattr(torch, dtype))
    return output
