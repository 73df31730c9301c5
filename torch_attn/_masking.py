"""Which (query, key) pairs may attend, in torch_attn: everything a mask kind needs.

* The band of the causal rule and the window (``rules.band``: ``lo <= j - i <= hi``) on any
  tile (``_in_band``), and for a whole call with the boolean mask and the rules below
  (``_allowed``).
* A call's chunks, ALiBi, segment ids, ``score_mod`` and ``mask_mod``
  (``spec.MASKS_AND_MODS``, held by ``_Mods``): applied to any tile of rows ``q0:`` and keys
  ``k0:`` (``_mods_scores``, ``_mods_allowed``), built from the call's validated arguments on
  the inputs' device (``_mods``), and planned: the statuses of the tiles under
  them (``_mods_statuses``, ``_plan_with_mods``; ``spec.TILE_SKIPPING``). torch only:
  ``_mods_plan`` also finds which runs of tiles are SDPA's causal triangle, for the fast
  path's ``"sdpa_blocks"`` (``_fast/blocks.py``).

The mask step that puts ``-inf`` where these forbid is ``_steps._mask_scores`` (per tile,
``_tiles._mask_tile``). Nothing here validates. Imports only ``_arrays`` (the ladder:
``_arrays.py``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

import attention_rules as rules

from ._arrays import _as_tensor, _describe, _dtype_name

# ------------------------------------------------------------------------------------------
# The band: the causal rule and the window (rules.band), with the mask and the rules below
# ------------------------------------------------------------------------------------------


def _allowed(
    q_len: int,
    kv_len: int,
    mask: torch.Tensor | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    device: torch.device | None = None,
    mods: _Mods | None = None,
) -> torch.Tensor | None:
    """AND of the boolean mask, the causal rule, the window and ``mods``' chunks, segment ids
    and ``mask_mod``; None when all are absent."""
    allowed = None if mask is None else mask.to(device)  # torch: built on the inputs' device
    if is_causal or window is not None:
        lo, hi = rules.band(q_len, kv_len, is_causal, causal_alignment, window)
        structural = _in_band(0, q_len, 0, kv_len, lo, hi, device)  # (q_len, kv_len)
        allowed = structural if allowed is None else allowed & structural
    extra = _mods_allowed(mods, 0, q_len, 0, kv_len)
    if extra is not None:
        allowed = extra if allowed is None else allowed & extra
    return allowed


def _in_band(
    q_start: int, rows: int, kv_start: int, keys: int, lo: float, hi: float,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``(rows, keys)`` bool: ``lo <= j - i <= hi`` for queries ``i`` from ``q_start`` and keys
    ``j`` from ``kv_start`` (``rules.band``: the causal rule and the window; ±inf unbounded)."""
    distance = (kv_start + torch.arange(keys, device=device))[None, :] - (
        q_start + torch.arange(rows, device=device))[:, None]  # torch: on the scores' device
    # torch: an int64 tensor against a Python float (±inf) is compared in floating point, many
    # times slower; the bounded sides are ints, the unbounded ones need no comparison
    allowed = distance >= int(lo) if math.isfinite(lo) else None
    if math.isfinite(hi):
        allowed = distance <= int(hi) if allowed is None else allowed & (distance <= int(hi))
    return torch.ones_like(distance, dtype=torch.bool) if allowed is None else allowed


# ------------------------------------------------------------------------------------------
# Chunks, ALiBi, segment ids, score_mod and mask_mod (spec.MASKS_AND_MODS), for any tile
# ------------------------------------------------------------------------------------------


