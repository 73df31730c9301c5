"""What the files of torch_attn share besides ``_core.py``'s steps: the sinks, each row's
log-sum-exp and the merging of partial results over disjoint keys (``spec.SINKS``,
``spec.MERGING``: the online softmax's step, the ring's and the paged decoder's); and a call's
chunks, ALiBi, segment ids and mods (``spec.MASKS_AND_MODS``) built from its validated
arguments, on the inputs' device, and the statuses of its tiles under them
(``spec.TILE_SKIPPING``). ``_core.py`` applies the mods to a tile (``_Mods``, ``_mods_scores``,
``_mods_allowed``: its mask step needs them); this file builds them and plans the tiles. Like
``_core``, a room whose private names every file of torch_attn may import; nothing here
validates. Imports run one way: ``_core < _extras < _tiles < blockwise < _blocked <
_blocked_vjp < _fast < functional < backward < modules`` (``context_parallel``, ``interop`` and
``integrations`` above; ``masks`` and ``kv_cache`` beside).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

import attention_rules as rules

from ._core import NEG_INF, _as_tensor, _describe, _in_band, _Mods, _mods_allowed

# ------------------------------------------------------------------------------------------
# Sinks, each row's log-sum-exp and merging partial results (spec.SINKS, spec.MERGING)
# ------------------------------------------------------------------------------------------


def _softmax_lse(
    scores: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last axis and each row's log-sum-exp ``(..., q_len)``: ``scores
    (..., heads, q_len, kv_len)``; ``sinks (heads,)`` (or None) join every row's denominator
    as a column without a value (``spec.SINKS``). A row that is all ``-inf`` gives weights 0
    and, without a sink, lse ``-inf``; its gradients are 0, never NaN."""
    if scores.shape[-1] == 0:  # no key at all: amax of an empty axis is an error in torch
        row_max = scores.new_full(scores.shape[:-1] + (1,), NEG_INF)
    else:  # (..., q_len, 1); a shift, without a gradient (softmax and lse are shift-invariant)
        row_max = scores.detach().amax(dim=-1, keepdim=True)
    if sinks is not None:  # the shift covers the sink too: exp(sink - max) <= 1
        sink = _sink_column(sinks, scores.ndim, scores)  # (heads, 1, 1)
        row_max = torch.maximum(row_max, sink.detach())
    row_max = torch.where(row_max == NEG_INF, 0.0, row_max)  # fully masked row: exp(-inf - 0)
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(dim=-1, keepdim=True)  # (..., q_len, 1)
    if sinks is not None:
        row_sum = row_sum + torch.exp(sink - row_max)
    empty = row_sum == 0.0  # no key, no sink
    safe_sum = torch.where(empty, 1.0, row_sum)  # where, not log(0): gradients stay finite
    lse = torch.where(empty, NEG_INF, row_max + torch.log(safe_sum))[..., 0]  # (..., q_len)
    return weights / safe_sum, lse


def _sink_column(sinks: torch.Tensor, ndim: int, like: torch.Tensor) -> torch.Tensor:
    """``(heads,)`` sink logits against rows ``(..., heads, q_len, 1)`` of rank ``ndim``:
    ``(heads, 1, 1)``, or ``(1, 1)`` for inputs without a heads axis, on ``like``'s device and
    in its dtype."""
    sinks = sinks.to(like.device, like.dtype)  # torch: dtype and device of the rows
    return sinks.reshape(tuple(sinks.shape) + (1, 1)) if ndim >= 3 else sinks.reshape(1, 1)


def _merge_attention(
    outputs: tuple[torch.Tensor, ...], lses: tuple[torch.Tensor, ...],
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial results over disjoint key sets of the same rows, each an output
    ``(..., rows, v_dim)`` and its log-sum-exp ``(..., rows, 1)`` (``-inf``: no key), merged
    into the attention over every key set and its log-sum-exp (``spec.MERGING``; the online
    softmax's step). ``sinks (heads,)`` join the denominator once: a part whose output is 0.
    Differentiable: a part with lse ``-inf`` gets gradient 0."""
    lses = list(lses)
    if sinks is not None:
        lses.append(_sink_column(sinks, outputs[0].ndim, lses[0]))
    row_max = functools.reduce(torch.maximum, [lse.detach() for lse in lses])  # (..., rows, 1)
    shift = torch.where(row_max == NEG_INF, 0.0, row_max)  # no -inf - -inf
    scales = [torch.exp(lse - shift) for lse in lses]  # exp(lse_i - max) <= 1; 0 for no key
    total = functools.reduce(torch.add, scales)
    empty = total == 0.0  # no key in any part
    safe_total = torch.where(empty, 1.0, total)
    lse = torch.where(empty, NEG_INF, shift + torch.log(safe_total))
    output = functools.reduce(torch.add, [a * out for a, out in zip(scales, outputs, strict=False)])
    return output / safe_total, lse


def _merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results over different keys of the same rows (``_merge_attention`` of two
    parts, the ring's step): outputs ``(..., rows, v_dim)``, lses ``(..., rows, 1)``
    (``-inf``: no key)."""
    return _merge_attention((out_a, out_b), (lse_a, lse_b), None)


def _with_sinks(
    output: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows finished over their keys by the online softmax, ``output (..., rows, v_dim)`` and
    ``lse (..., rows, 1)`` (``+inf`` for a row without a key, the tiles' convention), in the
    spec's terms: the sinks joined (``_merge_attention``) and ``-inf`` for a row without a key
    nor a sink."""
    lse = torch.where(lse == torch.inf, NEG_INF, lse)
    if sinks is None:
        return output, lse
    return _merge_attention((output,), (lse,), sinks)


def _describe_parts(fn: str, name: str, parts: Any) -> list[rules.ArrayInfo]:
    """``merge_attention``'s partial results as the rules see them: a list or tuple of arrays,
    ``name[i]`` each."""
    rules.check_parts(fn, name, parts)
    return [_describe(fn, f"{name}[{i}]", x) for i, x in enumerate(parts)]


# ------------------------------------------------------------------------------------------
# A call's chunks, ALiBi, segment ids and mods (spec.MASKS_AND_MODS), built; its tiles planned
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
    and ``mods``' rules, ``(n_q_blocks, n_kv_blocks)`` uint8 (over every batch entry and head):
    the chunk rule is arithmetic; segment ids and ``mask_mod`` are evaluated on every row of
    query blocks, over the keys the band and the chunks leave (``spec.TILE_SKIPPING``)."""
    base = np.array(rules.structural_statuses(q_len, kv_len, block_q, block_kv, lo, hi,
                                              mods.offset, mods.chunk_size), np.uint8)
    base = base.reshape(base.shape[0], -1)  # (n_q_blocks, n_kv_blocks), also when empty
    if mods.q_ids is None and mods.mask_mod is None:
        return base
    statuses = base.copy()
    for r, q0 in enumerate(range(0, q_len, block_q)):
        q1, kept = min(q0 + block_q, q_len), np.flatnonzero(base[r])
        if not kept.size:
            continue
        k0, k1 = int(kept[0]) * block_kv, min((int(kept[-1]) + 1) * block_kv, kv_len)
        with torch.no_grad():
            allowed = _mods_allowed(mods, q0, q1 - q0, k0, k1 - k0)
            if math.isfinite(lo) or math.isfinite(hi):
                allowed = allowed & _in_band(q0, q1 - q0, k0, k1 - k0, lo, hi, mods.device)
        allowed = np.broadcast_to(allowed.cpu().numpy(), allowed.shape[:-2] + (q1 - q0, k1 - k0))
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
