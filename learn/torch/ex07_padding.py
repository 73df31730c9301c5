"""Exercise 7 (PyTorch): padding masks and fully masked rows.

Write ``padded_attention`` below (torch tensors (float32) in, a tensor out),
then grade it from the repository root::

    python -m conformance exercise 7 --backend torch --file learn/torch/ex07_padding.py

(to keep this stub as it is, copy it and pass your copy to ``--file``). The grader compares
your result with a float64 reference on fixed inputs — the article's numbers where it prints
them, then a batch — and names the mistake when it recognises it. One answer:
``learn/solutions/torch/ex07_padding.py``; try first.
"""

from __future__ import annotations

import math

import torch


def padded_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
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
    scores = query @ key.transpose(-2, -1) / math.sqrt(query.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))  # True = may attend
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True) @ value
