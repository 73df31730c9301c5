"""A key/value cache for incremental decoding, in JAX.

Buffers are preallocated to ``max_len`` positions and filled left to right by ``append``;
``keys`` and ``values`` are views of the filled part. The cache is an immutable pytree (leaves:
both buffers and ``length``, an int32 scalar array), so ``append`` returns a NEW cache (write
``cache = cache.append(k, v)``) and a jitted decoding step that takes and returns the cache
compiles once per chunk size: ``length`` is traced, the buffers keep their shape.

Appending past ``max_len`` is a ValueError when ``length`` is concrete (outside jit). Under jit
nothing can raise, so an overflow is made impossible to miss instead (``spec.CACHE_OVERFLOW``):
``length`` still grows past ``max_len`` (``overflowed`` is then True, a traced bool), the write
puts NaN in the last positions of both buffers (``lax.dynamic_update_slice`` clamps its start),
so every later attention over the cache gives NaN, and the write starts at the true, out of
bounds, position, which ``jax.experimental.checkify`` reports as an error when the step is
wrapped in ``checkify.checkify(step, errors=checkify.index_checks)``.

A modules' decoding step over a long buffer runs split-KV (``paged.split_kv_attention``), and
one over a ``PagedKVCache`` runs ``paged_attention`` (``spec.SPLIT_DECODING``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import attention_rules as rules

from ._arrays import _cache_dtype, _check_device, _place
from .functional import scaled_dot_product_attention
from .paged import PagedKVCache, split_kv_attention


@jax.tree_util.register_pytree_node_class
class KVCache:
    """Keys ``(..., kv_heads, max_len, head_dim)`` and values ``(..., kv_heads, max_len, v_dim)``
    of the positions decoded so far; ``length`` of them are filled."""

    def __init__(self, key_buffer: jax.Array, value_buffer: jax.Array, length: Any) -> None:
        self.key_buffer = key_buffer  # (..., kv_heads, max_len, head_dim)
        self.value_buffer = value_buffer  # (..., kv_heads, max_len, v_dim)
        self._length = jnp.asarray(length, jnp.int32)  # jax: a (traceable) int32 scalar

    def tree_flatten(self) -> tuple[tuple[Any, ...], None]:
        """jax only: leaves are the buffers and the length."""
        return (self.key_buffer, self.value_buffer, self._length), None

    @classmethod
    def tree_unflatten(cls, aux: None, leaves: Any) -> KVCache:
        """jax only: rebuild a cache from its leaves."""
        cache = object.__new__(cls)
        cache.key_buffer, cache.value_buffer, cache._length = leaves
        return cache

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

        ``dtype``: a dtype name or a JAX dtype; ``device``: a ``jax.Device``, a platform name,
        or ``None`` for JAX's default placement.
        """
        fn = "KVCache.empty"
        kv_heads = rules.check_int(fn, "kv_heads", kv_heads, minimum=1)
        max_len = rules.check_int(fn, "max_len", max_len)
        head_dim = rules.check_int(fn, "head_dim", head_dim)
        v_dim = head_dim if v_dim is None else rules.check_int(fn, "v_dim", v_dim)
        device = _check_device(fn, device)  # jax: a device or a platform name
        dtype = _cache_dtype(fn, dtype)
        rules.check_float_inputs(fn, dtype=dtype.name)
        shape = tuple(batch_shape) + (kv_heads, max_len)
        return cls(_place(jnp.zeros(shape + (head_dim,), dtype), device),
                   _place(jnp.zeros(shape + (v_dim,), dtype), device), 0)

    @property
    def length(self) -> jax.Array:
        """Number of filled positions (jax: an int32 scalar array, traced under jit)."""
        return self._length

    @property
    def max_len(self) -> int:
        """Capacity in positions."""
        return self.key_buffer.shape[-2]

    @property
    def overflowed(self) -> jax.Array:
        """True once an append went past ``max_len`` (jax: a bool scalar array, traced under jit;
        only a traced append can overflow, a concrete one raises)."""
        return self._length > self.max_len

    @property
    def keys(self) -> jax.Array:
        """``(..., kv_heads, length, head_dim)``: the filled part (outside jit only)."""
        return self.key_buffer[..., : int(self._length), :]

    @property
    def values(self) -> jax.Array:
        """``(..., kv_heads, length, v_dim)``: the filled part (outside jit only)."""
        return self.value_buffer[..., : int(self._length), :]

    def append(self, key: Any, value: Any) -> KVCache:
        """Add ``key (..., kv_heads, n, head_dim)`` and ``value (..., kv_heads, n, v_dim)``
        (cast to the cache's dtype); returns a new cache (jax: immutable)."""
        fn = "KVCache.append"
        key, value = jnp.asarray(key), jnp.asarray(value)
        rules.check_float_inputs(fn, key=jnp.dtype(key.dtype).name)  # cast to the cache's
        rules.check_float_inputs(fn, value=jnp.dtype(value.dtype).name)
        rules.check_cache_append(fn, tuple(key.shape), tuple(value.shape),
                                 tuple(self.key_buffer.shape), tuple(self.value_buffer.shape))
        start, stop = self._length, self._length + key.shape[-2]
        if not isinstance(start, jax.core.Tracer):  # jax: checkable only when concrete
            rules.check_cache_room(fn, int(start), int(stop), self.max_len)
        # jax: under jit an overflow cannot raise; it writes NaN (see the module docstring)
        fits = stop <= self.max_len
        key = jnp.where(fits, key.astype(self.key_buffer.dtype), jnp.nan)
        value = jnp.where(fits, value.astype(self.value_buffer.dtype), jnp.nan)
        axis = self.key_buffer.ndim - 2
        key_buffer = jax.lax.dynamic_update_slice_in_dim(self.key_buffer, key, start, axis)
        value_buffer = jax.lax.dynamic_update_slice_in_dim(self.value_buffer, value, start, axis)
        return KVCache(key_buffer, value_buffer, stop)


