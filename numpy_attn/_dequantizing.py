"""Split-KV decoding over a quantised cache, its codes read a part at a time
(``QuantizedKVCache.attend``): no float copy of the whole cache is made.

The step is ``paged.split_kv_attention``'s: the keys cut into chunks (``rules.split_chunk``, or
one chunk below ``SPLIT_KV["min_kv_len"]``), a chunk a task on numpy_attn's thread pool (with
fewer chunks than cores, a chunk's kv heads in groups, a task each), the partial results
merged by their log-sum-exp in chunk order. A chunk reads its keys and values in parts of about
``PART_BYTES`` of float32, as ``split_kv_attention`` does; here each
part of codes is dequantised into the thread's buffer (``_chunks._buffer``: one per thread,
reused) right before its matrix product, so the product reads float32 values from the CPU's
caches, and the codes, a quarter of the float32 bytes, are all that comes from memory. The
residual window's positions follow the store's as one more part, read in place.

A float32 cache folds the scales into the products (``_Codes``; ``spec.QUANTIZED_CACHE``): a
part of codes is widened to float32, exactly, and the scales (and zero points) multiply the
products, not every value, so the only pass over a part is its widening. float16, bfloat16 and
float64 caches dequantise a part exactly as ``dequantize_kv`` does it (``codes · scale (+ zero
point)``, float32, rounded once per operation, then to the cache's dtype): the same bits as
``cache.keys`` / ``cache.values``, and only the chunking of the sums differs from
``scaled_dot_product_attention`` over them (``spec.SPLIT_DECODING``'s rounding).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

import attention_rules as rules

from . import _threads
from ._chunks import _attend_chunk, _buffer, _limits, _merge_chunks, _partials

#: About how many bytes of float32 one part of keys or values holds (every kv head of a batch
#: row together): 1,024 positions of 8 kv heads of 128. Measured at 32,768 tokens (int8 and fp8,
#: 8 kv heads of 128, AMD EPYC with AVX-512, 2 cores): parts of 1 MiB (``paged.PART_BYTES``,
#: which fits L2) took 1.6-2.1x as long as 4 MiB, which pays NumPy's per-call cost a quarter
#: as often; 8 and 16 MiB were slower again.
PART_BYTES = 4 << 20


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
    nan_codes: bool = False,
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
        (``PART_BYTES``, read by the caller at each call).
      nan_codes: True when an fp8 store may hold NaN codes (a NaN was appended): its parts
        are widened by a lookup that keeps them NaN.

    Returns:
      ``(output (..., heads, n, v_dim)`` in the query's dtype, ``lse (..., heads, n))``.
    """
    batch, (heads, n, head_dim) = query.shape[:-3], query.shape[-3:]
    kv_heads, v_dim, length = key_residual.shape[-3], value_residual.shape[-1], stored + held
    compute = np.dtype(rules.compute_dtype(query.dtype.name))
    flat = int(np.prod(batch))  # the batch axes as one
    rows = query.reshape(flat, kv_heads, heads // kv_heads * n, head_dim).astype(compute)
    keys = _Source(key_store, key_residual, flat, stored, part_bytes, nan_codes)
    values = _Source(value_store, value_residual, flat, stored, part_bytes, nan_codes)
    chunks = rules.kv_chunks(length, rules.split_chunk(n, length) or length)
    # fewer (batch row, chunk) tasks than cores (one chunk below min_kv_len): the kv heads in
    # groups too, so that every core works; a head's sums are the same in any group
    groups = max(1, min(kv_heads, _threads._cores() // (flat * len(chunks))))
    per_group = -(-kv_heads // groups)
    heads_of = [slice(h, min(h + per_group, kv_heads)) for h in range(0, kv_heads, per_group)]
    tasks = [(b, c, start, stop, h) for b in range(flat) for c, (start, stop) in
             enumerate(chunks) for h in heads_of]
    outputs, lses = _partials(len(chunks), rows, v_dim)
    scale = rules.default_scale(head_dim)

    def block(b: int, c: int, start: int, stop: int, h: slice, scratch: None) -> None:
        outputs[c, b, h], lses[c, b, h] = _attend_chunk(
            rows[b, h], stop - start, keys.parts(b, h, start, stop),
            values.parts(b, h, start, stop), start, _limits(length, n, rows.shape[-2], stop),
            scale, None)

    _threads.run_lanes(tasks, block, lambda: None)
    shape = batch + (heads, n)
    output, lse = _merge_chunks(outputs.reshape((-1,) + shape + (v_dim,)),
                                lses.reshape((-1,) + shape), sinks)
    return output.astype(query.dtype, copy=False), lse


class _Source:
    """The keys (or values) of a quantised cache, positions ``0..stored + held``, as parts of
    one batch row: codes, scales and zero points viewed with the batch axes as one."""

    def __init__(self, store: Any, residual: np.ndarray, flat: int, stored: int,
                 part_bytes: int, nan_codes: bool) -> None:
        self.part_bytes, self.nan_codes = part_bytes, nan_codes
        kv_heads, dim = residual.shape[-3], residual.shape[-1]
        self.codes = store.codes.reshape(flat, kv_heads, store.codes.shape[-2], dim)
        self.scheme, self.dtype = store.scheme, residual.dtype
        # a float32 cache folds the scales into the products (``_Codes``); the others
        # dequantise each part to dequantize_kv's values (float16 / bfloat16 round them)
        self.fold = self.dtype == np.float32
        if store.scheme.is_float8:  # a table of the 256 codes' values
            values = np.arange(256, dtype=np.uint8).view(store.codes.dtype).astype(np.float32)
            scales = np.broadcast_to(store.scales, (kv_heads,))[:, None]  # () or (kv_heads,)
            self.table = values  # (256,): the codes' values, unscaled
            self.tables = values * scales  # (kv_heads, 256): dequantize_kv's products
            self.head_scales = scales[:, None]  # (kv_heads, 1, 1)
            self.codes = self.codes.view(np.int8)  # signed: _widen_float8's sign
        else:  # (flat, kv_heads, max_len, groups)
            self.scales = store.scales.reshape((flat,) + store.scales.shape[-3:])
            self.zero_points = None if store.zero_points is None else \
                store.zero_points.reshape(self.scales.shape)
        self.residual = residual.reshape((flat,) + residual.shape[-3:])
        self.stored = stored  # the window's positions follow, read up to each part's stop

    def parts(self, b: int, h: slice, start: int, stop: int) -> Iterator[Any]:
        """Positions ``start..stop`` of batch row ``b``, kv heads ``h``, as consecutive parts
        ``(heads, part, dim)``: the store's as ``_Codes`` (a float32 cache) or dequantised,
        both in this thread's buffer (valid until the next part), then the window's, views.
        A part has the same positions whatever the heads (its size counts every kv head)."""
        kv_heads, dim = self.codes.shape[1], self.codes.shape[-1]
        per = max(1, self.part_bytes // max(1, kv_heads * dim * 4))  # positions per part
        part = self._codes if self.fold else self._dequantized
        for lo in range(start, min(stop, self.stored), per):
            yield part(b, h, lo, min(lo + per, stop, self.stored))
        if stop > self.stored:  # the residual window: positions stored..stored + held
            yield self.residual[b, h, max(start, self.stored) - self.stored:stop - self.stored]

    def _codes(self, b: int, h: slice, lo: int, hi: int) -> _Codes:
        """Positions ``lo..hi`` of the store, row ``b``, kv heads ``h``: the codes widened to
        float32 (exact), with the scales and zero points that ``_Codes`` folds into its
        products."""
        codes = self.codes[b, h, lo:hi]  # (heads, part, dim)
        out = _buffer(codes.shape, np.dtype(np.float32))
        if self.scheme.is_float8 and self.nan_codes:  # the lookup keeps NaN codes NaN
            np.take(self.table, codes.view(np.uint8), out=out, mode="wrap")
            return _Codes(out, self.head_scales[h], None)
        if self.scheme.is_float8:  # the codes' bits moved into float32's, then rescaled
            _widen_float8(codes, out, self.scheme.code_dtype)
            return _Codes(out, self.head_scales[h], None)
        np.copyto(out, codes, casting="unsafe")
        zero_points = None if self.zero_points is None else self.zero_points[b, h, lo:hi]
        return _Codes(out, self.scales[b, h, lo:hi], zero_points)

    def _dequantized(self, b: int, h: slice, lo: int, hi: int) -> np.ndarray:
        """Positions ``lo..hi`` of the store, row ``b``, kv heads ``h``: ``(heads, hi - lo,
        dim)``, ``dequantize_kv``'s values in the cache's dtype."""
        codes = self.codes[b, h, lo:hi]  # (heads, part, dim)
        out = _buffer(codes.shape, np.dtype(np.float32))
        if self.scheme.is_float8:  # numpy: a lookup (ml_dtypes' cast is 5-10x slower)
            for head, table in enumerate(self.tables[h]):
                np.take(table, codes[head].view(np.uint8), out=out[head], mode="wrap")
        else:  # numpy: the cast, then the scale in place (a mixed-type product is 1.5x slower)
            np.copyto(out, codes, casting="unsafe")
            grouped = out.reshape(codes.shape[:-1] + (self.scales.shape[-1], -1))
            grouped *= self.scales[b, h, lo:hi, :, None]  # (heads, part, groups, size)
            if self.zero_points is not None:  # two roundings: product, then sum
                grouped += self.zero_points[b, h, lo:hi, :, None]
        # float16 / bfloat16 caches round the values as dequantize_kv does (a fresh array)
        return out if self.dtype == np.float32 else out.astype(self.dtype)


class _Codes:
    """A part of a float32 cache's store with the scales folded into its products: ``codes
    (kv_heads, part, dim)`` widened to float32 (exact), ``scales (kv_heads, part, groups)``
    (integer codes: a group is ``dim // groups`` consecutive channels) or ``(kv_heads, 1, 1)``
    (fp8: one per head), ``zero_points`` like the integer scales, or None.

    A key of group ``g`` is ``s_g · c_g (+ z_g)``, so its score against a row ``q`` is
    ``Σ_g s_g (c_g · q_g) (+ z_g Σ q_g)``; a value's share of the output is ``(w · s_g) c_g
    (+ (w · z_g))``. The products read the codes once, and no pass multiplies every value by
    its scale (the pass that cost more than the memory the codes save). The float32
    roundings are those of a reordered sum (``spec.QUANTIZED_CACHE``)."""

    def __init__(self, codes: np.ndarray, scales: np.ndarray,
                 zero_points: np.ndarray | None) -> None:
        self.codes, self.scales, self.zero_points = codes, scales, zero_points
        self.shape = codes.shape

    def _groups(self) -> Iterator[tuple[int, slice]]:
        """``(g, channels of group g)`` for each scale group (fp8: one group, every channel)."""
        groups, dim = self.scales.shape[-1], self.codes.shape[-1]
        size = dim // groups
        for g in range(groups):
            yield g, slice(g * size, (g + 1) * size)

    def scores(self, rows_t: np.ndarray, out: np.ndarray) -> None:
        """``out (kv_heads, part, rows)`` = the keys' products with ``rows_t (kv_heads, dim,
        rows)``."""
        for g, channels in self._groups():
            product = self.codes[..., channels] @ rows_t[:, channels]  # (kv_heads, part, rows)
            product *= self.scales[..., g:g + 1]
            if self.zero_points is not None:  # z_g times the group's sum of each row
                product += self.zero_points[..., g:g + 1] * \
                    rows_t[:, channels].sum(axis=-2, keepdims=True)
            if g == 0:
                out[...] = product
            else:
                out += product

    def weighted(self, weights: np.ndarray) -> np.ndarray:
        """The values weighted by ``weights (kv_heads, rows, part)``: ``(kv_heads, rows,
        dim)``."""
        output = np.empty(weights.shape[:-1] + self.codes.shape[-1:], weights.dtype)
        for g, channels in self._groups():
            scaled = weights * np.swapaxes(self.scales[..., g:g + 1], -1, -2)  # (.., rows, part)
            output[..., channels] = scaled @ self.codes[..., channels]
            if self.zero_points is not None:  # (kv_heads, rows, 1): w · z_g, every channel
                output[..., channels] += weights @ self.zero_points[..., g:g + 1]
        return output


#: fp8 widening by bits: ``(mantissa bits, exponent bias)`` of each code dtype.
_FLOAT8_LAYOUT = {"float8_e4m3fn": (3, 7), "float8_e5m2": (2, 15)}


def _widen_float8(codes: np.ndarray, out: np.ndarray, code_dtype: str) -> None:
    """fp8 ``codes`` (viewed as int8) into float32 ``out``, exactly, for codes that are not
    NaN (or inf): the exponent and mantissa bits shifted into float32's (the sign from
    int8's sign extension, the bits it sets in the exponent masked off), then times
    ``2^(127 - bias)``, which is exact for normal and subnormal codes alike (a subnormal code
    is a subnormal float32 before the product). numpy: four passes of 1-4 bytes per value
    against ``np.take``'s one lookup per value, 2.6x faster here; NaN codes would read as
    finite numbers, so a cache that holds one uses the lookup (``_Source.nan_codes``)."""
    mantissa, bias = _FLOAT8_LAYOUT[code_dtype]
    shift = 23 - mantissa
    bits = out.view(np.int32)
    np.copyto(bits, codes)  # numpy: the cast alone, then in place (a casting shift: 1.3x)
    np.left_shift(bits, shift, out=bits)
    np.bitwise_and(bits, np.int32(-2**31 | 0x7F << shift), out=bits)
    np.multiply(out, np.float32(2.0 ** (127 - bias)), out=out)
