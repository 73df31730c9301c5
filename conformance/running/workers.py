"""The one protocol of the harness's worker processes: how each starts, and what goes between.

A worker is a fresh interpreter (``start``, like multiprocessing's "spawn": JAX or torch may be
loaded in the harness, so the harness is never forked): ``python -c`` with the harness's
``sys.path``, which calls one function of the project (``"module:function"``) with the worker's
end of a socket pair and its arguments. It is a plain process, not a
``multiprocessing.Process``, so the harness's own ``__main__`` (a script calling the Python API,
a reproducer the report printed) is never run again in it. Over the socket
(``multiprocessing.connection``) each message is one pickled object (``encode``, ``decode``;
``send``, ``receive``): a request, an answer, a cell.

Three kinds of worker speak it:

* ``module_worker``: a checked module given by its dotted path, one request and one answer per
  call, each within ``--timeout`` seconds;
* ``peer_worker``: the peers' cells, computed ahead of their turn and streamed back as each is
  judged (``room.Ahead``);
* ``keras_worker``: ``keras.ops.dot_product_attention`` on one Keras backend per process, the
  requests pipelined.

The last two are helpers of the harness: on the worker's side they ``lower_priority`` by
``NICE``, and the harness holds each through a ``Channel`` (a thread sends, so the caller never
blocks; a thread reads every message as it comes; the worker's output is kept, its last lines
naming a failure). Every worker ignores SIGINT (``connect``): Ctrl-C is the harness's to handle,
and it ends its workers.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

#: How much less CPU priority the harness's helper processes take than the harness (``nice``):
#: the harness's own process is the run's longest, so on a busy machine it goes first, and the
#: helpers, which finish earlier, take what is left (docs/checking.md, "Processes of a run").
NICE = 5
#: Seconds a helper may take for its first answer (its imports: Python, the frameworks).
START_TIMEOUT = 180.0
#: Seconds a helper may take for each later answer.
CALL_TIMEOUT = 120.0
_BOOT = ("import sys, json, importlib; sys.path[:] = json.loads(sys.argv[1]); "
         "module, _, function = sys.argv[2].partition(':'); "
         "getattr(importlib.import_module(module), function)(*sys.argv[3:])")


# ---------------------------------------------------------------------------- the messages


def encode(message: Any) -> bytes:
    """One message as bytes (pickled: NumPy arrays keep their dtype, bfloat16 too, and bits)."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    """The message ``encode`` made."""
    return pickle.loads(data)


def send(conn: Connection, message: Any) -> None:
    """Send one message."""
    conn.send_bytes(encode(message))


def receive(conn: Connection) -> Any:
    """The next message (waiting for it); ``EOFError`` or ``OSError`` when the other side is
    gone."""
    return decode(conn.recv_bytes())


# ---------------------------------------------------------------------------- the processes


def start(entry: str, *args: str, env: dict[str, str] | None = None,
          capture: bool = False) -> tuple[subprocess.Popen, Connection]:
    """Start a worker that runs ``entry`` (``"package.module:function"``) as
    ``function(fd, *args)``, ``fd`` its end of the socket; returns the process and the
    harness's end. ``capture``: its stdout and stderr, together, are the process's
    ``stdout`` pipe (else they are the harness's)."""
    ours, theirs = socket.socketpair()
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, json.dumps(sys.path), entry, str(theirs.fileno()),
             *args], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.STDOUT if capture else None)
    finally:
        theirs.close()
    return process, Connection(ours.detach())


def stop(process: subprocess.Popen, conn: Connection) -> None:
    """Close the connection and kill the process (at exit, on a timeout, when collected)."""
    conn.close()
    if process.poll() is None:
        process.kill()
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process that ignores SIGKILL
        pass


def connect(fd: str) -> Connection:
    """The worker's end of the socket (``start``'s ``fd``); from here on the worker ignores
    SIGINT (Ctrl-C is the harness's to handle: it ends its workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return Connection(int(fd))


def lower_priority() -> None:
    """Lower this process's CPU priority by ``NICE`` (where the system allows; else as is)."""
    try:
        os.nice(NICE)
    except (AttributeError, OSError):  # no os.nice (Windows), or not permitted
        pass


class Channel:
    """The harness's side of a helper worker (``start``, output captured): ``put`` queues a
    message (a thread sends them in order, so the caller never blocks on a full socket), a
    thread reads each message the worker sends and hands it to ``received``; when the worker's
    side closes, ``ended`` gets its exit code and the last lines it printed. ``output`` keeps
    those lines. Subclasses define ``received`` and ``ended``."""

    #: Seconds an ending worker may take to give its exit code (then it reads "unknown").
    exit_wait = 5.0

    def __init__(self, entry: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc, self.conn = start(entry, *args, env=env, capture=True)
        self.output: collections.deque[str] = collections.deque(maxlen=20)
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        self._threads = [threading.Thread(target=f, daemon=True)
                         for f in (self._send, self._read, self._read_output)]
        for thread in self._threads:
            thread.start()

    def put(self, data: bytes) -> None:
        """Queue one ``encode``-d message for the worker."""
        self._outbox.put(data)

    def _send(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the worker is gone: the reader says why
                return

    def _read_output(self) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            self.output.append(line.decode(errors="replace").rstrip())

    def _read(self) -> None:
        while True:
            try:
                message = receive(self.conn)
            except (EOFError, OSError, pickle.UnpicklingError):
                break
            self.received(message)
        self.ended(*self.exit_code_and_tail(self.exit_wait))

    def exit_code_and_tail(self, wait: float) -> tuple[int | str | None, str]:
        """The worker's exit code (waiting up to ``wait`` seconds; "unknown" if it runs on)
        and its last three lines of output."""
        try:
            code: int | str | None = self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            code = "unknown"
        for thread in self._threads[2:]:  # its last words reach ``output``
            thread.join(timeout=1)
        return code, " | ".join(line for line in list(self.output)[-3:] if line)

    def received(self, message: Any) -> None:
        """One message from the worker (called on the reading thread)."""
        raise NotImplementedError

    def ended(self, code: int | str | None, tail: str) -> None:
        """The worker's side closed: it exited with ``code`` after printing ``tail``."""
        raise NotImplementedError

    def finish(self) -> None:
        """Ask the worker to end once it has answered what it was sent (the message None)."""
        self.put(encode(None))

    def close(self, wait: float = 0.0) -> None:
        """End the sending thread and the worker: after ``finish`` it may take ``wait``
        seconds to exit, else (and without ``finish``) it is killed. Then the threads end."""
        self._outbox.put(None)
        if self.proc.poll() is None and wait:
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for thread in self._threads:
            thread.join(timeout=5)
        self.conn.close()


__all__ = ["CALL_TIMEOUT", "NICE", "START_TIMEOUT", "Channel", "connect", "decode", "encode",
           "lower_priority", "receive", "send", "start", "stop"]
