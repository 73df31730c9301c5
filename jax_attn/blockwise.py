"""Memory-efficient attention in JAX: keys and values in blocks, with the online softmax.

Plain attention holds a ``(q_len, kv_len)`` score matrix per head (4 GiB per head at 32,768
tokens in float32). ``blockwise_attention`` visits ``(block_q, block_kv)`` tiles instead and
keeps, per query row, a running maximum ``m``, a running sum ``l`` and a running weighted sum
``acc`` of the values (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022)::

    s      = mask(softcap(q kᵀ · scale) + bias)         one tile
    m_new  = max(m, rowmax(s))
    p      = exp(s - m_new)
    l      = l · exp(m - m_new) + rowsum(p)
    acc    = acc · exp(m - m_new) + p v
    output = acc / l                                    (0 where l == 0: a fully masked row)

Extra memory is a few ``(..., heads, block_q, block_kv)`` tiles. Masks are structure, not
arrays: the causal rule (both alignments), the sliding window and per-sequence key lengths
(``kv_lengths``) are evaluated per tile, and a tile that the causal rule or the window masks
entirely is never computed. The backward pass keeps only the log-sum-exp ``lse = m + log l``
of each row and recomputes every tile's weights as ``exp(s - lse)``.

JAX: the list of tiles is static (shapes, ``is_causal``, ``window`` and block sizes are known
at trace time), so the forward pass is ONE ``lax.scan`` over the tiles that keep a position,
and ``jax.custom_vjp`` gives it a backward pass that is a second scan recomputing each tile.
Plain autodiff through the forward scan would store every tile's weights for the backward
pass, i.e. the whole ``(q_len, kv_len)`` matrix again. Queries and keys are zero-padded to a
multiple of the block sizes (padded keys are masked; padded queries are dropped), so every
tile has a static shape. Everything jits to one program; ``kv_lengths`` may be traced.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules

from ._core import (
    HIGHEST,
    NEG_INF,
    _array,
    _describe,
    _describe_lengths,
    _describe_segments,
    _groups,
    _in_band,
    _matmul_grouped,
    _Mods,
    _mods,
    _mods_allowed,
    _mods_scores,
    _mods_statuses,
    _segments,
    _softcap,
    _sum_groups,
    _sum_to_shape,
    _to_compute,
    _with_sinks,
)

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_KV = 1024


# ------------------------------------------------------------------------------------------
# Public functions
# ------------------------------------------------------------------------------------------


def blockwise_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    bias: Any = None,
    kv_lengths: Any = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
    sinks: Any = None,
    return_lse: bool = False,
    chunk_size: int | None = None,
    alibi_slopes: Any = None,
    segment_ids: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention in ``(block_q, block_kv)`` tiles, with the online softmax.

    Equal to ``scaled_dot_product_attention(query, key, value, mask=padding_mask(kv_lengths,
    kv_len), bias=bias, ...)`` (no dropout, no weights), using a few tiles of extra memory
    instead of the ``(q_len, kv_len)`` matrix; tiles that the causal rule or the window mask
    entirely are skipped. One ``lax.scan``; differentiable through ``jax.custom_vjp``, whose
    backward pass recomputes each tile. ``is_causal``, ``causal_alignment``, ``window``,
    ``scale``, ``softcap``, ``block_q`` and ``block_kv`` must be static.

    Args:
      query: ``(..., heads, q_len, head_dim)`` or ``(q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)`` or ``(kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)`` or ``(kv_len, v_dim)``.
      bias: floating point, broadcastable to ``(..., heads, q_len, kv_len)``; sliced per tile.
      kv_lengths: ints shaped like the batch axes ``(...)`` (``(batch,)`` for 4-D inputs), each
        in ``[0, kv_len]``: key ``j`` of sequence ``b`` is attended only if
        ``j < kv_lengths[b]`` (may be traced; then its range is not checked).
      is_causal, causal_alignment, window, scale, softcap: as in
        ``scaled_dot_product_attention``.
      block_q: queries per tile (``>= 1``).
      block_kv: keys per tile (``>= 1``).
      sinks: ``(heads,)`` sink logits, joined to each row's denominator after the last tile
        (autodiff, beyond the tiles' custom VJP); may be traced.
      return_lse: also return each row's log-sum-exp (static).
      chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod: as in
        ``scaled_dot_product_attention``, per tile; the tiles that chunks, segment ids or
        ``mask_mod`` mask entirely are left out of the scan where that is known at trace time
        (segment ids: when concrete; ``spec.TILE_SKIPPING``).

    Returns:
      ``(..., heads, q_len, v_dim)`` in the input dtype (fully masked rows give 0), and with
      ``return_lse`` the lse ``(..., heads, q_len)`` in the compute dtype.
    """
    fn = "blockwise_attention"
    args = _arguments(fn, query, key, value, None, bias, kv_lengths, is_causal, causal_alignment,
                      window, scale, softcap, block_q, block_kv, sinks, return_lse,
                      (chunk_size, alibi_slopes, segment_ids, score_mod,
                       mask_mod))  # every rule of the spec, once
    query, key, value, bias = _array(query), _array(key), _array(value), _array(bias)
    mods = _mods(fn, args, query.shape, key.shape, alibi_slopes, _segments(segment_ids))
    bias, kv_lengths, cfg = _prepare(fn, query, key, bias, kv_lengths, args, mods)
    output, lse = _attend(cfg, query, key, value, bias, kv_lengths, _array(sinks),
                          None if mods is None else mods.arrays)
    return (output, lse[..., 0]) if args.return_lse else output


