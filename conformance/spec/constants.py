"""Semantic constants, error rules and tolerances.

What every backend computes, in words and data: mask polarity, causal alignments, fully masked
rows, precision, the fast paths (``FAST_PATHS``, from ``attention_rules``), NaN and infinities,
array and flag arguments, ``head_dim == 0``, dropout, attention sinks, the row log-sum-exp and
merging partial results, the exception type of each kind of bad
input (``ERRORS``) and the conformance harness's tolerances per dtype (``TOLERANCES``).
"""

from __future__ import annotations

# The backends' shared rules, standard library only like this file: the fast-path numbers are
# data of the spec, written once there (a test checks the spec's other restated constants).
from attention_rules import FAST_PATHS  # noqa: F401 - data of the spec, shown in the docs

from . import masks_and_mods, varlen

#: A boolean mask's True means the query may attend to that key (as in torch SDPA, jax.nn and
#: ONNX; the opposite of torch.nn.MultiheadAttention's ``key_padding_mask``/``attn_mask``).
MASK_TRUE_MEANS = "attend"

#: The two causal alignments and the offset each gives: query ``i`` may attend key ``j`` iff
#: ``j <= i + offset``.
CAUSAL_ALIGNMENTS = {
    "top_left": "offset = 0 (torch SDPA is_causal, jax.nn.dot_product_attention is_causal)",
    "bottom_right": "offset = kv_len - q_len (flash-attention >= 2.1, KV-cache decoding)",
}
DEFAULT_CAUSAL_ALIGNMENT = "top_left"

#: What a row with no allowed key gives.
FULLY_MASKED_ROW = "weights exactly 0 and output exactly 0 (never NaN, never mean of value)"

#: Value used for disallowed scores before the softmax.
MASKED_SCORE = float("-inf")

#: The dtypes a backend supports, and the dtype scores and softmax are computed in.
COMPUTE_DTYPE = {
    "float64": "float64",
    "float32": "float32",
    "bfloat16": "float32",
    "float16": "float32",
}

#: Precision rule, in words.
PRECISION = (
    "float16 and bfloat16 inputs compute scores, softmax and the weighted sum in float32 and "
    "return the input dtype; float32 stays float32 end to end (no float64 scalar promotion); "
    "float64 stays float64. Integer inputs, and query/key/value of different dtypes, are a "
    "TypeError. Step functions (attention_scores, mask_scores, attention_weights) return the "
    "compute dtype; scaled_dot_product_attention returns output and weights in the input dtype."
)

#: How large inputs are computed, in words.
BLOCKED_COMPUTATION = (
    "Backends may compute large inputs on a fast path, chosen by one selection rule per backend "
    "(_fast.use_fast_path; its numbers are FAST_PATHS): numpy_attn in blocks of 128 queries on "
    "a thread pool, one thread per core, with BLAS limited to one thread during the call "
    "through the optional threadpoolctl — without it the blocks run in the calling thread; "
    "jax_attn on CPU: lax.map over query blocks, and on a GPU cuDNN's flash attention for half "
    "inputs; torch_attn: torch's fused SDPA for finite query and key, and on large inputs "
    "with a soft-cap (or a window or bottom-right causal rule that leaves few tiles to compute) "
    "blockwise_attention's tiles, whose backward recomputes each tile from the row "
    "log-sum-exp. Results equal the "
    "explicit pipeline within the dtype's rounding, fully masked rows stay exactly 0, NaN and "
    "infinities follow NON_FINITE, and causal or window blocks that are fully masked are "
    "skipped. The step functions, return_weights=True, dropout and empty axes always run the "
    "explicit pipeline. With sinks or return_lse, jax_attn never takes cuDNN and torch_attn "
    "never SDPA (neither has them): large inputs take the blocked path or the tiles, which "
    "compute the row log-sum-exp anyway and join the sinks to each row's denominator at the end."
)