def decode_step(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    cache: KVCache | PagedKVCache | None,
    max_len: int | None,
    sinks: Any = None,
) -> tuple[jax.Array, KVCache | PagedKVCache]:
    """One decoding step of a module: append ``key``/``value`` ``(..., kv_heads, n, dim)`` to
    the cache (a new one of ``max_len`` positions when None), then attend
    ``query (..., heads, n, head_dim)`` over every cached position with the bottom-right causal
    rule: ``(..., heads, n, v_dim)``. ``sinks``: ``(heads,)`` sink logits (a module's
    learned sinks), or None.

    A long buffer is attended in chunks merged by their log-sum-exp (``spec.SPLIT_DECODING``,
    ``rules.split_chunk`` of ``max_len``: static); a ``PagedKVCache`` (outside jit: its
    bookkeeping is Python) holds sequences ``0..batch-1`` of the one batch axis and is attended
    by ``paged_attention``."""
    if isinstance(cache, PagedKVCache):
        cache = cache.append(key, value)
        return cache.attend(query.astype(cache.key_pages.dtype), sinks=sinks), cache
    if cache is None:
        max_len = key.shape[-2] if max_len is None else max_len
        cache = KVCache.empty(key.shape[:-3], key.shape[-3], max_len, key.shape[-1],
                              value.shape[-1], dtype=key.dtype)
    start = cache.length  # jax: may be traced, so the whole buffer is attended with a mask
    cache = cache.append(key, value)
    query = query.astype(cache.key_buffer.dtype)
    n = query.shape[-2]
    chunk = rules.split_chunk(n, cache.max_len)
    if chunk is not None:  # few query rows over a long buffer: chunks as one batch
        sinks = None if sinks is None else jnp.asarray(sinks)
        return split_kv_attention(query, cache.key_buffer, cache.value_buffer, chunk,
                                  sinks=sinks, length=cache.length)[0], cache
    # bottom-right causal over the filled part: key j <= start + i (later slots are not filled)
    mask = jnp.arange(cache.max_len)[None, :] <= start + jnp.arange(n)[:, None]  # (n, max_len)
    context = scaled_dot_product_attention(query, cache.key_buffer, cache.value_buffer, mask=mask,
                                           sinks=sinks)
    return context, cache
