"""The tile engine of torch_attn, unchecked: ``forward_tiles``, the online softmax over the
tiles of a plan, and ``backward_tiles``, FlashAttention's backward per tile from the saved
log-sum-exp, with the scores, bias and masks of one tile; out of place, on the inputs' device.
``BlockwiseFunction`` (torch only) makes the two passes one autograd node. ``blockwise.py``
explains them, validates and runs that Function; the fast path's ``"blocked"`` (``_fast``)
runs it too, and ``context_blocks.py`` runs the two passes on pairs of chunks.

Imports ``_arrays``, ``_masking`` and ``_steps`` (the ladder: ``_arrays.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ._arrays import _groups, _to_compute
from ._masking import _add_alibi, _in_band, _Mods, _mods_allowed, _mods_scores
from ._steps import NEG_INF, _matmul_grouped, _softcap, _sum_groups, _sum_to_shape

# ------------------------------------------------------------------------------------------
# Forward and backward, unchecked
# ------------------------------------------------------------------------------------------


def forward_tiles(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    kv_lengths: torch.Tensor | None,
    plan: list,
    lo: float,
    hi: float,
    scale: float,
    softcap: float | None,
    mods: _Mods | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax over the tiles of ``plan``, on validated inputs.

    Args:
      query: ``(..., heads, q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)``.
      bias: full rank ``(..., heads | 1, q_len | 1, kv_len | 1)``, or None.
      mask: boolean, full rank like ``bias`` (True = may attend), or None: the fast path's; the
        public functions pass None.
      kv_lengths: ints ``(...)`` shaped like the batch axes, or None: key ``j`` of sequence
        ``b`` is attended only if ``j < kv_lengths[b]``.
      plan: ``rules.plan``'s tiles; lo, hi: the band ``lo <= j - i <= hi``.
      scale: multiplies ``query @ keyᵀ``; softcap: ``softcap · tanh(s / softcap)`` or None.
      mods: chunks, ALiBi, segment ids and the mods (``_masking._mods``), or None; a tile whose
        ``partial`` has bit 2 (``_masking._plan_with_mods``) is masked by them.

    Returns:
      ``output (..., heads, q_len, v_dim)`` and ``lse (..., heads, q_len, 1)`` in the compute
      dtype; ``lse`` is ``+inf`` on fully masked rows, so ``exp(s - lse)`` is 0 there.
    """
    q = _to_compute(query) * scale  # (..., heads, q_len, head_dim)
    k, v = _to_compute(key), _to_compute(value)  # (..., kv_heads, kv_len, head_dim | v_dim)
    groups = _groups(q.shape, k.shape)
    like = {"dtype": q.dtype, "device": q.device}  # torch: dtype and device of new tensors
    output = torch.zeros(q.shape[:-1] + v.shape[-1:], **like)  # (..., heads, q_len, v_dim)
    lse = torch.full(q.shape[:-1] + (1,), math.inf, **like)  # (..., heads, q_len, 1)
    for q_start, q_stop, blocks in plan:
        rows = q.shape[:-2] + (q_stop - q_start, 1)
        row_max = torch.full(rows, NEG_INF, **like)  # m: (..., heads, bq, 1)
        row_sum = torch.zeros(rows, **like)  # l
        acc = torch.zeros(rows[:-1] + v.shape[-1:], **like)  # (..., heads, bq, v_dim)
        for kv_start, kv_stop, partial in blocks:
            tile = (q_start, q_stop, kv_start, kv_stop)
            scores = _tile_scores(q[..., q_start:q_stop, :], k[..., kv_start:kv_stop, :], groups,
                                  softcap)  # (..., heads, bq, bk)
            scores = _mask_tile(scores, bias, mask, kv_lengths, tile, partial, lo, hi, mods)
            new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
            shift = torch.where(new_max == NEG_INF, 0.0, new_max)  # no -inf - -inf
            scores -= shift
            p = torch.exp(scores, out=scores)  # in place: the tile's unnormalised weights
            correction = torch.exp(row_max - shift)  # rescales earlier tiles; 0 at first
            row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
            acc = acc * correction + _matmul_grouped(p, v[..., kv_start:kv_stop, :], groups)
            row_max = new_max
        kept = row_sum != 0  # (..., heads, bq, 1); False: a fully masked row; NaN
        # rows stay NaN, their lse too (NON_FINITE), never -inf: a merge must not drop them
        safe_sum = torch.where(kept, row_sum, 1.0)
        output[..., q_start:q_stop, :] = acc / safe_sum  # 0 / 1 = 0 on fully masked rows
        lse[..., q_start:q_stop, :] = torch.where(kept, row_max + torch.log(safe_sum), math.inf)
    return output, lse


