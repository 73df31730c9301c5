"""What the files of torch_attn share besides ``_core.py``'s steps: the sinks, each row's
log-sum-exp and the merging of partial results over disjoint keys (``spec.SINKS``,
``spec.MERGING``: the online softmax's step, the ring's and the paged decoder's); and a call's
chunks, ALiBi, segment ids and mods (``spec.MASKS_AND_MODS``) built from its validated
arguments, on the inputs' device, and the statuses of its tiles under them
(``spec.TILE_SKIPPING``). ``_core.py`` applies the mods to a tile (``_Mods``, ``_mods_scores``,
``_mods_allowed``: its mask step needs them); this file builds them and plans the tiles (torch
only: also the runs and parts of keys of ``_fast.py``'s ``"sdpa_blocks"`` path, and the
autograd Function that merges parts computed by torch's private CPU kernel by their lse). Like
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


def _sdpa_runs(statuses: np.ndarray, tri: np.ndarray | None, block_q: int, block_kv: int,
               q_len: int, kv_len: int, split: bool) -> list[tuple[int, int, list]]:
    """torch only: ``_fast._sdpa_blocks``' runs of query rows, ``(r0, r1, parts)``, from the
    statuses of its ``(block_q, block_kv)`` tiles (``_mods_plan``; ``tri`` its triangles or
    None); ``parts``: the keys the rows see, ``[(k0, k1, kind)]`` in order, kind ``"all"``
    (every row sees every key), ``"causal"`` (the top-left triangle from ``k0``), ``"mask"``
    (some rows see some keys) or ``"none"`` (no row sees a key; never first or last). A block of
    rows joins the run before it when both see the same first and last key (the statuses
    combined: a tile stays ``ALL`` or ``NONE`` only where it is in both), or when both are
    ``"all"`` keys from the same first key and then a causal triangle on the same diagonal that
    the run's triangle continues (the run then is ``"all"`` keys and one larger triangle: with
    ``split`` only, else only without ``"all"`` keys, which one unmasked call must otherwise
    compute)."""
    runs: list[list] = []  # [r0, r1, statuses row, parts]
    for r, row in enumerate(statuses):
        r0, r1 = r * block_q, min((r + 1) * block_q, q_len)
        parts = _run_parts(row, None if tri is None else tri[r], block_kv, kv_len)
        if runs and not parts and not runs[-1][3]:  # rows that see no key: one run of 0
            runs[-1][1] = r1
            continue
        if runs and parts and runs[-1][3]:
            last = runs[-1]
            joined = _join_triangles(last[0], last[1], last[3], r0, parts, split)
            if joined is not None:
                last[1], last[3] = r1, joined
                last[2] = row.copy()
                last[2][joined[-1][0] // block_kv : joined[-1][1] // block_kv] = rules.SOME
                continue
            if (last[3][0][0], last[3][-1][1]) == (parts[0][0], parts[-1][1]):
                last[1], last[2] = r1, np.where(last[2] == row, row, rules.SOME)
                last[3] = _run_parts(last[2], None, block_kv, kv_len)
                continue
        runs.append([r0, r1, row, parts])
    return [(r0, r1, parts) for r0, r1, _, parts in runs]


def _run_parts(row: np.ndarray, tri: np.ndarray | None, block_kv: int, kv_len: int) -> list:
    """torch only: a row of tile statuses as ``_sdpa_runs``' parts (``tri``: its triangles)."""
    seen = np.flatnonzero(row)
    if not seen.size:
        return []
    cols = np.arange(int(seen[0]), int(seen[-1]) + 1)
    starts = cols[np.r_[True, row[cols[1:]] != row[cols[:-1]]]]  # runs of one status
    kinds = {rules.ALL: "all", rules.SOME: "mask", rules.NONE: "none"}
    return [(int(a) * block_kv, min(int(b) * block_kv, kv_len), "causal" if row[a] ==
             rules.SOME and tri is not None and tri[a] else kinds[int(row[a])])
            for a, b in zip(starts, np.r_[starts[1:], cols[-1] + 1], strict=True)]


