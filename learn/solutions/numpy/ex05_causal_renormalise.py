"""Exercise 5 (NumPy), one answer: causal weights, the article's first method.

Graded by ``python -m conformance exercise 5 --backend numpy --file
learn/solutions/numpy/ex05_causal_renormalise.py`` (``tests/test_learn.py`` runs it).
"""

from __future__ import annotations

import numpy as np


def causal_weights_renormalised(weights: np.ndarray) -> np.ndarray:
    """The article's first causal method: zero the weights above the diagonal, renormalise.

    Query i may attend keys j <= i only (a token sees itself and the tokens before it). The
    article multiplies the softmax weights by ``tril(ones(T, T))`` and divides each row by its
    new sum, so the rows sum to 1 again.

    Args:
      weights: ``(..., T, T)`` softmax weights (rows summing to 1).

    Returns:
      ``(..., T, T)``: exactly 0 above the diagonal, rows summing to 1. For the article's
      weights: row 1 is [0.0532, 0.9468, 0, 0, 0, 0].
    """
    t = weights.shape[-1]
    keep = np.tril(np.ones((t, t), dtype=weights.dtype))  # 1 where j <= i
    masked = weights * keep
    return masked / masked.sum(axis=-1, keepdims=True)
