"""Split-KV decoding over a quantised cache, dequantised a part at a time (``QuantizedKVCache.
attend``): no float copy of the whole cache is made.

The step is ``paged.split_kv_attention``'s: the keys cut into chunks (``rules.split_chunk``, or
one chunk below ``SPLIT_KV["min_kv_len"]``), each chunk's partial result and log-sum-exp, the
partial results merged by ``_chunks._merge_chunks``. A chunk reads its keys and values in parts of
about ``paged.PART_BYTES`` of float32 over every (batch row, kv head) pair; each part of codes
is dequantised by one operation into the thread's buffer (``_chunks._buffer``, reused; a fresh
tensor when autograd records the call) right before its ``bmm``, so the product reads float32
values from the cache of the CPU, and the codes, a quarter of the float32 bytes, are all that
comes from memory. The residual window's positions follow the store's as one more part.

A part is dequantised exactly as ``dequantize_kv`` does it (``codes · scale (+ zero point)``,
float32, rounded once per operation, then to the cache's dtype), so the values are the same
bits as ``cache.keys`` / ``cache.values``; only the chunking of the sums differs from
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

#: What ``_widened_float8``'s values are multiplied by to be the codes' values.
_FLOAT8_SHIFT = {"float8_e4m3": 256.0, "float8_e5m2": 1.0}


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
        (``paged.PART_BYTES``, read by the caller at each call).

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
    keys = _Source(key_store, key_residual, stored, held, record, part_bytes)
    values = _Source(value_store, value_residual, stored, held, record, part_bytes)
    outputs, lses = [], []
    for start, stop in rules.kv_chunks(length, rules.split_chunk(n, length) or length):
        # torch: the scores as keys @ rowsᵀ (rows @ keysᵀ took 1.9x as long: paged.py)
        scores = torch.cat([torch.bmm(k.to(compute), rows.mT)
                            for k in keys.parts(start, stop)], dim=1).mT  # (pairs, rows, width)
        allowed = _chunk_allowed([(start, stop)], stop - start, length, n, rows.shape[1],
                                 rows.device)
        if allowed is not None:  # (rows, 1, width): the causal rule by absolute position
            scores = scores.masked_fill(~allowed[:, 0], NEG_INF)
        weights, lse = _chunk_softmax(scores, allowed is not None, record)
        output, at = None, 0
        for v in values.parts(start, stop):  # one bmm per part, summed in order
            part = torch.bmm(weights[..., at:at + v.shape[1]], v.to(compute))
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

    def __init__(self, store: Any, residual: torch.Tensor, stored: int, held: int,
                 fresh: bool, part_bytes: int) -> None:
        self.part_bytes = part_bytes
        kv_heads, dim = residual.shape[-3], residual.shape[-1]
        pairs = residual.shape[:-2].numel()  # torch: explicit (-1 is ambiguous for no element)
        self.codes = store.codes.reshape(pairs, store.codes.shape[-2], dim)  # (pairs, max_len, dim)
        self.scheme, self.dtype, self.fresh = store.scheme, residual.dtype, fresh
        if store.scheme.is_float8:  # () or (kv_heads,) → (pairs, 1, 1); e4m3: × 2^8, exact
            scales = store.scales * _FLOAT8_SHIFT[store.scheme.dtype]
            self.scales = scales.expand(kv_heads).repeat(pairs // kv_heads)[:, None, None]
            self.zero_points = None
        else:  # (pairs, max_len, groups)
            self.scales = store.scales.reshape((pairs,) + tuple(store.scales.shape[-2:]))
            self.zero_points = None if store.zero_points is None else \
                store.zero_points.reshape(self.scales.shape)
        self.residual = residual.reshape(pairs, residual.shape[-2], dim)
        self.stored, self.held = stored, held
        self.like = torch.empty(0, dtype=torch.float32, device=residual.device)

    def parts(self, start: int, stop: int) -> Iterator[torch.Tensor]:
        """Positions ``start..stop`` as consecutive parts ``(pairs, part, dim)``: the store's
        dequantised into this thread's buffer (valid until the next part), then the
        window's, views."""
        pairs, dim = self.codes.shape[0], self.codes.shape[-1]
        per = max(1, self.part_bytes // max(1, pairs * dim * 4))  # positions per part
        for lo in range(start, min(stop, self.stored), per):
            yield self._dequantized(lo, min(lo + per, stop, self.stored))
        if stop > self.stored:  # the residual window: positions stored..stored + held
            yield self.residual[:, max(start, self.stored) - self.stored:stop - self.stored]

    def _dequantized(self, lo: int, hi: int) -> torch.Tensor:
        """Positions ``lo..hi`` of the store: ``(pairs, hi - lo, dim)``, ``dequantize_kv``'s
        values in the cache's dtype."""
        codes = self.codes[:, lo:hi]  # (pairs, part, dim)
        out = None if self.fresh else _buffer((codes.numel(), 1), self.like).view(codes.shape)
        if self.scheme.is_float8:
            out = _widened_float8(codes, out)  # e4m3: 2^-8 × the codes, folded into the scales
            out = out.mul_(self.scales)
        else:  # torch: the cast, then the scale in place (a mixed-type product is slower)
            out = codes.to(torch.float32) if out is None else out.copy_(codes)
            grouped = out.unflatten(-1, (self.scales.shape[-1], -1))  # (pairs, part, groups, size)
            grouped.mul_(self.scales[:, lo:hi, :, None])
            if self.zero_points is not None:  # two roundings: product, then sum
                grouped.add_(self.zero_points[:, lo:hi, :, None])
        # float16 / bfloat16 caches round the values as dequantize_kv does (a fresh tensor)
        return out if self.dtype == torch.float32 else out.to(self.dtype)


def _widened_float8(codes: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """fp8 codes ``(pairs, part, dim)`` widened to float32 through float16 bits (into ``out``
    when given): e5m2's bits are float16's top byte, exactly its value; e4m3fn's exponent and
    mantissa shifted into float16's are the value × 2^-8, subnormals too (its NaN, 0x7F, is
    set apart). torch: its own cast of float8 to float32 runs 20-60x slower on the CPU than
    these integer steps and a float16 cast together."""
    bits = codes.view(torch.uint8).to(torch.int16)
    if codes.dtype == torch.float8_e5m2:
        half = bits << 8  # int16 wraps: the sign lands on bit 15
    else:  # torch: the constants as int16 tensors (a Python int takes a path 4-10x slower)
        one, low, sign, nan = (torch.tensor(c, dtype=torch.int16, device=bits.device)
                               for c in (1, 0x7F, 0x80, 0x7E00))
        magnitude = torch.bitwise_and(bits, low)  # exponent and mantissa
        half = torch.bitwise_or(magnitude << 7, torch.bitwise_and(bits, sign) << 8)
        is_nan = (magnitude + one) >> 7  # 1 for 0x7F, e4m3fn's NaN, else 0 (no compare: slow)
        half = torch.bitwise_or(half, is_nan * nan)  # 0x3F80 | 0x7E00: a float16 NaN
    half = half.view(torch.float16)
    return half.to(torch.float32) if out is None else out.copy_(half)
