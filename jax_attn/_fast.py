"""The fast paths of jax_attn: cuDNN's flash attention on a GPU, the blocked steps on the CPU.

``use_fast_path`` is the one selection rule (its numbers are
``attention_rules.FAST_PATHS["jax_attn"]``); ``fast_attention`` runs the path it chose.

The platform is the one of the devices the query lives on (a concrete ``jax.Array``), or
``jax.default_backend()`` for a tracer under ``jit`` (it has no concrete device).

``"cudnn"``: without ``return_weights``, ``jax.nn.dot_product_attention(...,
implementation="cudnn")`` (flash attention) when on a GPU, float16/bfloat16 inputs,
``v_dim == head_dim``, no ``mask``, no ``bias``, no ``softcap``, no dropout, no empty axis, and a
causal rule or window only with ``q_len == kv_len`` (so both alignments agree) and a window
only as ``(left, 0)`` or with ``is_causal`` (what cuDNN supports). Under those conditions no row
can be fully masked, so jax.nn's semantics (which give ``mean(value)`` for a fully masked row)
equal the spec's. If cuDNN refuses the shapes at trace time, ``fast_attention`` returns None and
the explicit steps run. NaN and infinities: a NaN in a query row or in an attended key gives a
NaN row there too, but what cuDNN's kernel does with a non-finite key at a causally masked
position, or with a row whose allowed scores are all ``-inf``, is not checked by this project
(no GPU in its CI): inputs that may hold NaN or infinities should be given in float32, or with
``return_weights=True``, which take the explicit steps (the spec's IEEE rule, tested).

``"blocked"`` (CPU): the explicit steps materialise the whole ``(..., heads, q_len, kv_len)``
score array, and XLA:CPU then streams it through memory several times (max, exp, sum,
divide). For large inputs (no ``return_weights``, no dropout, at least ``MIN_Q_LEN`` queries
and ``MIN_SCORES`` score entries), ``_blocked_attention_lse`` runs the same steps for ``BLOCK_Q``
queries at a time under ``lax.map``, so a block's scores stay in cache, with the division by the
row sums moved after ``@ value``; with a window (or a mask or bias, with the causal rule) the
queries form at most ``SEGMENTS`` static segments, each against only the keys it can see (fully
masked work is skipped); the causal rule alone is cut into unmasked rectangles and a triangle
halved again and again (``_causal_forward``), which computes about half of the products. When
the mask and the bias are the same for every batch and head, one (batch, kv head) item runs
at a time under an outer ``lax.map`` (its blocks are small enough to stay in cache). Each step
is ``_core.py``'s own step (``_scores``, ``_in_band``, ``_unnormalised_softmax``,
``_output``). It supports everything else (mask, bias, softcap, grouped-query heads, both
alignments, 2-D inputs; with ``sinks`` or ``return_lse``, ``_blocked_attention_lse`` joins
the sinks to each row's denominator after the blocks and returns the row log-sum-exp they
compute anyway, and its VJP gives the sinks' gradient; cuDNN is never taken then), ``jit``,
``vmap`` and ``grad``, and equals the explicit steps within
float32 rounding, NaN and infinities included (``tests/test_performance_paths.py``).

Chunks, ALiBi, segment ids, ``score_mod`` and ``mask_mod`` (``spec.MASKS_AND_MODS``) take the
blocked path with every head at once: each block adds ALiBi and ``score_mod`` (with its global
indices) and masks by the chunk rule, the ids and ``mask_mod``; the rules that mask cut the
queries (and, in the VJP, the keys) into at most ``MOD_SEGMENTS`` static segments, each against
only the keys (rows) their tiles leave (``_core._mods_segments``, decided at trace time from the
tiles' statuses), so their empty tiles are not computed. The backward pass differentiates
``score_mod`` per block by ``jax.vjp``; the slopes and ids travel through the custom VJP as
``_core._Mods.arrays`` (no cotangent).

Its backward pass is its own (``_blocked_attention_lse`` is a ``jax.custom_vjp``: autodiff through
``lax.map`` would store every block's weights, the whole ``(q_len, kv_len)`` matrix): the
forward pass saves the output and the row log-sum-exp, and ``_blocked_attention_vjp`` walks
``BLOCK_KV`` keys at a time under ``lax.scan`` against the query rows that can see them,
recomputing the weights from the log-sum-exp (FlashAttention-2's backward; with the causal
rule or a window, ``SEGMENTS`` static segments of keys skip the masked rows). No array is
``(q_len, kv_len)`` (``tests/test_fast_backward_jax.py``: float64 gradients against JAX's
autodiff of the explicit steps and the NumPy reference): ``jax.grad`` of
``scaled_dot_product_attention`` and ``scaled_dot_product_attention_vjp`` reach it through
``jax.vjp`` of the forward pass.
Figures: ``benchmarks/jax_backward.py`` and ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

import attention_rules as rules

from . import _core  # the steps the fast paths must equal, and reuse
from ._core import NEG_INF, _merge_partials, _sum_groups, _sum_to_shape

_CUDNN = rules.FAST_PATHS["jax_attn"]["cudnn"]
_BLOCKED = rules.FAST_PATHS["jax_attn"]["blocked"]
CUDNN_PLATFORMS = _CUDNN["platforms"]  # tests patch these two to run the path on the CPU
CUDNN_IMPLEMENTATION: str | None = "cudnn"
CUDNN_DTYPES = _CUDNN["dtypes"]  # cuDNN's flash attention is half-only
BLOCKED_PLATFORMS = _BLOCKED["platforms"]
BLOCK_Q = _BLOCKED["block_q"]  # query rows per lax.map step: the block's scores stay in cache
SEGMENTS = _BLOCKED["segments"]  # causal rule / window: static key ranges (more: slower compile)
BLOCK_KV = _BLOCKED["block_kv"]  # keys per lax.scan step of the VJP, against all their queries
MIN_SCORES = _BLOCKED["min_scores"]  # below this many score entries the steps are as fast
MIN_Q_LEN = _BLOCKED["min_q_len"]  # at least BLOCK_Q: a lax.map of whole blocks
# With chunks, segment ids or mask_mod: at most this many static segments (each a lax.map of
# its own: more compile, fewer products of tiles those rules empty)
MOD_SEGMENTS = 16
_FN = "scaled_dot_product_attention"  # the name in messages raised inside the custom VJP


def use_fast_path(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    args: rules.Arguments,
    backend: str | None = None,
) -> str | None:
    """The fast path for these validated inputs (``"cudnn"``, ``"blocked"``), or None for the
    steps. Static information only (shapes, dtypes, options, platforms); ``backend`` defaults
    to the platform(s) of the query's devices (``_platforms``).

    Args:
      query: ``(..., heads, q_len, head_dim)``; key: ``(..., kv_heads, kv_len, head_dim)``;
        value: ``(..., kv_heads, kv_len, v_dim)`` (arrays, tracers or ``ShapeDtypeStruct``).
      mask, bias: None or broadcastable to ``(..., heads, q_len, kv_len)``.
      args: the normalised options (``rules.attention_arguments``).
      backend: a platform name (``"cpu"``, ``"gpu"``) instead of the query's.
    """
    if args.return_weights or args.dropout_p > 0.0:
        return None  # neither path returns the weights or takes a keep-mask
    platforms = _platforms(query) if backend is None else {backend}
    lse_or_sinks = args.return_lse or args.has_sinks  # jax.nn here has neither: blocked only
    if platforms <= set(CUDNN_PLATFORMS) and not lse_or_sinks and _cudnn_fits(
        query, key, value, mask, bias, args
    ):
        return "cudnn"
    if platforms <= set(BLOCKED_PLATFORMS) and rules.large_enough(
        query.shape, key.shape, value.shape, MIN_SCORES, MIN_Q_LEN
    ):
        return "blocked"
    return None


def _platforms(x: Any) -> set[str]:
    """The platforms (``"cpu"``, ``"gpu"``, ...) of the devices a concrete ``jax.Array`` lives
    on; ``{jax.default_backend()}`` for anything else: a tracer under ``jit`` has no concrete
    device (jit places the computation on the default backend), nor has a ``ShapeDtypeStruct``."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return {device.platform for device in x.devices()}
    return {jax.default_backend()}


