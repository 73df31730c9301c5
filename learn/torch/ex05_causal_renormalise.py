"""Exercise 5 (PyTorch): causal weights, the article's first method.

Write ``causal_weights_renormalised`` below (torch tensors (float32) in, a tensor out),
then grade it from the repository root::

    python -m conformance exercise 5 --backend torch --file learn/torch/ex05_causal_renormalise.py

(to keep this stub as it is, copy it and pass your copy to ``--file``). The grader compares
your result with a float64 reference on fixed inputs — the article's numbers where it prints
them, then a batch — and names the mistake when it recognises it. One answer:
``learn/solutions/torch/ex05_causal_renormalise.py``; try first.
"""

from __future__ import annotations

import torch


def causal_weights_renormalised(weights: torch.Tensor) -> torch.Tensor:
    """The article's first causal method: zero the weights above the diagonal, renormalise.

    Query i may attend keys j <= i only (a token sees itself and the tokens before it). The
    article multiplies the softmax weights by ``tril(ones(T, T))`` and divides each row by its
    new sum, so the rows sum to 1 again.

    Args:
      weights: ``(..., T, T)`` softmax weights (rows summing to 1).

    Returns:
      ``(..., T, T)``: exactly 0 above the diagonal, rows summing to 1. For the article's
      weights: row 1 is [0.0532, 0.9468, 0, 0, 0, 0].
    """
    raise NotImplementedError("exercise 5: write causal_weights_renormalised")
