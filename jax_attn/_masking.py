"""Which (query, key) pairs may attend, on any tile: the band of the causal rule and the window
(``_in_band``, ``_allowed``), and a call's chunks, ALiBi, segment ids, ``score_mod`` and
``mask_mod`` (``spec.MASKS_AND_MODS``) applied to a tile (``_Mods``, ``_mods_scores``,
``_mods_allowed``: the mask step of ``_steps.py`` and every tile need them), built from its
validated arguments (``_mods``, one item's ``_mods_item``, the segment ids), and planned: the
statuses and static segments of its tiles under them (``spec.TILE_SKIPPING``, decided at trace
time). Everything a mask kind needs lives here; nothing here validates. Imports run one way:
``_arrays < _masking < _steps < _tiles < _fast`` (see ``_arrays.py``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules

from ._arrays import _describe, _dtype_name

# ------------------------------------------------------------------------------------------
# The band: the causal rule and the window (rules.band), on any tile
# ------------------------------------------------------------------------------------------


def _allowed(
    q_len: int,
    kv_len: int,
    mask: jax.Array | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    mods: _Mods | None = None,
) -> jax.Array | None:
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


def _in_band(q_start: int, rows: int, kv_start: int, keys: int, lo: float, hi: float) -> jax.Array:
    """``(rows, keys)`` bool: ``lo <= j - i <= hi`` for queries ``i`` from ``q_start`` and keys
    ``j`` from ``kv_start`` (``rules.band``: the causal rule and the window; ±inf unbounded)."""
    distance = (kv_start + jnp.arange(keys, dtype=jnp.int32))[None, :] - (
        q_start + jnp.arange(rows, dtype=jnp.int32))[:, None]  # jax: starts may be traced
    return (distance >= lo) & (distance <= hi)  # (rows, keys)


# ------------------------------------------------------------------------------------------
# Chunks, ALiBi, segment ids, score_mod and mask_mod (spec.MASKS_AND_MODS), for any tile
# ------------------------------------------------------------------------------------------


class _Mods(NamedTuple):
    """The chunk rule, ALiBi, segment ids and the mods of one call, ready for any tile of
    rows ``q0:`` and keys ``k0:`` (the starts may be traced). jax: never handed to a JAX
    transformation as is (its strings and callables are no arrays): the custom VJPs take its
    ``arrays`` and rebuild it (``_mods``)."""

    fn: str  # the public function, for the messages of what a mod returns
    chunk_size: int | None
    alibi: jax.Array | None  # (heads,) slopes in the compute dtype, without gradient
    q_ids: jax.Array | None  # (..., q_len): the batch axes broadcast
    kv_ids: jax.Array | None  # (..., kv_len)
    score_mod: Any
    mask_mod: Any
    offset: int  # query i sits at key position i + offset
    batch: tuple[int, ...]  # the leading batch axes
    heads: int | None  # None: 2-D inputs
    item: tuple | None = None  # (flat batch index, first head): one item of the fast path

    @property
    def masks(self) -> bool:
        """Whether a rule here may mask positions (chunks, segment ids, mask_mod)."""
        return self.chunk_size is not None or self.q_ids is not None or self.mask_mod is not None

    @property
    def arrays(self) -> tuple:
        """``(alibi, q_ids, kv_ids)``: what a custom VJP takes (and ``_mods`` rebuilds from)."""
        return self.alibi, self.q_ids, self.kv_ids


def _mod_target(mods: _Mods, rows: int, keys: int) -> tuple[int, ...]:
    """The shape of the scores of a tile: ``(..., heads, rows, keys)`` (``(rows, keys)`` for
    2-D inputs)."""
    return (rows, keys) if mods.heads is None else mods.batch + (mods.heads, rows, keys)


def _mod_indices(mods: _Mods, q0: Any, rows: int, k0: Any, keys: int) -> tuple[jax.Array, ...]:
    """``(batch, head, q_idx, kv_idx)`` of a tile (``spec.MOD_INDICES``): int32 arrays
    broadcasting to its scores (the starts may be traced)."""
    q_idx = (q0 + jnp.arange(rows, dtype=jnp.int32))[:, None]  # (rows, 1)
    kv_idx = k0 + jnp.arange(keys, dtype=jnp.int32)  # (keys,)
    zero = jnp.zeros((), jnp.int32)
    if mods.heads is None:
        return zero, zero, q_idx, kv_idx
    if mods.item is not None:  # one (batch, kv head) item: its batch entry and query heads
        heads = mods.item[1] + jnp.arange(mods.heads, dtype=jnp.int32)
        return mods.item[0], heads.reshape(mods.heads, 1, 1), q_idx, kv_idx
    size = math.prod(mods.batch)
    batch = jnp.arange(size, dtype=jnp.int32).reshape(mods.batch + (1, 1, 1)) if mods.batch \
        else zero
    return batch, jnp.arange(mods.heads, dtype=jnp.int32).reshape(mods.heads, 1, 1), q_idx, kv_idx


def _add_alibi(scores: jax.Array, mods: _Mods | None, q0: Any, k0: Any) -> jax.Array:
    """``scores (..., heads, rows, keys)`` minus ``slope_h · |i + offset - j|``."""
    if mods is None or mods.alibi is None:
        return scores
    rows, keys = scores.shape[-2:]
    distance = jnp.abs((q0 + mods.offset + jnp.arange(rows, dtype=jnp.int32))[:, None]
                       - (k0 + jnp.arange(keys, dtype=jnp.int32)))
    slopes = mods.alibi[0] if mods.heads is None else mods.alibi[:, None, None]
    return scores - (slopes * distance).astype(scores.dtype)


def _mods_scores(scores: jax.Array, mods: _Mods | None, q0: Any, k0: Any) -> jax.Array:
    """ALiBi, then ``score_mod``, on a tile of scores (rows from ``q0``, keys from ``k0``);
    differentiable (autodiff through ``score_mod``)."""
    scores = _add_alibi(scores, mods, q0, k0)
    if mods is None or mods.score_mod is None:
        return scores
    rows, keys = scores.shape[-2:]
    result = mods.score_mod(scores, *_mod_indices(mods, q0, rows, k0, keys))
    _check_result(mods.fn, "score_mod", result, scores.shape)
    return jnp.broadcast_to(result, scores.shape).astype(scores.dtype)


def _mods_allowed(mods: _Mods | None, q0: Any, rows: int, k0: Any, keys: int,
                  parts: tuple[str, ...] = ("chunks", "ids", "mask_mod")) -> jax.Array | None:
    """Bool, broadcastable to the tile's scores: the chunk rule, the segment ids and
    ``mask_mod`` (those of ``parts``) on rows ``q0:q0 + rows`` and keys ``k0:k0 + keys``;
    None when none is given."""
    if mods is None or not mods.masks:
        return None
    allowed = None
    if mods.chunk_size is not None and "chunks" in parts:  # floor division, as the spec's
        c = mods.chunk_size
        allowed = ((q0 + mods.offset + jnp.arange(rows, dtype=jnp.int32))[:, None] // c) == (
            (k0 + jnp.arange(keys, dtype=jnp.int32)) // c)
    if mods.q_ids is not None and "ids" in parts:
        q_ids = jax.lax.dynamic_slice_in_dim(mods.q_ids, q0, rows, axis=mods.q_ids.ndim - 1)
        kv_ids = jax.lax.dynamic_slice_in_dim(mods.kv_ids, k0, keys, axis=mods.kv_ids.ndim - 1)
        same = q_ids[..., :, None] == kv_ids[..., None, :]  # (..., rows, keys)
        if mods.heads is not None:
            same = same[..., None, :, :]  # (..., 1, rows, keys): every head
        allowed = same if allowed is None else allowed & same
    if mods.mask_mod is not None and "mask_mod" in parts:
        result = mods.mask_mod(*_mod_indices(mods, q0, rows, k0, keys))
        _check_result(mods.fn, "mask_mod", result, _mod_target(mods, rows, keys))
        allowed = result if allowed is None else allowed & result
    return allowed


def _check_result(fn: str, name: str, result: Any, target: tuple[int, ...]) -> None:
    """What a mod returned, against the scores ``target`` (``rules.check_mod_result``)."""
    shape = tuple(result.shape) if hasattr(result, "shape") and hasattr(result, "dtype") \
        else None
    dtype = _dtype_name(result) if shape is not None else type(result).__name__
    rules.check_mod_result(fn, name, shape, dtype, target)


# ------------------------------------------------------------------------------------------
# A call's chunks, ALiBi, segment ids and mods (spec.MASKS_AND_MODS), built; its tiles planned
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
    q_ids = kv_ids = None
    if segments is not None and segments[0] is not None:
        q_ids = jnp.broadcast_to(jnp.asarray(segments[0]), batch + (q_shape[-2],))
        kv_ids = jnp.broadcast_to(jnp.asarray(segments[1]), batch + (k_shape[-2],))
    if alibi is not None:  # constants: no gradient reaches the slopes (spec.ALIBI)
        alibi = jax.lax.stop_gradient(jnp.asarray(alibi).astype(rules.compute_dtype(args.dtype)))
    offset = rules.causal_offset(args.causal_alignment, q_shape[-2], k_shape[-2])
    heads = q_shape[-3] if len(q_shape) >= 3 else None
    return _Mods(fn, args.chunk_size, alibi, q_ids, kv_ids, args.score_mod, args.mask_mod,
                 offset, batch, heads)


def _mods_item(mods: _Mods, item: jax.Array, kv_heads: int, groups: int) -> _Mods:
    """``mods`` for one (batch, kv head) item of the blocked fast path (``item`` traced, in
    the order of ``_to_items``): its ``groups`` query heads' slopes, its batch entry's
    ids, and the indices ``_mod_indices`` gives its tiles."""
    batch, first = item // kv_heads, (item % kv_heads) * groups
    alibi = None if mods.alibi is None else jax.lax.dynamic_slice_in_dim(mods.alibi, first,
                                                                         groups)
    q_ids = kv_ids = None
    if mods.q_ids is not None:
        q_ids = mods.q_ids.reshape((-1,) + mods.q_ids.shape[-1:])[batch]
        kv_ids = mods.kv_ids.reshape((-1,) + mods.kv_ids.shape[-1:])[batch]
    return mods._replace(alibi=alibi, q_ids=q_ids, kv_ids=kv_ids, batch=(), heads=groups,
                         item=(batch, first))


def _mods_capture_tracers(args: rules.Arguments) -> bool:
    """Whether ``score_mod`` captures a tracer (``rules.mods.captures``): a traced array may
    be differentiated, and only the explicit steps, plain autodiff, give it its gradient
    (spec.SCORE_MOD); the blocked path's ``custom_vjp`` cannot close over it. A ``mask_mod``'s
    arrays get no gradient (its result is boolean): it keeps the blocked path."""
    return rules.mods.captures(args.score_mod, _is_tracer)


def _is_tracer(value: object) -> bool:
    return isinstance(value, jax.core.Tracer)


def _describe_segments(fn: str, segment_ids: Any) -> tuple | None:
    """``segment_ids`` (one array or a pair) as the rules see it: ``(query ids, key ids,
    one)``, each ``(shape, dtype name)``."""
    return rules.describe_segment_ids(fn, segment_ids, _describe)



def _mods_statuses(mods: _Mods, q_len: int, kv_len: int, block_q: int, block_kv: int,
                   lo: float, hi: float) -> np.ndarray:
    """``rules.NONE`` / ``SOME`` / ``ALL`` of every ``(block_q, block_kv)`` tile under the band
    and ``mods``' rules, ``(n_q_blocks, n_kv_blocks)`` uint8, at trace time: the chunk rule is
    arithmetic; segment ids and ``mask_mod`` are evaluated (``jax.ensure_compile_time_eval``)
    where their values are known at trace time, and count as allowing everything where they
    are traced (their tiles are then masked, not skipped: ``spec.TILE_SKIPPING``)."""
    base = np.array(rules.structural_statuses(q_len, kv_len, block_q, block_kv, lo, hi,
                                              mods.offset, mods.chunk_size), np.uint8)
    base = base.reshape(base.shape[0], -1)  # (n_q_blocks, n_kv_blocks), also when empty
    parts = tuple(p for p, given in (("ids", mods.q_ids is not None),
                                     ("mask_mod", mods.mask_mod is not None)) if given)
    if not parts:
        return base
    statuses = base.copy()
    for r, q0 in enumerate(range(0, q_len, block_q)):
        q1, kept = min(q0 + block_q, q_len), np.flatnonzero(base[r])
        if not kept.size:
            continue
        k0, k1 = int(kept[0]) * block_kv, min((int(kept[-1]) + 1) * block_kv, kv_len)
        allowed = _in_band_np(q0, q1 - q0, k0, k1 - k0, lo, hi)  # (rows, keys)
        with jax.ensure_compile_time_eval():
            for part in parts + ("chunks",):
                value = _mods_allowed(mods, q0, q1 - q0, k0, k1 - k0, (part,))
                if value is None or isinstance(value, jax.core.Tracer):
                    continue  # not given, or traced: unknown at trace time
                allowed = allowed & np.asarray(value)
        blocks = int(kept[-1]) - int(kept[0]) + 1
        padded = np.zeros(allowed.shape[:-1] + (blocks * block_kv,), bool)
        padded[..., : k1 - k0] = allowed
        padded = padded.reshape((-1,) + padded.shape[-2:-1] + (blocks, block_kv))
        counts = np.count_nonzero(padded, axis=(0, 1, 3))  # over batch, heads, rows, keys
        starts = np.arange(int(kept[0]), int(kept[-1]) + 1) * block_kv
        sizes = padded.shape[0] * (q1 - q0) * (np.minimum(starts + block_kv, kv_len) - starts)
        statuses[r, kept[0] : kept[-1] + 1] = np.where(
            counts == sizes, rules.ALL, np.where(counts > 0, rules.SOME, rules.NONE))
    return statuses


def _mods_segments(mods: _Mods, q_len: int, kv_len: int, lo: float, hi: float,
                   by_queries: bool, block_q: int, block_kv: int, limit: int
                   ) -> list[tuple[int, int, int, int]]:
    """Static segments of the blocked fast path for the chunk rule, segment ids and
    ``mask_mod`` (with the band), from the statuses of its ``(block_q, block_kv)`` tiles
    (``_mods_statuses``, at trace time): ``by_queries``, ``(r0, r1, k0, k1)``: query rows and
    the keys any of them sees; else ``(c0, c1, r0, r1)``: keys and the rows that see any of
    them. Blocks seeing the same range form one segment; at most ``limit`` (neighbours merged
    where that adds the fewest products), so the tiles the rules empty are mostly not
    computed."""
    statuses = _mods_statuses(mods, q_len, kv_len, block_q, block_kv, lo, hi)
    if not by_queries:
        statuses = statuses.T
    size, other_size = (block_q, block_kv) if by_queries else (block_kv, block_q)
    length, other = (q_len, kv_len) if by_queries else (kv_len, q_len)
    pieces = []  # [start, stop, lo, hi): the blocks' own ranges
    for b, row in enumerate(statuses):
        seen = np.flatnonzero(row)
        a, z = (int(seen[0]) * other_size, min((int(seen[-1]) + 1) * other_size, other)) \
            if seen.size else (0, 0)
        start, stop = b * size, min((b + 1) * size, length)
        if pieces and pieces[-1][2:] == [a, z]:
            pieces[-1][1] = stop
        else:
            pieces.append([start, stop, a, z])

    def merged(x: list, y: list) -> list:
        if x[3] > x[2] and y[3] > y[2]:
            return [x[0], y[1], min(x[2], y[2]), max(x[3], y[3])]
        return [x[0], y[1]] + (x[2:] if x[3] > x[2] else y[2:])

    def cost(piece: list) -> int:
        return (piece[1] - piece[0]) * (piece[3] - piece[2])

    while len(pieces) > limit:  # merge the neighbours that add the fewest products
        i = min(range(len(pieces) - 1), key=lambda i: cost(merged(pieces[i], pieces[i + 1]))
                - cost(pieces[i]) - cost(pieces[i + 1]))
        pieces[i : i + 2] = [merged(pieces[i], pieces[i + 1])]
    return [tuple(piece) for piece in pieces]


def _in_band_np(q_start: int, rows: int, kv_start: int, keys: int, lo: float, hi: float
                ) -> np.ndarray:
    """``_in_band`` in NumPy, for the plans made at trace time."""
    distance = (kv_start + np.arange(keys))[None, :] - (q_start + np.arange(rows))[:, None]
    return (distance >= lo) & (distance <= hi)
