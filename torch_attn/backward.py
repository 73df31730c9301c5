"""The backward pass of attention: ``torch.autograd`` through the forward composition.

numpy_attn writes this derivation out by hand (FlashAttention's backward); here PyTorch's
autograd differentiates the forward pipeline (``functional.pipeline``) itself, so the
conformance harness compares two independent gradient computations (three with jax_attn's
``jax.vjp``).
The forward's safe softmax keeps gradients of masked positions and fully masked rows at 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import attention_rules as rules

from ._arrays import _array, _as_tensor, _describe, _describe_parts, _to_numpy
from ._masking import _describe_segments, _mods
from .functional import merge_attention, pipeline


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
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of ``scaled_dot_product_attention`` with respect to its array inputs.

    Arguments are those of ``scaled_dot_product_attention`` (dropout needs its ``dropout_mask``:
    the backward pass must see the forward pass's keep-mask), plus:

    Args:
      query: ``(..., heads, q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)``.
      grad_output: ``(..., heads, q_len, v_dim)``, the gradient of a loss with respect to the
        output.
      sinks: ``(heads,)`` sink logits, or None.
      chunk_size, alibi_slopes, segment_ids, score_mod, mask_mod: as in
        ``scaled_dot_product_attention`` (autograd runs through ``score_mod``; the slopes get
        no gradient).

    Returns:
      ``(grad_query, grad_key, grad_value, grad_bias)`` with the shapes and dtype of query, key,
      value and bias; ``grad_bias`` is None without a bias; with ``sinks`` a fifth,
      ``grad_sinks (heads,)``.
    """
    fn = "scaled_dot_product_attention_vjp"
    args = rules.attention_arguments(
        fn, _describe(fn, "query", query), _describe(fn, "key", key),
        _describe(fn, "value", value), grad_output=_describe(fn, "grad_output", grad_output),
        mask=_describe(fn, "mask", mask), bias=_describe(fn, "bias", bias), is_causal=is_causal,
        causal_alignment=causal_alignment, window=window, scale=scale, softcap=softcap,
        dropout_p=dropout_p, dropout_mask=_describe(fn, "dropout_mask", dropout_mask),
        sinks=_describe(fn, "sinks", sinks), chunk_size=chunk_size,
        alibi_slopes=_describe(fn, "alibi_slopes", alibi_slopes),
        segment_ids=_describe_segments(fn, segment_ids), score_mod=score_mod, mask_mod=mask_mod,
    )  # every rule of the spec, once
    query, key, value, grad_output = _array(query), _array(key), _array(value), _array(grad_output)
    mask, dropout_mask = _array(mask), _array(dropout_mask)
    mods = _mods(fn, args, query, key, alibi_slopes, rules.segment_pair(segment_ids))

    # autograd differentiates the forward pass; bias and sinks join the inputs only when given.
    given = {name: x.detach().requires_grad_(True) for name, x in
             (("bias", _array(bias)), ("sinks", _array(sinks))) if x is not None}
    inputs = [t.detach().requires_grad_(True) for t in (query, key, value)] + list(given.values())
    with torch.enable_grad():
        output = pipeline(  # validated above
            *inputs[:3], mask, given.get("bias"), dropout_mask, None, args, given.get("sinks"),
            mods,
        )
        grads = torch.autograd.grad(output, inputs, grad_outputs=grad_output, allow_unused=True)
    grads = dict(zip(["query", "key", "value", *given], (
        torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True)
    ), strict=True))
    result = (grads["query"], grads["key"], grads["value"], grads.get("bias"))
    return result + ((grads["sinks"],) if sinks is not None else ())


def merge_attention_vjp(
    outputs: Any, lses: Any, grad_output: Any, *, grad_lse: Any = None, sinks: Any = None
) -> tuple[tuple[torch.Tensor, ...] | torch.Tensor, ...]:
    """Gradients of ``merge_attention``: ``torch.autograd`` through it (numpy_attn derives
    them by hand).

    Args:
      outputs: list or tuple of ``(..., heads, q_len, v_dim)`` partial outputs.
      lses: list or tuple of their ``(..., heads, q_len)`` log-sum-exps.
      grad_output: ``(..., heads, q_len, v_dim)``: the merged output's cotangent.
      grad_lse: ``(..., heads, q_len)``: the merged lse's cotangent, or None (0).
      sinks: ``(heads,)`` sink logits, or None.

    Returns:
      ``(grad_outputs, grad_lses)``, tuples shaped and typed like ``outputs`` and ``lses``,
      and with ``sinks`` a third element, ``grad_sinks (heads,)``.
    """
    fn = "merge_attention_vjp"
    rules.merge_arguments(
        fn, _describe_parts(fn, "outputs", outputs), _describe_parts(fn, "lses", lses),
        sinks=_describe(fn, "sinks", sinks), grad_output=_describe(fn, "grad_output", grad_output),
        grad_lse=_describe(fn, "grad_lse", grad_lse),
    )  # every rule, once (merge_attention checks its own arguments again: the same)
    parts = [_array(x).detach().requires_grad_(True) for x in outputs]
    lse_parts = [_array(x).detach().requires_grad_(True) for x in lses]
    sink = None if sinks is None else _array(sinks).detach().requires_grad_(True)
    inputs = parts + lse_parts + ([] if sink is None else [sink])
    with torch.enable_grad():
        output, lse = merge_attention(parts, lse_parts, sinks=sink)
        targets, cotangents = [output], [_array(grad_output).to(output.device, output.dtype)]
        if grad_lse is not None:
            targets.append(lse)
            cotangents.append(_array(grad_lse).to(lse.device, lse.dtype))
        grads = torch.autograd.grad(targets, inputs, grad_outputs=cotangents, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True)]
    n = len(parts)
    result = (tuple(grads[:n]), tuple(grads[n : 2 * n]))
    return result if sink is None else result + (grads[-1],)


def module_weight_grads(
    module: Any, output: torch.Tensor, grad_output: Any
) -> dict[str, np.ndarray]:
    """Gradient of every weight of a module: ``torch.autograd.grad`` of ``output`` (e.g.
    ``(..., seq, d_out)``) against ``grad_output`` (its shape); returns ``{weight name:
    gradient}`` as NumPy arrays, each of its weight's shape.

    numpy_attn's modules write this backward pass out by hand; here autograd differentiates the
    forward pass that produced ``output`` (the parameters' ``.grad`` are left untouched).
    """
    names = list(module.export_weights())
    parameters = [module.get_parameter(name) for name in names]
    grad_output = _as_tensor(grad_output).to(output.device, output.dtype)
    grads = torch.autograd.grad(output, parameters, grad_outputs=grad_output, allow_unused=True)
    return {
        name: _to_numpy(torch.zeros_like(p) if g is None else g)
        for name, p, g in zip(names, parameters, grads, strict=True)
    }