def backward_tiles(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    kv_lengths: torch.Tensor | None,
    plan: list,
    lo: float,
    hi: float,
    scale: float,
    softcap: float | None,
    output: torch.Tensor,
    lse: torch.Tensor,
    grad_output: torch.Tensor,
    bias_needs_grad: bool = True,
    grad_lse: torch.Tensor | None = None,
    mods: _Mods | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """FlashAttention's backward per tile (numpy_attn's ``backward.py`` derives it for the whole
    matrix), recomputing each tile's weights as ``exp(s - lse)``.

    Args:
      query, key, value, bias, mask, kv_lengths, plan, lo, hi, scale, softcap: as in
        ``forward_tiles``.
      output: ``(..., heads, q_len, v_dim)``, ``forward_tiles``' output (compute dtype).
      lse: ``(..., heads, q_len, 1)``, ``forward_tiles``' log-sum-exp (``+inf``: empty row).
      grad_output: ``(..., heads, q_len, v_dim)``.
      bias_needs_grad: False skips ``grad_bias``.
      grad_lse: the lse's cotangent ``(..., heads, q_len, 1)``, or None: ``dlse / dS = P``, so
        ``dS = P ⊙ (dP - rowsum(dO ⊙ O) + dlse)``.
      mods: as in ``forward_tiles``; ``dS`` goes back through ``score_mod`` by autograd of
        the tile.

    Returns:
      ``(grad_query, grad_key, grad_value, grad_bias)`` shaped like query, key, value and the
      full-rank bias, in the compute dtype; ``grad_bias`` is None without a bias or when
      ``bias_needs_grad`` is False.
    """
    q = _to_compute(query)  # (..., heads, q_len, head_dim), unscaled
    k, v = _to_compute(key), _to_compute(value)
    d_out = _to_compute(grad_output)  # (..., heads, q_len, v_dim)
    groups = _groups(q.shape, k.shape)
    q_scaled = q * scale
    row_dot = (d_out * output).sum(dim=-1, keepdim=True)  # rowsum(dO ⊙ O): (..., heads, q_len, 1)
    if grad_lse is not None:
        row_dot = row_dot - grad_lse.to(row_dot.dtype)
    grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    grad_bias = None
    if bias is not None and bias_needs_grad:
        grad_bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device)
    for q_start, q_stop, blocks in plan:
        rows = slice(q_start, q_stop)
        d_out_tile = d_out[..., rows, :]  # (..., heads, bq, v_dim)
        for kv_start, kv_stop, partial in blocks:
            tile, cols = (q_start, q_stop, kv_start, kv_stop), slice(kv_start, kv_stop)
            capped = _tile_scores(q_scaled[..., rows, :], k[..., cols, :], groups, softcap)  # S1
            scores = capped.clone() if softcap is not None else capped  # S1 is needed for tanh'
            pre = post = None  # around score_mod, for its derivative
            if mods is not None and mods.score_mod is not None:
                if bias is not None:
                    scores = scores + bias[_bias_tile(bias, *tile)].to(scores.device, scores.dtype)
                with torch.enable_grad():
                    pre = _add_alibi(scores, mods, q_start, kv_start).detach().requires_grad_()
                    post = _mods_scores(pre, mods._replace(alibi=None), q_start, kv_start)
                scores = _mask_tile(post.detach().clone(), None, mask, kv_lengths, tile, partial,
                                    lo, hi, mods, transformed=True)
            else:
                scores = _mask_tile(scores, bias, mask, kv_lengths, tile, partial, lo, hi, mods)
            p = torch.exp(scores.sub_(lse[..., rows, :]), out=scores)  # P, recomputed, in place
            # dV = Pᵀ dO
            grad_v[..., cols, :] += _sum_groups(p.transpose(-1, -2) @ d_out_tile, groups)
            # dP = dO Vᵀ
            grad_p = _matmul_grouped(d_out_tile, v[..., cols, :].transpose(-1, -2), groups)
            # dS = P ⊙ (dP - rowsum(dO ⊙ O))
            grad_s = grad_p.sub_(row_dot[..., rows, :]).mul_(p)  # in place: dP is not needed
            if post is not None:  # through score_mod: its vector-Jacobian product; 0 where P
                grad_s = torch.autograd.grad(post, pre, grad_s)[0]  # is 0 (masked), even NaN
                grad_s = torch.where(p == 0.0, 0.0, grad_s)
            if grad_bias is not None:
                index = _bias_tile(grad_bias, *tile)
                grad_bias[index] += _sum_to_shape(grad_s, grad_bias[index].shape)
            if softcap is not None:  # tanh': 1 - (S1 / c)², in place: S1 is not needed after
                grad_s *= capped.mul_(1.0 / softcap).square_().neg_().add_(1.0)
            # dQ = dS K · scale (scaled once, below), dK = dSᵀ (Q · scale)
            grad_q[..., rows, :] += _matmul_grouped(grad_s, k[..., cols, :], groups)
            grad_k[..., cols, :] += _sum_groups(
                grad_s.transpose(-1, -2) @ q_scaled[..., rows, :], groups)
    grad_q *= scale
    return grad_q, grad_k, grad_v, grad_bias


