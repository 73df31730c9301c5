"""Exercise 8 (NumPy), one answer: multi-head attention with stacked weights.

Graded by ``python -m conformance exercise 8 --backend numpy --file
learn/solutions/numpy/ex08_multi_head.py`` (``tests/test_learn.py`` runs it).
"""

from __future__ import annotations

import math

import numpy as np


def multi_head_attention(
    x: np.ndarray, w_query: np.ndarray, w_key: np.ndarray, w_value: np.ndarray, num_heads: int
) -> np.ndarray:
    """The article's ``MultiHeadAttentionWrapper``, fused: one projection for all heads.

    The wrapper runs ``num_heads`` independent ``SelfAttention`` heads and concatenates their
    outputs. Stack the heads' weights side by side and one product ``x @ w_query`` projects
    every head at once: head h owns columns h·d_k … (h+1)·d_k (h·d_v … for values). Split the
    columns into heads, attend per head (scale by the head's own √d_k), and concatenate the
    heads' outputs along the last axis. (A production ``MultiHeadAttention`` adds an output
    projection; with the identity there it equals the wrapper.)

    Args:
      x: ``(..., T, d_in)``.
      w_query, w_key: ``(d_in, num_heads·d_k)``; w_value: ``(d_in, num_heads·d_v)``.
      num_heads: the number of heads.

    Returns:
      ``(..., T, num_heads·d_v)``. With the article's 4 heads (d_k 2, d_v 1) its row 0 is
      [-0.0185, 0.0170, 0.1999, -0.0860].
    """
    def heads(y):  # (..., T, H·d) → (..., H, T, d)
        y = y.reshape(y.shape[:-1] + (num_heads, y.shape[-1] // num_heads))
        return np.swapaxes(y, -2, -3)

    q, k, v = heads(x @ w_query), heads(x @ w_key), heads(x @ w_value)
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])  # the head's own d_k
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    out = e / e.sum(axis=-1, keepdims=True) @ v  # (..., H, T, d_v)
    out = np.swapaxes(out, -2, -3)  # (..., T, H, d_v)
    return out.reshape(out.shape[:-2] + (-1,))  # heads side by side
