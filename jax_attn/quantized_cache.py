"""Quantised KV caches in JAX: ``quantize_kv`` / ``dequantize_kv`` and ``QuantizedKVCache``;
``conformance/spec/quantized_cache.py`` is the spec, ``attention_rules.quantizing`` the rules.

Integer codes: ``scale = amax / qmax`` per group (symmetric, codes in [-qmax, qmax]) or
``scale = (max - min) / (2^bits - 1)`` with the group's minimum as zero point (codes in
[0, 2^bits - 1]); ``code = clip(round_half_even(x / scale))``. fp8 codes: ``x / scale``
clipped to ±fp8_max (saturation) and cast with round-to-nearest-even (ml_dtypes' float8
types). Every step in float32, rounded once per operation; a scale of 0 codes 0 and
dequantises to exactly 0 (plus the zero point). int4 codes are stored unpacked, one per byte.
The cache quantises on append and dequantises inside ``attend``; its most recent tokens may
stay unquantised (``KVQuantization.residual``). jax: ``QuantizedArray`` and the cache are
immutable pytrees; ``append`` returns a NEW cache (write ``cache = cache.append(k, v)``). The
lengths are Python ints (static data of the pytree), since where a token goes depends on them:
append runs eagerly, and a jitted function of a cache compiles once per pair of lengths (so
does ``attend``'s decoding step, ``_dequantizing.py``, a jitted program of its own).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import attention_rules as rules
from attention_rules import quantizing as qrules
from attention_rules.quantizing import KVQuantization  # noqa: F401 - re-exported

from . import _dequantizing
from ._arrays import _cache_dtype, _check_device, _describe, _dtype_name, _place
from ._dequantizing import dequantizing_attention
from .functional import scaled_dot_product_attention

#: jax: the code dtypes by name (fp8: ml_dtypes' types, as jnp.float8_*).
_CODES = {"int8": jnp.int8, "uint8": jnp.uint8, "float8_e4m3fn": jnp.float8_e4m3fn,
          "float8_e5m2": jnp.float8_e5m2}


@jax.tree_util.register_pytree_node_class
class QuantizedArray:
    """Codes and scales of a quantised ``(..., kv_heads, n, head_dim)`` array.

    ``codes`` ``(..., kv_heads, n, head_dim)`` (``scheme.code_dtype``); ``scales`` float32,
    ``(..., kv_heads, n, groups)`` for integer codes, ``()`` (per tensor) or ``(kv_heads,)``
    (per head) for fp8; ``zero_points`` like ``scales`` with zero points, else None;
    ``scheme``; ``dtype`` the name of the dtype ``dequantize_kv`` returns.
    """

    def __init__(self, codes: jax.Array, scales: jax.Array, zero_points: jax.Array | None,
                 scheme: KVQuantization, dtype: str) -> None:
        self.codes = codes
        self.scales = scales
        self.zero_points = zero_points
        self.scheme = scheme
        self.dtype = dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the quantised array: ``codes.shape``."""
        return tuple(self.codes.shape)

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[KVQuantization, str]]:
        """jax only: leaves are the arrays; the scheme and the dtype are static."""
        return (self.codes, self.scales, self.zero_points), (self.scheme, self.dtype)

    @classmethod
    def tree_unflatten(cls, aux: tuple[KVQuantization, str], leaves: Any) -> QuantizedArray:
        """jax only: rebuild from the leaves."""
        return cls(*leaves, *aux)


def quantize_kv(x: Any, scheme: KVQuantization) -> QuantizedArray:
    """Quantise keys or values ``x (..., kv_heads, n, head_dim)`` by ``scheme``.

    Args:
      x: ``(..., kv_heads, n, head_dim)``, float16, bfloat16, float32 or float64 (rounded to
        float32 first).
      scheme: a ``KVQuantization`` (its ``residual`` is the cache's and is ignored here).

    Returns:
      a ``QuantizedArray``: codes ``x.shape``, scales (and zero points) as its docstring says.
    """
    fn = "quantize_kv"
    plan = qrules.quantize_arguments(fn, _describe(fn, "x", x), scheme)
    x32 = jnp.asarray(x).astype(jnp.float32)  # (..., kv_heads, n, head_dim)
    if scheme.is_float8:
        scales = _float8_scale(x32, scheme)
        return QuantizedArray(_float8_codes(x32, scales, scheme), scales, None, scheme, plan.dtype)
    codes, scales, zero_points = _integer_codes(x32, scheme, plan.group_size)
    return QuantizedArray(codes, scales, zero_points, scheme, plan.dtype)