# ------------------------------------------------------------------------------------------
# The tiles' autograd Function (torch only): forward and backward
# ------------------------------------------------------------------------------------------


class BlockwiseFunction(torch.autograd.Function):
    """torch only: the tiles as one autograd node, ``BlockwiseFunction.apply(query, key, value,
    bias, mask, kv_lengths, config)`` with ``config = (plan, lo, hi, scale, softcap)`` and the
    arrays of ``forward_tiles``; returns its ``(output, lse)`` (compute dtype; lse ``+inf`` on
    a row without a key: ``_steps._with_sinks`` gives the spec's ``-inf``), both
    differentiable. Its backward recomputes every tile (``backward_tiles``)."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                bias: torch.Tensor | None, mask: torch.Tensor | None,
                kv_lengths: torch.Tensor | None, config: tuple, mods: _Mods | None = None) -> Any:
        output, lse = forward_tiles(query, key, value, bias, mask, kv_lengths, *config, mods)
        ctx.save_for_backward(query, key, value, bias, mask, kv_lengths, output, lse)
        ctx.config, ctx.mods = config, mods
        return output, lse

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, grad_lse: torch.Tensor) -> Any:
        query, key, value, bias, mask, kv_lengths, output, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v, grad_bias = backward_tiles(
            query, key, value, bias, mask, kv_lengths, *ctx.config, output, lse, grad_output,
            bias_needs_grad=ctx.needs_input_grad[3],
            grad_lse=torch.where(torch.isinf(lse), 0.0, grad_lse),  # no row: no gradient
            mods=ctx.mods,
        )
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype), grad_bias, \
            None, None, None, None


# ------------------------------------------------------------------------------------------
# Tiles
# ------------------------------------------------------------------------------------------


def _tile_scores(
    q_tile: torch.Tensor, k_tile: torch.Tensor, groups: int, softcap: float | None
) -> torch.Tensor:
    """``(..., heads, bq, head_dim) @ (..., kv_heads, bk, head_dim)ᵀ`` → ``(..., heads, bq, bk)``,
    soft-capped; ``q_tile`` is already scaled."""
    scores = _matmul_grouped(q_tile, k_tile.transpose(-1, -2), groups)
    return _softcap(scores, softcap)


def _bias_tile(bias: torch.Tensor, q_start: int, q_stop: int, kv_start: int, kv_stop: int) -> Any:
    """The tile of a full-rank bias (or mask); broadcast (size-1) query or key axes are kept
    whole."""
    q_slice = slice(q_start, q_stop) if bias.shape[-2] != 1 else slice(None)
    kv_slice = slice(kv_start, kv_stop) if bias.shape[-1] != 1 else slice(None)
    return (..., q_slice, kv_slice)


def _mask_tile(
    scores: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    kv_lengths: torch.Tensor | None,
    tile: tuple[int, int, int, int],
    partial: int,
    lo: float,
    hi: float,
    mods: _Mods | None = None,
    transformed: bool = False,
) -> torch.Tensor:
    """Add the bias tile (and ALiBi, then ``score_mod``; not when ``transformed``: done), then
    ``-inf`` where the mask, the band (bit 1 of ``partial``), ``kv_lengths`` or ``mods``' rules
    (bit 2) forbid (in place; replaced, not added, so a NaN score at a masked position does not
    spread)."""
    q_start, q_stop, kv_start, kv_stop = tile
    device = scores.device  # torch: positions are built on the scores' device
    if bias is not None:
        scores += bias[_bias_tile(bias, *tile)].to(device, scores.dtype)
    if not transformed and mods is not None:
        scores = _mods_scores(scores, mods, q_start, kv_start)
    if mask is not None:  # torch only: the fast path's boolean mask, full rank, sliced per tile
        scores.masked_fill_(~mask[_bias_tile(mask, *tile)].to(device), NEG_INF)
    if partial & 2:  # chunks, segment ids, mask_mod cut the tile
        allowed = _mods_allowed(mods, q_start, q_stop - q_start, kv_start, kv_stop - kv_start)
        scores.masked_fill_(~allowed, NEG_INF)
    if partial & 1:  # (bq, bk): j - i inside [lo, hi]
        allowed = _in_band(q_start, q_stop - q_start, kv_start, kv_stop - kv_start, lo, hi, device)
        scores.masked_fill_(~allowed, NEG_INF)
    if kv_lengths is not None:  # (batch..., 1, 1, bk): key j < kv_lengths[b]
        lengths = kv_lengths.reshape(kv_lengths.shape + (1,) * (scores.ndim - kv_lengths.ndim))
        scores.masked_fill_(torch.arange(kv_start, kv_stop, device=device) >= lengths, NEG_INF)
    return scores
