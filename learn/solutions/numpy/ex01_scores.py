"""Exercise 1 (NumPy), one answer: unnormalised attention scores ω.

Graded by ``python -m conformance exercise 1 --backend numpy --file
learn/solutions/numpy/ex01_scores.py`` (``tests/test_learn.py`` runs it).
"""

from __future__ import annotations

import numpy as np


def attention_scores(queries: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """How much each query "likes" each key: ω[i, j] = queries[i] · keys[j].

    The article does it for one query (``omega_3 = query_3 @ keys.T``), then for all of them
    (``attn_scores = queries @ keys.T``): one matrix product. Do not scale yet (exercise 2).

    Args:
      queries: ``(..., q_len, d_k)``.
      keys: ``(..., kv_len, d_k)``.

    Returns:
      ``(..., q_len, kv_len)``: ω, unscaled.

    The grader checks the article's 6 tokens (it prints this 6 × 6 matrix; row 0 starts
    0.0613, -0.3491), then a batch of 2 sequences × 3 heads. Careful: ``.T`` reverses *every*
    axis of a batched array; swap only the last two (np.swapaxes(keys, -1, -2)).
    """
    return queries @ np.swapaxes(keys, -1, -2)  # (..., q_len, kv_len)
