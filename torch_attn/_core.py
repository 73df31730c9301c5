"""The unchecked steps of the pipeline and the array and head helpers every file of torch_attn
shares: scores, soft-cap, mask, softmax, dropout and output (``conformance/spec/functions.py``),
the chunks, ALiBi, segment ids and mods of ``_Mods`` applied to any tile (the mask step applies
them; ``_extras.py`` builds them, and holds the sinks, the log-sum-exp and the merges), the
gradient helpers for grouped heads and broadcast inputs, and the description, dtype and head
bookkeeping of tensors. Imports run one way: ``_core < _extras < _tiles < blockwise < _blocked
< _blocked_vjp < _fast < functional < backward < modules`` (``context_parallel``, ``interop``
and ``integrations`` above; ``masks`` and ``kv_cache`` beside); nothing here validates: the
public functions (``functional.py`` and the others) check their inputs once, with
``attention_rules``, then call these.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

import attention_rules as rules

NEG_INF = float("-inf")


# ------------------------------------------------------------------------------------------
# The steps, unchecked: each returns a fresh tensor (torch: none works in place, so autograd
# sees every step). The public functions validate, then call these.
# ------------------------------------------------------------------------------------------


def _scores(
    query: torch.Tensor, key: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """``(query @ keyᵀ) · scale``, soft-capped: query ``(..., heads, q_len, head_dim)`` and key
    ``(..., kv_heads, kv_len, head_dim)`` give ``(..., heads, q_len, kv_len)`` in the compute
    dtype (query head ``h`` meets kv head ``h // groups``)."""
    query = _to_compute(query) * scale  # (..., heads, q_len, head_dim); scaling q is cheapest
    key = _to_compute(key)  # (..., kv_heads, kv_len, head_dim)
    groups = _groups(query.shape, key.shape)
    if groups > 1:  # grouped-query: (..., kv_heads, groups, q_len, head_dim)
        query = _group_heads(query, groups)
        key = key[..., None, :, :]  # (..., kv_heads, 1, kv_len, head_dim)
    scores = query @ key.transpose(-1, -2)  # (..., [kv_heads, groups,] q_len, kv_len)
    scores = scores.reshape(_merged(scores.shape, groups))  # (..., heads, q_len, kv_len)
    return _softcap(scores, softcap)


def _softcap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap · tanh(scores / softcap)``; unchanged for None."""
    if softcap is not None:
        scores = torch.tanh(scores * (1.0 / softcap)) * softcap  # out of place, for autograd
    return scores


def _mask_scores(
    scores: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    mods: _Mods | None = None,
) -> torch.Tensor:
    """``scores (..., heads, q_len, kv_len)`` plus ``bias`` (and ALiBi, then ``score_mod``:
    ``mods``), then ``-inf`` wherever a position is not allowed (``_allowed``: True in ``mask``
    = may attend); out of place."""
    if bias is not None:
        scores = scores + bias.to(scores.device, scores.dtype)  # (..., heads, q_len, kv_len)
    scores = _mods_scores(scores, mods, 0, 0)
    q_len, kv_len = scores.shape[-2:]
    allowed = _allowed(q_len, kv_len, mask, is_causal, causal_alignment, window, scores.device,
                       mods)
    if allowed is not None:
        # replaced, not added: a NaN score at a masked position does not spread; gradient 0
        scores = scores.masked_fill(~allowed, NEG_INF)
    return scores


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


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis; rows that are all ``-inf`` become exactly 0 (so do their
    gradients: no ``-inf - -inf``, no ``0 / 0``)."""
    weights, row_sum = _unnormalised_softmax(scores)  # (..., q_len, kv_len), (..., q_len, 1)
    return weights / row_sum


def _unnormalised_softmax(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(scores - row max)`` and its row sums ``(..., q_len, 1)``; a row that is all
    ``-inf`` gives 0 and a row sum of 1, so dividing by it gives 0, never NaN."""
    if scores.shape[-1] == 0:  # no key at all: amax of an empty axis is an error in torch
        return scores.clone(), scores.new_ones(scores.shape[:-1] + (1,))
    row_max = scores.detach().amax(dim=-1, keepdim=True)  # (..., q_len, 1); shift, no gradient
    row_max = torch.where(row_max == NEG_INF, 0.0, row_max)  # fully masked row: exp(-inf - 0)
    scores = torch.exp(scores - row_max)
    row_sum = scores.sum(dim=-1, keepdim=True)  # (..., q_len, 1)
    row_sum = torch.where(row_sum == 0.0, 1.0, row_sum)  # 0 / 1 = 0 for fully masked rows
    return scores, row_sum


def _dropout(
    weights: torch.Tensor, dropout_p: float, dropout_mask: torch.Tensor | None, rng: Any
) -> torch.Tensor:
    """``weights (..., q_len, kv_len) · keep / (1 - dropout_p)``; the keep-mask (True = keep)
    is drawn from ``rng`` (a ``torch.Generator`` on the weights' device; None: torch's global
    one) when ``dropout_mask`` is None."""
    if dropout_mask is None:
        dropout_mask = _keep_mask(weights, dropout_p, rng)
    dropout_mask = dropout_mask.to(weights.device)  # a keep-mask made elsewhere joins weights
    return weights * dropout_mask * (1.0 / (1.0 - dropout_p))


def _keep_mask(weights: torch.Tensor, dropout_p: float, rng: Any) -> torch.Tensor:
    """A keep-mask shaped like ``weights (..., q_len, kv_len)``, on their device: True (keep)
    with probability ``1 - dropout_p``, drawn from ``rng`` (a ``torch.Generator`` on that
    device; None: torch's global one)."""
    return torch.rand(weights.shape, generator=rng, device=weights.device) >= dropout_p


def _output(weights: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``weights (..., heads, q_len, kv_len) @ value (..., kv_heads, kv_len, v_dim)`` with the
    grouped-query head mapping: ``(..., heads, q_len, v_dim)`` in the compute dtype."""
    value = _to_compute(value)  # (..., kv_heads, kv_len, v_dim)
    groups = _groups(weights.shape, value.shape)
    if groups > 1:
        weights = _group_heads(weights, groups)  # (..., kv_heads, groups, q_len, kv_len)
        value = value[..., None, :, :]  # (..., kv_heads, 1, kv_len, v_dim)
    output = weights.to(value.dtype) @ value
    return output.reshape(_merged(output.shape, groups))  # (..., heads, q_len, v_dim)


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
# Gradients: grouped heads and broadcast inputs
# ------------------------------------------------------------------------------------------


def _matmul_grouped(a: torch.Tensor, b: torch.Tensor, groups: int) -> torch.Tensor:
    """``a (..., heads, T, S) @ b (..., kv_heads, S, D)`` with the grouped-query head mapping."""
    if groups == 1:
        return a @ b
    product = _group_heads(a, groups) @ b[..., None, :, :]  # (..., kv_heads, groups, T, D)
    return product.reshape(a.shape[:-1] + (b.shape[-1],))  # (..., heads, T, D)


def _sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(..., heads, T, D)`` → ``(..., kv_heads, T, D)``: add the query heads sharing a kv head."""
    if groups == 1:
        return x
    return _group_heads(x, groups).sum(dim=-3)


def _sum_to_shape(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Sum ``x`` over the axes along which an array of ``shape`` was broadcast to ``x.shape``."""
    leading = x.ndim - len(shape)
    x = x.sum(dim=tuple(range(leading))) if leading else x
    stretched = tuple(axis for axis, size in enumerate(shape) if size == 1 and x.shape[axis] != 1)
    return x.sum(dim=stretched, keepdim=True) if stretched else x


# ------------------------------------------------------------------------------------------
# Arrays, dtypes, heads and devices
# ------------------------------------------------------------------------------------------


def _describe(fn: str, name: str, x: Any) -> rules.ArrayInfo | None:
    """What the rules see of an input: ``(shape, dtype name)``; None for None. A Python list,
    tuple or scalar is refused (TypeError): it has no dtype of its own."""
    if x is None:
        return None
    rules.check_array(fn, name, x)
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), _dtype_name(x)
    x = np.asarray(x)  # torch: NumPy arrays are welcome too, named as NumPy names them
    return tuple(x.shape), x.dtype.name


def _describe_lengths(kv_lengths: Any) -> rules.ArrayInfo | None:
    """``(shape, dtype name)`` of ``kv_lengths`` (a list of ints is welcome)."""
    if kv_lengths is None:
        return None
    if isinstance(kv_lengths, torch.Tensor):
        return tuple(kv_lengths.shape), _dtype_name(kv_lengths)
    kv_lengths = np.asarray(kv_lengths)  # torch: named as NumPy names them
    return tuple(kv_lengths.shape), kv_lengths.dtype.name


def _array(x: Any) -> torch.Tensor | None:
    """A validated input as a tensor (a tensor as is); None stays None."""
    return None if x is None else _as_tensor(x)


def _check_scores(fn: str, name: str, x: Any) -> rules.ArrayInfo:
    """A floating array of rank >= 2 (scores or weights); its ``(shape, dtype name)``."""
    shape, dtype = _describe(fn, name, x)
    rules.check_float_inputs(fn, **{name: dtype})
    rules.check_rank(fn, **{name: shape})
    return shape, dtype


def _to_compute(x: torch.Tensor) -> torch.Tensor:
    """Half types up to float32; float32 and float64 unchanged (no copy)."""
    return x.to(getattr(torch, rules.compute_dtype(_dtype_name(x))))


def _group_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
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


def _dtype_name(x: torch.Tensor) -> str:
    """torch's dtype name without the prefix: ``"float32"``, ``"bool"``, ``"int64"``…"""
    return str(x.dtype).removeprefix("torch.")


def _as_tensor(x: Any, device: Any = None) -> torch.Tensor:
    """torch only: a tensor as is (moved to ``device`` if given); anything else through NumPy,
    so Python lists get NumPy's dtypes (float64, int64) and messages match numpy_attn's."""
    if isinstance(x, torch.Tensor):
        return x if device is None else x.to(device)
    array = np.asarray(x)
    if array.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: torch reads it through float32
        return torch.from_numpy(array.astype(np.float32)).to(device, torch.bfloat16)
    return torch.as_tensor(array, device=device)


def _to_numpy(x: Any) -> np.ndarray:
    """torch only: a copy as a NumPy array (any shape); bfloat16 becomes ml_dtypes' bfloat16,
    as in the other backends."""
    if not isinstance(x, torch.Tensor):
        return np.array(x)
    x = x.detach().cpu()
    if x.dtype == torch.bfloat16:  # NumPy has no bfloat16 of its own
        import ml_dtypes

        return x.float().numpy().astype(ml_dtypes.bfloat16)
    return x.numpy().copy()
