"""The backward pass of attention: ``jax.vjp`` of the forward composition.

numpy_attn writes this derivation out by hand (FlashAttention's backward); here JAX's autodiff
differentiates the forward pipeline (``functional.pipeline``) itself, so the conformance harness
compares two independent gradient computations (three with torch_attn's autograd). The
forward's safe softmax keeps gradients of masked positions and fully masked rows at exactly 0.
Large inputs on the CPU take the blocked fast path, whose ``jax.custom_vjp`` is a blocked
backward pass written out (``_fast.backward.blocked_attention_vjp``), as numpy_attn's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules

from ._arrays import _array, _describe, _describe_parts
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
) -> tuple[jax.Array | None, ...]:
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
        ``scaled_dot_product_attention`` (``jax.vjp`` runs through ``score_mod``; the slopes
        get no gradient).

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
    mods = _mods(fn, args, query.shape, key.shape, alibi_slopes, rules.segment_pair(segment_ids))
    primals = {"bias": _array(bias), "sinks": _array(sinks)}
    given = {name: x for name, x in primals.items() if x is not None}

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, extra: dict) -> jax.Array:
        arrays = {**primals, **extra}  # validated above
        return pipeline(q, k, v, mask, arrays["bias"], dropout_mask, None, args, arrays["sinks"],
                        mods)

    # jax.vjp differentiates the forward pass; bias and sinks join the primals only when given.
    _, pullback = jax.vjp(attend, query, key, value, given)
    grad_q, grad_k, grad_v, grads = pullback(grad_output)
    result = (grad_q, grad_k, grad_v, grads.get("bias"))
    return result + ((grads["sinks"],) if "sinks" in grads else ())


def merge_attention_vjp(
    outputs: Any, lses: Any, grad_output: Any, *, grad_lse: Any = None, sinks: Any = None
) -> tuple[tuple[jax.Array, ...] | jax.Array, ...]:
    """Gradients of ``merge_attention``: ``jax.vjp`` of it (numpy_attn derives them by hand).

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
    args = rules.merge_arguments(
        fn, _describe_parts(fn, "outputs", outputs), _describe_parts(fn, "lses", lses),
        sinks=_describe(fn, "sinks", sinks), grad_output=_describe(fn, "grad_output", grad_output),
        grad_lse=_describe(fn, "grad_lse", grad_lse),
    )  # every rule, once (merge_attention checks its own arguments again: the same)
    parts, lse_parts = tuple(map(_array, outputs)), tuple(map(_array, lses))
    if sinks is None:
        output, pullback = jax.vjp(lambda o, s: merge_attention(list(o), list(s)), parts,
                                   lse_parts)
    else:
        output, pullback = jax.vjp(lambda o, s, k: merge_attention(list(o), list(s), sinks=k),
                                   parts, lse_parts, _array(sinks))
    d_lse = jnp.zeros(args.output_shape[:-1], output[1].dtype) if grad_lse is None else \
        _array(grad_lse).astype(output[1].dtype)
    return pullback((_array(grad_output).astype(output[0].dtype), d_lse))


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
