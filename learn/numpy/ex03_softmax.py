"""Exercise 3 (NumPy): a softmax that does not overflow.

Write ``softmax`` below (NumPy arrays (float32) in, a NumPy array out),
then grade it from the repository root::

    python -m conformance exercise 3 --backend numpy --file learn/numpy/ex03_softmax.py

(to keep this stub as it is, copy it and pass your copy to ``--file``). The grader compares
your result with a float64 reference on fixed inputs — the article's numbers where it prints
them, then a batch — and names the mistake when it recognises it. One answer:
``learn/solutions/numpy/ex03_softmax.py``; try first.
"""

from __future__ import annotations

import numpy as np


def softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis: every row becomes weights ≥ 0 that sum to 1.

    softmax(s)[i, j] = exp(s[i, j]) / Σ_k exp(s[i, k]). Written like that it overflows:
    float32's exp is inf above 88.7 (and 0 below −103.9), and inf / inf is NaN. Softmax does
    not change when a constant is subtracted from a row, so subtract each row's maximum first:
    the largest exponent is then exp(0) = 1. Do not call the framework's softmax.

    Args:
      scores: ``(..., q_len, kv_len)``, finite.

    Returns:
      ``(..., q_len, kv_len)``, each row summing to 1.

    The body below is the formula as written: it passes the article's scores and fails on
    scores near ±1000. Grade it, read the diagnosis, fix it.
    """
    e = np.exp(scores)  # overflows for large scores
    return e / e.sum(axis=-1, keepdims=True)
