"""Known differences of the frameworks' own kernels from the spec.

The frameworks' kernels (the "peers" of the conformance harness) differ from the spec where this
data says so (standard library only; ``spec`` shows it as ``spec.KNOWN_DIFFERENCES``). Each
difference is a hypothesis the harness tests, not a label: an entry names the ``alternative``
semantics that explain it (``KNOWN_ALTERNATIVES``), the harness computes that alternative's
expected value from the case's arrays in float64 and the cell is "known" only when the peer
matches it within the tolerance rule, else "unexpected". When several entries cover a cell, a
combination of them may explain it (the smallest that does is shown).

peer → list of {cases: the case names it covers (no patterns: a new case is looked at before
an entry covers it), dtypes (optional; every dtype without it), alternative, raises (for
``"raises"``: {type: the exception's type or a base class, match: a regular expression its
message matches}), short (the table's cell), differs, why}. An entry lists the cases where the
difference shows; a case that meets the spec despite the cause (``huge_logits``: one-hot weights;
``length_one``, and ``single_query_causal`` aligned top-left: one key) is not listed. Found and
checked by running ``python -m conformance`` with torch 2.13 (CPU), jax 0.10.2 (CPU), keras
3.15.1, flax 0.12.8, transformers 5.24.0, onnx 1.23.2 and onnxruntime 1.32.0. torch SDPA gives
exactly 0 on fully masked rows on CPU (as the spec), so it has no entry for them. The row
log-sum-exp: torch FlexAttention (eager, CPU) returns it in natural log (not log2), float32 for
half inputs and ``-inf`` for a fully masked row, as the spec, and differs only on a ``+inf``
score; jax.nn's ``return_residual`` is natural log too. GPT-OSS's eager attention
(``transformers.gpt_oss``) is the sinks' reference semantics and meets the spec on every case
with sinks it can express, so it has no entry. FlexAttention meets the spec on every chunked,
ALiBi, segment-id, mod and packed case it can express (no sinks), in every dtype, so those have
no entry either; the packed cases' differences are jax.nn's (``jax.nn[lengths]``: top-left,
the float32 softmax and the lse fill, verified on the padded batch,
``conformance.cases.varlen_padding``) and ONNX's float64 and bfloat16 (``onnxruntime[nonpad]``).
"""

from __future__ import annotations

KNOWN_ALTERNATIVES = {
    "top_left": "the causal rule and the window aligned top-left whatever the case asks: the "
    "float64 reference with causal_alignment='top_left'",
    "mean_of_value": "a fully masked row gets uniform weights over every key, so its output is "
    "the mean of value (masked logits get a large finite negative value, not -inf)",
    "unmasked_row": "a fully masked row gets the weights of the same row with the boolean mask "
    "left out (a constant added to every score of a row cancels in the softmax)",
    "nan_rows": "a fully masked row gives NaN weights and a NaN output row (the softmax of a row "
    "of -inf is 0/0)",
    "nan_row_zero": "a row whose every allowed score is NaN gives weights 0 and an output row of "
    "0 (a kernel that finds no finite maximum treats the row as fully masked)",
    "additive_mask": "the boolean mask is added to the scores (0 or -inf) instead of replacing "
    "them, so a NaN score at a masked position makes its row NaN (NaN + -inf is NaN)",
    "mixed_heads": "torch MultiheadAttention's identity projections are matrix products over "
    "all heads of a token (computed as exact IEEE products in float64): a NaN or Inf in one head "
    "reaches every head of its token (0·NaN = 0·inf = NaN), before and after the attention",
    "float32_softmax": "the softmax of the float64 masked scores computed in float32; compared "
    "with float32's tolerance, the results in the input dtype",
    "float32": "float64 inputs cast to float32, computed and returned in float32: the float32 "
    "cell's expected value and tolerance, float32 results",
    "float32_scale": "ONNX's Attention function body: sqrt(scale) computed in float32 (the "
    "default scale 1/sqrt(head_dim) in float32 too) and query and key each multiplied by it; "
    "compared with the input dtype's own tolerance",
    "raises": "the call raises an exception of the named type (or a subclass) whose message "
    "matches the entry's pattern",
    "lse_masking_fill": "a fully masked row's lse is the log-sum-exp of the finite fill the "
    "kernel puts in masked logits, -0.7·finfo(float32).max + log(kv_len) (about -2.4e38), not "
    "-inf",
    "float32_angles": "a rotary case's frequencies, angles, cos and sin computed in float32 "
    "(transformers' inv_freq buffer and position_ids.float()), the rotation in x's dtype: in "
    "float64, compared with float32's tolerance",
    "lse_plus_inf": "a row with a +inf score has lse +inf (the log of an infinite sum), not the "
    "NaN of the spec's IEEE rule (inf - inf once the row maximum is subtracted)",
    "lse_input_dtype": "the lse is rounded to, and returned in, the input dtype (bfloat16, "
    "float16), not kept in the compute dtype float32 (float16 rounds the fill of a fully masked "
    "row to -inf)",
}

