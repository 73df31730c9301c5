"""Incremental decoding.

A key/value cache (``KVCache``) and the modules' ``decode`` method.
"""

from __future__ import annotations

from typing import Any

#: Public classes that are not modules (no weights).
CLASSES = ("KVCache",)

#: Modules with a ``decode`` method (``DecodingModule.decode`` gives its signature).
DECODING_MODULES = ("CausalSelfAttention", "MultiHeadAttention")

DECODING = (
    "A KVCache preallocates keys (..., kv_heads, max_len, head_dim) and values (..., kv_heads, "
    "max_len, v_dim) and fills them left to right. append(key, value) returns the cache holding "
    "the new positions: numpy_attn and torch_attn write in place and return the same cache; "
    "jax_attn caches are immutable pytrees (length is a traced int32 scalar, so a jitted "
    "decoding step compiles once per chunk size) and return a new cache. Write "
    "`cache = cache.append(key, value)` to be portable. "
    "module.decode(x, cache) projects the new tokens x (..., n, d), appends their keys and "
    "values, and attends with the bottom-right causal rule over every cached position, so "
    "decoding a sequence token by token, or in chunks, equals forward(x, is_causal=True) "
    "(CausalSelfAttention: forward(x)). decode never applies dropout. It returns "
    "(output, cache); cache=None starts a cache of max_len positions (default: n). "
    "The cache holds values only, never autograd history (torch_attn stores detached "
    "copies), so a decoding loop's memory does not grow with the number of steps; torch_attn's "
    "decode records a graph only when a gradient is requested (grad mode on and the module in "
    "training mode; in eval() it runs as under torch.no_grad()), and then the cached positions "
    "are constants of that graph."
)

#: What appending past ``max_len`` does, in every backend.
CACHE_OVERFLOW = (
    "An append whose length + n exceeds max_len never writes silently. Where length is a "
    "concrete number (numpy_attn and torch_attn always, jax_attn outside jit) it is a "
    "ValueError naming max_len, raised before anything changes: the cache stays as it was. "
    "Under jax.jit, where length is traced and nothing can raise, the append makes the overflow "
    "impossible to miss: length still grows past max_len, so `cache.overflowed` (length > "
    "max_len, a traced bool) is True from then on; the write puts NaN in the last n positions "
    "of both buffers (lax.dynamic_update_slice clamps the start), so every later decode output "
    "is NaN (never a finite wrong number); and the write starts at the true, out-of-bounds "
    "position, which jax.experimental.checkify reports when the step is wrapped in "
    "checkify.checkify(step, errors=checkify.index_checks). `overflowed` exists in every "
    "backend (always False where an overflow raises)."
)


class KVCache:
    """Keys and values of the positions decoded so far, preallocated to ``max_len``.

    Attributes (read-only): ``keys`` ``(..., kv_heads, length, head_dim)`` and ``values``
    ``(..., kv_heads, length, v_dim)`` are views of the filled part (jax_attn: slices, outside
    jit only); ``length`` the number of filled positions (jax_attn: an int32 scalar array);
    ``max_len`` the capacity; ``overflowed`` True once an append went past ``max_len``
    (``CACHE_OVERFLOW``).
    """

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
    ) -> Any:
        """An empty cache: buffers ``(*batch_shape, kv_heads, max_len, head_dim | v_dim)`` of zeros.

        ``v_dim`` defaults to ``head_dim``; ``dtype`` a dtype name or the backend's dtype;
        ``device`` as in ``causal_mask``.
        """

    def append(self, key: Any, value: Any) -> Any:
        """Add ``key (..., kv_heads, n, head_dim)`` and ``value (..., kv_heads, n, v_dim)``.

        Cast to the cache's dtype. Returns the cache (see ``DECODING``); ValueError when
        ``length + n > max_len`` (under ``jax.jit``: see ``CACHE_OVERFLOW``) or when the shapes
        do not match the cache.
        """


class DecodingModule:
    """The ``decode`` method of the modules named in ``DECODING_MODULES``."""

    def decode(self, x: Any, cache: Any = None, *, max_len: int | None = None) -> Any:
        """Attend the new tokens ``x`` over the cached ones and themselves (bottom-right causal).

        Args:
          x: ``(..., n, d_in)`` (``d_model`` for MultiHeadAttention): the next ``n`` tokens.
          cache: a ``KVCache`` from an earlier ``decode`` (``kv_heads`` = ``num_kv_heads``;
            CausalSelfAttention: 1 head of ``d_out_kq``/``d_out_v``), or None for a new one.
          max_len: capacity of the new cache when ``cache`` is None (default ``n``).

        Returns:
          ``(output, cache)``: ``output (..., n, d_out)`` as ``forward`` gives for these
          positions, and the cache holding every position so far.
        """
