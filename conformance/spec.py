"""The specification of scaled dot-product attention that every backend implements.

This module is the single source of truth of the project. It uses the standard library only, so
it can be read and imported anywhere. It holds:

* the semantic constants (mask polarity, causal alignments, fully-masked rows, precision rules),
* one stub per public function, with the canonical signature and a docstring that gives a shape
  for every argument (axis names as words),
* one stub class per public module, with its constructor and methods,
* the error rules every backend must follow,
* the tolerances the conformance harness uses, per dtype.

``docs/spec.md`` is generated from this file (``python -m conformance spec``); a test fails when the
two disagree. ``tests/test_signatures.py`` checks every backend's public signatures against the
stubs below.

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

from typing import Any

# The backends' shared rules, standard library only like this file: the fast-path numbers are
# data of the spec, written once there (a test checks the spec's other restated constants).
from attention_rules import FAST_PATHS  # noqa: F401 - data of the spec, shown in the docs

from .known_differences import KNOWN_DIFFERENCES  # noqa: F401 - the peers' known differences

# --------------------------------------------------------------------------------------------
# Semantic constants
# --------------------------------------------------------------------------------------------

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
    "explicit pipeline."
)

#: What each number of FAST_PATHS (imported above from attention_rules, the one place the
#: backends read them) means: FAST_PATHS[backend][path][key].
FAST_PATH_RULES = {
    "block_q": "queries per block of a blocked path",
    "block_kv": "keys per step of the blocked VJP (numpy_attn: per task, the task's own dK and "
    "dV rows; jax_attn: per lax.scan step, against every query that sees them)",
    "block_q_backward": "numpy_attn: queries per tile of the blocked VJP (a tile stays in cache)",
    "min_scores": "a blocked path runs only from this many score entries (..., heads, q_len) "
    "× kv_len: below it the explicit steps are as fast",
    "min_q_len": "a blocked path runs only from this many queries (decoding steps, with few "
    "queries, are one batched matmul); jax_attn needs at least block_q",
    "max_tile_fraction": "torch_attn: a window or bottom-right causal rule without a soft-cap "
    "takes the tiles only when they compute at most this fraction of the score matrix (SDPA "
    "with the band as a mask computes all of it, faster per entry)",
    "segments": "jax_attn: the causal rule or a window cut the queries into at most this many "
    "static segments, each against only the keys it can see",
    "platforms": "jax_attn: the JAX backends (jax.default_backend()) the path runs on",
    "dtypes": "jax_attn cudnn: the input dtypes cuDNN's flash attention takes",
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
    "query, key, value, mask, bias, dropout_mask, grad_output, scores and weights are arrays: "
    "numpy.ndarray, jax.Array or torch.Tensor (every backend also takes NumPy arrays). A Python "
    "list, tuple or scalar there is a TypeError naming the argument and its type, the same in "
    "every backend (e.g. scaled_dot_product_attention: query must be an array (numpy.ndarray, "
    "jax.Array or torch.Tensor), not a Python list; convert it with an explicit dtype; got "
    "type(query)=list): it has no dtype of its own (NumPy and torch would read [[1.0]] as "
    "float64, JAX as float32). Integers where the spec asks for ints stay welcome as Python "
    "values: kv_lengths and q_lengths as lists, window as a tuple or list of two."
)

#: Boolean options, in words.
FLAGS = (
    "is_causal and return_weights are bools: Python True/False or numpy.bool_. Anything else "
    "(\"yes\", 1, a 0-d array) is a TypeError naming the argument, e.g. "
    "scaled_dot_product_attention: is_causal must be a bool (True or False); got "
    "is_causal='yes'. Under jax.jit both are static arguments."
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
    "is_causal or return_weights not a bool (see FLAGS)": "TypeError",
    "mask builders: q_len, kv_len or offset not an int (>= 0 for lengths), per-sequence "
    "lengths not 1-D ints in [0, max], or q_lengths without q_len": "ValueError",
    "masks given to combine_masks that do not broadcast together": "ValueError",
    "grad_output not shaped like the output (..., heads, q_len, v_dim)": "ValueError",
    "blockwise_attention: block_q or block_kv below 1, or kv_lengths not ints shaped like "
    "the batch axes, each in [0, kv_len]": "ValueError",
}

#: Tolerances of the conformance harness, per input dtype (flash-attention's rule). A step's
#: result ``x`` passes against the float64 reference ``ref`` when
#: ``|x - ref| <= atol + rtol·|ref| + k·e`` everywhere, where ``e`` is the largest error of a
#: straightforward implementation in the same dtype on the same inputs, measured in the same
#: run (``conformance.naive``): the float64 pipeline with every intermediate (dot products,
#: scaled scores, exp, row sums, weights, weighted sum) rounded to the dtype, and every dot
#: product and row sum accumulated in the compute dtype, as a plain ``query @ keyᵀ`` does. For
#: the weights and the output, ``e`` is never below the first-order effect of rounding each
#: score once, ``u·(scale·Σ_d |q_d k_d| + |score|)`` with ``u`` the dtype's unit roundoff,
#: carried through the softmax and the weighted sum: on a tiny example the measured error can
#: be small by luck (two roundings that cancel). In float64 ``e`` is ~1e-16, so ``atol`` and
#: ``rtol`` decide. The property checks (``--hypothesis N``) apply the same rule to each drawn
#: example. Measured with numpy_attn, jax_attn, torch_attn and the framework kernels on every
#: case (2026-12): the worst ``|x - ref| / bound`` was 0.30 in float32, 0.38 in bfloat16, 0.44
#: in float16 and 0.10 in float64, and 0.27 over 2,000 property examples per backend; each
#: planted bug of ``tests/test_harness.py`` exceeds 1 by orders of magnitude. ``k`` is larger
#: in float32 than flash-attention's 2, which compares errors over large tensors, where the
#: largest error is a stable measure; the cases and property examples here are tiny. In the
#: half types the final rounding of the output dominates both errors.
TOLERANCES = {
    "float64": {"k": 2.0, "atol": 1e-12, "rtol": 1e-12},
    "float32": {"k": 10.0, "atol": 1e-7, "rtol": 0.0},
    "bfloat16": {"k": 3.0, "atol": 1e-3, "rtol": 0.0},
    "float16": {"k": 3.0, "atol": 1e-4, "rtol": 0.0},
}

# --------------------------------------------------------------------------------------------
# Public functions (stubs). Backends implement each with exactly this signature.
# --------------------------------------------------------------------------------------------

FUNCTIONS = (
    "causal_mask",
    "sliding_window_mask",
    "padding_mask",
    "combine_masks",
    "attention_scores",
    "mask_scores",
    "attention_weights",
    "apply_dropout",
    "attention_output",
    "renormalized_causal_weights",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_vjp",
    "blockwise_attention",
    "blockwise_attention_vjp",
)


def causal_mask(q_len: int, kv_len: int, *, offset: int = 0, device: Any = None) -> Any:
    """Boolean causal mask: query ``i`` may attend key ``j`` iff ``j <= i + offset``.

    Args:
      q_len: number of queries (``>= 0``).
      kv_len: number of keys (``>= 0``).
      offset: ``0`` is top-left alignment; ``kv_len - q_len`` is bottom-right alignment.
      device: where to create the mask (``None``: the backend's default; ``"cpu"`` in NumPy).

    Returns:
      ``(q_len, kv_len)`` bool, True = may attend.
    """


def sliding_window_mask(
    q_len: int, kv_len: int, window: tuple, *, offset: int = 0, device: Any = None
) -> Any:
    """Boolean local-attention mask: ``i + offset - left <= j <= i + offset + right``.

    Args:
      q_len: number of queries.
      kv_len: number of keys.
      window: ``(left, right)``, non-negative ints; ``None`` in a slot means unbounded.
      offset: alignment offset, as in ``causal_mask``.
      device: where to create the mask.

    Returns:
      ``(q_len, kv_len)`` bool, True = may attend.
    """


def padding_mask(
    kv_lengths: Any,
    kv_len: int,
    *,
    q_lengths: Any = None,
    q_len: int | None = None,
    device: Any = None,
) -> Any:
    """Boolean padding mask from per-sequence lengths.

    Key ``j`` of sequence ``b`` may be attended iff ``j < kv_lengths[b]``; with ``q_lengths``,
    query ``i`` of sequence ``b`` may attend only if ``i < q_lengths[b]`` too (a padded query
    is a fully masked row, so its output is 0).

    Args:
      kv_lengths: ``(batch,)`` ints, each in ``[0, kv_len]``.
      kv_len: padded key length.
      q_lengths: optional ``(batch,)`` ints, each in ``[0, q_len]``.
      q_len: padded query length; required with ``q_lengths``.
      device: where to create the mask.

    Returns:
      ``(batch, 1, 1, kv_len)`` bool, or ``(batch, 1, q_len, kv_len)`` with ``q_lengths``;
      broadcastable to ``(batch, heads, q_len, kv_len)``.
    """


def combine_masks(*masks: Any) -> Any:
    """AND of boolean masks, broadcast together; ``None`` entries are skipped.

    Args:
      masks: boolean arrays, mutually broadcastable (e.g. ``(q_len, kv_len)`` and
        ``(batch, 1, 1, kv_len)``).

    Returns:
      the broadcast AND, or ``None`` when every entry is ``None``.
    """


def attention_scores(
    query: Any, key: Any, *, scale: float | None = None, softcap: float | None = None
) -> Any:
    """Scaled (and optionally soft-capped) dot products, steps 1-2 of the pipeline.

    ``scores = (query @ keyᵀ) · scale``, then ``softcap · tanh(scores / softcap)`` if given.

    Args:
      query: ``(..., heads, q_len, head_dim)`` or ``(q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)`` or ``(kv_len, head_dim)``.
      scale: multiplier of the dot products; default ``head_dim ** -0.5``.
      softcap: positive cap, or ``None``.

    Returns:
      ``(..., heads, q_len, kv_len)`` in the compute dtype.
    """


def mask_scores(
    scores: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
) -> Any:
    """Add the bias and set disallowed positions to ``-inf``, steps 3-4 of the pipeline.

    Args:
      scores: ``(..., heads, q_len, kv_len)`` (or ``(q_len, kv_len)``).
      mask: boolean, broadcastable to ``scores``; True = may attend.
      bias: floating point, broadcastable to ``scores``; added before masking.
      is_causal: apply the causal rule ``j <= i + offset``.
      causal_alignment: ``"top_left"`` (offset 0) or ``"bottom_right"``
        (offset ``kv_len - q_len``); also aligns ``window``.
      window: ``(left, right)`` sliding window, or ``None``.

    Returns:
      ``(..., heads, q_len, kv_len)`` in the compute dtype, ``-inf`` where not allowed.
    """


def attention_weights(scores: Any) -> Any:
    """Softmax over keys, with fully masked rows (all ``-inf``) giving exactly 0, step 5.

    Args:
      scores: ``(..., q_len, kv_len)`` masked scores.

    Returns:
      ``(..., q_len, kv_len)`` in the compute dtype; each row sums to 1 or is all 0.
    """


def apply_dropout(
    weights: Any, dropout_p: float, *, dropout_mask: Any = None, rng: Any = None
) -> Any:
    """Dropout of the attention weights, step 6: ``weights · keep / (1 - dropout_p)``.

    Args:
      weights: ``(..., q_len, kv_len)``.
      dropout_p: drop probability in ``[0, 1)``; ``0`` returns ``weights`` unchanged.
      dropout_mask: boolean keep-mask (True = keep) broadcastable to ``weights``, or ``None``.
      rng: the backend's random source (see ``DROPOUT``), used when ``dropout_mask`` is None.

    Returns:
      ``(..., q_len, kv_len)``, same dtype as ``weights``.
    """


def attention_output(weights: Any, value: Any) -> Any:
    """Weighted sum of the values, step 7, with the grouped-query head mapping.

    Args:
      weights: ``(..., heads, q_len, kv_len)`` (or ``(q_len, kv_len)``).
      value: ``(..., kv_heads, kv_len, v_dim)`` (or ``(kv_len, v_dim)``).

    Returns:
      ``(..., heads, q_len, v_dim)`` in the compute dtype.
    """


def renormalized_causal_weights(weights: Any, *, causal_alignment: str = "top_left") -> Any:
    """The article's second causal method: zero the weights above the diagonal, renormalise.

    Teaching function. Equal to masking the scores with ``-inf`` before the softmax wherever a
    row keeps at least one key; a row that keeps none gives 0 (not ``0 / 0``).

    Args:
      weights: ``(..., q_len, kv_len)`` unmasked softmax weights.
      causal_alignment: ``"top_left"`` or ``"bottom_right"``.

    Returns:
      ``(..., q_len, kv_len)``, same dtype as ``weights``.
    """


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    dropout_mask: Any = None,
    rng: Any = None,
    return_weights: bool = False,
) -> Any:
    """Scaled dot-product attention: the whole pipeline of this spec.

    Args:
      query: ``(..., heads, q_len, head_dim)`` or ``(q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)`` or ``(kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)`` or ``(kv_len, v_dim)``.
      mask: boolean, broadcastable to ``(..., heads, q_len, kv_len)``; True = may attend.
      bias: floating point, broadcastable to ``(..., heads, q_len, kv_len)``.
      is_causal: query ``i`` attends key ``j`` only if ``j <= i + offset``.
      causal_alignment: ``"top_left"`` (offset 0) or ``"bottom_right"`` (``kv_len - q_len``).
      window: ``(left, right)`` sliding window, aligned like the causal rule.
      scale: default ``head_dim ** -0.5``.
      softcap: positive cap applied as ``softcap · tanh(scores / softcap)``.
      dropout_p: dropout probability on the weights, in ``[0, 1)``.
      dropout_mask: boolean keep-mask broadcastable to the weights (True = keep).
      rng: the backend's random source for dropout (see ``DROPOUT``).
      return_weights: also return the weights (before dropout).

    Returns:
      ``output``: ``(..., heads, q_len, v_dim)`` in the input dtype; with
      ``return_weights=True``, ``(output, weights)`` with weights ``(..., heads, q_len, kv_len)``
      in the input dtype.
    """


def scaled_dot_product_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    dropout_mask: Any = None,
) -> Any:
    """Gradients of ``scaled_dot_product_attention`` with respect to its array inputs.

    numpy_attn derives them by hand (FlashAttention's backward); jax_attn uses ``jax.vjp`` and
    torch_attn ``torch.autograd``, so the harness compares three independent computations.
    Dropout needs the forward pass's ``dropout_mask`` (ValueError without it). Masked
    positions and fully masked rows receive gradient exactly 0, never NaN.

    Args:
      query: ``(..., heads, q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)``.
      grad_output: ``(..., heads, q_len, v_dim)``: the gradient of a loss w.r.t. the output.
      mask, bias, is_causal, causal_alignment, window, scale, softcap, dropout_p,
        dropout_mask: as in ``scaled_dot_product_attention``.

    Returns:
      ``(grad_query, grad_key, grad_value, grad_bias)`` shaped like query, key, value and
      bias (``grad_bias`` is None without a bias); grouped-query heads add their key/value
      gradients into the shared head.
    """


def blockwise_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    bias: Any = None,
    kv_lengths: Any = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    block_q: int = 512,
    block_kv: int = 1024,
) -> Any:
    """Memory-efficient attention: the pipeline in ``(block_q, block_kv)`` tiles, online softmax.

    Equals ``scaled_dot_product_attention(query, key, value, mask=padding_mask(kv_lengths,
    kv_len), bias=bias, ...)`` without dropout and weights, within the tolerances of
    ``TOLERANCES``. Per query row it keeps a running maximum ``m``, sum ``l`` and weighted sum
    ``acc`` over the key tiles (``acc`` and ``l`` rescaled by ``exp(m_old - m_new)``), so extra
    memory is a few ``(..., heads, block_q, block_kv)`` tiles instead of the ``(..., heads,
    q_len, kv_len)`` scores. Masks are structure: the causal rule (both alignments), the window
    and ``kv_lengths`` are evaluated per tile, and tiles that the causal rule or the window mask
    entirely are not computed. Fully masked rows give exactly 0; float16/bfloat16 compute in
    float32 and return the input dtype. Its backward pass keeps only the log-sum-exp of each row
    and recomputes every tile (``blockwise_attention_vjp``). jax_attn: one ``lax.scan`` with a
    ``jax.custom_vjp``; ``is_causal``, ``causal_alignment``, ``window``, ``scale``, ``softcap``,
    ``block_q`` and ``block_kv`` are static, ``kv_lengths`` may be traced.

    Args:
      query: ``(..., heads, q_len, head_dim)`` or ``(q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)`` or ``(kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)`` or ``(kv_len, v_dim)``.
      bias: floating point, broadcastable to ``(..., heads, q_len, kv_len)``; sliced per tile.
      kv_lengths: ints shaped like the leading batch axes ``(...)`` (``(batch,)`` for
        ``(batch, heads, seq, dim)`` inputs; a scalar for 2-D and 3-D inputs), each in
        ``[0, kv_len]``: key ``j`` of sequence ``b`` is attended only if ``j < kv_lengths[b]``.
        Wrong shape, non-integer or out of range: ValueError.
      is_causal, causal_alignment, window, scale, softcap: as in
        ``scaled_dot_product_attention``.
      block_q: queries per tile, ``>= 1`` (ValueError otherwise).
      block_kv: keys per tile, ``>= 1`` (ValueError otherwise).

    Returns:
      ``(..., heads, q_len, v_dim)`` in the input dtype.
    """


def blockwise_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    *,
    bias: Any = None,
    kv_lengths: Any = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    block_q: int = 512,
    block_kv: int = 1024,
) -> Any:
    """Gradients of ``blockwise_attention``, tile by tile, from the saved log-sum-exp.

    The forward pass keeps the output and ``lse = m + log l`` per row (``+inf`` on fully
    masked rows); the backward pass recomputes each tile's weights as ``exp(s - lse)`` and
    applies FlashAttention's backward per tile, so no ``(q_len, kv_len)`` array is stored.
    numpy_attn writes it by hand; jax_attn runs ``jax.vjp`` through a ``jax.custom_vjp``
    (a second scan); torch_attn runs autograd through a ``torch.autograd.Function``.

    Args:
      query: ``(..., heads, q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)``.
      grad_output: ``(..., heads, q_len, v_dim)``: the gradient of a loss w.r.t. the output.
      bias, kv_lengths, is_causal, causal_alignment, window, scale, softcap, block_q,
        block_kv: as in ``blockwise_attention``.

    Returns:
      ``(grad_query, grad_key, grad_value, grad_bias)`` shaped like query, key, value and
      bias, in their dtypes (``grad_bias`` is None without a bias).
    """


# --------------------------------------------------------------------------------------------
# Public modules (stubs). Weights use the ``x @ W`` convention of the article: ``(d_in, d_out)``.
# --------------------------------------------------------------------------------------------

MODULES = (
    "SelfAttention",
    "CrossAttention",
    "CausalSelfAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadAttention",
)

#: Methods every module has, beyond its constructor.
MODULE_METHODS = ("forward", "backward", "export_weights", "load_weights")

WEIGHTS = (
    "Each module's weights export to a flat dict of NumPy arrays (export_weights) and load from "
    "one (load_weights), with the same keys and shapes in every backend. load_weights returns "
    "the module holding the new weights: numpy_attn and torch_attn update the module in place "
    "and return it; jax_attn modules are immutable pytrees and return a new module. Write "
    "`module = module.load_weights(weights)` to be portable. backward(inputs..., grad_output) "
    "returns the gradient of every weight as a dict of NumPy arrays with the same keys: "
    "numpy_attn derives it by hand (backward.py), jax_attn with jax.vjp and torch_attn with "
    "torch.autograd; it never applies dropout (numpy_attn and torch_attn raise ValueError while "
    "dropout is active in training mode)."
)

INITIALISATION = (
    "SelfAttention, CrossAttention, CausalSelfAttention and MultiHeadAttentionWrapper draw "
    "every weight uniformly from [0, 1), in the article's order (W_query, W_key, W_value; head "
    "by head), so torch_attn with torch.manual_seed(123) reproduces the article's numbers. "
    "MultiHeadAttention draws W_query, W_key, W_value, W_out from the Xavier/Glorot uniform "
    "distribution (as torch.nn.MultiheadAttention's in_proj_weight) and sets biases to 0."
)


class SelfAttention:
    """The article's single-head self-attention.

    Weights: ``W_query (d_in, d_out_kq)``, ``W_key (d_in, d_out_kq)``,
    ``W_value (d_in, d_out_v)``. ``scale = d_out_kq ** -0.5``.
    """

    def __init__(self, d_in: int, d_out_kq: int, d_out_v: int, *, rng: Any = None) -> None:
        """``rng``: the backend's random source for the initial weights."""

    def forward(self, x: Any) -> Any:
        """``x: (..., seq, d_in)`` → ``(..., seq, d_out_v)``."""

    def backward(self, x: Any, grad_output: Any) -> dict:
        """Weight gradients: ``grad_output: (..., seq, d_out_v)`` → name → NumPy array."""

    def export_weights(self) -> dict:
        """Flat dict name → NumPy array."""

    def load_weights(self, weights: dict) -> Any:
        """Load weights exported by any backend; returns the module."""


class CrossAttention:
    """The article's cross-attention: queries from ``x_1``, keys and values from ``x_2``.

    Weights as ``SelfAttention``.
    """

    def __init__(self, d_in: int, d_out_kq: int, d_out_v: int, *, rng: Any = None) -> None:
        """``rng``: the backend's random source for the initial weights."""

    def forward(self, x_1: Any, x_2: Any) -> Any:
        """``x_1: (..., q_len, d_in)``, ``x_2: (..., kv_len, d_in)`` → ``(..., q_len, d_out_v)``."""

    def backward(self, x_1: Any, x_2: Any, grad_output: Any) -> dict:
        """Weight gradients: ``grad_output: (..., q_len, d_out_v)`` → name → NumPy array."""

    def export_weights(self) -> dict:
        """Flat dict name → NumPy array."""

    def load_weights(self, weights: dict) -> Any:
        """Load weights exported by any backend; returns the module."""


class CausalSelfAttention:
    """The article's causal (masked) self-attention, with optional dropout on the weights.

    Weights as ``SelfAttention``. Dropout applies only in training mode (``train()``/``eval()``
    in numpy_attn and torch_attn; in jax_attn only when ``forward`` gets an ``rng`` key).
    """

    def __init__(
        self, d_in: int, d_out_kq: int, d_out_v: int, *, dropout_p: float = 0.0, rng: Any = None
    ) -> None:
        """``rng``: the backend's random source for the initial weights."""

    def forward(self, x: Any, *, rng: Any = None) -> Any:
        """``x: (..., seq, d_in)`` → ``(..., seq, d_out_v)``; ``rng`` feeds dropout."""

    def backward(self, x: Any, grad_output: Any) -> dict:
        """Weight gradients (no dropout): ``grad_output: (..., seq, d_out_v)``."""

    def export_weights(self) -> dict:
        """Flat dict name → NumPy array."""

    def load_weights(self, weights: dict) -> Any:
        """Load weights exported by any backend; returns the module."""


class MultiHeadAttentionWrapper:
    """The article's multi-head wrapper: ``num_heads`` independent ``SelfAttention`` heads.

    Outputs are concatenated on the last axis: ``(..., seq, num_heads * d_out_v)``.
    Weights: ``heads.{h}.W_query``, ``heads.{h}.W_key``, ``heads.{h}.W_value``.
    """

    def __init__(
        self, d_in: int, d_out_kq: int, d_out_v: int, num_heads: int, *, rng: Any = None
    ) -> None:
        """``rng``: the backend's random source for the initial weights."""

    def forward(self, x: Any) -> Any:
        """``x: (..., seq, d_in)`` → ``(..., seq, num_heads * d_out_v)``."""

    def backward(self, x: Any, grad_output: Any) -> dict:
        """Weight gradients ``heads.{h}.W_*``: ``grad_output: (..., seq, num_heads * d_out_v)``."""

    def export_weights(self) -> dict:
        """Flat dict name → NumPy array."""

    def load_weights(self, weights: dict) -> Any:
        """Load weights exported by any backend; returns the module."""


class MultiHeadAttention:
    """Production-style multi-head attention with fused projections.

    ``head_dim = d_model // num_heads``; ``num_kv_heads`` (default ``num_heads``) must divide
    ``num_heads`` (grouped-query / multi-query attention). Weights: ``W_query (d_model,
    num_heads·head_dim)``, ``W_key``/``W_value (d_model, num_kv_heads·head_dim)``,
    ``W_out (num_heads·head_dim, d_model)``, and with ``bias=True`` ``b_query``, ``b_key``,
    ``b_value``, ``b_out`` of matching output sizes. Self-attention when ``context`` is None,
    cross-attention otherwise.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        bias: bool = True,
        dropout_p: float = 0.0,
        rng: Any = None,
    ) -> None:
        """``rng``: the backend's random source for the initial weights."""

    def forward(
        self,
        x: Any,
        context: Any = None,
        *,
        mask: Any = None,
        is_causal: bool = False,
        causal_alignment: str = "top_left",
        window: tuple | None = None,
        return_weights: bool = False,
        rng: Any = None,
    ) -> Any:
        """Attention of ``x`` over ``context`` (or over itself).

        Args:
          x: ``(..., q_len, d_model)``.
          context: ``(..., kv_len, d_model)`` or ``None`` for self-attention.
          mask: boolean, broadcastable to ``(..., num_heads, q_len, kv_len)``.
          is_causal, causal_alignment, window: as in ``scaled_dot_product_attention``.
          return_weights: also return weights ``(..., num_heads, q_len, kv_len)``.
          rng: random source for dropout.

        Returns:
          ``(..., q_len, d_model)`` (and the weights).
        """

    def backward(
        self,
        x: Any,
        grad_output: Any,
        context: Any = None,
        *,
        mask: Any = None,
        is_causal: bool = False,
        causal_alignment: str = "top_left",
        window: tuple | None = None,
    ) -> dict:
        """Weight gradients of ``forward(x, context, ...)`` (no dropout).

        ``grad_output: (..., q_len, d_model)``; returns name → NumPy array for every weight.
        """

    def export_weights(self) -> dict:
        """Flat dict name → NumPy array."""

    def load_weights(self, weights: dict) -> Any:
        """Load weights exported by any backend; returns the module."""


# --------------------------------------------------------------------------------------------
# Incremental decoding: a key/value cache and the modules' ``decode`` method.
# --------------------------------------------------------------------------------------------

#: Public classes that are not modules (no weights).
CLASSES = ("KVCache",)

#: Modules with a ``decode`` method (``DecodingModule.decode`` gives its signature).
DECODING_MODULES = ("CausalSelfAttention", "MultiHeadAttention")

DECODING = (
    "A KVCache preallocates keys (..., kv_heads, max_len, head_dim) and values (..., kv_heads, "
    "max_len, v_dim) and fills them left to right. append(key, value) returns the cache holding "
    "the new positions: numpy_attn and torch_attn write in place and return the same cache; "
    "jax_attn caches are immutable pytrees (length is a traced int32 scalar, so a jitted "
    "decoding step compiles once per chunk size) and return a new cache. Write "
    "`cache = cache.append(key, value)` to be portable. "
    "module.decode(x, cache) projects the new tokens x (..., n, d), appends their keys and "
    "values, and attends with the bottom-right causal rule over every cached position, so "
    "decoding a sequence token by token, or in chunks, equals forward(x, is_causal=True) "
    "(CausalSelfAttention: forward(x)). decode never applies dropout. It returns "
    "(output, cache); cache=None starts a cache of max_len positions (default: n). "
    "The cache holds values only, never autograd history (torch_attn stores detached "
    "copies), so a decoding loop's memory does not grow with the number of steps; torch_attn's "
    "decode records a graph only when a gradient is requested (grad mode on and the module in "
    "training mode; in eval() it runs as under torch.no_grad()), and then the cached positions "
    "are constants of that graph."
)

#: What appending past ``max_len`` does, in every backend.
CACHE_OVERFLOW = (
    "An append whose length + n exceeds max_len never writes silently. Where length is a "
    "concrete number (numpy_attn and torch_attn always, jax_attn outside jit) it is a "
    "ValueError naming max_len, raised before anything changes: the cache stays as it was. "
    "Under jax.jit, where length is traced and nothing can raise, the append makes the overflow "
    "impossible to miss: length still grows past max_len, so `cache.overflowed` (length > "
    "max_len, a traced bool) is True from then on; the write puts NaN in the last n positions "
    "of both buffers (lax.dynamic_update_slice clamps the start), so every later decode output "
    "is NaN (never a finite wrong number); and the write starts at the true, out-of-bounds "
    "position, which jax.experimental.checkify reports when the step is wrapped in "
    "checkify.checkify(step, errors=checkify.index_checks). `overflowed` exists in every "
    "backend (always False where an overflow raises)."
)


class KVCache:
    """Keys and values of the positions decoded so far, preallocated to ``max_len``.

    Attributes (read-only): ``keys`` ``(..., kv_heads, length, head_dim)`` and ``values``
    ``(..., kv_heads, length, v_dim)`` are views of the filled part (jax_attn: slices, outside
    jit only); ``length`` the number of filled positions (jax_attn: an int32 scalar array);
    ``max_len`` the capacity; ``overflowed`` True once an append went past ``max_len``
    (``CACHE_OVERFLOW``).
    """

    @classmethod
    def empty(
        cls,
        batch_shape: tuple,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        v_dim: int | None = None,
        *,
        dtype: Any = "float32",
        device: Any = None,
    ) -> Any:
        """An empty cache: buffers ``(*batch_shape, kv_heads, max_len, head_dim | v_dim)`` of zeros.

        ``v_dim`` defaults to ``head_dim``; ``dtype`` a dtype name or the backend's dtype;
        ``device`` as in ``causal_mask``.
        """

    def append(self, key: Any, value: Any) -> Any:
        """Add ``key (..., kv_heads, n, head_dim)`` and ``value (..., kv_heads, n, v_dim)``.

        Cast to the cache's dtype. Returns the cache (see ``DECODING``); ValueError when
        ``length + n > max_len`` (under ``jax.jit``: see ``CACHE_OVERFLOW``) or when the shapes
        do not match the cache.
        """


class DecodingModule:
    """The ``decode`` method of the modules named in ``DECODING_MODULES``."""

    def decode(self, x: Any, cache: Any = None, *, max_len: int | None = None) -> Any:
        """Attend the new tokens ``x`` over the cached ones and themselves (bottom-right causal).

        Args:
          x: ``(..., n, d_in)`` (``d_model`` for MultiHeadAttention): the next ``n`` tokens.
          cache: a ``KVCache`` from an earlier ``decode`` (``kv_heads`` = ``num_kv_heads``;
            CausalSelfAttention: 1 head of ``d_out_kq``/``d_out_v``), or None for a new one.
          max_len: capacity of the new cache when ``cache`` is None (default ``n``).

        Returns:
          ``(output, cache)``: ``output (..., n, d_out)`` as ``forward`` gives for these
          positions, and the cache holding every position so far.
        """


# --------------------------------------------------------------------------------------------
# Concurrency and determinism: what a caller may rely on when the same inputs come back, and
# when several threads call at once (a server, a data loader). ``conformance/repeat.py`` checks
# the bitwise promises of REPEATABLE for every backend.
# --------------------------------------------------------------------------------------------

#: What each backend guarantees on CPU, in words: repeatability, thread safety, and which
#: calls may run concurrently.
CONCURRENCY = {
    "numpy_attn": (
        "Every function is pure and may be called from any number of threads at once. The same "
        "inputs (values, shapes, dtypes and arguments) give the same bits in every call of one "
        "process, whatever other threads are doing: the fast path (BLOCKED_COMPUTATION) fixes "
        "its blocks, its BLAS thread count (one) and the order of every sum (its tasks are "
        "dealt into one lane per core the process may use, each lane summing into its own "
        "copy, the copies added in lane order) from the shapes and the core count alone, never "
        "from how many threads are free or which thread ran a block, and concurrent fast-path "
        "calls take turns through its one pool (a lock; one call already keeps every core "
        "busy). The BLAS thread limit: see BLAS_LIMIT. Without threadpoolctl the blocks run in "
        "the calling thread with BLAS as configured, which gives the same bits call after call "
        "as long as nobody changes the BLAS thread count. Bits may differ between machines "
        "(core count, BLAS build) and NumPy versions. "
        "Modules' forward and backward only read the weights and "
        "may run concurrently; load_weights, KVCache.append and decode write in place (one "
        "thread per cache). Dropout: the same seeded Generator state gives the same bits; a "
        "numpy Generator is not thread-safe, so give each thread its own."
    ),
    "jax_attn": (
        "Every function is pure; arrays and KVCache are immutable, so any thread may use them, "
        "and jitted functions may be called from several threads at once. On CPU the same "
        "compiled function gives the same bits for the same inputs, call after call and from "
        "several threads at once (XLA fixes its algorithms and its work split at compile "
        "time). An eager call and a jitted one, or two different jit boundaries around the "
        "same function, may differ in the last bits (XLA fuses differently). On GPU XLA may "
        "use non-deterministic reductions unless XLA_FLAGS=--xla_gpu_deterministic_ops=true "
        "(not checked here). Dropout: the same key gives the same bits."
    ),
    "torch_attn": (
        "Functions and modules' forward may be called from several threads at once (autograd "
        "is thread-safe; each thread builds its own graph). On CPU the same inputs give the "
        "same bits call after call and from several threads at once, for a fixed "
        "torch.get_num_threads() (another thread count may change the bits: set it once, before "
        "the threads start). On CUDA the fused SDPA kernels' backward may be non-deterministic "
        "unless torch.use_deterministic_algorithms(True) (not checked here). KVCache.append and "
        "decode write the cache in place (one thread per cache); load_weights writes the "
        "parameters. Dropout with rng=None draws from torch's global generator, shared by all "
        "threads: pass a torch.Generator per thread for repeatable masks."
    ),
}

#: numpy_attn's BLAS thread limit during the fast path, and who else it touches.
BLAS_LIMIT = (
    "The fast path runs its blocks on a pool of threads with BLAS limited to one thread, so the "
    "two levels of threading do not oversubscribe the cores. Where the BLAS library has a "
    "per-thread setting (OpenBLAS built with OpenMP) only the pool's threads and the calling "
    "thread are limited: no other thread sees a change. The OpenBLAS that NumPy's wheels "
    "bundle (pthreads; its openblas_set_num_threads_local is process-wide too), and MKL and "
    "BLIS as threadpoolctl sets them, have a process-wide setting only: it is set to one while "
    "a call's blocks run, and only then (not while the inputs are prepared or the results "
    "assembled), and restored after; during that span, matrix products of other threads also "
    "run on one BLAS thread (and give that thread count's bits). Without threadpoolctl "
    "nothing is changed (the blocks run in the calling thread)."
)

#: The bitwise-repeat promises the harness checks (``python -m conformance.repeat``), per
#: backend: the same inputs give the same bits in these modes. ``sequential``: calls one after
#: the other, each on a new copy of the inputs; ``threads``: the same calls from several threads
#: at once, compared with the sequential results. The checked calls (REPEAT_CALLS) are
#: ``scaled_dot_product_attention`` and ``scaled_dot_product_attention_vjp``, on shapes that take
#: each backend's fast path and shapes that do not, causal and not (jax_attn: jitted).
REPEATABLE = {
    "numpy_attn": ("sequential", "threads"),
    "jax_attn": ("sequential", "threads"),
    "torch_attn": ("sequential", "threads"),
}
REPEAT_CALLS = ("scaled_dot_product_attention", "scaled_dot_product_attention_vjp")


# --------------------------------------------------------------------------------------------
# Context parallelism: one sequence split across devices (docs/context_parallel.md).
# --------------------------------------------------------------------------------------------

#: The public functions of context parallelism, in every backend. Their signatures are the
#: stubs below with ``devices`` replaced by the backend's own parameters
#: (``CONTEXT_PARALLEL_DEVICES``); the rest of each signature is shared.
CONTEXT_PARALLEL_FUNCTIONS = ("context_parallel_attention", "context_parallel_attention_vjp")

#: How each backend names its devices: these parameters replace ``devices`` in the stubs
#: (numpy_attn's ``trace``, a list that receives the schedule's events, comes last).
CONTEXT_PARALLEL_DEVICES = {
    "numpy_attn": ("world_size", "trace"),
    "jax_attn": ("mesh", "axis_name"),
    "torch_attn": ("group",),
}

#: How keys and values reach the queries of every rank.
CONTEXT_PARALLEL_STRATEGIES = {
    "ring": "at step s rank r holds the key/value block of rank r - s and passes it to r + 1 "
    "(jax: lax.ppermute; torch: batch_isend_irecv); steps after the last one any rank needs are "
    "dropped; the backward pass runs the ring again with dK and dV travelling with their blocks, "
    "then sends them home.",
    "all_gather": "every rank gathers every key/value block (lax.all_gather, all_gather_single); "
    "the backward pass gathers again and reduce-scatters dK and dV to their owners.",
    "ulysses": "an all-to-all turns (all heads, 1/N of the sequence) into (1/N of the heads, the "
    "whole sequence), each rank attends, a second all-to-all turns the output back; heads and "
    "kv_heads must be multiples of N (ValueError otherwise).",
}

#: The sequence layout: rank r's shard of the sequence axis, with N ranks.
CONTEXT_PARALLEL_LAYOUT = (
    "Without load_balance rank r holds the contiguous chunk r of N; q_len and kv_len must be "
    "multiples of N. With load_balance=True (zig-zag, for causal attention) the sequence is cut "
    "into 2N chunks and rank r holds chunks r and 2N - 1 - r, concatenated; q_len and kv_len "
    "must be multiples of 2N. Otherwise ValueError. Positions in is_causal, window and "
    "kv_lengths are global (natural order); attention_rules.context_parallel.positions gives "
    "the layout order, x[..., positions, :]."
)


def context_parallel_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    devices: Any,
    strategy: str = "ring",
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    kv_lengths: Any = None,
    load_balance: bool = False,
) -> Any:
    """Attention over a sequence split along its sequence axis across ``N`` ranks.

    Equals ``blockwise_attention(query, key, value, kv_lengths=kv_lengths, ...)`` on the whole
    sequence within ``TOLERANCES``, every rank holding its shard of the sequence axis
    (``CONTEXT_PARALLEL_LAYOUT``) and the ranks exchanging blocks as ``strategy`` says
    (``CONTEXT_PARALLEL_STRATEGIES``). Per (query chunk, key chunk) pair each rank runs
    ``blockwise_attention``'s online softmax and keeps the log-sum-exp; partial results merge
    exactly (``lse = logaddexp(lse_a, lse_b)``, ``out = Σ exp(lse_x - lse)·out_x``). A pair that
    the causal rule or the window masks entirely is not computed. Fully masked rows give exactly
    0; float16/bfloat16 compute in float32 and return the input dtype.

    The devices (``CONTEXT_PARALLEL_DEVICES``): numpy_attn simulates ``world_size`` ranks in
    one process on the whole (layout-ordered) arrays; jax_attn takes whole arrays and a
    ``jax.sharding.Mesh`` and runs under ``jax.shard_map`` on the axis ``axis_name`` (jit-able,
    differentiable through a ``jax.custom_vjp``; ValueError when the mesh lacks the axis);
    torch_attn is called on every rank of a ``torch.distributed`` process group with that
    rank's shards and returns its shard (differentiable through a ``torch.autograd.Function``);
    shards that differ across ranks raise ValueError on every rank, and a rank that never calls
    makes the others fail when the group's timeout expires.

    Args:
      query: ``(batch, heads, q_len, head_dim)`` in layout order (torch: the rank's shard
        ``(batch, heads, q_len / N, head_dim)``).
      key: ``(batch, kv_heads, kv_len, head_dim)`` (torch: ``kv_len / N``).
      value: ``(batch, kv_heads, kv_len, v_dim)`` (torch: ``kv_len / N``).
      devices: the backend's parameters of ``CONTEXT_PARALLEL_DEVICES``.
      strategy: a key of ``CONTEXT_PARALLEL_STRATEGIES`` (ValueError otherwise).
      is_causal, causal_alignment, window, scale, softcap: as in
        ``scaled_dot_product_attention``, on global positions.
      kv_lengths: ``(batch,)`` ints in ``[0, kv_len]`` (global), the same on every rank.
      load_balance: the zig-zag layout (``CONTEXT_PARALLEL_LAYOUT``).

    Returns:
      ``(batch, heads, q_len, v_dim)`` in layout order (torch: the rank's shard), input dtype.
    """


def context_parallel_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    *,
    devices: Any,
    strategy: str = "ring",
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    kv_lengths: Any = None,
    load_balance: bool = False,
) -> Any:
    """Gradients of ``context_parallel_attention``: the forward pass, then the strategy's
    backward pass (numpy_attn by hand; jax_attn through ``jax.vjp``; torch_attn through
    ``torch.autograd.grad``).

    Args:
      query: ``(batch, heads, q_len, head_dim)`` (torch: the rank's shard).
      key: ``(batch, kv_heads, kv_len, head_dim)``.
      value: ``(batch, kv_heads, kv_len, v_dim)``.
      grad_output: ``(batch, heads, q_len, v_dim)``, in layout order like query.
      devices, strategy, is_causal, causal_alignment, window, scale, softcap, kv_lengths,
        load_balance: as in ``context_parallel_attention``.

    Returns:
      ``(grad_query, grad_key, grad_value)`` shaped like query, key and value, in their dtype.
    """


