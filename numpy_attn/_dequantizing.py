"""Split-KV decoding over a quantised cache, dequantised a part at a time (``QuantizedKVCache.
attend``): no float copy of the whole cache is made.

The step is ``paged.split_kv_attention``'s: the keys cut into chunks (``rules.split_chunk``, or
one chunk below ``SPLIT_KV["min_kv_len"]``), a chunk a task on numpy_attn's thread pool, the
partial results merged by their log-sum-exp in chunk order. A chunk reads its keys and values
in parts of about ``paged.PART_BYTES`` of float32, as ``split_kv_attention`` does; here each
part of codes is dequantised into the thread's buffer (``_chunks._buffer``: one per thread,
reused) right before its matrix product, so the product reads float32 values from the L2
cache, and the codes, a quarter of the float32 bytes, are all that comes from memory. The
residual window's positions follow the store's as one more part, read in place.

A part is dequantised exactly as ``dequantize_kv`` does it (``codes · scale (+ zero point)``,
float32, rounded once per operation, then to the cache's dtype), so the values are the same
bits as ``cache.keys`` / ``cache.values``; only the chunking of the sums differs from
``scaled_dot_product_attention`` over them (``spec.SPLIT_DECODING``'s rounding).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

import attention_rules as rules

from . import _threads
from ._chunks import _attend_chunk, _buffer, _limits, _merge_chunks, _partials


def dequantizing_attention(
    query: np.ndarray,
    key_store: Any,
    value_store: Any,
    key_residual: np.ndarray,
    value_residual: np.ndarray,
    stored: int,
    held: int,
    *,
    sinks: np.ndarray | None = None,
    part_bytes: int,
) -> tuple[np.ndarray, np.ndarray]:
    """A decoding step over a quantised cache: ``query (..., heads, n, head_dim)`` are the last
    ``n`` of the cache's ``stored + held`` positions (bottom-right causal), default scale.

    Args:
      query: ``(..., heads, n, head_dim)`` in the cache's dtype; ``n <= stored + held``.
      key_store, value_store: ``QuantizedArray`` of codes ``(..., kv_heads, max_len, head_dim
        | v_dim)``, the first ``stored`` positions filled.
      key_residual, value_residual: ``(..., kv_heads, residual, head_dim | v_dim)``, the first
        ``held`` positions filled (the cache's last ones).
      stored, held: positions in the store and in the window.
      sinks: ``(heads,)`` sink logits, or None.
      part_bytes: about how many bytes of float32 one part of keys or values holds
        (``paged.PART_BYTES``, read by the caller at each call).

    Returns:
      ``(output (..., heads, n, v_dim)`` in the query's dtype, ``lse (..., heads, n))``.
    """
    batch, (heads, n, head_dim) = query.shape[:-3], query.shape[-3:]
    kv_heads, v_dim, length = key_residual.shape[-3], value_residual.shape[-1], stored + held
    compute = np.dtype(rules.compute_dtype(query.dtype.name))
    flat = int(np.prod(batch))  # the batch axes as one
    rows = query.reshape(flat, kv_heads, heads // kv_heads * n, head_dim).astype(compute)
    keys = _Source(key_store, key_residual, flat, stored, held, part_bytes)
    values = _Source(value_store, value_residual, flat, stored, held, part_bytes)
    chunks = rules.kv_chunks(length, rules.split_chunk(n, length) or length)
    tasks = [(b, c, start, stop) for b in range(flat) for c, (start, stop) in enumerate(chunks)]
    outputs, lses = _partials(len(chunks), rows, v_dim)
    scale = rules.default_scale(head_dim)

    def block(b: int, c: int, start: int, stop: int, scratch: None) -> None:
        outputs[c, b], lses[c, b] = _attend_chunk(
            rows[b], stop - start, keys.parts(b, start, stop), values.parts(b, start, stop),
            start, _limits(length, n, rows.shape[-2], stop), scale, None)

    _threads.run_lanes(tasks, block, lambda: None)
    shape = batch + (heads, n)
    output, lse = _merge_chunks(outputs.reshape((-1,) + shape + (v_dim,)),
                                lses.reshape((-1,) + shape), sinks)
    return output.astype(query.dtype, copy=False), lse


class _Source:
    """The keys (or values) of a quantised cache, positions ``0..stored + held``, as parts of
    one batch row: codes, scales and zero points viewed with the batch axes as one."""

    def __init__(self, store: Any, residual: np.ndarray, flat: int, stored: int,
                 held: int, part_bytes: int) -> None:
        self.part_bytes = part_bytes
        kv_heads, dim = residual.shape[-3], residual.shape[-1]
        self.codes = store.codes.reshape(flat, kv_heads, store.codes.shape[-2], dim)
        self.scheme, self.dtype = store.scheme, residual.dtype
        if store.scheme.is_float8:  # a table of the 256 codes' values per kv head, scaled
            values = np.arange(256, dtype=np.uint8).view(store.codes.dtype).astype(np.float32)
            scales = np.broadcast_to(store.scales, (kv_heads,))[:, None]  # () or (kv_heads,)
            self.tables = values * scales  # (kv_heads, 256): dequantize_kv's products
            self.codes = self.codes.view(np.uint8)
        else:  # (flat, kv_heads, max_len, groups)
            self.scales = store.scales.reshape((flat,) + store.scales.shape[-3:])
            self.zero_points = None if store.zero_points is None else \
                store.zero_points.reshape(self.scales.shape)
        self.residual = residual.reshape((flat,) + residual.shape[-3:])
        self.stored, self.held = stored, held

    def parts(self, b: int, start: int, stop: int) -> Iterator[np.ndarray]:
        """Positions ``start..stop`` of batch row ``b`` as consecutive parts ``(kv_heads,
        part, dim)``: the store's dequantised into this thread's buffer (valid until the next
        part), then the window's, views."""
        kv_heads, dim = self.codes.shape[1], self.codes.shape[-1]
        per = max(1, self.part_bytes // max(1, kv_heads * dim * 4))  # positions per part
        for lo in range(start, min(stop, self.stored), per):
            yield self._dequantized(b, lo, min(lo + per, stop, self.stored))
        if stop > self.stored:  # the residual window: positions stored..stored + held
            yield self.residual[b, :, max(start, self.stored) - self.stored:stop - self.stored]

    def _dequantized(self, b: int, lo: int, hi: int) -> np.ndarray:
        """Positions ``lo..hi`` of the store, row ``b``: ``(kv_heads, hi - lo, dim)``,
        ``dequantize_kv``'s values in the cache's dtype."""
        codes = self.codes[b, :, lo:hi]  # (kv_heads, part, dim)
        out = _buffer(codes.shape, np.dtype(np.float32))
        if self.scheme.is_float8:  # numpy: a lookup (ml_dtypes' cast is 5-10x slower)
            for h, table in enumerate(self.tables):
                np.take(table, codes[h], out=out[h], mode="clip")
        else:  # numpy: the cast, then the scale in place (a mixed-type product is 1.5x slower)
            np.copyto(out, codes, casting="unsafe")
            grouped = out.reshape(codes.shape[:-1] + (self.scales.shape[-1], -1))
            grouped *= self.scales[b, :, lo:hi, :, None]  # (kv_heads, part, groups, size)
            if self.zero_points is not None:  # two roundings: product, then sum
                grouped += self.zero_points[b, :, lo:hi, :, None]
        # float16 / bfloat16 caches round the values as dequantize_kv does (a fresh array)
        return out if self.dtype == np.float32 else out.astype(self.dtype)