def _join_triangles(a0: int, a1: int, mine: list, b0: int, theirs: list, split: bool
                    ) -> list | None:
    """torch only: the parts of a run of rows ``a0:a1`` (``mine``) joined with the next block
    of rows from ``b0 == a1`` (``theirs``) when both are ``"all"`` keys from the same key and
    then a causal triangle, on the same diagonal (``r0 - k0`` of the triangle), and the run's
    triangle is at least as wide as its rows (its last row sees no key after it); else None."""
    forms = []
    for parts in (mine, theirs):
        if parts[-1][2] != "causal" or len(parts) > 2 or (len(parts) == 2 and
                                                           parts[0][2] != "all"):
            return None
        forms.append((parts[0][0], parts[-1][0], parts[-1][1]))  # first key, triangle, end
    (k0, p, e), (k0b, pb, eb) = forms
    if k0 != k0b or a0 - p != b0 - pb or a1 - a0 > e - p or eb < e or (k0 < p and not split):
        return None
    return ([(k0, p, "all")] if k0 < p else []) + [(p, eb, "causal")]


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


# ------------------------------------------------------------------------------------------
# torch only: SDPA's CPU kernel over parts of the keys, merged by their log-sum-exp
# ------------------------------------------------------------------------------------------

try:  # private: torch's fused CPU kernel returning each row's lse, and its backward pass
    _ATEN = torch.ops.aten
    _FLASH_CPU = _ATEN._scaled_dot_product_flash_attention_for_cpu.default
    _FLASH_CPU_BACKWARD = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward.default
except (AttributeError, RuntimeError):  # another torch: _fast.py takes one masked call instead
    _FLASH_CPU = _FLASH_CPU_BACKWARD = None


class _FlashParts(torch.autograd.Function):
    """torch only: attention of ``query (B, H, rows, D)`` over disjoint parts of ``key`` and
    ``value`` ``(B, H, S, D)`` (``parts``: ``[(k0, k1, is_causal, float mask or None)]``,
    masks ``(rows, k1 - k0)`` or ``(B, H, rows, k1 - k0)``, ``-inf`` where not allowed), one
    call of SDPA's fused CPU kernel each, merged by their log-sum-exp (``spec.MERGING``):
    output ``(B, H, rows, D)``. Backward: the kernel's backward pass per part, given the MERGED
    output and lse (flash attention's split backward: ``P = exp(s - lse)`` is then each key's
    final weight, ``rowsum(dO · O)`` the whole row's), gives that part's exact dK, dV and its
    share of dQ. A row with no key in any part gives 0, gradient 0."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                parts: list, scale: float) -> torch.Tensor:
        """The merged output ``(B, H, rows, D)``."""
        outs, lses = [], []
        for k0, k1, causal, mask in parts:
            out, lse = _FLASH_CPU(query, key[:, :, k0:k1], value[:, :, k0:k1], 0.0, causal,
                                  attn_mask=mask, scale=scale)  # (B, H, rows, D), (B, H, rows)
            if mask is not None:  # the kernel's lse of a row without a key is 0: -inf here
                lse = lse.masked_fill(~(mask > NEG_INF).any(dim=-1), NEG_INF)
            outs.append(out)
            lses.append(lse)
        row_max = functools.reduce(torch.maximum, lses)
        shift = torch.where(row_max == NEG_INF, 0.0, row_max)
        scales = [torch.exp(lse - shift) for lse in lses]  # small: (B, H, rows)
        total = functools.reduce(torch.add, scales)
        empty = total == 0.0  # no key in any part
        safe = torch.where(empty, 1.0, total)
        output = outs[0] * (scales[0] / safe)[..., None]
        for out, a in zip(outs[1:], scales[1:], strict=True):
            output.addcmul_(out, (a / safe)[..., None])
        # the backward's lse: the kernel's own 0 for a row without a key (exp(-inf - 0) = 0)
        lse = torch.where(empty, 0.0, shift + torch.log(safe))
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.parts, ctx.scale = parts, scale
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        """dQ, dK, dV from each part's backward pass with the merged output and lse."""
        query, key, value, output, lse = ctx.saved_tensors
        grad = grad.contiguous()
        grad_q, grad_k, grad_v = None, torch.zeros_like(key), torch.zeros_like(value)
        for k0, k1, causal, mask in ctx.parts:
            gq, gk, gv = _FLASH_CPU_BACKWARD(grad, query, key[:, :, k0:k1], value[:, :, k0:k1],
                                             output, lse, 0.0, causal, attn_mask=mask,
                                             scale=ctx.scale)
            grad_q = gq if grad_q is None else grad_q.add_(gq)
            grad_k[:, :, k0:k1] = gk
            grad_v[:, :, k0:k1] = gv
        return grad_q, grad_k, grad_v, None, None
