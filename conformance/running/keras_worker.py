"""The Keras workers: ``keras.ops.dot_product_attention`` on one Keras 3 backend per process.

Keras reads ``KERAS_BACKEND`` once, when it is first imported, so each ``keras[...]`` peer
(``conformance.peers.keras_ops``) talks to one long-lived worker process of its backend
(``workers.start``, the environment's ``KERAS_BACKEND`` set), started at its first request and
serving every later cell of the run: one start per backend, however many cases. Requests are
pipelined: ``Worker.submit`` queues one and returns its ticket at once, ``Worker.result`` waits
for a ticket's reply; the worker answers in order. The command line's run queues every case's
request up front (``room.Ahead``), so the workers compute while the harness runs the other
columns, and each cell takes its output when its turn comes.

Every wait on a worker is bounded (``workers.START_TIMEOUT`` for its ready message,
``workers.CALL_TIMEOUT`` for each reply after it); a worker that hangs is killed, and its cell
and those still queued in it are errors (``WorkerError``). Messages are ``workers``' (pickled):
a request is ``(arrays, options)``, a reply ``(arrays, header)``, the header saying ``ok`` or
the exception's type and message. Inside, ``serve`` runs each request on the backend (``attend``:
jitted on JAX, as Keras runs a model's steps there, with the harness's persistent compilation
cache) at a lower priority (``workers.NICE``); the process ends when the harness asks it to or
its socket closes.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from typing import Any

import numpy as np

from . import workers

_ENTRY = "conformance.running.keras_worker:serve"
_BUILTIN_ERRORS = {e.__name__: e for e in (ValueError, TypeError, RuntimeError,
                                           NotImplementedError, IndexError, KeyError)}


# ---------------------------------------------------------------------------- the harness side


class WorkerError(RuntimeError):
    """A Keras worker could not start, died or timed out."""


class Worker(workers.Channel):
    """One Keras worker process on one Keras backend (module docstring).

    The start is not waited for: the first ``result`` waits up to ``START_TIMEOUT`` for the
    worker's ready message, each reply after it up to ``CALL_TIMEOUT``. A failure (a start that
    fails, a timeout, which kills the worker, or a worker that exits) is kept in ``failure``
    and raised by every later ``result`` at once: no wait is ever repeated on a worker known to
    be gone."""

    exit_wait = 10.0  # seconds an ending worker may take to give its exit code

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.replies: queue.Queue[Any] = queue.Queue()
        self.ready: dict[str, Any] | None = None
        self.failure: WorkerError | None = None
        self.start_failed = False
        self._sent = self._received = 0
        self._results: dict[int, tuple[dict[str, np.ndarray], dict[str, Any]]] = {}
        self._lock, self._submitting = threading.Lock(), threading.Lock()
        env = dict(os.environ, KERAS_BACKEND=backend)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        super().__init__(_ENTRY, backend, env=env)

    def received(self, message: Any) -> None:
        self.replies.put(message)

    def ended(self, code: int | str | None, tail: str) -> None:
        self.replies.put(("exited", code, tail))

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
        if message[0] == "exited":
            _, code, tail = message
            raise self._fail(f"keras[{self.backend}] worker exited (code {code}): {tail}")
        return message

    def _started(self) -> None:
        """Wait for the ready message (once); a worker that cannot import Keras fails."""
        if self.ready is not None:
            return
        try:
            ready = self._reply(workers.START_TIMEOUT, "start")[1]
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
            self.put(workers.encode((arrays, options)))
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
                self._results[self._received] = self._reply(workers.CALL_TIMEOUT, "a call")
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

    def close(self, wait: bool = True) -> None:  # type: ignore[override]
        """End the process: asked to end (its interpreter's shutdown takes 2 s and saves
        nothing, so it is killed if it has not within a second), or killed at once when
        requests are left unanswered (an interrupted run does not need them). ``wait`` False:
        ask it to end and return (``close_workers`` then waits for every worker at once)."""
        if self.proc.poll() is None and self._received < self._sent:
            self.proc.kill()
        if not wait:
            self.finish()
            self._outbox.put(None)
            return
        self.finish()
        super().close(wait=1.0)


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
    running = list(_WORKERS.values())
    _WORKERS.clear()
    for found in running:
        found.close(wait=False)
    deadline = time.monotonic() + 1.0
    for found in running:
        workers.Channel.close(found, wait=max(0.0, deadline - time.monotonic()))


# ---------------------------------------------------------------------------- inside the worker


_JITTED: list[Any] = []


def _jitted() -> Any:
    """``keras.ops.dot_product_attention`` under ``jax.jit``, as Keras runs a model's steps on
    JAX (one program per shape instead of one per operation)."""
    if not _JITTED:
        import jax
        import keras

        _JITTED.append(jax.jit(keras.ops.dot_product_attention,
                               static_argnames=("is_causal", "scale")))
    return _JITTED[0]


def attend(backend: str, arrays: dict[str, np.ndarray], options: dict[str, Any]) -> np.ndarray:
    """``keras.ops.dot_product_attention`` on BTNH ``query``/``key``/``value`` (optional
    ``mask``, ``bias``), keyword ``options`` as given; the output as a NumPy array."""
    import keras

    args = (arrays["query"], arrays["key"], arrays["value"])
    kwargs = {"bias": arrays.get("bias"), "mask": arrays.get("mask"), **options}
    # Eager for float16: XLA on CPU rejects jitted float16 products ("precision 'F16_F16_F32'
    # is not supported by dot_general on CPU").
    if backend == "jax" and arrays["query"].dtype != np.float16:
        out = _jitted()(*args, **kwargs)
    else:
        out = keras.ops.dot_product_attention(*args, **kwargs)
    return np.asarray(keras.ops.convert_to_numpy(out))


def _jax_cache() -> None:
    """The persistent compilation cache of ``running.backends.jax_prepare`` (same place, same
    ``ATTENTION_JAX_CACHE`` switch), so a second run compiles nothing; x64 stays as Keras
    leaves it."""
    import jax

    cache = os.environ.get("ATTENTION_JAX_CACHE", os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
        "attention-three-ways", "jax"))
    if cache != "off":
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def serve(fd: str, backend: str) -> None:
    """The worker's main loop (``Worker`` starts it): say whether Keras imports on
    ``backend``, then answer each request until the harness sends None or is gone."""
    conn = workers.connect(fd)
    workers.lower_priority()
    try:
        import keras

        if backend == "jax":
            _jax_cache()
        ready = {"ok": True, "keras": keras.__version__, "backend": keras.backend.backend()}
    except Exception as exc:  # noqa: BLE001 - reported to the caller
        ready = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
    try:
        workers.send(conn, ({}, ready))
        while ready["ok"] and (request := workers.receive(conn)) is not None:
            arrays, options = request
            try:
                reply = ({"output": attend(backend, arrays, options)}, {"ok": True})
            except Exception as exc:  # noqa: BLE001 - a failing call is a result
                reply = ({}, {"ok": False, "type": type(exc).__name__, "message": str(exc)})
            workers.send(conn, reply)
    except (EOFError, OSError):
        pass  # the harness is gone
    os._exit(0)


__all__ = ["Worker", "WorkerError", "attend", "close_workers", "serve", "worker"]
