"""Scaled dot-product attention in pure NumPy: the readable reference of the project's spec.

Layout ``(..., heads, seq, head_dim)``; boolean masks mean True = may attend; fully masked rows
give exactly 0. See ``conformance/spec.py`` for the full specification.
"""

from .backward import Adam, scaled_dot_product_attention_vjp, sgd_step
from .functional import (
    apply_dropout,
    attention_output,
    attention_scores,
    attention_weights,
    mask_scores,
    renormalized_causal_weights,
    scaled_dot_product_attention,
)
from .masks import causal_mask, combine_masks, padding_mask, sliding_window_mask
from .modules import (
    CausalSelfAttention,
    CrossAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention,
)

__all__ = [
    "Adam",
    "CausalSelfAttention",
    "CrossAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "SelfAttention",
    "apply_dropout",
    "attention_output",
    "attention_scores",
    "attention_weights",
    "causal_mask",
    "combine_masks",
    "mask_scores",
    "padding_mask",
    "renormalized_causal_weights",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_vjp",
    "sgd_step",
    "sliding_window_mask",
]
