"""Split-KV decoding over a quantised cache, dequantised a part at a time (``QuantizedKVCache.
attend``): no float copy of the whole cache is made.

The step is ``paged.split_kv_attention``'s: the keys cut into chunks (``rules.split_chunk``, or
one chunk below ``SPLIT_KV["min_kv_len"]``), each chunk's partial result and log-sum-exp, the
partial results merged by their log-sum-exp in chunk order (``_steps._merge_attention``). jax:
one jitted program per cache shape, whatever its lengths (traced, so a decoding loop compiles
once): the chunks are those of the store's ``max_len`` positions, as ``KVCache``'s split step
cuts its static buffer, the full ones a ``lax.map`` (XLA's while loop) in which a chunk past
the filled positions is skipped (a ``lax.cond``), a shorter last one beside it, and the
residual window one more chunk; positions not yet filled are masked. A chunk reads its store's
positions in parts of about ``PART_BYTES`` of float32 (every batch row and kv head together):
the scores part by part (a ``lax.map``), the chunk's softmax, then the weighted values part by
part (a ``lax.scan``, summed in order); each part's codes are sliced and dequantised right
before its product, so XLA holds one part of float values at a time, and the window's
positions follow the store's, read as they are. The part is what makes the step fast: with
4,096-key chunks dequantised whole, a step took 3-8x as long (int8, 8 kv heads of 128, on the
loaded 2-core machine: 17 ms against 2.2 ms at 4,096 tokens, 34 ms against 10-15 ms at
32,768; a chunk's float keys, 16 MiB, leave the caches before their product reads them);
parts of 2-4 MiB were fastest, 0.5-1 MiB slower again (more loop steps).

The codes of fp8 caches enter as their bytes (``uint8``) and a part's bytes are cast back to
fp8 after the slice: XLA's CPU backend computes nothing in fp8 and widens an fp8 operand to
float16 before slicing it, a copy of the whole store that it hoists out of the loop (and that
made the step as slow as dequantising the whole cache first).

A part is dequantised exactly as ``dequantize_kv`` does it (``codes · scale (+ zero point)``,
float32, rounded once per operation, then to the cache's dtype), so the values are the same
bits as an eager ``cache.keys`` / ``cache.values`` for every dtype, float64 included; only the
chunking of the sums differs from ``scaled_dot_product_attention`` over them
(``spec.SPLIT_DECODING``'s rounding). The scales are not folded into the products (numpy_attn's
and torch_attn's float32 caches fold them): under XLA folding them (per channel group,
``s_g · (codes_g · q_g)``, ``(w · s_g) · codes_g``) took 1.25-1.7x as long with 64-channel
groups (int8, int4 with zero points) and 1.0-1.1x with one group per token (int8), at 4,096
and 32,768 tokens: XLA fuses the cast and the scale into one pass over a part either way, and
the fold adds a product per group.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules

from ._steps import NEG_INF, _merge_attention, _softmax_lse

#: Bytes of float32 keys (or values) dequantised at a time, every batch row and kv head
#: together: 512 positions of 8 kv heads of 128 (jax_attn's choice; the module docstring).
PART_BYTES = 2 << 20


def dequantizing_attention(
    query: jax.Array,
    key_store: Any,
    value_store: Any,
    key_residual: jax.Array,
    value_residual: jax.Array,
    stored: int,
    held: int,
    *,
    sinks: jax.Array | None = None,
    part_bytes: int,
) -> tuple[jax.Array, jax.Array]:
    """A decoding step over a quantised cache: ``query (..., heads, n, head_dim)`` are the last
    ``n`` of the cache's ``stored + held`` positions (bottom-right causal), default scale.

    Args:
      query: ``(..., heads, n, head_dim)`` in the cache's dtype; ``0 < n <= stored + held``.
      key_store, value_store: ``QuantizedArray`` of codes ``(..., kv_heads, max_len, head_dim
        | v_dim)``, the first ``stored`` positions filled.
      key_residual, value_residual: ``(..., kv_heads, residual, head_dim | v_dim)``, the first
        ``held`` positions filled (the cache's last ones).
      stored, held: positions in the store and in the window (jax: traced in the compiled
        step, so a decoding loop compiles once per cache shape).
      sinks: ``(heads,)`` sink logits, or None.
      part_bytes: about how many bytes of float32 one part of keys or values holds, every
        batch row and kv head together (``PART_BYTES``, read by the caller at each call).

    Returns:
      ``(output (..., heads, n, v_dim)`` in the query's dtype, ``lse (..., heads, n))``.
    """
    n, max_len = query.shape[-2], key_store.codes.shape[-2]
    pairs = int(np.prod(key_residual.shape[:-2]))  # (batch row, kv head) pairs
    width = max(key_residual.shape[-1], value_residual.shape[-1])
    part = max(1, part_bytes // max(1, pairs * width * 4))  # positions per part
    # jax: chunks of the static store, as KVCache's split step cuts its max_len buffer
    chunk = rules.split_chunk(n, max_len) or max(1, max_len)
    return _step(query, key_store, value_store, key_residual, value_residual, sinks,
                 jnp.int32(stored), jnp.int32(held), chunk=chunk, part=part)


@functools.partial(jax.jit, static_argnames=("chunk", "part"))
def _step(
    query: jax.Array,
    key_store: Any,
    value_store: Any,
    key_residual: jax.Array,
    value_residual: jax.Array,
    sinks: jax.Array | None,
    stored: jax.Array,
    held: jax.Array,
    *,
    chunk: int,
    part: int,
) -> tuple[jax.Array, jax.Array]:
    """``dequantizing_attention``, one compiled program per shape, chunk and part: the
    lengths are traced. The store's chunks are a ``lax.map`` whose chunks past ``stored`` are
    skipped (a ``lax.cond``), a shorter last chunk is computed beside it, and the window is one
    more chunk; positions past the filled ones are masked."""
    batch, (heads, n, head_dim) = query.shape[:-3], query.shape[-3:]
    kv_heads, v_dim = key_residual.shape[-3], value_residual.shape[-1]
    max_len, residual = key_store.codes.shape[-2], key_residual.shape[-2]
    compute = jnp.dtype(rules.compute_dtype(jnp.dtype(query.dtype).name))
    flat = int(np.prod(batch))  # the batch axes as one
    rows = query.reshape(flat, kv_heads, heads // kv_heads * n, head_dim).astype(compute)
    rows = rows * rules.default_scale(head_dim)  # (flat, kv_heads, rows, head_dim)
    keys = _Source(key_store, key_residual, flat, compute)
    values = _Source(value_store, value_residual, flat, compute)
    limits = (stored + held - n + 1 + jnp.arange(rows.shape[-2]) % n)[:, None]  # (rows, 1)
    empty = (jnp.zeros(rows.shape[:-1] + (v_dim,), compute),
             jnp.full(rows.shape[:-1], NEG_INF, compute))  # a chunk without a key

    def partial(scores: jax.Array, allowed: jax.Array,
                weighted: Any) -> tuple[jax.Array, jax.Array]:
        """A chunk's partial output and lse from its scores ``(flat, kv_heads, rows,
        width)``, the allowed positions ``(rows, width)`` and ``weighted(weights)``."""
        weights, lse = _softmax_lse(jnp.where(allowed, scores, NEG_INF), None)
        return weighted(weights), lse

    def stored_chunk(start: Any, width: int) -> tuple[jax.Array, jax.Array]:
        """Store positions ``start..start + width`` (``start`` traced in the lax.map): its
        partial output ``(flat, kv_heads, rows, v_dim)`` and lse ``(flat, kv_heads, rows)``.
        The positions in parts of ``part`` (a lax.map of the whole parts, the shorter last
        one beside), each part's codes dequantised right before its product."""
        whole = width // part  # whole parts
        starts = start + part * jnp.arange(whole)  # (whole,)
        pieces = []  # the scores of the parts, in order: (flat, kv_heads, rows, positions)
        if whole:
            scores = jax.lax.map(lambda at: _scores(rows, keys.dequantized(at, part)), starts)
            pieces.append(jnp.moveaxis(scores, 0, -2).reshape(rows.shape[:-1] + (whole * part,)))
        if width % part:
            pieces.append(_scores(rows, keys.dequantized(start + whole * part, width % part)))
        scores = jnp.concatenate(pieces, axis=-1) if len(pieces) > 1 else pieces[0]
        positions = start + jnp.arange(width)  # filled, and allowed by the causal rule
        allowed = (positions < stored) & (positions < limits)

        def weighted(weights: jax.Array) -> jax.Array:  # one product per part, in order
            output = jnp.zeros(rows.shape[:-1] + (v_dim,), compute)
            if whole:
                split = weights[..., :whole * part].reshape(weights.shape[:-1] + (whole, part))
                output, _ = jax.lax.scan(
                    lambda acc, x: (acc + _weighted(x[1], values.dequantized(x[0], part)),
                                    None), output, (starts, jnp.moveaxis(split, -2, 0)))
            if width % part:
                output = output + _weighted(weights[..., whole * part:],
                                            values.dequantized(start + whole * part,
                                                               width % part))
            return output

        return partial(scores, allowed, weighted)

    chunks = rules.kv_chunks(max_len, chunk)
    inner = [a for a, b in chunks if b - a == chunk]  # the full chunks, a prefix
    outputs, lses = [], []
    if inner:  # jax: a while loop over the full chunks; those past `stored` are skipped
        output, lse = jax.lax.map(
            lambda at: jax.lax.cond(at < stored, lambda a: stored_chunk(a, chunk),
                                    lambda a: empty, at), jnp.asarray(inner))
        outputs += list(output)
        lses += list(lse)
    for a, b in chunks[len(inner):]:  # beside it: a shorter last chunk
        output, lse = stored_chunk(jnp.int32(a), b - a)
        outputs.append(output)
        lses.append(lse)
    if residual:  # the window: its position j is the cache's position stored + j
        j = jnp.arange(residual)
        output, lse = partial(_scores(rows, keys.window(0, residual)),
                              (j < held) & (stored + j < limits),
                              lambda weights: _weighted(weights, values.window(0, residual)))
        outputs.append(output)
        lses.append(lse)
    shape = batch + (heads, n)
    output, lse = _merge_attention(tuple(o.reshape(shape + (v_dim,)) for o in outputs),
                                   tuple(x.reshape(shape + (1,)) for x in lses), sinks)
    return output.astype(query.dtype), lse[..., 0]


def _scores(rows: jax.Array, keys: jax.Array) -> jax.Array:
    """``rows (flat, kv_heads, rows, head_dim)`` against ``keys (flat, kv_heads, positions,
    head_dim)``: ``(flat, kv_heads, rows, positions)``."""
    return jnp.einsum("bhrd,bhkd->bhrk", rows, keys)


def _weighted(weights: jax.Array, values: jax.Array) -> jax.Array:
    """``weights (flat, kv_heads, rows, positions)`` times ``values (flat, kv_heads,
    positions, v_dim)``: ``(flat, kv_heads, rows, v_dim)``."""
    return jnp.einsum("bhrk,bhkv->bhrv", weights, values)


class _Source:
    """The keys (or values) of a quantised cache: the store's codes (fp8: their bytes), scales
    and zero points, and the residual window, with the batch axes as one; parts come out in
    ``compute``."""

    def __init__(self, store: Any, residual: jax.Array, flat: int, compute: Any) -> None:
        kv_heads, dim = residual.shape[-3], residual.shape[-1]
        codes = store.codes.reshape(flat, kv_heads, store.codes.shape[-2], dim)
        self.scheme, self.dtype, self.compute = store.scheme, residual.dtype, compute
        if store.scheme.is_float8:  # jax: the bytes (see the module docstring)
            self.codes, self.code_dtype = jax.lax.bitcast_convert_type(codes, jnp.uint8), \
                codes.dtype
            self.scales = jnp.broadcast_to(store.scales, (kv_heads,)).reshape(1, kv_heads, 1, 1)
            self.zero_points = None
        else:  # (flat, kv_heads, max_len, groups)
            self.codes = codes
            self.scales = store.scales.reshape((flat,) + store.scales.shape[-3:])
            self.zero_points = None if store.zero_points is None else \
                store.zero_points.reshape(self.scales.shape)
        self.residual = residual.reshape((flat,) + residual.shape[-3:])

    def window(self, first: int, last: int) -> jax.Array:
        """Positions ``first..last`` of the window: ``(flat, kv_heads, last - first, dim)``."""
        return self.residual[:, :, first:last].astype(self.compute)

    def dequantized(self, start: Any, width: int) -> jax.Array:
        """Positions ``start..start + width`` of the store (``start`` may be traced): ``(flat,
        kv_heads, width, dim)``, ``dequantize_kv``'s values (``_values``) in ``compute``."""
        return self._values(start, width).astype(self.compute)

    def _values(self, start: Any, width: int) -> jax.Array:
        """Positions ``start..start + width`` of the store: ``dequantize_kv``'s values, in the
        cache's dtype."""
        codes = jax.lax.dynamic_slice_in_dim(self.codes, start, width, axis=2)
        if self.scheme.is_float8:  # the part's bytes as fp8 again, then XLA's exact cast
            codes = jax.lax.bitcast_convert_type(codes, self.code_dtype)
            values = codes.astype(jnp.float32) * self.scales
        else:
            scales = jax.lax.dynamic_slice_in_dim(self.scales, start, width, axis=2)
            groups = scales.shape[-1]  # the counts explicit (-1 is ambiguous for 0 elements)
            grouped = codes.astype(jnp.float32).reshape(  # (flat, kv_heads, width, groups, size)
                codes.shape[:-1] + (groups, codes.shape[-1] // groups))
            values = grouped * scales[..., None]
            if self.zero_points is not None:  # two roundings: product, then sum
                values = _rounded_apart(values, scales[..., None])
                zero_points = jax.lax.dynamic_slice_in_dim(self.zero_points, start, width, axis=2)
                values = values + zero_points[..., None]
            values = values.reshape(codes.shape)
        # float16 / bfloat16 caches round the values as dequantize_kv does
        return values.astype(self.dtype)


def _rounded_apart(products: jax.Array, scales: jax.Array) -> jax.Array:
    """``products`` (``codes · scales``, rounded) kept apart from the sum that follows them:
    XLA's CPU backend contracts a product and a sum into one fused multiply-add (one rounding
    where ``spec.QUANTIZED_CACHE`` has two), and no barrier stops it under ``jit``; the
    products' bits xor the scales' sign bits (broadcast to them) between the two do. A scale
    is never negative, so the xor changes no bit, and a NaN scale makes the product NaN either
    way."""
    sign = jax.lax.bitcast_convert_type(scales, jnp.int32) & np.int32(-2**31)
    bits = jax.lax.bitcast_convert_type(products, jnp.int32) ^ sign
    return jax.lax.bitcast_convert_type(bits, jnp.float32)
