"""Exercise 9 (PyTorch), one answer: grouped-query attention.

Graded by ``python -m conformance exercise 9 --backend torch --file
learn/solutions/torch/ex09_gqa.py`` (``tests/test_learn.py`` runs it).
"""

from __future__ import annotations

import math

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
    group = query.shape[-3] // key.shape[-3]  # query heads per kv head
    key = key.repeat_interleave(group, dim=-3)  # kv head g serves g·group … (g+1)·group - 1
    value = value.repeat_interleave(group, dim=-3)
    scores = query @ key.transpose(-2, -1) / math.sqrt(query.shape[-1])
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True) @ value
