"""Scaled dot-product attention in JAX: jit-, vmap- and grad-friendly, from the project's spec.

Layout ``(..., heads, seq, head_dim)``; boolean masks mean True = may attend; fully masked rows
give exactly 0 (and a zero gradient). See ``conformance/spec/`` for the full specification.

float16, bfloat16 and float32 work out of the box; float64 needs
``jax.config.update("jax_enable_x64", True)`` before the arrays are created (otherwise JAX turns
float64 inputs into float32). Dropout and module initialisation take explicit ``jax.random`` keys
(``rng=``). Matmuls use ``Precision.HIGHEST`` (see ``jax_attn.functional``).
"""

from .backward import merge_attention_vjp, scaled_dot_product_attention_vjp
from .blockwise import blockwise_attention, blockwise_attention_vjp
from .context_parallel import context_parallel_attention, context_parallel_attention_vjp
from .functional import (
    apply_dropout,
    attention_output,
    attention_scores,
    attention_weights,
    mask_scores,
    merge_attention,
    renormalized_causal_weights,
    scaled_dot_product_attention,
)
from .kv_cache import KVCache
from .latent_attention import MultiHeadLatentAttention
from .masks import causal_mask, combine_masks, padding_mask, sliding_window_mask
from .modules import (
    CausalSelfAttention,
    CrossAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention,
)
from .paged import PagedKVCache, paged_attention
from .quantized_cache import (
    KVQuantization,
    QuantizedArray,
    QuantizedKVCache,
    dequantize_kv,
    quantize_kv,
)
from .rotary import (
    RoPE,
    permute_for_rotary_layout,
    rope_frequencies,
    rotary_embedding,
    rotary_embedding_vjp,
)
from .varlen import (
    pack_sequences,
    unpack_sequences,
    varlen_attention,
    varlen_attention_vjp,
)

__all__ = [
    "CausalSelfAttention",
    "CrossAttention",
    "KVCache",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "MultiHeadAttentionWrapper",
    "PagedKVCache",
    "SelfAttention",
    "apply_dropout",
    "attention_output",
    "attention_scores",
    "attention_weights",
    "blockwise_attention",
    "blockwise_attention_vjp",
    "context_parallel_attention",
    "context_parallel_attention_vjp",
    "causal_mask",
    "combine_masks",
    "mask_scores",
    "merge_attention",
    "merge_attention_vjp",
    "pack_sequences",
    "padding_mask",
    "paged_attention",
    "renormalized_causal_weights",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_vjp",
    "sliding_window_mask",
    "unpack_sequences",
    "varlen_attention",
    "varlen_attention_vjp",
    "RoPE",
    "permute_for_rotary_layout",
    "rope_frequencies",
    "rotary_embedding",
    "rotary_embedding_vjp",
    "KVQuantization",
    "QuantizedArray",
    "QuantizedKVCache",
    "dequantize_kv",
    "quantize_kv",
]
