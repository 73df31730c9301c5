"""The blocked path of jax_attn, backward: its own pass, ``blocked_attention_vjp`` (the
blocked path is a ``jax.custom_vjp``, ``_fast._blocked_attention_lse``: autodiff through
``lax.map`` would store every block's weights, the whole ``(q_len, kv_len)`` matrix).

The forward pass (``forward.py``) saves the output and the row log-sum-exp, and
``blocked_attention_vjp`` walks ``BLOCK_KV`` keys at a time under ``lax.scan`` against the
query rows that can see them, recomputing the weights from the log-sum-exp (FlashAttention-2's
backward; with the causal rule or a window, ``SEGMENTS`` static segments of keys skip the
masked rows). The causal rule alone takes those segments too, not the forward pass's halved
triangle: on 2 cores (AVX2, 8 heads) the triangle's smaller products made forward + backward
1.16x slower at 2,048 and 4,096 tokens (``benchmarks/RESULTS.md``). No
array is ``(q_len, kv_len)`` (``tests/test_fast_backward_jax.py``: float64 gradients against
JAX's autodiff of the explicit steps and the NumPy reference): ``jax.grad`` of
``scaled_dot_product_attention`` and ``scaled_dot_product_attention_vjp`` reach it through
``jax.vjp`` of the forward pass. With chunks, segment ids or ``mask_mod`` the keys form at most
``MOD_SEGMENTS`` static segments, each against only the rows their tiles leave; ``score_mod``
is differentiated per block by ``jax.vjp``. The block sizes are ``_fast``'s constants,
passed at each call (``blocks``). Figures: ``benchmarks/jax_backward.py`` and
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

import attention_rules as rules

from .. import _arrays, _masking, _steps  # the steps the fast paths must equal, and reuse
from .._steps import NEG_INF, _sum_groups, _sum_to_shape
from . import slicing
from .slicing import (
    _blocks,
    _cols,
    _rows,
    _squeeze,
    _to_items,
    _unblock,
)

# ------------------------------------------------------------------------------------------
# The blocked backward pass
# ------------------------------------------------------------------------------------------


def blocked_attention_vjp(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    grad_output: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    args: rules.Arguments,
    output: jax.Array,
    lse: jax.Array,
    grad_lse: jax.Array | None = None,
    mods: _masking._Mods | None = None,
    *,
    blocks: tuple[int, int, int, int, int],
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """The gradients of the blocked path from its saved output and row log-sum-exp
    (FlashAttention-2's backward pass; numpy_attn's ``backward.py`` derives it for the whole
    matrix): ``BLOCK_KV`` keys at a time under ``lax.scan``, each against the query rows that
    can see them, recomputing the block's weights as ``exp(score - lse)``::

        P = exp(S - lse)     dV = Pᵀ dO     dP = dO Vᵀ     dS = P ⊙ (dP - rowsum(dO ⊙ O))
        dK = dSᵀ Q · scale   dQ += dS K · scale             (dS · tanh' with a soft-cap)

    With the causal rule or a window the keys are cut into at most ``SEGMENTS`` static
    segments, each against only the query rows that see it (fully masked work is skipped).
    No array is ``(q_len, kv_len)``: a step holds ``(..., heads, rows, BLOCK_KV)``.

    Args:
      query: ``(..., heads, q_len, head_dim)``; key: ``(..., kv_heads, kv_len, head_dim)``;
      value: ``(..., kv_heads, kv_len, v_dim)``; mask, bias: broadcastable to
      ``(..., heads, q_len, kv_len)``; output: ``(..., heads, q_len, v_dim)`` and lse:
      ``(..., heads, q_len, 1)`` from the forward pass (compute dtype); grad_output:
      ``(..., heads, q_len, v_dim)``; grad_lse: the lse's cotangent ``(..., heads, q_len, 1)``
      or None. Only ``delta = rowsum(dO ⊙ O) - dlse`` reaches the blocks (``_vjp_heads``).

    Like the forward pass, one (batch, kv head) item at a time under ``lax.scan`` (which adds up
    the items' bias gradients), or all heads at once (``_items``), with ``BLOCK_Q`` grown as
    the forward pass grows it (``slicing._grown``: the rows of the mods' tiles, the same tiles
    as the forward pass's); ``mods``' ``score_mod`` the blocks differentiate by ``jax.vjp``.
    ``blocks``: ``(BLOCK_Q, BLOCK_KV, SEGMENTS, MOD_SEGMENTS, BLOCK_SCORES)``, ``_fast``'s.

    Returns:
      ``(grad_query, grad_key, grad_value, grad_bias)`` shaped like and in the dtypes of query,
      key, value and bias (``grad_bias`` None without a bias).
    """
    items, blocks = slicing._item_blocks(query, key, mask, bias, args, blocks)
    BLOCK_Q, BLOCK_KV, SEGMENTS, MOD_SEGMENTS, _ = blocks
    compute = rules.compute_dtype(query.dtype.name)
    delta = (grad_output.astype(compute) * output).sum(axis=-1, keepdims=True)  # (..., q, 1)
    if grad_lse is not None:  # dlse / dS = P: dS = P ⊙ (dP - delta + dlse)
        delta = delta - grad_lse.astype(compute)
    pieces = None  # with mods: the static segments of keys, made once for every item
    if mods is not None and mods.masks:
        q_len, kv_len = query.shape[-2], key.shape[-2]
        lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
        pieces = _masking._mods_segments(mods, q_len, kv_len, lo, hi, False, BLOCK_Q, BLOCK_KV,
                                         MOD_SEGMENTS)
    if items == 1:
        return _vjp_heads(query, key, value, grad_output, mask, bias, args, delta, lse, mods,
                          pieces, blocks=blocks)
    mask_item, bias_item = _squeeze(mask), _squeeze(bias)  # the same for every item
    groups = query.shape[-3] // key.shape[-3]

    def item(grad_bias: jax.Array | None, xs: tuple) -> tuple:
        q, k, v, d_out, delta_item, lse_item, i = xs
        item_mods = None if mods is None else _masking._mods_item(mods, i, key.shape[-3], groups)
        grad_q, grad_k, grad_v, grad_b = _vjp_heads(
            q, k, v, d_out, mask_item, bias_item, args, delta_item, lse_item, item_mods, pieces,
            blocks=blocks)
        grad_bias = None if grad_b is None else grad_bias + grad_b.astype(grad_bias.dtype)
        return grad_bias, (grad_q, grad_k, grad_v)

    xs = tuple(_to_items(x, items) for x in (query, key, value, grad_output, delta, lse))
    xs += (jnp.arange(items, dtype=jnp.int32),)
    init = None  # the sum of the items' bias gradients, in the compute dtype
    if bias is not None:
        init = jnp.zeros(bias_item.shape, rules.compute_dtype(bias.dtype.name))
    grad_bias, (grad_q, grad_k, grad_v) = jax.lax.scan(item, init, xs)
    grads = (grad_q.reshape(query.shape), grad_k.reshape(key.shape), grad_v.reshape(value.shape))
    return grads + (None if bias is None else grad_bias.reshape(bias.shape).astype(bias.dtype),)


def _vjp_heads(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    grad_output: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    args: rules.Arguments,
    delta: jax.Array,
    lse: jax.Array,
    mods: _masking._Mods | None = None,
    pieces: list | None = None,
    *,
    blocks: tuple[int, int, int, int, int],
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """``blocked_attention_vjp`` for all heads at once; ``delta (..., heads, q_len, 1)`` is
    ``rowsum(dO ⊙ O) - dlse``; ``pieces``: the segments of keys for ``mods``, if made."""
    BLOCK_Q, BLOCK_KV, SEGMENTS, MOD_SEGMENTS, _ = blocks  # _fast's, read at each call
    q_len, kv_len, v_dim = query.shape[-2], key.shape[-2], value.shape[-1]
    compute = rules.compute_dtype(query.dtype.name)
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
    banded = lo > -math.inf or hi < math.inf
    groups = _arrays._groups(query.shape, key.shape)
    rank = query.ndim  # of the scores too
    q_scaled = _arrays._to_compute(query) * args.scale  # (..., heads, q_len, head_dim)
    k, v = _arrays._to_compute(key), _arrays._to_compute(value)
    d_out = grad_output.astype(compute)  # (..., heads, q_len, v_dim)
    row_dot = delta  # rowsum(dO ⊙ O) - dlse: (..., q_len, 1)
    if mask is not None:  # full rank: rows and columns are the last two axes
        mask = mask.reshape((1,) * (rank - mask.ndim) + mask.shape)
    if bias is not None:
        full_bias = bias.astype(compute).reshape((1,) * (rank - bias.ndim) + bias.shape)
        grad_bias = jnp.zeros(full_bias.shape, compute)

    def block(carry, k_blk, v_blk, j0, r0, seg):
        """One block of keys ``(..., kv_heads, n, head_dim)`` from (traced) ``j0`` against the
        segment's query rows ``seg`` (from ``r0``; sliced once per segment): adds to the
        carried ``dQ`` and returns ``dKᵀ``, ``dVᵀ`` ``(..., kv_heads, ·, n)`` and the bias
        gradient of the block. Transposed because the segment's ``Qᵀ`` and ``dOᵀ`` are made
        once: ``Qᵀ dS`` is a plain product, while ``dSᵀ Q`` (a transposed left operand)
        took 1.9x as long in XLA:CPU (a step of 128 keys × 2,048 rows: 1.73 ms against
        2.26; ``benchmarks/RESULTS.md``)."""
        q_seg, d_out_seg, lse_seg, dot_seg, mask_seg, bias_seg, q_t, d_out_t = seg
        n, rows = k_blk.shape[-2], q_seg.shape[-2]
        capped = _steps._scores(q_seg, k_blk, 1.0, args.softcap)  # (..., heads, rows, n)

        def masked(scores: jax.Array) -> jax.Array:  # + bias, ALiBi, score_mod; -inf if masked
            if bias_seg is not None:
                scores = scores + _cols(bias_seg, j0, n)
            scores = _masking._mods_scores(scores, mods, r0, j0)
            allowed = _cols(mask_seg, j0, n)
            if banded:
                in_band = _masking._in_band(r0, rows, j0, n, lo, hi)
                allowed = in_band if allowed is None else allowed & in_band
            extra = _masking._mods_allowed(mods, r0, rows, j0, n)
            if extra is not None:
                allowed = extra if allowed is None else allowed & extra
            return scores if allowed is None else jnp.where(allowed, scores, NEG_INF)

        through_mod = None  # score_mod's pullback: dS back to the scores before it
        if mods is not None and mods.score_mod is not None:
            scores, through_mod = jax.vjp(masked, capped)
        else:
            scores = masked(capped)
        p = jnp.exp(scores - lse_seg)  # the weights, recomputed; 0 where masked
        grad_v = _sum_groups(_matmul(d_out_t, p), groups)  # dVᵀ = dOᵀ P: (..., v_dim, n)
        grad_p = _steps._scores(d_out_seg, v_blk, 1.0, None)  # dP = dO Vᵀ
        grad_s = p * (grad_p - dot_seg)  # dS: (..., heads, rows, n)
        if through_mod is not None:  # d score_mod / d score, by autodiff of the block; 0
            grad_s = jnp.where(p == 0.0, 0.0, through_mod(grad_s)[0])  # where P is 0 (masked)
        grad_bias_blk = None
        if bias_seg is not None:
            grad_bias_blk = _sum_to_shape(grad_s, _cols(bias_seg, j0, n).shape)
        if args.softcap is not None:  # tanh' = 1 - (capped / softcap)²
            grad_s = grad_s * (1.0 - jnp.square(capped * (1.0 / args.softcap)))
        grad_q = carry + _steps._output(grad_s, k_blk)  # dS K (scaled at the end)
        grad_k = _sum_groups(_matmul(q_t, grad_s), groups)  # dKᵀ = Qᵀ dS (· scale in Q)
        return grad_q, (grad_k, grad_v, grad_bias_blk)

    if mods is not None and mods.masks:
        if pieces is None:
            pieces = _masking._mods_segments(mods, q_len, kv_len, lo, hi, False, BLOCK_Q,
                                             BLOCK_KV, MOD_SEGMENTS)
    else:
        n_blocks = kv_len // BLOCK_KV
        segments = max(1, min(SEGMENTS, n_blocks)) if banded else 1
        bounds = [n_blocks * s // segments * BLOCK_KV for s in range(segments)] + [kv_len]
        pieces = [(c0, c1) + rules.query_range(c0, c1, q_len, lo, hi)[:2]
                  for c0, c1 in zip(bounds[:-1], bounds[1:], strict=True)]
    grad_q = jnp.zeros(query.shape, compute)
    grad_ks, grad_vs = [], []
    for c0, c1, r0, r1 in pieces:  # static segments of keys, each with the rows that see them
        if r1 == r0:  # no query sees a key of the segment: zero gradients
            grad_ks.append(jnp.zeros(key.shape[:-2] + (c1 - c0, key.shape[-1]), compute))
            grad_vs.append(jnp.zeros(value.shape[:-2] + (c1 - c0, v_dim), compute))
            continue
        seg = (q_scaled[..., r0:r1, :], d_out[..., r0:r1, :], lse[..., r0:r1, :],
               row_dot[..., r0:r1, :], _rows(mask, r0, r1 - r0),
               None if bias is None else _rows(full_bias, r0, r1 - r0))
        seg += tuple(_t(x) for x in seg[:2])  # Qᵀ, dOᵀ: once per segment
        step = partial(block, r0=r0, seg=seg)
        full = (c1 - c0) // BLOCK_KV * BLOCK_KV  # keys in whole blocks; the rest is one block
        carry = jnp.zeros(query.shape[:-2] + (r1 - r0, query.shape[-1]), compute)
        pieces = []
        if full:
            xs = (_blocks(k[..., c0 : c0 + full, :], BLOCK_KV),
                  _blocks(v[..., c0 : c0 + full, :], BLOCK_KV),
                  c0 + BLOCK_KV * jnp.arange(full // BLOCK_KV, dtype=jnp.int32))
            carry, (grad_k, grad_v, grad_b) = jax.lax.scan(
                lambda carry, xs, step=step: step(carry, *xs), carry, xs)
            pieces.append((_unblock(_t(grad_k)), _unblock(_t(grad_v)), grad_b, c0, c0 + full))
        if c0 + full < c1:
            carry, (grad_k, grad_v, grad_b) = step(
                carry, k[..., c0 + full : c1, :], v[..., c0 + full : c1, :], c0 + full)
            pieces.append((_t(grad_k), _t(grad_v), None if grad_b is None else grad_b[None],
                           c0 + full, c1))
        grad_q = grad_q.at[..., r0:r1, :].add(carry)
        for grad_k, grad_v, grad_b, b0, b1 in pieces:
            grad_ks.append(grad_k)
            grad_vs.append(grad_v)
            if grad_b is not None:  # (blocks, ..., rows or 1, block or 1)
                if full_bias.shape[-1] == 1:
                    grad_b = grad_b.sum(axis=0)
                else:
                    grad_b = jnp.moveaxis(grad_b, 0, -2)
                    grad_b = grad_b.reshape(grad_b.shape[:-3] + (grad_b.shape[-3], b1 - b0))
                row_slice = slice(None) if full_bias.shape[-2] == 1 else slice(r0, r1)
                col_slice = slice(None) if full_bias.shape[-1] == 1 else slice(b0, b1)
                grad_bias = grad_bias.at[..., row_slice, col_slice].add(grad_b)
    grad_q = (grad_q * args.scale).astype(query.dtype)
    grad_k = jnp.concatenate(grad_ks, axis=-2).astype(key.dtype)
    grad_v = jnp.concatenate(grad_vs, axis=-2).astype(value.dtype)
    if bias is None:
        return grad_q, grad_k, grad_v, None
    return grad_q, grad_k, grad_v, grad_bias.reshape(bias.shape).astype(bias.dtype)


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` over the last two axes at full precision: ``(..., d, rows) @ (..., rows, n)``
    → ``(..., d, n)``."""
    return jnp.matmul(a, b, precision=_steps.HIGHEST)


def _t(x: jax.Array) -> jax.Array:
    """The last two axes swapped."""
    return jnp.swapaxes(x, -1, -2)
