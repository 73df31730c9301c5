"""Exercise 11 (PyTorch), one answer: the rotary position embedding (RoPE), half layout.

Graded by ``python -m conformance exercise 11 --backend torch --file
learn/solutions/torch/ex11_rope.py`` (``tests/test_learn.py`` runs it).
"""

from __future__ import annotations

import torch


def rotary_embedding(
    x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dims of x by their tokens' positions (RoPE, half layout).

    RoPE turns each query and key vector, two dims at a time, by an angle proportional to its
    token's position, so that q · k depends on the positions only through their difference.
    With ``r = rotary_dim``:

    - the frequencies: ``inv_freq[i] = theta ** (-2 i / r)`` for ``i = 0 … r/2 - 1``;
    - the angles: ``angle = positions · inv_freq[i]`` (one per token and pair);
    - the pairs (the "half" layout of transformers' ``rotate_half`` and GPT-NeoX): dim ``i``
      turns with dim ``i + r/2``: ``x1 = x[..., :r/2]``, ``x2 = x[..., r/2:r]`` and
      ``out1 = x1·cos(angle) − x2·sin(angle)``, ``out2 = x2·cos(angle) + x1·sin(angle)``;
    - the dims ``x[..., r:]`` pass through unchanged (partial rotary: GPT-NeoX, Phi).

    Meta's Llama code pairs ``(2i, 2i + 1)`` instead (the "interleaved" layout): not here.

    Args:
      x: ``(..., heads, seq, head_dim)`` queries or keys.
      positions: ``(..., seq)`` integers: each token's position in its sequence (a KV-cache
        step starts after the cached tokens). Insert the heads axis,
        ``positions[..., None, :]``, so that it broadcasts against ``x.shape[:-1]``.
      theta: the base of the frequencies (10000, Llama 3: 500000).
      rotary_dim: the rotated dims, even, ``<= head_dim``.

    Returns:
      ``x.shape``.
    """
    half = rotary_dim // 2
    exponents = torch.arange(half, dtype=torch.float32) * 2.0 / rotary_dim
    inv_freq = 1.0 / theta**exponents  # (r/2,), float32 as transformers computes it
    angles = positions[..., None, :, None].float() * inv_freq  # (..., 1, seq, r/2)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:rotary_dim]  # the pairs (i, i + r/2)
    rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    return torch.cat([*rotated, x[..., rotary_dim:]], dim=-1).to(x.dtype)
