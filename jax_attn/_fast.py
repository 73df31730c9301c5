"""The fast paths of jax_attn: cuDNN's flash attention on a GPU, the blocked steps on the CPU.

``use_fast_path`` is the one selection rule (its numbers are
``attention_rules.FAST_PATHS["jax_attn"]``); ``fast_attention`` runs the path it chose.

``"cudnn"``: without ``return_weights``, ``jax.nn.dot_product_attention(...,
implementation="cudnn")`` (flash attention) when a GPU backend, float16/bfloat16 inputs,
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
and ``MIN_SCORES`` score entries), ``_blocked_attention`` runs the same steps for ``BLOCK_Q``
queries at a time under ``lax.map``, so a block's scores stay in cache, with the division by the
row sums moved after ``@ value``; with the causal rule or a window the queries form at most
``SEGMENTS`` static segments, each against only the keys it can see (fully masked work is
skipped). Each step is ``functional.py``'s own helper (``_scores``, ``_in_band``,
``_unnormalised_softmax``, ``_output``). It supports everything else (mask, bias, softcap,
grouped-query heads, both alignments, 2-D inputs), ``jit``, ``vmap`` and ``grad``, and equals the
explicit steps within float32 rounding, NaN and infinities included
(``tests/test_performance_paths.py``). At 2048 tokens it is about 2.5 times as fast as jax.nn's
XLA implementation (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

import attention_rules as rules

from . import functional  # the steps the fast paths must equal, and reuse

NEG_INF = -jnp.inf
_CUDNN = rules.FAST_PATHS["jax_attn"]["cudnn"]
_BLOCKED = rules.FAST_PATHS["jax_attn"]["blocked"]
CUDNN_PLATFORMS = _CUDNN["platforms"]  # tests patch these two to run the path on the CPU
CUDNN_IMPLEMENTATION: str | None = "cudnn"
CUDNN_DTYPES = _CUDNN["dtypes"]  # cuDNN's flash attention is half-only
BLOCKED_PLATFORMS = _BLOCKED["platforms"]
BLOCK_Q = _BLOCKED["block_q"]  # query rows per lax.map step: the block's scores stay in cache
SEGMENTS = _BLOCKED["segments"]  # causal rule / window: static key ranges (more: slower compile)
MIN_SCORES = _BLOCKED["min_scores"]  # below this many score entries the steps are as fast
MIN_Q_LEN = _BLOCKED["min_q_len"]  # at least BLOCK_Q: a lax.map of whole blocks


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
    steps. Static information only (shapes, dtypes, options); ``backend`` defaults to
    ``jax.default_backend()``."""
    backend = jax.default_backend() if backend is None else backend
    if args.return_weights or args.dropout_p > 0.0:
        return None  # neither path returns the weights or takes a keep-mask
    if backend in CUDNN_PLATFORMS and _cudnn_fits(query, key, value, mask, bias, args):
        return "cudnn"
    if backend in BLOCKED_PLATFORMS and rules.large_enough(
        query.shape, key.shape, value.shape, MIN_SCORES, MIN_Q_LEN
    ):
        return "blocked"
    return None


def fast_attention(
    path: str,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    args: rules.Arguments,
) -> jax.Array | None:
    """``scaled_dot_product_attention``'s output on the path ``use_fast_path`` chose; None when
    cuDNN refuses the shapes (then the explicit steps run)."""
    if path == "cudnn":
        try:  # cuDNN checks its shapes at trace time
            output = _cudnn_attention(
                query, key, value, args.scale, args.is_causal, args.window, CUDNN_IMPLEMENTATION
            )
        except (ValueError, NotImplementedError, RuntimeError):
            return None
        return output.astype(query.dtype)
    return _blocked_attention(query, key, value, mask, bias, args).astype(query.dtype)


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
    if mask is not None or bias is not None or args.softcap is not None:
        return False  # a mask or bias could empty a row; jax.nn has no softcap
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


