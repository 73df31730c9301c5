"""A deliberately wrong implementation of the spec, to show what the harness catches.

It is numpy_attn with two classic mistakes:

1. **mask polarity flipped**: a boolean mask's True is taken to mean "masked out" (the
   convention of ``torch.nn.MultiheadAttention``), where the spec's True means "may attend";
2. **bottom-right causal alignment ignored**: ``causal_alignment="bottom_right"`` is treated as
   top-left, which only matters when ``q_len != kv_len`` (KV-cache decoding).

Run the conformance suite against it from the repository root::

    python -m conformance --backend examples.wrong_attention

It fails exactly where ``examples/README.md`` says — the cases with a boolean mask or a
bottom-right causal rule — and the report's first line says why ("mask polarity flipped", "wrong
causal alignment"); every other cell passes (``tests/test_examples.py`` pins the set). Any
module that defines ``scaled_dot_product_attention`` (and any other of the spec's names) can be
checked the same way: ``docs/checking.md``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import numpy_attn
from numpy_attn import (  # noqa: F401 - re-exported: the parts this module gets right
    CausalSelfAttention,
    CrossAttention,
    KVCache,
    KVQuantization,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    MultiHeadLatentAttention,
    PagedKVCache,
    QuantizedKVCache,
    SelfAttention,
    apply_dropout,
    attention_output,
    attention_scores,
    attention_weights,
    causal_mask,
    combine_masks,
    dequantize_kv,
    merge_attention,
    merge_attention_vjp,
    pack_sequences,
    padding_mask,
    paged_attention,
    permute_for_rotary_layout,
    quantize_kv,
    renormalized_causal_weights,
    rope_frequencies,
    rotary_embedding,
    rotary_embedding_vjp,
    sliding_window_mask,
    unpack_sequences,
    varlen_attention,
    varlen_attention_vjp,
)


def _wrong(kwargs: dict[str, Any]) -> dict[str, Any]:
    mask = kwargs.get("mask")
    if isinstance(mask, np.ndarray) and mask.dtype == bool:
        kwargs["mask"] = ~mask  # BUG 1: True read as "masked out"
    if kwargs.get("causal_alignment") == "bottom_right":
        kwargs["causal_alignment"] = "top_left"  # BUG 2: bottom-right silently ignored
    return kwargs


def mask_scores(scores: Any, **kwargs: Any) -> np.ndarray:
    """numpy_attn.mask_scores with both bugs."""
    return numpy_attn.mask_scores(scores, **_wrong(kwargs))


def scaled_dot_product_attention(query: Any, key: Any, value: Any, **kwargs: Any) -> Any:
    """numpy_attn.scaled_dot_product_attention with both bugs."""
    return numpy_attn.scaled_dot_product_attention(query, key, value, **_wrong(kwargs))


def scaled_dot_product_attention_vjp(query: Any, key: Any, value: Any, grad_output: Any,
                                     **kwargs: Any) -> Any:
    """numpy_attn.scaled_dot_product_attention_vjp with both bugs."""
    return numpy_attn.scaled_dot_product_attention_vjp(query, key, value, grad_output,
                                                       **_wrong(kwargs))


def blockwise_attention(query: Any, key: Any, value: Any, **kwargs: Any) -> Any:
    """numpy_attn.blockwise_attention with the alignment bug (it takes no boolean mask)."""
    return numpy_attn.blockwise_attention(query, key, value, **_wrong(kwargs))


def blockwise_attention_vjp(query: Any, key: Any, value: Any, grad_output: Any,
                            **kwargs: Any) -> Any:
    """numpy_attn.blockwise_attention_vjp with the alignment bug."""
    return numpy_attn.blockwise_attention_vjp(query, key, value, grad_output, **_wrong(kwargs))
