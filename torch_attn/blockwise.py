"""Memory-efficient attention in PyTorch: keys and values in blocks, with the online softmax.

Plain attention holds a ``(q_len, kv_len)`` score matrix per head (4 GiB per head at 32,768
tokens in float32). ``blockwise_attention`` visits ``(block_q, block_kv)`` tiles instead and
keeps, per query row, a running maximum ``m``, a running sum ``l`` and a running weighted sum
``acc`` of the values (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022)::

    s      = mask(softcap(q kᵀ · scale) + bias)         one tile
    m_new  = max(m, rowmax(s))
    p      = exp(s - m_new)
    l      = l · exp(m - m_new) + rowsum(p)
    acc    = acc · exp(m - m_new) + p v
    output = acc / l                                    (0 where l == 0: a fully masked row)

Extra memory is a few ``(..., heads, block_q, block_kv)`` tiles. Masks are structure, not
arrays: the causal rule (both alignments), the sliding window and per-sequence key lengths
(``kv_lengths``) are evaluated per tile, and a tile that the causal rule or the window masks
entirely is never computed. The backward pass keeps only the log-sum-exp ``lse = m + log l``
of each row and recomputes every tile's weights as ``exp(s - lse)``: a custom
``torch.autograd.Function`` (``BlockwiseFunction``), so autograd never stores a tile.
``scaled_dot_product_attention``'s fast path (``_fast.py``) runs the same Function for large
inputs with a soft-cap, a window or bottom-right causal with ``q_len != kv_len``, its boolean
``mask`` sliced per tile like the bias (torch only: the public functions here take none);
``context_parallel.py`` runs ``forward_tiles`` and ``backward_tiles`` on pairs of chunks.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import attention_rules as rules

from ._core import (
    NEG_INF,
    _add_alibi,
    _array,
    _as_tensor,
    _describe,
    _describe_lengths,
    _describe_segments,
    _groups,
    _in_band,
    _matmul_grouped,
    _Mods,
    _mods,
    _mods_allowed,
    _mods_scores,
    _plan_with_mods,
    _segments,
    _softcap,
    _sum_groups,
    _sum_to_shape,
    _to_compute,
    _with_sinks,
)

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_KV = 1024


# ------------------------------------------------------------------------------------------
# Public functions
# ------------------------------------------------------------------------------------------


def blockwise_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    bias: Any = None,
    kv_lengths: Any = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
    sinks: Any = None,
    return_lse: bool = False,
    chunk_size: int | None = None,
    alibi_slopes: Any = None,
    segment_ids: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention in ``(block_q, block_kv)`` tiles, with the online softmax.

    Equal to ``scaled_dot_product_attention(query, key, value, mask=padding_mask(kv_lengths,
    kv_len), bias=bias, ...)`` (no dropout, no weights), using a few tiles of extra memory
    instead of the ``(q_len, kv_len)`` matrix; tiles that the causal rule or the window mask
    entirely are skipped. Differentiable: the backward pass recomputes each tile.

    Args:
      query: ``(..., heads, q_len, head_dim)`` or ``(q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)`` or ``(kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)`` or ``(kv_len, v_dim)``.
      bias: floating point, broadcastable to ``(..., heads, q_len, kv_len)``; sliced per tile.
      kv_lengths: ints shaped like the batch axes ``(...)`` (``(batch,)`` for 4-D inputs), each
        in ``[0, kv_len]``: key ``j`` of sequence ``b`` is attended only if
        ``j < kv_lengths[b]``.
      is_causal, causal_alignment, window, scale, softcap: as in
        ``scaled_dot_product_attention``.
      block_q: queries per tile (``>= 1``).
      block_kv: keys per tile (``>= 1``).
      sinks: ``(heads,)`` sink logits, joined to each row's denominator after the last tile
        (autograd, beyond the tiles' Function).
      return_lse: also return each row's log-sum-exp (differentiable).
      chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod: as in
        ``scaled_dot_product_attention``, per tile; the tiles that chunks, segment ids or
        ``mask_mod`` mask entirely are skipped.

    Returns:
      ``(..., heads, q_len, v_dim)`` in the input dtype (fully masked rows give 0), and with
      ``return_lse`` the lse ``(..., heads, q_len)`` in the compute dtype.
    """
    fn = "blockwise_attention"
    args = _arguments(fn, query, key, value, None, bias, kv_lengths, is_causal, causal_alignment,
                      window, scale, softcap, block_q, block_kv, sinks, return_lse,
                      (chunk_size, alibi_slopes, segment_ids, score_mod,
                       mask_mod))  # every rule of the spec, once
    query, key, value, bias = _array(query), _array(key), _array(value), _array(bias)
    mods = _mods(fn, args, query, key, alibi_slopes, _segments(segment_ids))
    bias, kv_lengths, plan, lo, hi = _prepare(fn, query, key, bias, kv_lengths, args, mods)
    config = (plan, lo, hi, args.scale, args.softcap)
    output, lse = _with_sinks(  # the sinks join once, at the end
        *BlockwiseFunction.apply(query, key, value, bias, None, kv_lengths, config, mods),
        _array(sinks))
    output = output.to(query.dtype)
    return (output, lse[..., 0]) if args.return_lse else output