def _blocked_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    args: rules.Arguments,
) -> jax.Array:
    """The output in the compute dtype, ``BLOCK_Q`` queries at a time under ``lax.map`` (XLA
    keeps a block's scores in cache and spreads each op over the cores), normalising after
    ``@ value``. With the causal rule or a window the queries are cut into at most ``SEGMENTS``
    static segments, each against only the keys it can see."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
    banded = lo > -math.inf or hi < math.inf  # the causal rule or a window cuts some blocks
    if bias is not None:
        bias = bias.astype(rules.compute_dtype(query.dtype.name))

    def rows(x: jax.Array | None, i0: Any, n: int) -> jax.Array | None:
        """Rows ``i0 : i0 + n`` of a mask or bias whose query axis is not broadcast."""
        if x is None or x.ndim < 2 or x.shape[-2] == 1:
            return x
        return jax.lax.dynamic_slice_in_dim(x, i0, n, axis=-2)

    def cols(x: jax.Array | None, k0: int, k1: int) -> jax.Array | None:
        if x is None or x.shape[-1] == 1:
            return x
        return x[..., k0:k1]

    def block(q_blk, i0, k0, k_seg, v_seg, mask_seg, bias_seg):  # (..., heads, n, head_dim)
        n, keys = q_blk.shape[-2], k_seg.shape[-2]
        scores = functional._scores(q_blk, k_seg, args.scale, args.softcap)  # (..., heads, n, keys)
        if bias_seg is not None:
            scores = scores + rows(bias_seg, i0, n)
        allowed = rows(mask_seg, i0, n)
        if banded:  # j - i with global positions: i0 is traced, k0 static
            in_band = functional._in_band(i0, n, k0, keys, lo, hi)
            allowed = in_band if allowed is None else allowed & in_band
        if allowed is not None:  # replaced, not added: a masked NaN does not spread
            scores = jnp.where(allowed, scores, NEG_INF)
        weights, row_sum = functional._unnormalised_softmax(scores)  # (..., heads, n, 1)
        return functional._output(weights, v_seg) / row_sum  # (..., heads, n, v_dim)

    n_blocks = q_len // BLOCK_Q
    segments = min(SEGMENTS, n_blocks) if banded else 1
    bounds = [n_blocks * s // segments * BLOCK_Q for s in range(segments)] + [q_len]
    outputs = []
    for r0, r1 in zip(bounds[:-1], bounds[1:], strict=True):  # static segments of query rows
        k0, k1, _, _ = rules.key_range(r0, r1, kv_len, lo, hi)
        shape = query.shape[:-2] + (r1 - r0, value.shape[-1])
        if k1 == k0:  # no row of the segment sees a key: fully masked
            outputs.append(jnp.zeros(shape, rules.compute_dtype(query.dtype.name)))
            continue
        segment = (k0, key[..., k0:k1, :], value[..., k0:k1, :],
                   cols(mask, k0, k1), cols(bias, k0, k1))
        full = (r1 - r0) // BLOCK_Q * BLOCK_Q  # rows in whole blocks; the rest is one block
        q_seg = query[..., r0 : r0 + full, :]
        q_seg = q_seg.reshape(q_seg.shape[:-2] + (-1, BLOCK_Q, q_seg.shape[-1]))
        starts = r0 + BLOCK_Q * jnp.arange(full // BLOCK_Q, dtype=jnp.int32)
        out = jax.lax.map(
            lambda xs, segment=segment: block(xs[0], xs[1], *segment),
            (jnp.moveaxis(q_seg, -3, 0), starts),
        )  # (blocks, ..., heads, BLOCK_Q, v_dim)
        outputs.append(jnp.moveaxis(out, 0, -3).reshape(shape[:-2] + (full, shape[-1])))
        if r0 + full < r1:
            outputs.append(block(query[..., r0 + full : r1, :], r0 + full, *segment))
    return jnp.concatenate(outputs, axis=-2)  # (..., heads, q_len, v_dim)