def fast_attention(
    path: str,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    args: rules.Arguments,
    sinks: jax.Array | None = None,
    mods: _core._Mods | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array] | None:
    """``scaled_dot_product_attention``'s output on the path ``use_fast_path`` chose; None when
    cuDNN refuses the shapes (then the explicit steps run). With ``args.return_lse`` also the
    row log-sum-exp ``(..., heads, q_len)`` the blocks computed anyway (compute dtype); the
    ``(heads,)`` ``sinks`` join each row's denominator once, after the blocks
    (``_blocked_attention_lse``); ``mods`` (chunks, ALiBi, segment ids, the mods) apply per
    block, and the blocks they mask entirely are not computed (``_core._mods_segments``)."""
    if path == "cudnn":
        try:  # cuDNN checks its shapes at trace time
            output = _cudnn_attention(
                query, key, value, args.scale, args.is_causal, args.window, CUDNN_IMPLEMENTATION
            )
        except (ValueError, NotImplementedError, RuntimeError):
            return None
        return output.astype(query.dtype)
    mod_arrays = None
    if mods is not None:  # what a mod returns is checked here, with the caller's name
        _check_mods(mods, query, key)
        mod_arrays = mods.arrays
    output, lse = _blocked_attention_lse(args, query, key, value, mask, bias, sinks, mod_arrays)
    output = output.astype(query.dtype)
    return (output, lse[..., 0]) if args.return_lse else output


