"""What the files of jax_attn share besides ``_core.py``'s steps: the sinks, each row's
log-sum-exp and the merging of partial results over disjoint keys (``spec.SINKS``,
``spec.MERGING``: the online softmax's step, the ring's and the paged decoder's); a call's
chunks, ALiBi, segment ids and mods (``spec.MASKS_AND_MODS``) built from its validated
arguments, and the statuses and static segments of its tiles under them
(``spec.TILE_SKIPPING``, decided at trace time); and the helpers the blocked fast path's
forward (``_blocked.py``) and backward (``_blocked_vjp.py``) share. ``_core.py`` applies the
mods to a tile (``_Mods``, ``_mods_scores``, ``_mods_allowed``: its mask step needs them); this
file builds them and plans the tiles. Like ``_core``, a room whose private names every file of
jax_attn may import; nothing here validates. Imports run one way: ``_core < _extras < _tiles <
blockwise < _blocked < _blocked_vjp < _fast < functional < backward < modules``
(``context_parallel`` and ``integrations`` above).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules

from ._core import NEG_INF, _describe, _Mods, _mods_allowed

# ------------------------------------------------------------------------------------------
# Sinks, each row's log-sum-exp and merging partial results (spec.SINKS, spec.MERGING)
# ------------------------------------------------------------------------------------------


def _softmax_lse(scores: jax.Array, sinks: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Softmax over the last axis and each row's log-sum-exp ``(..., q_len)``: ``scores
    (..., heads, q_len, kv_len)``; ``sinks (heads,)`` (or None) join every row's denominator
    as a column without a value (``spec.SINKS``). A row that is all ``-inf`` gives weights 0
    and, without a sink, lse ``-inf``; its gradients are 0, never NaN."""
    row_max = scores.max(axis=-1, keepdims=True, initial=NEG_INF)  # (..., q_len, 1)
    if sinks is not None:  # the shift covers the sink too: exp(sink - max) <= 1
        sink = _sink_column(sinks, scores.ndim, scores.dtype)  # (heads, 1, 1)
        row_max = jnp.maximum(row_max, sink)
    # shift-invariant (weights and lse alike): stop_gradient is exact
    row_max = jax.lax.stop_gradient(row_max)
    row_max = jnp.where(row_max == NEG_INF, 0.0, row_max)  # fully masked: exp(-inf - 0) = 0
    weights = jnp.exp(scores - row_max)
    row_sum = weights.sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    if sinks is not None:
        row_sum = row_sum + jnp.exp(sink - row_max)
    empty = row_sum == 0.0  # no key, no sink
    safe_sum = jnp.where(empty, 1.0, row_sum)  # where, not log(0): gradients stay finite
    lse = jnp.where(empty, NEG_INF, row_max + jnp.log(safe_sum))[..., 0]  # (..., q_len)
    return weights / safe_sum, lse


def _sink_column(sinks: jax.Array, ndim: int, dtype: Any) -> jax.Array:
    """``(heads,)`` sink logits against rows ``(..., heads, q_len, 1)`` of rank ``ndim``:
    ``(heads, 1, 1)``, or ``(1, 1)`` for inputs without a heads axis, in ``dtype``."""
    sinks = sinks.astype(dtype)
    return sinks.reshape(sinks.shape + (1, 1)) if ndim >= 3 else sinks.reshape(1, 1)


