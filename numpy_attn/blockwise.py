"""Memory-efficient attention in NumPy: keys and values in blocks, with the online softmax.

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
of each row and recomputes every tile's weights as ``exp(s - lse)``. Attention sinks join each
row's denominator once, after the last tile (``_core._with_sinks``), and ``return_lse`` returns
that lse.

Both passes run on numpy_attn's threads (``_threads.run_lanes``, BLAS in one thread per
worker): the forward pass one query block per task (its output rows are its own), the backward
pass one key block per task (its ``dK`` and ``dV`` rows are its own; each worker adds ``dQ``
into its own copy, and the copies are added at the end), so no two threads write the same
entry.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import attention_rules as rules

from . import _threads
from ._core import (
    NEG_INF,
    _add_alibi,
    _array,
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
    _mods_slope,
    _mods_statuses,
    _segments,
    _sinks_grad,
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
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Scaled dot-product attention in ``(block_q, block_kv)`` tiles, with the online softmax.

    Equal to ``scaled_dot_product_attention(query, key, value, mask=padding_mask(kv_lengths,
    kv_len), bias=bias, ...)`` (no dropout, no weights), using a few tiles of extra memory
    instead of the ``(q_len, kv_len)`` matrix; tiles that the causal rule or the window mask
    entirely are skipped.

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
      sinks: ``(heads,)`` sink logits, joined to each row's denominator after the last tile.
      return_lse: also return each row's log-sum-exp.
      chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod: as in
        ``scaled_dot_product_attention``, per tile; tiles that the chunks, the segment ids or
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
    mods = _mods(fn, args, query.shape, key.shape, alibi_slopes, _segments(segment_ids))
    bias, kv_lengths, plan, lo, hi = _prepare(fn, query, key, bias, kv_lengths, args, mods)
    output, lse = forward_tiles(query, key, value, bias, kv_lengths, plan, lo, hi, args.scale,
                                args.softcap, mods)
    output, lse = _with_sinks(output, lse, _array(sinks))  # the sinks join once, at the end
    output = output.astype(query.dtype, copy=False)
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
) -> tuple[np.ndarray | None, ...]:
    """Gradients of ``blockwise_attention``, tile by tile, from the saved log-sum-exp.

    Written by hand (``backward.py``'s derivation per tile): the forward pass keeps only the
    output and ``lse`` per row; each tile's weights are recomputed as ``exp(s - lse)``. With
    sinks, ``output`` and ``lse`` are those of the rows with the sink joined, so the tiles'
    formulas stay as they are (the sink's column has no value: ``dP`` is 0 there), and
    ``d sink = -sum exp(sink - lse) · rowsum(dO ⊙ O)``.

    Args:
      query: ``(..., heads, q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)``.
      grad_output: ``(..., heads, q_len, v_dim)``.
      bias, kv_lengths, is_causal, causal_alignment, window, scale, softcap, block_q,
        block_kv, sinks, chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod: as in
        ``blockwise_attention`` (``score_mod`` needs its ``derivative``, as in
        ``scaled_dot_product_attention_vjp``).

    Returns:
      ``(grad_query, grad_key, grad_value, grad_bias)`` shaped like query, key, value and bias
      (``grad_bias`` is None without a bias), in their dtypes, and with ``sinks`` a fifth,
      ``grad_sinks (heads,)`` in the sinks' dtype.
    """
    fn = "blockwise_attention_vjp"
    args = _arguments(fn, query, key, value, grad_output, bias, kv_lengths, is_causal,
                      causal_alignment, window, scale, softcap, block_q, block_kv, sinks, False,
                      (chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod))
    rules.check_mod_derivative(fn, args.score_mod)  # numpy: by hand, so it needs d score_mod
    query, key, value, bias = _array(query), _array(key), _array(value), _array(bias)
    grad_output, bias_shape = _array(grad_output), None if bias is None else bias.shape
    mods = _mods(fn, args, query.shape, key.shape, alibi_slopes, _segments(segment_ids))
    bias, kv_lengths, plan, lo, hi = _prepare(fn, query, key, bias, kv_lengths, args, mods)
    output, lse = forward_tiles(query, key, value, bias, kv_lengths, plan, lo, hi,
                                args.scale, args.softcap, mods)
    sinks = _array(sinks)
    if sinks is not None:  # the rows with their sinks: -inf (no key, a sink of -inf) → +inf
        output, lse = _with_sinks(output, lse, sinks)
        lse = np.where(lse == -np.inf, np.inf, lse).astype(lse.dtype)
    grad_q, grad_k, grad_v, grad_bias = backward_tiles(  # numpy: by hand, tile by tile
        query, key, value, bias, kv_lengths, plan, lo, hi, args.scale, args.softcap, output, lse,
        grad_output, mods,
    )
    dtype = query.dtype
    grads = (grad_q.astype(dtype), grad_k.astype(dtype), grad_v.astype(dtype))
    grads += (None if grad_bias is None else grad_bias.reshape(bias_shape).astype(bias.dtype),)
    if sinks is None:
        return grads
    row_dot = (_to_compute(grad_output) * output).sum(axis=-1, keepdims=True)  # rowsum(dO ⊙ O)
    return grads + (_sinks_grad(sinks, lse, row_dot).astype(sinks.dtype),)


# ------------------------------------------------------------------------------------------
# Forward and backward, unchecked (the engine of the tiles; context_parallel.py's too)
# ------------------------------------------------------------------------------------------


def forward_tiles(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    bias: np.ndarray | None,
    kv_lengths: np.ndarray | None,
    plan: list,
    lo: float,
    hi: float,
    scale: float,
    softcap: float | None,
    mods: _Mods | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The online-softmax forward pass over the tiles of ``plan``, unchecked (the public
    functions here and ``context_parallel.py`` validate first).

    Args:
      query: ``(..., heads, q_len, head_dim)``, unscaled.
      key: ``(..., kv_heads, kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)``.
      bias: full rank, broadcastable to ``(..., heads, q_len, kv_len)``, or None.
      kv_lengths: ints shaped like the batch axes ``(...)``, or None.
      plan: ``rules.plan(q_len, kv_len, block_q, block_kv, lo, hi)``: the tiles to compute.
      lo, hi: the band ``lo <= j - i <= hi`` (``rules.band``).
      scale, softcap: as checked by ``rules.attention_arguments``.
      mods: chunks, ALiBi, segment ids and the mods (``_core._mods``), or None; a tile whose
        ``partial`` has bit 2 (``_prepare``) is masked by them.

    Returns:
      ``output (..., heads, q_len, v_dim)`` and ``lse (..., heads, q_len, 1)`` in the compute
      dtype; ``lse`` is ``+inf`` on fully masked rows, so ``exp(s - lse)`` is 0 there.
    """
    q = _to_compute(query) * scale  # (..., heads, q_len, head_dim)
    k, v = _to_compute(key), _to_compute(value)  # (..., kv_heads, kv_len, head_dim | v_dim)
    groups = _groups(q.shape, k.shape)
    output = np.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)  # (..., heads, q_len, v_dim)
    lse = np.full(q.shape[:-1] + (1,), np.inf, q.dtype)  # (..., heads, q_len, 1)

    def query_block(q_start: int, q_stop: int, blocks: list, scratch: None) -> None:
        rows = q.shape[:-2] + (q_stop - q_start, 1)
        row_max = np.full(rows, NEG_INF, q.dtype)  # m: (..., heads, bq, 1)
        row_sum = np.zeros(rows, q.dtype)  # l
        acc = np.zeros(rows[:-1] + v.shape[-1:], q.dtype)  # (..., heads, bq, v_dim)
        for kv_start, kv_stop, partial in blocks:
            tile = (q_start, q_stop, kv_start, kv_stop)
            scores = _tile_scores(q[..., q_start:q_stop, :], k[..., kv_start:kv_stop, :], groups,
                                  softcap)  # (..., heads, bq, bk)
            scores = _mask_tile(scores, bias, kv_lengths, tile, partial, lo, hi, mods)
            new_max = np.maximum(row_max, scores.max(axis=-1, keepdims=True))
            shift = np.where(new_max == NEG_INF, 0.0, new_max).astype(q.dtype)  # no -inf - -inf
            scores -= shift
            p = np.exp(scores, out=scores)  # in place: the tile's unnormalised weights
            correction = np.exp(row_max - shift)  # rescales earlier tiles; 0 at first
            row_sum = row_sum * correction + p.sum(axis=-1, keepdims=True)
            acc = acc * correction + _matmul_grouped(p, v[..., kv_start:kv_stop, :], groups)
            row_max = new_max
        kept = row_sum != 0  # (..., heads, bq, 1); False: a fully masked row; NaN
        # rows stay NaN, their lse too (NON_FINITE), never -inf: a merge must not drop them
        safe_sum = np.where(kept, row_sum, 1.0).astype(q.dtype)
        output[..., q_start:q_stop, :] = acc / safe_sum  # 0 / 1 = 0 on fully masked rows
        lse[..., q_start:q_stop, :] = np.where(kept, row_max + np.log(safe_sum), np.inf)

    # numpy: the query blocks on the threads (their rows are their own)
    _threads.run_lanes(sorted(plan, key=lambda task: -len(task[2])), query_block, lambda: None)
    return output, lse


def backward_tiles(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    bias: np.ndarray | None,
    kv_lengths: np.ndarray | None,
    plan: list,
    lo: float,
    hi: float,
    scale: float,
    softcap: float | None,
    output: np.ndarray,
    lse: np.ndarray,
    grad_output: np.ndarray,
    mods: _Mods | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """FlashAttention's backward per tile (``backward.py`` derives it for the whole matrix),
    unchecked, from ``forward_tiles``' results.

    Args:
      query, key, value, bias, kv_lengths, plan, lo, hi, scale, softcap, mods: as in
        ``forward_tiles`` (``score_mod``'s derivative multiplies ``dS`` before the bias takes
        it).
      output: ``(..., heads, q_len, v_dim)`` in the compute dtype, from ``forward_tiles``.
      lse: ``(..., heads, q_len, 1)``, ``+inf`` on fully masked rows.
      grad_output: ``(..., heads, q_len, v_dim)``.

    Returns:
      ``(grad_query, grad_key, grad_value, grad_bias)`` in the compute dtype, shaped like query
      ``(..., heads, q_len, head_dim)``, key ``(..., kv_heads, kv_len, head_dim)``, value
      ``(..., kv_heads, kv_len, v_dim)`` and the full-rank bias (None without one).
    """
    q = _to_compute(query)  # (..., heads, q_len, head_dim), unscaled
    k, v = _to_compute(key), _to_compute(value)
    d_out = _to_compute(grad_output)  # (..., heads, q_len, v_dim)
    groups = _groups(q.shape, k.shape)
    q_scaled = q * scale
    row_dot = (d_out * output).sum(axis=-1, keepdims=True)  # rowsum(dO ⊙ O): (..., heads, q_len, 1)
    grad_k, grad_v = np.zeros_like(k), np.zeros_like(v)
    has_bias = bias is not None
    columns: dict[tuple[int, int], list] = {}  # key block -> the query blocks that see it
    for q_start, q_stop, blocks in plan:
        for kv_start, kv_stop, partial in blocks:
            columns.setdefault((kv_start, kv_stop), []).append((q_start, q_stop, partial))

    def key_block(kv_start: int, kv_stop: int, tiles: list, own: tuple) -> None:
        grad_q, grad_bias = own  # this lane's: key blocks may share entries of a broadcast bias
        cols = slice(kv_start, kv_stop)  # dK and dV of these keys: this task's own
        for q_start, q_stop, partial in tiles:
            tile, rows = (q_start, q_stop, kv_start, kv_stop), slice(q_start, q_stop)
            d_out_tile = d_out[..., rows, :]  # (..., heads, bq, v_dim)
            capped = _tile_scores(q_scaled[..., rows, :], k[..., cols, :], groups, softcap)  # S1
            scores = capped.copy() if softcap is not None else capped  # S1 is needed for tanh'
            mod_slope = None  # d score_mod / d score at S1 + bias + ALiBi
            if mods is not None and mods.score_mod is not None:
                pre = scores.copy()
                if bias is not None:
                    pre += bias[_bias_tile(bias, *tile)].astype(pre.dtype, copy=False)
                mod_slope = _mods_slope(_add_alibi(pre, mods, q_start, kv_start), mods, q_start,
                                        kv_start)
            scores = _mask_tile(scores, bias, kv_lengths, tile, partial, lo, hi, mods)
            p = np.exp(scores - lse[..., rows, :])  # P, recomputed: (..., heads, bq, bk)
            # dV = Pᵀ dO
            grad_v[..., cols, :] += _sum_groups(np.swapaxes(p, -1, -2) @ d_out_tile, groups)
            # dP = dO Vᵀ
            grad_p = _matmul_grouped(d_out_tile, np.swapaxes(v[..., cols, :], -1, -2), groups)
            # dS = P ⊙ (dP - rowsum(dO ⊙ O))
            grad_s = p * (grad_p - row_dot[..., rows, :])
            if mod_slope is not None:  # through score_mod
                grad_s *= mod_slope
            if grad_bias is not None:
                index = _bias_tile(grad_bias, *tile)
                grad_bias[index] += _sum_to_shape(grad_s, grad_bias[index].shape)
            if softcap is not None:  # tanh': 1 - (S1 / c)²
                grad_s *= 1.0 - np.square(capped * (1.0 / softcap))
            grad_s *= scale
            # dQ = dS K · scale (into this worker's own dQ), dK = dSᵀ Q · scale
            grad_q[..., rows, :] += _matmul_grouped(grad_s, k[..., cols, :], groups)
            grad_k[..., cols, :] += _sum_groups(np.swapaxes(grad_s, -1, -2) @ q[..., rows, :],
                                                groups)

    # numpy: the key blocks on the threads, each lane adding into its own dQ (and
    # dbias), summed in lane order: the same bits whatever thread ran a lane
    tasks = [(kv_start, kv_stop, tiles) for (kv_start, kv_stop), tiles in columns.items()]
    tasks.sort(key=lambda task: -len(task[2]))  # most tiles first
    lanes = _threads.run_lanes(tasks, key_block, lambda: (
        np.zeros_like(q), np.zeros(bias.shape, q.dtype) if has_bias else None))
    grad_q, grad_bias = lanes[0] if lanes else (
        np.zeros_like(q), np.zeros(bias.shape, q.dtype) if has_bias else None)
    for lane_q, lane_bias in lanes[1:]:
        grad_q += lane_q
        if has_bias:
            grad_bias += lane_bias
    return grad_q, grad_k, grad_v, grad_bias


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
    fn: str, query: np.ndarray, key: np.ndarray, bias: np.ndarray | None, kv_lengths: Any,
    args: rules.Arguments, mods: _Mods | None = None,
) -> tuple:
    """The full-rank bias, the checked ``kv_lengths`` and the tiles to compute with their band:
    without the tiles ``mods`` mask entirely, and ``partial | 2`` where they mask part."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if kv_lengths is not None:  # the range needs the values: checked here
        kv_lengths = np.asarray(kv_lengths)
        rules.check_lengths(fn, "kv_lengths", kv_lengths.tolist(), kv_len)
    if bias is not None:  # full rank, so tiles slice the last two axes
        bias = bias.reshape((1,) * (len(args.scores_shape) - bias.ndim) + bias.shape)
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
    plan = rules.plan(q_len, kv_len, args.block_q, args.block_kv, lo, hi)
    if kv_lengths is not None and kv_lengths.size:  # key blocks past every length: skipped
        longest = int(kv_lengths.max())
        plan = [(a, b, [t for t in blocks if t[0] < longest]) for a, b, blocks in plan]
    if mods is not None and mods.masks:  # tiles chunks, segment ids or mask_mod empty: skipped
        statuses = _mods_statuses(mods, q_len, kv_len, args.block_q, args.block_kv, lo, hi)
        plan = [(a, b, [(k0, k1, int(part) | (2 if status == rules.SOME else 0))
                        for k0, k1, part in blocks
                        if (status := statuses[a // args.block_q, k0 // args.block_kv])])
                for a, b, blocks in plan]
    return bias, kv_lengths, plan, lo, hi


# ------------------------------------------------------------------------------------------
# Tiles
# ------------------------------------------------------------------------------------------


def _tile_scores(
    q_tile: np.ndarray, k_tile: np.ndarray, groups: int, softcap: float | None
) -> np.ndarray:
    """``(..., heads, bq, head_dim) @ (..., kv_heads, bk, head_dim)ᵀ`` → ``(..., heads, bq, bk)``,
    soft-capped; ``q_tile`` is already scaled."""
    scores = _matmul_grouped(q_tile, np.swapaxes(k_tile, -1, -2), groups)
    return _softcap(scores, softcap)


def _bias_tile(bias: np.ndarray, q_start: int, q_stop: int, kv_start: int, kv_stop: int) -> Any:
    """The tile of a full-rank bias; broadcast (size-1) query or key axes are kept whole."""
    q_slice = slice(q_start, q_stop) if bias.shape[-2] != 1 else slice(None)
    kv_slice = slice(kv_start, kv_stop) if bias.shape[-1] != 1 else slice(None)
    return (..., q_slice, kv_slice)


def _mask_tile(
    scores: np.ndarray,
    bias: np.ndarray | None,
    kv_lengths: np.ndarray | None,
    tile: tuple[int, int, int, int],
    partial: int,
    lo: float,
    hi: float,
    mods: _Mods | None = None,
) -> np.ndarray:
    """Add the bias tile (and ALiBi, then ``score_mod``), then ``-inf`` where the band (bit 1
    of ``partial``), ``kv_lengths`` or ``mods``' rules (bit 2) forbid (in place)."""
    q_start, q_stop, kv_start, kv_stop = tile
    if bias is not None:
        scores += bias[_bias_tile(bias, *tile)].astype(scores.dtype, copy=False)
    scores = _mods_scores(scores, mods, q_start, kv_start)
    if partial & 2:  # chunks, segment ids, mask_mod cut the tile
        allowed = _mods_allowed(mods, q_start, q_stop - q_start, kv_start, kv_stop - kv_start)
        np.copyto(scores, NEG_INF, where=~allowed)
    if partial & 1:  # (bq, bk): j - i inside [lo, hi]
        allowed = _in_band(q_start, q_stop - q_start, kv_start, kv_stop - kv_start, lo, hi)
        np.copyto(scores, NEG_INF, where=~allowed)
    if kv_lengths is not None:  # (batch..., 1, 1, bk): key j < kv_lengths[b]
        lengths = kv_lengths.reshape(kv_lengths.shape + (1,) * (scores.ndim - kv_lengths.ndim))
        np.copyto(scores, NEG_INF, where=np.arange(kv_start, kv_stop) >= lengths)
    return scores
