"""Exercise 9 (PyTorch): grouped-query attention.

Write ``grouped_query_attention`` below (torch tensors (float32) in, a tensor out),
then grade it from the repository root::

    python -m conformance exercise 9 --backend torch --file learn/torch/ex09_gqa.py

(to keep this stub as it is, copy it and pass your copy to ``--file``). The grader compares
your result with a float64 reference on fixed inputs — the article's numbers where it prints
them, then a batch — and names the mistake when it recognises it. One answer:
``learn/solutions/torch/ex09_gqa.py``; try first.
"""

from __future__ import annotations

import torch


def grouped_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> torch.Tensor:
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
