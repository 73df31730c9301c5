"""Memory-efficient attention in PyTorch: keys and values in blocks, with the online softmax.

Plain attention holds a ``(q_len, kv_len)`` score matrix per head (4 GiB per head at 32,768
tokens in float32). ``blockwise_attention`` visits ``(block_q, block_kv)`` tiles instead and
keeps, per query row, a running maximum ``m``, a running sum ``l`` and a running weighted sum
``acc`` of the values (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022)::

    s      = mask(softcap(q kᵀ · scale) + bias)         one tile
    m_new  = max(m, rowmax(s))
    p      = exp(s - m_new)
    l      = l · exp(m - m_new) + rowsum(p)
    acc    = acc · exp(m - m_new) + p v
    output = acc / l                                    (0 where l == 0: a fully masked row)

Extra memory is a few ``(..., heads, block_q, block_kv)`` tiles. Masks are structure, not
arrays: the causal rule (both alignments), the sliding window and per-sequence key lengths
(``kv_lengths``) are evaluated per tile, and a tile that the causal rule or the window masks
entirely is never computed. The backward pass keeps only the log-sum-exp ``lse = m + log l``
of each row and recomputes every tile's weights as ``exp(s - lse)``: a custom
``torch.autograd.Function`` (``_tiles.BlockwiseFunction``), so autograd never stores a tile.
``scaled_dot_product_attention``'s fast path (``_fast``) runs the same Function for large
inputs with a soft-cap, a window or bottom-right causal with ``q_len != kv_len``, its boolean
``mask`` sliced per tile like the bias (torch only: the public functions here take none);
``context_parallel.py`` runs ``forward_tiles`` and ``backward_tiles`` on pairs of chunks.
"""

from __future__ import annotations

from typing import Any

import torch

import attention_rules as rules

from ._arrays import _array, _as_tensor, _describe, _describe_lengths
from ._masking import _describe_segments, _Mods, _mods, _mods_capture_grads, _plan_with_mods
from ._steps import _with_sinks
from ._tiles import BlockwiseFunction

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_KV = 1024


# ------------------------------------------------------------------------------------------
# Public functions
# ------------------------------------------------------------------------------------------


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
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
    sinks: Any = None,
    return_lse: bool = False,
    chunk_size: int | None = None,
    alibi_slopes: Any = None,
    segment_ids: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention in ``(block_q, block_kv)`` tiles, with the online softmax.

    Equal to ``scaled_dot_product_attention(query, key, value, mask=padding_mask(kv_lengths,
    kv_len), bias=bias, ...)`` (no dropout, no weights), using a few tiles of extra memory
    instead of the ``(q_len, kv_len)`` matrix; tiles that the causal rule or the window mask
    entirely are skipped. Differentiable: the backward pass recomputes each tile.

    Args:
      query: ``(..., heads, q_len, head_dim)`` or ``(q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)`` or ``(kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)`` or ``(kv_len, v_dim)``.
      bias: floating point, broadcastable to ``(..., heads, q_len, kv_len)``; sliced per tile.
      kv_lengths: ints shaped like the batch axes ``(...)`` (``(batch,)`` for 4-D inputs), each
        in ``[0, kv_len]``: key ``j`` of sequence ``b`` is attended only if
        ``j < kv_lengths[b]``.
      is_causal, causal_alignment, window, scale, softcap: as in
        ``scaled_dot_product_attention``.
      block_q: queries per tile (``>= 1``).
      block_kv: keys per tile (``>= 1``).
      sinks: ``(heads,)`` sink logits, joined to each row's denominator after the last tile
        (autograd, beyond the tiles' Function).
      return_lse: also return each row's log-sum-exp (differentiable).
      chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod: as in
        ``scaled_dot_product_attention``, per tile; the tiles that chunks, segment ids or
        ``mask_mod`` mask entirely are skipped. A mod capturing a tensor that requires grad,
        under grad mode: NotImplementedError (``spec.SCORE_MOD``).

    Returns:
      ``(..., heads, q_len, v_dim)`` in the input dtype (fully masked rows give 0), and with
      ``return_lse`` the lse ``(..., heads, q_len)`` in the compute dtype.
    """
    fn = "blockwise_attention"
    args = _arguments(fn, query, key, value, None, bias, kv_lengths, is_causal, causal_alignment,
                      window, scale, softcap, block_q, block_kv, sinks, return_lse,
                      (chunk_size, alibi_slopes, segment_ids, score_mod,
                       mask_mod))  # every rule of the spec, once
    if _mods_capture_grads(args):  # the tiles' Function gives its inputs gradients, no others
        raise NotImplementedError(
            f"{fn}: a score_mod capturing a tensor that requires grad gets no "
            f"gradient from the tiles' custom backward pass; use scaled_dot_product_attention "
            f"(autograd through the explicit steps), or detach the captured tensor")
    query, key, value, bias = _array(query), _array(key), _array(value), _array(bias)
    mods = _mods(fn, args, query, key, alibi_slopes, rules.segment_pair(segment_ids))
    bias, kv_lengths, plan, lo, hi = _prepare(fn, query, key, bias, kv_lengths, args, mods)
    config = (plan, lo, hi, args.scale, args.softcap)
    output, lse = _with_sinks(  # the sinks join once, at the end
        *BlockwiseFunction.apply(query, key, value, bias, None, kv_lengths, config, mods),
        _array(sinks))
    output = output.to(query.dtype)
    return (output, lse[..., 0]) if args.return_lse else output


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
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
    sinks: Any = None,
    chunk_size: int | None = None,
    alibi_slopes: Any = None,
    segment_ids: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of ``blockwise_attention``, tile by tile, from the saved log-sum-exp.

    Through ``torch.autograd``: ``blockwise_attention`` is a custom ``autograd.Function`` whose
    backward recomputes each tile's weights as ``exp(s - lse)`` (numpy_attn's derivation).

    Args:
      query: ``(..., heads, q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)``.
      grad_output: ``(..., heads, q_len, v_dim)``.
      bias, kv_lengths, is_causal, causal_alignment, window, scale, softcap, block_q,
        block_kv, sinks, chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod: as in
        ``blockwise_attention``.

    Returns:
      ``(grad_query, grad_key, grad_value, grad_bias)`` shaped like query, key, value and bias
      (``grad_bias`` is None without a bias), in their dtypes, and with ``sinks`` a fifth,
      ``grad_sinks (heads,)``.
    """
    fn = "blockwise_attention_vjp"
    args = _arguments(fn, query, key, value, grad_output, bias, kv_lengths, is_causal,
                      causal_alignment, window, scale, softcap, block_q, block_kv, sinks, False,
                      (chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod))
    query, key, value, bias = _array(query), _array(key), _array(value), _array(bias)
    grad_output, bias_shape = _array(grad_output), None if bias is None else bias.shape
    mods = _mods(fn, args, query, key, alibi_slopes, rules.segment_pair(segment_ids))
    bias, kv_lengths, plan, lo, hi = _prepare(fn, query, key, bias, kv_lengths, args, mods)
    config = (plan, lo, hi, args.scale, args.softcap)
    # autograd through the custom Function; bias and sinks join the inputs only when given.
    given = {name: x.detach().requires_grad_(True) for name, x in
             (("bias", bias), ("sinks", _array(sinks))) if x is not None}
    inputs = [t.detach().requires_grad_(True) for t in (query, key, value)] + list(given.values())
    with torch.enable_grad():
        output, _ = _with_sinks(
            *BlockwiseFunction.apply(*inputs[:3], given.get("bias"), None, kv_lengths, config,
                                     mods), given.get("sinks"))
        grads = torch.autograd.grad(output.to(query.dtype), inputs, grad_outputs=grad_output,
                                    allow_unused=True)
    grads = dict(zip(["query", "key", "value", *given], (
        torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True)
    ), strict=True))
    result = (grads["query"], grads["key"], grads["value"],
              grads["bias"].reshape(bias_shape) if bias is not None else None)
    return result + ((grads["sinks"],) if sinks is not None else ())


