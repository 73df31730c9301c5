"""Exercise 11 (JAX): the rotary position embedding (RoPE), half layout.

Write ``rotary_embedding`` below (JAX arrays in and out; jax.numpy, not numpy),
then grade it from the repository root::

    python -m conformance exercise 11 --backend jax --file learn/jax/ex11_rope.py

(to keep this stub as it is, copy it and pass your copy to ``--file``). The grader compares
your result with a float64 reference on fixed inputs — positions 0 … 5, then a KV-cache step
at positions past 1000, then partial rotary — and names the mistake when it recognises it
(the interleaved layout, a backwards turn, positions off by one, …). One answer:
``learn/solutions/jax/ex11_rope.py``; try first. ``docs/backend_differences.md`` ("Same
weights, two RoPE layouts") and ``docs/images/rope_pairs.png`` show the two layouts.
"""

from __future__ import annotations

import jax.numpy as jnp


def rotary_embedding(
    x: jnp.ndarray, positions: jnp.ndarray, theta: float, rotary_dim: int
) -> jnp.ndarray:
    """Rotate the first ``rotary_dim`` dims of x by their tokens' positions (RoPE, half layout).

    RoPE turns each query and key vector, two dims at a time, by an angle proportional to its
    token's position, so that q · k depends on the positions only through their difference.
    With ``r = rotary_dim``:

    - the frequencies: ``inv_freq[i] = theta ** (-2 i / r)`` for ``i = 0 … r/2 - 1``;
    - the angles: ``angle = positions · inv_freq[i]`` (one per token and pair);
    - the pairs (the "half" layout of transformers' ``rotate_half`` and GPT-NeoX): dim ``i``
      turns with dim ``i + r/2``: ``x1 = x[..., :r/2]``, ``x2 = x[..., r/2:r]`` and
      ``out1 = x1·cos(angle) − x2·sin(angle)``, ``out2 = x2·cos(angle) + x1·sin(angle)``;
    - the dims ``x[..., r:]`` pass through unchanged (partial rotary: GPT-NeoX, Phi).

    Meta's Llama code pairs ``(2i, 2i + 1)`` instead (the "interleaved" layout): not here.

    Args:
      x: ``(..., heads, seq, head_dim)`` queries or keys.
      positions: ``(..., seq)`` integers: each token's position in its sequence (a KV-cache
        step starts after the cached tokens). Insert the heads axis,
        ``positions[..., None, :]``, so that it broadcasts against ``x.shape[:-1]``.
      theta: the base of the frequencies (10000, Llama 3: 500000).
      rotary_dim: the rotated dims, even, ``<= head_dim``.

    Returns:
      ``x.shape``.
    """
    raise NotImplementedError("exercise 11: write rotary_embedding")
