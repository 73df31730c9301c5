"""A process that runs ``keras.ops.dot_product_attention`` on one Keras 3 backend.

Keras reads ``KERAS_BACKEND`` once, when it is first imported, so each ``keras[...]`` peer
(``conformance.peers.keras_ops``) runs its own copy of this file, by its path: ``python
.../conformance/peers/keras_worker.py BACKEND`` (so this folder is the worker's first import
directory: no file here is named like a framework). Requests and replies are length-prefixed
messages on stdin/stdout (``encode``, ``decode``: a JSON header and the raw bytes of each array,
so bfloat16 travels as its bits); anything else the framework prints goes to stderr. One
request is one call; the process ends when stdin closes. This file imports nothing from the
project, so the worker starts without it.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import Any, BinaryIO

import numpy as np

_LENGTH = struct.Struct("<Q")
#: How much less CPU priority the harness's helper processes take than the harness (``nice``):
#: the harness's own process is the run's longest, so on a busy machine it goes first, and the
#: helpers, which finish earlier, take what is left (docs/checking.md, "Processes of a run").
NICE = 5


def lower_priority() -> None:
    """Lower this process's CPU priority by ``NICE`` (where the system allows; else as is)."""
    try:
        os.nice(NICE)
    except (AttributeError, OSError):  # no os.nice (Windows), or not permitted
        pass


def _bfloat16() -> Any:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def encode(arrays: dict[str, np.ndarray], header: dict[str, Any]) -> bytes:
    """One message: ``header`` (JSON) and ``arrays`` (dtype name, shape, raw bytes)."""
    specs, blobs = [], []
    for name, x in arrays.items():
        x = np.ascontiguousarray(x)
        specs.append({"name": name, "dtype": str(x.dtype), "shape": list(x.shape)})
        blobs.append(x.tobytes())
    head = json.dumps({"header": header, "arrays": specs}).encode()
    return _LENGTH.pack(len(head)) + head + b"".join(blobs)


def decode(message: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``(arrays, header)`` of a message made by ``encode``."""
    (n,) = _LENGTH.unpack_from(message)
    head = json.loads(message[_LENGTH.size:_LENGTH.size + n])
    offset, arrays = _LENGTH.size + n, {}
    for spec in head["arrays"]:
        dtype = _bfloat16() if spec["dtype"] == "bfloat16" else np.dtype(spec["dtype"])
        count = int(np.prod(spec["shape"], dtype=np.int64))
        flat = np.frombuffer(message, dtype, count, offset)
        arrays[spec["name"]] = flat.reshape(spec["shape"]).copy()
        offset += count * dtype.itemsize
    return arrays, head["header"]


def write_message(stream: BinaryIO, message: bytes) -> None:
    """Write one length-prefixed message and flush."""
    stream.write(_LENGTH.pack(len(message)) + message)
    stream.flush()


def read_message(stream: BinaryIO) -> bytes | None:
    """Read one length-prefixed message; None at end of stream."""
    prefix = stream.read(_LENGTH.size)
    if len(prefix) < _LENGTH.size:
        return None
    (n,) = _LENGTH.unpack(prefix)
    return stream.read(n)


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
    """The persistent compilation cache of ``conformance.backends.jax_prepare`` (same place,
    same ``ATTENTION_JAX_CACHE`` switch), so a second run compiles nothing; x64 stays as Keras
    leaves it."""
    import jax

    cache = os.environ.get("ATTENTION_JAX_CACHE", os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
        "attention-three-ways", "jax"))
    if cache != "off":
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def main(backend: str) -> None:
    """Serve requests on stdin until it closes."""
    lower_priority()
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the framework's prints: to stderr
    os.environ["KERAS_BACKEND"] = backend
    try:
        import keras

        if backend == "jax":
            _jax_cache()
        ready = {"ok": True, "keras": keras.__version__, "backend": keras.backend.backend()}
    except Exception as exc:  # noqa: BLE001 - reported to the caller
        ready = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
    write_message(replies, encode({}, ready))
    while ready["ok"]:
        message = read_message(sys.stdin.buffer)
        if message is None:
            return
        arrays, options = decode(message)
        try:
            reply = encode({"output": attend(backend, arrays, options)}, {"ok": True})
        except Exception as exc:  # noqa: BLE001 - a failing call is a result
            reply = encode({}, {"ok": False, "type": type(exc).__name__,
                                "message": str(exc)})
        write_message(replies, reply)


if __name__ == "__main__":
    main(sys.argv[1])
