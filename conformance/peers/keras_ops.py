"""``keras.ops.dot_product_attention`` on Keras 3's NumPy, JAX and torch backends, as peers.

Keras chooses its backend once per process (``KERAS_BACKEND``, read at import), so each column
``keras[numpy]``, ``keras[jax]``, ``keras[torch]`` talks to one long-lived worker process
(``conformance.peers.keras_worker``), started at its first cell and serving every later cell of
the run: one start per backend, however many cases. Every wait on a worker is bounded
(``START_TIMEOUT``, ``CALL_TIMEOUT``); a worker that hangs is killed and its cell is an error.

The adapter: layout ``(batch, seq, heads, head_dim)`` (BTNH), 4-D only (2-D and 3-D cases get
leading axes of 1); the boolean mask (True = may attend), ``bias`` and ``scale`` as given,
``is_causal`` as given (its alignment is Keras'); no window, soft-capping (Keras' soft cap is
TPU-only) or dropout keep-mask: n/a. On JAX the function runs under ``jax.jit``, as Keras runs a
model's steps there (eagerly in float16, which XLA on CPU does not compile), with the harness'
persistent compilation cache.
"""

from __future__ import annotations

import atexit
import collections
import os
import queue
import subprocess
import sys
import threading
from typing import Any

import numpy as np

from ..expected import Expected
from . import keras_worker
from .inputs import btnh, four_d, need, sdpa_case

#: Seconds a worker may take to import Keras and its backend.
START_TIMEOUT = 180.0
#: Seconds one call may take.
CALL_TIMEOUT = 120.0
_BUILTIN_ERRORS = {e.__name__: e for e in (ValueError, TypeError, RuntimeError,
                                           NotImplementedError, IndexError, KeyError)}


class WorkerError(RuntimeError):
    """A Keras worker could not start, died or timed out."""


class Worker:
    """One ``keras_worker`` process on one Keras backend."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        env = dict(os.environ, KERAS_BACKEND=backend)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        self.proc = subprocess.Popen(
            [sys.executable, keras_worker.__file__, backend], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.replies: queue.Queue[bytes | None] = queue.Queue()
        self.stderr: collections.deque[str] = collections.deque(maxlen=20)
        threading.Thread(target=self._read_replies, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self.ready = self._reply(START_TIMEOUT, "start")[1]
        if not self.ready.get("ok"):
            self.close()
            raise WorkerError(f"keras[{backend}] worker cannot import Keras: "
                              f"{self.ready.get('type')}: {self.ready.get('message')}")

    def _read_replies(self) -> None:
        while (message := keras_worker.read_message(self.proc.stdout)) is not None:
            self.replies.put(message)
        self.replies.put(None)

    def _read_stderr(self) -> None:
        for line in iter(self.proc.stderr.readline, b""):
            self.stderr.append(line.decode(errors="replace").rstrip())

    def _reply(self, timeout: float, what: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        try:
            message = self.replies.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise WorkerError(f"keras[{self.backend}] worker: no answer to {what} within "
                              f"{timeout:.0f} s") from None
        if message is None:
            tail = " | ".join(list(self.stderr)[-3:])
            raise WorkerError(f"keras[{self.backend}] worker exited "
                              f"(code {self.proc.wait()}): {tail}")
        return keras_worker.decode(message)

    def call(self, arrays: dict[str, np.ndarray], options: dict[str, Any]) -> np.ndarray:
        """``keras.ops.dot_product_attention`` in the worker; its exception type re-raised
        (builtin types as themselves, others as ``RuntimeError`` naming the type)."""
        try:
            keras_worker.write_message(self.proc.stdin, keras_worker.encode(arrays, options))
        except OSError as exc:
            raise WorkerError(f"keras[{self.backend}] worker is gone: {exc}") from None
        result, header = self._reply(CALL_TIMEOUT, "a call")
        if header["ok"]:
            return result["output"]
        kind = _BUILTIN_ERRORS.get(header["type"])
        if kind is not None:
            raise kind(header["message"])
        raise RuntimeError(f"{header['type']}: {header['message']}")

    def close(self) -> None:
        """End the process (closing stdin ends it; kill if it does not)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


_WORKERS: dict[str, Worker | WorkerError] = {}


def worker(backend: str) -> Worker:
    """The running worker of ``backend``, started on first use; a failed start is remembered
    (and re-raised), so a broken install costs one start, not one per cell."""
    found = _WORKERS.get(backend)
    if isinstance(found, WorkerError):
        raise found
    if found is None or found.proc.poll() is not None:
        try:
            found = _WORKERS[backend] = Worker(backend)
        except WorkerError as exc:
            _WORKERS[backend] = exc
            raise
    return found


@atexit.register
def close_workers() -> None:
    """End every worker (also at interpreter exit)."""
    for found in list(_WORKERS.values()):
        if isinstance(found, Worker):
            found.close()
    _WORKERS.clear()


def keras_attention(backend: str, exp: Expected) -> dict[str, np.ndarray]:
    """The ``keras[backend]`` peer: the case's output from ``keras.ops.dot_product_attention``."""
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
    out = worker(backend).call(arrays, options)
    return {"output": btnh(out).reshape(x.output_shape)}


def keras_numpy(exp: Expected) -> dict[str, np.ndarray]:
    """The ``keras[numpy]`` peer."""
    return keras_attention("numpy", exp)


def keras_jax(exp: Expected) -> dict[str, np.ndarray]:
    """The ``keras[jax]`` peer."""
    return keras_attention("jax", exp)


def keras_torch(exp: Expected) -> dict[str, np.ndarray]:
    """The ``keras[torch]`` peer."""
    return keras_attention("torch", exp)


__all__ = ["CALL_TIMEOUT", "START_TIMEOUT", "Worker", "WorkerError", "close_workers",
           "keras_attention", "keras_jax", "keras_numpy", "keras_torch", "worker"]
