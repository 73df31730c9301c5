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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules

from ._arrays import _array, _describe, _describe_lengths
from ._masking import _describe_segments, _Mods, _mods, _mods_statuses
from ._steps import NEG_INF, _with_sinks
from ._tiles import TileConfig, backward_tiles, forward_tiles

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
    mods = _mods(fn, args, query.shape, key.shape, alibi_slopes, rules.segment_pair(segment_ids))
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
    mods = _mods(fn, args, query.shape, key.shape, alibi_slopes, rules.segment_pair(segment_ids))
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
# The tiles' custom VJP (jax only): one scan forward, one backward (_tiles.py)
# ------------------------------------------------------------------------------------------


def _attend(cfg: TileConfig, query: jax.Array, key: jax.Array, value: jax.Array,
            bias: jax.Array | None, kv_lengths: jax.Array | None,
            sinks: jax.Array | None, mod_arrays: tuple | None = None
            ) -> tuple[jax.Array, jax.Array]:
    """The tiles (``_blockwise``), then the sinks joined once (``_steps._with_sinks``): the
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
