"""Scaled dot-product attention in PyTorch, from the project's spec.

Layout ``(..., heads, seq, head_dim)``; boolean masks mean True = may attend; fully masked rows
give exactly 0 (output and gradient). Functions keep their inputs' device and dtype, support
autograd and ``torch.compile``, and use ``torch.nn.functional.scaled_dot_product_attention``
when it follows the spec. Modules are ``torch.nn.Module``s. See ``conformance/spec/`` for the
full specification.
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
from .interop import weights_from_torch_multihead
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
    "weights_from_torch_multihead",
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
