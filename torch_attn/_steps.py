"""The unchecked steps of the pipeline in torch_attn (``conformance/spec/functions.py``):
scores, soft-cap, the mask step (the bias, ALiBi and ``score_mod``, then ``-inf`` wherever
``_masking`` forbids), softmax (also with each row's log-sum-exp and the sinks:
``spec.SINKS``), dropout and the weighted sum of values; the merging of partial results over
disjoint keys (``spec.MERGING``: the online softmax's step, the ring's and the paged
decoder's); and the gradient helpers for grouped heads and broadcast inputs.

Nothing here validates: the public functions (``functional.py`` and the others) check their
inputs once, with ``attention_rules``, then call these. Imports ``_arrays`` and ``_masking``
(the ladder: ``_arrays.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ._arrays import _group_heads, _groups, _merged, _to_compute
from ._masking import _allowed, _Mods, _mods_scores

NEG_INF = float("-inf")


# ------------------------------------------------------------------------------------------
# The steps, unchecked: each returns a fresh tensor (torch: none works in place, so autograd
# sees every step). The public functions validate, then call these.
# ------------------------------------------------------------------------------------------


def _scores(
    query: torch.Tensor, key: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """``(query @ keyᵀ) · scale``, soft-capped: query ``(..., heads, q_len, head_dim)`` and key
    ``(..., kv_heads, kv_len, head_dim)`` give ``(..., heads, q_len, kv_len)`` in the compute
    dtype (query head ``h`` meets kv head ``h // groups``)."""
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
    mods: _Mods | None = None,
) -> torch.Tensor:
    """``scores (..., heads, q_len, kv_len)`` plus ``bias`` (and ALiBi, then ``score_mod``:
    ``mods``), then ``-inf`` wherever a position is not allowed (``_allowed``: True in ``mask``
    = may attend); out of place."""
    if bias is not None:
        scores = scores + bias.to(scores.device, scores.dtype)  # (..., heads, q_len, kv_len)
    q_len, kv_len = scores.shape[-2:]
    allowed = _allowed(q_len, kv_len, mask, is_causal, causal_alignment, window, scores.device,
                       mods)
    if allowed is not None and mods is not None and mods.score_mod is not None and \
            scores.requires_grad:  # score_mod's NaN at a masked position: gradient 0 there
        scores = _MaskedGradientZero.apply(scores, allowed)
    scores = _mods_scores(scores, mods, 0, 0)
    if allowed is not None:
        # replaced, not added: a NaN score at a masked position does not spread; gradient 0
        scores = scores.masked_fill(~allowed, NEG_INF)
    return scores


