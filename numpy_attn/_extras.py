"""What the files of numpy_attn share besides ``_core.py``'s steps: the sinks, each row's
log-sum-exp and the merging of partial results over disjoint keys (``spec.SINKS``,
``spec.MERGING``: the online softmax's step, the ring's and the paged decoder's); a call's
chunks, ALiBi, segment ids and mods (``spec.MASKS_AND_MODS``) built from its validated
arguments, and the statuses of its tiles under them (``spec.TILE_SKIPPING``); and the helpers
the blocked fast path's forward (``_blocked.py``) and backward (``_blocked_vjp.py``) share.
``_core.py`` applies the mods to a tile (``_Mods``, ``_mods_scores``, ``_mods_allowed``: its
mask step needs them); this file builds them and plans the tiles. Like ``_core``, a room whose
private names every file of numpy_attn may import; nothing here validates. Imports run one
way: ``_core < _extras < _tiles < blockwise < _blocked < _blocked_vjp < _fast < functional <
backward < modules`` (``context_parallel`` above; ``masks``, ``kv_cache`` and ``_threads``
beside).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

import attention_rules as rules

from . import _threads
from ._core import (
    NEG_INF,
    _check_result,
    _describe,
    _in_band,
    _mod_indices,
    _Mods,
    _mods_allowed,
)

# ------------------------------------------------------------------------------------------
# Sinks, each row's log-sum-exp and merging partial results (spec.SINKS, spec.MERGING)
# ------------------------------------------------------------------------------------------


def _softmax_lse(scores: np.ndarray, sinks: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over the last axis (in place) and each row's log-sum-exp ``(..., q_len)``:
    ``scores (..., heads, q_len, kv_len)``; ``sinks (heads,)`` (or None) join every row's
    denominator as a column without a value (``spec.SINKS``), so the weights of a row sum to
    less than 1. A row that is all ``-inf`` gives weights 0 and, without a sink, lse ``-inf``."""
    row_max = scores.max(axis=-1, keepdims=True, initial=NEG_INF)  # (..., q_len, 1)
    if sinks is not None:  # the shift covers the sink too: exp(sink - max) <= 1
        sink = _sink_column(sinks, scores.ndim, scores.dtype)  # (heads, 1, 1)
        row_max = np.maximum(row_max, sink)
    row_max[row_max == NEG_INF] = 0.0  # fully masked row: exp(-inf - 0) = 0, no NaN
    scores -= row_max
    np.exp(scores, out=scores)
    row_sum = scores.sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    if sinks is not None:
        row_sum += np.exp(sink - row_max)
    with np.errstate(divide="ignore"):  # log(0) = -inf: a row without a key or a sink
        lse = (row_max + np.log(row_sum))[..., 0]  # (..., q_len)
    row_sum[row_sum == 0.0] = 1.0  # 0 / 1 = 0 for fully masked rows
    scores /= row_sum
    return scores, lse


def _sink_column(sinks: np.ndarray, ndim: int, dtype: Any) -> np.ndarray:
    """``(heads,)`` sink logits against rows ``(..., heads, q_len, 1)`` of rank ``ndim``:
    ``(heads, 1, 1)``, or ``(1, 1)`` for inputs without a heads axis, in ``dtype``."""
    sinks = sinks.astype(dtype, copy=False)
    return sinks.reshape(sinks.shape + (1, 1)) if ndim >= 3 else sinks.reshape(1, 1)


def _merge_attention(
    outputs: tuple[np.ndarray, ...], lses: tuple[np.ndarray, ...], sinks: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Partial results over disjoint key sets of the same rows, each an output
    ``(..., rows, v_dim)`` and its log-sum-exp ``(..., rows, 1)`` (``-inf``: no key), merged
    into the attention over every key set and its log-sum-exp (``spec.MERGING``; the online
    softmax's step). ``sinks (heads,)`` join the denominator once: a part whose output is 0."""
    lses = list(lses)
    if sinks is not None:
        lses.append(_sink_column(sinks, outputs[0].ndim, lses[0].dtype))
    row_max = functools.reduce(np.maximum, lses)  # (..., rows, 1)
    shift = np.where(row_max == NEG_INF, 0.0, row_max).astype(row_max.dtype)  # no -inf - -inf
    scales = [np.exp(lse - shift) for lse in lses]  # exp(lse_i - max) <= 1; 0 for no key
    total = functools.reduce(np.add, scales)
    with np.errstate(divide="ignore"):  # log(0) = -inf: no key in any part
        lse = shift + np.log(total)
    output = functools.reduce(np.add, [a * out for a, out in zip(scales, outputs, strict=False)])
    return output / np.where(total == 0.0, 1.0, total).astype(total.dtype), lse


def _merge_partials(
    out_a: np.ndarray, lse_a: np.ndarray, out_b: np.ndarray, lse_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Two partial results over different keys of the same rows (``_merge_attention`` of two
    parts, the ring's and the causal pieces' step): outputs ``(..., rows, v_dim)``, lses
    ``(..., rows, 1)`` (``-inf``: no key)."""
    return _merge_attention((out_a, out_b), (lse_a, lse_b), None)


def _with_sinks(
    output: np.ndarray, lse: np.ndarray, sinks: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Rows finished over their keys by the online softmax, ``output (..., rows, v_dim)`` and
    ``lse (..., rows, 1)`` (``+inf`` for a row without a key, the tiles' convention), in the
    spec's terms: the sinks joined (``_merge_attention``) and ``-inf`` for a row without a key
    nor a sink."""
    lse = np.where(lse == np.inf, NEG_INF, lse).astype(lse.dtype)
    if sinks is None:
        return output, lse
    return _merge_attention((output,), (lse,), sinks)


def _sinks_grad(sinks: np.ndarray, lse: np.ndarray, row_dot: np.ndarray) -> np.ndarray:
    """``d sinks (heads,)`` in ``lse``'s dtype: ``-sum p_sink · row_dot`` over every axis but
    the heads, ``p_sink = exp(sink - lse)`` (0 where lse is ``±inf``: a row with no key nor
    sink); ``lse`` and ``row_dot = rowsum(dO ⊙ O) - dlse`` are ``(..., heads, rows, 1)``."""
    sink = _sink_column(sinks, lse.ndim, lse.dtype)
    with np.errstate(invalid="ignore"):
        p_sink = np.where(np.isinf(lse), 0.0, np.exp(sink - lse))  # (..., heads, rows, 1)
    terms = -p_sink * row_dot
    if lse.ndim < 3:  # no heads axis: one sink
        return terms.sum(keepdims=True).reshape(1).astype(lse.dtype)
    axes = tuple(a for a in range(terms.ndim) if a != terms.ndim - 3)
    return terms.sum(axis=axes).astype(lse.dtype)


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


# ------------------------------------------------------------------------------------------
# The blocked fast path's pieces, shared by its forward (_blocked.py) and backward
# (_blocked_vjp.py)
# ------------------------------------------------------------------------------------------


def _entry(statuses: np.ndarray, index: tuple[int, ...]) -> np.ndarray:
    """The ``(q blocks, key blocks)`` statuses of one (batch..., head) ``index`` from
    ``_mods_statuses(..., per_entry=True)`` (whose size-1 axes hold for every entry)."""
    lead = statuses.shape[:-2]
    return statuses[tuple(0 if size == 1 else i for i, size in zip(index, lead, strict=True))]


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
