"""Known differences of the frameworks' own kernels from the spec.

The frameworks' kernels (the "peers" of the conformance harness) differ from the spec where this
data says so (standard library only; ``spec`` shows it as ``spec.KNOWN_DIFFERENCES``).

peer → list of {cases: glob patterns of case names, dtypes (optional), short (the table's cell),
differs, why}; the first entry that matches a failing cell explains it. Found by running
``python -m conformance`` with torch 2.13 (CPU) and jax 0.10.2 (CPU), keras 3.15, flax 0.12.8,
transformers 5.24 and onnxruntime 1.32. torch SDPA gives exactly 0 on fully masked rows on CPU
(as the spec), so it has no entry for them.
"""

from __future__ import annotations

_BOTTOM_RIGHT = [
    "causal_bottom_right", "causal_bottom_right_q_longer", "window_causal_bottom_right",
    "single_query_causal",
]
_EMPTY_ROWS = ["fully_masked_rows", "padding", "kv_lengths"]
_NON_FINITE = ["nan_*", "inf_key"]
# Keras 3 on every backend (keras.ops.dot_product_attention).
_KERAS = [
    {
        "cases": _BOTTOM_RIGHT,
        "short": "top-left",
        "differs": "top-left causal mask where the case asks bottom-right",
        "why": "is_causal of keras.ops.dot_product_attention is a tril mask aligned top-left "
        "(the torch backend passes is_causal to torch SDPA, also top-left).",
    },
    {
        "cases": _EMPTY_ROWS,
        "short": "mean of V",
        "differs": "fully masked rows give the mean of value",
        "why": "masked logits get a large finite negative value (the NumPy and torch backends: "
        "-0.7·max of the dtype), not -inf, so a row with no allowed key gets uniform weights.",
    },
    {
        "cases": ["*"],
        "dtypes": ["float64"],
        "short": "float32",
        "differs": "float64 inputs are computed and returned in float32",
        "why": "Keras' type promotion maps float64 to floatx (float32): "
        "keras.backend.result_type('float64', 'float64') is 'float32'.",
    },
]

