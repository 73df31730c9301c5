"""Which (query, key) pairs of numpy_attn may attend, and what the mods add to the scores:
everything a mask kind needs. The boolean mask, the causal rule and the window (one band of
distances ``lo <= j - i <= hi``, ``rules.band``): ``_allowed`` for a call, ``_in_band`` for any
tile. The chunks, ALiBi, segment ids, ``score_mod`` and ``mask_mod`` (``spec.MASKS_AND_MODS``):
applied to any tile (``_Mods``, ``_mods_scores``, ``_mods_allowed``), built for a call from its
validated arguments (``_mods``), and planned: the status of every tile under them
(``_mods_statuses``, ``spec.TILE_SKIPPING``), which the tiles, the blockwise functions and the
fast path read to skip what they mask. Nothing here validates: the public functions check their
inputs once, with ``attention_rules``. Imports: ``_arrays`` and ``_threads``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

import attention_rules as rules

from . import _threads
from ._arrays import _describe

NEG_INF = -np.inf  # the score of a position that may not attend


# ------------------------------------------------------------------------------------------
# The boolean mask, the causal rule and the window (one band of distances): a call, a tile
# ------------------------------------------------------------------------------------------


def _allowed(
    q_len: int,
    kv_len: int,
    mask: np.ndarray | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    mods: _Mods | None = None,
) -> np.ndarray | None:
    """AND of the boolean mask, the causal rule, the window and ``mods``' chunks, segment ids
    and ``mask_mod``; None when all are absent."""
    allowed = mask
    if is_causal or window is not None:
        lo, hi = rules.band(q_len, kv_len, is_causal, causal_alignment, window)
        structural = _in_band(0, q_len, 0, kv_len, lo, hi)  # (q_len, kv_len)
        allowed = structural if allowed is None else allowed & structural
    extra = _mods_allowed(mods, 0, q_len, 0, kv_len)
    if extra is not None:
        allowed = extra if allowed is None else allowed & extra
    return allowed


def _in_band(q_start: int, rows: int, kv_start: int, keys: int, lo: float, hi: float) -> np.ndarray:
    """``(rows, keys)`` bool: ``lo <= j - i <= hi`` for queries ``i`` from ``q_start`` and keys
    ``j`` from ``kv_start`` (``rules.band``: the causal rule and the window; ±inf unbounded)."""
    distance = (kv_start + np.arange(keys))[None, :] - (q_start + np.arange(rows))[:, None]
    if lo == NEG_INF:  # numpy: no pass for the unbounded side (the causal rule has no lower)
        return distance <= hi  # (rows, keys)
    return (distance >= lo) & (distance <= hi)  # (rows, keys)


def _outside_band(
    strips: dict, q_start: int, rows: int, kv_start: int, keys: int, lo: float, hi: float
) -> np.ndarray:
    """``~_in_band(...)``: ``(rows, keys)``, True where ``j - i`` is outside the
    band. It depends on ``kv_start - q_start`` and the sizes only, so it is made once per
    geometry and kept in ``strips`` (a dict shared by the workers of one call)."""
    geometry = (kv_start - q_start, rows, keys)
    outside = strips.get(geometry)
    if outside is None:
        outside = ~_in_band(q_start, rows, kv_start, keys, lo, hi)
        strips[geometry] = outside  # two workers may both make it: the same array
    return outside


# ------------------------------------------------------------------------------------------
# Chunks, ALiBi, segment ids, score_mod and mask_mod (spec.MASKS_AND_MODS), for any tile
# ------------------------------------------------------------------------------------------


class _Mods(NamedTuple):
    """The chunk rule, ALiBi, segment ids and the mods of one call, ready for any tile of
    rows ``q0:`` and keys ``k0:`` (``index``: one (batch..., head) entry, or None for all)."""

    fn: str  # the public function, for the messages of what a mod returns
    chunk_size: int | None
    alibi: np.ndarray | None  # (heads,) slopes in the compute dtype
    q_ids: np.ndarray | None  # (..., q_len): the batch axes broadcast
    kv_ids: np.ndarray | None  # (..., kv_len)
    score_mod: Any
    mask_mod: Any
    offset: int  # query i sits at key position i + offset
    batch: tuple[int, ...]  # the leading batch axes
    heads: int | None  # None: 2-D inputs

    @property
    def masks(self) -> bool:
        """Whether a rule here may mask positions (chunks, segment ids, mask_mod)."""
        return self.chunk_size is not None or self.q_ids is not None or self.mask_mod is not None


def _mod_target(mods: _Mods, rows: int, keys: int, index: tuple | None) -> tuple[int, ...]:
    """The shape of the scores of a tile: ``(..., heads, rows, keys)``, or ``(rows, keys)``
    for one entry ``index`` or 2-D inputs."""
    if index is not None or mods.heads is None:
        return rows, keys
    return mods.batch + (mods.heads, rows, keys)


def _mod_indices(mods: _Mods, q0: int, rows: int, k0: int, keys: int, index: tuple | None
                 ) -> tuple[np.ndarray, ...]:
    """``(batch, head, q_idx, kv_idx)`` of a tile (``spec.MOD_INDICES``): int64 arrays
    broadcasting to its scores; 0-d batch and head for one entry ``index``."""
    q_idx = (q0 + np.arange(rows))[:, None]  # (rows, 1)
    kv_idx = k0 + np.arange(keys)  # (keys,)
    if mods.heads is None:
        return np.zeros((), np.int64), np.zeros((), np.int64), q_idx, kv_idx
    if index is not None:
        flat = int(np.ravel_multi_index(index[:-1], mods.batch)) if mods.batch else 0
        return np.asarray(flat), np.asarray(index[-1]), q_idx, kv_idx
    size = int(np.prod(mods.batch, dtype=np.int64))
    batch = np.arange(size).reshape(mods.batch + (1, 1, 1)) if mods.batch else np.zeros((),
                                                                                       np.int64)
    return batch, np.arange(mods.heads).reshape(mods.heads, 1, 1), q_idx, kv_idx


def _add_alibi(scores: np.ndarray, mods: _Mods | None, q0: int, k0: int,
               index: tuple | None = None) -> np.ndarray:
    """``scores (..., heads, rows, keys)`` minus ``slope_h · |i + offset - j|`` (in place)."""
    if mods is None or mods.alibi is None:
        return scores
    rows, keys = scores.shape[-2:]
    distance = np.abs((q0 + mods.offset + np.arange(rows))[:, None] - (k0 + np.arange(keys)))
    if mods.heads is None:
        slopes = mods.alibi[0]
    elif index is not None:
        slopes = mods.alibi[index[-1]]
    else:
        slopes = mods.alibi[:, None, None]  # (heads, 1, 1)
    scores -= (slopes * distance).astype(scores.dtype, copy=False)
    return scores


def _mods_scores(scores: np.ndarray, mods: _Mods | None, q0: int, k0: int,
                 index: tuple | None = None) -> np.ndarray:
    """ALiBi, then ``score_mod``, on a tile of scores (rows from ``q0``, keys from ``k0``);
    in place where it can (numpy: ``score_mod``'s result is copied in)."""
    scores = _add_alibi(scores, mods, q0, k0, index)
    if mods is None or mods.score_mod is None:
        return scores
    rows, keys = scores.shape[-2:]
    result = mods.score_mod(scores, *_mod_indices(mods, q0, rows, k0, keys, index))
    _check_result(mods.fn, "score_mod", result, scores.shape)
    scores[...] = result  # broadcast, in the compute dtype
    return scores


def _mods_allowed(mods: _Mods | None, q0: int, rows: int, k0: int, keys: int,
                  index: tuple | None = None) -> np.ndarray | None:
    """Bool, broadcastable to the tile's scores: the chunk rule, the segment ids and
    ``mask_mod`` on rows ``q0:q0 + rows`` and keys ``k0:k0 + keys``; None when none is
    given."""
    if mods is None or not mods.masks:
        return None
    allowed = None
    if mods.chunk_size is not None:  # (q + offset) // C == k // C, floor division
        c = mods.chunk_size
        allowed = ((q0 + mods.offset + np.arange(rows))[:, None] // c) == ((k0 + np.arange(keys))
                                                                            // c)
    if mods.q_ids is not None:
        q_ids = mods.q_ids[..., q0 : q0 + rows]
        kv_ids = mods.kv_ids[..., k0 : k0 + keys]
        if index is not None:
            q_ids, kv_ids = q_ids[index[:-1]], kv_ids[index[:-1]]
        same = q_ids[..., :, None] == kv_ids[..., None, :]  # (..., rows, keys)
        if index is None and mods.heads is not None:
            same = same[..., None, :, :]  # (..., 1, rows, keys): every head
        allowed = same if allowed is None else allowed & same
    if mods.mask_mod is not None:
        result = mods.mask_mod(*_mod_indices(mods, q0, rows, k0, keys, index))
        _check_result(mods.fn, "mask_mod", result, _mod_target(mods, rows, keys, index))
        result = np.asarray(result)
        allowed = result if allowed is None else allowed & result
    return allowed


def _check_result(fn: str, name: str, result: Any, target: tuple[int, ...]) -> None:
    """What a mod returned, against the scores ``target`` (``rules.check_mod_result``)."""
    shape = tuple(result.shape) if isinstance(result, np.ndarray) else None
    dtype = result.dtype.name if isinstance(result, np.ndarray) else type(result).__name__
    rules.check_mod_result(fn, name, shape, dtype, target)


# ------------------------------------------------------------------------------------------
# A call's chunks, ALiBi, segment ids and mods, built; its tiles planned (spec.TILE_SKIPPING)
# ------------------------------------------------------------------------------------------


def _mods(
    fn: str, args: rules.Arguments, q_shape: tuple[int, ...], k_shape: tuple[int, ...],
    alibi: Any, segments: tuple[Any, Any] | None,
) -> _Mods | None:
    """The call's ``_Mods`` from validated arguments (None when it has none): ``alibi`` the
    slopes or None, ``segments`` the query and key ids or None."""
    if not args.has_mods:
        return None
    batch = tuple(q_shape[:-3])
    compute = rules.compute_dtype(args.dtype)
    q_ids = kv_ids = None
    if segments is not None:
        q_ids = np.broadcast_to(np.asarray(segments[0]), batch + (q_shape[-2],))
        kv_ids = np.broadcast_to(np.asarray(segments[1]), batch + (k_shape[-2],))
    alibi = None if alibi is None else np.asarray(alibi).astype(compute)
    offset = rules.causal_offset(args.causal_alignment, q_shape[-2], k_shape[-2])
    heads = q_shape[-3] if len(q_shape) >= 3 else None
    return _Mods(fn, args.chunk_size, alibi, q_ids, kv_ids, args.score_mod, args.mask_mod,
                 offset, batch, heads)


def _describe_segments(fn: str, segment_ids: Any) -> tuple | None:
    """``segment_ids`` (one array or a pair) as the rules see it: ``(query ids, key ids,
    one)``, each ``(shape, dtype name)``."""
    return rules.describe_segment_ids(fn, segment_ids, _describe)



def _mods_slope(pre: np.ndarray, mods: _Mods, q0: int, k0: int,
                index: tuple | None = None) -> np.ndarray:
    """``d score_mod / d score`` at the scores before it, ``pre`` (its ``derivative``)."""
    rows, keys = pre.shape[-2:]
    slope = mods.score_mod.derivative(pre, *_mod_indices(mods, q0, rows, k0, keys, index))
    _check_result(mods.fn, "score_mod", slope, pre.shape)
    return slope


def _mods_statuses(mods: _Mods, q_len: int, kv_len: int, block_q: int, block_kv: int,
                   lo: float, hi: float, per_entry: bool = False) -> np.ndarray:
    """``rules.NONE`` / ``SOME`` / ``ALL`` of every ``(block_q, block_kv)`` tile under the band
    and ``mods``' rules: ``(n_q_blocks, n_kv_blocks)`` uint8, or with ``per_entry``
    ``(..., heads, n_q_blocks, n_kv_blocks)`` (size 1 where no rule varies). The chunk rule is
    arithmetic; segment ids and ``mask_mod`` are evaluated on every row of query blocks, over
    the keys the band and the chunks leave (``spec.TILE_SKIPPING``)."""
    base = np.array(rules.structural_statuses(q_len, kv_len, block_q, block_kv, lo, hi,
                                              mods.offset, mods.chunk_size), np.uint8)
    base = base.reshape(base.shape[0], -1)  # (n_q_blocks, n_kv_blocks), also when empty
    lead = (mods.batch + (mods.heads,)) if mods.heads is not None else ()
    if mods.q_ids is None and mods.mask_mod is None:
        return base.reshape((1,) * len(lead) + base.shape) if per_entry else base
    statuses = np.zeros(lead + base.shape, np.uint8)

    def row(r: int, scratch: None) -> None:  # one block of query rows: its own statuses row
        q0, kept = r * block_q, np.flatnonzero(base[r])
        if not kept.size:
            return
        q1, blocks = min(q0 + block_q, q_len), int(kept[-1]) - int(kept[0]) + 1
        k0, k1 = int(kept[0]) * block_kv, min((int(kept[-1]) + 1) * block_kv, kv_len)
        allowed = _mods_allowed(mods, q0, q1 - q0, k0, k1 - k0)  # (..., rows, keys)
        if lo > NEG_INF or hi < np.inf:
            allowed = allowed & _in_band(q0, q1 - q0, k0, k1 - k0, lo, hi)
        allowed = np.broadcast_to(allowed, allowed.shape[:-2] + (q1 - q0, k1 - k0))
        if k1 - k0 < blocks * block_kv:  # by key blocks: padded with False to whole blocks
            padded = np.zeros(allowed.shape[:-1] + (blocks * block_kv,), bool)
            padded[..., : k1 - k0] = allowed
            allowed = padded
        counts = np.count_nonzero(allowed.reshape(allowed.shape[:-1] + (blocks, block_kv)),
                                  axis=(-3, -1))  # (..., blocks)
        starts = np.arange(int(kept[0]), int(kept[-1]) + 1) * block_kv
        sizes = (q1 - q0) * (np.minimum(starts + block_kv, kv_len) - starts)
        statuses[..., r, kept[0] : kept[-1] + 1] = np.where(
            counts == sizes, rules.ALL, np.where(counts > 0, rules.SOME, rules.NONE))

    # numpy: the blocks of rows on the threads (each writes its own row of statuses)
    _threads.run_lanes([(r,) for r in range(base.shape[0])], row, lambda: None)
    if per_entry:
        return statuses
    axes = tuple(range(len(lead)))
    some, every = (statuses > 0).any(axis=axes), (statuses == rules.ALL).all(axis=axes)
    return np.where(every, rules.ALL, np.where(some, rules.SOME, rules.NONE)).astype(np.uint8)


def _entry(statuses: np.ndarray, index: tuple[int, ...]) -> np.ndarray:
    """The ``(q blocks, key blocks)`` statuses of one (batch..., head) ``index`` from
    ``_mods_statuses(..., per_entry=True)`` (whose size-1 axes hold for every entry)."""
    lead = statuses.shape[:-2]
    return statuses[tuple(0 if size == 1 else i for i, size in zip(index, lead, strict=True))]