class _Mods(NamedTuple):
    """The chunk rule, ALiBi, segment ids and the mods of one call, ready for any tile of
    rows ``q0:`` and keys ``k0:``, on the inputs' device."""

    fn: str  # the public function, for the messages of what a mod returns
    chunk_size: int | None
    alibi: torch.Tensor | None  # (heads,) slopes in the compute dtype, detached
    q_ids: torch.Tensor | None  # (..., q_len): the batch axes broadcast
    kv_ids: torch.Tensor | None  # (..., kv_len)
    score_mod: Any
    mask_mod: Any
    offset: int  # query i sits at key position i + offset
    batch: tuple[int, ...]  # the leading batch axes
    heads: int | None  # None: 2-D inputs
    device: Any  # the inputs' device

    @property
    def masks(self) -> bool:
        """Whether a rule here may mask positions (chunks, segment ids, mask_mod)."""
        return self.chunk_size is not None or self.q_ids is not None or self.mask_mod is not None


def _mod_target(mods: _Mods, rows: int, keys: int) -> tuple[int, ...]:
    """The shape of the scores of a tile: ``(..., heads, rows, keys)`` (``(rows, keys)`` for
    2-D inputs)."""
    return (rows, keys) if mods.heads is None else mods.batch + (mods.heads, rows, keys)


def _mod_indices(mods: _Mods, q0: int, rows: int, k0: int, keys: int
                 ) -> tuple[torch.Tensor, ...]:
    """``(batch, head, q_idx, kv_idx)`` of a tile (``spec.MOD_INDICES``): int64 tensors on the
    inputs' device, broadcasting to its scores."""
    like = {"device": mods.device, "dtype": torch.int64}
    q_idx = (q0 + torch.arange(rows, **like))[:, None]  # (rows, 1)
    kv_idx = k0 + torch.arange(keys, **like)  # (keys,)
    zero = torch.zeros((), **like)
    if mods.heads is None:
        return zero, zero, q_idx, kv_idx
    batch = torch.arange(math.prod(mods.batch), **like).reshape(mods.batch + (1, 1, 1)) \
        if mods.batch else zero
    return batch, torch.arange(mods.heads, **like).reshape(mods.heads, 1, 1), q_idx, kv_idx


def _add_alibi(scores: torch.Tensor, mods: _Mods | None, q0: int, k0: int) -> torch.Tensor:
    """``scores (..., heads, rows, keys)`` minus ``slope_h · |i + offset - j|`` (out of place)."""
    if mods is None or mods.alibi is None:
        return scores
    rows, keys = scores.shape[-2:]
    device = scores.device
    distance = ((q0 + mods.offset + torch.arange(rows, device=device))[:, None]
                - (k0 + torch.arange(keys, device=device))).abs()
    slopes = mods.alibi[0] if mods.heads is None else mods.alibi[:, None, None]
    return scores - (slopes.to(device) * distance).to(scores.dtype)


def _mods_scores(scores: torch.Tensor, mods: _Mods | None, q0: int, k0: int) -> torch.Tensor:
    """ALiBi, then ``score_mod``, on a tile of scores (rows from ``q0``, keys from ``k0``);
    out of place, so autograd runs through ``score_mod``."""
    scores = _add_alibi(scores, mods, q0, k0)
    if mods is None or mods.score_mod is None:
        return scores
    rows, keys = scores.shape[-2:]
    result = mods.score_mod(scores, *_mod_indices(mods, q0, rows, k0, keys))
    _check_result(mods.fn, "score_mod", result, tuple(scores.shape))
    result = result.to(scores.dtype)
    return result if result.shape == scores.shape else result.expand(scores.shape).clone()


def _mods_allowed(mods: _Mods | None, q0: int, rows: int, k0: int, keys: int,
                  parts: tuple[str, ...] = ("chunks", "ids", "mask_mod")
                  ) -> torch.Tensor | None:
    """Bool, broadcastable to the tile's scores: the chunk rule, the segment ids and
    ``mask_mod`` (those of ``parts``) on rows ``q0:q0 + rows`` and keys ``k0:k0 + keys``;
    None when none is given."""
    if mods is None or not mods.masks:
        return None
    allowed = None
    if mods.chunk_size is not None and "chunks" in parts:  # floor division, as the spec's
        c, like = mods.chunk_size, {"device": mods.device}
        allowed = torch.div((q0 + mods.offset + torch.arange(rows, **like))[:, None], c,
                            rounding_mode="floor") == torch.div(k0 + torch.arange(keys, **like),
                                                                c, rounding_mode="floor")
    if mods.q_ids is not None and "ids" in parts:
        same = mods.q_ids[..., q0 : q0 + rows, None] == mods.kv_ids[..., None, k0 : k0 + keys]
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
    tensor = isinstance(result, torch.Tensor)
    shape = tuple(result.shape) if tensor else None
    dtype = _dtype_name(result) if tensor else type(result).__name__
    rules.check_mod_result(fn, name, shape, dtype, target)


