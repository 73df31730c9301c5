"""The blocked path of jax_attn, forward: the steps for ``BLOCK_Q`` queries at a time, for
large inputs on the CPU (``_fast/__init__.py`` selects it and gives it its ``jax.custom_vjp``,
whose backward pass is ``backward.py``'s).

The explicit steps materialise the whole ``(..., heads, q_len, kv_len)`` score array, and
XLA:CPU then streams it through memory several times (max, exp, sum, divide). Here
``blocked_forward`` runs the same steps for ``BLOCK_Q`` queries at a time under ``lax.map``,
so a block's scores stay in cache, with the division by the row sums moved after ``@ value``;
with a window (or a mask or bias, with the causal rule) the queries form at most ``SEGMENTS``
static segments, each against only the keys it can see (fully masked work is skipped); the
causal rule alone is cut into unmasked rectangles and a triangle halved again and again
(``_causal_forward``), which computes about half of the products. When the mask and the bias
are the same for every batch and head, one (batch, kv head) item runs at a time under an
outer ``lax.map``, its blocks grown to up to 4x ``BLOCK_Q`` rows while their scores stay
within ``BLOCK_SCORES`` entries (``slicing._grown``). Each step is ``_steps.py``'s own step
(``_scores``, ``_unnormalised_softmax``, ``_output``; ``_masking.py``'s ``_in_band``). The
block sizes ``(BLOCK_Q, BLOCK_KV, SEGMENTS, MOD_SEGMENTS, BLOCK_SCORES)`` are ``_fast``'s
constants, passed at each call (``blocks``).

Chunks, ALiBi, segment ids, ``score_mod`` and ``mask_mod`` (``spec.MASKS_AND_MODS``) take the
blocked path item by item too (each item with its own slopes, ids and head indices): each
block adds ALiBi and ``score_mod`` (with its global indices) and masks by the chunk rule, the
ids and ``mask_mod``; the rules that mask cut the queries into at most ``MOD_SEGMENTS``
static segments, each against only the keys their tiles leave (``_masking._mods_segments``,
decided at trace time from the tiles' statuses), so their empty tiles are not computed.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

import attention_rules as rules

from .. import _masking, _steps  # the steps the fast paths must equal, and reuse
from .._steps import NEG_INF, _merge_partials
from . import slicing
from .slicing import (
    _blocks,
    _cols,
    _halves,
    _pad_rows,
    _rows,
    _squeeze,
    _to_items,
    _triangle,
    _unblock,
    _unhalves,
)

# ------------------------------------------------------------------------------------------
# The blocked forward pass
# ------------------------------------------------------------------------------------------


def blocked_forward(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    args: rules.Arguments,
    with_lse: bool,
    mods: _masking._Mods | None = None,
    *,
    blocks: tuple[int, int, int, int, int],
) -> tuple[jax.Array, jax.Array | None]:
    """``_forward_heads`` for one (batch, kv head) item at a time under ``lax.map``; for all
    heads at once when there is one item or when the mask or bias varies along the batch or
    head axes (``_items``). Without a window (whose ``SEGMENTS`` are cut along the blocks) the
    blocks grow to 2x or 4x ``BLOCK_Q`` rows while their scores, the heads of one block ×
    rows × keys, stay within ``BLOCK_SCORES`` entries (``slicing._grown``: products large
    enough for XLA's threads, scores that stay in cache). Each item takes its own slopes, ids
    and indices of ``mods`` (``_masking._mods_item``), and the static segments are made once,
    over every item, before the ``lax.map``. ``blocks``: ``(BLOCK_Q, BLOCK_KV, SEGMENTS,
    MOD_SEGMENTS, BLOCK_SCORES)``, ``_fast``'s.

    Measured on 2 cores (AVX2, 8 heads of 2,048 tokens, ``benchmarks/RESULTS.md``): the items
    in grown blocks take 0.67–0.82x the time of every head at once in blocks of 128 rows,
    whose scores (8 MiB at 2,048 keys) leave the cache."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    items, blocks = slicing._item_blocks(query, key, mask, bias, args, blocks)
    BLOCK_Q, BLOCK_KV, SEGMENTS, MOD_SEGMENTS, _ = blocks
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
    masks = mods is not None and mods.masks
    pieces = _masking._mods_segments(mods, q_len, kv_len, lo, hi, True, BLOCK_Q, BLOCK_KV,
                                     MOD_SEGMENTS) if masks else None
    if items == 1:
        return _forward_heads(query, key, value, mask, bias, args, with_lse, mods, pieces,
                              blocks=blocks)
    mask, bias = _squeeze(mask), _squeeze(bias)  # the same for every item
    groups = query.shape[-3] // key.shape[-3]

    def one(xs: tuple) -> tuple:
        q, k, v, i = xs
        item_mods = None if mods is None else _masking._mods_item(mods, i, key.shape[-3], groups)
        return _forward_heads(q, k, v, mask, bias, args, with_lse, item_mods, pieces,
                              blocks=blocks)

    output, lse = jax.lax.map(one, (_to_items(query, items), _to_items(key, items),
                                    _to_items(value, items), jnp.arange(items, dtype=jnp.int32))
                              )  # (items, groups, q_len, v_dim), (items, groups, q_len, 1)
    lse = None if lse is None else lse.reshape(query.shape[:-1] + (1,))
    return output.reshape(query.shape[:-1] + value.shape[-1:]), lse


def _forward_heads(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    args: rules.Arguments,
    with_lse: bool,
    mods: _masking._Mods | None = None,
    pieces: list | None = None,
    *,
    blocks: tuple[int, int, int, int, int],
) -> tuple[jax.Array, jax.Array | None]:
    """The output in the compute dtype, ``BLOCK_Q`` queries at a time under ``lax.map`` (XLA
    keeps a block's scores in cache and spreads each op over the cores), normalising after
    ``@ value``; and, ``with_lse``, the row log-sum-exp ``(..., heads, q_len, 1)`` (``+inf`` on
    fully masked rows, so that ``exp(score - lse)`` is 0 there). With the causal rule or a
    window the queries are cut into at most ``SEGMENTS`` static segments, each against only the
    keys it can see; with ``mods`` that mask, into the segments of ``_masking._mods_segments``
    (``pieces``, when the caller made them already)."""
    BLOCK_Q, BLOCK_KV, SEGMENTS, MOD_SEGMENTS, _ = blocks  # _fast's, read at each call
    q_len, kv_len = query.shape[-2], key.shape[-2]
    compute = rules.compute_dtype(query.dtype.name)
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
    banded = lo > -math.inf or hi < math.inf  # the causal rule or a window cuts some blocks
    plain = mask is None and bias is None and mods is None
    if args.window is None and plain and banded:
        triangle = min(q_len - max(0, -int(hi)), kv_len - max(0, int(hi)))
        if triangle >= 2 * BLOCK_Q:  # the causal rule alone: halves, not segments
            output, lse = _causal_forward(query, key, value, args, blocks)
            return output, lse if with_lse else None
    if bias is not None:
        bias = bias.astype(compute)

    def block(q_blk, i0, k0, k_seg, v_seg, mask_seg, bias_seg):  # (..., heads, n, head_dim)
        n, keys = q_blk.shape[-2], k_seg.shape[-2]
        scores = _steps._scores(q_blk, k_seg, args.scale, args.softcap)  # (..., heads, n, keys)
        if bias_seg is not None:
            scores = scores + _rows(bias_seg, i0, n)
        scores = _masking._mods_scores(scores, mods, i0, k0)  # ALiBi, score_mod
        allowed = _rows(mask_seg, i0, n)
        if banded:  # j - i with global positions: i0 is traced, k0 static
            in_band = _masking._in_band(i0, n, k0, keys, lo, hi)
            allowed = in_band if allowed is None else allowed & in_band
        extra = _masking._mods_allowed(mods, i0, n, k0, keys)  # chunks, segment ids, mask_mod
        if extra is not None:
            allowed = extra if allowed is None else allowed & extra
        if allowed is not None:  # replaced, not added: a masked NaN does not spread
            scores = jnp.where(allowed, scores, NEG_INF)
        if not with_lse:
            weights, row_sum = _steps._unnormalised_softmax(scores)  # (..., heads, n, 1)
            return _steps._output(weights, v_seg) / row_sum, None  # (..., heads, n, v_dim)
        weights, row_sum, lse = _softmax_lse(scores)
        return _steps._output(weights, v_seg) / row_sum, lse

    if mods is not None and mods.masks:
        if pieces is None:
            pieces = _masking._mods_segments(mods, q_len, kv_len, lo, hi, True, BLOCK_Q, BLOCK_KV,
                                             MOD_SEGMENTS)
    else:
        n_blocks = q_len // BLOCK_Q
        segments = max(1, min(SEGMENTS, n_blocks)) if banded else 1
        bounds = [n_blocks * s // segments * BLOCK_Q for s in range(segments)] + [q_len]
        pieces = [(r0, r1) + rules.key_range(r0, r1, kv_len, lo, hi)[:2]
                  for r0, r1 in zip(bounds[:-1], bounds[1:], strict=True)]
    outputs, lses = [], []
    for r0, r1, k0, k1 in pieces:  # static segments of query rows, each with its keys
        rows_shape = query.shape[:-2] + (r1 - r0,)
        if k1 == k0:  # no row of the segment sees a key: fully masked
            outputs.append(jnp.zeros(rows_shape + (value.shape[-1],), compute))
            lses.append(jnp.full(rows_shape + (1,), jnp.inf, compute))
            continue
        segment = (k0, key[..., k0:k1, :], value[..., k0:k1, :],
                   _cols(mask, k0, k1 - k0), _cols(bias, k0, k1 - k0))
        full = (r1 - r0) // BLOCK_Q * BLOCK_Q  # rows in whole blocks; the rest is one block
        if full:
            starts = r0 + BLOCK_Q * jnp.arange(full // BLOCK_Q, dtype=jnp.int32)
            out, lse = jax.lax.map(
                lambda xs, segment=segment: block(xs[0], xs[1], *segment),
                (_blocks(query[..., r0 : r0 + full, :], BLOCK_Q), starts),
            )  # (blocks, ..., heads, BLOCK_Q, v_dim), (blocks, ..., heads, BLOCK_Q, 1)
            outputs.append(_unblock(out))
            lses.append(None if lse is None else _unblock(lse))
        if r0 + full < r1:
            out, lse = block(query[..., r0 + full : r1, :], r0 + full, *segment)
            outputs.append(out)
            lses.append(lse)
    output = jnp.concatenate(outputs, axis=-2)  # (..., heads, q_len, v_dim)
    return output, jnp.concatenate(lses, axis=-2) if with_lse else None


def _causal_forward(
    query: jax.Array, key: jax.Array, value: jax.Array, args: rules.Arguments,
    blocks: tuple[int, int, int, int, int],
) -> tuple[jax.Array, jax.Array]:
    """The causal rule alone (no mask, bias or window): output and row log-sum-exp of
    ``_forward_heads``, computing about half of the ``(q_len, kv_len)`` products.

    The allowed positions ``j <= i + offset`` are rectangles without any mask (the keys
    before the diagonal; with ``q_len > kv_len`` top-left, the rows below the last key) and
    one square triangle on the diagonal. The triangle of side ``n`` (padded to ``leaf · 2^d``,
    ``leaf <= BLOCK_Q``) is cut in halves again and again: at level ``l`` its ``2^l``
    rectangles ``(rows of the lower half) × (keys of the upper half)`` all have the same shape,
    so one ``_forward_heads`` call takes them as a batch axis; the ``2^d`` leaves on the
    diagonal are one causal call. Each piece gives its rows' output and log-sum-exp, and
    ``_merge_partials`` adds them up as the online softmax does. Segments instead compute
    ``(segments + 1) / (2 · segments)`` of the products, and their small blocks cost more
    per product."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    i0, c0, n, depth, side = _triangle(q_len, kv_len, args, blocks[0])
    plain = args._replace(is_causal=False, window=None)  # rectangles: every position allowed
    rows = query.shape[:-2] + (q_len,)
    output = jnp.zeros(rows + value.shape[-1:], rules.compute_dtype(query.dtype.name))
    lse = jnp.full(rows + (1,), NEG_INF, output.dtype)  # -inf: no key yet

    def add(r0: int, part: tuple[jax.Array, jax.Array]) -> None:
        nonlocal output, lse
        pad = [(0, 0)] * (output.ndim - 2) + [(r0, q_len - r0 - part[0].shape[-2]), (0, 0)]
        part_lse = jnp.where(part[1] == jnp.inf, NEG_INF, part[1])  # +inf: no key in the part
        output, lse = _merge_partials(output, lse, jnp.pad(part[0], pad),
                                      jnp.pad(part_lse, pad, constant_values=NEG_INF))

    if c0 > 0:  # every row from i0 sees keys [0, c0)
        add(i0, _forward_heads(query[..., i0:, :], key[..., :c0, :], value[..., :c0, :], None,
                               None, plain, True, blocks=blocks))
    if i0 + n < q_len:  # the rows below the triangle see keys [c0, kv_len) too
        add(i0 + n, _forward_heads(query[..., i0 + n :, :], key[..., c0:, :],
                                   value[..., c0:, :], None, None, plain, True,
                                   blocks=blocks))
    # the triangle padded to side: padded keys meet padded rows only
    tri = [_pad_rows(x[..., start : start + n, :], side)
           for x, start in ((query, i0), (key, c0), (value, c0))]
    out_tri = jnp.zeros(output.shape[:-2] + (side, output.shape[-1]), output.dtype)
    lse_tri = jnp.full(output.shape[:-2] + (side, 1), NEG_INF, output.dtype)
    for level in range(depth + 1):
        parts = 2**level
        if level < depth:  # rows of each lower half against keys of its upper half
            half = side // (2 * parts)
            q_l, k_l, v_l = (_halves(x, parts, half, lower) for x, lower in
                             zip(tri, (True, False, False), strict=True))
            part = _forward_heads(q_l, k_l, v_l, None, None, plain, True, blocks=blocks)
        else:  # the diagonal leaves, causal
            leaf = side // parts
            q_l, k_l, v_l = (_halves(x, parts, leaf, None) for x in tri)
            part = _forward_heads(q_l, k_l, v_l, None, None, args._replace(
                causal_alignment="top_left", window=None), True, blocks=blocks)
        part_lse = jnp.where(part[1] == jnp.inf, NEG_INF, part[1])  # +inf: no key
        part_out = _unhalves(part[0], level < depth, 0.0)
        part_lse = _unhalves(part_lse, level < depth, NEG_INF)
        out_tri, lse_tri = _merge_partials(out_tri, lse_tri, part_out, part_lse)
    add(i0, (out_tri[..., :n, :], lse_tri[..., :n, :]))
    empty = lse == NEG_INF  # rows that see no key: output 0, lse +inf (exp(s - lse) = 0)
    return output, jnp.where(empty, jnp.inf, lse)


def _softmax_lse(scores: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``_steps._unnormalised_softmax`` plus the row log-sum-exp ``max + log(sum)``
    (``+inf`` on a fully masked row)."""
    row_max = scores.max(axis=-1, keepdims=True, initial=NEG_INF)  # (..., n, 1)
    row_max = jnp.where(row_max == NEG_INF, 0.0, row_max)  # fully masked: exp(-inf - 0) = 0
    weights = jnp.exp(scores - row_max)
    row_sum = weights.sum(axis=-1, keepdims=True)  # (..., n, 1)
    empty = row_sum == 0.0
    row_sum = jnp.where(empty, 1.0, row_sum)  # 0 / 1 = 0 for fully masked rows
    return weights, row_sum, jnp.where(empty, jnp.inf, row_max + jnp.log(row_sum))