#: Every sdpa case of the harness, by name (``conformance.cases.catalogue``).
_SDPA = (
    "self", "cross", "causal_top_left", "causal_bottom_right", "causal_top_left_q_longer",
    "causal_bottom_right_q_longer", "padding", "window", "window_causal_bottom_right", "bias",
    "mask_and_bias", "softcap", "gqa", "mqa", "v_dim", "scale", "dropout_mask",
    "fully_masked_rows", "huge_logits", "kv_lengths", "length_one", "single_query_causal",
    "two_d", "three_d_gqa_causal", "nan_query", "nan_key_masked", "inf_key", "nan_value",
    "nan_value_causal", "seed_example", "seed_example_causal",
)


def _but(*left_out: str) -> list[str]:
    """The sdpa cases but ``left_out`` (those a peer cannot express or that pass anyway)."""
    return [c for c in _SDPA if c not in left_out]


_BOTTOM_RIGHT = ["causal_bottom_right", "causal_bottom_right_q_longer", "single_query_causal"]
_EMPTY_ROWS = ["padding", "fully_masked_rows", "kv_lengths"]
_NON_FINITE = ["nan_query", "nan_key_masked", "inf_key", "nan_value", "nan_value_causal"]
_NO_WINDOW = ("window", "window_causal_bottom_right", "softcap", "dropout_mask")
_PASS_ANYWAY = ("huge_logits", "length_one")
_V_DIM = ("v_dim", "seed_example", "seed_example_causal")
_ONE_KEY = "single_query_causal"  # top-left, its one query sees one key: weight 1 in any dtype
_F64 = ["float64"]
_TOP_LEFT = {
    "alternative": "top_left", "short": "top-left",
    "differs": "top-left causal mask where the case asks bottom-right",
}
_MASKED_NAN = {
    "cases": ["nan_key_masked"], "alternative": "additive_mask", "short": "masked NaN spreads",
    "differs": "a NaN key at a masked (padded) position makes every row of its head NaN",
}
_NAN_ROW_ZERO = {
    "cases": ["nan_query"], "alternative": "nan_row_zero", "short": "NaN row → 0",
    "differs": "a query row holding a NaN gives an output row of 0, not NaN",
    "why": "it calls torch SDPA, whose CPU flash kernel treats a row without a finite maximum "
    "like a fully masked row (see torch.sdpa).",
}
_MHA_HEADS = {
    "alternative": "mixed_heads", "short": "NaN all heads",
    "differs": "a NaN or Inf in one head reaches every head of its token",
    "why": "the input and output projections are matrix products over all heads (identity "
    "weights here) and 0·NaN = 0·inf = NaN, so a non-finite query, key, value or output row in "
    "one head reaches every head of the token.",
}


def _keras(left_out: tuple[str, ...], empty_dtypes: list[str]) -> list[dict]:
    """What Keras 3 does on every backend (keras.ops.dot_product_attention); ``left_out``: the
    cases this backend raises on, ``empty_dtypes``: where fully masked rows are the mean of V."""
    return [
        {**_TOP_LEFT, "cases": _BOTTOM_RIGHT,
         "why": "is_causal of keras.ops.dot_product_attention is a tril mask aligned top-left "
         "(the torch backend passes is_causal to torch SDPA, also top-left)."},
        {"cases": _EMPTY_ROWS, "dtypes": empty_dtypes, "alternative": "mean_of_value",
         "short": "mean of V", "differs": "fully masked rows give the mean of value",
         "why": "masked logits get a large finite negative value (the NumPy and torch backends: "
         "-0.7·max of the dtype), not -inf, so a row with no allowed key gets uniform weights."},
        {"cases": _but(*_NO_WINDOW, *left_out), "dtypes": _F64, "alternative": "float32",
         "short": "float32", "differs": "float64 inputs are computed and returned in float32",
         "why": "Keras' type promotion maps float64 to floatx (float32): "
         "keras.backend.result_type('float64', 'float64') is 'float32'."},
    ]


