"""Exercise 7 (JAX), one answer: padding masks and fully masked rows.

Graded by ``python -m conformance exercise 7 --backend jax --file
learn/solutions/jax/ex07_padding.py`` (``tests/test_learn.py`` runs it).
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def padded_attention(
    query: jnp.ndarray, key: jnp.ndarray, value: jnp.ndarray, mask: jnp.ndarray
) -> jnp.ndarray:
    """Attention with a boolean mask: ``softmax(where(mask, q @ kᵀ / √d, −inf)) @ v``.

    ``mask`` is True where the query may attend the key (as in torch SDPA and jax.nn; the
    opposite of ``torch.nn.MultiheadAttention``'s masks). Padding makes whole rows False: a
    padded query may attend nothing. The spec's answer for such a row is weights 0 and output
    exactly 0 — never NaN, never the mean of the values.

    Args:
      query: ``(..., q_len, d)``; key: ``(..., kv_len, d)``; value: ``(..., kv_len, d_v)``.
      mask: bool, broadcastable to ``(..., q_len, kv_len)``.

    Returns:
      ``(..., q_len, d_v)``.

    The body below works until a row is fully masked. Grade it, read the diagnosis, fix it.
    """
    scores = query @ jnp.swapaxes(key, -1, -2) / math.sqrt(query.shape[-1])
    scores = jnp.where(mask, scores, -jnp.inf)  # True = may attend
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(row_max == -jnp.inf, 0.0, row_max)  # an empty row: no -inf - (-inf)
    e = jnp.exp(scores - row_max)  # masked: exp(-inf) = 0
    total = e.sum(axis=-1, keepdims=True)
    weights = e / jnp.where(total == 0, 1.0, total)  # an empty row: 0 / 1 = 0
    return weights @ value
