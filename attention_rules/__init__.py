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
* ``tiles``: the causal/window band and the tile plans of the blockwise and blocked paths;
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
    check_module_heads,
    check_query_key,
    check_rank,
    check_scale,
    check_sinks,
    check_softcap,
    check_structure,
    check_weight_shapes,
    check_weights_value,
    check_window,
    compute_dtype,
    default_scale,
    heads_of,
    scores_shape,
)
from .fast_paths import FAST_PATHS, has_empty_axis, large_enough
from .merging import MergeArguments, check_parts, merge_arguments
from .tiles import Window, band, key_range, plan, query_range

__all__ = [
    "CAUSAL_ALIGNMENTS",
    "FAST_PATHS",
    "HALF_DTYPES",
    "SUPPORTED_DTYPES",
    "Arguments",
    "ArrayInfo",
    "MergeArguments",
    "Shape",
    "Window",
    "attention_arguments",
    "band",
    "broadcast_shapes",
    "causal_offset",
    "check_alignment",
    "check_array",
    "check_backward_without_dropout",
    "check_bias_dtype",
    "check_bool",
    "check_broadcast",
    "check_cache_append",
    "check_cache_room",
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
    "check_module_heads",
    "check_parts",
    "check_query_key",
    "check_rank",
    "check_scale",
    "check_sinks",
    "check_softcap",
    "check_structure",
    "check_weight_shapes",
    "check_weights_value",
    "check_window",
    "compute_dtype",
    "default_scale",
    "has_empty_axis",
    "heads_of",
    "key_range",
    "large_enough",
    "merge_arguments",
    "plan",
    "query_range",
    "scores_shape",
]
