"""A key/value cache for incremental decoding, in NumPy.

Buffers are preallocated to ``max_len`` positions and filled left to right by ``append``;
``keys`` and ``values`` are views of the filled part. ``append`` writes in place and returns
the cache itself (jax_attn returns a new cache: write ``cache = cache.append(k, v)``).
A modules' decoding step over a long cache runs split-KV (``paged.split_kv_attention``), and
one over a ``PagedKVCache`` runs ``paged_attention`` (``spec.SPLIT_DECODING``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import attention_rules as rules

from ._arrays import _cache_dtype, _check_device
from .functional import scaled_dot_product_attention
from .paged import PagedKVCache, split_kv_attention


class KVCache:
    """Keys ``(..., kv_heads, max_len, head_dim)`` and values ``(..., kv_heads, max_len, v_dim)``
    of the positions decoded so far; ``length`` of them are filled."""

    def __init__(self, key_buffer: np.ndarray, value_buffer: np.ndarray, length: int) -> None:
        self.key_buffer = key_buffer  # (..., kv_heads, max_len, head_dim)
        self.value_buffer = value_buffer  # (..., kv_heads, max_len, v_dim)
        self._length = length

    @classmethod
    def empty(
        cls,
        batch_shape: tuple,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        v_dim: int | None = None,
        *,
        dtype: Any = "float32",
        device: Any = None,
    ) -> KVCache:
        """An empty cache: zero buffers ``(*batch_shape, kv_heads, max_len, head_dim)`` for keys
        and ``(*batch_shape, kv_heads, max_len, v_dim)`` for values (``v_dim``: ``head_dim``).

        ``dtype``: a dtype name or a NumPy dtype; ``device``: ``None`` or ``"cpu"``.
        """
        fn = "KVCache.empty"
        kv_heads = rules.check_int(fn, "kv_heads", kv_heads, minimum=1)
        max_len = rules.check_int(fn, "max_len", max_len)
        head_dim = rules.check_int(fn, "head_dim", head_dim)
        v_dim = head_dim if v_dim is None else rules.check_int(fn, "v_dim", v_dim)
        _check_device(fn, device)  # numpy: the CPU only
        dtype = _cache_dtype(fn, dtype)
        rules.check_float_inputs(fn, dtype=dtype.name)
        shape = tuple(batch_shape) + (kv_heads, max_len)
        return cls(np.zeros(shape + (head_dim,), dtype), np.zeros(shape + (v_dim,), dtype), 0)

    @property
    def length(self) -> int:
        """Number of filled positions."""
        return self._length

    @property
    def max_len(self) -> int:
        """Capacity in positions."""
        return self.key_buffer.shape[-2]

    @property
    def overflowed(self) -> bool:
        """True once an append went past ``max_len``: never here, where such an append raises
        (jax_attn: possible under jit, see ``spec.CACHE_OVERFLOW``)."""
        return self._length > self.max_len

    @property
    def keys(self) -> np.ndarray:
        """``(..., kv_heads, length, head_dim)``: a view of the filled part."""
        return self.key_buffer[..., : self._length, :]

    @property
    def values(self) -> np.ndarray:
        """``(..., kv_heads, length, v_dim)``: a view of the filled part."""
        return self.value_buffer[..., : self._length, :]

    def append(self, key: Any, value: Any) -> KVCache:
        """Add ``key (..., kv_heads, n, head_dim)`` and ``value (..., kv_heads, n, v_dim)``
        (cast to the cache's dtype); returns the cache, updated in place."""
        fn = "KVCache.append"
        key, value = np.asarray(key), np.asarray(value)
        rules.check_float_inputs(fn, key=key.dtype.name)  # cast to the cache's dtype after
        rules.check_float_inputs(fn, value=value.dtype.name)
        rules.check_cache_append(fn, tuple(key.shape), tuple(value.shape),
                                 tuple(self.key_buffer.shape), tuple(self.value_buffer.shape))
        start, stop = self._length, self._length + key.shape[-2]
        rules.check_cache_room(fn, start, stop, self.max_len)
        self.key_buffer[..., start:stop, :] = key  # numpy: in place
        self.value_buffer[..., start:stop, :] = value
        self._length = stop
        return self


def decode_step(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    cache: KVCache | PagedKVCache | None,
    max_len: int | None,
    sinks: Any = None,
) -> tuple[np.ndarray, KVCache | PagedKVCache]:
    """One decoding step of a module: append ``key``/``value`` ``(..., kv_heads, n, dim)`` to
    the cache (a new one of ``max_len`` positions when None), then attend
    ``query (..., heads, n, head_dim)`` over every cached position with the bottom-right causal
    rule: ``(..., heads, n, v_dim)``. ``sinks``: ``(heads,)`` sink logits (a module's
    learned sinks), or None.

    A long cache is attended in chunks merged by their log-sum-exp (``spec.SPLIT_DECODING``,
    ``rules.split_chunk``); a ``PagedKVCache`` holds sequences ``0..batch-1`` of the one batch
    axis and is attended by ``paged_attention``."""
    if isinstance(cache, PagedKVCache):
        cache = cache.append(key, value)
        query = query.astype(cache.key_pages.dtype, copy=False)
        return cache.attend(query, sinks=sinks), cache
    if cache is None:
        max_len = key.shape[-2] if max_len is None else max_len
        cache = KVCache.empty(key.shape[:-3], key.shape[-3], max_len, key.shape[-1],
                              value.shape[-1], dtype=key.dtype)
    cache = cache.append(key, value)
    query = query.astype(cache.key_buffer.dtype, copy=False)
    chunk = rules.split_chunk(query.shape[-2], cache.length)
    if chunk is not None:  # few query rows over many keys: the chunks on every core
        sinks = None if sinks is None else np.asarray(sinks)
        return split_kv_attention(query, cache.keys, cache.values, chunk, sinks=sinks)[0], cache
    context = scaled_dot_product_attention(
        query, cache.keys, cache.values, is_causal=True, causal_alignment="bottom_right",
        sinks=sinks,
    )
    return context, cache