# ------------------------------------------------------------------------------------------
# cuDNN: jax.nn.dot_product_attention where its semantics equal the spec's (GPU only)
# ------------------------------------------------------------------------------------------


def _cudnn_fits(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    args: rules.Arguments,
) -> bool:
    """Whether ``jax.nn.dot_product_attention`` computes exactly the spec's result here."""
    if query.dtype.name not in CUDNN_DTYPES:
        return False  # float32/64: cuDNN's flash attention is half-only
    if mask is not None or bias is not None or args.softcap is not None or args.has_mods:
        return False  # a mask or bias could empty a row; jax.nn has no softcap, no mods
    if value.shape[-1] != query.shape[-1] or rules.has_empty_axis(query.shape, key.shape):
        return False  # jax.nn needs v_dim == head_dim; empty axes are not worth a kernel
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if (args.is_causal or args.window is not None) and q_len != kv_len:
        return False  # alignment: cuDNN's causal mask is top-left only
    if args.window is not None and not args.is_causal and args.window[1] != 0:
        return False  # cuDNN windows look left only: (left, 0), or any window with is_causal
    return True


def _cudnn_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    scale: float,
    is_causal: bool,
    window: tuple[int | None, int | None] | None,
    implementation: str | None,
) -> jax.Array:
    """``jax.nn.dot_product_attention`` in this project's layout, ``(..., heads, seq, dim)``."""

    def to_btnh(x: jax.Array) -> jax.Array:  # (..., heads, seq, dim) → (batch, seq, heads, dim)
        x = x.reshape((-1,) + x.shape[-3:]) if x.ndim >= 3 else x[None, None]
        return jnp.swapaxes(x, 1, 2)

    local_window_size = None
    if window is not None:  # eligible windows are (left, 0) or causal: causal plus a left bound
        is_causal = True
        local_window_size = None if window[0] is None else (window[0], 0)
    output = jax.nn.dot_product_attention(
        to_btnh(query), to_btnh(key), to_btnh(value), scale=scale, is_causal=is_causal,
        local_window_size=local_window_size, implementation=implementation,
    )  # (batch, q_len, heads, v_dim)
    return jnp.swapaxes(output, 1, 2).reshape(query.shape[:-1] + (value.shape[-1],))


