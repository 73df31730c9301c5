"""Exercise 2 (PyTorch): scaled scores ω / √d_k.

Write ``scaled_scores`` below (torch tensors (float32) in, a tensor out),
then grade it from the repository root::

    python -m conformance exercise 2 --backend torch --file learn/torch/ex02_scaling.py

(to keep this stub as it is, copy it and pass your copy to ``--file``). The grader compares
your result with a float64 reference on fixed inputs — the article's numbers where it prints
them, then a batch — and names the mistake when it recognises it. One answer:
``learn/solutions/torch/ex02_scaling.py``; try first.
"""

from __future__ import annotations

import torch


def scaled_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The scores the softmax sees: ω / √d_k, with d_k = ``queries.shape[-1]``.

    Why: if the entries of q and k have variance 1, q · k has variance d_k. Unscaled, large d_k
    pushes the softmax to a one-hot row whose gradient is almost 0; dividing by √d_k brings the
    variance back to 1 (the walkthrough notebook plots it for d_k = 2 and 512).

    Args:
      queries: ``(..., q_len, d_k)``.
      keys: ``(..., kv_len, d_k)``.

    Returns:
      ``(..., q_len, kv_len)``.

    The body below is exercise 1's answer: grade it as it is to see the diagnosis, then fix it.
    """
    return queries @ keys.transpose(-2, -1)  # exercise 1's answer: scale it
