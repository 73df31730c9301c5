"""Exercise 6 (PyTorch), one answer: causal weights, the article's second method.

Graded by ``python -m conformance exercise 6 --backend torch --file
learn/solutions/torch/ex06_causal_mask.py`` (``tests/test_learn.py`` runs it).
"""

from __future__ import annotations

import torch


def causal_attention_weights(scores: torch.Tensor) -> torch.Tensor:
    """The article's second causal method: −inf above the diagonal, then the softmax.

    ``masked_fill(triu(ones(T, T), diagonal=1), -inf)`` puts −inf where j > i; exp(−inf) = 0,
    so the future gets weight exactly 0 and no renormalisation is needed. Use a stable softmax
    (exercise 3); the diagonal stays, so no row is fully masked here (exercise 7 has those).

    Args:
      scores: ``(..., T, T)``, already scaled (exercise 2's result).

    Returns:
      ``(..., T, T)``: the same weights as exercise 5 gives for softmax(scores).
    """
    t = scores.shape[-1]
    future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)  # True where j > i
    masked = scores.masked_fill(future, float("-inf"))
    e = torch.exp(masked - masked.amax(dim=-1, keepdim=True))  # exp(-inf) = 0
    return e / e.sum(dim=-1, keepdim=True)