#: What each number of FAST_PATHS (imported above from attention_rules, the one place the
#: backends read them) means: FAST_PATHS[backend][path][key].
FAST_PATH_RULES = {
    "block_q": "queries per block of a blocked path (jax_attn: at least; without a window a "
    "block takes twice, then four times as many while its scores stay within block_scores "
    "entries)",
    "block_scores": "jax_attn: the score entries (heads of a block) × rows × keys a forward "
    "block may grow to (2 MiB of float32: bigger blocks keep XLA's products busy, smaller "
    "ones stay in cache)",
    "block_kv": "keys per step of the blocked VJP (numpy_attn: per task, the task's own dK and "
    "dV rows; jax_attn: per lax.scan step, against every query that sees them)",
    "block_q_backward": "numpy_attn: queries per tile of the blocked VJP (a tile stays in cache)",
    "keys_first": "numpy_attn: the forward block's scores made as keys @ queriesᵀ into a "
    "(keys, queries) buffer that the later steps read through its transpose (True), or as "
    "queries @ keysᵀ (False): the same sums, another BLAS kernel",
    "keys_first_backward": "numpy_attn: the same order for the VJP tile's two (keys, queries) "
    "products, the scores and dPᵀ",
    "min_scores": "a blocked path runs only from this many score entries (..., heads, q_len) "
    "× kv_len: below it the explicit steps are as fast",
    "min_q_len": "a blocked path runs only from this many queries (decoding steps, with few "
    "queries, are one batched matmul); jax_attn needs at least block_q",
    "max_tile_fraction": "torch_attn: a window or bottom-right causal rule without a soft-cap "
    "takes the tiles only when they compute at most this fraction of the score matrix (SDPA "
    "with the band as a mask computes all of it, faster per entry)",
    "segments": "jax_attn: the causal rule or a window cut the queries into at most this many "
    "static segments, each against only the keys it can see",
    "platforms": "jax_attn: the platforms of the query's devices (x.devices()), or "
    "jax.default_backend() for a tracer under jit, that the path runs on",
    "dtypes": "jax_attn cudnn: the input dtypes cuDNN's flash attention takes",
    "tuning": "numpy_attn: the choices of the blocked path, which change its speed and never "
    "what it computes: block_q (queries per forward block), exp2 (the exponential of "
    "the forward blocks and the VJP's tiles: exp of the scores, or exp2 of the scores in units "
    "of log2 e), block_kv and "
    "block_q_backward (keys per VJP task, queries per VJP tile), keys_first and "
    "keys_first_backward (the order of the forward's and the VJP's score products). The "
    "numbers above are the fixed table; by default the first call of a shape class "
    "(forward or VJP, compute dtype, head_dim, v_dim, q_len and kv_len rounded up to powers "
    "of two) times the candidates of "
    "attention_rules.fast_paths.TUNING (every combination of the step's entries) on random "
    "inputs of that class, full attention, and keeps the fastest when it beats the fixed "
    "table by 5 % twice, for the process and in a JSON file per machine (CPU model, cores, "
    "NumPy, BLAS, library version) in $ATTENTION_TUNING_CACHE, else "
    "~/.cache/attention-three-ways/tuning beside JAX's compilation cache; a file that is "
    "unreadable, malformed or of another machine is ignored. Causal and windowed calls are "
    "not measured: tuned, they run the fixed table. "
    "ATTENTION_TUNING=off (or numpy_attn._fast.tuning.set_tuning('off')) runs the fixed table, "
    "'alternate' the fixed table with every block halved, the other exponential and the "
    "other product orders, "
    "'block_q=64,exp2=0' those entries. A given choice gives the same bits on every call, from "
    "any thread (CONCURRENCY), and a shape class keeps its choice for the life of the process; "
    "two choices differ only in rounding (the order of the sums, the BLAS kernel, exp against "
    "exp2), both "
    "within TOLERANCES of the float64 reference, NaN, infinities and fully masked rows alike",
}

