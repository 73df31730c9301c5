"""Exercise 12 (NumPy), one answer: absorb the weights (MLA's decoding form).

Graded by ``python -m conformance exercise 12 --backend numpy --file
learn/solutions/numpy/ex12_absorb.py`` (``tests/test_learn.py`` runs it).
"""

from __future__ import annotations

import math

import numpy as np


def absorbed_attention(
    q_nope: np.ndarray, q_pe: np.ndarray, latent: np.ndarray, k_pe: np.ndarray,
    w_uk: np.ndarray, w_uv: np.ndarray
) -> np.ndarray:
    """Attend the latent cache in MLA's absorbed form (DeepSeek-V2/V3 decoding).

    Multi-head latent attention caches one latent ``c`` per token (``kv_lora_rank`` numbers)
    and one rotary key ``k_pe`` shared by every head. Head h's keys and values are
    up-projections of the latent, ``k_nope = c @ w_uk[h]`` and ``v = c @ w_uv[h]``; the
    naive form materialises them, ``softmax([q_nope ; q_pe] @ [k_nope ; k_pe]ᵀ · scale) @ v``.
    Decoding never does: since ``q_nope · (c @ W_UK) = (q_nope @ W_UKᵀ) · c``,

    - fold W_UK into the query: ``q_latent = q_nope @ w_uk[h]ᵀ`` (``kv_lora_rank`` dims);
    - the scores: ``(q_latent · c + q_pe · k_pe) · scale`` with the naive scale
      ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` (absorbing the weights changes where
      the products are summed, not the scores), then the softmax over the cached tokens;
    - attend the latent itself: ``weights @ c`` (``kv_lora_rank`` dims per head);
    - apply W_UV once, after the weighted sum: ``(weights @ c) @ w_uv[h]``.

    No mask: every query attends every cached token. ``q_pe`` and ``k_pe`` come already
    rotated. (transformers' ``kv_b_proj.weight`` is ``(H·(d_n + d_v), r)``; head h's rows
    are ``[w_uk[h]ᵀ ; w_uv[h]ᵀ]``.)

    Args:
      q_nope: ``(..., heads, q_len, qk_nope_head_dim)``.
      q_pe: ``(..., heads, q_len, qk_rope_head_dim)``.
      latent: ``(..., kv_len, kv_lora_rank)``: no heads axis (one latent serves every head).
      k_pe: ``(..., kv_len, qk_rope_head_dim)``: no heads axis either.
      w_uk: ``(heads, kv_lora_rank, qk_nope_head_dim)``: head h's keys are ``c @ w_uk[h]``.
      w_uv: ``(heads, kv_lora_rank, v_head_dim)``: head h's values are ``c @ w_uv[h]``.

    Returns:
      ``(..., heads, q_len, v_head_dim)``.
    """
    q_latent = q_nope @ w_uk.mT  # (..., heads, q_len, r): W_UK folded into the query
    c = latent[..., None, :, :]  # (..., 1, kv_len, r): one latent for every head
    k_rope = k_pe[..., None, :, :]  # (..., 1, kv_len, d_r)
    scale = 1.0 / math.sqrt(q_nope.shape[-1] + q_pe.shape[-1])  # the naive head's width
    scores = (q_latent @ c.mT + q_pe @ k_rope.mT) * scale  # (..., heads, q_len, kv_len)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = e / e.sum(axis=-1, keepdims=True)
    context_latent = weights @ c  # (..., heads, q_len, r): values never materialised
    return context_latent @ w_uv  # W_UV once, after the weighted sum
