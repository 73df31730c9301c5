"""The route of torch_attn's fast path through torch's fused ``scaled_dot_product_attention``
(SDPA): ``"sdpa"`` and ``"sdpa_blocks"`` (``use_fast_path``, in ``_fast/__init__.py``, says when
each is taken).

``"sdpa"``, whole (``_sdpa_attention``): the boolean mask, the causal rule and the window become
ONE explicit boolean ``attn_mask`` (SDPA's own ``is_causal`` when nothing else is to be combined
and the rule is top-left, or ``q_len == kv_len`` where both alignments coincide); the causal
rule bottom-right alone with ``q_len != kv_len`` takes no mask of ours
(``_bottom_right_attention``); a bias becomes one float ``attn_mask``, ``-inf`` where not
allowed; grouped-query heads go through ``enable_gqa``; ``v_dim != head_dim`` and 2-D inputs
are supported; float16/bfloat16 are given to SDPA as float32 copies (the spec's float32
weighted sum: SDPA's half kernels round the weights to the half type before ``weights @
value``). Fully masked rows: on the CPU SDPA gives output and gradient exactly 0 (torch >= 2.13,
checked by the tests); on other devices they are given every key for the kernel and their
output is zeroed afterwards, so no kernel meets an empty row.

``"sdpa_blocks"`` (``_sdpa_blocks``): chunks, ALiBi, segment ids or ``mask_mod``
(``spec.MASKS_AND_MODS``) without ``score_mod``: SDPA per run of query rows that see the same
keys, against only those keys (the blocks of ``SDPA_ROWS`` rows and ``SDPA_KEYS`` keys the band
and the rules leave, ``_masking._mods_plan``; the runs and their parts of keys,
``blocks._sdpa_runs``): the tiles the rules empty are never computed. A run's keys are parts:
all allowed (no mask), SDPA's own causal triangle (found by evaluating the rules: a causal
``mask_mod`` is ONE call with ``is_causal=True``), partly allowed (a float mask), none
(skipped). Several parts with a triangle or a gap go to torch's private CPU kernel, which
returns the lse, once per part, merged by lse (``blocks._FlashParts``; without that kernel, in
other torch versions, one masked call over the run's keys: ``_sdpa_blocks`` says when).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import attention_rules as rules

from .._arrays import _groups, _to_compute
from .._masking import _add_alibi, _allowed, _in_band, _Mods, _mods_allowed, _mods_plan
from .._steps import NEG_INF
from .blocks import _FLASH_CPU, _FlashParts, _sdpa_runs

SDPA_ROWS = 256  # "sdpa_blocks": query rows per block of the plan (runs of them are one call)
SDPA_KEYS = 128  # "sdpa_blocks": keys per block of the plan (the mask covers only cut blocks)
SDPA_MAX_PARTS = 4  # "sdpa_blocks": more parts of keys than this: one masked call for the run

# CPU SDPA gives fully masked rows an output and a gradient of exactly 0 (checked on torch 2.13
# by tests/test_torch_fast_path.py); other devices and older versions are not relied upon.
CPU_SDPA_ZEROES_MASKED_ROWS = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


def causal_lower_right(*size: int):
    """torch's ``causal_lower_right(*size)``, imported at the first call: its module,
    ``torch.nn.attention.bias``, imports ``torch._dynamo``, which would double the cost of
    ``import torch_attn``."""
    from torch.nn.attention.bias import causal_lower_right as torch_causal_lower_right

    return torch_causal_lower_right(*size)


# ------------------------------------------------------------------------------------------
# "sdpa": the whole pipeline in one SDPA call
# ------------------------------------------------------------------------------------------


def _sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    scale: float,
) -> torch.Tensor:
    """The whole pipeline in one SDPA call, in the input dtype (``torch.compile``-able)."""
    dtype = query.dtype
    query, key, value = _to_compute(query), _to_compute(key), _to_compute(value)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    sdpa_causal = is_causal and mask is None and bias is None and window is None
    if sdpa_causal and causal_alignment == "bottom_right" and q_len != kv_len:
        return _bottom_right_attention(query, key, value, scale).to(dtype)
    # SDPA's is_causal is top-left, which bottom-right equals when q_len == kv_len
    attn_mask = None
    if not sdpa_causal:
        attn_mask = _allowed(q_len, kv_len, mask, is_causal, causal_alignment, window, query.device)
    if bias is not None:  # one float mask: bias where allowed, -inf elsewhere
        float_mask = bias.to(query.device, query.dtype)
        attn_mask = float_mask if attn_mask is None else float_mask.masked_fill(~attn_mask, NEG_INF)
    row_ok = None
    if attn_mask is not None and not (query.device.type == "cpu" and CPU_SDPA_ZEROES_MASKED_ROWS):
        allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > NEG_INF
        row_ok = allowed.any(dim=-1, keepdim=True)  # (..., q_len, 1): the row keeps a key
        if attn_mask.dtype == torch.bool:
            attn_mask = attn_mask | ~row_ok  # a fully masked row attends everything...
        else:
            attn_mask = torch.where(row_ok, attn_mask, 0.0)
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, is_causal=sdpa_causal, scale=scale,
        enable_gqa=_groups(query.shape, key.shape) > 1,
    )  # (..., heads, q_len, v_dim)
    if row_ok is not None:
        output = torch.where(row_ok, output, 0.0)  # ...and is zeroed here, gradient 0 too
    return output.to(dtype)


def _bottom_right_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """The causal rule bottom-right alone, ``q_len != kv_len``, without a ``(q_len, kv_len)``
    mask of ours: query ``(..., heads, q_len, head_dim)``, key ``(..., kv_heads, kv_len,
    head_dim)`` and value ``(..., kv_heads, kv_len, v_dim)`` in the compute dtype give
    ``(..., heads, q_len, v_dim)``.

    ``q_len > kv_len``: the first ``q_len - kv_len`` queries see no key (0, gradient 0) and the
    last ``kv_len`` meet the keys in a square, where bottom-right is SDPA's top-left
    ``is_causal``: no mask at all, on every device. ``q_len < kv_len`` (every row keeps a key):
    torch's ``causal_lower_right`` bias, served without a mask by CUDA's memory-efficient
    kernel; torch 2.13's CPU SDPA has no lower-right kernel, so torch builds the boolean itself
    (``torch.tril``, 1 byte per entry: 1 MiB at 512 × 2,048, against 11 MiB for our int64
    distance and its comparisons) before its own float copy of it. Under ``torch.compile`` the
    band is our boolean mask, as before (a graph cannot build a ``CausalBias``)."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    enable_gqa = _groups(query.shape, key.shape) > 1
    if q_len < kv_len:
        if torch.compiler.is_compiling():  # torch 2.13 traces no new CausalBias: our mask
            attn_mask = _allowed(q_len, kv_len, None, True, "bottom_right", None, query.device)
        else:
            attn_mask = causal_lower_right(q_len, kv_len)
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa
        )  # (..., heads, q_len, v_dim)
    empty = q_len - kv_len  # rows whose every key lies in their future
    seen = F.scaled_dot_product_attention(
        query[..., empty:, :], key, value, is_causal=True, scale=scale, enable_gqa=enable_gqa
    )  # (..., heads, kv_len, v_dim)
    zeros = seen.new_zeros(seen.shape[:-2] + (empty, seen.shape[-1]))  # (..., heads, empty, v)
    return torch.cat([zeros, seen], dim=-2)  # (..., heads, q_len, v_dim)


