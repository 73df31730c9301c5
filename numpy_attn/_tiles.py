"""The engine of numpy_attn's tiles, unchecked: ``forward_tiles``, the online softmax over the
tiles of a plan, and ``backward_tiles``, FlashAttention's backward per tile from the saved
log-sum-exp (``blockwise.py`` explains both and validates; ``context_blocks.py`` runs them on
pairs of chunks), with the scores, bias and masks of one tile.

Both passes run on numpy_attn's threads (``_threads.run_lanes``, BLAS in one thread per
worker): the forward pass one query block per task (its output rows are its own), the backward
pass one key block per task (its ``dK`` and ``dV`` rows are its own; each worker adds ``dQ``
into its own copy, and the copies are added at the end), so no two threads write the same
entry.

Imports: ``_arrays``, ``_masking``, ``_steps`` and ``_threads``; ``blockwise.py`` and
``context_blocks.py`` run it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _threads
from ._arrays import _groups, _to_compute
from ._masking import NEG_INF, _add_alibi, _in_band, _Mods, _mods_allowed, _mods_scores, _mods_slope
from ._steps import _matmul_grouped, _softcap, _sum_groups, _sum_to_shape

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
      mods: chunks, ALiBi, segment ids and the mods (``_masking._mods``), or None; a tile whose
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
            if mod_slope is not None:  # through score_mod; 0 where P is 0 (masked), even NaN
                np.multiply(grad_s, mod_slope, out=grad_s, where=p != 0.0)
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
