"""Checking a (batch, seq, heads, head_dim) attention function: ``jax.nn.dot_product_attention``.

flash-attention, ``jax.nn`` and many model codebases keep the sequence axis before the heads.
``LAYOUT = "bshd"`` tells the harness to hand this module query, key and value in that layout
and to read its output back the same way (masks and bias keep ``(..., heads, q_len, kv_len)``);
``UNSUPPORTED`` names what jax.nn cannot express, reported as unsupported rather than failed.
From the repository root, with JAX installed::

    python -m conformance --backend examples.bshd_wrapper
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

LAYOUT = "bshd"
# jax.nn aligns causal masks and windows top-left, has no soft-capping and no given dropout
# mask, returns no weights, needs a heads axis and value's head_dim equal to the query's, and
# attends float64 inputs in float32; this thin wrapper leaves bad inputs to jax.nn's own errors
# and passes on neither attention sinks nor the row log-sum-exp (so no merge either).
UNSUPPORTED = {"bottom_right", "softcap", "dropout", "return_weights", "2d_inputs", "v_dim",
               "float64", "sinks", "lse", "errors", "chunked", "alibi", "segments", "score_mod",
               "mask_mod"}


def asarray(x: np.ndarray) -> jax.Array:
    """A NumPy array as a JAX array (the harness converts every input with this)."""
    return jnp.asarray(x)


def to_numpy(x: jax.Array) -> np.ndarray:
    """A JAX array as a NumPy array (the harness converts every result with this)."""
    return np.asarray(x)


def scaled_dot_product_attention(query: Any, key: Any, value: Any, *, mask: Any = None,
                                 bias: Any = None, is_causal: bool = False,
                                 window: tuple | None = None, scale: float | None = None,
                                 **unsupported: Any) -> jax.Array:
    """query ``(batch, q_len, heads, head_dim)``, key and value ``(batch, kv_len, kv_heads,
    dim)``; mask and bias ``(batch, heads, q_len, kv_len)``. Returns ``(batch, q_len, heads,
    v_dim)``."""
    if window is not None:  # the spec's None side is unbounded; jax.nn wants a size
        window = tuple(key.shape[-3] if w is None else w for w in window)
    out = jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask, scale=scale,
                                       is_causal=is_causal, local_window_size=window)
    if mask is not None:  # jax.nn gives a row with no allowed key the mean of value; spec: 0
        empty = ~jnp.any(jnp.asarray(mask), axis=-1, keepdims=True)  # (batch, heads, q_len, 1)
        out = jnp.where(jnp.swapaxes(empty, -3, -2), 0, out)
    return out
