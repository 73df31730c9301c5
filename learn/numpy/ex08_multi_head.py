"""Exercise 8 (NumPy): multi-head attention with stacked weights.

Write ``multi_head_attention`` below (NumPy arrays (float32) in, a NumPy array out),
then grade it from the repository root::

    python -m conformance exercise 8 --backend numpy --file learn/numpy/ex08_multi_head.py

(to keep this stub as it is, copy it and pass your copy to ``--file``). The grader compares
your result with a float64 reference on fixed inputs — the article's numbers where it prints
them, then a batch — and names the mistake when it recognises it. One answer:
``learn/solutions/numpy/ex08_multi_head.py``; try first.
"""

from __future__ import annotations

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
    raise NotImplementedError("exercise 8: write multi_head_attention")
