"""``jax.nn.dot_product_attention`` as a peer (column ``jax.nn``).

Called as models call it: under ``jax.jit``, with ``implementation=None`` (on CPU the XLA path;
cuDNN needs a GPU). Layout ``(batch, seq, heads, head_dim)`` (BTNH); the boolean mask (True =
may attend) and ``bias`` broadcast to the scores; ``is_causal`` and ``local_window_size`` as
given (both aligned top-left). Not expressible (n/a): ``v_dim != head_dim``, more than one
batch axis, soft-capping, attention sinks and a given dropout keep-mask.

It is called with ``return_residual=True``, so it also gives the ``lse`` step: jax 0.10.2's
residual is ``logsumexp`` (natural log) of the masked float32 logits, shape ``(batch, q_len,
heads)`` (BTN, transposed here to the spec's ``(batch, heads, q_len)``), cast to the *key's*
dtype and under ``stop_gradient``. The output is the same with or without the residual.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import backends
from ..expected import Expected
from .inputs import need, sdpa_case


@functools.cache
def _jax_nn_compiled() -> Callable[..., Any]:
    """``jax.nn.dot_product_attention`` under ``jax.jit``: one program per case and dtype
    (eagerly, every primitive is a program of its own). Eager where jit fails: float16 on CPU,
    whose jitted dot products XLA rejects."""
    import jax

    return jax.jit(jax.nn.dot_product_attention,
                   static_argnames=("is_causal", "scale", "local_window_size", "return_residual"))


def jax_nn(exp: Expected) -> dict[str, np.ndarray]:
    """The ``jax.nn`` peer: ``output (..., heads, q_len, head_dim)`` and ``lse (..., heads,
    q_len)`` from ``jax.nn.dot_product_attention(..., return_residual=True)`` (jitted)."""
    backends.jax_prepare()
    import jax
    import jax.numpy as jnp

    a, o = sdpa_case(exp, "jax.nn.dot_product_attention")
    q, k, v = (np.asarray(a[n]) for n in ("query", "key", "value"))
    need(v.shape[-1] == q.shape[-1], "jax.nn.dot_product_attention needs v_dim == head_dim")
    squeeze = q.ndim == 2
    if squeeze:
        q, k, v = q[None], k[None], v[None]
    need(q.ndim in (3, 4), "jax.nn.dot_product_attention takes at most one batch axis")

    def btnh(x: np.ndarray) -> Any:  # (..., N, T, H) → (..., T, N, H)
        return jnp.asarray(np.swapaxes(x, -2, -3))

    target = q.shape[:-1] + (k.shape[-2],)  # (..., heads, q_len, kv_len)
    kwargs: dict[str, Any] = {"is_causal": bool(o.get("is_causal"))}
    if o.get("scale") is not None:
        kwargs["scale"] = float(o["scale"])
    if a.get("mask") is not None:
        kwargs["mask"] = jnp.asarray(np.broadcast_to(np.asarray(a["mask"], bool), target))
    if a.get("bias") is not None:
        kwargs["bias"] = jnp.asarray(np.broadcast_to(a["bias"], target))
    if o.get("window") is not None:
        left, right = o["window"]
        big = max(q.shape[-2], k.shape[-2])
        kwargs["local_window_size"] = (big if left is None else left,
                                       big if right is None else right)
    kwargs["return_residual"] = True  # the row log-sum-exp: (..., q_len, heads)
    try:
        out, lse = _jax_nn_compiled()(btnh(q), btnh(k), btnh(v), **kwargs)
    except ValueError:  # jitted float16 on CPU: "precision 'F16_F16_F32' is not supported"
        out, lse = jax.nn.dot_product_attention(btnh(q), btnh(k), btnh(v), **kwargs)
    out_np = np.swapaxes(np.asarray(out), -2, -3)
    lse_np = np.swapaxes(np.asarray(lse), -1, -2)  # (..., heads, q_len)
    if squeeze:
        return {"output": out_np[0], "lse": lse_np[0]}  # 2-D inputs: lse (q_len,)
    return {"output": out_np, "lse": lse_np}
