"""The single validation entry point of the attention functions that take query, key and value.

``scaled_dot_product_attention``, ``scaled_dot_product_attention_vjp``,
``blockwise_attention`` and ``blockwise_attention_vjp`` of every backend describe their arrays
as ``(shape, dtype name)`` and hand them, with the Python options, to
``attention_arguments``: it raises the spec's exception for the first rule broken (in a fixed
order, so every backend reports the same one) or returns the normalised values.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .checks import (
    ArrayInfo,
    Shape,
    check_dropout,
    check_dropout_mask,
    check_flag,
    check_float_inputs,
    check_grad_output,
    check_int,
    check_key_value,
    check_kv_lengths,
    check_mask_bias,
    check_query_key,
    check_scale,
    check_sinks,
    check_softcap,
    check_structure,
    heads_of,
    scores_shape,
)
from .mods import check_alibi_slopes, check_chunk_size, check_mod, check_segment_ids
from .tiles import Window

_NOT_BLOCKWISE = object()  # default of block_q and block_kv: not a blockwise call


class Arguments(NamedTuple):
    """The validated, normalised arguments of one call."""

    dtype: str  # the dtype query, key and value share (as given)
    scores_shape: Shape  # (..., heads, q_len, kv_len)
    output_shape: Shape  # (..., heads, q_len, v_dim)
    is_causal: bool
    causal_alignment: str
    window: Window  # (left, right) of ints or None
    scale: float  # head_dim ** -0.5 when not given (1.0 for head_dim 0)
    softcap: float | None
    dropout_p: float
    return_weights: bool
    block_q: int | None  # blockwise only
    block_kv: int | None  # blockwise only
    return_lse: bool = False  # also return the row log-sum-exp
    has_sinks: bool = False  # sinks given: one logit per head joins every row's softmax
    chunk_size: int | None = None  # chunked local attention (spec.CHUNKED)
    has_alibi: bool = False  # alibi_slopes given (spec.ALIBI)
    has_segments: bool = False  # segment_ids given (spec.SEGMENT_IDS)
    score_mod: Any = None  # callable(score, batch, head, q_idx, kv_idx) (spec.SCORE_MOD)
    mask_mod: Any = None  # callable(batch, head, q_idx, kv_idx) -> bool (spec.MASK_MOD)

    @property
    def has_mods(self) -> bool:
        """Any of chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod given."""
        return (self.chunk_size is not None or self.has_alibi or self.has_segments
                or self.score_mod is not None or self.mask_mod is not None)

    @property
    def masks_tiles(self) -> bool:
        """A rule that may empty whole tiles beyond the band: chunks, segments, mask_mod."""
        return self.chunk_size is not None or self.has_segments or self.mask_mod is not None


def attention_arguments(
    fn: str,
    query: ArrayInfo,
    key: ArrayInfo,
    value: ArrayInfo,
    *,
    grad_output: ArrayInfo | None = None,
    mask: ArrayInfo | None = None,
    bias: ArrayInfo | None = None,
    is_causal: object = False,
    causal_alignment: object = "top_left",
    window: object = None,
    scale: object = None,
    softcap: object = None,
    dropout_p: object = 0.0,
    dropout_mask: ArrayInfo | None = None,
    return_weights: object = False,
    kv_lengths: ArrayInfo | None = None,
    sinks: ArrayInfo | None = None,
    return_lse: object = False,
    block_q: object = _NOT_BLOCKWISE,
    block_kv: object = _NOT_BLOCKWISE,
    chunk_size: object = None,
    alibi_slopes: ArrayInfo | None = None,
    segment_ids: tuple[ArrayInfo, ArrayInfo, bool] | None = None,
    score_mod: object = None,
    mask_mod: object = None,
) -> Arguments:
    """Every rule of the spec for one call, in order; the normalised arguments.

    Args:
      fn: the public function's name, which starts every message.
      query, key, value: ``(shape, dtype name)``.
      grad_output: ``(shape, dtype name)`` for a VJP (then dropout needs ``dropout_mask``).
      mask, bias, dropout_mask, kv_lengths, sinks: ``(shape, dtype name)`` or None.
      is_causal, causal_alignment, window, scale, softcap, dropout_p, return_weights,
        return_lse: the caller's values, as given.
      block_q, block_kv: ``blockwise_attention``'s tile sizes (not given elsewhere).
      chunk_size, score_mod, mask_mod: as given; alibi_slopes: ``(shape, dtype name)`` or
        None; segment_ids: ``(query ids, key ids, one array)`` described, or None
        (``mods.split_segment_ids`` splits the caller's value).

    Returns:
      ``Arguments``; raises TypeError or ValueError as ``spec.ERRORS`` says.
    """
    dtypes = {"query": query[1], "key": key[1], "value": value[1]}
    if grad_output is not None:
        dtypes["grad_output"] = grad_output[1]
    dtype = check_float_inputs(fn, **dtypes)
    q_shape, k_shape, v_shape = tuple(query[0]), tuple(key[0]), tuple(value[0])
    check_query_key(fn, q_shape, k_shape)
    check_key_value(fn, k_shape, v_shape)
    output_shape = q_shape[:-1] + v_shape[-1:]  # (..., heads, q_len, v_dim)
    if grad_output is not None:
        check_grad_output(fn, grad_output[0], output_shape)
    target = scores_shape(q_shape, k_shape)  # (..., heads, q_len, kv_len)
    check_mask_bias(fn, mask, bias, target)
    check_sinks(fn, sinks, heads_of(q_shape))
    check_alibi_slopes(fn, alibi_slopes, heads_of(q_shape))
    if segment_ids is not None:
        check_segment_ids(fn, segment_ids[0], segment_ids[1], q_shape, k_shape, segment_ids[2])
    is_causal, causal_alignment, window = check_structure(fn, is_causal, causal_alignment, window)
    chunk_size = check_chunk_size(fn, chunk_size)
    score_mod = check_mod(fn, "score_mod", score_mod)
    mask_mod = check_mod(fn, "mask_mod", mask_mod)
    scale = check_scale(fn, scale, q_shape[-1])
    softcap = check_softcap(fn, softcap)
    dropout_p = check_dropout(fn, dropout_p, dropout_mask is not None)
    if grad_output is not None and dropout_p > 0 and dropout_mask is None:
        raise ValueError(
            f"{fn}: dropout needs the forward pass's dropout_mask; got dropout_p={dropout_p!r}, "
            f"dropout_mask=None"
        )
    check_dropout_mask(fn, dropout_mask, target)
    return_weights = check_flag(fn, "return_weights", return_weights)
    return_lse = check_flag(fn, "return_lse", return_lse)
    blockwise = block_q is not _NOT_BLOCKWISE
    block_q = check_int(fn, "block_q", block_q, minimum=1) if blockwise else None
    block_kv = check_int(fn, "block_kv", block_kv, minimum=1) if blockwise else None
    check_kv_lengths(fn, kv_lengths, q_shape[:-3])
    return Arguments(
        dtype, target, output_shape, is_causal, causal_alignment, window, scale, softcap,
        dropout_p, return_weights, block_q, block_kv, return_lse, sinks is not None,
        chunk_size, alibi_slopes is not None, segment_ids is not None, score_mod, mask_mod,
    )
