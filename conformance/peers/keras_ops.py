"""``keras.ops.dot_product_attention`` on Keras 3's NumPy, JAX and torch backends, as peers.

Keras chooses its backend once per process (``KERAS_BACKEND``, read at import), so each column
``keras[numpy]``, ``keras[jax]``, ``keras[torch]`` talks to one long-lived worker process of its
backend (``conformance.running.keras_worker``), started at its first request and serving every
later cell of the run. Requests are pipelined (``keras_submit``): the command line's run queues
every case's request up front (``running.room.Ahead``), so the workers compute while the harness
runs the other columns, and each cell takes its output when its turn comes.

The adapter: layout ``(batch, seq, heads, head_dim)`` (BTNH), 4-D only (2-D and 3-D cases get
leading axes of 1); the boolean mask (True = may attend), ``bias`` and ``scale`` as given,
``is_causal`` as given (its alignment is Keras'); no window, soft-capping (Keras' soft cap is
TPU-only) or dropout keep-mask: n/a. On JAX the function runs under ``jax.jit``, as Keras runs a
model's steps there (eagerly in float16, which XLA on CPU does not compile), with the harness'
persistent compilation cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..cases.expected import Expected
from ..running import keras_worker
from .inputs import btnh, four_d, need, sdpa_case


def keras_submit(backend: str, exp: Expected) -> Callable[[], dict[str, np.ndarray]]:
    """The ``keras[backend]`` peer, started: the case's call is queued in the worker now
    (``Worker.submit``: a case it cannot express raises ``NotApplicable`` here); the returned
    function waits for the output (``Worker.result``)."""
    peer = f"keras.ops.dot_product_attention ({backend} backend)"
    a, o = sdpa_case(exp, peer)
    need(o.get("window") is None, f"{peer} has no sliding window")
    x = four_d(exp, peer)
    arrays = {"query": btnh(x.query), "key": btnh(x.key), "value": btnh(x.value)}
    target = x.query.shape[:-1] + (x.key.shape[-2],)  # (B, H, Tq, Tk)
    if x.mask is not None:
        arrays["mask"] = np.broadcast_to(x.mask, target)
    if x.bias is not None:
        arrays["bias"] = x.bias
    options: dict[str, Any] = {"is_causal": bool(o.get("is_causal"))}
    if o.get("scale") is not None:
        options["scale"] = float(o["scale"])
    running = keras_worker.worker(backend)
    ticket = running.submit(arrays, options)
    return lambda: {"output": btnh(running.result(ticket)).reshape(x.output_shape)}


def keras_attention(backend: str, exp: Expected) -> dict[str, np.ndarray]:
    """The ``keras[backend]`` peer: the case's output from ``keras.ops.dot_product_attention``
    (``keras_submit``, waited for)."""
    return keras_submit(backend, exp)()


def keras_numpy(exp: Expected) -> dict[str, np.ndarray]:
    """The ``keras[numpy]`` peer."""
    return keras_attention("numpy", exp)


def keras_jax(exp: Expected) -> dict[str, np.ndarray]:
    """The ``keras[jax]`` peer."""
    return keras_attention("jax", exp)


def keras_torch(exp: Expected) -> dict[str, np.ndarray]:
    """The ``keras[torch]`` peer."""
    return keras_attention("torch", exp)


__all__ = ["keras_attention", "keras_jax", "keras_numpy", "keras_submit", "keras_torch"]
