"""Exercise 4 (NumPy): context vectors.

Write ``context_vectors`` below (NumPy arrays (float32) in, a NumPy array out),
then grade it from the repository root::

    python -m conformance exercise 4 --backend numpy --file learn/numpy/ex04_context.py

(to keep this stub as it is, copy it and pass your copy to ``--file``). The grader compares
your result with a float64 reference on fixed inputs — the article's numbers where it prints
them, then a batch — and names the mistake when it recognises it. One answer:
``learn/solutions/numpy/ex04_context.py``; try first.
"""

from __future__ import annotations

import numpy as np


def context_vectors(weights: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The context vector of each query: the values, mixed by that query's weights.

    context[i] = Σ_j weights[i, j] · values[j] — the article's ``attn_weights @ values``. Its
    rows are the article's ``SelfAttention`` output (row 2: -0.3542, -0.1234, -0.2627, -0.3706).

    Args:
      weights: ``(..., q_len, kv_len)``, rows summing to 1.
      values: ``(..., kv_len, d_v)``.

    Returns:
      ``(..., q_len, d_v)``.

    The checks include the article's cross-attention, where q_len (6) differs from kv_len (8).
    """
    raise NotImplementedError("exercise 4: write context_vectors")