# ------------------------------------------------------------------------------------------
# Blocked: the same steps over blocks of queries, for large inputs on the CPU
# ------------------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocked_attention_lse(
    args: rules.Arguments,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    sinks: jax.Array | None,
    mod_arrays: tuple | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The output ``(..., heads, q_len, v_dim)`` in the compute dtype (``_blocked_forward``;
    jax: a ``custom_vjp``, as autodiff through ``lax.map`` would store every block's weights,
    the whole ``(q_len, kv_len)`` matrix), with the ``(heads,)`` ``sinks`` (or None) joined to
    each row's denominator after the blocks (``_core._with_sinks``), and the row log-sum-exp
    ``(..., heads, q_len, 1)`` the blocks compute anyway (``-inf``: no key nor sink); both
    differentiable. The VJP takes the lse's cotangent (``dS = P ⊙ (dP - rowsum(dO ⊙ O) +
    dlse)`` with ``P`` and ``O`` those of the rows with their sinks) and gives the sinks'
    gradient (``_core._sinks_grad``), as numpy_attn's blocked VJP does. ``mod_arrays``: the
    ``_core._Mods.arrays`` of the call (its ALiBi slopes and segment ids: no cotangent), or
    None."""
    return _blocked_attention_lse_fwd(args, query, key, value, mask, bias, sinks, mod_arrays)[0]


def _blocked_attention_lse_fwd(
    args: rules.Arguments,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    sinks: jax.Array | None,
    mod_arrays: tuple | None = None,
) -> tuple[tuple[jax.Array, jax.Array], tuple]:
    """The output and lse, and what the backward pass needs."""
    mods = _rebuilt(args, query, key, mod_arrays)
    output, lse = _blocked_forward(query, key, value, mask, bias, args, with_lse=True, mods=mods)
    output, lse = _core._with_sinks(output, lse, sinks)
    return (output, lse), (query, key, value, mask, bias, sinks, mod_arrays, output, lse)


def _blocked_attention_lse_bwd(args: rules.Arguments, residuals: tuple,
                               cotangents: tuple[jax.Array, jax.Array]) -> tuple:
    query, key, value, mask, bias, sinks, mod_arrays, output, lse = residuals
    grad_output, grad_lse = cotangents
    lse = jnp.where(lse == NEG_INF, jnp.inf, lse)  # no key nor sink: exp(s - lse) = 0
    grad_q, grad_k, grad_v, grad_bias = _blocked_attention_vjp(
        query, key, value, grad_output, mask, bias, args, output, lse, grad_lse,
        _rebuilt(args, query, key, mod_arrays))
    grad_sinks = None
    if sinks is not None:  # d sink = sum exp(sink - lse) · (dlse - rowsum(dO ⊙ O))
        delta = (grad_output.astype(output.dtype) * output).sum(axis=-1, keepdims=True)
        grad_sinks = _core._sinks_grad(sinks, lse, delta - grad_lse).astype(sinks.dtype)
    # mask: boolean; the slopes and ids of mod_arrays: constants and ints: no cotangent
    return grad_q, grad_k, grad_v, None, grad_bias, grad_sinks, None


_blocked_attention_lse.defvjp(_blocked_attention_lse_fwd, _blocked_attention_lse_bwd)


def _rebuilt(args: rules.Arguments, query: jax.Array, key: jax.Array, mod_arrays: tuple | None
             ) -> _core._Mods | None:
    """The call's ``_core._Mods`` rebuilt inside the custom VJP from its arrays (the callables
    and the chunk size are in ``args``)."""
    if mod_arrays is None:
        return None
    alibi, q_ids, kv_ids = mod_arrays
    return _core._mods(_FN, args, query.shape, key.shape, alibi,
                       None if q_ids is None else (q_ids, kv_ids))


def _check_mods(mods: _core._Mods, query: jax.Array, key: jax.Array) -> None:
    """What the mods return, on one block's shapes, before the custom VJP (whose messages
    would name ``_FN``): ``jax.eval_shape``, so nothing is computed."""
    rows, keys = min(BLOCK_Q, query.shape[-2]), key.shape[-2]
    scores = jax.ShapeDtypeStruct(query.shape[:-1] + (keys,), rules.compute_dtype(
        query.dtype.name))
    if mods.score_mod is not None:
        jax.eval_shape(lambda s: _core._mods_scores(s[..., :rows, :], mods, 0, 0), scores)
    if mods.mask_mod is not None:
        jax.eval_shape(lambda: _core._mods_allowed(mods, 0, rows, 0, keys))


def _blocked_forward(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    args: rules.Arguments,
    with_lse: bool,
    mods: _core._Mods | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """``_forward_heads`` for one (batch, kv head) item at a time under ``lax.map`` (its
    blocks then stay in cache) when the causal rule or a window cuts the work into pieces; for
    all heads at once without them (each ``lax.map`` step then spreads over the cores: 1.4x
    faster at 2,048 tokens, 8 heads), when there is one item, or when the mask or bias varies
    along the batch or head axes (``_items``). With ``mods`` the items count as banded; each
    takes its own slopes, ids and indices (``_core._mods_item``), and the static segments are
    made once, over every item, before the ``lax.map``."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
    masks = mods is not None and mods.masks
    banded = lo > -math.inf or hi < math.inf or masks
    items = _items(query, key, mask, bias) if banded else 1
    pieces = _core._mods_segments(mods, q_len, kv_len, lo, hi, True, BLOCK_Q, BLOCK_KV,
                                  MOD_SEGMENTS) if masks else None
    if items == 1:
        return _forward_heads(query, key, value, mask, bias, args, with_lse, mods, pieces)
    mask, bias = _squeeze(mask), _squeeze(bias)  # the same for every item
    groups = query.shape[-3] // key.shape[-3]

    def one(xs: tuple) -> tuple:
        q, k, v, i = xs
        item_mods = None if mods is None else _core._mods_item(mods, i, key.shape[-3], groups)
        return _forward_heads(q, k, v, mask, bias, args, with_lse, item_mods, pieces)

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
    mods: _core._Mods | None = None,
    pieces: list | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """The output in the compute dtype, ``BLOCK_Q`` queries at a time under ``lax.map`` (XLA
    keeps a block's scores in cache and spreads each op over the cores), normalising after
    ``@ value``; and, ``with_lse``, the row log-sum-exp ``(..., heads, q_len, 1)`` (``+inf`` on
    fully masked rows, so that ``exp(score - lse)`` is 0 there). With the causal rule or a
    window the queries are cut into at most ``SEGMENTS`` static segments, each against only the
    keys it can see; with ``mods`` that mask, into the segments of ``_core._mods_segments``
    (``pieces``, when the caller made them already)."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    compute = rules.compute_dtype(query.dtype.name)
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
    banded = lo > -math.inf or hi < math.inf  # the causal rule or a window cuts some blocks
    plain = mask is None and bias is None and mods is None
    if args.window is None and plain and banded:
        triangle = min(q_len - max(0, -int(hi)), kv_len - max(0, int(hi)))
        if triangle >= 2 * BLOCK_Q:  # the causal rule alone: halves, not segments
            output, lse = _causal_forward(query, key, value, args)
            return output, lse if with_lse else None
    if bias is not None:
        bias = bias.astype(compute)

    def block(q_blk, i0, k0, k_seg, v_seg, mask_seg, bias_seg):  # (..., heads, n, head_dim)
        n, keys = q_blk.shape[-2], k_seg.shape[-2]
        scores = _core._scores(q_blk, k_seg, args.scale, args.softcap)  # (..., heads, n, keys)
        if bias_seg is not None:
            scores = scores + _rows(bias_seg, i0, n)
        scores = _core._mods_scores(scores, mods, i0, k0)  # ALiBi, score_mod
        allowed = _rows(mask_seg, i0, n)
        if banded:  # j - i with global positions: i0 is traced, k0 static
            in_band = _core._in_band(i0, n, k0, keys, lo, hi)
            allowed = in_band if allowed is None else allowed & in_band
        extra = _core._mods_allowed(mods, i0, n, k0, keys)  # chunks, segment ids, mask_mod
        if extra is not None:
            allowed = extra if allowed is None else allowed & extra
        if allowed is not None:  # replaced, not added: a masked NaN does not spread
            scores = jnp.where(allowed, scores, NEG_INF)
        if not with_lse:
            weights, row_sum = _core._unnormalised_softmax(scores)  # (..., heads, n, 1)
            return _core._output(weights, v_seg) / row_sum, None  # (..., heads, n, v_dim)
        weights, row_sum, lse = _softmax_lse(scores)
        return _core._output(weights, v_seg) / row_sum, lse

    if mods is not None and mods.masks:
        if pieces is None:
            pieces = _core._mods_segments(mods, q_len, kv_len, lo, hi, True, BLOCK_Q, BLOCK_KV,
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
    query: jax.Array, key: jax.Array, value: jax.Array, args: rules.Arguments
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
    i0, c0, n, depth, side = _triangle(q_len, kv_len, args)
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
                               None, plain, True))
    if i0 + n < q_len:  # the rows below the triangle see keys [c0, kv_len) too
        add(i0 + n, _forward_heads(query[..., i0 + n :, :], key[..., c0:, :],
                                   value[..., c0:, :], None, None, plain, True))
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
            part = _forward_heads(q_l, k_l, v_l, None, None, plain, True)
        else:  # the diagonal leaves, causal
            leaf = side // parts
            q_l, k_l, v_l = (_halves(x, parts, leaf, None) for x in tri)
            part = _forward_heads(q_l, k_l, v_l, None, None, args._replace(
                causal_alignment="top_left", window=None), True)
        part_lse = jnp.where(part[1] == jnp.inf, NEG_INF, part[1])  # +inf: no key
        part_out = _unhalves(part[0], level < depth, 0.0)
        part_lse = _unhalves(part_lse, level < depth, NEG_INF)
        out_tri, lse_tri = _merge_partials(out_tri, lse_tri, part_out, part_lse)
    add(i0, (out_tri[..., :n, :], lse_tri[..., :n, :]))
    empty = lse == NEG_INF  # rows that see no key: output 0, lse +inf (exp(s - lse) = 0)
    return output, jnp.where(empty, jnp.inf, lse)


def _triangle(q_len: int, kv_len: int, args: rules.Arguments) -> tuple[int, int, int, int, int]:
    """The pieces of the causal rule (``_causal_forward``, ``_causal_vjp``): the diagonal
    triangle's first row ``i0``, first key ``c0`` and side ``n``, how many times it is halved
    (``depth``: leaves of at most ``BLOCK_Q`` rows) and its side padded to ``leaf · 2^depth``."""
    offset = int(rules.band(q_len, kv_len, True, args.causal_alignment, None)[1])
    i0, c0 = max(0, -offset), max(0, offset)
    n = min(q_len - i0, kv_len - c0)
    depth = max(0, math.ceil(math.log2(n / BLOCK_Q)))
    return i0, c0, n, depth, -(-n // 2**depth) * 2**depth


def _halves(x: jax.Array, parts: int, size: int, lower: bool | None) -> jax.Array:
    """``(..., side, d)`` cut into ``parts`` chunks (each two halves of ``size`` rows when
    ``lower`` is not None: the lower or the upper one) → ``(parts, ..., size, d)``."""
    if lower is None:
        x = x.reshape(x.shape[:-2] + (parts, size, x.shape[-1]))
    else:
        x = x.reshape(x.shape[:-2] + (parts, 2, size, x.shape[-1]))[..., int(lower), :, :]
    return jnp.moveaxis(x, -3, 0)


def _unhalves(x: jax.Array, halves: bool, fill: float, lower: bool = True) -> jax.Array:
    """Undo ``_halves``: ``(parts, ..., size, d)`` → ``(..., side, d)``; with ``halves`` the
    other half of each chunk (the upper one for ``lower``) filled with ``fill`` (what adds
    nothing)."""
    x = jnp.moveaxis(x, 0, -3)  # (..., parts, size, d)
    if halves:
        other = jnp.full_like(x, fill)
        x = jnp.stack([other, x] if lower else [x, other], axis=-3)  # (..., parts, 2, size, d)
    return x.reshape(x.shape[:-4 if halves else -3] + (-1, x.shape[-1]))


def _pad_rows(x: jax.Array, size: int) -> jax.Array:
    """Zero rows appended up to ``size`` rows."""
    pad = [(0, 0)] * (x.ndim - 2) + [(0, size - x.shape[-2]), (0, 0)]
    return jnp.pad(x, pad) if size > x.shape[-2] else x


def _causal_vjp(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    grad_output: jax.Array,
    args: rules.Arguments,
    delta: jax.Array,
    lse: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, None]:
    """The causal rule alone (no mask, bias or window): ``_vjp_heads`` over the pieces of
    ``_causal_forward`` (rectangles without a mask, a triangle halved again and again, causal
    leaves), each with the rows' own ``delta`` and log-sum-exp, the gradients added up."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    i0, c0, n, depth, side = _triangle(q_len, kv_len, args)
    plain = args._replace(is_causal=False, window=None)
    q, k, v = (_core._to_compute(x) for x in (query, key, value))  # sums in compute dtype
    d_out = grad_output.astype(q.dtype)
    grad_q, grad_k, grad_v = jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    for r0, k0, k1 in ((i0, 0, c0), (i0 + n, c0, kv_len)):  # rectangles: rows r0.. × keys k0:k1
        if k1 > k0 and r0 < q_len:
            gq, gk, gv, _ = _vjp_heads(q[..., r0:, :], k[..., k0:k1, :], v[..., k0:k1, :],
                                       d_out[..., r0:, :], None, None, plain,
                                       delta[..., r0:, :], lse[..., r0:, :])
            grad_q = grad_q.at[..., r0:, :].add(gq)
            grad_k = grad_k.at[..., k0:k1, :].add(gk)
            grad_v = grad_v.at[..., k0:k1, :].add(gv)
    # rows padded to side: dO = 0 and lse = +inf, so they add 0
    rows = [_pad_rows(x[..., i0 : i0 + n, :], side) for x in (q, d_out, delta)]
    lse_tri = jnp.pad(lse[..., i0 : i0 + n, :], [(0, 0)] * (lse.ndim - 2) + [(0, side - n), (0, 0)],
                      constant_values=jnp.inf)
    rows.append(lse_tri)
    cols = [_pad_rows(x[..., c0 : c0 + n, :], side) for x in (k, v)]
    tri_q = jnp.zeros(rows[0].shape, q.dtype)
    tri_k, tri_v = jnp.zeros(cols[0].shape, q.dtype), jnp.zeros(cols[1].shape, q.dtype)
    for level in range(depth + 1):
        parts = 2**level
        if level < depth:  # rows of each lower half against keys of its upper half
            size, lower, piece_args = side // (2 * parts), True, plain
        else:  # the diagonal leaves, causal
            size, lower, piece_args = side // parts, None, args._replace(
                causal_alignment="top_left", window=None)
        q_l, d_l, o_l, lse_l = (_halves(x, parts, size, lower) for x in rows)
        k_l, v_l = (_halves(x, parts, size, None if lower is None else False) for x in cols)
        gq, gk, gv, _ = _vjp_heads(q_l, k_l, v_l, d_l, None, None, piece_args, o_l, lse_l)
        halves = level < depth
        tri_q = tri_q + _unhalves(gq, halves, 0.0)
        tri_k = tri_k + _unhalves(gk, halves, 0.0, lower=False)
        tri_v = tri_v + _unhalves(gv, halves, 0.0, lower=False)
    grad_q = grad_q.at[..., i0 : i0 + n, :].add(tri_q[..., :n, :])
    grad_k = grad_k.at[..., c0 : c0 + n, :].add(tri_k[..., :n, :])
    grad_v = grad_v.at[..., c0 : c0 + n, :].add(tri_v[..., :n, :])
    return (grad_q.astype(query.dtype), grad_k.astype(key.dtype), grad_v.astype(value.dtype),
            None)


