"""The unchecked steps of the pipeline and the array and head helpers every file of numpy_attn
shares: scores, soft-cap, mask, softmax, dropout and output (``conformance/spec/functions.py``), the
gradient helpers for grouped heads and broadcast inputs, and the description, dtype and head
bookkeeping of arrays. Imports run one way: ``_core < blockwise < _fast < functional < backward
< modules`` (``context_parallel`` above; ``masks``, ``kv_cache`` and ``_threads`` beside);
nothing here validates: the public functions (``functional.py`` and the others) check their
inputs once, with ``attention_rules``, then call these.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

import attention_rules as rules

from . import _threads

NEG_INF = -np.inf


# ------------------------------------------------------------------------------------------
# The steps, unchecked: each returns a fresh array (numpy: one it owns, so later steps may
# work in place). The public functions validate, then call these.
# ------------------------------------------------------------------------------------------


def _scores(query: np.ndarray, key: np.ndarray, scale: float, softcap: float | None) -> np.ndarray:
    """``(query @ keyᵀ) · scale``, soft-capped: query ``(..., heads, q_len, head_dim)`` and key
    ``(..., kv_heads, kv_len, head_dim)`` give ``(..., heads, q_len, kv_len)`` in the compute
    dtype (query head ``h`` meets kv head ``h // groups``)."""
    query = _to_compute(query) * scale  # (..., heads, q_len, head_dim); scaling q is cheapest
    key = _to_compute(key)  # (..., kv_heads, kv_len, head_dim)
    groups = _groups(query.shape, key.shape)
    if groups > 1:  # grouped-query: (..., kv_heads, groups, q_len, head_dim)
        query = _group_heads(query, groups)
        key = key[..., None, :, :]  # (..., kv_heads, 1, kv_len, head_dim)
    scores = query @ np.swapaxes(key, -1, -2)  # (..., [kv_heads, groups,] q_len, kv_len)
    scores = scores.reshape(_merged(scores.shape, groups))  # (..., heads, q_len, kv_len)
    return _softcap(scores, softcap)


def _softcap(scores: np.ndarray, softcap: float | None) -> np.ndarray:
    """``softcap · tanh(scores / softcap)`` (in place); unchanged for None."""
    if softcap is not None:
        scores *= 1.0 / softcap
        np.tanh(scores, out=scores)
        scores *= softcap
    return scores


def _mask_scores(
    scores: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    mods: _Mods | None = None,
) -> np.ndarray:
    """``scores (..., heads, q_len, kv_len)`` plus ``bias`` (and ALiBi, then ``score_mod``:
    ``mods``), then ``-inf`` wherever a position is not allowed (``_allowed``: True in ``mask``
    = may attend); in place."""
    if bias is not None:
        scores += bias.astype(scores.dtype, copy=False)  # (..., heads, q_len, kv_len)
    scores = _mods_scores(scores, mods, 0, 0)
    q_len, kv_len = scores.shape[-2:]
    allowed = _allowed(q_len, kv_len, mask, is_causal, causal_alignment, window, mods)
    if allowed is not None:
        # replaced, not added: a NaN score at a masked position does not spread
        np.copyto(scores, NEG_INF, where=~allowed)
    return scores


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


def _softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in place; rows that are all ``-inf`` become exactly 0."""
    weights, row_sum = _unnormalised_softmax(scores)  # (..., q_len, kv_len), (..., q_len, 1)
    weights /= row_sum
    return weights


def _unnormalised_softmax(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``exp(scores - row max)`` (in place) and its row sums ``(..., q_len, 1)``; a row that is
    all ``-inf`` gives 0 and a row sum of 1, so dividing by it gives 0, never NaN."""
    row_max = scores.max(axis=-1, keepdims=True, initial=NEG_INF)  # (..., q_len, 1)
    row_max[row_max == NEG_INF] = 0.0  # fully masked row: exp(-inf - 0) = 0, no NaN
    scores -= row_max
    np.exp(scores, out=scores)
    row_sum = scores.sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    row_sum[row_sum == 0.0] = 1.0  # 0 / 1 = 0 for fully masked rows
    return scores, row_sum


def _dropout(
    weights: np.ndarray, dropout_p: float, dropout_mask: np.ndarray | None, rng: Any
) -> np.ndarray:
    """``weights (..., q_len, kv_len) · keep / (1 - dropout_p)``; the keep-mask (True = keep)
    is drawn from ``rng`` (a fresh ``default_rng()`` for None) when ``dropout_mask`` is None."""
    if dropout_mask is None:
        rng = np.random.default_rng() if rng is None else rng
        dropout_mask = rng.random(weights.shape, dtype=np.float32) >= dropout_p
    return weights * dropout_mask * (1.0 / (1.0 - dropout_p))


def _output(weights: np.ndarray, value: np.ndarray) -> np.ndarray:
    """``weights (..., heads, q_len, kv_len) @ value (..., kv_heads, kv_len, v_dim)`` with the
    grouped-query head mapping: ``(..., heads, q_len, v_dim)`` in the compute dtype."""
    value = _to_compute(value)  # (..., kv_heads, kv_len, v_dim)
    groups = _groups(weights.shape, value.shape)
    if groups > 1:
        weights = _group_heads(weights, groups)  # (..., kv_heads, groups, q_len, kv_len)
        value = value[..., None, :, :]  # (..., kv_heads, 1, kv_len, v_dim)
    output = weights.astype(value.dtype, copy=False) @ value
    return output.reshape(_merged(output.shape, groups))  # (..., heads, q_len, v_dim)


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


def _mods_slope(pre: np.ndarray, mods: _Mods, q0: int, k0: int,
                index: tuple | None = None) -> np.ndarray:
    """``d score_mod / d score`` at the scores before it, ``pre`` (its ``derivative``)."""
    rows, keys = pre.shape[-2:]
    slope = mods.score_mod.derivative(pre, *_mod_indices(mods, q0, rows, k0, keys, index))
    _check_result(mods.fn, "score_mod", slope, pre.shape)
    return slope


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
# Gradients: grouped heads and broadcast inputs
# ------------------------------------------------------------------------------------------


def _matmul_grouped(a: np.ndarray, b: np.ndarray, groups: int) -> np.ndarray:
    """``a (..., heads, T, S) @ b (..., kv_heads, S, D)`` with the grouped-query head mapping."""
    if groups == 1:
        return a @ b
    product = _group_heads(a, groups) @ b[..., None, :, :]  # (..., kv_heads, groups, T, D)
    return product.reshape(a.shape[:-1] + (b.shape[-1],))  # (..., heads, T, D)


def _sum_groups(x: np.ndarray, groups: int) -> np.ndarray:
    """``(..., heads, T, D)`` → ``(..., kv_heads, T, D)``: add the query heads sharing a kv head."""
    if groups == 1:
        return x
    return _group_heads(x, groups).sum(axis=-3)


def _sum_to_shape(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``x`` over the axes along which an array of ``shape`` was broadcast to ``x.shape``."""
    leading = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(leading))) if leading else x
    stretched = tuple(axis for axis, size in enumerate(shape) if size == 1 and x.shape[axis] != 1)
    return x.sum(axis=stretched, keepdims=True) if stretched else x


# ------------------------------------------------------------------------------------------
# Arrays, dtypes, heads and devices
# ------------------------------------------------------------------------------------------


def _describe(fn: str, name: str, x: Any) -> rules.ArrayInfo | None:
    """What the rules see of an input: ``(shape, dtype name)``; None for None. A Python list,
    tuple or scalar is refused (TypeError): it has no dtype of its own."""
    if x is None:
        return None
    rules.check_array(fn, name, x)
    x = np.asarray(x)
    return tuple(x.shape), x.dtype.name


def _describe_lengths(kv_lengths: Any) -> rules.ArrayInfo | None:
    """``(shape, dtype name)`` of ``kv_lengths`` (a list of ints is welcome)."""
    if kv_lengths is None:
        return None
    kv_lengths = np.asarray(kv_lengths)
    return tuple(kv_lengths.shape), kv_lengths.dtype.name


def _array(x: Any) -> np.ndarray | None:
    """A validated input as a NumPy array (no copy); None stays None."""
    return None if x is None else np.asarray(x)


def _check_scores(fn: str, name: str, x: Any) -> rules.ArrayInfo:
    """A floating array of rank >= 2 (scores or weights); its ``(shape, dtype name)``."""
    shape, dtype = _describe(fn, name, x)
    rules.check_float_inputs(fn, **{name: dtype})
    rules.check_rank(fn, **{name: shape})
    return shape, dtype


def _to_compute(x: np.ndarray) -> np.ndarray:
    """Half types up to float32; float32 and float64 unchanged (no copy)."""
    return x.astype(rules.compute_dtype(x.dtype.name), copy=False)


def _group_heads(x: np.ndarray, groups: int) -> np.ndarray:
    """``(..., heads, T, D)`` → ``(..., kv_heads, groups, T, D)``: query head ``h`` is
    ``(h // groups, h % groups)``, so it meets kv head ``h // groups``."""
    return x.reshape(x.shape[:-3] + (x.shape[-3] // groups, groups) + x.shape[-2:])


def _groups(x_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> int:
    """Query heads per kv head: ``heads // kv_heads`` of ``(..., heads, T, D)`` and
    ``(..., kv_heads, S, D)``; 1 for inputs without a head axis."""
    return x_shape[-3] // kv_shape[-3] if len(x_shape) >= 3 else 1


def _merged(shape: tuple[int, ...], groups: int) -> tuple[int, ...]:
    """Undo ``_group_heads``: ``(..., kv_heads, groups, T, S)`` → ``(..., heads, T, S)``."""
    if groups == 1:
        return shape
    return shape[:-4] + (shape[-4] * shape[-3],) + shape[-2:]


def _check_device(fn: str, device: Any) -> None:
    """``device`` of a function that creates arrays: None or ``"cpu"`` (NumPy arrays live on
    the CPU only, the Array API's ``device="cpu"``); ValueError otherwise."""
    if device not in (None, "cpu"):
        raise ValueError(f"{fn}: numpy_attn creates arrays on the CPU only; got device={device!r}")
