"""Exercise 6 (JAX), one answer: causal weights, the article's second method.

Graded by ``python -m conformance exercise 6 --backend jax --file
learn/solutions/jax/ex06_causal_mask.py`` (``tests/test_learn.py`` runs it).
"""

from __future__ import annotations

import jax.numpy as jnp


def causal_attention_weights(scores: jnp.ndarray) -> jnp.ndarray:
    """The article's second causal method: −inf above the diagonal, then the softmax.

    ``masked_fill(triu(ones(T, T), diagonal=1), -inf)`` puts −inf where j > i; exp(−inf) = 0,
    so the future gets weight exactly 0 and no renormalisation is needed. Use a stable softmax
    (exercise 3); the diagonal stays, so no row is fully masked here (exercise 7 has those).

    Args:
      scores: ``(..., T, T)``, already scaled (exercise 2's result).

    Returns:
      ``(..., T, T)``: the same weights as exercise 5 gives for softmax(scores).
    """
    t = scores.shape[-1]
    future = jnp.triu(jnp.ones((t, t), dtype=bool), k=1)  # True where j > i
    masked = jnp.where(future, -jnp.inf, scores)
    e = jnp.exp(masked - jnp.max(masked, axis=-1, keepdims=True))  # exp(-inf) = 0
    return e / e.sum(axis=-1, keepdims=True)
