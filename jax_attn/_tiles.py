"""The engine of jax_attn's tiles, unchecked: ``forward_tiles``, the online softmax as ONE
``lax.scan`` over the static list of tiles of a plan (``TileConfig``), and ``backward_tiles``,
a second scan that recomputes each tile from the saved log-sum-exp (``blockwise.py`` explains
both, validates and gives them their ``jax.custom_vjp``; ``context_blocks.py`` runs them on
pairs of chunks), with the scores, bias and masks of one tile. Queries and keys are
zero-padded to a multiple of the block sizes (padded keys are masked; padded queries are
dropped), so every tile has a static shape.

Imports run one way: ``_arrays < _masking < _steps < _tiles < _fast`` (see ``_arrays.py``);
``blockwise.py`` and ``context_blocks.py`` sit above.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ._arrays import _groups, _to_compute
from ._masking import _in_band, _Mods, _mods, _mods_allowed, _mods_scores
from ._steps import HIGHEST, NEG_INF, _matmul_grouped, _softcap, _sum_groups, _sum_to_shape

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
    # jax only: dK and dV carried transposed, (..., kv_heads, ·, kv_pad), against Qᵀ and dOᵀ
    # made once: Qᵀ dS is a plain product, dSᵀ Q (a transposed left operand) took 1.9x as
    # long in XLA:CPU (_fast/backward.py measures it)
    q_t, d_out_t = jnp.swapaxes(q, -1, -2), jnp.swapaxes(d_out, -1, -2)
    carry = (jnp.zeros_like(q), jnp.swapaxes(jnp.zeros_like(k), -1, -2),
             jnp.swapaxes(jnp.zeros_like(v), -1, -2), grad_bias)

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
        # dV = Pᵀ dO, as dVᵀ = dOᵀ P
        grad_v = _add_at(grad_v, _sum_groups(jnp.matmul(
            _slice(d_out_t, q_start, cfg.block_q, -1), p, precision=HIGHEST), groups),
            kv_start, -1)
        # dP = dO Vᵀ
        grad_p = _matmul_grouped(d_out_tile, jnp.swapaxes(v_tile, -1, -2), groups)
        # dS = P ⊙ (dP - rowsum(dO ⊙ O))
        grad_s = p * (grad_p - _slice(row_dot, q_start, cfg.block_q, -2))
        if through_mod is not None:  # d score_mod / d score, by autodiff of the tile; 0
            grad_s = jnp.where(p == 0.0, 0.0, through_mod(grad_s)[0])  # where P is 0 (masked)
        if grad_bias is not None:
            grad_bias = _add_bias_tile(grad_bias, grad_s, q_start, kv_start)
        if cfg.softcap is not None:  # tanh': 1 - (S1 / c)²
            grad_s = grad_s * (1.0 - jnp.square(capped * (1.0 / cfg.softcap)))
        grad_s = grad_s * cfg.scale
        # dQ = dS K · scale, dK = dSᵀ Q · scale, as dKᵀ = Qᵀ dS
        grad_q = _add_at(grad_q, _matmul_grouped(grad_s, k_tile, groups), q_start, -2)
        grad_k = _add_at(grad_k, _sum_groups(jnp.matmul(
            _slice(q_t, q_start, cfg.block_q, -1), grad_s, precision=HIGHEST), groups),
            kv_start, -1)
        return (grad_q, grad_k, grad_v, grad_bias), None

    if cfg.starts:
        carry, _ = jax.lax.scan(tile, carry, jnp.asarray(cfg.starts, dtype=jnp.int32))
    grad_q, grad_k, grad_v, grad_bias = carry
    grad_k, grad_v = jnp.swapaxes(grad_k, -1, -2), jnp.swapaxes(grad_v, -1, -2)
    if grad_bias is not None:  # drop the padding of the bias
        grad_bias = grad_bias[..., : bias.shape[-2], : bias.shape[-1]]
    return (grad_q[..., : cfg.q_len, :], grad_k[..., : cfg.kv_len, :],
            grad_v[..., : cfg.kv_len, :], grad_bias)


# ------------------------------------------------------------------------------------------
# The static plan of the tiles
# ------------------------------------------------------------------------------------------


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
