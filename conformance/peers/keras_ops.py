"""``keras.ops.dot_product_attention`` on Keras 3's NumPy, JAX and torch backends, as peers.

Keras chooses its backend once per process (``KERAS_BACKEND``, read at import), so each column
``keras[numpy]``, ``keras[jax]``, ``keras[torch]`` talks to one long-lived worker process
(``conformance.peers.keras_worker``), started at its first request and serving every later
cell of the run: one start per backend, however many cases. Requests are pipelined
(``keras_submit``): the command line's run queues every case's request up front
(``peers.background``), so the workers compute while the harness runs the other columns, and
each cell takes its output when its turn comes. Every wait on a worker is bounded
(``START_TIMEOUT``, ``CALL_TIMEOUT``); a worker that hangs is killed, and its cell and those
still queued in it are errors.

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
import time
from collections.abc import Callable
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
    """One ``keras_worker`` process on one Keras backend.

    Requests are pipelined: ``submit`` queues one and returns its ticket at once (a writer
    thread feeds the worker's stdin, so the caller never blocks on a full pipe), ``result``
    waits for a ticket's reply; the worker answers in order. The start is not waited for: the
    first ``result`` waits up to ``START_TIMEOUT`` for the worker's ready message, each reply
    after it up to ``CALL_TIMEOUT``. A failure (a start that fails, a timeout, which kills the
    worker, or a worker that exits) is kept in ``failure`` and raised by every later
    ``result`` at once: no wait is ever repeated on a worker known to be gone."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        env = dict(os.environ, KERAS_BACKEND=backend)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        self.proc = subprocess.Popen(
            [sys.executable, keras_worker.__file__, backend], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.replies: queue.Queue[bytes | None] = queue.Queue()
        self.stderr: collections.deque[str] = collections.deque(maxlen=20)
        self.ready: dict[str, Any] | None = None
        self.failure: WorkerError | None = None
        self.start_failed = False
        self._requests: queue.Queue[bytes | None] = queue.Queue()
        self._sent = self._received = 0
        self._results: dict[int, tuple[dict[str, np.ndarray], dict[str, Any]]] = {}
        self._lock, self._submitting = threading.Lock(), threading.Lock()
        threading.Thread(target=self._read_replies, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        threading.Thread(target=self._write_requests, daemon=True).start()

    def _read_replies(self) -> None:
        while (message := keras_worker.read_message(self.proc.stdout)) is not None:
            self.replies.put(message)
        self.replies.put(None)

    def _read_stderr(self) -> None:
        for line in iter(self.proc.stderr.readline, b""):
            self.stderr.append(line.decode(errors="replace").rstrip())

    def _write_requests(self) -> None:
        while (message := self._requests.get()) is not None:
            try:
                keras_worker.write_message(self.proc.stdin, message)
            except (OSError, ValueError):  # the worker is gone: its reader says why
                return

    def _fail(self, message: str) -> WorkerError:
        self.failure = self.failure or WorkerError(message)
        return self.failure

    def _reply(self, timeout: float, what: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        if self.failure is not None:
            raise self.failure
        try:
            message = self.replies.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise self._fail(f"keras[{self.backend}] worker: no answer to {what} within "
                             f"{timeout:.0f} s") from None
        if message is None:
            tail = " | ".join(list(self.stderr)[-3:])
            try:
                code: int | str | None = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = "unknown"
            raise self._fail(f"keras[{self.backend}] worker exited (code {code}): {tail}")
        return keras_worker.decode(message)

    def _started(self) -> None:
        """Wait for the ready message (once); a worker that cannot import Keras fails."""
        if self.ready is not None:
            return
        try:
            ready = self._reply(START_TIMEOUT, "start")[1]
            if not ready.get("ok"):
                self.close()
                raise self._fail(f"keras[{self.backend}] worker cannot import Keras: "
                                 f"{ready.get('type')}: {ready.get('message')}")
        except WorkerError:
            self.start_failed = True  # kept: a broken install costs one start
            raise
        self.ready = ready

    def submit(self, arrays: dict[str, np.ndarray], options: dict[str, Any]) -> int:
        """Queue one ``keras.ops.dot_product_attention`` call; returns its ticket for
        ``result`` (calls run in the order submitted)."""
        with self._submitting:
            self._requests.put(keras_worker.encode(arrays, options))
            self._sent += 1
            return self._sent

    def result(self, ticket: int) -> np.ndarray:
        """The output of the call ``ticket`` (waiting, bounded); its exception re-raised
        (builtin types as themselves, others as ``RuntimeError`` naming the type); a
        ``WorkerError`` when the worker failed before answering it."""
        with self._lock:
            self._started()
            while ticket not in self._results:
                if ticket <= self._received:
                    raise RuntimeError(f"keras[{self.backend}] call {ticket} was taken twice")
                self._received += 1
                self._results[self._received] = self._reply(CALL_TIMEOUT, "a call")
            result, header = self._results.pop(ticket)
        if header["ok"]:
            return result["output"]
        kind = _BUILTIN_ERRORS.get(header["type"])
        if kind is not None:
            raise kind(header["message"])
        raise RuntimeError(f"{header['type']}: {header['message']}")

    def call(self, arrays: dict[str, np.ndarray], options: dict[str, Any]) -> np.ndarray:
        """``keras.ops.dot_product_attention`` in the worker, waited for (``submit`` and
        ``result``)."""
        return self.result(self.submit(arrays, options))

    def close(self, wait: bool = True) -> None:
        """End the process (closing stdin ends it; kill if it has not within a second, as its
        interpreter's shutdown takes 2 s and saves nothing, or at once when requests are left
        unanswered: an interrupted run does not need them). ``wait`` False: ask it to end and
        return (``close_workers`` then waits for every worker at once)."""
        self._requests.put(None)
        if self.proc.poll() is None and self._received < self._sent:
            self.proc.kill()
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                if wait:
                    self.proc.wait(timeout=1)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


_WORKERS: dict[str, Worker] = {}


def worker(backend: str) -> Worker:
    """The running worker of ``backend``, started on first use (not waited for: see
    ``Worker``); one whose start failed is kept (its ``result`` re-raises the failure), so a
    broken install costs one start, not one per cell; one that died or timed out is replaced
    by a new one at the next request."""
    found = _WORKERS.get(backend)
    if found is None or not found.start_failed and (
            found.failure is not None or found.proc.poll() is not None):
        found = _WORKERS[backend] = Worker(backend)
    return found


@atexit.register
def close_workers() -> None:
    """End every worker (also at interpreter exit): all are asked first, then waited for, so
    they shut down side by side."""
    workers = list(_WORKERS.values())
    _WORKERS.clear()
    for found in workers:
        found.close(wait=False)
    deadline = time.monotonic() + 1.0
    for found in workers:
        try:
            found.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            found.proc.kill()
            found.proc.wait()


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
    running = worker(backend)
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


__all__ = ["CALL_TIMEOUT", "START_TIMEOUT", "Worker", "WorkerError", "close_workers",
           "keras_attention", "keras_jax", "keras_numpy", "keras_submit", "keras_torch",
           "worker"]