# ------------------------------------------------------------------------------------------
# "sdpa_blocks": SDPA per run of query rows, against only the keys they see
# ------------------------------------------------------------------------------------------


def _sdpa_blocks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    args: rules.Arguments,
    mods: _Mods,
) -> torch.Tensor:
    """Chunks, ALiBi, segment ids or ``mask_mod`` without ``score_mod``: SDPA on each run of
    query rows that see the same keys, against only those keys. The rules are evaluated once
    per group of blocks of ``SDPA_ROWS`` rows and ``SDPA_KEYS`` keys (``_masking._mods_plan``:
    each tile ``ALL``, ``SOME`` or ``NONE``, and which runs of ``SOME`` tiles are exactly a
    causal triangle); ``blocks._sdpa_runs`` joins the blocks of rows into runs and splits
    their keys into parts (``"all"``, ``"causal"``, ``"mask"``, ``"none"``). A run is then:

    * one part ``"all"`` or ``"causal"`` (no bias, ALiBi or boolean mask): one SDPA call
      without a mask, SDPA's own ``is_causal`` for a triangle (a causal ``mask_mod`` joins all
      its rows into one run: one call, as ``is_causal=True``);
    * several parts of which one is a triangle or a gap of ``"none"`` keys, at most
      ``SDPA_MAX_PARTS`` (no bias, ALiBi or mask; on the CPU, with torch's private
      ``_scaled_dot_product_flash_attention_for_cpu``, which returns the lse, and
      ``head_dim == v_dim``, the batch axes of query, key and value equal, not under
      ``torch.compile``): one call of that kernel per part, the gap skipped, merged by their
      lse (``blocks._FlashParts``, whose backward pass is the kernel's per part);
    * else (and where that private kernel is missing: other torch versions) one SDPA call over
      all the run's keys, with a float mask over the keys from its first part that is not
      ``"all"`` to its last (the band and the rules there, ``-inf`` where not allowed; with a
      bias or ALiBi, a float mask over all of them).

    A triangle is found only where it starts at a block's first row and a key block's first
    key (a causal ``mask_mod`` with an offset that is not a multiple of the blocks is partly
    allowed there: masked). More than ``SDPA_MAX_PARTS`` parts take one masked call: on a
    loaded CPU each call and each merge costs about as much as the work a part skips.
    Rows that see no key give 0. Output ``(..., heads, q_len, v_dim)`` in the input dtype."""
    dtype = query.dtype
    query, key, value = _to_compute(query), _to_compute(key), _to_compute(value)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
    plain = mask is None and bias is None and mods.alibi is None
    split = plain and _FLASH_CPU is not None and query.device.type == "cpu" and \
        query.shape[-1] == value.shape[-1] and query.shape[:-3] == key.shape[:-3] == \
        value.shape[:-3] and not torch.compiler.is_compiling()
    statuses, tri = _mods_plan(mods, q_len, kv_len, SDPA_ROWS, SDPA_KEYS, lo, hi, plain)
    runs = _sdpa_runs(statuses, tri, SDPA_ROWS, SDPA_KEYS, q_len, kv_len, split)
    spans = [(parts[0][0], parts[-1][1]) if parts else (0, 0) for _, _, parts in runs]
    keys, values = _key_spans(key, spans), _key_spans(value, spans)
    outputs = []
    for (r0, _, parts), rows, (k0, _), k, v in zip(
            runs, query.split([r1 - r0 for r0, r1, _ in runs], dim=-2), spans, keys, values,
            strict=True):
        kept = [part for part in parts if part[2] != "none"]
        if not kept:  # no row of the run sees a key: 0, gradient 0
            outputs.append(_no_key(rows, k, v, value.shape[-1]))
        elif plain and len(kept) == 1 and kept[0][2] != "mask":  # no mask at all
            outputs.append(F.scaled_dot_product_attention(
                rows, k, v, is_causal=kept[0][2] == "causal", scale=args.scale,
                enable_gqa=_groups(query.shape, key.shape) > 1))
        elif split and len(kept) <= SDPA_MAX_PARTS and (
                len(kept) < len(parts) or any(kind == "causal" for _, _, kind in kept)):
            outputs.append(_flash_parts(rows, k, v, r0, k0, kept, mods, lo, hi, args.scale))
        else:
            outputs.append(_sdpa_run(rows, k, v, mask, bias, args, mods, r0, k0, parts,
                                     (lo, hi)))
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-2)
    return output.to(dtype)


