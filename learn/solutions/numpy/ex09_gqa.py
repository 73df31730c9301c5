"""Exercise 9 (NumPy), one answer: grouped-query attention.

Graded by ``python -m conformance exercise 9 --backend numpy --file
learn/solutions/numpy/ex09_gqa.py`` (``tests/test_learn.py`` runs it).
"""

from __future__ import annotations

import math

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
    group = query.shape[-3] // key.shape[-3]  # query heads per kv head
    key = np.repeat(key, group, axis=-3)  # kv head g serves query heads g·group … (g+1)·group - 1
    value = np.repeat(value, group, axis=-3)
    scores = query @ np.swapaxes(key, -1, -2) / math.sqrt(query.shape[-1])
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True) @ value