def blockwise_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    *,
    bias: Any = None,
    kv_lengths: Any = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
    sinks: Any = None,
    chunk_size: int | None = None,
    alibi_slopes: Any = None,
    segment_ids: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
) -> tuple[jax.Array | None, ...]:
    """Gradients of ``blockwise_attention``, tile by tile, from the saved log-sum-exp.

    Through ``jax.vjp``: ``blockwise_attention`` is a ``jax.custom_vjp`` whose backward pass
    is a scan recomputing each tile's weights as ``exp(s - lse)`` (numpy_attn's derivation).

    Args:
      query: ``(..., heads, q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)``.
      grad_output: ``(..., heads, q_len, v_dim)``.
      bias, kv_lengths, is_causal, causal_alignment, window, scale, softcap, block_q,
        block_kv, sinks, chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod: as in
        ``blockwise_attention``.

    Returns:
      ``(grad_query, grad_key, grad_value, grad_bias)`` shaped like query, key, value and bias
      (``grad_bias`` is None without a bias), in their dtypes, and with ``sinks`` a fifth,
      ``grad_sinks (heads,)``.
    """
    fn = "blockwise_attention_vjp"
    args = _arguments(fn, query, key, value, grad_output, bias, kv_lengths, is_causal,
                      causal_alignment, window, scale, softcap, block_q, block_kv, sinks, False,
                      (chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod))
    query, key, value, bias = _array(query), _array(key), _array(value), _array(bias)
    grad_output, bias_shape = _array(grad_output), None if bias is None else bias.shape
    mods = _mods(fn, args, query.shape, key.shape, alibi_slopes, _segments(segment_ids))
    mod_arrays = None if mods is None else mods.arrays
    bias, kv_lengths, cfg = _prepare(fn, query, key, bias, kv_lengths, args, mods)
    # jax.vjp through the custom_vjp (a second scan); bias and sinks join the primals only
    # when given.
    primals = {"bias": bias, "sinks": _array(sinks)}
    given = {name: x for name, x in primals.items() if x is not None}

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, extra: dict) -> jax.Array:
        arrays = {**primals, **extra}
        return _attend(cfg, q, k, v, arrays["bias"], kv_lengths, arrays["sinks"], mod_arrays)[0]

    _, pullback = jax.vjp(attend, query, key, value, given)
    grad_q, grad_k, grad_v, grads = pullback(grad_output)
    grad_bias = grads["bias"].reshape(bias_shape) if bias is not None else None
    return (grad_q, grad_k, grad_v, grad_bias) + ((grads["sinks"],) if sinks is not None else ())


# ------------------------------------------------------------------------------------------
# Forward and backward, unchecked: one scan each over the static list of tiles
# ------------------------------------------------------------------------------------------


def _pad(x: jax.Array, size: int, axis: int) -> jax.Array:
    """jax only: zero-pad ``axis`` up to ``size`` (tiles have static shapes)."""
    missing = size - x.shape[axis]
    if missing <= 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[x.ndim + axis] = (0, missing)
    return jnp.pad(x, widths)


