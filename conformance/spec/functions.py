"""Public functions (stubs).

Backends implement each with exactly this signature (``tests/test_signatures.py`` checks it).
"""

from __future__ import annotations

from typing import Any

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
    "merge_attention",
    "merge_attention_vjp",
    # packed variable-length batches: their stubs are in varlen.py (the next chapter)
    "varlen_attention",
    "varlen_attention_vjp",
    "pack_sequences",
    "unpack_sequences",
    "paged_attention",  # the paged KV cache's kernel: its stub is in decoding.py
    # the rotary position embedding: its stubs are in rotary.py
    "rotary_embedding",
    "rotary_embedding_vjp",
    "rope_frequencies",
    "permute_for_rotary_layout",
    # quantised KV caches: their stubs are in quantized_cache.py
    "quantize_kv",
    "dequantize_kv",
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
    """The article's first causal method: zero the weights above the diagonal, renormalise.

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
    sinks: Any = None,
    return_lse: bool = False,
    chunk_size: int | None = None,
    alibi_slopes: Any = None,
    segment_ids: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
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
      sinks: ``(heads,)`` floating-point sink logits (``(1,)`` for 2-D inputs), or ``None``
        (``SINKS``): each joins its head's softmax denominators as a column without a value.
      return_lse: also return the row log-sum-exp (``LOG_SUM_EXP``).
      chunk_size: keys per chunk of chunked local attention (``CHUNKED``), or None.
      alibi_slopes: ``(heads,)`` ALiBi slopes (``ALIBI``), or None.
      segment_ids: ``(..., seq)`` ints or a pair for queries and keys (``SEGMENT_IDS``).
      score_mod, mask_mod: FlexAttention's callables (``SCORE_MOD``, ``MASK_MOD``), or None.

    Returns:
      ``output``: ``(..., heads, q_len, v_dim)`` in the input dtype; with
      ``return_weights=True`` or ``return_lse=True`` a tuple ``(output[, weights][, lse])``:
      weights ``(..., heads, q_len, kv_len)`` in the input dtype, lse ``(..., heads, q_len)``
      in the compute dtype (``-inf`` on a fully masked row without sinks).
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
    sinks: Any = None,
    chunk_size: int | None = None,
    alibi_slopes: Any = None,
    segment_ids: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
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
        dropout_mask, sinks, chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod: as
        in ``scaled_dot_product_attention`` (no gradient for the slopes; ``SCORE_MOD``).

    Returns:
      ``(grad_query, grad_key, grad_value, grad_bias)`` shaped like query, key, value and
      bias (``grad_bias`` is None without a bias), and with ``sinks`` a fifth element,
      ``grad_sinks`` ``(heads,)`` in the sinks' dtype; grouped-query heads add their key/value
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
    sinks: Any = None,
    return_lse: bool = False,
    chunk_size: int | None = None,
    alibi_slopes: Any = None,
    segment_ids: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
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
      sinks, return_lse: as in ``scaled_dot_product_attention`` (the sinks join each row's
        denominator once, after the last tile).
      chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod: per tile (TILE_SKIPPING).

    Returns:
      ``(..., heads, q_len, v_dim)`` in the input dtype; with ``return_lse``, ``(output,
      lse)``, lse ``(..., heads, q_len)`` in the compute dtype.
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
    sinks: Any = None,
    chunk_size: int | None = None,
    alibi_slopes: Any = None,
    segment_ids: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
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
        block_kv, sinks, chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod: as in
        ``blockwise_attention``.

    Returns:
      ``(grad_query, grad_key, grad_value, grad_bias)`` shaped like query, key, value and
      bias, in their dtypes (``grad_bias`` is None without a bias), and with ``sinks``
      ``grad_sinks`` ``(heads,)`` as a fifth element.
    """


def merge_attention(outputs: Any, lses: Any, *, sinks: Any = None) -> Any:
    """Attention over the union of disjoint key sets, from the partial results over each set.

    ``MERGING``: with ``m = max_i lse_i``, ``lse = m + log(sum_i exp(lse_i - m))`` and
    ``output = sum_i exp(lse_i - lse) · outputs[i]``; parts with lse ``-inf`` contribute
    nothing (all ``-inf``: output 0, lse ``-inf``). ``sinks`` are applied once, here.

    Args:
      outputs: a list or tuple of partial outputs, each ``(..., heads, q_len, v_dim)`` (or
        ``(q_len, v_dim)``), one floating dtype.
      lses: a list or tuple of their row log-sum-exps, each ``(..., heads, q_len)``, natural
        log, computed without sinks (``scaled_dot_product_attention(..., return_lse=True)``).
      sinks: ``(heads,)`` sink logits, or ``None``.

    Returns:
      ``(output, lse)``: ``(..., heads, q_len, v_dim)`` in the outputs' dtype and
      ``(..., heads, q_len)`` in its compute dtype.
    """


def merge_attention_vjp(
    outputs: Any, lses: Any, grad_output: Any, *, grad_lse: Any = None, sinks: Any = None
) -> Any:
    """Gradients of ``merge_attention`` with respect to the partial outputs, their lses and
    the sinks (numpy_attn by hand; jax_attn ``jax.vjp``; torch_attn ``torch.autograd``).

    With ``a_i = exp(lse_i - lse)`` and ``a_s = exp(sink - lse)``: ``d outputs[i] = a_i
    dO``, ``d lses[i] = a_i (rowsum(dO ⊙ (outputs[i] - O)) + dlse)``, ``d sink = sum a_s
    (dlse - rowsum(dO ⊙ O))`` over batch and queries; a part with lse ``-inf`` gets 0.

    Args:
      outputs, lses, sinks: as in ``merge_attention``.
      grad_output: ``(..., heads, q_len, v_dim)``: the cotangent of the merged output.
      grad_lse: ``(..., heads, q_len)``: the cotangent of the merged lse, or ``None`` (0).

    Returns:
      ``(grad_outputs, grad_lses)``, two tuples shaped and typed like ``outputs`` and
      ``lses``, and with ``sinks`` ``grad_sinks`` ``(heads,)`` as a third element.
    """
