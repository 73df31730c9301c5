"""Checking another implementation.

How any importable module is checked against this spec (``docs/checking.md``).
"""

from __future__ import annotations

PLUGIN_CONTRACT = (
    "Any importable module can be checked: python -m conformance --backend mypkg.attention. It "
    "must define scaled_dot_product_attention with the signature above; every other name of "
    "FUNCTIONS and MODULES, and PagedKVCache, is optional, and the harness runs exactly the "
    "steps the module provides and lists the rest once as not provided. It takes and returns "
    "NumPy arrays, or "
    "defines asarray(numpy_array) and to_numpy(x) for its own array type (and rng(seed) for "
    "dropout). It may declare UNSUPPORTED, a set of names of PLUGIN_FEATURES, or raise "
    "NotImplementedError: those cells are reported as unsupported, not failed. With "
    'LAYOUT = "bshd" its query, key, value (and their gradients and the output) are '
    "(..., seq, heads, head_dim); masks, bias and weights keep (..., heads, q_len, kv_len), "
    "the lse (..., heads, q_len). Attention sinks, the row log-sum-exp and merge_attention are "
    "checked like everything else: a module without them declares sinks, lse or merge; so are "
    "packed batches (varlen_attention) and chunk_size, alibi_slopes, segment_ids, score_mod "
    "and mask_mod (varlen, chunked, alibi, segments, score_mod, mask_mod). A mod reaches the "
    "module as a callable with FlexAttention's signature that works on NumPy, jax and torch "
    "arrays (conformance.cases.mods). The rotary position embedding (rotary_embedding, its VJP "
    "and rope_frequencies) is optional in the same way: a module without it lists those names "
    "as not provided, one that has some of it may declare rotary; with LAYOUT = \"bshd\", "
    "rotary_embedding's x (and grad_output) are (..., seq, heads, head_dim) too. So are "
    "multi-head latent attention (MultiHeadLatentAttention: forward naive and absorbed, "
    "decode from a latent cache, load_weights) and quantised KV caches (quantize_kv, "
    "dequantize_kv, QuantizedKVCache, and KVQuantization for the schemes, else the harness "
    "passes attention_rules.quantizing.KVQuantization): a module without them lists them as "
    "not provided, one that has them but cannot run the cases declares latent_attention or "
    "quantized_cache. quantize_kv's result is read by its attributes codes, scales and "
    "zero_points (fp8 codes as float8 arrays or their float values)."
)

#: What a checked module may declare it does not support (``UNSUPPORTED = {...}``): each name,
#: and what a case must use to need it.
PLUGIN_FEATURES = {
    "mask": "a boolean mask",
    "bias": "an additive bias",
    "causal": "is_causal=True",
    "bottom_right": 'causal_alignment="bottom_right" with is_causal or window',
    "window": "a sliding window",
    "scale": "a scale other than the default",
    "softcap": "soft-capping",
    "dropout": "dropout_p > 0 with a dropout_mask",
    "grouped_query": "fewer key/value heads than query heads (kv_heads < heads)",
    "v_dim": "a value feature size v_dim != head_dim",
    "2d_inputs": "2-D inputs (seq, head_dim) without a heads axis",
    "non_finite": "NaN or Inf inputs (NON_FINITE)",
    "return_weights": "return_weights=True",
    "sinks": "attention sinks: a sinks array (heads,) (SINKS)",
    "lse": "return_lse=True: the row log-sum-exp (LOG_SUM_EXP); merge cases need it too",
    "merge": "merge_attention of partial results over split keys (MERGING)",
    "paged": "decoding from a paged KV cache (block table, pages, per-sequence lengths)",
    "varlen": "packed variable-length batches: varlen_attention, its VJP, pack_sequences and "
              "unpack_sequences (VARLEN)",
    "chunked": "chunk_size: chunked local attention (CHUNKED)",
    "alibi": "alibi_slopes: ALiBi (ALIBI)",
    "segments": "segment_ids: packed documents (SEGMENT_IDS)",
    "score_mod": "a score_mod callable (SCORE_MOD)",
    "mask_mod": "a mask_mod callable (MASK_MOD)",
    "rotary": "the rotary position embedding: rotary_embedding, rotary_embedding_vjp and "
              "rope_frequencies (ROTARY, ROTARY_SCALING)",
    "latent_attention": "multi-head latent attention: MultiHeadLatentAttention's naive and "
                        "absorbed forward and decoding from a latent cache (LATENT_ATTENTION)",
    "quantized_cache": "quantised KV caches: quantize_kv, dequantize_kv and QuantizedKVCache "
                       "(QUANTIZATION_SCHEMES, QUANTIZED_CACHE)",
    "errors": "the bad inputs of ERRORS (exception type and message)",
    "float64": "float64 inputs",
    "float32": "float32 inputs",
    "bfloat16": "bfloat16 inputs",
    "float16": "float16 inputs",
}

#: The harness's two profiles: what ``python -m conformance`` runs when no case, dtype or
#: property-example count is named (``conformance.running.profiles``).
PROFILES = {
    "quick": "the default, a first answer in seconds: the smallest set of case x dtype rows, "
             "chosen by rule (greedy set cover), that together use every feature of "
             "PLUGIN_FEATURES any case uses (dtypes aside), both causal alignments, fully masked "
             "rows, gradients, every module class of MODULES, every compared step, every pair "
             "of order-sensitive steps of PIPELINE_WITH_MODS together in one row, and one half "
             "dtype; every row on every spec backend, plus the frameworks' own attention "
             "(torch.sdpa, jax.nn) as peers and the bad inputs of ERRORS; no property checks. "
             "A checked module that declares UNSUPPORTED features gets the same cover over the "
             "cases it can run, in dtypes it supports",
    "full": "every case in every dtype on every backend and every installed peer, the bad "
            "inputs, and 100 property-based examples per backend (for CI)",
}