# ------------------------------------------------------------------------------------------
# A call's chunks, ALiBi, segment ids and mods, built from its validated arguments
# ------------------------------------------------------------------------------------------


def _mods(
    fn: str, args: rules.Arguments, query: torch.Tensor, key: torch.Tensor, alibi: Any,
    segments: tuple[Any, Any] | None,
) -> _Mods | None:
    """The call's ``_Mods`` from validated arguments (None when it has none), on the query's
    device: ``alibi`` the slopes or None, ``segments`` the query and key ids or None."""
    if not args.has_mods:
        return None
    q_shape, k_shape, device = tuple(query.shape), tuple(key.shape), query.device
    batch = q_shape[:-3]
    q_ids = kv_ids = None
    if segments is not None:
        q_ids = _as_tensor(segments[0], device).broadcast_to(batch + (q_shape[-2],))
        kv_ids = _as_tensor(segments[1], device).broadcast_to(batch + (k_shape[-2],))
    if alibi is not None:  # constants: no gradient reaches the slopes (spec.ALIBI)
        alibi = _as_tensor(alibi, device).detach().to(getattr(torch, rules.compute_dtype(
            args.dtype)))
    offset = rules.causal_offset(args.causal_alignment, q_shape[-2], k_shape[-2])
    heads = q_shape[-3] if len(q_shape) >= 3 else None
    return _Mods(fn, args.chunk_size, alibi, q_ids, kv_ids, args.score_mod, args.mask_mod,
                 offset, batch, heads, device)


def _mods_capture_grads(args: rules.Arguments) -> bool:
    """Whether ``score_mod`` captures a tensor that requires grad, under grad mode
    (``rules.mods.captures``): then only the explicit steps, plain autograd, give it its
    gradient (spec.SCORE_MOD); the fast paths' Function would leave it None. A ``mask_mod``'s
    arrays get no gradient (its result is boolean)."""
    if not torch.is_grad_enabled() or args.score_mod is None:
        return False
    return rules.mods.captures(args.score_mod, _requires_grad)


