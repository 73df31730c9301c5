"""The peer columns computed ahead, in other processes, while the harness runs the rest.

The command line's run (``runner.run(..., concurrent=True)``) spends most of its time in the
harness's own process tracing JAX programs, single-threaded; the machine has other cores. So
before the first cell, ``Ahead`` hands every case × dtype to two kinds of other processes:

* **the background peer worker** (``PeerWorker``, one process, ``background_worker`` inside
  it) computes the cells of the peers in ``BACKGROUND`` (the torch, transformers and
  onnxruntime columns) on every expectation, in the run's order, and streams each cell back
  as soon as it is judged. It runs the harness's ``runner.run_peer_cell`` there, so a cell is
  the same as in-process (tests/test_background_peers.py compares them) and no framework's
  exception has to cross processes; the expectations travel pickled (``Expected``, its
  ``CaseData`` and a ``mods.Mod`` pickle; one that does not is computed in-process);
* **the keras workers** (``keras_ops``, one process per Keras backend, as before) get every
  case's request queued (``Peer.submit``); the harness judges their outputs itself.

When a cell's turn comes, ``Ahead.cell`` takes it (waiting if needed), so the report's order and
content do not change. Which peers go to the background worker was measured (docs/checking.md,
"Processes of a run"): the torch-family columns need no JAX and cost the harness's process
about 37 of its CPU seconds; the JAX peers (``jax.nn``, ``flax.nnx``) stay in the harness's
process, which has JAX loaded anyway: moved too, they evened out the two processes' CPU seconds
but cost a second JAX and its programs in the worker (870 MiB more at the run's peak).

Every wait is bounded: the first cell within ``START_TIMEOUT`` seconds of the worker's start
(it imports torch, transformers and onnxruntime), each later one within ``CELL_TIMEOUT`` of the
one before. A worker that exits or does not answer in time (it is then killed) makes its cell
and every later cell of its peers an "error" naming what happened, at once: never a hang,
never a traceback. The workers end with the run (``Ahead.close``, also on Ctrl-C, which the
worker ignores: the harness kills it) and at interpreter exit.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection

import numpy as np

from ..expected import Expected
from ..results import Cell, Column
from . import Peer, keras_ops

#: The peers whose cells the background worker computes (the others: the harness's process).
BACKGROUND = ("torch.sdpa", "torch.MHA", "torch.MHA[sdpa]", "torch.flex", "transformers.eager",
              "transformers.sdpa", "transformers.gpt_oss", "onnxruntime", "onnxruntime[nonpad]")
#: Seconds the worker may take for its first cell (Python, torch, transformers: imported).
START_TIMEOUT = keras_ops.START_TIMEOUT
#: Seconds it may take for each later cell.
CELL_TIMEOUT = keras_ops.CALL_TIMEOUT
_BOOT = ("import sys, json, os; sys.path[:] = json.loads(sys.argv[1]); "
         "from conformance.peers.background_worker import serve; serve(int(sys.argv[2])); "
         "os._exit(0)")
_LIVE: weakref.WeakSet[PeerWorker] = weakref.WeakSet()


class PeerWorker:
    """The background peer worker process, seen from the harness (module docstring)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, json.dumps(sys.path), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.output: collections.deque[str] = collections.deque(maxlen=20)
        self.failure = ""
        self._cells: dict[tuple[int, str], Cell] = {}
        self._order: list[tuple[Expected, str]] = []  # what it computes, in its order
        self._done = 0
        self._last = time.monotonic()
        self._changed = threading.Condition()
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        self._outbox.put(pickle.dumps(self.names))
        self._threads = [threading.Thread(target=f, daemon=True)
                         for f in (self._send, self._read, self._read_output)]
        for thread in self._threads:
            thread.start()
        _LIVE.add(self)

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
                index, name, cell = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError, pickle.UnpicklingError):
                break
            with self._changed:
                self._cells[(index, name)] = cell
                self._done += 1
                self._last = time.monotonic()
                self._changed.notify_all()
        try:
            code: int | str | None = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = "unknown"
        time.sleep(0.1)  # its last words reach ``output``
        tail = " | ".join(line for line in list(self.output)[-3:] if line)
        self._fail(f"exited (code {code})" + (f": {tail}" if tail else ""))

    def _fail(self, what: str) -> None:
        with self._changed:
            if not self.failure:
                self.failure = (f"the background peer worker {what}; this cell and the later "
                                f"ones of its peers were not computed")
            self._changed.notify_all()

    def submit(self, index: int, exp: Expected) -> bool:
        """Queue ``exp`` (the run's ``index``-th expectation): the worker computes the cell of
        each of its peers on it, in order after those queued before. False (nothing queued)
        when ``exp`` does not pickle: its cells are then the harness's to compute."""
        try:
            data = pickle.dumps((index, exp), protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError):
            return False
        self._outbox.put(data)
        self._order += [(exp, name) for name in self.names]
        return True

    def cell(self, index: int, exp: Expected, name: str) -> Cell:
        """The cell of peer ``name`` on the ``index``-th expectation ``exp`` (submitted
        before), waiting for it within the time limits; an "error" cell when the worker
        failed before computing it."""
        with self._changed:
            while (index, name) not in self._cells and not self.failure:
                limit = CELL_TIMEOUT if self._done else START_TIMEOUT
                left = self._last + limit - time.monotonic()
                if left <= 0:
                    hung, peer = self._order[min(self._done, len(self._order) - 1)]
                    self.proc.kill()
                    self.failure = (f"the background peer worker gave no cell within "
                                    f"{limit:g} s (on {peer} {hung.case} {hung.dtype}) and was "
                                    f"killed; this cell and the later ones of its peers were "
                                    f"not computed")
                    break
                self._changed.wait(left)
            cell = self._cells.pop((index, name), None)
        if cell is None:
            return Cell(exp.case, exp.dtype, name, status="error", ratio=None,
                        detail=self.failure, spec_backend=False)
        return cell

    def close(self) -> None:
        """End the worker now (its remaining work is not needed) and its threads."""
        self._outbox.put(None)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for thread in self._threads:
            thread.join(timeout=5)
        self.conn.close()
        _LIVE.discard(self)


