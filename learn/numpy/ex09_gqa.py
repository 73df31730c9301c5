"""Exercise 9 (NumPy): grouped-query attention.

Write ``grouped_query_attention`` below (NumPy arrays (float32) in, a NumPy array out),
then grade it from the repository root::

    python -m conformance exercise 9 --backend numpy --file learn/numpy/ex09_gqa.py

(to keep this stub as it is, copy it and pass your copy to ``--file``). The grader compares
your result with a float64 reference on fixed inputs — the article's numbers where it prints
them, then a batch — and names the mistake when it recognises it. One answer:
``learn/solutions/numpy/ex09_gqa.py``; try first.
"""

from __future__ import annotations

import numpy as np


def grouped_query_attention(query: np.ndarray, key: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Grouped-query attention: fewer key/value heads than query heads (Llama 2 70B, Mistral).

    With ``heads`` query heads and ``kv_heads`` key/value heads (``heads`` a multiple of it),
    query head h uses key/value head ``h // (heads // kv_heads)``: consecutive query heads share
    one. Then ordinary attention per head: softmax(q @ kᵀ / √d) @ v, no mask.

    Args:
      query: ``(..., heads, q_len, d)``.
      key: ``(..., kv_heads, kv_len, d)``; value: ``(..., kv_heads, kv_len, d_v)``.

    Returns:
      ``(..., heads, q_len, d_v)``.
    """
    raise NotImplementedError("exercise 9: write grouped_query_attention")