def _requires_grad(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _describe_segments(fn: str, segment_ids: Any) -> tuple | None:
    """``segment_ids`` (one array or a pair) as the rules see it: ``(query ids, key ids,
    one)``, each ``(shape, dtype name)``."""
    return rules.describe_segment_ids(fn, segment_ids, _describe)



# ------------------------------------------------------------------------------------------
# A call's tiles planned under them (spec.TILE_SKIPPING)
# ------------------------------------------------------------------------------------------


#: torch only: the most ``rows × keys`` entries ``_mods_plan`` evaluates the rules on at once
#: (counted over the batch entries and heads the rules tell apart: their result on one
#: position says which). On the CPU every torch operation over many entries wakes torch's
#: threads, which costs most when the machine is loaded: a few large evaluations instead of one
#: per block of rows (4,096 tokens, 2 busy cores: 0.5 s of mask_mod calls became 3 of them); a
#: mod's int64 temporaries (8 bytes an entry) bound the size.
MODS_EVAL_ENTRIES = 1 << 23


def _mods_statuses(mods: _Mods, q_len: int, kv_len: int, block_q: int, block_kv: int,
                   lo: float, hi: float) -> np.ndarray:
    """``rules.NONE`` / ``SOME`` / ``ALL`` of every ``(block_q, block_kv)`` tile under the band
    and ``mods``' rules, ``(n_q_blocks, n_kv_blocks)`` uint8 (over every batch entry and head):
    the chunk rule is arithmetic; segment ids and ``mask_mod`` are evaluated on every row of
    query blocks, over the keys the band and the chunks leave (``spec.TILE_SKIPPING``; torch:
    several blocks of rows at once, ``_mods_plan``)."""
    return _mods_plan(mods, q_len, kv_len, block_q, block_kv, lo, hi)[0]


def _mods_plan(mods: _Mods, q_len: int, kv_len: int, block_q: int, block_kv: int, lo: float,
               hi: float, triangles: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """torch only: ``_mods_statuses``' statuses, and with ``triangles`` which runs of ``SOME``
    tiles are SDPA's causal triangle: bool ``(n_q_blocks, n_kv_blocks)``, True on the first tile
    of a run of ``SOME`` tiles (in a row of blocks) whose allowed positions are, for every batch
    entry and head, exactly the top-left triangle from the run's first key (the block's row
    ``i`` sees the run's keys ``j <= i``): ``is_causal=True`` without a mask computes it.

    The rules (band, chunks, segment ids, ``mask_mod``) are evaluated on groups of consecutive
    blocks of rows at once, over the union of the keys the band and the chunks leave them (a
    group grows while that union is at most twice their own keys and at most
    ``MODS_EVAL_ENTRIES`` entries); the tiles' statuses and triangles are then found with NumPy
    on the evaluated booleans. Without segment ids and ``mask_mod`` (and without ``triangles``
    or any ``SOME`` tile) the structural statuses are returned unevaluated."""
    base = np.array(rules.structural_statuses(q_len, kv_len, block_q, block_kv, lo, hi,
                                              mods.offset, mods.chunk_size), np.uint8)
    base = base.reshape(base.shape[0], -1)  # (n_q_blocks, n_kv_blocks), also when empty
    tri = np.zeros(base.shape, bool) if triangles else None
    evaluate = mods.q_ids is not None or mods.mask_mod is not None or (
        triangles and bool((base == rules.SOME).any()))
    if not evaluate or not base.any():  # nothing to evaluate, or no tile left to it
        return base, tri
    with torch.no_grad():  # the entries the rules tell apart, from one position
        probe = _mods_allowed(mods, 0, 1, 0, 1)
    statuses, lead = base.copy(), 1 if probe is None else math.prod(probe.shape[:-2])
    kept = [np.flatnonzero(row) for row in base]
    r = 0
    while r < base.shape[0]:
        if not kept[r].size:
            r += 1
            continue
        b0, b1, own, g = int(kept[r][0]), int(kept[r][-1]) + 1, 0, r
        while g < base.shape[0] and kept[g].size:  # grow the group of blocks of rows
            n0, n1 = min(b0, int(kept[g][0])), max(b1, int(kept[g][-1]) + 1)
            rows = min((g + 1) * block_q, q_len) - r * block_q
            area = rows * (min(n1 * block_kv, kv_len) - n0 * block_kv)
            mine = (min((g + 1) * block_q, q_len) - g * block_q) * (
                min((int(kept[g][-1]) + 1) * block_kv, kv_len) - int(kept[g][0]) * block_kv)
            if g > r and (area * lead > MODS_EVAL_ENTRIES or area > 2 * (own + mine)):
                break
            b0, b1, own, g = n0, n1, own + mine, g + 1
        q0, q1, k0, k1 = r * block_q, min(g * block_q, q_len), b0 * block_kv, min(
            b1 * block_kv, kv_len)
        with torch.no_grad():
            allowed = _mods_allowed(mods, q0, q1 - q0, k0, k1 - k0)
            if math.isfinite(lo) or math.isfinite(hi):
                band = _in_band(q0, q1 - q0, k0, k1 - k0, lo, hi, mods.device)
                allowed = band if allowed is None else allowed & band
        allowed = allowed.cpu().numpy()  # (..., rows, keys) or broadcastable to it
        allowed = np.broadcast_to(allowed, allowed.shape[:-2] + (q1 - q0, k1 - k0))
        allowed = allowed.reshape((-1, q1 - q0, k1 - k0))  # (entries, rows, keys)
        some, full = _tiles_any_all(allowed, g - r, block_q, b1 - b0, block_kv)
        found = np.where(full, rules.ALL, np.where(some, rules.SOME, rules.NONE))
        statuses[r:g, b0:b1] = np.where(base[r:g, b0:b1] != rules.NONE, found, rules.NONE)
        for i in range(r, g) if triangles else ():
            _find_triangles(allowed, statuses[i], tri[i], i * block_q - q0, min(
                block_q, q_len - i * block_q), k0, block_kv, kv_len)
        r = g
    return statuses, tri


def _tiles_any_all(allowed: np.ndarray, n_q: int, block_q: int, n_kv: int, block_kv: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """torch only: whether each of the ``(n_q, n_kv)`` tiles of ``allowed (entries, rows,
    keys)`` (the last ones may be cut short) allows any position, and all of them, in any
    entry / every entry: two bool ``(n_q, n_kv)``. NumPy, over the rows of a tile first."""
    entries, rows, keys = allowed.shape
    tiles = (entries, n_q, block_q, n_kv, block_kv)
    if (rows, keys) == (n_q * block_q, n_kv * block_kv):  # whole tiles: no copy
        whole = allowed.reshape(tiles)
        return (whole.any(axis=2).any(axis=(0, 3)), whole.all(axis=2).all(axis=(0, 3)))
    some, not_all = np.zeros(tiles, bool), np.zeros(tiles, bool)
    some.reshape(entries, n_q * block_q, -1)[:, :rows, :keys] = allowed  # padded: False
    np.logical_not(allowed, out=not_all.reshape(entries, n_q * block_q, -1)[:, :rows, :keys])
    return (some.any(axis=2).any(axis=(0, 3)), ~not_all.any(axis=2).any(axis=(0, 3)))


def _find_triangles(allowed: np.ndarray, row: np.ndarray, tri: np.ndarray, r0: int, rows: int,
                    k0: int, block_kv: int, kv_len: int) -> None:
    """torch only: mark in ``tri`` (one row of blocks, in place) the first tile of each run of
    ``SOME`` tiles of ``row`` (its statuses) whose positions in ``allowed`` ``(entries, rows,
    keys from k0)``, rows ``r0 : r0 + rows``, are the top-left causal triangle from the run's
    first key."""
    cols = np.flatnonzero(row == rules.SOME)
    for run in np.split(cols, np.flatnonzero(np.diff(cols) != 1) + 1) if cols.size else ():
        s0, s1 = int(run[0]) * block_kv - k0, min((int(run[-1]) + 1) * block_kv, kv_len) - k0
        part = allowed[:, r0 : r0 + rows, s0:s1]
        if part[:, 0, 0].all() and not part[:, 0, 1:].any() and (
                part == np.tri(rows, s1 - s0, dtype=bool)).all():  # row 0 first: cheap "no"
            tri[run[0]] = True


def _plan_with_mods(plan: list, mods: _Mods | None, q_len: int, kv_len: int, block_q: int,
                    block_kv: int, lo: float, hi: float) -> list:
    """``rules.plan``'s tiles without those ``mods`` (chunks, segment ids, ``mask_mod``) mask
    entirely, and ``partial | 2`` where they mask part (``_mask_tile`` then masks by them)."""
    if mods is None or not mods.masks:
        return plan
    statuses = _mods_statuses(mods, q_len, kv_len, block_q, block_kv, lo, hi)
    return [(a, b, [(k0, k1, int(part) | (2 if status == rules.SOME else 0))
                    for k0, k1, part in blocks
                    if (status := statuses[a // block_q, k0 // block_kv])])
            for a, b, blocks in plan]
