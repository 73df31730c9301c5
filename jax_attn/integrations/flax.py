"""jax_attn as the ``attention_fn`` of Flax NNX.

``attention_fn`` has the signature of ``flax.nnx.dot_product_attention``, so it goes wherever
that one goes::

    from jax_attn.integrations.flax import attention_fn, use_jax_attn

    layer = nnx.MultiHeadAttention(num_heads=4, in_features=64, attention_fn=attention_fn,
                                   rngs=nnx.Rngs(0))
    use_jax_attn(model)  # or: every MultiHeadAttention of a model built already

    layer = MultiHeadAttentionWithSinks(num_heads=4, in_features=64, rngs=nnx.Rngs(0))

How Flax's arguments map onto the spec (``conformance/spec/functions.py``):

* layout: Flax passes ``(batch..., seq, heads, head_dim)`` ("BTNH"); the spec's layout is
  ``(batch..., heads, seq, head_dim)``, so the seq and heads axes are swapped on the way in and
  back on the way out. Key/value may have fewer heads than the query (grouped-query);
* ``mask``: broadcastable to ``(batch..., heads, q_len, kv_len)``, nonzero = may attend (Flax's
  own masks are float 0/1 or boolean; the spec's are boolean, True = may attend);
* ``bias`` → ``bias``, in its own dtype (added in the compute dtype, as Flax adds it: a
  float32 bias on float16 inputs is not rounded to float16); ``is_causal`` → ``is_causal``
  with ``causal_alignment="top_left"``, as Flax aligns it;
* dropout (``dropout_rate > 0`` and not ``deterministic``): the keep-mask is drawn from
  ``dropout_rng`` exactly as Flax draws it (``jax.random.bernoulli`` with keep probability
  ``1 - dropout_rate``, shape ``(1, 1, q_len, kv_len)`` with ``broadcast_dropout``, else the
  weights' shape) and given to jax_attn as ``dropout_mask``, so the same key drops the same
  weights;
* ``dtype``/``promote_dtype`` promote query, key and value as Flax does; ``module`` sows the
  weights (before dropout) as ``nnx.Intermediate`` ``attention_weights``; ``precision`` is not
  used: jax_attn's matmuls always run at ``Precision.HIGHEST``;
* ``sinks`` (not a Flax argument): ``(heads,)`` attention sinks, as GPT-OSS's (``SINKS`` in
  the spec). Flax has no sinks and ``nnx.MultiHeadAttention`` passes none to its
  ``attention_fn``, so a learned sink needs a module that holds one:
  ``MultiHeadAttentionWithSinks`` (an ``nnx.MultiHeadAttention`` with an ``nnx.Param``
  ``sinks``, zeros at first, whose attention is this function with its sinks); fixed sinks go
  through ``functools.partial(attention_fn, sinks=...)``.

A query row that may attend no key (a padding token under Flax's usual
``make_attention_mask(tokens > 0, tokens > 0)``) gives output 0 as the spec says; Flax gives the
mean of the values there (``docs/integrations.md``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from .. import functional

__all__ = ["MultiHeadAttentionWithSinks", "attention_fn", "use_jax_attn"]


def attention_fn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: nnx.Module | None = None,
    promote_dtype: Callable[..., Any] = dtypes.promote_dtype,
    is_causal: bool = False,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """``flax.nnx.dot_product_attention``'s signature on ``jax_attn.scaled_dot_product_attention``.

    Args:
      query: ``(batch..., q_len, heads, head_dim)``.
      key: ``(batch..., kv_len, kv_heads, head_dim)``; ``heads`` a multiple of ``kv_heads``.
      value: ``(batch..., kv_len, kv_heads, v_dim)``.
      bias: float, broadcastable to ``(batch..., heads, q_len, kv_len)``, added to the scores.
      mask: broadcastable to ``(batch..., heads, q_len, kv_len)``; nonzero/True = may attend.
      broadcast_dropout: one keep-mask ``(1, 1, q_len, kv_len)`` for every batch and head.
      dropout_rng: a ``jax.random`` key; needed when dropout is on.
      dropout_rate: dropout probability on the weights, in ``[0, 1)``.
      deterministic: True turns dropout off.
      dtype: the dtype query, key and value are promoted to (None: from the inputs).
      precision: not used (jax_attn computes at ``Precision.HIGHEST``).
      module: a Module to sow the weights ``(batch..., heads, q_len, kv_len)`` into.
      promote_dtype: Flax's dtype promotion of ``(query, key, value)``.
      is_causal: query ``i`` attends key ``j`` only if ``j <= i`` (top-left, as Flax).
      sinks: ``(heads,)`` sink logits (one per query head, joining each row's softmax as a
        column without a value; a row with no allowed key gives 0), or None. Not a Flax
        argument: ``MultiHeadAttentionWithSinks`` passes its own.

    Returns:
      ``(batch..., q_len, heads, v_dim)`` in the promoted dtype.
    """
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    q, k, v = (jnp.swapaxes(x, -3, -2) for x in (query, key, value))  # (..., heads, seq, dim)
    if mask is not None:
        mask = jnp.asarray(mask) != 0  # Flax: nonzero = may attend
    if bias is not None:
        bias = jnp.asarray(bias)  # its own dtype: added in the compute dtype, as Flax adds it
    dropout_p, keep = 0.0, None
    if dropout_rate > 0.0 and not deterministic:
        if dropout_rng is None:
            raise ValueError("attention_fn: dropout_rate > 0 and not deterministic needs "
                             "dropout_rng (a jax.random key)")
        dropout_p = float(dropout_rate)
        shape = q.shape[:-1] + k.shape[-2:-1]  # the weights' (..., heads, q_len, kv_len)
        if broadcast_dropout:  # as Flax: one keep-mask for all batches and heads
            shape = (1,) * (key.ndim - 2) + shape[-2:]
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_p, shape)
    result = functional.scaled_dot_product_attention(
        q, k, v, mask=mask, bias=bias, is_causal=is_causal, causal_alignment="top_left",
        dropout_p=dropout_p, dropout_mask=keep, return_weights=module is not None, sinks=sinks,
    )  # (..., heads, q_len, v_dim)
    if module is not None:
        result, weights = result
        module.sow(nnx.Intermediate, "attention_weights", weights)
    return jnp.swapaxes(result, -3, -2)  # (..., q_len, heads, v_dim)


def use_jax_attn(model: nnx.Module) -> int:
    """Set ``attention_fn`` on every ``nnx.MultiHeadAttention`` inside ``model`` (in place).

    Returns:
      how many layers now use it (0: the model has no ``MultiHeadAttention``).
    """
    count = 0
    for _, layer in nnx.iter_modules(model):
        if isinstance(layer, nnx.MultiHeadAttention):
            layer.attention_fn = attention_fn
            count += 1
    return count


_FIXED = ("MultiHeadAttentionWithSinks: attention_fn is jax_attn's with the module's sinks "
          "and cannot be replaced")


class MultiHeadAttentionWithSinks(nnx.MultiHeadAttention):
    """``nnx.MultiHeadAttention`` with learned attention sinks, as GPT-OSS: an ``nnx.Param``
    ``sinks`` of shape ``(num_heads,)`` (zeros at first, in ``param_dtype``) that joins every
    softmax denominator of its head, through ``attention_fn(..., sinks=self.sinks)``.

    Flax's ``MultiHeadAttention`` calls ``self.attention_fn`` without sinks, so here
    ``attention_fn`` is read-only: each call reads it afresh and gets this module's jax_attn
    ``attention_fn`` with the sinks as they are now (traced under ``nnx.jit``/``nnx.grad``, so
    they train like the other parameters). Everything else is Flax's: the constructor takes
    ``nnx.MultiHeadAttention``'s arguments but ``attention_fn``; ``decode=True`` caching, masks,
    dropout and ``sow_weights`` work as there.
    """

    def __init__(self, num_heads: int, in_features: int, *args: Any, rngs: nnx.Rngs,
                 **kwargs: Any) -> None:
        """``nnx.MultiHeadAttention(num_heads, in_features, ..., rngs=rngs)``, and
        ``sinks (num_heads,)`` set to 0 (drawing nothing from ``rngs``)."""
        if "attention_fn" in kwargs:
            raise TypeError(f"{_FIXED}; got attention_fn={kwargs['attention_fn']!r}")
        super().__init__(num_heads, in_features, *args, attention_fn=attention_fn, rngs=rngs,
                         **kwargs)
        self.sinks = nnx.Param(jnp.zeros((num_heads,), self.param_dtype))  # (num_heads,)

    @property
    def attention_fn(self) -> Callable[..., jax.Array]:
        """jax_attn's ``attention_fn`` with this module's sinks, as they are now."""
        return functools.partial(attention_fn, sinks=self.sinks[...])

    @attention_fn.setter
    def attention_fn(self, fn: Callable[..., jax.Array]) -> None:
        # Flax's constructor and use_jax_attn set it: only jax_attn's own is accepted
        if fn is not attention_fn:
            raise TypeError(f"{_FIXED}; got attention_fn={fn!r}")
