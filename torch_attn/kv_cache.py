"""A key/value cache for incremental decoding, in PyTorch.

Buffers are preallocated to ``max_len`` positions and filled left to right by ``append``;
``keys`` and ``values`` are views of the filled part. ``append`` writes in place and returns
the cache itself (jax_attn returns a new cache: write ``cache = cache.append(k, v)``).
The buffers hold values, never autograd history: ``append`` stores detached copies.
A modules' decoding step over a long cache runs split-KV (``paged.split_kv_attention``), and
one over a ``PagedKVCache`` runs ``paged_attention`` (``spec.SPLIT_DECODING``). torch: a step
of at most ``SPLIT_KV["max_q_len"]`` query rows over a shorter cache runs the same kernel in
one piece: for one query row torch's SDPA (which reads each kv head's keys once per query head)
and ``scaled_dot_product_attention`` (its checks cost more than the kernel at this size) are
slower than a kv head's query rows as the rows of one matrix product
(``benchmarks/RESULTS.md``, decoding at scale).
"""

from __future__ import annotations

from typing import Any

import torch

import attention_rules as rules

from ._arrays import _as_tensor, _cache_dtype, _dtype_name
from .functional import merge_attention, scaled_dot_product_attention
from .paged import PagedKVCache, paged_cached_part, split_kv_attention


class KVCache:
    """Keys ``(..., kv_heads, max_len, head_dim)`` and values ``(..., kv_heads, max_len, v_dim)``
    of the positions decoded so far; ``length`` of them are filled."""

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> None:
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

        ``dtype``: a dtype name or a ``torch.dtype``; ``device``: a ``torch.device`` (or its
        name), ``None`` for torch's default device.
        """
        fn = "KVCache.empty"
        kv_heads = rules.check_int(fn, "kv_heads", kv_heads, minimum=1)
        max_len = rules.check_int(fn, "max_len", max_len)
        head_dim = rules.check_int(fn, "head_dim", head_dim)
        v_dim = head_dim if v_dim is None else rules.check_int(fn, "v_dim", v_dim)
        dtype = _cache_dtype(fn, dtype)
        rules.check_float_inputs(fn, dtype=str(dtype).removeprefix("torch."))
        shape = tuple(batch_shape) + (kv_heads, max_len)
        like = {"dtype": dtype, "device": device}  # torch: the device of the buffers
        return cls(torch.zeros(shape + (head_dim,), **like), torch.zeros(shape + (v_dim,), **like),
                   0)

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
    def keys(self) -> torch.Tensor:
        """``(..., kv_heads, length, head_dim)``: a view of the filled part."""
        return self.key_buffer[..., : self._length, :]

    @property
    def values(self) -> torch.Tensor:
        """``(..., kv_heads, length, v_dim)``: a view of the filled part."""
        return self.value_buffer[..., : self._length, :]

    def append(self, key: Any, value: Any) -> KVCache:
        """Add ``key (..., kv_heads, n, head_dim)`` and ``value (..., kv_heads, n, v_dim)``
        (cast to the cache's dtype, detached); returns the cache, updated in place."""
        fn = "KVCache.append"
        key, value = _as_tensor(key), _as_tensor(value)
        rules.check_float_inputs(fn, key=_dtype_name(key))  # cast to the cache's dtype after
        rules.check_float_inputs(fn, value=_dtype_name(value))
        rules.check_cache_append(fn, tuple(key.shape), tuple(value.shape),
                                 tuple(self.key_buffer.shape), tuple(self.value_buffer.shape))
        start, stop = self._length, self._length + key.shape[-2]
        rules.check_cache_room(fn, start, stop, self.max_len)
        # in place, cast to the cache's dtype/device; torch: without autograd history, so the
        # buffers never chain the graphs of every step (a decoding loop's memory stays flat)
        self.key_buffer[..., start:stop, :] = key.detach()
        self.value_buffer[..., start:stop, :] = value.detach()
        self._length = stop
        return self


def decode_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: KVCache | PagedKVCache | None,
    max_len: int | None,
    sinks: Any = None,
) -> tuple[torch.Tensor, KVCache | PagedKVCache]:
    """One decoding step of a module: append ``key``/``value`` ``(..., kv_heads, n, dim)`` to
    the cache (a new one of ``max_len`` positions when None), then attend
    ``query (..., heads, n, head_dim)`` over every cached position with the bottom-right causal
    rule: ``(..., heads, n, v_dim)``. ``sinks``: ``(heads,)`` sink logits (a module's
    learned sinks), or None.

    A long cache is attended in chunks merged by their log-sum-exp (``spec.SPLIT_DECODING``,
    ``rules.split_chunk``); a ``PagedKVCache`` holds sequences ``0..batch-1`` of the one batch
    axis and is attended by ``paged_attention``. torch: up to ``SPLIT_KV["max_q_len"]`` query
    rows, ``split_kv_attention`` (in one piece over a shorter cache; the module docstring).

    torch: the cache stores values without history; when grad mode is on, this call's own
    keys and values are attended with theirs (the cached positions are constants)."""
    if isinstance(cache, PagedKVCache):
        return _paged_step(query, key, value, cache, sinks)
    if cache is None:
        max_len = key.shape[-2] if max_len is None else max_len
        cache = KVCache.empty(tuple(key.shape[:-3]), key.shape[-3], max_len, key.shape[-1],
                              value.shape[-1], dtype=key.dtype, device=key.device)
    start = cache.length
    cache = cache.append(key, value)
    query = query.to(cache.key_buffer.dtype)
    keys, values = cache.keys, cache.values  # (..., kv_heads, length, head_dim | v_dim)
    if torch.is_grad_enabled():  # torch: a copy whose last n positions keep their history
        keys = torch.cat([keys[..., :start, :], key.to(keys.dtype)], dim=-2)
        values = torch.cat([values[..., :start, :], value.to(values.dtype)], dim=-2)
    n, kv_len = query.shape[-2], keys.shape[-2]
    if 0 < n <= rules.SPLIT_KV["max_q_len"]:  # few query rows: torch_attn's own matmuls
        chunk = rules.split_chunk(n, kv_len) or kv_len  # many keys: chunks merged by lse
        sinks = None if sinks is None else _as_tensor(sinks)
        return split_kv_attention(query, keys, values, chunk, sinks=sinks)[0], cache
    context = scaled_dot_product_attention(
        query, keys, values, is_causal=True, causal_alignment="bottom_right", sinks=sinks
    )
    return context, cache


def _paged_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    sinks: Any,
) -> tuple[torch.Tensor, PagedKVCache]:
    """``decode_step`` over a ``PagedKVCache`` (sequences ``0..batch-1``). torch: with grad
    mode on, the pages (values without history) give the cached positions' partial result and
    this step's own keys and values, with their history, the rest (causal among themselves);
    the two merge by their log-sum-exp."""
    starts = [cache.seq_len(b) for b in range(key.shape[0])]
    cache = cache.append(key, value)
    query = query.to(cache.key_pages.dtype)
    if not torch.is_grad_enabled():
        return cache.attend(query, sinks=sinks), cache
    own = scaled_dot_product_attention(query, key.to(query.dtype), value.to(query.dtype),
                                       is_causal=True, return_lse=True)
    cached = paged_cached_part(query, cache, starts)
    context, _ = merge_attention([cached[0], own[0]], [cached[1], own[1]], sinks=sinks)
    return context, cache