def _blocked_attention_vjp(
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
    mods: _core._Mods | None = None,
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
    the items' bias gradients), or all heads at once (``_items``); ``mods``' ``score_mod`` the
    blocks differentiate by ``jax.vjp``.

    Returns:
      ``(grad_query, grad_key, grad_value, grad_bias)`` shaped like and in the dtypes of query,
      key, value and bias (``grad_bias`` None without a bias).
    """
    compute = rules.compute_dtype(query.dtype.name)
    delta = (grad_output.astype(compute) * output).sum(axis=-1, keepdims=True)  # (..., q, 1)
    if grad_lse is not None:  # dlse / dS = P: dS = P ⊙ (dP - delta + dlse)
        delta = delta - grad_lse.astype(compute)
    items = _items(query, key, mask, bias)
    pieces = None  # with mods: the static segments of keys, made once for every item
    if mods is not None and mods.masks:
        q_len, kv_len = query.shape[-2], key.shape[-2]
        lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
        pieces = _core._mods_segments(mods, q_len, kv_len, lo, hi, False, BLOCK_Q, BLOCK_KV,
                                      MOD_SEGMENTS)
    if items == 1:
        return _vjp_heads(query, key, value, grad_output, mask, bias, args, delta, lse, mods,
                          pieces)
    mask_item, bias_item = _squeeze(mask), _squeeze(bias)  # the same for every item
    groups = query.shape[-3] // key.shape[-3]

    def item(grad_bias: jax.Array | None, xs: tuple) -> tuple:
        q, k, v, d_out, delta_item, lse_item, i = xs
        item_mods = None if mods is None else _core._mods_item(mods, i, key.shape[-3], groups)
        grad_q, grad_k, grad_v, grad_b = _vjp_heads(
            q, k, v, d_out, mask_item, bias_item, args, delta_item, lse_item, item_mods, pieces)
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
    mods: _core._Mods | None = None,
    pieces: list | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """``_blocked_attention_vjp`` for all heads at once; ``delta (..., heads, q_len, 1)`` is
    ``rowsum(dO ⊙ O) - dlse``; ``pieces``: the segments of keys for ``mods``, if made."""
    q_len, kv_len, v_dim = query.shape[-2], key.shape[-2], value.shape[-1]
    compute = rules.compute_dtype(query.dtype.name)
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
    banded = lo > -math.inf or hi < math.inf
    if args.window is None and mask is None and bias is None and mods is None and banded:
        if min(q_len - max(0, -int(hi)), kv_len - max(0, int(hi))) >= 2 * BLOCK_Q:
            return _causal_vjp(query, key, value, grad_output, args, delta, lse)
    groups = _core._groups(query.shape, key.shape)
    rank = query.ndim  # of the scores too
    q_scaled = _core._to_compute(query) * args.scale  # (..., heads, q_len, head_dim)
    k, v = _core._to_compute(key), _core._to_compute(value)
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
        carried ``dQ`` and returns ``dK``, ``dV`` and the bias gradient of the block."""
        q_seg, d_out_seg, lse_seg, dot_seg, mask_seg, bias_seg = seg  # (..., heads, rows, ·)
        n, rows = k_blk.shape[-2], q_seg.shape[-2]
        capped = _core._scores(q_seg, k_blk, 1.0, args.softcap)  # (..., heads, rows, n)

        def masked(scores: jax.Array) -> jax.Array:  # + bias, ALiBi, score_mod; -inf if masked
            if bias_seg is not None:
                scores = scores + _cols(bias_seg, j0, n)
            scores = _core._mods_scores(scores, mods, r0, j0)
            allowed = _cols(mask_seg, j0, n)
            if banded:
                in_band = _core._in_band(r0, rows, j0, n, lo, hi)
                allowed = in_band if allowed is None else allowed & in_band
            extra = _core._mods_allowed(mods, r0, rows, j0, n)
            if extra is not None:
                allowed = extra if allowed is None else allowed & extra
            return scores if allowed is None else jnp.where(allowed, scores, NEG_INF)

        through_mod = None  # score_mod's pullback: dS back to the scores before it
        if mods is not None and mods.score_mod is not None:
            scores, through_mod = jax.vjp(masked, capped)
        else:
            scores = masked(capped)
        p = jnp.exp(scores - lse_seg)  # the weights, recomputed; 0 where masked
        grad_v = _sum_groups(_matmul_t(p, d_out_seg), groups)  # dV = Pᵀ dO: (..., n, v_dim)
        grad_p = _core._scores(d_out_seg, v_blk, 1.0, None)  # dP = dO Vᵀ
        grad_s = p * (grad_p - dot_seg)  # dS: (..., heads, rows, n)
        if through_mod is not None:  # d score_mod / d score, by autodiff of the block
            grad_s = through_mod(grad_s)[0]
        grad_bias_blk = None
        if bias_seg is not None:
            grad_bias_blk = _sum_to_shape(grad_s, _cols(bias_seg, j0, n).shape)
        if args.softcap is not None:  # tanh' = 1 - (capped / softcap)²
            grad_s = grad_s * (1.0 - jnp.square(capped * (1.0 / args.softcap)))
        grad_q = carry + _core._output(grad_s, k_blk)  # dS K (scaled at the end)
        grad_k = _sum_groups(_matmul_t(grad_s, q_seg), groups)  # dSᵀ Q · scale
        return grad_q, (grad_k, grad_v, grad_bias_blk)

    if mods is not None and mods.masks:
        if pieces is None:
            pieces = _core._mods_segments(mods, q_len, kv_len, lo, hi, False, BLOCK_Q,
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
            pieces.append((_unblock(grad_k), _unblock(grad_v), grad_b, c0, c0 + full))
        if c0 + full < c1:
            carry, (grad_k, grad_v, grad_b) = step(
                carry, k[..., c0 + full : c1, :], v[..., c0 + full : c1, :], c0 + full)
            pieces.append((grad_k, grad_v, None if grad_b is None else grad_b[None],
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


# ------------------------------------------------------------------------------------------
# Helpers of the blocked path
# ------------------------------------------------------------------------------------------


def _softmax_lse(scores: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``_core._unnormalised_softmax`` plus the row log-sum-exp ``max + log(sum)``
    (``+inf`` on a fully masked row)."""
    row_max = scores.max(axis=-1, keepdims=True, initial=NEG_INF)  # (..., n, 1)
    row_max = jnp.where(row_max == NEG_INF, 0.0, row_max)  # fully masked: exp(-inf - 0) = 0
    weights = jnp.exp(scores - row_max)
    row_sum = weights.sum(axis=-1, keepdims=True)  # (..., n, 1)
    empty = row_sum == 0.0
    row_sum = jnp.where(empty, 1.0, row_sum)  # 0 / 1 = 0 for fully masked rows
    return weights, row_sum, jnp.where(empty, jnp.inf, row_max + jnp.log(row_sum))


def _items(query: jax.Array, key: jax.Array, mask: jax.Array | None,
           bias: jax.Array | None) -> int:
    """How many (batch, kv head) items the blocked path takes one at a time: the product of
    the key's leading axes; 1 (all heads at once) for 2-D inputs, or when the mask or the bias
    varies along a batch or head axis (each item would need its own slice of it)."""
    if query.ndim < 3 or any(x is not None and math.prod(x.shape[:-2]) != 1 for x in (mask, bias)):
        return 1
    return math.prod(key.shape[:-2])


def _to_items(x: jax.Array, items: int) -> jax.Array:
    """``(..., kv_heads · groups, T, d)`` → ``(items, groups, T, d)``: one item per (batch,
    kv head), with its query heads (``_core._group_heads``' order)."""
    return x.reshape((items, -1) + x.shape[-2:])


def _squeeze(x: jax.Array | None) -> jax.Array | None:
    """A mask or bias without its leading size-1 axes: at most ``(q_len, kv_len)``."""
    return None if x is None else x.reshape(x.shape[-2:])


def _rows(x: jax.Array | None, i0: Any, n: int) -> jax.Array | None:
    """Rows ``i0 : i0 + n`` of a mask or bias whose query axis is not broadcast."""
    if x is None or x.ndim < 2 or x.shape[-2] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, i0, n, axis=x.ndim - 2)


def _cols(x: jax.Array | None, k0: Any, n: int) -> jax.Array | None:
    """Columns ``k0 : k0 + n`` of a mask or bias whose key axis is not broadcast."""
    if x is None or x.shape[-1] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, k0, n, axis=x.ndim - 1)


def _blocks(x: jax.Array, size: int) -> jax.Array:
    """``(..., n · size, d)`` → ``(n, ..., size, d)``: the blocks along the first axis, for
    ``lax.map`` and ``lax.scan``."""
    x = x.reshape(x.shape[:-2] + (-1, size, x.shape[-1]))
    return jnp.moveaxis(x, -3, 0)


def _unblock(x: jax.Array) -> jax.Array:
    """``(n, ..., block, d)`` → ``(..., n · block, d)``: undo ``_blocks``."""
    x = jnp.moveaxis(x, 0, -3)
    return x.reshape(x.shape[:-3] + (-1, x.shape[-1]))


def _matmul_t(a: jax.Array, b: jax.Array) -> jax.Array:
    """``aᵀ b`` over the last two axes: ``(..., rows, n)ᵀ @ (..., rows, d)`` → ``(..., n, d)``
    (XLA folds the transpose into the product)."""
    return jnp.matmul(jnp.swapaxes(a, -1, -2), b, precision=_core.HIGHEST)
