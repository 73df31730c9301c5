"""The specification of scaled dot-product attention that every backend implements.

This package is the single source of truth of the project. It uses the standard library only, so
it can be read and imported anywhere. One file per chapter, every name re-exported here
(``spec.X``, ``from conformance.spec import X``):

* ``constants``: the semantic constants (mask polarity, causal alignments, fully-masked rows,
  precision rules), the error rules every backend must follow, and the tolerances the
  conformance harness uses, per dtype;
* ``functions``: one stub per public function, with the canonical signature and a docstring
  that gives a shape for every argument (axis names as words);
* ``masks_and_mods``: chunked local attention, ALiBi, segment ids, ``score_mod`` and
  ``mask_mod``, and the ready-made mods;
* ``varlen``: packed variable-length batches (``varlen_attention``, the converters);
* ``rotary``: the rotary position embedding (``rotary_embedding``, ``rope_frequencies``, the
  layouts of the model families, ``RoPE``);
* ``latent_attention``: multi-head latent attention (MLA), naive and absorbed, and the
  latent cache;
* ``modules``: one stub class per public module, with its constructor and methods;
* ``decoding``: the key/value cache and the modules' ``decode`` method, split-KV decoding
  and the paged cache (``paged_attention``);
* ``quantized_cache``: int8 / int4 / fp8 KV caches (``quantize_kv``, ``QuantizedKVCache``),
  their rounding and saturation rules and the residual window;
* ``concurrency``: repeatability and thread safety;
* ``context_parallel``: one sequence split across devices;
* ``extras``: the names and integrations of one backend only;
* ``checking``: what another implementation provides to be checked against this spec.

Beside them: ``known_differences`` (the frameworks' kernels' known differences, as data, each
naming the alternative semantics that explain it), ``seed_example`` (the seed article's worked
example, as data) and ``specdoc``, which renders ``docs/spec.md`` from these files (``python -m
conformance spec``); a test fails when the two disagree. ``tests/test_signatures.py`` checks
every backend's public signatures against the stubs.

Axis names used in shapes
-------------------------
``batch...``  any number (zero or more) of leading batch axes, identical for query, key and value
``heads``     query heads; absent for 2-D inputs ``(seq, head_dim)``
``kv_heads``  key/value heads; ``heads % kv_heads == 0`` (grouped-query attention)
``q_len``     query sequence length
``kv_len``    key/value sequence length
``head_dim``  query/key feature size
``v_dim``     value feature size (may differ from ``head_dim``)

Inputs are ``(..., heads, seq, head_dim)``: ``(seq, head_dim)`` (the seed article's 2-D examples),
``(heads, seq, head_dim)`` and ``(batch, heads, seq, head_dim)`` are all accepted. Query, key and
value must have the same rank and identical leading batch axes.

The pipeline, in this order
---------------------------
1. ``scores = (query @ keyᵀ) · scale`` with ``scale = head_dim ** -0.5`` by default
   (``scale=1.0`` gives the article's unnormalised ω);
2. optional soft-capping: ``scores = softcap · tanh(scores / softcap)``;
3. ``scores = scores + bias`` (an additive float array, broadcastable to the scores);
4. masking: every position that is not allowed becomes ``-inf``. A position is allowed when the
   boolean ``mask`` is True there (**True means "may attend"**), and the causal rule allows it
   (``is_causal``), and the sliding window allows it (``window``): the three combine by AND;
5. softmax over keys; a row with no allowed key (a *fully masked row*) gets weights exactly 0;
6. optional dropout of the weights, survivors scaled by ``1 / (1 - dropout_p)``;
7. ``output = weights @ value``; a fully masked row therefore gives an output row of exactly 0.

Grouped-query attention: query head ``h`` uses key/value head ``h // (heads // kv_heads)``.
"""

from __future__ import annotations

from typing import Any  # noqa: F401 - the stubs' annotation, spec.Any as before