KNOWN_DIFFERENCES = {
    "torch.sdpa": [
        {
            "cases": _BOTTOM_RIGHT,
            "short": "top-left",
            "differs": "top-left causal mask where the case asks bottom-right",
            "why": "is_causal of torch.nn.functional.scaled_dot_product_attention is top-left "
            "only (torch.nn.attention.bias.causal_lower_right is the bottom-right variant); "
            "with q_len != kv_len the masks differ.",
        },
        {
            "cases": ["nan_query"],
            "short": "NaN row → 0",
            "differs": "a query row holding a NaN gives an output row of 0, not NaN",
            "why": "the CPU flash kernel torch picks for these inputs treats a row without a "
            "finite maximum like a fully masked row and writes 0 (SDPBackend.MATH gives NaN); "
            "the spec's IEEE rule gives NaN.",
        },
        {
            "cases": ["nan_key_masked"],
            "short": "masked NaN spreads",
            "differs": "a NaN key at a masked (padded) position makes every row of its head NaN",
            "why": "a boolean attn_mask becomes an additive mask (0 or -inf) added to the "
            "scores, and NaN + (-inf) is NaN; the spec replaces a masked score by -inf. "
            "(is_causal masking on the CPU flash kernel does not spread it.)",
        },
    ],
    "torch.MHA": [
        {
            "cases": _BOTTOM_RIGHT,
            "short": "top-left",
            "differs": "top-left causal mask where the case asks bottom-right",
            "why": "MultiheadAttention takes an explicit attn_mask; the usual causal mask "
            "(nn.Transformer.generate_square_subsequent_mask, triu) is top-left.",
        },
        {
            "cases": _EMPTY_ROWS,
            "short": "NaN rows",
            "differs": "NaN on fully masked rows, spreading to every head of that query",
            "why": "the softmax of a row of -inf is 0/0 = NaN, and the output projection mixes "
            "heads, so NaN reaches every head of the query (9 empty rows gave 24 NaN rows in "
            "fully_masked_rows); the spec gives exactly 0.",
        },
        {
            "cases": _NON_FINITE,
            "short": "NaN all heads",
            "differs": "a NaN or Inf in one head reaches every head of its token",
            "why": "the input and output projections are matrix products over all heads "
            "(identity weights here) and 0·NaN = 0·inf = NaN, so a non-finite query, key or value "
            "in one head reaches every head of the token; masks are added as -inf, so a masked "
            "NaN key spreads too.",
        },
    ],
    "jax.nn": [
        {
            "cases": _BOTTOM_RIGHT,
            "short": "top-left",
            "differs": "top-left causal/window alignment where the case asks bottom-right",
            "why": "is_causal and local_window_size of jax.nn.dot_product_attention are aligned "
            "top-left; with q_len != kv_len the masks differ.",
        },
        {
            "cases": _EMPTY_ROWS,
            "short": "mean of V",
            "differs": "fully masked rows give the mean of value",
            "why": "jax.nn masks with the dtype's most negative finite value, not -inf, so a "
            "row with no allowed key gets uniform weights; the spec gives exactly 0.",
        },
        {
            "cases": ["*"],
            "dtypes": ["float64"],
            "short": "f32 softmax",
            "differs": "float64 inputs attend in float32 (errors ~1.4e-7, not ~1e-16)",
            "why": "jax.nn.dot_product_attention's XLA path casts the masked logits to float32 "
            "for the softmax ('always carried out in fp32'), whatever the input dtype.",
        },
    ],
    "keras[numpy]": [
        {
            "cases": ["gqa", "three_d_gqa_causal"],
            "short": "GQA error",
            "differs": "grouped-query heads (1 < kv_heads < heads) raise ValueError",
            "why": "the NumPy backend's einsum broadcasts key heads against query heads, which "
            "works for one key/value head (multi-query) only; its docstring promises GQA.",
        },
        *_KERAS,
    ],
    "keras[jax]": [
        {
            "cases": ["v_dim", "seed_example", "seed_example_causal"],
            "short": "v_dim error",
            "differs": "value head_dim != query head_dim raises TypeError (a reshape)",
            "why": "the JAX backend reshapes the output to the query's shape; Keras documents "
            "value with key's shape, while its NumPy and torch backends accept any v_dim.",
        },
        *_KERAS,
    ],
    "keras[torch]": [
        {
            "cases": ["mask_and_bias"],
            "short": "bias+mask error",
            "differs": "a bias together with a mask raises ValueError",
            "why": "the torch backend passes either one as attn_mask of torch SDPA and rejects "
            "both ('Only one of `bias` and `mask` can be provided'); the other backends add both.",
        },
        {
            "cases": ["nan_query"],
            "short": "NaN row → 0",
            "differs": "a query row holding a NaN gives an output row of 0, not NaN",
            "why": "it calls torch SDPA, whose CPU flash kernel treats a row without a finite "
            "maximum like a fully masked row (see torch.sdpa).",
        },
        {
            "cases": ["nan_key_masked"],
            "short": "masked NaN spreads",
            "differs": "a NaN key at a masked (padded) position makes every row of its head NaN",
            "why": "the boolean mask becomes an additive mask (0 or -0.7·max of the dtype) "
            "added to the scores, and NaN + anything is NaN.",
        },
        {
            "cases": _EMPTY_ROWS,
            "dtypes": ["float16"],
            "short": "rounded rows",
            "differs": "float16: fully masked rows give neither 0 nor the mean of value",
            "why": "masked scores get -0.7·65500 = -45850 added, where float16's spacing is 32, "
            "so a row with no allowed key is a softmax of rounded scores; the spec gives 0.",
        },
        *_KERAS,
    ],
    "flax.nnx": [
        {
            "cases": _BOTTOM_RIGHT,
            "short": "top-left",
            "differs": "top-left causal mask where the case asks bottom-right",
            "why": "without dropout or a module to sow weights into, flax.nnx."
            "dot_product_attention calls jax.nn.dot_product_attention, whose is_causal is "
            "aligned top-left.",
        },
        {
            "cases": _EMPTY_ROWS,
            "short": "mean of V",
            "differs": "fully masked rows give the mean of value",
            "why": "through jax.nn, masked logits get the dtype's most negative finite value, "
            "not -inf, so a row with no allowed key gets uniform weights; the spec gives 0.",
        },
        {
            "cases": ["*"],
            "dtypes": ["float64"],
            "short": "f32 softmax",
            "differs": "float64 inputs attend in float32 (errors ~1.4e-7, not ~1e-16)",
            "why": "through jax.nn, whose XLA path runs the softmax in float32 for every input "
            "dtype (the same errors as the jax.nn column, to the last bit).",
        },
    ],
    "transformers.eager": [
        {
            "cases": [*_EMPTY_ROWS, "causal_bottom_right_q_longer"],
            "dtypes": ["float64"],
            "short": "NaN rows",
            "differs": "float64: fully masked rows give NaN",
            "why": "the additive mask holds torch.finfo(float64).min, and the softmax runs in "
            "float32 (dtype=torch.float32), where that value is -inf: a row of -inf is 0/0.",
        },
        {
            "cases": [*_EMPTY_ROWS, "causal_bottom_right_q_longer"],
            "short": "mean of V",
            "differs": "fully masked rows give the mean of value",
            "why": "masked positions get torch.finfo(dtype).min added (masking_utils' eager "
            "mask), a finite value, so a row with no allowed key gets uniform weights.",
        },
        {
            "cases": ["nan_key_masked"],
            "short": "masked NaN spreads",
            "differs": "a NaN key at a masked (padded) position makes every row of its head NaN",
            "why": "the mask is added to the scores (attn_weights + attention_mask), and "
            "NaN + finfo.min is NaN; the spec replaces a masked score by -inf.",
        },
        {
            "cases": ["*"],
            "dtypes": ["float64"],
            "short": "f32 softmax",
            "differs": "float64 inputs attend in float32 (errors ~1.4e-7, not ~1e-16)",
            "why": "eager_attention_forward computes the softmax with dtype=torch.float32 and "
            "casts back to the query's dtype.",
        },
    ],
    "transformers.sdpa": [
        {
            "cases": ["nan_query"],
            "short": "NaN row → 0",
            "differs": "a query row holding a NaN gives an output row of 0, not NaN",
            "why": "it calls torch SDPA, whose CPU flash kernel treats a row without a finite "
            "maximum like a fully masked row (see torch.sdpa).",
        },
        {
            "cases": ["nan_key_masked"],
            "short": "masked NaN spreads",
            "differs": "a NaN key at a masked (padded) position makes every row of its head NaN",
            "why": "torch SDPA turns the boolean attention_mask into an additive mask (0 or "
            "-inf) added to the scores, and NaN + (-inf) is NaN.",
        },
    ],
    "onnxruntime": [
        {
            "cases": ["kv_lengths", "nan_key_masked"],
            "dtypes": ["float32", "float16"],
            "short": "mask shape error",
            "differs": "a mask broadcast over queries, (batch, 1, 1, kv_len), is rejected: "
            "'inconsistent q_sequence_length (between attn_mask and Q)'",
            "why": "the CPU Attention kernel wants attn_mask's q_len axis in full; ONNX allows any "
            "mask broadcastable to (batch, heads, q_len, kv_len), and float64 inputs accept it.",
        },
        {
            "cases": ["nan_key_masked"],
            "dtypes": ["float64"],
            "short": "masked NaN spreads",
            "differs": "a NaN key at a masked (padded) position makes every row of its head NaN",
            "why": "the boolean attn_mask is applied to the scores by addition (0 or -inf), not "
            "by replacing them, and NaN + (-inf) is NaN.",
        },
        {
            "cases": ["*"],
            "dtypes": ["float64"],
            "short": "f32 inside",
            "differs": "float64 inputs give float32-level errors (~6e-8, not ~1e-16)",
            "why": "onnxruntime's CPU Attention kernel runs part of its float64 computation in "
            "float32 (measured: the output is float64, its error is float32's).",
        },
    ],
}