def dequantize_kv(q: QuantizedArray) -> jax.Array:
    """The values of ``q``: ``codes · scale (+ zero point)`` in float32, rounded to ``q.dtype``.

    Args:
      q: a ``QuantizedArray`` of ``(..., kv_heads, n, head_dim)``.

    Returns:
      ``(..., kv_heads, n, head_dim)`` in ``q.dtype``; a group of scale 0 is exactly 0 (its
      zero point with zero points); a NaN scale makes its group NaN.
    """
    qrules.check_quantized("dequantize_kv", q, QuantizedArray)
    values = q.codes.astype(jnp.float32)  # (..., kv_heads, n, head_dim)
    if q.scheme.is_float8:
        values = values * _head_axes(q.scales, values.ndim)
    else:
        groups = q.scales.shape[-1]
        # (..., n, groups, size): the counts explicit (-1 is ambiguous for 0 tokens)
        values = values.reshape(values.shape[:-1] + (groups, values.shape[-1] // groups))
        values = values * q.scales[..., None]
        if q.zero_points is not None:  # two roundings: product, then sum (kept apart under jit)
            values = _dequantizing._rounded_apart(values, q.scales[..., None])
            values = values + q.zero_points[..., None]
        values = values.reshape(q.codes.shape)
    return values.astype(_cache_dtype("dequantize_kv", q.dtype))


def _integer_codes(
    x32: jax.Array, scheme: KVQuantization, group_size: int
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Integer codes ``x32.shape``, scales and zero points ``(..., n, groups)`` float32."""
    # (..., n, groups, size): the counts explicit (-1 is ambiguous for 0 tokens)
    grouped = x32.reshape(x32.shape[:-1] + (x32.shape[-1] // group_size, group_size))
    low, high = scheme.code_range
    if scheme.zero_point:
        zero_points = grouped.min(axis=-1)  # (..., n, groups); NaN propagates
        spread = grouped.max(axis=-1) - zero_points
        scales = _divide(spread, jnp.float32(high))
        shifted = grouped - zero_points[..., None]
    else:
        zero_points = None
        scales = _divide(jnp.abs(grouped).max(axis=-1), jnp.float32(high))
        shifted = grouped
    scales = jnp.where(jnp.isfinite(scales), scales, jnp.nan)  # a NaN/inf group: NaN
    usable = scales > 0  # a scale of 0 (or NaN) codes 0
    ratio = _divide(shifted, jnp.where(usable, scales, jnp.float32(1))[..., None])
    ratio = jnp.where(usable[..., None], ratio, jnp.float32(0))
    codes = jnp.clip(jnp.round(ratio), low, high)  # jax: round is half to even
    codes = codes.reshape(x32.shape).astype(_CODES[scheme.code_dtype])
    return codes, scales, zero_points


def _float8_scale(x32: jax.Array, scheme: KVQuantization) -> jax.Array:
    """fp8 scales: ``()`` per tensor or ``(kv_heads,)`` per head, float32; the given ones, or
    ``amax / fp8_max`` (NaN where amax is not finite)."""
    if scheme.scale is not None:
        return jnp.asarray(scheme.scale, jnp.float32)
    magnitudes = jnp.abs(x32)
    if scheme.granularity == "head":  # every axis but kv_heads
        axes = tuple(a for a in range(x32.ndim) if a != x32.ndim - 3)
        amax = magnitudes.max(axis=axes) if x32.size else jnp.zeros(x32.shape[-3], jnp.float32)
    else:
        amax = magnitudes.max() if x32.size else jnp.float32(0)
    scales = _divide(jnp.asarray(amax, jnp.float32), jnp.float32(scheme.code_range[1]))
    return jnp.where(jnp.isfinite(scales), scales, jnp.nan)


def _float8_codes(x32: jax.Array, scales: jax.Array, scheme: KVQuantization) -> jax.Array:
    """fp8 codes of ``x32 / scale``, saturated to ±fp8_max (NaN stays NaN)."""
    scale = _head_axes(scales, x32.ndim)
    usable = scale > 0
    ratio = jnp.where(usable, _divide(x32, jnp.where(usable, scale, jnp.float32(1))), 0.0)
    low, high = scheme.code_range
    ratio = jnp.clip(ratio, jnp.float32(low), jnp.float32(high))  # saturate; NaN passes
    return ratio.astype(_CODES[scheme.code_dtype])  # round to nearest even


def _divide(a: jax.Array, b: Any) -> jax.Array:
    """``a / b`` (broadcast), rounded once: IEEE division. jax: XLA on CPU turns a division
    by a broadcast divisor into a product with its reciprocal (off by an ulp); the barrier keeps
    the division."""
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(b, shape))


def _head_axes(scales: jax.Array, ndim: int) -> jax.Array:
    """fp8 scales shaped to broadcast against ``(..., kv_heads, n, head_dim)``."""
    return scales.reshape(scales.shape + (1, 1)) if scales.ndim == 1 else scales


@jax.tree_util.register_pytree_node_class
class QuantizedKVCache:
    """A KV cache that stores quantised keys and values (``spec.QUANTIZED_CACHE``): codes of
    ``length - residual_length`` positions, then ``residual_length`` positions unquantised."""

    def __init__(self, key_store: QuantizedArray, value_store: QuantizedArray,
                 key_residual: jax.Array, value_residual: jax.Array, stored: int,
                 held: int) -> None:
        self.key_store = key_store  # codes (..., kv_heads, max_len, head_dim)
        self.value_store = value_store  # codes (..., kv_heads, max_len, v_dim)
        self.key_residual = key_residual  # (..., kv_heads, residual, head_dim), the dtype
        self.value_residual = value_residual  # (..., kv_heads, residual, v_dim)
        self._stored = stored  # jax: Python ints, static data of the pytree
        self._held = held

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[int, int]]:
        """jax only: leaves are the stores and the windows; the lengths are static."""
        leaves = (self.key_store, self.value_store, self.key_residual, self.value_residual)
        return leaves, (self._stored, self._held)

    @classmethod
    def tree_unflatten(cls, aux: tuple[int, int], leaves: Any) -> QuantizedKVCache:
        """jax only: rebuild a cache from its leaves."""
        return cls(*leaves, *aux)

    @classmethod
    def empty(
        cls,
        batch_shape: tuple,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        v_dim: int | None = None,
        *,
        scheme: KVQuantization,
        value_scheme: KVQuantization | None = None,
        dtype: Any = "float32",
        device: Any = None,
    ) -> QuantizedKVCache:
        """An empty cache of ``max_len`` positions of ``(*batch_shape, kv_heads, *,
        head_dim | v_dim)``: keys quantised by ``scheme``, values by ``value_scheme`` (default
        ``scheme``; both with the same ``residual``); ``dtype`` of the residual window and of
        the dequantised keys and values; ``device``: ``None`` or ``"cpu"``."""
        fn = "QuantizedKVCache.empty"
        kv_heads = rules.check_int(fn, "kv_heads", kv_heads, minimum=1)
        max_len = rules.check_int(fn, "max_len", max_len)
        head_dim = rules.check_int(fn, "head_dim", head_dim)
        v_dim = head_dim if v_dim is None else rules.check_int(fn, "v_dim", v_dim)
        scheme, value_scheme = qrules.cache_schemes(fn, scheme, value_scheme, kv_heads,
                                                    head_dim, v_dim)
        device = _check_device(fn, device)  # jax: a device or a platform name
        dtype = _cache_dtype(fn, dtype)
        rules.check_float_inputs(fn, dtype=dtype.name)
        shape = tuple(batch_shape) + (kv_heads,)
        residual = (scheme.residual,)
        cache = cls(_empty_store(shape + (max_len, head_dim), scheme, dtype.name),
                    _empty_store(shape + (max_len, v_dim), value_scheme, dtype.name),
                    jnp.zeros(shape + residual + (head_dim,), dtype),
                    jnp.zeros(shape + residual + (v_dim,), dtype), 0, 0)
        return jax.tree_util.tree_map(lambda a: _place(a, device), cache)  # jax: placement

    @property
    def length(self) -> int:
        """Number of filled positions (quantised and residual)."""
        return self._stored + self._held

    @property
    def stored_length(self) -> int:
        """Positions in the quantised store: ``0 .. stored_length - 1``."""
        return self._stored

    @property
    def residual_length(self) -> int:
        """Positions in the unquantised window: the last ``residual_length``."""
        return self._held

    @property
    def max_len(self) -> int:
        """Capacity in positions."""
        return self.key_store.codes.shape[-2]

    @property
    def overflowed(self) -> bool:
        """True once an append went past ``max_len``: never here, where such an append raises
        (jax: the lengths are Python ints, so an append checks them even under jit)."""
        return self.length > self.max_len

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales, zero points and both residual windows."""
        stores = (self.key_store, self.value_store)
        arrays = [a for s in stores for a in (s.codes, s.scales, s.zero_points) if a is not None]
        return sum(a.nbytes for a in arrays + [self.key_residual, self.value_residual])

    @property
    def keys(self) -> jax.Array:
        """``(..., kv_heads, length, head_dim)``: dequantised keys, then the residual ones."""
        return _cached(self.key_store, self._stored, self.key_residual, self._held)

    @property
    def values(self) -> jax.Array:
        """``(..., kv_heads, length, v_dim)``: dequantised values, then the residual ones."""
        return _cached(self.value_store, self._stored, self.value_residual, self._held)

    def append(self, key: Any, value: Any) -> QuantizedKVCache:
        """Add ``key (..., kv_heads, n, head_dim)`` and ``value (..., kv_heads, n, v_dim)``
        (cast to the cache's dtype, then quantised or held in the residual window by
        ``spec.QUANTIZED_RESIDUAL``); returns a new cache (jax: immutable)."""
        fn = "QuantizedKVCache.append"
        rules.check_float_inputs(fn, key=_dtype_name(key))  # cast to the cache's dtype after
        rules.check_float_inputs(fn, value=_dtype_name(value))
        key, value = jnp.asarray(key), jnp.asarray(value)
        rules.check_cache_append(fn, tuple(key.shape), tuple(value.shape),
                                 tuple(self.key_store.codes.shape),
                                 tuple(self.value_store.codes.shape))
        n = key.shape[-2]
        rules.check_cache_room(fn, self.length, self.length + n, self.max_len)
        dtype = self.key_residual.dtype
        key, value = key.astype(dtype), value.astype(dtype)
        held, residual = self._held, self.key_residual.shape[-2]
        if qrules.moves_to_store(self.length, held, n, residual):  # the window and the new
            keys = jnp.concatenate([self.key_residual[..., :held, :], key], axis=-2)
            values = jnp.concatenate([self.value_residual[..., :held, :], value], axis=-2)
            return QuantizedKVCache(_store(self.key_store, keys, self._stored),  # jax: new
                                    _store(self.value_store, values, self._stored),
                                    self.key_residual, self.value_residual,
                                    self._stored + held + n, 0)
        return QuantizedKVCache(  # into the window
            self.key_store, self.value_store,
            self.key_residual.at[..., held:held + n, :].set(key),
            self.value_residual.at[..., held:held + n, :].set(value), self._stored, held + n)

    def attend(
        self,
        query: Any,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: Any = None,
    ) -> jax.Array:
        """Attention of ``query (..., heads, q_len, head_dim)`` (the last ``q_len`` positions,
        cast to the cache's dtype) over the dequantised keys and values and the residual
        window, bottom-right causal: ``scaled_dot_product_attention`` of ``keys`` and
        ``values``; ``(..., heads, q_len, v_dim)``. A decoding step (default scale, no
        softcap, up to ``SPLIT_KV["max_q_len"]`` query rows) runs split-KV and dequantises
        the codes a part at a time (``_dequantizing.py``): no float copy of the cache."""
        fn = "QuantizedKVCache.attend"
        info = _describe(fn, "query", query)
        rules.check_float_inputs(fn, query=info[1])
        shape = tuple(self.key_residual.shape[:-2]) + (self.length, self.key_residual.shape[-1])
        rules.check_query_key(fn, info[0], shape)
        rules.check_sinks(fn, _describe(fn, "sinks", sinks), rules.heads_of(info[0]))
        query = jnp.asarray(query).astype(self.key_residual.dtype)
        n = query.shape[-2]
        if scale is None and softcap is None and 0 < n <= min(self.length,
                                                              rules.SPLIT_KV["max_q_len"]):
            # few query rows: the codes dequantised a part at a time, no float copy
            sinks = None if sinks is None else jnp.asarray(sinks)
            return dequantizing_attention(
                query, self.key_store, self.value_store, self.key_residual,
                self.value_residual, self._stored, self._held, sinks=sinks,
                part_bytes=_dequantizing.PART_BYTES)[0]
        return scaled_dot_product_attention(
            query, self.keys, self.values, is_causal=True, causal_alignment="bottom_right",
            scale=scale, softcap=softcap, sinks=sinks)


def _empty_store(shape: tuple, scheme: KVQuantization, dtype: str) -> QuantizedArray:
    """A store of zero codes ``shape`` ``(..., kv_heads, max_len, dim)``: scales (and zero
    points) per position for integer codes; fp8: the given scales, or zeros until the first
    append calibrates them."""
    codes = jnp.zeros(shape, _CODES[scheme.code_dtype])
    if scheme.is_float8:
        heads = (shape[-3],) if scheme.granularity == "head" else ()
        given = scheme.scale is not None
        scales = jnp.asarray(scheme.scale, jnp.float32) if given else jnp.zeros(heads, jnp.float32)
        return QuantizedArray(codes, scales, None, scheme, dtype)
    groups = 1 if scheme.granularity == "token" else shape[-1] // scheme.group_size
    scales = jnp.zeros(shape[:-1] + (groups,), jnp.float32)
    zero_points = jnp.zeros_like(scales) if scheme.zero_point else None
    return QuantizedArray(codes, scales, zero_points, scheme, dtype)


def _store(store: QuantizedArray, x: jax.Array, at: int) -> QuantizedArray:
    """Quantise ``x (..., kv_heads, n, dim)`` into positions ``at .. at + n`` of ``store``;
    a dynamic fp8 scale is calibrated by the first positions (``at == 0``) and kept.
    jax: returns a new store."""
    scheme, stop = store.scheme, at + x.shape[-2]
    x32 = x.astype(jnp.float32)
    if scheme.is_float8:
        scales = store.scales
        if at == 0 and scheme.scale is None:
            scales = _float8_scale(x32, scheme)
        codes = store.codes.at[..., at:stop, :].set(_float8_codes(x32, scales, scheme))
        return QuantizedArray(codes, scales, None, scheme, store.dtype)
    codes, scales, zero_points = _integer_codes(x32, scheme, x.shape[-1] // store.scales.shape[-1])
    return QuantizedArray(
        store.codes.at[..., at:stop, :].set(codes), store.scales.at[..., at:stop, :].set(scales),
        None if zero_points is None else store.zero_points.at[..., at:stop, :].set(zero_points),
        scheme, store.dtype)


def _cached(store: QuantizedArray, stored: int, residual: jax.Array, held: int) -> jax.Array:
    """The first ``stored`` positions of ``store`` dequantised, then ``held`` residual ones."""
    per_position = not store.scheme.is_float8
    part = QuantizedArray(
        store.codes[..., :stored, :],
        store.scales[..., :stored, :] if per_position else store.scales,
        store.zero_points[..., :stored, :] if store.zero_points is not None else None,
        store.scheme, store.dtype)
    return jnp.concatenate([dequantize_kv(part), residual[..., :held, :]], axis=-2)
