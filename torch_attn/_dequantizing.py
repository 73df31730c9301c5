"""Split-KV decoding over a quantised cache, dequantised a part at a time (``QuantizedKVCache.
attend``): no float copy of the whole cache is made.

The step is ``paged.split_kv_attention``'s: the keys cut into chunks (``rules.split_chunk``, or
one chunk below ``SPLIT_KV["min_kv_len"]``), each chunk's partial result and log-sum-exp, the
partial results merged by ``_chunks._merge_chunks``. A chunk reads its keys and values in parts of
about ``PART_BYTES`` of float32 over every (batch row, kv head) pair; each part of codes
is dequantised by one operation into the thread's buffer (``_chunks._buffer``, reused; a fresh
tensor when autograd records the call) right before its ``bmm``, so the product reads float32
values from the cache of the CPU, and the codes, a quarter of the float32 bytes, are all that
comes from memory. The residual window's positions follow the store's as one more part.

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

import torch

import attention_rules as rules

from ._arrays import _dtype_name
from ._chunks import _buffer, _chunk_allowed, _chunk_softmax, _merge_chunks
from ._steps import NEG_INF

#: About how many bytes of float32 one part of keys or values holds (every (batch row, kv head)
#: pair together): 2,048 positions of 8 kv heads of 128. Measured at 4,096 and 32,768 tokens
#: (int8 and fp8, 8 kv heads of 128, AMD EPYC with AVX-512, 2 cores): parts of 1 MiB
#: (``paged.PART_BYTES``) took 1.6-2.1x as long as 8 MiB, each part paying torch's per-operation
#: cost (several microseconds, a few operations per part and channel group); 16 MiB was
#: slower again at 4,096 tokens.
PART_BYTES = 8 << 20

#: fp8 widening by bits: ``(mantissa bits, exponent bias)`` of each code dtype.
_FLOAT8_LAYOUT = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}


def dequantizing_attention(
    query: torch.Tensor,
    key_store: Any,
    value_store: Any,
    key_residual: torch.Tensor,
    value_residual: torch.Tensor,
    stored: int,
    held: int,
    *,
    sinks: torch.Tensor | None = None,
    part_bytes: int,
    nan_codes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
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
        are widened by torch's own cast, which keeps them NaN.

    Returns:
      ``(output (..., heads, n, v_dim)`` in the query's dtype, ``lse (..., heads, n))``.
    """
    batch, (heads, n, head_dim) = tuple(query.shape[:-3]), tuple(query.shape[-3:])
    kv_heads, v_dim, length = key_residual.shape[-3], value_residual.shape[-1], stored + held
    compute = getattr(torch, rules.compute_dtype(_dtype_name(query)))
    record = torch.is_grad_enabled() and any(  # autograd keeps the parts: fresh ones
        x is not None and x.requires_grad for x in (query, sinks))
    rows = query.reshape(-1, heads // kv_heads * n, head_dim).to(compute)
    rows = rows * rules.default_scale(head_dim)  # (pairs, rows, head_dim)
    keys = _Source(key_store, key_residual, stored, record, part_bytes, nan_codes)
    values = _Source(value_store, value_residual, stored, record, part_bytes, nan_codes)
    outputs, lses = [], []
    for start, stop in rules.kv_chunks(length, rules.split_chunk(n, length) or length):
        # torch: the scores as keys @ rowsᵀ (rows @ keysᵀ took 1.9x as long: paged.py)
        scores = torch.cat([torch.bmm(k.to(compute), rows.mT) if isinstance(k, torch.Tensor)
                            else k.scores(rows.mT)  # a part of codes: its scales folded in
                            for k in keys.parts(start, stop)], dim=1).mT  # (pairs, rows, width)
        allowed = _chunk_allowed([(start, stop)], stop - start, length, n, rows.shape[1],
                                 rows.device)
        if allowed is not None:  # (rows, 1, width): the causal rule by absolute position
            scores = scores.masked_fill(~allowed[:, 0], NEG_INF)
        weights, lse = _chunk_softmax(scores, allowed is not None, record)
        output, at = None, 0
        for v in values.parts(start, stop):  # one bmm per part, summed in order
            part = torch.bmm(weights[..., at:at + v.shape[1]], v.to(compute)) \
                if isinstance(v, torch.Tensor) else v.weighted(weights[..., at:at + v.shape[1]])
            output = part if output is None else output + part
            at += v.shape[1]
        outputs.append(output)  # (pairs, rows, v_dim)
        lses.append(lse)  # (pairs, rows)
    shape = batch + (heads, n)
    output, lse = _merge_chunks(torch.stack(outputs).reshape((-1,) + shape + (v_dim,)),
                                torch.stack(lses).reshape((-1,) + shape), sinks)
    return output.to(query.dtype), lse


class _Source:
    """The keys (or values) of a quantised cache, positions ``0..stored + held``, as parts
    over every (batch row, kv head) pair: codes, scales and zero points viewed as pairs."""

    def __init__(self, store: Any, residual: torch.Tensor, stored: int, fresh: bool,
                 part_bytes: int, nan_codes: bool) -> None:
        self.part_bytes, self.nan_codes = part_bytes, nan_codes
        kv_heads, dim = residual.shape[-3], residual.shape[-1]
        pairs = residual.shape[:-2].numel()  # torch: explicit (-1 is ambiguous for no element)
        self.codes = store.codes.reshape(pairs, store.codes.shape[-2], dim)  # (pairs, max_len, dim)
        self.scheme, self.dtype, self.fresh = store.scheme, residual.dtype, fresh
        # a float32 cache folds the scales into the products (``_Codes``); the others
        # dequantise each part to dequantize_kv's values (float16 / bfloat16 round them)
        self.fold = self.dtype == torch.float32
        if store.scheme.is_float8:  # () or (kv_heads,) → (pairs, 1, 1)
            self.scales = store.scales.expand(kv_heads).repeat(pairs // kv_heads)[:, None, None]
            self.zero_points = None
        else:  # (pairs, max_len, groups)
            self.scales = store.scales.reshape((pairs,) + tuple(store.scales.shape[-2:]))
            self.zero_points = None if store.zero_points is None else \
                store.zero_points.reshape(self.scales.shape)
        self.residual = residual.reshape(pairs, residual.shape[-2], dim)
        self.stored = stored  # the window's positions follow, read up to each part's stop
        self.like = torch.empty(0, dtype=torch.float32, device=residual.device)

    def parts(self, start: int, stop: int) -> Iterator[Any]:
        """Positions ``start..stop`` as consecutive parts ``(pairs, part, dim)``: the store's
        as ``_Codes`` (a float32 cache) or dequantised, both in this thread's buffer (valid
        until the next part), then the window's, views."""
        pairs, dim = self.codes.shape[0], self.codes.shape[-1]
        per = max(1, self.part_bytes // max(1, pairs * dim * 4))  # positions per part
        for lo in range(start, min(stop, self.stored), per):
            hi = min(lo + per, stop, self.stored)
            if self.fold:
                yield _Codes(self._widened(lo, hi), self._scales(lo, hi),
                             None if self.zero_points is None else self.zero_points[:, lo:hi])
            else:
                yield self._dequantized(lo, hi)
        if stop > self.stored:  # the residual window: positions stored..stored + held
            yield self.residual[:, max(start, self.stored) - self.stored:stop - self.stored]

    def _scales(self, lo: int, hi: int) -> torch.Tensor:
        """The scales of positions ``lo..hi``: ``(pairs, part, groups)``, fp8 ``(pairs, 1,
        1)``."""
        return self.scales if self.scheme.is_float8 else self.scales[:, lo:hi]

    def _widened(self, lo: int, hi: int) -> torch.Tensor:
        """Positions ``lo..hi`` of the store: the codes ``(pairs, hi - lo, dim)`` as float32
        values, exactly (no scale)."""
        codes = self.codes[:, lo:hi]  # (pairs, part, dim)
        out = None if self.fresh else _buffer((codes.numel(), 1), self.like).view(codes.shape)
        if self.scheme.is_float8 and self.nan_codes:  # torch's own cast keeps NaN codes NaN
            return codes.to(torch.float32) if out is None else out.copy_(codes)
        if self.scheme.is_float8:
            return _widened_float8(codes, out)
        return codes.to(torch.float32) if out is None else out.copy_(codes)

    def _dequantized(self, lo: int, hi: int) -> torch.Tensor:
        """Positions ``lo..hi`` of the store: ``(pairs, hi - lo, dim)``, ``dequantize_kv``'s
        values in the cache's dtype."""
        out = self._widened(lo, hi)
        if self.scheme.is_float8:
            out = out.mul_(self.scales)
        else:  # torch: the cast, then the scale in place (a mixed-type product is slower)
            grouped = out.unflatten(-1, (self.scales.shape[-1], -1))  # (pairs, part, groups, size)
            grouped.mul_(self.scales[:, lo:hi, :, None])
            if self.zero_points is not None:  # two roundings: product, then sum
                grouped.add_(self.zero_points[:, lo:hi, :, None])
        # float16 / bfloat16 caches round the values as dequantize_kv does (a fresh tensor)
        return out if self.dtype == torch.float32 else out.to(self.dtype)


class _Codes:
    """A part of a float32 cache's store with the scales folded into its products: ``codes
    (pairs, part, dim)`` widened to float32 (exact), ``scales (pairs, part, groups)`` (integer
    codes: a group is ``dim // groups`` consecutive channels) or ``(pairs, 1, 1)`` (fp8: one
    per head), ``zero_points`` like the integer scales, or None.

    A key of group ``g`` is ``s_g · c_g (+ z_g)``, so its score against a row ``q`` is
    ``Σ_g s_g (c_g · q_g) (+ z_g Σ q_g)``; a value's share of the output is ``(w · s_g) c_g
    (+ (w · z_g))``. The products read the codes once, and no pass multiplies every value by
    its scale (the pass that cost more than the memory the codes save). The float32
    roundings are those of a reordered sum (``spec.QUANTIZED_CACHE``)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor,
                 zero_points: torch.Tensor | None) -> None:
        self.codes, self.scales, self.zero_points = codes, scales, zero_points
        self.shape = codes.shape

    def _groups(self) -> Iterator[tuple[int, slice]]:
        """``(g, channels of group g)`` for each scale group (fp8: one group, every channel)."""
        groups, dim = self.scales.shape[-1], self.codes.shape[-1]
        size = dim // groups
        for g in range(groups):
            yield g, slice(g * size, (g + 1) * size)

    def scores(self, rows_t: torch.Tensor) -> torch.Tensor:
        """The keys' products with ``rows_t (pairs, dim, rows)``: ``(pairs, part, rows)``."""
        out = None
        for g, channels in self._groups():
            product = torch.bmm(self.codes[..., channels], rows_t[:, channels])
            product = product * self.scales[..., g:g + 1]  # (pairs, part, rows)
            if self.zero_points is not None:  # z_g times the group's sum of each row
                product = product + self.zero_points[..., g:g + 1] * \
                    rows_t[:, channels].sum(dim=-2, keepdim=True)
            out = product if out is None else out + product
        return out

    def weighted(self, weights: torch.Tensor) -> torch.Tensor:
        """The values weighted by ``weights (pairs, rows, part)``: ``(pairs, rows, dim)``."""
        outputs = []
        for g, channels in self._groups():
            scaled = weights * self.scales[..., g:g + 1].mT  # (pairs, rows, part)
            output = torch.bmm(scaled, self.codes[..., channels])
            if self.zero_points is not None:  # (pairs, rows, 1): w · z_g, every channel
                output = output + torch.bmm(weights, self.zero_points[..., g:g + 1])
            outputs.append(output)
        return torch.cat(outputs, dim=-1)


def _widened_float8(codes: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """fp8 ``codes`` ``(pairs, part, dim)`` widened to float32 (into ``out`` when given),
    exactly, for codes that are not NaN (or inf): the exponent and mantissa bits shifted into
    float32's (the sign from int8's sign extension, the bits it sets in the exponent masked
    off), then times ``2^(127 - bias)``, exact for normal and subnormal codes alike (a
    subnormal code is a subnormal float32 before the product). torch: its own cast of float8
    to float32 runs 20-60x slower on the CPU than these integer steps; NaN codes would read as
    finite numbers, so a cache that holds one uses that cast (``_Source.nan_codes``)."""
    mantissa, bias = _FLOAT8_LAYOUT[codes.dtype]
    shift = 23 - mantissa
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device) if out is None \
        else out
    bits = out.view(torch.int32)
    bits.copy_(codes.view(torch.int8))  # sign-extended
    bits.bitwise_left_shift_(shift)
    bits.bitwise_and_(torch.tensor(-2**31 | 0x7F << shift, dtype=torch.int32,
                                   device=codes.device))  # torch: a tensor (an int is slower)
    return out.mul_(2.0 ** (127 - bias))
