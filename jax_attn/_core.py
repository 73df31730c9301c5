"""The unchecked pipeline steps and the array/head helpers that every file of jax_attn shares.

The steps (scores, soft-cap, mask, softmax, dropout, weighted sum) take arrays that the public
functions have already validated; the chunks, ALiBi, segment ids and mods of ``_Mods`` are
applied to any tile here (the mask step applies them; ``_extras.py`` builds them, and holds
the sinks, the log-sum-exp and the merges); the gradient helpers serve the hand-written
backward passes (``_tiles.py``, the blocked fast path); the array helpers describe inputs for
the rules, map query heads onto kv heads and place arrays on devices. Imports run one way:
``_core < _extras < _tiles < blockwise < _blocked < _blocked_vjp < _fast < functional <
backward < modules`` (``context_parallel`` and ``integrations`` above); nothing here validates
(the public functions in ``functional.py`` do, with ``attention_rules``).
"""

from __future__ import annotations

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
        dropout_mask = _keep_mask(weights, dropout_p, rng)
    return weights * dropout_mask * (1.0 / (1.0 - dropout_p))


def _keep_mask(weights: jax.Array, dropout_p: float, rng: Any) -> jax.Array:
    """A keep-mask shaped like ``weights (..., q_len, kv_len)``: True (keep) with probability
    ``1 - dropout_p``, drawn from ``rng``, an explicit ``jax.random`` key (checked by
    ``_check_rng``), never hidden global state."""
    return jax.random.uniform(rng, weights.shape, dtype=jnp.float32) >= dropout_p


def _output(weights: jax.Array, value: jax.Array) -> jax.Array:
    value = _to_compute(value)  # (..., kv_heads, kv_len, v_dim)
    groups = _groups(weights.shape, value.shape)
    if groups > 1:
        weights = _group_heads(weights, groups)  # (..., kv_heads, groups, q_len, kv_len)
        value = value[..., None, :, :]  # (..., kv_heads, 1, kv_len, v_dim)
    output = jnp.matmul(weights.astype(value.dtype), value, precision=HIGHEST)  # explicit
    return output.reshape(_merged(output.shape, groups))  # (..., heads, q_len, v_dim)


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