#: NaN and infinities in the inputs: what every backend and every path computes.
NON_FINITE = (
    "NaN and infinities are neither checked nor repaired: the pipeline is ordinary IEEE "
    "arithmetic. A NaN in query row i makes every score of row i NaN, so output row i is NaN "
    "(unless row i is fully masked: then it is 0). A NaN or ±inf in key j makes score (i, j) "
    "NaN or ±inf for every query i (soft-capping maps ±inf to ±softcap; NaN stays NaN); at a "
    "position the mask, the causal rule and the window allow, a NaN or +inf score makes row i "
    "NaN (+inf − +inf in the softmax), and a −inf score gets weight 0 like a masked position "
    "(a row whose allowed scores are all −inf is a fully masked row: 0). Masking replaces a "
    "masked position's score by −inf (it does not add −inf to it), so a NaN or infinite key at "
    "a masked position does not spread: rows that do not attend key j stay finite. ±inf in "
    "query row i gives scores ±inf or NaN by IEEE (inf · 0 = NaN, inf − inf = NaN): row i is "
    "NaN, or 0 when every allowed score is −inf. A NaN or ±inf in value row j reaches every "
    "output row whose weight on key j is non-zero; rows whose weight on j is exactly 0 are "
    "unspecified (a plain matmul gives 0 · NaN = NaN there, while a blocked kernel that skips "
    "the tile never reads it). A NaN bias at an allowed position makes the row NaN; a −inf bias "
    "masks its position. torch SDPA adds the mask to the scores instead (NaN + −inf = NaN), so "
    "torch_attn gives SDPA finite query and key only; jax_attn's cuDNN path (GPU, half inputs) "
    "is not checked against this rule: give such inputs in float32 or with return_weights=True."
)

#: Array arguments, in words.
ARRAY_INPUTS = (
    "query, key, value, mask, bias, dropout_mask, sinks, grad_output, scores and weights are "
    "arrays: numpy.ndarray, jax.Array or torch.Tensor (every backend also takes NumPy arrays); "
    "merge_attention's outputs and lses are lists or tuples of them. A Python "
    "list, tuple or scalar there is a TypeError naming the argument and its type, the same in "
    "every backend (e.g. scaled_dot_product_attention: query must be an array (numpy.ndarray, "
    "jax.Array or torch.Tensor), not a Python list; convert it with an explicit dtype; got "
    "type(query)=list): it has no dtype of its own (NumPy and torch would read [[1.0]] as "
    "float64, JAX as float32). Integers where the spec asks for ints stay welcome as Python "
    "values: kv_lengths and q_lengths as lists, window as a tuple or list of two."
)

#: Boolean options, in words.
FLAGS = (
    "is_causal, return_weights and return_lse are bools: Python True/False or numpy.bool_. "
    "Anything else "
    "(\"yes\", 1, a 0-d array) is a TypeError naming the argument, e.g. "
    "scaled_dot_product_attention: is_causal must be a bool (True or False); got "
    "is_causal='yes'. Under jax.jit they are static arguments."
)

#: head_dim == 0, in words.
EMPTY_HEAD_DIM = (
    "head_dim == 0 is allowed: every dot product is the empty sum 0 and the default scale is "
    "1.0 (not 0 ** -0.5 = inf), so every score before the bias is 0 (0 after soft-capping "
    "too), the weights are uniform over the allowed keys (softmax of the bias with a bias) and "
    "each output row is the mean of value over its allowed keys; a fully masked row is 0. "
    "Every backend and every path gives this (the fast paths leave empty axes to the explicit "
    "pipeline; blockwise_attention computes it tile by tile)."
)

#: Dropout rule, in words.
DROPOUT = (
    "dropout_p in [0, 1). With dropout_p > 0 the weights are multiplied by a keep-mask and "
    "scaled by 1 / (1 - dropout_p). The keep-mask is dropout_mask (boolean, True = keep, "
    "broadcastable to the weights) when given, else drawn from rng: a numpy.random.Generator "
    "(numpy_attn; None means a fresh default_rng()), a jax.random key (jax_attn; required), or "
    "a torch.Generator (torch_attn; None means torch's global generator). return_weights=True "
    "returns the weights before dropout. dropout_mask with dropout_p == 0 is a ValueError."
)