@atexit.register
def close_workers() -> None:
    """End every background peer worker still running (also at interpreter exit)."""
    for worker in list(_LIVE):
        worker.close()


class Ahead:
    """One run's peer cells, started before the first cell (module docstring): the
    ``BACKGROUND`` peers among ``columns`` in a ``PeerWorker``, every other peer with a
    ``submit`` queued in its own worker, for each of ``expectations`` (none: every cell is
    ``run_peer_cell``'s, in this process, when its turn comes). ``cell`` gives each cell in
    the run's order. A context manager: the background worker ends with the run."""

    def __init__(self, columns: list[Column], expectations: list[Expected],
                 run_peer_cell: Callable[[Peer, Expected], Cell]) -> None:
        peers = [c.peer for c in columns if c.kind == "peer" and c.peer is not None]
        names = [p.name for p in peers if p.name in BACKGROUND]
        self.run_peer_cell = run_peer_cell
        self._order: list[tuple[Column, Expected, Cell | None]] = []  # ``add``'s cells
        self.index = {(e.case, e.dtype): i for i, e in enumerate(expectations)}
        self.worker = PeerWorker(names) if names and expectations else None
        self.pending: dict[tuple[str, str, str], Callable[[], dict[str, np.ndarray]]] = {}
        for i, exp in enumerate(expectations):
            if self.worker is not None and not self.worker.submit(i, exp):
                del self.index[(exp.case, exp.dtype)]  # computed here when its turn comes
            for peer in peers:
                if peer.submit is not None and peer.name not in BACKGROUND:
                    self.pending[(peer.name, exp.case, exp.dtype)] = _started(peer, exp)

    def cell(self, peer: Peer, exp: Expected) -> Cell:
        """The cell of ``peer`` on ``exp``: from the background worker, or judged here on the
        output its worker computed ahead, or (anything else) ``run_peer_cell``'s, here."""
        index = self._worker_index(peer, exp)
        if index is not None:
            return self.worker.cell(index, exp, peer.name)
        waiting = self.pending.pop((peer.name, exp.case, exp.dtype), None)
        if waiting is not None:
            return self.run_peer_cell(dataclasses.replace(peer, compute=lambda _: waiting()),
                                      exp)
        return self.run_peer_cell(peer, exp)

    def add(self, column: Column, exp: Expected, compute: Callable[[], Cell]) -> None:
        """The run's next cell: ``compute()`` now, or, when another process computes it
        (``remote``), taken by ``ordered`` after this process's own."""
        remote = column.kind == "peer" and self.remote(column.peer, exp)
        self._order.append((column, exp, None if remote else compute()))

    def ordered(self, take: Callable[[Column, Expected], Cell]) -> list[Cell]:
        """Every cell ``add`` was given, in its order, the others' taken with ``take``."""
        return [take(column, exp) if cell is None else cell for column, exp, cell in self._order]

    def remote(self, peer: Peer, exp: Expected) -> bool:
        """True when the cell of ``peer`` on ``exp`` is computed in another process (the
        background worker or a keras worker): ``cell`` may have to wait for it."""
        return self._worker_index(peer, exp) is not None or \
            (peer.name, exp.case, exp.dtype) in self.pending

    def _worker_index(self, peer: Peer, exp: Expected) -> int | None:
        """The index the background worker computes ``peer``'s cell on ``exp`` under, or None
        (not one of its peers, or a case it was not given)."""
        if self.worker is None or peer.name not in self.worker.names:
            return None
        return self.index.get((exp.case, exp.dtype))

    def close(self) -> None:
        """End the background worker; keras workers with requests left (an interrupted run)
        too, since what they would still compute is not needed."""
        if self.worker is not None:
            self.worker.close()
        if self.pending:
            keras_ops.close_workers()
            self.pending.clear()

    def __enter__(self) -> Ahead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _started(peer: Peer, exp: Expected) -> Callable[[], dict[str, np.ndarray]]:
    """``peer.submit(exp)``; what it raises (``NotApplicable``: the case cannot be expressed)
    is raised again when the cell's turn comes, so the cell says it as in-process."""
    try:
        return peer.submit(exp)
    except Exception as exc:  # noqa: BLE001 - re-raised at the cell's turn
        failed = exc

    def again() -> dict[str, np.ndarray]:
        raise failed

    return again


__all__ = ["BACKGROUND", "CELL_TIMEOUT", "START_TIMEOUT", "Ahead", "PeerWorker",
           "close_workers"]
