"""Exercise 4 (PyTorch), one answer: context vectors.

Graded by ``python -m conformance exercise 4 --backend torch --file
learn/solutions/torch/ex04_context.py`` (``tests/test_learn.py`` runs it).
"""

from __future__ import annotations

import torch


def context_vectors(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
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
    return weights @ values  # (..., q_len, d_v)