#: Attention sinks (``sinks``), in words.
SINKS = (
    "sinks: one learned logit per query head, shape (heads,) ((1,) for 2-D inputs without a "
    "heads axis), floating point, in the compute dtype; as GPT-OSS's sinks: the sink logit "
    "joins every row's softmax as an extra column of the scores that carries no value, and the "
    "column is dropped after the softmax (transformers' gpt_oss eager_attention_forward is the "
    "reference semantics). It is added after scale, soft-cap, bias and mask and is itself "
    "neither scaled, soft-capped nor masked: weights = exp(s_ij) / (exp(sink_h) + sum_k "
    "exp(s_ik)), so each row's weights sum to less than 1 and return_weights returns them "
    "without the sink column (before dropout, which never drops the sink). A fully masked row "
    "puts all its weight on the sink: weights 0 and output 0, as FULLY_MASKED_ROW says for a "
    "row without a sink. Query heads sharing a kv head keep their own sink. Gradients reach the "
    "sink logits: dsink_h = -sum over batch and queries of p_sink · rowsum(dO ⊙ O) (plus p_sink "
    "times the lse's cotangent), with p_sink = exp(sink_h - lse). A sink of -inf is no sink. "
    "A NaN or +inf sink follows IEEE arithmetic in the max-subtracted softmax: every row of "
    "its head, fully masked or not, has a NaN output and lse (+inf - +inf is NaN; the weights "
    "are not taken as all on the sink), as transformers' gpt_oss eager attention gives. "
    "Wrong dtype: TypeError; wrong shape: ValueError (scaled_dot_product_attention: sinks must "
    "have shape (heads,) = (4,), one logit per query head; got sinks.shape=(3,))."
)

#: The row log-sum-exp (``return_lse``), in words.
LOG_SUM_EXP = (
    "return_lse=True also returns each row's log-sum-exp, lse_i = log(sum_j exp(s_ij)), in the "
    "natural log (some kernels keep log2 internally: merging a natural-log lse with a log2 one "
    "is a bug), of the scores after scale, soft-cap, bias and mask (before dropout, which the "
    "lse ignores): the log of the softmax denominator actually used, so it includes exp(sink) "
    "when sinks are given. Shape (..., heads, q_len) ((q_len,) for 2-D inputs), dtype the "
    "compute dtype (float32 for float16, bfloat16 and float32 inputs, float64 for float64). A "
    "fully masked row has lse = -inf without sinks (never 0, never +inf, never NaN) and lse = "
    "its sink logit with sinks; a row that NON_FINITE makes NaN has a NaN lse (never -inf, "
    "which would make a merge drop the row's NaN). Results come back in the order "
    "output[, weights][, lse]. The "
    "lse is differentiable (jax_attn, torch_attn: through autodiff; numpy_attn: "
    "merge_attention_vjp takes its cotangent)."
)

#: Merging partial results (``merge_attention``), in words.
MERGING = (
    "merge_attention(outputs, lses) gives the attention over the union of disjoint key sets "
    "from the partial results over each set (split-KV decoding, context parallelism, cascade "
    "attention): with m = max_i lse_i, lse = m + log(sum_i exp(lse_i - m)) and output = "
    "sum_i exp(lse_i - lse) · output_i, exact within rounding. The partial lses are those of "
    "return_lse without sinks; sinks, if given, are applied exactly once, in the merge: "
    "output · exp(lse - logaddexp(lse, sink)) and lse = logaddexp(lse, sink). A part with lse "
    "-inf (no key) contributes nothing; when every part is -inf the output is 0 and the lse "
    "-inf, never NaN. The merge runs in the compute dtype of the outputs' dtype; the merged "
    "output has the outputs' dtype and the merged lse the compute dtype."
)