_JAX_F32 = {
    "dtypes": _F64, "alternative": "float32_softmax", "short": "f32 softmax",
    "differs": "float64 inputs attend in float32 (errors ~1e-7, not ~1e-16)",
}
_JAX_MEAN = {
    "cases": _EMPTY_ROWS, "alternative": "mean_of_value", "short": "mean of V",
    "differs": "fully masked rows give the mean of value",
}
_LSE_PLUS_INF = {
    "cases": ["inf_key"], "alternative": "lse_plus_inf", "short": "lse +inf",
    "differs": "a row with a +inf score has lse +inf, not NaN",
}

#: The cases the padding-as-lengths peers (jax.nn[lengths], onnxruntime[nonpad]) compute: a
#: padding mask and a packed batch (unpacked into a padded one).
_LENGTHS = ["padding", "kv_lengths", "nan_key_masked", "varlen_causal_gqa"]
_KEY_PADDING = ["kv_lengths", "nan_key_masked", "varlen_causal_gqa"]

#: transformers' rotary modules in a float64 model (``transformers.rope`` columns).
_ROPE_F32 = {"dtypes": _F64, "alternative": "float32_angles", "short": "f32 angles",
             "differs": "float64: the angles, cos and sin are float32 (errors ~1e-7, growing "
             "with the position)",
             "why": "the rotary module's inv_freq buffer is float32 and forward computes "
             "inv_freq @ position_ids.float() and cos, sin under autocast disabled in float32, "
             "then casts them to x's dtype; the spec computes a float64 x in float64. In "
             "float32, bfloat16 and float16 the column meets the spec."}