# ------------------------------------------------------------------------------------------
# Arguments and the plan of tiles
# ------------------------------------------------------------------------------------------


def _arguments(
    fn: str, query: Any, key: Any, value: Any, grad_output: Any, bias: Any, kv_lengths: Any,
    is_causal: Any, causal_alignment: Any, window: Any, scale: Any, softcap: Any, block_q: Any,
    block_kv: Any, sinks: Any, return_lse: Any, extra: tuple = (None,) * 5,
) -> rules.Arguments:
    """``rules.attention_arguments`` for the forward pass (``grad_output`` None) and the VJP;
    ``extra``: ``(chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod)`` as given."""
    chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod = extra
    return rules.attention_arguments(
        fn, _describe(fn, "query", query), _describe(fn, "key", key),
        _describe(fn, "value", value),
        grad_output=None if grad_output is None else _describe(fn, "grad_output", grad_output),
        bias=_describe(fn, "bias", bias), is_causal=is_causal, causal_alignment=causal_alignment,
        window=window, scale=scale, softcap=softcap, kv_lengths=_describe_lengths(kv_lengths),
        block_q=block_q, block_kv=block_kv, sinks=_describe(fn, "sinks", sinks),
        return_lse=return_lse, chunk_size=chunk_size,
        alibi_slopes=_describe(fn, "alibi_slopes", alibi_slopes),
        segment_ids=_describe_segments(fn, segment_ids), score_mod=score_mod, mask_mod=mask_mod,
    )


def _prepare(
    fn: str, query: torch.Tensor, key: torch.Tensor, bias: torch.Tensor | None, kv_lengths: Any,
    args: rules.Arguments, mods: _Mods | None = None,
) -> tuple:
    """The full-rank bias, the checked ``kv_lengths`` and the tiles to compute with their band,
    without those ``mods`` mask entirely (``_masking._plan_with_mods``)."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if kv_lengths is not None:  # the range needs the values: checked here
        kv_lengths = _as_tensor(kv_lengths).to(query.device)  # torch: a mask, not an input
        rules.check_lengths(fn, "kv_lengths", kv_lengths.tolist(), kv_len)
    if bias is not None:  # full rank, so tiles slice the last two axes
        bias = bias.reshape((1,) * (len(args.scores_shape) - bias.ndim) + tuple(bias.shape))
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
    plan = rules.plan(q_len, kv_len, args.block_q, args.block_kv, lo, hi)
    if kv_lengths is not None and kv_lengths.numel():  # key blocks past every length: skipped
        longest = int(kv_lengths.max())
        plan = [(a, b, [t for t in blocks if t[0] < longest]) for a, b, blocks in plan]
    plan = _plan_with_mods(plan, mods, q_len, kv_len, args.block_q, args.block_kv, lo, hi)
    return bias, kv_lengths, plan, lo, hi
