"""The unchecked steps of the pipeline and the array and head helpers every file of numpy_attn
shares: scores, soft-cap, mask, softmax, dropout and output (``conformance/spec/functions.py``),
the chunks, ALiBi, segment ids and mods of ``_Mods`` applied to any tile (the mask step applies
them; ``_extras.py`` builds them, and holds the sinks, the log-sum-exp and the merges), the
gradient helpers for grouped heads and broadcast inputs, and the description, dtype and head
bookkeeping of arrays. Imports run one way: ``_core < _extras < _tiles < blockwise < _blocked <
_blocked_vjp < _fast < functional < backward < modules`` (``context_parallel`` above; ``masks``,
``kv_cache`` and ``_threads`` beside); nothing here validates: the public functions
(``functional.py`` and the others) check their inputs once, with ``attention_rules``, then call
these.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

import attention_rules as rules

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
        dropout_mask = _keep_mask(weights, dropout_p, rng)
    return weights * dropout_mask * (1.0 / (1.0 - dropout_p))


def _keep_mask(weights: np.ndarray, dropout_p: float, rng: Any) -> np.ndarray:
    """A keep-mask shaped like ``weights (..., q_len, kv_len)``: True (keep) with probability
    ``1 - dropout_p``, drawn from ``rng`` (a fresh ``default_rng()`` for None)."""
    rng = np.random.default_rng() if rng is None else rng
    return rng.random(weights.shape, dtype=np.float32) >= dropout_p


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