KNOWN_DIFFERENCES = {
    "torch.sdpa": [
        {**_TOP_LEFT, "cases": _BOTTOM_RIGHT,
         "why": "is_causal of torch.nn.functional.scaled_dot_product_attention is top-left "
         "only (torch.nn.attention.bias.causal_lower_right is the bottom-right variant); "
         "with q_len != kv_len the masks differ."},
        {**_NAN_ROW_ZERO,
         "why": "the CPU flash kernel torch picks for these inputs treats a row without a "
         "finite maximum like a fully masked row and writes 0 (SDPBackend.MATH gives NaN); "
         "the spec's IEEE rule gives NaN."},
        {**_MASKED_NAN,
         "why": "a boolean attn_mask becomes an additive mask (0 or -inf) added to the "
         "scores, and NaN + (-inf) is NaN; the spec replaces a masked score by -inf. "
         "(is_causal masking on the CPU flash kernel does not spread it.)"},
    ],
    "torch.MHA": [
        {**_TOP_LEFT, "cases": _BOTTOM_RIGHT,
         "why": "MultiheadAttention takes an explicit attn_mask; the usual causal mask "
         "(nn.Transformer.generate_square_subsequent_mask, triu) is top-left."},
        {"cases": _EMPTY_ROWS, "alternative": "nan_rows", "short": "NaN rows",
         "differs": "fully masked rows give NaN (weights and output)",
         "why": "with need_weights=True it computes softmax(baddbmm(mask, q, kᵀ)) itself, and "
         "the softmax of a row of -inf is 0/0 = NaN; the spec gives exactly 0."},
        {**_MHA_HEADS, "cases": ["fully_masked_rows", *_NON_FINITE]},
        {**_MASKED_NAN,
         "why": "the boolean mask becomes a float mask (0 or -inf) added to the scores "
         "(baddbmm), and NaN + (-inf) is NaN."},
    ],
    "torch.MHA[sdpa]": [
        {**_TOP_LEFT, "cases": _BOTTOM_RIGHT,
         "why": "MultiheadAttention takes an explicit attn_mask; the usual causal mask "
         "(nn.Transformer.generate_square_subsequent_mask, triu) is top-left."},
        {**_MHA_HEADS, "cases": _NON_FINITE},
        {**_NAN_ROW_ZERO,
         "why": "need_weights=False runs torch SDPA, whose CPU flash kernel treats a row "
         "without a finite maximum like a fully masked row; the input projection made the "
         "query row NaN in every head, so every head of the token gives 0."},
        {**_MASKED_NAN,
         "why": "the boolean mask becomes a float mask (0 or -inf) that SDPA adds to the "
         "scores, and NaN + (-inf) is NaN."},
    ],
    "jax.nn": [
        {**_TOP_LEFT, "cases": [*_BOTTOM_RIGHT, "window_causal_bottom_right"],
         "differs": "top-left causal/window alignment where the case asks bottom-right",
         "why": "is_causal and local_window_size of jax.nn.dot_product_attention are aligned "
         "top-left; with q_len != kv_len the masks differ."},
        {**_JAX_MEAN,
         "why": "jax.nn masks with the dtype's most negative finite value, not -inf, so a "
         "row with no allowed key gets uniform weights; the spec gives exactly 0."},
        {**_JAX_F32, "cases": _but("softcap", "dropout_mask", *_V_DIM),
         "why": "jax.nn.dot_product_attention's XLA path casts the masked logits to float32 "
         "for the softmax ('always carried out in fp32'), whatever the input dtype, and its "
         "residual (return_residual=True) is the logsumexp of those float32 logits (so huge "
         "logits and one key, exact in the output, still show in the lse)."},
        {"cases": _EMPTY_ROWS, "dtypes": ["float64", "float32", "bfloat16"],
         "alternative": "lse_masking_fill", "short": "lse fill",
         "differs": "a fully masked row's lse is about -2.4e38, not -inf",
         "why": "the residual is logsumexp of the padded logits, where masked logits hold "
         "-0.7·finfo(float32).max, a finite value: a row with no key gets that plus "
         "log(kv_len) instead of -inf (float16 rounds it to -inf on its way out)."},
        {"cases": _but("softcap", "dropout_mask", *_V_DIM),
         "dtypes": ["bfloat16", "float16"], "alternative": "lse_input_dtype",
         "short": "lse in input dtype",
         "differs": "the lse comes back in the input dtype (bfloat16, float16), not float32",
         "why": "the residual is computed in float32 and cast to the key's dtype "
         "(logsumexp(...).astype(key.dtype)), so half inputs lose the float32 lse the spec "
         "keeps (and the merge of partial results needs)."},
        {**_LSE_PLUS_INF,
         "why": "logsumexp(padded_logits) of a row holding +inf is +inf; the spec's lse, "
         "computed with the row maximum subtracted (inf - inf), is NaN there."},
    ],
    "jax.nn[lengths]": [
        {**_TOP_LEFT, "cases": ["varlen_causal_gqa"],
         "differs": "a packed batch's causal rule aligned top-left in each sequence, not "
         "bottom-right",
         "why": "is_causal of jax.nn.dot_product_attention is aligned top-left of the padded "
         "block and query_seq_lengths / key_value_seq_lengths only cut its end, so a sequence "
         "with q_len != kv_len gets the top-left rule where varlen_attention (torch, "
         "flash-attn) aligns each sequence bottom-right; jax.nn has no per-sequence offset."},
        {**_JAX_MEAN, "cases": ["kv_lengths"],
         "why": "key_value_seq_lengths masks the padded keys with the same large finite "
         "negative value as a mask, so a sequence with no key gets uniform weights over the "
         "padded keys; query_seq_lengths would zero such rows, but they are not padded queries."},
        {**_JAX_F32, "cases": _LENGTHS,
         "why": "the lengths take the same XLA path as the mask: the softmax in float32."},
        {"cases": ["padding", "kv_lengths", "varlen_causal_gqa"],
         "dtypes": ["float64", "float32", "bfloat16"], "alternative": "lse_masking_fill",
         "short": "lse fill", "differs": "a row with no key has lse about -2.4e38, not -inf",
         "why": "the residual is logsumexp of the padded logits: padded query rows (whose "
         "output query_seq_lengths zeroes afterwards) and rows without a key keep the finite "
         "fill -0.7·finfo(float32).max (float16 rounds it to -inf on its way out)."},
        {"cases": _LENGTHS, "dtypes": ["bfloat16", "float16"], "alternative": "lse_input_dtype",
         "short": "lse in input dtype",
         "differs": "the lse comes back in the input dtype (bfloat16, float16), not float32",
         "why": "as jax.nn: the residual is cast to the key's dtype."},
    ],
    "torch.flex": [
        {**_LSE_PLUS_INF,
         "why": "FlexAttention's lse of a row holding a +inf score is +inf (its output row is "
         "NaN, as the spec's); the spec's lse, computed with the row maximum subtracted "
         "(inf - inf), is NaN there."},
    ],
    "keras[numpy]": [
        {"cases": ["gqa", "three_d_gqa_causal"], "alternative": "raises",
         "raises": {"type": "ValueError", "match": "could not be broadcast together"},
         "short": "GQA error",
         "differs": "grouped-query heads (1 < kv_heads < heads) raise ValueError",
         "why": "the NumPy backend's einsum broadcasts key heads against query heads, which "
         "works for one key/value head (multi-query) only; its docstring promises GQA."},
        *_keras(("gqa", "three_d_gqa_causal"), ["float64", "float32", "bfloat16", "float16"]),
    ],
    "keras[jax]": [
        {"cases": list(_V_DIM), "alternative": "raises",
         "raises": {"type": "TypeError", "match": "cannot reshape array"},
         "short": "v_dim error",
         "differs": "value head_dim != query head_dim raises TypeError (a reshape)",
         "why": "the JAX backend reshapes the output to the query's shape; Keras documents "
         "value with key's shape, while its NumPy and torch backends accept any v_dim."},
        *_keras(_V_DIM, ["float64", "float32", "bfloat16", "float16"]),
    ],
    "keras[torch]": [
        {"cases": ["mask_and_bias"], "alternative": "raises",
         "raises": {"type": "ValueError", "match": "Only one of `bias` and `mask`"},
         "short": "bias+mask error", "differs": "a bias together with a mask raises ValueError",
         "why": "the torch backend passes either one as attn_mask of torch SDPA and rejects "
         "both ('Only one of `bias` and `mask` can be provided'); the other backends add both."},
        _NAN_ROW_ZERO,
        {**_MASKED_NAN,
         "why": "the boolean mask becomes an additive mask (0 or -0.7·max of the dtype) "
         "added to the scores, and NaN + anything is NaN."},
        {"cases": _EMPTY_ROWS, "dtypes": ["float16"], "alternative": "unmasked_row",
         "short": "unmasked rows",
         "differs": "float16: a fully masked row equals the same row without the mask",
         "why": "the mask becomes a float16 fill of -0.7·65500 (-45856 in float16) that torch "
         "SDPA's CPU kernel adds to the scores in float32, where the scores keep their "
         "precision: every score of a fully masked row moves by the same constant, which the "
         "softmax cancels (in bfloat16 and float32 the fill, ~-2.4e38, swallows the scores)."},
        *_keras(("mask_and_bias",), ["float64", "float32", "bfloat16"]),
    ],
    "flax.nnx": [
        {**_TOP_LEFT, "cases": _BOTTOM_RIGHT,
         "why": "without dropout or a module to sow weights into, flax.nnx."
         "dot_product_attention calls jax.nn.dot_product_attention, whose is_causal is "
         "aligned top-left."},
        {**_JAX_MEAN,
         "why": "through jax.nn, masked logits get the dtype's most negative finite value, "
         "not -inf, so a row with no allowed key gets uniform weights; the spec gives 0."},
        {**_JAX_F32, "cases": _but(*_NO_WINDOW, "scale", *_PASS_ANYWAY, *_V_DIM, _ONE_KEY),
         "why": "through jax.nn, whose XLA path runs the softmax in float32 for every input "
         "dtype (the same errors as the jax.nn column, to the last bit)."},
    ],
    "transformers.eager": [
        {"cases": [*_EMPTY_ROWS, "causal_bottom_right_q_longer"], "dtypes": _F64,
         "alternative": "nan_rows", "short": "NaN rows",
         "differs": "float64: fully masked rows give NaN",
         "why": "the additive mask holds torch.finfo(float64).min, and the softmax runs in "
         "float32 (dtype=torch.float32), where that value is -inf: a row of -inf is 0/0."},
        {**_JAX_MEAN, "cases": [*_EMPTY_ROWS, "causal_bottom_right_q_longer"],
         "dtypes": ["float32", "bfloat16", "float16"],
         "why": "masked positions get torch.finfo(dtype).min added (masking_utils' eager "
         "mask), a finite value, so a row with no allowed key gets uniform weights."},
        {**_MASKED_NAN,
         "why": "the mask is added to the scores (attn_weights + attention_mask), and "
         "NaN + finfo.min is NaN; the spec replaces a masked score by -inf."},
        {**_JAX_F32, "cases": _but("softcap", "dropout_mask", *_PASS_ANYWAY),
         "why": "eager_attention_forward computes the softmax with dtype=torch.float32 and "
         "casts back to the query's dtype."},
    ],
    "transformers.sdpa": [
        _NAN_ROW_ZERO,
        {**_MASKED_NAN,
         "why": "torch SDPA turns the boolean attention_mask into an additive mask (0 or "
         "-inf) added to the scores, and NaN + (-inf) is NaN."},
    ],
    "transformers.rope[llama]": [
        {**_ROPE_F32, "cases": ["rotary_half", "rotary_packed_positions",
                                "rotary_large_positions", "rope_dynamic", "rope_llama3",
                                "rope_longrope"]},
    ],
    "transformers.rope[deepseek_v3]": [
        {**_ROPE_F32, "cases": ["rope_yarn_interleaved_decode", "rotary_interleaved_partial",
                                "rope_linear_interleaved"],
         "why": _ROPE_F32["why"] + " apply_rotary_pos_emb_interleave also returns the rotated "
         "dims de-interleaved (half order: q·k unchanged, the tensor not): the adapter "
         "re-interleaves them before comparing, so that is no difference of the column."},
    ],
    "transformers.rope[gpt_neox]": [
        {**_ROPE_F32, "cases": ["rotary_half", "rotary_partial_decode",
                                "rotary_packed_positions", "rotary_large_positions",
                                "rope_dynamic", "rope_llama3", "rope_longrope"]},
    ],
    "onnxruntime": [
        {"cases": ["kv_lengths", "nan_key_masked"], "dtypes": ["float32", "float16"],
         "alternative": "raises",
         "raises": {"type": "RuntimeError", "match": "inconsistent q_sequence_length"},
         "short": "mask shape error",
         "differs": "a mask broadcast over queries, (batch, 1, 1, kv_len), is rejected: "
         "'inconsistent q_sequence_length (between attn_mask and Q)'",
         "why": "the CPU Attention kernel (float32, float16) wants attn_mask's q_len axis in "
         "full; ONNX allows any mask broadcastable to (batch, heads, q_len, kv_len), and the "
         "function body that runs float64 accepts it."},
        {**_MASKED_NAN, "dtypes": _F64,
         "why": "float64 runs the ONNX function body, which turns the boolean attn_mask into "
         "a bias (0 or -inf) added to the scores, and NaN + (-inf) is NaN."},
        {"cases": _but("causal_bottom_right_q_longer", "dropout_mask", *_PASS_ANYWAY),
         "dtypes": _F64, "alternative": "float32_scale", "short": "f32 scale",
         "differs": "float64: the scale is rounded through float32 (errors ~1e-7, not ~1e-16)",
         "why": "onnxruntime has no float64 CPU Attention kernel: float64 runs the ONNX "
         "function body op by op, which computes sqrt(scale) in float32 "
         "(Cast(head_size, FLOAT), Sqrt, Div, Sqrt) before multiplying query and key by it; "
         "everything else stays float64."},
        {"cases": _but("causal_bottom_right_q_longer", "dropout_mask"),
         "dtypes": ["bfloat16"], "alternative": "raises",
         "raises": {"type": "RuntimeError",
                    "match": "Could not find an implementation for Expand"},
         "short": "no bf16 kernel",
         "differs": "bfloat16: the session cannot be built (no CPU kernel)",
         "why": "the CPU Attention kernel is registered for float32 and float16 only; "
         "bfloat16 falls back to the ONNX function body, whose Expand has no bfloat16 CPU "
         "kernel either."},
    ],
    "onnxruntime[nonpad]": [
        {"cases": _KEY_PADDING, "dtypes": _F64, "alternative": "float32_scale",
         "short": "f32 scale",
         "differs": "float64: the scale is rounded through float32 (errors ~1e-7, not ~1e-16)",
         "why": "as the onnxruntime column: float64 runs the ONNX function body (which takes "
         "nonpad_kv_seqlen too), computing sqrt(scale) in float32."},
        {**_MASKED_NAN, "dtypes": _F64,
         "why": "float64 runs the ONNX function body, which turns nonpad_kv_seqlen into a bias "
         "(0 or -inf) added to the scores, and NaN + (-inf) is NaN; the CPU kernel (float32, "
         "float16) skips the padded keys and meets the spec."},
        {"cases": _KEY_PADDING, "dtypes": ["bfloat16"], "alternative": "raises",
         "raises": {"type": "RuntimeError",
                    "match": "Could not find an implementation for Expand"},
         "short": "no bf16 kernel",
         "differs": "bfloat16: the session cannot be built (no CPU kernel)",
         "why": "as the onnxruntime column: no bfloat16 CPU Attention kernel, and the function "
         "body's Expand has none either."},
    ],
}
