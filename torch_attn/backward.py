"""The backward pass of attention: ``torch.autograd`` through the forward composition.

numpy_attn writes this derivation out by hand (FlashAttention's backward); here PyTorch's
autograd differentiates ``functional.scaled_dot_product_attention`` itself, so the conformance
harness compares two independent gradient computations (three with jax_attn's ``jax.vjp``).
The forward's safe softmax keeps gradients of masked positions and fully masked rows at 0.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _checks
from .functional import (
    _check_dropout_mask,
    _check_mask_bias,
    _check_structure,
    scaled_dot_product_attention,
)
from .masks import _as_tensor, _dtype_name


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
    query, key, value = _as_tensor(query), _as_tensor(key), _as_tensor(value)
    grad_output = _as_tensor(grad_output)
    _checks.check_float_inputs(
        fn, query=_dtype_name(query), key=_dtype_name(key), value=_dtype_name(value),
        grad_output=_dtype_name(grad_output),
    )
    _checks.check_query_key(fn, tuple(query.shape), tuple(key.shape))
    _checks.check_key_value(fn, tuple(key.shape), tuple(value.shape))
    out_shape = tuple(query.shape[:-1]) + tuple(value.shape[-1:])
    if tuple(grad_output.shape) != out_shape:
        raise ValueError(
            f"{fn}: grad_output must have the output's shape {out_shape}; "
            f"got grad_output.shape={tuple(grad_output.shape)}"
        )
    target = _checks.scores_shape(tuple(query.shape), tuple(key.shape))
    mask, bias = _check_mask_bias(fn, mask, bias, target)
    window = _check_structure(fn, is_causal, causal_alignment, window)
    scale = _checks.check_scale(fn, scale, query.shape[-1])
    softcap = _checks.check_softcap(fn, softcap)
    dropout_p = _checks.check_dropout(fn, dropout_p, dropout_mask is not None)
    if dropout_p > 0 and dropout_mask is None:
        raise ValueError(
            f"{fn}: dropout needs the forward pass's dropout_mask; got dropout_p={dropout_p!r}, "
            f"dropout_mask=None"
        )
    dropout_mask = _check_dropout_mask(fn, dropout_mask, target)

    # autograd differentiates the forward pass; bias joins the inputs only when given.
    inputs = [t.detach().requires_grad_(True) for t in (query, key, value)]
    if bias is not None:
        inputs.append(bias.detach().requires_grad_(True))
    with torch.enable_grad():
        output = scaled_dot_product_attention(
            *inputs[:3], mask=mask, bias=inputs[3] if bias is not None else None,
            is_causal=is_causal, causal_alignment=causal_alignment, window=window, scale=scale,
            softcap=softcap, dropout_p=dropout_p, dropout_mask=dropout_mask,
        )
        grads = torch.autograd.grad(output, inputs, grad_outputs=grad_output, allow_unused=True)
    grads = tuple(
        torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True)
    )
    return grads[:3] + ((grads[3] if bias is not None else None),)
