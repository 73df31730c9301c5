"""Exercise 2 (JAX), one answer: scaled scores ω / √d_k.

Graded by ``python -m conformance exercise 2 --backend jax --file
learn/solutions/jax/ex02_scaling.py`` (``tests/test_learn.py`` runs it).
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def scaled_scores(queries: jnp.ndarray, keys: jnp.ndarray) -> jnp.ndarray:
    """The scores the softmax sees: ω / √d_k, with d_k = ``queries.shape[-1]``.

    Why: if the entries of q and k have variance 1, q · k has variance d_k. Unscaled, large d_k
    pushes the softmax to a one-hot row whose gradient is almost 0; dividing by √d_k brings the
    variance back to 1 (the walkthrough notebook plots it for d_k = 2 and 512).

    Args:
      queries: ``(..., q_len, d_k)``.
      keys: ``(..., kv_len, d_k)``.

    Returns:
      ``(..., q_len, kv_len)``.

    The body below is exercise 1's answer: grade it as it is to see the diagnosis, then fix it.
    """
    return queries @ jnp.swapaxes(keys, -1, -2) / math.sqrt(queries.shape[-1])
