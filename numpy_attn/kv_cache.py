"""A key/value cache for incremental decoding, in NumPy.

Buffers are preallocated to ``max_len`` positions and filled left to right by ``append``;
``keys`` and ``values`` are views of the filled part. ``append`` writes in place and returns
the cache itself (jax_attn returns a new cache: write ``cache = cache.append(k, v)``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _checks
from .masks import _check_device


def _dtype(dtype: Any) -> np.dtype:
    """A dtype name (``"bfloat16"`` via ml_dtypes) or a NumPy dtype."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


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
        kv_heads = _checks.check_int(fn, "kv_heads", kv_heads, minimum=1)
        max_len = _checks.check_int(fn, "max_len", max_len)
        head_dim = _checks.check_int(fn, "head_dim", head_dim)
        v_dim = head_dim if v_dim is None else _checks.check_int(fn, "v_dim", v_dim)
        _check_device(fn, device)  # numpy: the CPU only
        dtype = _dtype(dtype)
        _checks.check_float_inputs(fn, dtype=dtype.name)
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
        _check_append(fn, tuple(key.shape), tuple(value.shape), tuple(self.key_buffer.shape),
                      tuple(self.value_buffer.shape))
        start, stop = self._length, self._length + key.shape[-2]
        _check_room(fn, start, stop, self.max_len)
        self.key_buffer[..., start:stop, :] = key  # numpy: in place
        self.value_buffer[..., start:stop, :] = value
        self._length = stop
        return self


def _check_append(
    fn: str,
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    k_buffer: tuple[int, ...],
    v_buffer: tuple[int, ...],
) -> None:
    """Key and value match the cache in every axis but the sequence axis."""
    _checks.check_key_value(fn, k_shape, v_shape)
    same = len(k_shape) == len(k_buffer) and k_shape[:-2] == k_buffer[:-2]
    if not (same and k_shape[-1] == k_buffer[-1] and v_shape[-1] == v_buffer[-1]):
        raise ValueError(
            f"{fn}: key and value must match the cache's (..., kv_heads, *, head_dim | v_dim) = "
            f"{k_buffer[:-2] + (k_buffer[-1],)} | {v_buffer[-1]}; "
            f"got key.shape={k_shape}, value.shape={v_shape}"
        )


def _check_room(fn: str, start: int, stop: int, max_len: int) -> None:
    """``stop <= max_len`` (ValueError naming max_len otherwise)."""
    if stop > max_len:
        raise ValueError(
            f"{fn}: the cache is full; {stop - start} new positions after {start} exceed "
            f"max_len={max_len}"
        )
