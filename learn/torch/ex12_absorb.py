"""Exercise 12 (PyTorch): absorb the weights (MLA's decoding form).

Write ``absorbed_attention`` below (torch tensors (float32) in, a tensor out),
then grade it from the repository root::

    python -m conformance exercise 12 --backend torch --file learn/torch/ex12_absorb.py

(to keep this stub as it is, copy it and pass your copy to ``--file``). The grader compares
your result with the naive form in float64 (K and V materialised per head) on fixed inputs —
a square toy, then one decoded token in DeepSeek's proportions, then two batch axes — and
names the mistake when it recognises it (W_UK not folded or transposed, W_UV forgotten, the
latent's width as the scale, one head's weights for all, …). One answer:
``learn/solutions/torch/ex12_absorb.py``; try first. ``conformance/spec/latent_attention.py``
(``LATENT_ABSORBED``) states the form, ``docs/paged_decoding.md`` ("The cache per token")
shows what it saves.
"""

from __future__ import annotations

import torch


def absorbed_attention(
    q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
    w_uk: torch.Tensor, w_uv: torch.Tensor
) -> torch.Tensor:
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
    raise NotImplementedError("exercise 12: write absorbed_attention")