class _MaskedGradientZero(torch.autograd.Function):
    """``scores`` as they are; their gradient exactly 0 where ``allowed`` is False, by
    ``where``: a ``score_mod`` that is NaN (or infinite) only at masked positions gives a
    masked score, whose gradient 0 times the mod's NaN derivative would be NaN (torch's flex
    attention zeroes it too)."""

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(allowed)
        return scores.view_as(scores)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (allowed,) = ctx.saved_tensors
        return torch.where(allowed, grad, 0.0), None


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis; rows that are all ``-inf`` become exactly 0 (so do their
    gradients: no ``-inf - -inf``, no ``0 / 0``)."""
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
    """``weights (..., q_len, kv_len) · keep / (1 - dropout_p)``; the keep-mask (True = keep)
    is drawn from ``rng`` (a ``torch.Generator`` on the weights' device; None: torch's global
    one) when ``dropout_mask`` is None."""
    if dropout_mask is None:
        dropout_mask = _keep_mask(weights, dropout_p, rng)
    dropout_mask = dropout_mask.to(weights.device)  # a keep-mask made elsewhere joins weights
    return weights * dropout_mask * (1.0 / (1.0 - dropout_p))


def _keep_mask(weights: torch.Tensor, dropout_p: float, rng: Any) -> torch.Tensor:
    """A keep-mask shaped like ``weights (..., q_len, kv_len)``, on their device: True (keep)
    with probability ``1 - dropout_p``, drawn from ``rng`` (a ``torch.Generator`` on that
    device; None: torch's global one)."""
    return torch.rand(weights.shape, generator=rng, device=weights.device) >= dropout_p


def _output(weights: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``weights (..., heads, q_len, kv_len) @ value (..., kv_heads, kv_len, v_dim)`` with the
    grouped-query head mapping: ``(..., heads, q_len, v_dim)`` in the compute dtype."""
    value = _to_compute(value)  # (..., kv_heads, kv_len, v_dim)
    groups = _groups(weights.shape, value.shape)
    if groups > 1:
        weights = _group_heads(weights, groups)  # (..., kv_heads, groups, q_len, kv_len)
        value = value[..., None, :, :]  # (..., kv_heads, 1, kv_len, v_dim)
    output = weights.to(value.dtype) @ value
    return output.reshape(_merged(output.shape, groups))  # (..., heads, q_len, v_dim)


def _softmax_lse(
    scores: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last axis and each row's log-sum-exp ``(..., q_len)``: ``scores
    (..., heads, q_len, kv_len)``; ``sinks (heads,)`` (or None) join every row's denominator
    as a column without a value (``spec.SINKS``). A row that is all ``-inf`` gives weights 0
    and, without a sink, lse ``-inf``; its gradients are 0, never NaN."""
    if scores.shape[-1] == 0:  # no key at all: amax of an empty axis is an error in torch
        row_max = scores.new_full(scores.shape[:-1] + (1,), NEG_INF)
    else:  # (..., q_len, 1); a shift, without a gradient (softmax and lse are shift-invariant)
        row_max = scores.detach().amax(dim=-1, keepdim=True)
    if sinks is not None:  # the shift covers the sink too: exp(sink - max) <= 1
        sink = _sink_column(sinks, scores.ndim, scores)  # (heads, 1, 1)
        row_max = torch.maximum(row_max, sink.detach())
    row_max = torch.where(row_max == NEG_INF, 0.0, row_max)  # fully masked row: exp(-inf - 0)
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(dim=-1, keepdim=True)  # (..., q_len, 1)
    if sinks is not None:
        row_sum = row_sum + torch.exp(sink - row_max)
    empty = row_sum == 0.0  # no key, no sink
    safe_sum = torch.where(empty, 1.0, row_sum)  # where, not log(0): gradients stay finite
    lse = torch.where(empty, NEG_INF, row_max + torch.log(safe_sum))[..., 0]  # (..., q_len)
    return weights / safe_sum, lse


def _sink_column(sinks: torch.Tensor, ndim: int, like: torch.Tensor) -> torch.Tensor:
    """``(heads,)`` sink logits against rows ``(..., heads, q_len, 1)`` of rank ``ndim``:
    ``(heads, 1, 1)``, or ``(1, 1)`` for inputs without a heads axis, on ``like``'s device and
    in its dtype."""
    sinks = sinks.to(like.device, like.dtype)  # torch: dtype and device of the rows
    return sinks.reshape(tuple(sinks.shape) + (1, 1)) if ndim >= 3 else sinks.reshape(1, 1)


# ------------------------------------------------------------------------------------------
# Merging partial results over disjoint keys, and the sinks joined (spec.MERGING)
# ------------------------------------------------------------------------------------------


def _merge_attention(
    outputs: tuple[torch.Tensor, ...], lses: tuple[torch.Tensor, ...],
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial results over disjoint key sets of the same rows, each an output
    ``(..., rows, v_dim)`` and its log-sum-exp ``(..., rows, 1)`` (``-inf``: no key), merged
    into the attention over every key set and its log-sum-exp (``spec.MERGING``; the online
    softmax's step). ``sinks (heads,)`` join the denominator once: a part whose output is 0.
    Differentiable: a part with lse ``-inf`` gets gradient 0."""
    lses = list(lses)
    if sinks is not None:
        lses.append(_sink_column(sinks, outputs[0].ndim, lses[0]))
    row_max = functools.reduce(torch.maximum, [lse.detach() for lse in lses])  # (..., rows, 1)
    shift = torch.where(row_max == NEG_INF, 0.0, row_max)  # no -inf - -inf
    scales = [torch.exp(lse - shift) for lse in lses]  # exp(lse_i - max) <= 1; 0 for no key
    total = functools.reduce(torch.add, scales)
    empty = total == 0.0  # no key in any part
    safe_total = torch.where(empty, 1.0, total)
    lse = torch.where(empty, NEG_INF, shift + torch.log(safe_total))
    output = functools.reduce(torch.add, [  # a part with lse -inf adds 0, even a NaN output
        a * torch.where(part == NEG_INF, 0.0, out) for a, part, out in zip(scales, lses, outputs,
                                                                         strict=False)])
    return output / safe_total, lse


def _merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results over different keys of the same rows (``_merge_attention`` of two
    parts, the ring's step): outputs ``(..., rows, v_dim)``, lses ``(..., rows, 1)``
    (``-inf``: no key)."""
    return _merge_attention((out_a, out_b), (lse_a, lse_b), None)


def _with_sinks(
    output: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows finished over their keys by the online softmax, ``output (..., rows, v_dim)`` and
    ``lse (..., rows, 1)`` (``+inf`` for a row without a key, the tiles' convention), in the
    spec's terms: the sinks joined (``_merge_attention``) and ``-inf`` for a row without a key
    nor a sink."""
    lse = torch.where(lse == torch.inf, NEG_INF, lse)
    if sinks is None:
        return output, lse
    return _merge_attention((output,), (lse,), sinks)


# ------------------------------------------------------------------------------------------
# Gradients: grouped heads and broadcast inputs
# ------------------------------------------------------------------------------------------


def _matmul_grouped(a: torch.Tensor, b: torch.Tensor, groups: int) -> torch.Tensor:
    """``a (..., heads, T, S) @ b (..., kv_heads, S, D)`` with the grouped-query head mapping."""
    if groups == 1:
        return a @ b
    product = _group_heads(a, groups) @ b[..., None, :, :]  # (..., kv_heads, groups, T, D)
    return product.reshape(a.shape[:-1] + (b.shape[-1],))  # (..., heads, T, D)


def _sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(..., heads, T, D)`` → ``(..., kv_heads, T, D)``: add the query heads sharing a kv head."""
    if groups == 1:
        return x
    return _group_heads(x, groups).sum(dim=-3)


def _sum_to_shape(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Sum ``x`` over the axes along which an array of ``shape`` was broadcast to ``x.shape``."""
    leading = x.ndim - len(shape)
    x = x.sum(dim=tuple(range(leading))) if leading else x
    stretched = tuple(axis for axis, size in enumerate(shape) if size == 1 and x.shape[axis] != 1)
    return x.sum(dim=stretched, keepdim=True) if stretched else x