from .checking import PLUGIN_CONTRACT, PLUGIN_FEATURES, PROFILES
from .concurrency import BLAS_LIMIT, CONCURRENCY, REPEAT_CALLS, REPEATABLE
from .constants import (
    ARRAY_INPUTS,
    BLOCKED_COMPUTATION,
    CAUSAL_ALIGNMENTS,
    COMPUTE_DTYPE,
    DEFAULT_CAUSAL_ALIGNMENT,
    DROPOUT,
    EMPTY_HEAD_DIM,
    ERRORS,
    FAST_PATH_RULES,
    FAST_PATHS,
    FLAGS,
    FULLY_MASKED_ROW,
    LOG_SUM_EXP,
    MASK_TRUE_MEANS,
    MASKED_SCORE,
    MERGING,
    NON_FINITE,
    PRECISION,
    SINKS,
    TOLERANCES,
)
from .context_parallel import (
    CONTEXT_PARALLEL_DEVICES,
    CONTEXT_PARALLEL_FUNCTIONS,
    CONTEXT_PARALLEL_LAYOUT,
    CONTEXT_PARALLEL_STRATEGIES,
    context_parallel_attention,
    context_parallel_attention_vjp,
)
from .decoding import (
    CACHE_OVERFLOW,
    CLASSES,
    DECODING,
    DECODING_MODULES,
    PAGED_CACHE,
    SPLIT_DECODING,
    SPLIT_KV,
    DecodingModule,
    KVCache,
    PagedKVCache,
    paged_attention,
)
from .extras import BACKEND_EXTRAS, BACKEND_INTEGRATIONS
from .functions import (
    FUNCTIONS,
    apply_dropout,
    attention_output,
    attention_scores,
    attention_weights,
    blockwise_attention,
    blockwise_attention_vjp,
    causal_mask,
    combine_masks,
    mask_scores,
    merge_attention,
    merge_attention_vjp,
    padding_mask,
    renormalized_causal_weights,
    scaled_dot_product_attention,
    scaled_dot_product_attention_vjp,
    sliding_window_mask,
)
from .known_differences import KNOWN_ALTERNATIVES, KNOWN_DIFFERENCES
from .latent_attention import (
    LATENT_ABSORBED,
    LATENT_ATTENTION,
    LATENT_CACHE,
    LATENT_ERRORS,
    MultiHeadLatentAttention,
)
from .masks_and_mods import (
    ALIBI,
    CHUNKED,
    MASK_MOD,
    MASKS_AND_MODS_ERRORS,
    MOD_INDICES,
    PIPELINE_WITH_MODS,
    READY_MADE_MODS,
    SCORE_MOD,
    SEGMENT_IDS,
    TILE_SKIPPING,
)
from .modules import (
    INITIALISATION,
    MODULE_METHODS,
    MODULES,
    WEIGHTS,
    CausalSelfAttention,
    CrossAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention,
)
from .quantized_cache import (
    QUANTIZATION_SCHEMES,
    QUANTIZED_CACHE,
    QUANTIZED_ERRORS,
    QUANTIZED_PEERS,
    QUANTIZED_RESIDUAL,
    QUANTIZED_ROUNDING,
    QUANTIZED_SPECIAL_VALUES,
    KVQuantization,
    QuantizedArray,
    QuantizedKVCache,
    dequantize_kv,
    quantize_kv,
)
from .rotary import (
    ROTARY,
    ROTARY_ERRORS,
    ROTARY_LAYOUTS,
    ROTARY_PERMUTATION,
    ROTARY_POSITIONS,
    ROTARY_PRECISION,
    ROTARY_SCALING,
    RoPE,
    permute_for_rotary_layout,
    rope_frequencies,
    rotary_embedding,
    rotary_embedding_vjp,
)
from .varlen import (
    VARLEN,
    VARLEN_COMPUTATION,
    VARLEN_ERRORS,
    pack_sequences,
    unpack_sequences,
    varlen_attention,
    varlen_attention_vjp,
)