def _padded(cfg: TileConfig) -> tuple[int, int]:
    """Query and key lengths rounded up to a multiple of the block sizes."""
    return (-(-cfg.q_len // cfg.block_q) * cfg.block_q,
            -(-cfg.kv_len // cfg.block_kv) * cfg.block_kv)


def _pad_inputs(query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
                cfg: TileConfig) -> tuple:
    q_pad, kv_pad = _padded(cfg)
    q = _pad(_to_compute(query), q_pad, -2)
    k, v = _pad(_to_compute(key), kv_pad, -2), _pad(_to_compute(value), kv_pad, -2)
    if bias is not None:
        bias = _pad(bias, q_pad, -2) if bias.shape[-2] != 1 else bias
        bias = _pad(bias, kv_pad, -1) if bias.shape[-1] != 1 else bias
    return q, k, v, bias


def forward_tiles(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None,
    kv_lengths: jax.Array | None,
    cfg: TileConfig,
    mod_arrays: tuple | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The forward scan over ``cfg.starts`` on validated arrays (the engine of
    ``blockwise_attention`` and of ``context_parallel``'s per-pair attention).

    Args:
      query: ``(..., heads, q_len, head_dim)``; key: ``(..., kv_heads, kv_len, head_dim)``;
        value: ``(..., kv_heads, kv_len, v_dim)``.
      bias: None or full rank, broadcastable to ``(..., heads, q_len, kv_len)``.
      kv_lengths: None or ``(batch...)`` ints: key ``j`` of a sequence is allowed iff
        ``j < kv_lengths``.
      cfg: the static plan (``TileConfig``).
      mod_arrays: ``_Mods.arrays`` (ALiBi slopes, segment ids) of ``cfg.mods``, or None.

    Returns:
      ``output (..., heads, q_len, v_dim)`` and ``lse (..., heads, q_len, 1)`` in the compute
      dtype; ``lse`` is ``+inf`` on fully masked rows, so ``exp(s - lse)`` is 0 there.
    """
    mods = _tile_mods(cfg, query.shape, key.shape, mod_arrays)
    q, k, v, bias = _pad_inputs(query, key, value, bias, cfg)
    q = q * cfg.scale  # (..., heads, q_pad, head_dim)
    groups = _groups(q.shape, k.shape)
    rows = q.shape[:-1] + (1,)
    carry = (
        jnp.full(rows, NEG_INF, q.dtype),  # m: (..., heads, q_pad, 1)
        jnp.zeros(rows, q.dtype),  # l
        jnp.zeros(q.shape[:-1] + v.shape[-1:], q.dtype),  # acc: (..., heads, q_pad, v_dim)
    )

    def tile(carry: tuple, starts: jax.Array) -> tuple[tuple, None]:
        all_max, all_sum, all_acc = carry
        q_start, kv_start = starts[0], starts[1]
        scores = _tile_scores(_slice(q, q_start, cfg.block_q, -2),
                              _slice(k, kv_start, cfg.block_kv, -2), groups, cfg.softcap)
        scores = _mask_tile(scores, bias, kv_lengths, q_start, kv_start, cfg, mods)
        row_max = _slice(all_max, q_start, cfg.block_q, -2)  # (..., heads, bq, 1)
        new_max = jnp.maximum(row_max, scores.max(axis=-1, keepdims=True))
        shift = jnp.where(new_max == NEG_INF, 0.0, new_max)  # no -inf - -inf
        p = jnp.exp(scores - shift)  # the tile's unnormalised weights
        correction = jnp.exp(row_max - shift)  # rescales earlier tiles; 0 at first
        row_sum = _slice(all_sum, q_start, cfg.block_q, -2) * correction + p.sum(-1, keepdims=True)
        acc = _slice(all_acc, q_start, cfg.block_q, -2) * correction + _matmul_grouped(
            p, _slice(v, kv_start, cfg.block_kv, -2), groups)
        update = partial(jax.lax.dynamic_update_slice_in_dim, start_index=q_start,
                         axis=q.ndim - 2)
        return (update(all_max, new_max), update(all_sum, row_sum), update(all_acc, acc)), None

    if cfg.starts:
        carry, _ = jax.lax.scan(tile, carry, jnp.asarray(cfg.starts, dtype=jnp.int32))
    row_max, row_sum, acc = carry
    kept = row_sum != 0  # (..., heads, q_pad, 1); False: a fully masked row; NaN
    # rows stay NaN, their lse too (NON_FINITE), never -inf: a merge must not drop them
    safe_sum = jnp.where(kept, row_sum, 1.0)
    output = acc / safe_sum  # 0 / 1 = 0 on fully masked rows
    lse = jnp.where(kept, row_max + jnp.log(safe_sum), jnp.inf)
    return output[..., : cfg.q_len, :], lse[..., : cfg.q_len, :]


def backward_tiles(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None,
    kv_lengths: jax.Array | None,
    cfg: TileConfig,
    output: jax.Array,
    lse: jax.Array,
    grad_output: jax.Array,
    grad_lse: jax.Array | None = None,
    mod_arrays: tuple | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """FlashAttention's backward per tile (numpy_attn's ``backward.py`` derives it for the whole
    matrix): the VJP of ``forward_tiles``.

    Args:
      query, key, value, bias, kv_lengths, cfg: as in ``forward_tiles``.
      output: ``(..., heads, q_len, v_dim)`` and lse: ``(..., heads, q_len, 1)`` from
        ``forward_tiles``; grad_output: ``(..., heads, q_len, v_dim)``; grad_lse: the lse's
        cotangent ``(..., heads, q_len, 1)`` or None (``dS = P ⊙ (dP - rowsum(dO ⊙ O) +
        dlse)``); mod_arrays: as in ``forward_tiles`` (``jax.vjp`` of the tile's bias, ALiBi,
        ``score_mod`` and masking carries ``dS`` back through ``score_mod``).

    Returns:
      ``(grad_query, grad_key, grad_value, grad_bias)`` in the compute dtype, shaped like query,
      key, value and the full-rank bias (None without one).
    """
    mods = _tile_mods(cfg, query.shape, key.shape, mod_arrays)
    q, k, v, padded_bias = _pad_inputs(query, key, value, bias, cfg)  # q unscaled
    q_pad = q.shape[-2]
    d_out = _pad(_to_compute(grad_output), q_pad, -2)  # (..., heads, q_pad, v_dim); 0 if padded
    groups = _groups(q.shape, k.shape)
    q_scaled = q * cfg.scale
    row_dot = (d_out * _pad(output, q_pad, -2)).sum(axis=-1, keepdims=True)  # rowsum(dO ⊙ O)
    if grad_lse is not None:  # dlse / dS = P
        row_dot = row_dot - _pad(grad_lse.astype(row_dot.dtype), q_pad, -2)
    lse = jnp.concatenate(  # padded rows: +inf, so their weights are 0
        [lse, jnp.full(lse.shape[:-2] + (q_pad - cfg.q_len, 1), jnp.inf, lse.dtype)], axis=-2)
    grad_bias = None if bias is None else jnp.zeros(padded_bias.shape, q.dtype)
    carry = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), grad_bias)

    def tile(carry: tuple, starts: jax.Array) -> tuple[tuple, None]:
        grad_q, grad_k, grad_v, grad_bias = carry
        q_start, kv_start = starts[0], starts[1]
        k_tile = _slice(k, kv_start, cfg.block_kv, -2)
        v_tile = _slice(v, kv_start, cfg.block_kv, -2)
        d_out_tile = _slice(d_out, q_start, cfg.block_q, -2)  # (..., heads, bq, v_dim)
        capped = _tile_scores(_slice(q_scaled, q_start, cfg.block_q, -2), k_tile, groups,
                              cfg.softcap)  # S1
        through_mod = None  # score_mod's pullback: dS back to the scores before it
        if mods is not None and mods.score_mod is not None:
            scores, through_mod = jax.vjp(lambda s: _mask_tile(
                s, padded_bias, kv_lengths, q_start, kv_start, cfg, mods), capped)
        else:
            scores = _mask_tile(capped, padded_bias, kv_lengths, q_start, kv_start, cfg, mods)
        p = jnp.exp(scores - _slice(lse, q_start, cfg.block_q, -2))  # P, recomputed
        # dV = Pᵀ dO
        grad_v = _add_at(grad_v, _sum_groups(
            jnp.matmul(jnp.swapaxes(p, -1, -2), d_out_tile, precision=HIGHEST), groups),
            kv_start, -2)
        # dP = dO Vᵀ
        grad_p = _matmul_grouped(d_out_tile, jnp.swapaxes(v_tile, -1, -2), groups)
        # dS = P ⊙ (dP - rowsum(dO ⊙ O))
        grad_s = p * (grad_p - _slice(row_dot, q_start, cfg.block_q, -2))
        if through_mod is not None:  # d score_mod / d score, by autodiff of the tile
            grad_s = through_mod(grad_s)[0]
        if grad_bias is not None:
            grad_bias = _add_bias_tile(grad_bias, grad_s, q_start, kv_start)
        if cfg.softcap is not None:  # tanh': 1 - (S1 / c)²
            grad_s = grad_s * (1.0 - jnp.square(capped * (1.0 / cfg.softcap)))
        grad_s = grad_s * cfg.scale
        # dQ = dS K · scale, dK = dSᵀ Q · scale
        grad_q = _add_at(grad_q, _matmul_grouped(grad_s, k_tile, groups), q_start, -2)
        grad_k = _add_at(grad_k, _sum_groups(jnp.matmul(
            jnp.swapaxes(grad_s, -1, -2), _slice(q, q_start, cfg.block_q, -2),
            precision=HIGHEST), groups), kv_start, -2)
        return (grad_q, grad_k, grad_v, grad_bias), None

    if cfg.starts:
        carry, _ = jax.lax.scan(tile, carry, jnp.asarray(cfg.starts, dtype=jnp.int32))
    grad_q, grad_k, grad_v, grad_bias = carry
    if grad_bias is not None:  # drop the padding of the bias
        grad_bias = grad_bias[..., : bias.shape[-2], : bias.shape[-1]]
    return (grad_q[..., : cfg.q_len, :], grad_k[..., : cfg.kv_len, :],
            grad_v[..., : cfg.kv_len, :], grad_bias)


def _attend(cfg: TileConfig, query: jax.Array, key: jax.Array, value: jax.Array,
            bias: jax.Array | None, kv_lengths: jax.Array | None,
            sinks: jax.Array | None, mod_arrays: tuple | None = None
            ) -> tuple[jax.Array, jax.Array]:
    """The tiles (``_blockwise``), then the sinks joined once (``_core._with_sinks``): the
    output in the input dtype and the lse ``(..., heads, q_len, 1)`` in the compute dtype."""
    output, lse = _blockwise(cfg, query, key, value, bias, kv_lengths, mod_arrays)
    output, lse = _with_sinks(output, lse, sinks)
    return output.astype(query.dtype), lse


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blockwise(cfg: TileConfig, query: jax.Array, key: jax.Array, value: jax.Array,
               bias: jax.Array | None, kv_lengths: jax.Array | None, mod_arrays: tuple | None
               ) -> tuple[jax.Array, jax.Array]:
    """jax only: the forward scan, with ``_blockwise_bwd`` as its VJP: the output in the
    compute dtype and the lse ``(..., heads, q_len, 1)`` (``-inf``: no key), both
    differentiable (the slopes and ids of ``mod_arrays`` are not)."""
    output, lse = forward_tiles(query, key, value, bias, kv_lengths, cfg, mod_arrays)
    return output, jnp.where(lse == jnp.inf, NEG_INF, lse)


def _blockwise_fwd(cfg: TileConfig, query: jax.Array, key: jax.Array, value: jax.Array,
                   bias: jax.Array | None, kv_lengths: jax.Array | None,
                   mod_arrays: tuple | None) -> tuple:
    output, lse = forward_tiles(query, key, value, bias, kv_lengths, cfg, mod_arrays)
    public = jnp.where(lse == jnp.inf, NEG_INF, lse)
    return (output, public), (query, key, value, bias, kv_lengths, mod_arrays, output, lse)


def _blockwise_bwd(cfg: TileConfig, residuals: tuple,
                   cotangents: tuple[jax.Array, jax.Array]) -> tuple:
    query, key, value, bias, kv_lengths, mod_arrays, output, lse = residuals
    grad_output, grad_lse = cotangents
    grad_q, grad_k, grad_v, grad_bias = backward_tiles(
        query, key, value, bias, kv_lengths, cfg, output, lse, grad_output, grad_lse, mod_arrays
    )
    grad_bias = None if grad_bias is None else grad_bias.astype(bias.dtype)
    # kv_lengths and the ids hold ints, the slopes are constants: no cotangent (None)
    return grad_q.astype(query.dtype), grad_k.astype(key.dtype), grad_v.astype(value.dtype), \
        grad_bias, None, None


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


# ------------------------------------------------------------------------------------------
# Arguments and the plan of tiles
# ------------------------------------------------------------------------------------------


def _arguments(
    fn: str, query: Any, key: Any, value: Any, grad_output: Any, bias: Any, kv_lengths: Any,
    is_causal: Any, causal_alignment: Any, window: Any, scale: Any, softcap: Any, block_q: Any,
    block_kv: Any, sinks: Any, return_lse: Any, extra: tuple = (None,) * 5,
) -> rules.Arguments:
    """``rules.attention_arguments`` for the forward pass (``grad_output`` None) and the VJP;
    ``extra``: ``(chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod)`` as given."""
    chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod = extra
    return rules.attention_arguments(
        fn, _describe(fn, "query", query), _describe(fn, "key", key),
        _describe(fn, "value", value),
        grad_output=None if grad_output is None else _describe(fn, "grad_output", grad_output),
        bias=_describe(fn, "bias", bias), is_causal=is_causal, causal_alignment=causal_alignment,
        window=window, scale=scale, softcap=softcap, kv_lengths=_describe_lengths(kv_lengths),
        block_q=block_q, block_kv=block_kv, sinks=_describe(fn, "sinks", sinks),
        return_lse=return_lse, chunk_size=chunk_size,
        alibi_slopes=_describe(fn, "alibi_slopes", alibi_slopes),
        segment_ids=_describe_segments(fn, segment_ids), score_mod=score_mod, mask_mod=mask_mod,
    )


class TileConfig(NamedTuple):
    """The static plan of ``forward_tiles``/``backward_tiles`` (jax only: hashable, for
    ``custom_vjp``'s nondiff argument): the lengths, block sizes, the ``(q_start, kv_start)`` of
    every tile to compute, the band ``lo <= j - i <= hi``, the scale and the soft-cap."""

    q_len: int
    kv_len: int
    block_q: int
    block_kv: int
    starts: tuple[tuple[int, int], ...]  # (q_start, kv_start) of every tile that is computed
    lo: float
    hi: float
    scale: float
    softcap: float | None
    mods: tuple | None = None  # (fn, args) of the call's _Mods (its arrays travel apart)


def _tile_mods(cfg: TileConfig, q_shape: tuple, k_shape: tuple, mod_arrays: tuple | None
               ) -> _Mods | None:
    """The call's ``_Mods`` rebuilt from ``cfg.mods`` and its arrays, the segment ids padded
    like the queries and keys (so every tile's slice lies inside them)."""
    if cfg.mods is None:
        return None
    alibi, q_ids, kv_ids = mod_arrays
    mods = _mods(*cfg.mods, q_shape, k_shape, alibi, None if q_ids is None else (q_ids, kv_ids))
    if q_ids is None:
        return mods
    q_pad, kv_pad = _padded(cfg)
    return mods._replace(q_ids=_pad(mods.q_ids, q_pad, -1), kv_ids=_pad(mods.kv_ids, kv_pad, -1))


def _prepare(
    fn: str, query: jax.Array, key: jax.Array, bias: jax.Array | None, kv_lengths: Any,
    args: rules.Arguments, mods: _Mods | None = None,
) -> tuple:
    """The full-rank bias, the checked ``kv_lengths`` and the static configuration: the tiles
    to compute (jax: every one of them in one scan) with their band, without those ``mods``
    mask entirely (where known at trace time)."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if kv_lengths is not None:  # the range needs the values: checked here when concrete
        kv_lengths = jnp.asarray(kv_lengths)
        if not isinstance(kv_lengths, jax.core.Tracer):  # jax: traced values are checked by nobody
            rules.check_lengths(fn, "kv_lengths", np.asarray(kv_lengths).tolist(), kv_len)
    if bias is not None:  # full rank, so tiles slice the last two axes
        bias = bias.reshape((1,) * (len(args.scores_shape) - bias.ndim) + bias.shape)
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
    block_q, block_kv = min(args.block_q, max(q_len, 1)), min(args.block_kv, max(kv_len, 1))
    plan = rules.plan(q_len, kv_len, block_q, block_kv, lo, hi)  # jax: less padding above
    # jax: kv_lengths may be traced, so key blocks past every length are masked, not skipped
    starts = tuple((q_start, kv_start) for q_start, _, blocks in plan for kv_start, _, _ in blocks)
    if mods is not None and mods.masks:  # tiles chunks, segment ids or mask_mod empty: left out
        statuses = _mods_statuses(mods, q_len, kv_len, block_q, block_kv, lo, hi)
        starts = tuple((a, b) for a, b in starts if statuses[a // block_q, b // block_kv])
    cfg = TileConfig(q_len, kv_len, block_q, block_kv, starts, lo, hi, args.scale, args.softcap,
                     None if mods is None else (fn, args))
    return bias, kv_lengths, cfg


# ------------------------------------------------------------------------------------------
# Tiles
# ------------------------------------------------------------------------------------------


def _tile_scores(
    q_tile: jax.Array, k_tile: jax.Array, groups: int, softcap: float | None
) -> jax.Array:
    """``(..., heads, bq, head_dim) @ (..., kv_heads, bk, head_dim)ᵀ`` → ``(..., heads, bq, bk)``,
    soft-capped; ``q_tile`` is already scaled."""
    scores = _matmul_grouped(q_tile, jnp.swapaxes(k_tile, -1, -2), groups)
    return _softcap(scores, softcap)


def _slice(x: jax.Array, start: Any, size: int, axis: int) -> jax.Array:
    """jax only: ``x[..., start:start + size, ...]`` along ``axis`` with a traced ``start``."""
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim + axis)


def _add_at(x: jax.Array, update: jax.Array, start: Any, axis: int) -> jax.Array:
    """jax only: ``x[..., start:start + n, ...] += update`` along ``axis``, functionally."""
    current = _slice(x, start, update.shape[axis], axis)
    return jax.lax.dynamic_update_slice_in_dim(x, current + update, start, axis=x.ndim + axis)


def _tile_starts(x: jax.Array, q_start: Any, kv_start: Any) -> list:
    """jax only: start indices of a tile of a full-rank bias; broadcast axes start at 0."""
    zero = jnp.zeros((), jnp.int32)
    starts = [zero] * x.ndim
    starts[-2] = q_start if x.shape[-2] != 1 else zero
    starts[-1] = kv_start if x.shape[-1] != 1 else zero
    return starts


def _bias_tile(bias: jax.Array, q_start: Any, kv_start: Any, cfg: TileConfig) -> jax.Array:
    """The tile of a full-rank bias; broadcast (size-1) query or key axes are kept whole."""
    sizes = bias.shape[:-2] + (min(bias.shape[-2], cfg.block_q), min(bias.shape[-1], cfg.block_kv))
    return jax.lax.dynamic_slice(bias, _tile_starts(bias, q_start, kv_start), sizes)


def _add_bias_tile(grad_bias: jax.Array, grad_s: jax.Array, q_start: Any,
                   kv_start: Any) -> jax.Array:
    """``grad_bias[tile] += grad_s`` summed over the axes the bias was broadcast along."""
    starts = _tile_starts(grad_bias, q_start, kv_start)
    sizes = grad_bias.shape[:-2] + tuple(
        1 if grad_bias.shape[axis] == 1 else grad_s.shape[axis] for axis in (-2, -1))
    current = jax.lax.dynamic_slice(grad_bias, starts, sizes)
    update = current + _sum_to_shape(grad_s, current.shape)
    return jax.lax.dynamic_update_slice(grad_bias, update, starts)


def _mask_tile(
    scores: jax.Array,
    bias: jax.Array | None,
    kv_lengths: jax.Array | None,
    q_start: Any,
    kv_start: Any,
    cfg: TileConfig,
    mods: _Mods | None = None,
) -> jax.Array:
    """Add the bias tile (and ALiBi, then ``score_mod``), then ``-inf`` where the band,
    ``kv_lengths``, padding or ``mods``' rules forbid."""
    if bias is not None:
        scores = scores + _bias_tile(bias, q_start, kv_start, cfg).astype(scores.dtype)
    scores = _mods_scores(scores, mods, q_start, kv_start)
    key_pos = kv_start + jnp.arange(cfg.block_kv)  # (bk,)
    allowed = key_pos[None, :] < cfg.kv_len  # padded keys; jax: one body for every tile
    allowed &= _in_band(q_start, cfg.block_q, kv_start, cfg.block_kv, cfg.lo, cfg.hi)  # (bq, bk)
    extra = _mods_allowed(mods, q_start, cfg.block_q, kv_start, cfg.block_kv)
    if extra is not None:
        allowed = allowed & extra
    if kv_lengths is not None:  # (batch..., 1, 1, bk): key j < kv_lengths[b]
        lengths = kv_lengths.reshape(kv_lengths.shape + (1,) * (scores.ndim - kv_lengths.ndim))
        allowed = allowed & (key_pos < lengths)
    return jnp.where(allowed, scores, NEG_INF)


