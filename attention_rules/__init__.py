"""The rules of the spec that every backend shares, written once: pure Python, standard library.

numpy_attn, jax_attn and torch_attn import this package (and never each other, nor
``conformance``). Every function here works on plain shape tuples, dtype names (``"float32"``,
``"bfloat16"``, ``"bool"``…) and Python numbers, so every backend raises the same exception
type with the same message for the same bad input, and plans the same tiles:

* ``checks``: one check per rule of ``spec.ERRORS`` (``check_float_inputs``, ``check_window``…)
  and the constants they use (``SUPPORTED_DTYPES``, ``CAUSAL_ALIGNMENTS``);
* ``arguments``: ``attention_arguments``, the single validation entry point of
  ``scaled_dot_product_attention``, its VJP and ``blockwise_attention`` (and its VJP); it
  returns the normalised values (``Arguments``);
* ``merging``: ``merge_arguments``, the entry point of ``merge_attention`` and its VJP
  (partial results over disjoint key sets, merged by their row log-sum-exp);
* ``mods``: the checks of chunked attention, ALiBi, segment ids, ``score_mod`` and
  ``mask_mod``, and the tiles the chunk rule keeps (``chunk_status``);
* ``ready_mods``: ``MaskMod``, ``ScoreMod`` and the ready-made mods (``causal_mod``,
  ``alibi_mod``…), written once; each backend's ``masks`` module passes its array functions;
* ``paging``: split-KV decoding's chunks (``SPLIT_KV``) and the rules of the paged KV cache
  (``paged_arguments``, ``check_block_table``, a full pool);
* ``tiles``: the causal/window band and the tile plans of the blockwise and blocked paths;
* ``varlen`` (imported as ``attention_rules.varlen``): the rules of packed variable-length
  batches (``varlen_attention``: offsets, pages, the groups of equal sequences);
* ``rotary`` and ``rope_scaling`` (imported by name): the rotary embedding's arguments,
  layouts and ``RoPE``; its frequencies, default and transformers' scaling methods;
* ``latent_attention`` and ``quantizing`` (imported by name): multi-head latent attention's
  sizes and checks; the quantised KV caches' schemes (``KVQuantization``) and rules;
* ``fast_paths``: ``FAST_PATHS``, the constants of each backend's fast-path selection rule
  (``conformance/spec/constants.py`` shows the same dict).

The conformance harness checks the backends' errors against the spec's text, not against this
package, so a rule written wrongly here still fails there.
"""

from __future__ import annotations

from .arguments import Arguments, attention_arguments
from .checks import (
    CAUSAL_ALIGNMENTS,
    HALF_DTYPES,
    SUPPORTED_DTYPES,
    ArrayInfo,
    Shape,
    broadcast_shapes,
    causal_offset,
    check_alignment,
    check_array,
    check_backward_without_dropout,
    check_bias_dtype,
    check_bool,
    check_broadcast,
    check_cache_append,
    check_cache_room,
    check_dropout,
    check_dropout_mask,
    check_flag,
    check_float_inputs,
    check_grad_output,
    check_heads,
    check_int,
    check_key_value,
    check_kv_lengths,
    check_lengths,
    check_lengths_1d,
    check_mask_bias,
    check_masks_broadcast,
    check_module_heads,
    check_query_key,
    check_rank,
    check_scale,
    check_score_array,
    check_sinks,
    check_softcap,
    check_structure,
    check_weight_shapes,
    check_weights_value,
    check_window,
    compute_dtype,
    default_scale,
    heads_of,
    merged_heads,
    scores_shape,
)
from .fast_paths import FAST_PATHS, has_empty_axis, large_enough
from .merging import MergeArguments, check_parts, merge_arguments
from .mods import (
    ALL,
    NONE,
    SOME,
    check_alibi_slopes,
    check_chunk_size,
    check_mod,
    check_mod_derivative,
    check_mod_result,
    check_segment_ids,
    chunk_keys,
    chunk_status,
    describe_segment_ids,
    segment_pair,
    split_segment_ids,
    structural_statuses,
)
from .paging import (
    SPLIT_KV,
    PageBook,
    PagedArguments,
    book_append,
    book_free,
    book_tables,
    check_block_table,
    check_page_pool,
    check_paged_append,
    check_pool,
    check_sequences,
    kv_chunks,
    new_book,
    page_chunk,
    paged_arguments,
    pages_needed,
    split_chunk,
)
from .tiles import Window, band, key_range, plan, query_range

__all__ = [
    "ALL",
    "NONE",
    "SOME",
    "CAUSAL_ALIGNMENTS",
    "FAST_PATHS",
    "HALF_DTYPES",
    "SPLIT_KV",
    "SUPPORTED_DTYPES",
    "Arguments",
    "ArrayInfo",
    "MergeArguments",
    "PageBook",
    "PagedArguments",
    "Shape",
    "Window",
    "attention_arguments",
    "band",
    "book_append",
    "book_free",
    "book_tables",
    "broadcast_shapes",
    "causal_offset",
    "check_alignment",
    "check_array",
    "check_alibi_slopes",
    "check_backward_without_dropout",
    "check_block_table",
    "check_bias_dtype",
    "check_bool",
    "check_broadcast",
    "check_cache_append",
    "check_cache_room",
    "check_chunk_size",
    "check_dropout",
    "check_dropout_mask",
    "check_flag",
    "check_float_inputs",
    "check_grad_output",
    "check_heads",
    "check_int",
    "check_key_value",
    "check_kv_lengths",
    "check_lengths",
    "check_lengths_1d",
    "check_mask_bias",
    "check_masks_broadcast",
    "check_mod",
    "check_mod_derivative",
    "check_mod_result",
    "check_module_heads",
    "check_page_pool",
    "check_paged_append",
    "check_parts",
    "check_pool",
    "check_query_key",
    "check_rank",
    "check_scale",
    "check_score_array",
    "check_sequences",
    "check_segment_ids",
    "check_sinks",
    "check_softcap",
    "check_structure",
    "check_weight_shapes",
    "check_weights_value",
    "check_window",
    "chunk_keys",
    "chunk_status",
    "compute_dtype",
    "default_scale",
    "describe_segment_ids",
    "has_empty_axis",
    "heads_of",
    "key_range",
    "kv_chunks",
    "large_enough",
    "merge_arguments",
    "merged_heads",
    "new_book",
    "page_chunk",
    "paged_arguments",
    "pages_needed",
    "plan",
    "query_range",
    "scores_shape",
    "segment_pair",
    "split_chunk",
    "split_segment_ids",
    "structural_statuses",
]