def blockwise_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    *,
    bias: Any = None,
    kv_lengths: Any = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
    sinks: Any = None,
    chunk_size: int | None = None,
    alibi_slopes: Any = None,
    segment_ids: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of ``blockwise_attention``, tile by tile, from the saved log-sum-exp.

    Through ``torch.autograd``: ``blockwise_attention`` is a custom ``autograd.Function`` whose
    backward recomputes each tile's weights as ``exp(s - lse)`` (numpy_attn's derivation).

    Args:
      query: ``(..., heads, q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)``.
      grad_output: ``(..., heads, q_len, v_dim)``.
      bias, kv_lengths, is_causal, causal_alignment, window, scale, softcap, block_q,
        block_kv, sinks, chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod: as in
        ``blockwise_attention``.

    Returns:
      ``(grad_query, grad_key, grad_value, grad_bias)`` shaped like query, key, value and bias
      (``grad_bias`` is None without a bias), in their dtypes, and with ``sinks`` a fifth,
      ``grad_sinks (heads,)``.
    """
    fn = "blockwise_attention_vjp"
    args = _arguments(fn, query, key, value, grad_output, bias, kv_lengths, is_causal,
                      causal_alignment, window, scale, softcap, block_q, block_kv, sinks, False,
                      (chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod))
    query, key, value, bias = _array(query), _array(key), _array(value), _array(bias)
    grad_output, bias_shape = _array(grad_output), None if bias is None else bias.shape
    mods = _mods(fn, args, query, key, alibi_slopes, _segments(segment_ids))
    bias, kv_lengths, plan, lo, hi = _prepare(fn, query, key, bias, kv_lengths, args, mods)
    config = (plan, lo, hi, args.scale, args.softcap)
    # autograd through the custom Function; bias and sinks join the inputs only when given.
    given = {name: x.detach().requires_grad_(True) for name, x in
             (("bias", bias), ("sinks", _array(sinks))) if x is not None}
    inputs = [t.detach().requires_grad_(True) for t in (query, key, value)] + list(given.values())
    with torch.enable_grad():
        output, _ = _with_sinks(
            *BlockwiseFunction.apply(*inputs[:3], given.get("bias"), None, kv_lengths, config,
                                     mods), given.get("sinks"))
        grads = torch.autograd.grad(output.to(query.dtype), inputs, grad_outputs=grad_output,
                                    allow_unused=True)
    grads = dict(zip(["query", "key", "value", *given], (
        torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True)
    ), strict=True))
    result = (grads["query"], grads["key"], grads["value"],
              grads["bias"].reshape(bias_shape) if bias is not None else None)
    return result + ((grads["sinks"],) if sinks is not None else ())


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
      mods: chunks, ALiBi, segment ids and the mods (``_core._mods``), or None; a tile whose
        ``partial`` has bit 2 (``_core._plan_with_mods``) is masked by them.

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
            if post is not None:  # through score_mod: its vector-Jacobian product
                grad_s = torch.autograd.grad(post, pre, grad_s)[0]
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


class BlockwiseFunction(torch.autograd.Function):
    """torch only: the tiles as one autograd node, ``BlockwiseFunction.apply(query, key, value,
    bias, mask, kv_lengths, config)`` with ``config = (plan, lo, hi, scale, softcap)`` and the
    arrays of ``forward_tiles``; returns its ``(output, lse)`` (compute dtype; lse ``+inf`` on
    a row without a key: ``_core._with_sinks`` gives the spec's ``-inf``), both
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
# Arguments and the plan of tiles
# ------------------------------------------------------------------------------------------


def _arguments(
    fn: str, query: Any, key: Any, value: Any, grad_output: Any, bias: Any, kv_lengths: Any,
    is_causal: Any, causal_alignment: Any, window: Any, scale: Any, softcap: Any, block_q: Any,
    block_kv: Any, sinks: Any, return_lse: Any, extra: tuple = (None,) * 5,
) -> rules.Arguments:
    """``rules.attention_arguments`` for the forward pass (``grad_output`` None) and the VJP;
    ``extra``: ``(chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod)`` as given."""
    chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod = extra
    return rules.attention_arguments(
        fn, _describe(fn, "query", query), _describe(fn, "key", key),
        _describe(fn, "value", value),
        grad_output=None if grad_output is None else _describe(fn, "grad_output", grad_output),
        bias=_describe(fn, "bias", bias), is_causal=is_causal, causal_alignment=causal_alignment,
        window=window, scale=scale, softcap=softcap, kv_lengths=_describe_lengths(kv_lengths),
        block_q=block_q, block_kv=block_kv, sinks=_describe(fn, "sinks", sinks),
        return_lse=return_lse, chunk_size=chunk_size,
        alibi_slopes=_describe(fn, "alibi_slopes", alibi_slopes),
        segment_ids=_describe_segments(fn, segment_ids), score_mod=score_mod, mask_mod=mask_mod,
    )


def _prepare(
    fn: str, query: torch.Tensor, key: torch.Tensor, bias: torch.Tensor | None, kv_lengths: Any,
    args: rules.Arguments, mods: _Mods | None = None,
) -> tuple:
    """The full-rank bias, the checked ``kv_lengths`` and the tiles to compute with their band,
    without those ``mods`` mask entirely (``_core._plan_with_mods``)."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if kv_lengths is not None:  # the range needs the values: checked here
        kv_lengths = _as_tensor(kv_lengths).to(query.device)  # torch: a mask, not an input
        rules.check_lengths(fn, "kv_lengths", kv_lengths.tolist(), kv_len)
    if bias is not None:  # full rank, so tiles slice the last two axes
        bias = bias.reshape((1,) * (len(args.scores_shape) - bias.ndim) + tuple(bias.shape))
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
    plan = rules.plan(q_len, kv_len, args.block_q, args.block_kv, lo, hi)
    if kv_lengths is not None and kv_lengths.numel():  # key blocks past every length: skipped
        longest = int(kv_lengths.max())
        plan = [(a, b, [t for t in blocks if t[0] < longest]) for a, b, blocks in plan]
    plan = _plan_with_mods(plan, mods, q_len, kv_len, args.block_q, args.block_kv, lo, hi)
    return bias, kv_lengths, plan, lo, hi


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


