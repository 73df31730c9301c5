"""Exercise 7 (NumPy): padding masks and fully masked rows.

Write ``padded_attention`` below (NumPy arrays (float32) in, a NumPy array out),
then grade it from the repository root::

    python -m conformance exercise 7 --backend numpy --file learn/numpy/ex07_padding.py

(to keep this stub as it is, copy it and pass your copy to ``--file``). The grader compares
your result with a float64 reference on fixed inputs — the article's numbers where it prints
them, then a batch — and names the mistake when it recognises it. One answer:
``learn/solutions/numpy/ex07_padding.py``; try first.
"""

from __future__ import annotations

import math

import numpy as np


def padded_attention(
    query: np.ndarray, key: np.ndarray, value: np.ndarray, mask: np.ndarray
) -> np.ndarray:
    """Attention with a boolean mask: ``softmax(where(mask, q @ kᵀ / √d, −inf)) @ v``.

    ``mask`` is True where the query may attend the key (as in torch SDPA and jax.nn; the
    opposite of ``torch.nn.MultiheadAttention``'s masks). Padding makes whole rows False: a
    padded query may attend nothing. The spec's answer for such a row is weights 0 and output
    exactly 0 — never NaN, never the mean of the values.

    Args:
      query: ``(..., q_len, d)``; key: ``(..., kv_len, d)``; value: ``(..., kv_len, d_v)``.
      mask: bool, broadcastable to ``(..., q_len, kv_len)``.

    Returns:
      ``(..., q_len, d_v)``.

    The body below works until a row is fully masked. Grade it, read the diagnosis, fix it.
    """
    scores = query @ np.swapaxes(key, -1, -2) / math.sqrt(query.shape[-1])
    scores = np.where(mask, scores, -np.inf)  # True = may attend
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True) @ value