# --------------------------------------------------------------------------------------------
# Backend-specific extras: public names that exist in one backend only, because they concern
# that framework alone. The signature test allows exactly these beyond the spec.
# --------------------------------------------------------------------------------------------

BACKEND_EXTRAS = {
    # NumPy has no autodiff: a minimal optimiser so NumPy-only users can train with the
    # modules' hand-written ``backward`` methods.
    "numpy_attn": ("sgd_step", "Adam"),
    "jax_attn": (),
    "torch_attn": ("weights_from_torch_multihead",),
}

# Integrations: backend-specific adapters to one host framework each, in the backend's
# ``integrations`` subpackage (``torch_attn.integrations.transformers``). They are not in the
# backend's ``__all__``: ``import torch_attn`` imports neither them nor their host framework
# (the optional extras ``transformers`` and ``flax`` of pyproject.toml install the hosts).
# backend → module → its public names. docs/integrations.md shows how they map onto this spec.
BACKEND_INTEGRATIONS = {
    "numpy_attn": {},
    "jax_attn": {"flax": ("attention_fn", "use_jax_attn")},
    "torch_attn": {"transformers": ("NAME", "attention_forward", "attention_mask", "register")},
}

# --------------------------------------------------------------------------------------------
# Checking another implementation against this spec (docs/checking.md)
# --------------------------------------------------------------------------------------------

PLUGIN_CONTRACT = (
    "Any importable module can be checked: python -m conformance --backend mypkg.attention. It "
    "must define scaled_dot_product_attention with the signature above; every other name of "
    "FUNCTIONS and MODULES is optional, and the harness runs exactly the steps the module "
    "provides and lists the rest once as not provided. It takes and returns NumPy arrays, or "
    "defines asarray(numpy_array) and to_numpy(x) for its own array type (and rng(seed) for "
    "dropout). It may declare UNSUPPORTED, a set of names of PLUGIN_FEATURES, or raise "
    "NotImplementedError: those cells are reported as unsupported, not failed. With "
    'LAYOUT = "bshd" its query, key, value (and their gradients and the output) are '
    "(..., seq, heads, head_dim); masks, bias and weights keep (..., heads, q_len, kv_len)."
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
    "errors": "the bad inputs of ERRORS (exception type and message)",
    "float64": "float64 inputs",
    "float32": "float32 inputs",
    "bfloat16": "bfloat16 inputs",
    "float16": "float16 inputs",
}