#: Every name of the spec, chapter by chapter.
__all__ = [
    # constants
    "MASK_TRUE_MEANS", "CAUSAL_ALIGNMENTS", "DEFAULT_CAUSAL_ALIGNMENT", "FULLY_MASKED_ROW",
    "MASKED_SCORE", "COMPUTE_DTYPE", "PRECISION", "BLOCKED_COMPUTATION", "FAST_PATH_RULES",
    "NON_FINITE", "ARRAY_INPUTS", "FLAGS", "EMPTY_HEAD_DIM", "DROPOUT", "SINKS", "LOG_SUM_EXP",
    "MERGING", "ERRORS", "TOLERANCES", "FAST_PATHS",
    # functions
    "FUNCTIONS", "causal_mask", "sliding_window_mask", "padding_mask", "combine_masks",
    "attention_scores", "mask_scores", "attention_weights", "apply_dropout", "attention_output",
    "renormalized_causal_weights", "scaled_dot_product_attention",
    "scaled_dot_product_attention_vjp", "blockwise_attention", "blockwise_attention_vjp",
    "merge_attention", "merge_attention_vjp",
    # varlen
    "VARLEN", "VARLEN_COMPUTATION", "VARLEN_ERRORS", "varlen_attention", "varlen_attention_vjp",
    "pack_sequences", "unpack_sequences",
    # rotary
    "ROTARY", "ROTARY_LAYOUTS", "ROTARY_PERMUTATION", "ROTARY_SCALING", "ROTARY_PRECISION",
    "ROTARY_POSITIONS", "ROTARY_ERRORS", "rotary_embedding", "rotary_embedding_vjp",
    "rope_frequencies", "permute_for_rotary_layout", "RoPE",
    # latent_attention
    "LATENT_ATTENTION", "LATENT_ABSORBED", "LATENT_CACHE", "LATENT_ERRORS",
    "MultiHeadLatentAttention",
    # masks_and_mods
    "PIPELINE_WITH_MODS", "CHUNKED", "ALIBI", "SEGMENT_IDS", "SCORE_MOD", "MASK_MOD",
    "MOD_INDICES", "TILE_SKIPPING", "READY_MADE_MODS", "MASKS_AND_MODS_ERRORS",
    # modules
    "MODULES", "MODULE_METHODS", "WEIGHTS", "INITIALISATION", "SelfAttention", "CrossAttention",
    "CausalSelfAttention", "MultiHeadAttentionWrapper", "MultiHeadAttention",
    # decoding
    "CLASSES", "DECODING_MODULES", "DECODING", "CACHE_OVERFLOW", "KVCache", "DecodingModule",
    "SPLIT_KV", "SPLIT_DECODING", "PAGED_CACHE", "PagedKVCache", "paged_attention",
    # quantized_cache
    "QUANTIZATION_SCHEMES", "QUANTIZED_ROUNDING", "QUANTIZED_SPECIAL_VALUES", "QUANTIZED_CACHE",
    "QUANTIZED_RESIDUAL", "QUANTIZED_PEERS", "QUANTIZED_ERRORS", "quantize_kv", "dequantize_kv",
    "KVQuantization", "QuantizedArray", "QuantizedKVCache",
    # concurrency
    "CONCURRENCY", "BLAS_LIMIT", "REPEATABLE", "REPEAT_CALLS",
    # context_parallel
    "CONTEXT_PARALLEL_FUNCTIONS", "CONTEXT_PARALLEL_DEVICES", "CONTEXT_PARALLEL_STRATEGIES",
    "CONTEXT_PARALLEL_LAYOUT", "context_parallel_attention", "context_parallel_attention_vjp",
    # extras
    "BACKEND_EXTRAS", "BACKEND_INTEGRATIONS",
    # checking
    "PLUGIN_CONTRACT", "PLUGIN_FEATURES", "PROFILES",
    # known_differences
    "KNOWN_ALTERNATIVES", "KNOWN_DIFFERENCES",
]
