"""The backward pass of attention: ``jax.vjp`` of the forward composition.

numpy_attn writes this derivation out by hand (FlashAttention's backward); here JAX's autodiff
differentiates the forward pipeline (``functional.pipeline``) itself, so the conformance harness
compares two independent gradient computations (three with torch_attn's autograd). The
forward's safe softmax keeps gradients of masked positions and fully masked rows at exactly 0.
Large inputs on the CPU take the blocked fast path, whose ``jax.custom_vjp`` is a blocked
backward pass written out (``_fast._blocked_attention_vjp``), as numpy_attn's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules

from ._core import _array, _describe
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
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
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

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, b: jax.Array | None) -> jax.Array:
        return pipeline(q, k, v, mask, b, dropout_mask, None, args)  # validated above

    # jax.vjp differentiates the forward pass; bias joins the primals only when given.
    if bias is None:
        _, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, None), query, key, value)
        return pullback(grad_output) + (None,)
    _, pullback = jax.vjp(attend, query, key, value, bias)
    return pullback(grad_output)


def module_weight_grads(
    module: Any,
    args: tuple[Any, ...],
    grad_output: Any,
    arrays: dict[str, Any] | None = None,
    static: tuple[tuple[str, Any], ...] = (),
) -> dict[str, np.ndarray]:
    """Gradient of every weight of a module: ``jax.vjp`` of
    ``module.forward(*args, **arrays, **static)`` against ``grad_output`` (the output's shape,
    e.g. ``(..., seq, d_out)``); returns ``{weight name: gradient}``, each of its weight's shape.

    numpy_attn's modules write this backward pass out by hand; here the module is a pytree, so
    its gradient is a module of the same structure whose "weights" are the gradients. The vjp
    runs as one ``jax.jit``-compiled program (cached by module structure, input shapes and the
    static keyword arguments), and the gradients become NumPy arrays only at the end.
    """
    arrays = {} if arrays is None else arrays
    try:
        hash(static)
    except TypeError:  # an unhashable static argument (e.g. a list window): run eagerly
        return _weight_grads_eager(module, args, grad_output, arrays, static).export_weights()
    return _weight_grads_jit(module, args, grad_output, arrays, static).export_weights()


def _weight_grads_eager(module: Any, args: tuple[Any, ...], grad_output: Any,
                        arrays: dict[str, Any], static: tuple[tuple[str, Any], ...]) -> Any:
    """The gradients as a module of ``module``'s kind (its cotangent); jitted just below."""
    kwargs = {**arrays, **dict(static)}
    _, pullback = jax.vjp(lambda m: m.forward(*args, **kwargs), module)
    return pullback(jnp.asarray(grad_output))[0]


_weight_grads_jit = jax.jit(_weight_grads_eager, static_argnums=(4,))
