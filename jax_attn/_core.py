"""The unchecked pipeline steps and the array/head helpers that every file of jax_attn shares.

The steps (scores, soft-cap, mask, softmax, dropout, weighted sum) take arrays that the public
functions have already validated; the gradient helpers serve the hand-written backward passes
(``blockwise.py``, the blocked fast path); the array helpers describe inputs for the rules, map
query heads onto kv heads and place arrays on devices. Imports run one way: ``_core <
blockwise < _fast < functional < backward < modules`` (``context_parallel`` and
``integrations`` above); nothing here validates (the public functions in ``functional.py`` do,
with ``attention_rules``).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules

NEG_INF = -jnp.inf
HIGHEST = jax.lax.Precision.HIGHEST


# ------------------------------------------------------------------------------------------
# The steps, unchecked: each returns a fresh array (JAX arrays are immutable; XLA fuses
# the steps under jit). The public functions validate, then call these.
# ------------------------------------------------------------------------------------------


def _scores(query: jax.Array, key: jax.Array, scale: float, softcap: float | None) -> jax.Array:
    query = _to_compute(query) * scale  # (..., heads, q_len, head_dim); scaling q is cheapest
    key = _to_compute(key)  # (..., kv_heads, kv_len, head_dim)
    groups = _groups(query.shape, key.shape)
    if groups > 1:  # grouped-query: (..., kv_heads, groups, q_len, head_dim)
        query = _group_heads(query, groups)
        key = key[..., None, :, :]  # (..., kv_heads, 1, kv_len, head_dim)
    # matmul with the transposed key: XLA folds the transpose into the dot's dimension numbers
    scores = jnp.matmul(query, jnp.swapaxes(key, -1, -2), precision=HIGHEST)  # (..., q, kv)
    scores = scores.reshape(_merged(scores.shape, groups))  # (..., heads, q_len, kv_len)
    return _softcap(scores, softcap)


def _softcap(scores: jax.Array, softcap: float | None) -> jax.Array:
    """``softcap · tanh(scores / softcap)``; unchanged for None."""
    if softcap is not None:
        scores = jnp.tanh(scores * (1.0 / softcap)) * softcap  # no in-place ops in JAX
    return scores


def _mask_scores(
    scores: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    mods: _Mods | None = None,
) -> jax.Array:
    """``scores (..., heads, q_len, kv_len)`` plus ``bias`` (and ALiBi, then ``score_mod``:
    ``mods``), then ``-inf`` wherever a position is not allowed (``_allowed``)."""
    if bias is not None:
        scores = scores + bias.astype(scores.dtype)  # (..., heads, q_len, kv_len)
    scores = _mods_scores(scores, mods, 0, 0)
    q_len, kv_len = scores.shape[-2:]
    allowed = _allowed(q_len, kv_len, mask, is_causal, causal_alignment, window, mods)
    if allowed is not None:
        # replaced, not added: a NaN score at a masked position does not spread; and where,
        # not scores + log(mask): the gradient at a masked position is exactly 0
        scores = jnp.where(allowed, scores, NEG_INF)
    return scores


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


def _softmax(scores: jax.Array) -> jax.Array:
    """Softmax over the last axis; rows that are all ``-inf`` become exactly 0."""
    weights, row_sum = _unnormalised_softmax(scores)  # (..., q_len, kv_len), (..., q_len, 1)
    return weights / row_sum


def _unnormalised_softmax(scores: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``exp(scores - row max)`` and its row sums ``(..., q_len, 1)``; a row that is all
    ``-inf`` gives 0 and a row sum of 1, so dividing by it gives 0, never NaN."""
    row_max = scores.max(axis=-1, keepdims=True, initial=NEG_INF)  # (..., q_len, 1)
    # softmax is shift-invariant, so stop_gradient is exact and keeps max's VJP out of the graph
    row_max = jax.lax.stop_gradient(row_max)
    row_max = jnp.where(row_max == NEG_INF, 0.0, row_max)  # fully masked: exp(-inf - 0) = 0
    scores = jnp.exp(scores - row_max)
    row_sum = scores.sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    row_sum = jnp.where(row_sum == 0.0, 1.0, row_sum)  # 0 / 1 = 0 for fully masked rows
    return scores, row_sum


def _dropout(
    weights: jax.Array, dropout_p: float, dropout_mask: jax.Array | None, rng: Any
) -> jax.Array:
    if dropout_mask is None:
        # an explicit jax.random key (checked by _check_rng), never hidden global state
        dropout_mask = jax.random.uniform(rng, weights.shape, dtype=jnp.float32) >= dropout_p
    return weights * dropout_mask * (1.0 / (1.0 - dropout_p))