#: Error rules: the exception type for each kind of bad input, identical in every backend.
#: Every message starts with the public function's name and names the argument, with shapes
#: printed as plain tuples, e.g. ``scaled_dot_product_attention: key and value must have the
#: same kv_len; got key.shape=(2, 4, 6, 8), value.shape=(2, 4, 5, 8)``.
ERRORS = {
    "rank below 2, or query/key/value of different ranks": "ValueError",
    "key and value with different kv_len (weights and value in attention_output)": "ValueError",
    "query and key with different head_dim": "ValueError",
    "different leading batch axes": "ValueError",
    "heads not divisible by kv_heads, or key and value with different kv_heads": "ValueError",
    "mask or bias not broadcastable to the scores (..., heads, q_len, kv_len), or "
    "dropout_mask to the weights": "ValueError",
    "mask that is not boolean": "TypeError",
    "bias that is not floating point": "TypeError",
    "integer, complex or mixed query/key/value dtypes": "TypeError",
    "window not a pair of non-negative ints (or None for unbounded)": "ValueError",
    "causal_alignment not 'top_left' or 'bottom_right'": "ValueError",
    "dropout_p outside [0, 1), dropout_mask given with dropout_p == 0, or a VJP with "
    "dropout_p > 0 but no dropout_mask": "ValueError",
    "dropout_mask not boolean": "TypeError",
    "softcap not a positive finite number": "ValueError",
    "scale not a finite number": "ValueError",
    "a Python list, tuple or scalar where an array is expected (see ARRAY_INPUTS)": "TypeError",
    "is_causal, return_weights or return_lse not a bool (see FLAGS)": "TypeError",
    "mask builders: q_len, kv_len or offset not an int (>= 0 for lengths), per-sequence "
    "lengths not 1-D ints in [0, max], or q_lengths without q_len": "ValueError",
    "masks given to combine_masks that do not broadcast together": "ValueError",
    "grad_output not shaped like the output (..., heads, q_len, v_dim)": "ValueError",
    "blockwise_attention: block_q or block_kv below 1, or kv_lengths not ints shaped like "
    "the batch axes, each in [0, kv_len]": "ValueError",
    "sinks not shaped (heads,) ((1,) for 2-D inputs; see SINKS)": "ValueError",
    "sinks not floating point": "TypeError",
    "merge_attention: outputs and lses of different lengths or no part, outputs of different "
    "shapes, or an lse not shaped like its output without v_dim": "ValueError",
    "merge_attention: outputs or lses not a list or tuple of arrays, or not floating point "
    "(see MERGING)": "TypeError",
}
#: The packed batches' rules (VARLEN_ERRORS) and those of chunks, ALiBi, segment ids and the
#: mods (MASKS_AND_MODS_ERRORS) are rules of ERRORS too, the same in every backend; numpy_attn's
#: NotImplementedError for a score_mod without a derivative is not a bad input (jax_attn and
#: torch_attn differentiate it), so it stays in its chapter alone.
ERRORS.update(varlen.VARLEN_ERRORS)
ERRORS.update({rule: kind for rule, kind in masks_and_mods.MASKS_AND_MODS_ERRORS.items()
               if kind != "NotImplementedError"})

#: Tolerances of the conformance harness, per input dtype (flash-attention's rule). A step's
#: result ``x`` passes against the float64 reference ``ref`` when
#: ``|x - ref| <= atol + rtol·|ref| + k·e`` everywhere, where ``e`` is the largest error of a
#: straightforward implementation in the same dtype on the same inputs, measured in the same
#: run (``conformance.cases.naive``): the float64 pipeline with every intermediate (dot products,
#: scaled scores, exp, row sums, weights, weighted sum) rounded to the dtype, and every dot
#: product and row sum accumulated in the compute dtype, as a plain ``query @ keyᵀ`` does. For
#: the weights, the output and the row log-sum-exp, ``e`` is never below the first-order effect
#: of rounding each score once, ``u·(scale·Σ_d |q_d k_d| + |score|)`` with ``u`` the dtype's
#: unit roundoff, carried through the softmax and the weighted sum: on a tiny example the
#: measured error can be small by luck (two roundings that cancel). A merge case's ``e`` is
#: that of each part computed naively and merged with every intermediate rounded. In float64
#: ``e`` is ~1e-16, so ``atol`` and ``rtol`` decide. The property checks (``--hypothesis N``)
#: apply the same rule to each drawn example. Measured with numpy_attn, jax_attn, torch_attn
#: and the framework kernels on every case (2026-12): the worst ``|x - ref| / bound`` was 0.30
#: in float32, 0.38 in bfloat16, 0.44 in float16 and 0.10 in float64, and 0.27 over 2,000
#: property examples per backend; with the sinks, lse, merge and paged cases added (the three
#: backends), 0.40 in float32 (jax_attn's blockwise gradient of the sinks), the others
#: unchanged; each planted bug of ``tests/test_harness_planted_bugs.py`` exceeds 1 by orders
#: of magnitude. ``k`` is larger in float32 than flash-attention's 2, which compares errors
#: over large tensors, where the largest error is a stable measure; the cases and property
#: examples here are tiny. In the half types the final rounding of the output dominates both
#: errors.
TOLERANCES = {
    "float64": {"k": 2.0, "atol": 1e-12, "rtol": 1e-12},
    "float32": {"k": 10.0, "atol": 1e-7, "rtol": 0.0},
    "bfloat16": {"k": 3.0, "atol": 1e-3, "rtol": 0.0},
    "float16": {"k": 3.0, "atol": 1e-4, "rtol": 0.0},
}
