"""``flax.nnx.dot_product_attention`` as a peer (column ``flax.nnx``).

Flax NNX's attention function: layout ``(batch, seq, heads, head_dim)``
(BTNH), the boolean mask (True = may attend), ``bias`` and ``is_causal`` as given, grouped-query
heads as given. Not expressible (n/a): value's head_dim != query's, a scale (always ``head_dim **
-0.5``), a window, soft-capping, and a given dropout keep-mask (it draws its own).

Without dropout and without a ``module`` to sow the weights into, it calls
``jax.nn.dot_product_attention`` (the same bits as the ``jax.nn`` column), so it shares
``jax.nn``'s differences. Run under ``jax.jit`` (one program per shape and dtype), eagerly where
XLA on CPU rejects a jitted float16 product.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..cases.expected import Expected
from ..running import backends
from .inputs import btnh, four_d, need, sdpa_case


@functools.cache
def _compiled() -> Callable[..., Any]:
    import jax
    from flax import nnx

    return jax.jit(functools.partial(nnx.dot_product_attention, deterministic=True),
                   static_argnames=("is_causal",))


def flax_nnx(exp: Expected) -> dict[str, np.ndarray]:
    """The ``flax.nnx`` peer: the case's output from ``flax.nnx.dot_product_attention``."""
    backends.jax_prepare()
    import jax
    from flax import nnx

    peer = "flax.nnx.dot_product_attention"
    a, o = sdpa_case(exp, peer)
    need(o.get("window") is None, f"{peer} has no sliding window")
    need(o.get("scale") is None, f"{peer} always scales by head_dim ** -0.5")
    x = four_d(exp, peer)
    need(x.value.shape[-1] == x.query.shape[-1],
         f"{peer} needs value's head_dim == query's (it checks value's shape against key's)")
    q, k, v = (jax.device_put(btnh(t)) for t in (x.query, x.key, x.value))
    kwargs: dict[str, Any] = {"is_causal": bool(o.get("is_causal"))}
    if x.mask is not None:
        kwargs["mask"] = jax.device_put(x.mask)
    if x.bias is not None:
        kwargs["bias"] = jax.device_put(x.bias)
    try:
        out = _compiled()(q, k, v, **kwargs)
    except ValueError:  # jitted float16 on CPU: "precision 'F16_F16_F32' is not supported"
        out = nnx.dot_product_attention(q, k, v, deterministic=True, **kwargs)
    return {"output": btnh(np.asarray(out)).reshape(x.output_shape)}


__all__ = ["flax_nnx"]