def _output(weights: jax.Array, value: jax.Array) -> jax.Array:
    value = _to_compute(value)  # (..., kv_heads, kv_len, v_dim)
    groups = _groups(weights.shape, value.shape)
    if groups > 1:
        weights = _group_heads(weights, groups)  # (..., kv_heads, groups, q_len, kv_len)
        value = value[..., None, :, :]  # (..., kv_heads, 1, kv_len, v_dim)
    output = jnp.matmul(weights.astype(value.dtype), value, precision=HIGHEST)  # explicit
    return output.reshape(_merged(output.shape, groups))  # (..., heads, q_len, v_dim)


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
    the order of ``_fast._to_items``): its ``groups`` query heads' slopes, its batch entry's
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
# Gradients: grouped heads and broadcast inputs
# ------------------------------------------------------------------------------------------


def _matmul_grouped(a: jax.Array, b: jax.Array, groups: int) -> jax.Array:
    """``a (..., heads, T, S) @ b (..., kv_heads, S, D)`` with the grouped-query head mapping."""
    if groups == 1:
        return jnp.matmul(a, b, precision=HIGHEST)
    product = jnp.matmul(_group_heads(a, groups), b[..., None, :, :], precision=HIGHEST)
    return product.reshape(a.shape[:-1] + (b.shape[-1],))  # (..., heads, T, D)


def _sum_groups(x: jax.Array, groups: int) -> jax.Array:
    """``(..., heads, T, D)`` → ``(..., kv_heads, T, D)``: add the query heads sharing a kv head."""
    if groups == 1:
        return x
    return _group_heads(x, groups).sum(axis=-3)


def _sum_to_shape(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
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
    return tuple(np.shape(x)), _dtype_name(x)  # jax: the dtype as given, before x64 rules


def _describe_lengths(kv_lengths: Any) -> rules.ArrayInfo | None:
    """``(shape, dtype name)`` of ``kv_lengths`` (a list of ints is welcome)."""
    if kv_lengths is None:
        return None
    return tuple(np.shape(kv_lengths)), _dtype_name(kv_lengths)  # jax: the dtype as given


def _array(x: Any) -> jax.Array | None:
    """A validated input as a JAX array; None stays None."""
    return None if x is None else jnp.asarray(x)


def _check_scores(fn: str, name: str, x: Any) -> rules.ArrayInfo:
    """A floating array of rank >= 2 (scores or weights); its ``(shape, dtype name)``."""
    shape, dtype = _describe(fn, name, x)
    rules.check_float_inputs(fn, **{name: dtype})
    rules.check_rank(fn, **{name: shape})
    return shape, dtype


def _to_compute(x: jax.Array) -> jax.Array:
    """Half types up to float32; float32 and float64 unchanged (no copy)."""
    return x.astype(rules.compute_dtype(x.dtype.name))


def _group_heads(x: jax.Array, groups: int) -> jax.Array:
    """``(..., heads, T, D)`` → ``(..., kv_heads, groups, T, D)``: query head ``h`` is
    ``(h // groups, h % groups)``, so it meets kv head ``h // groups``."""
    return x.reshape(x.shape[:-3] + (x.shape[-3] // groups, groups) + x.shape[-2:])


def _groups(x_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> int:
    return x_shape[-3] // kv_shape[-3] if len(x_shape) >= 3 else 1


def _merged(shape: tuple[int, ...], groups: int) -> tuple[int, ...]:
    """Undo ``_group_heads``: ``(..., kv_heads, groups, T, S)`` → ``(..., heads, T, S)``."""
    if groups == 1:
        return shape
    return shape[:-4] + (shape[-4] * shape[-3],) + shape[-2:]


def _dtype_name(x: Any) -> str:
    # The dtype as given, before JAX's x64 canonicalisation (int64 stays "int64" in messages).
    return np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype).name


def _check_device(fn: str, device: Any) -> Any:
    # JAX arrays live on a jax.Device; a platform name ("cpu", "gpu") means its first device.
    if device is None or isinstance(device, jax.Device):
        return device
    if isinstance(device, str):
        try:
            return jax.devices(device)[0]
        except RuntimeError:
            pass
    raise ValueError(
        f"{fn}: device must be None, a jax.Device or a platform name such as 'cpu'; "
        f"got device={device!r}"
    )


def _place(array: jax.Array, device: Any) -> jax.Array:
    # Only an explicit device moves the mask; None keeps JAX's default placement (and jit's).
    return array if device is None else jax.device_put(array, device)

