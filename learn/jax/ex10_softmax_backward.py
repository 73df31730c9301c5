"""Exercise 10 (JAX): one backward pass: the gradient through the softmax.

Write ``softmax_backward`` below (JAX arrays in and out; jax.numpy, not numpy),
then grade it from the repository root::

    python -m conformance exercise 10 --backend jax --file learn/jax/ex10_softmax_backward.py

(to keep this stub as it is, copy it and pass your copy to ``--file``). The grader compares
your result with a float64 reference on fixed inputs — the article's numbers where it prints
them, then a batch — and names the mistake when it recognises it. One answer:
``learn/solutions/jax/ex10_softmax_backward.py``; try first.
"""

from __future__ import annotations

import jax.numpy as jnp


def softmax_backward(weights: jnp.ndarray, grad_weights: jnp.ndarray) -> jnp.ndarray:
    """The backward pass of the softmax: from dL/dweights to dL/dscores.

    Each weight of a row depends on every score of that row: ∂w_i/∂s_k = w_i (δ_ik − w_k), the
    Jacobian diag(w) − w wᵀ. Multiplied out, dL/ds_k = w_k (g_k − Σ_i g_i w_i) with g =
    dL/dweights: subtract the row's weighted mean of g, multiply by the weights. (Check
    your formula against jax.vjp(jax.nn.softmax, scores) on a small example.)

    Args:
      weights: ``(..., q_len, kv_len)``, softmax rows (masked positions are exactly 0).
      grad_weights: ``(..., q_len, kv_len)``, the upstream gradient g.

    Returns:
      ``(..., q_len, kv_len)``: dL/dscores (exactly 0 where the weight is 0).
    """
    raise NotImplementedError("exercise 10: write softmax_backward")
