"""Exercise 6 (NumPy): causal weights, the article's second method.

Write ``causal_attention_weights`` below (NumPy arrays (float32) in, a NumPy array out),
then grade it from the repository root::

    python -m conformance exercise 6 --backend numpy --file learn/numpy/ex06_causal_mask.py

(to keep this stub as it is, copy it and pass your copy to ``--file``). The grader compares
your result with a float64 reference on fixed inputs — the article's numbers where it prints
them, then a batch — and names the mistake when it recognises it. One answer:
``learn/solutions/numpy/ex06_causal_mask.py``; try first.
"""

from __future__ import annotations

import numpy as np


def causal_attention_weights(scores: np.ndarray) -> np.ndarray:
    """The article's second causal method: −inf above the diagonal, then the softmax.

    ``masked_fill(triu(ones(T, T), diagonal=1), -inf)`` puts −inf where j > i; exp(−inf) = 0,
    so the future gets weight exactly 0 and no renormalisation is needed. Use a stable softmax
    (exercise 3); the diagonal stays, so no row is fully masked here (exercise 7 has those).

    Args:
      scores: ``(..., T, T)``, already scaled (exercise 2's result).

    Returns:
      ``(..., T, T)``: the same weights as exercise 5 gives for softmax(scores).
    """
    raise NotImplementedError("exercise 6: write causal_attention_weights")