def _no_key(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_dim: int) -> torch.Tensor:
    """The output of query rows ``(..., rows, head_dim)`` that see no key: 0 ``(..., rows,
    v_dim)``, yet in the autograd graph of the query, key and value (a ``where`` that never
    picks them: gradient exactly 0, also for a NaN value), so ``backward`` runs on a fully
    masked input as on any other."""
    zeros = rows.new_zeros(rows.shape[:-1] + (v_dim,))
    anchor = rows.sum() + k.sum() + v.sum()  # () the inputs, never picked
    return torch.where(torch.zeros((), dtype=torch.bool, device=rows.device), anchor, zeros)


def _key_spans(x: torch.Tensor, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """``x[..., k0:k1, :]`` for each ``(k0, k1)`` of ``spans``. When no span starts or ends
    inside another, from ONE ``torch.split`` of ``x`` (as the rows, which the runs partition):
    autograd then joins their gradients in one concatenation, where a slice's gradient is a
    zero tensor of ``x``'s size filled and added per run (most of the backward pass of
    chunked attention at 4,096 tokens)."""
    bounds = sorted({0, x.shape[-2]}.union(*spans))
    if any(k0 < b < k1 for k0, k1 in spans for b in bounds):
        return [x[..., k0:k1, :] for k0, k1 in spans]
    sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    pieces = dict(zip(bounds, x.split(sizes, dim=-2), strict=False))
    return [pieces[k0] if k1 > k0 else x[..., :0, :] for k0, k1 in spans]


def _flash_parts(
    rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor, r0: int, k0: int, parts: list,
    mods: _Mods, lo: float, hi: float, scale: float,
) -> torch.Tensor:
    """One run's rows ``(..., heads, rows, D)`` from ``r0`` against its keys and values from
    ``k0`` (``(..., kv_heads, keys, D)``) in ``parts`` (not ``"none"``), one call of torch's
    private CPU kernel each (``blocks._FlashParts``): the inputs as ``(batch, heads, T, D)``,
    kv heads repeated for the query heads they serve, a ``"mask"`` part given the band and the
    rules as a float mask. Output ``(..., heads, rows, D)``."""
    n, heads = rows.shape[-2], (rows.shape[-3] if rows.ndim >= 3 else 1)
    groups = _groups(rows.shape, key.shape)
    four = [x.reshape((-1, x.shape[-3] if x.ndim >= 3 else 1) + x.shape[-2:])
            for x in (rows, key, value)]
    if groups > 1:  # the kernel has no grouped heads: each kv head once per query head
        four[1:] = [x.repeat_interleave(groups, dim=1) for x in four[1:]]
    flash = []
    for s0, s1, kind in parts:
        attn_mask = None
        if kind == "mask":
            allowed = _mods_allowed(mods, r0, n, s0, s1 - s0)
            if math.isfinite(lo) or math.isfinite(hi):
                band = _in_band(r0, n, s0, s1 - s0, lo, hi, rows.device)
                allowed = band if allowed is None else allowed & band
            if allowed.ndim > 2:  # per batch entry or head: (batch, heads, rows, keys)
                allowed = allowed.broadcast_to(rows.shape[:-2] + (n, s1 - s0)).reshape(
                    (-1, heads, n, s1 - s0))
            else:
                allowed = allowed.broadcast_to((n, s1 - s0))
            attn_mask = rows.new_zeros(allowed.shape).masked_fill_(~allowed, NEG_INF)
        flash.append((s0 - k0, s1 - k0, kind == "causal", attn_mask))
    output = _FlashParts.apply(*four, flash, scale)  # (batch, heads, rows, D)
    return output.reshape(rows.shape)


def _sdpa_run(
    rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    bias: torch.Tensor | None, args: rules.Arguments, mods: _Mods, r0: int, k0: int,
    parts: list, band: tuple[float, float],
) -> torch.Tensor:
    """One run's rows ``(..., heads, rows, head_dim)`` from ``r0`` in one SDPA call over all
    its keys and values from ``k0`` (``parts``; ``(..., kv_heads, keys, D)``), with one float
    mask (SDPA on the CPU takes it faster than a boolean one): the bias and ALiBi, ``-inf``
    where the mask, or the band (``(lo, hi)``) and the rules on the keys from the first part
    that is not ``"all"`` to the last, forbid; None when nothing is to be added or masked.
    Output ``(..., heads, rows, v_dim)``."""
    device, n, rank = rows.device, rows.shape[-2], len(args.scores_shape)
    k1, (lo, hi) = parts[-1][1], band
    r1, keys = r0 + n, k1 - k0
    cut = [part for part in parts if part[2] != "all"]
    p0, p1 = (cut[0][0], cut[-1][1]) if cut else (k0, k0)
    part = None  # the band and the rules on the cut keys [p0, p1)
    if p1 > p0:
        part = _mods_allowed(mods, r0, n, p0, p1 - p0)
        if math.isfinite(lo) or math.isfinite(hi):
            in_band = _in_band(r0, n, p0, p1 - p0, lo, hi, device)
            part = in_band if part is None else part & in_band
    attn_mask = None
    if bias is not None or mods.alibi is not None or mask is not None or part is not None:
        lead = () if part is None else tuple(part.shape[:-2])  # rules per batch or head
        attn_mask = rows.new_zeros(lead + (n, keys))
    if part is not None:  # in place, on the new zeros
        attn_mask[..., p0 - k0 : p1 - k0].masked_fill_(~part, NEG_INF)
    if bias is not None:
        whole = bias.reshape((1,) * (rank - bias.ndim) + tuple(bias.shape))
        attn_mask = attn_mask + whole[..., _span(whole, r0, r1, -2),
                                      _span(whole, k0, k1, -1)].to(device, rows.dtype)
    if mods.alibi is not None:
        attn_mask = _add_alibi(attn_mask, mods, r0, k0)
    if mask is not None:
        whole = mask.reshape((1,) * (rank - mask.ndim) + tuple(mask.shape))
        attn_mask = attn_mask.masked_fill(~whole[..., _span(whole, r0, r1, -2),
                                                 _span(whole, k0, k1, -1)].to(device), NEG_INF)
    row_ok = None
    if attn_mask is not None and not (device.type == "cpu" and CPU_SDPA_ZEROES_MASKED_ROWS):
        row_ok = (attn_mask > NEG_INF).any(dim=-1, keepdim=True)  # the row keeps a key
        attn_mask = torch.where(row_ok, attn_mask, 0.0)
    out = F.scaled_dot_product_attention(
        rows, key, value, attn_mask=attn_mask, scale=args.scale,
        enable_gqa=_groups(rows.shape, key.shape) > 1,
    )  # (..., heads, rows, v_dim)
    return out if row_ok is None else torch.where(row_ok, out, 0.0)


def _span(x: torch.Tensor, start: int, stop: int, axis: int) -> slice:
    """``start:stop`` along ``axis`` of a mask or bias, or all of a broadcast (size-1) axis."""
    return slice(None) if x.shape[axis] == 1 else slice(start, stop)
