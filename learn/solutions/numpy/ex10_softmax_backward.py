"""Exercise 10 (NumPy), one answer: one backward pass: the gradient through the softmax.

Graded by ``python -m conformance exercise 10 --backend numpy --file
learn/solutions/numpy/ex10_softmax_backward.py`` (``tests/test_learn.py`` runs it).
"""

from __future__ import annotations

import numpy as np


def softmax_backward(weights: np.ndarray, grad_weights: np.ndarray) -> np.ndarray:
    """The backward pass of the softmax: from dL/dweights to dL/dscores.

    Each weight of a row depends on every score of that row: ∂w_i/∂s_k = w_i (δ_ik − w_k), the
    Jacobian diag(w) − w wᵀ. Multiplied out, dL/ds_k = w_k (g_k − Σ_i g_i w_i) with g =
    dL/dweights: subtract the row's weighted mean of g, multiply by the weights. (Check
    your formula against a finite difference on a small example.)

    Args:
      weights: ``(..., q_len, kv_len)``, softmax rows (masked positions are exactly 0).
      grad_weights: ``(..., q_len, kv_len)``, the upstream gradient g.

    Returns:
      ``(..., q_len, kv_len)``: dL/dscores (exactly 0 where the weight is 0).
    """
    mean_g = (grad_weights * weights).sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    return weights * (grad_weights - mean_g)
