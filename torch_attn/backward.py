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

from ._core import _array, _as_tensor, _describe, _to_numpy
from .functional import pipeline


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of ``scaled_dot_product_attention`` with respect to its array inputs.

    Arguments are those of ``scaled_dot_product_attention`` (dropout needs its ``dropout_mask``:
    the backward pass must see the forward pass's keep-mask), plus:

    Args:
      query: ``(..., heads, q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)``.
      grad_output: ``(..., heads, q_len, v_dim)``, the gradient of a loss with respect to the
        output.

    Returns:
      ``(grad_query, grad_key, grad_value, grad_bias)`` with the shapes and dtype of query, key,
      value and bias; ``grad_bias`` is None without a bias.
    """
    fn = "scaled_dot_product_attention_vjp"
    args = rules.attention_arguments(
        fn, _describe(fn, "query", query), _describe(fn, "key", key),
        _describe(fn, "value", value), grad_output=_describe(fn, "grad_output", grad_output),
        mask=_describe(fn, "mask", mask), bias=_describe(fn, "bias", bias), is_causal=is_causal,
        causal_alignment=causal_alignment, window=window, scale=scale, softcap=softcap,
        dropout_p=dropout_p, dropout_mask=_describe(fn, "dropout_mask", dropout_mask),
    )  # every rule of the spec, once
    query, key, value, grad_output = _array(query), _array(key), _array(value), _array(grad_output)
    mask, bias, dropout_mask = _array(mask), _array(bias), _array(dropout_mask)

    # autograd differentiates the forward pass; bias joins the inputs only when given.
    inputs = [t.detach().requires_grad_(True) for t in (query, key, value)]
    if bias is not None:
        inputs.append(bias.detach().requires_grad_(True))
    with torch.enable_grad():
        output = pipeline(  # validated above
            *inputs[:3], mask, inputs[3] if bias is not None else None, dropout_mask, None, args
        )
        grads = torch.autograd.grad(output, inputs, grad_outputs=grad_output, allow_unused=True)
    grads = tuple(
        torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True)
    )
    return grads[:3] + ((grads[3] if bias is not None else None),)


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