def _merge_attention(
    outputs: tuple[jax.Array, ...], lses: tuple[jax.Array, ...], sinks: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Partial results over disjoint key sets of the same rows, each an output
    ``(..., rows, v_dim)`` and its log-sum-exp ``(..., rows, 1)`` (``-inf``: no key), merged
    into the attention over every key set and its log-sum-exp (``spec.MERGING``; the online
    softmax's step). ``sinks (heads,)`` join the denominator once: a part whose output is 0.
    Differentiable: a part with lse ``-inf`` gets gradient 0."""
    lses = list(lses)
    if sinks is not None:
        lses.append(_sink_column(sinks, outputs[0].ndim, lses[0].dtype))
    row_max = jax.lax.stop_gradient(functools.reduce(jnp.maximum, lses))  # (..., rows, 1)
    shift = jnp.where(row_max == NEG_INF, 0.0, row_max)  # no -inf - -inf
    scales = [jnp.exp(lse - shift) for lse in lses]  # exp(lse_i - max) <= 1; 0 for no key
    total = functools.reduce(jnp.add, scales)
    empty = total == 0.0  # no key in any part
    safe_total = jnp.where(empty, 1.0, total)
    lse = jnp.where(empty, NEG_INF, shift + jnp.log(safe_total))
    output = functools.reduce(jnp.add, [a * out for a, out in zip(scales, outputs, strict=False)])
    return output / safe_total, lse


def _merge_partials(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Two partial results over different keys of the same rows (``_merge_attention`` of two
    parts, the ring's and the causal pieces' step): outputs ``(..., rows, v_dim)``, lses
    ``(..., rows, 1)`` (``-inf``: no key)."""
    return _merge_attention((out_a, out_b), (lse_a, lse_b), None)


def _with_sinks(
    output: jax.Array, lse: jax.Array, sinks: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Rows finished over their keys by the online softmax, ``output (..., rows, v_dim)`` and
    ``lse (..., rows, 1)`` (``+inf`` for a row without a key, the tiles' convention), in the
    spec's terms: the sinks joined (``_merge_attention``) and ``-inf`` for a row without a key
    nor a sink."""
    lse = jnp.where(lse == jnp.inf, NEG_INF, lse)
    if sinks is None:
        return output, lse
    return _merge_attention((output,), (lse,), sinks)


def _sinks_grad(sinks: jax.Array, lse: jax.Array, row_dot: jax.Array) -> jax.Array:
    """``d sinks (heads,)`` in ``lse``'s dtype: ``-sum p_sink · row_dot`` over every axis but
    the heads, ``p_sink = exp(sink - lse)`` (0 where lse is ``±inf``: a row with no key nor
    sink); ``lse`` and ``row_dot = rowsum(dO ⊙ O) - dlse`` are ``(..., heads, rows, 1)`` (the
    blocked path's hand-written VJP)."""
    sink = _sink_column(sinks, lse.ndim, lse.dtype)
    p_sink = jnp.where(jnp.isinf(lse), 0.0, jnp.exp(sink - lse))  # (..., heads, rows, 1)
    terms = -p_sink * row_dot
    if lse.ndim < 3:  # no heads axis: one sink
        return terms.sum().reshape(1)
    return terms.sum(axis=tuple(a for a in range(terms.ndim) if a != terms.ndim - 3))


def _describe_parts(fn: str, name: str, parts: Any) -> list[rules.ArrayInfo]:
    """``merge_attention``'s partial results as the rules see them: a list or tuple of arrays,
    ``name[i]`` each."""
    rules.check_parts(fn, name, parts)
    return [_describe(fn, f"{name}[{i}]", x) for i, x in enumerate(parts)]


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


def _describe_segments(fn: str, segment_ids: Any) -> tuple | None:
    """``segment_ids`` (one array or a pair) as the rules see it: ``(query ids, key ids,
    one)``, each ``(shape, dtype name)``."""
    split = rules.split_segment_ids(fn, segment_ids)
    if split is None:
        return None
    q_ids, kv_ids, one = split
    names = ("segment_ids", "segment_ids") if one else ("segment_ids[0]", "segment_ids[1]")
    return _describe(fn, names[0], q_ids), _describe(fn, names[1], kv_ids), one


def _segments(segment_ids: Any) -> tuple[Any, Any] | None:
    """The validated ``segment_ids`` as ``(query ids, key ids)``."""
    if segment_ids is None:
        return None
    if isinstance(segment_ids, (list, tuple)):
        return segment_ids[0], segment_ids[1]
    return segment_ids, segment_ids


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


# ------------------------------------------------------------------------------------------
# The blocked fast path's pieces, shared by its forward (_blocked.py) and backward
# (_blocked_vjp.py)
# ------------------------------------------------------------------------------------------


def _triangle(q_len: int, kv_len: int, args: rules.Arguments, block_q: int
              ) -> tuple[int, int, int, int, int]:
    """The pieces of the causal rule (``_blocked._causal_forward``): the diagonal
    triangle's first row ``i0``, first key ``c0`` and side ``n``, how many times it is halved
    (``depth``: leaves of at most ``block_q`` rows) and its side padded to ``leaf · 2^depth``."""
    offset = int(rules.band(q_len, kv_len, True, args.causal_alignment, None)[1])
    i0, c0 = max(0, -offset), max(0, offset)
    n = min(q_len - i0, kv_len - c0)
    depth = max(0, math.ceil(math.log2(n / block_q)))
    return i0, c0, n, depth, -(-n // 2**depth) * 2**depth


def _halves(x: jax.Array, parts: int, size: int, lower: bool | None) -> jax.Array:
    """``(..., side, d)`` cut into ``parts`` chunks (each two halves of ``size`` rows when
    ``lower`` is not None: the lower or the upper one) → ``(parts, ..., size, d)``."""
    if lower is None:
        x = x.reshape(x.shape[:-2] + (parts, size, x.shape[-1]))
    else:
        x = x.reshape(x.shape[:-2] + (parts, 2, size, x.shape[-1]))[..., int(lower), :, :]
    return jnp.moveaxis(x, -3, 0)


def _unhalves(x: jax.Array, halves: bool, fill: float, lower: bool = True) -> jax.Array:
    """Undo ``_halves``: ``(parts, ..., size, d)`` → ``(..., side, d)``; with ``halves`` the
    other half of each chunk (the upper one for ``lower``) filled with ``fill`` (what adds
    nothing)."""
    x = jnp.moveaxis(x, 0, -3)  # (..., parts, size, d)
    if halves:
        other = jnp.full_like(x, fill)
        x = jnp.stack([other, x] if lower else [x, other], axis=-3)  # (..., parts, 2, size, d)
    return x.reshape(x.shape[:-4 if halves else -3] + (-1, x.shape[-1]))


def _pad_rows(x: jax.Array, size: int) -> jax.Array:
    """Zero rows appended up to ``size`` rows."""
    pad = [(0, 0)] * (x.ndim - 2) + [(0, size - x.shape[-2]), (0, 0)]
    return jnp.pad(x, pad) if size > x.shape[-2] else x


def _items(query: jax.Array, key: jax.Array, mask: jax.Array | None,
           bias: jax.Array | None) -> int:
    """How many (batch, kv head) items the blocked path takes one at a time: the product of
    the key's leading axes; 1 (all heads at once) for 2-D inputs, or when the mask or the bias
    varies along a batch or head axis (each item would need its own slice of it)."""
    if query.ndim < 3 or any(x is not None and math.prod(x.shape[:-2]) != 1 for x in (mask, bias)):
        return 1
    return math.prod(key.shape[:-2])


def _grown(blocks: tuple[int, int, int, int, int], heads: int, kv_len: int
           ) -> tuple[int, int, int, int, int]:
    """``blocks`` with ``BLOCK_Q`` doubled, at most twice, while a block's scores (``heads`` ×
    rows × ``kv_len`` entries, ``heads`` the leading axes of one block) stay within
    ``BLOCK_SCORES`` (``blocks[4]``). One head of 2,048 keys takes 256 rows, of 4,096 keys
    128: larger products for XLA's threads, scores that stay in the cache
    (``benchmarks/RESULTS.md``)."""
    rows = blocks[0]
    for _ in range(2):
        if heads * 2 * rows * kv_len > blocks[4]:
            break
        rows *= 2
    return (rows,) + tuple(blocks[1:])


def _item_blocks(query: jax.Array, key: jax.Array, mask: jax.Array | None,
                 bias: jax.Array | None, args: rules.Arguments,
                 blocks: tuple[int, int, int, int, int]
                 ) -> tuple[int, tuple[int, int, int, int, int]]:
    """The blocked path's items (``_items``) and its ``blocks``, ``BLOCK_Q`` grown for the heads
    of one block (an item's query heads, or every leading axis when there is one item) — the
    same for the forward pass and the VJP, so the mods' tiles agree. A window keeps
    ``BLOCK_Q`` rows: its segments are cut along the blocks."""
    items = _items(query, key, mask, bias)
    if args.window is not None:
        return items, blocks
    heads = query.shape[-3] // key.shape[-3] if items > 1 else math.prod(query.shape[:-2])
    return items, _grown(blocks, heads, key.shape[-2])


def _to_items(x: jax.Array, items: int) -> jax.Array:
    """``(..., kv_heads · groups, T, d)`` → ``(items, groups, T, d)``: one item per (batch,
    kv head), with its query heads (``_core._group_heads``' order)."""
    return x.reshape((items, -1) + x.shape[-2:])


def _squeeze(x: jax.Array | None) -> jax.Array | None:
    """A mask or bias without its leading size-1 axes: at most ``(q_len, kv_len)``."""
    return None if x is None else x.reshape(x.shape[-2:])


def _rows(x: jax.Array | None, i0: Any, n: int) -> jax.Array | None:
    """Rows ``i0 : i0 + n`` of a mask or bias whose query axis is not broadcast."""
    if x is None or x.ndim < 2 or x.shape[-2] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, i0, n, axis=x.ndim - 2)


def _cols(x: jax.Array | None, k0: Any, n: int) -> jax.Array | None:
    """Columns ``k0 : k0 + n`` of a mask or bias whose key axis is not broadcast."""
    if x is None or x.shape[-1] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, k0, n, axis=x.ndim - 1)


def _blocks(x: jax.Array, size: int) -> jax.Array:
    """``(..., n · size, d)`` → ``(n, ..., size, d)``: the blocks along the first axis, for
    ``lax.map`` and ``lax.scan``."""
    x = x.reshape(x.shape[:-2] + (-1, size, x.shape[-1]))
    return jnp.moveaxis(x, -3, 0)


def _unblock(x: jax.Array) -> jax.Array:
    """``(n, ..., block, d)`` → ``(..., n · block, d)``: undo ``_blocks``."""
    x = jnp.moveaxis(x, 0, -3)
    return x.reshape(x.shape[:-3] + (-1, x.shape[-1]))
