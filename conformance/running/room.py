"""Where a run's cells are computed, and in which order: the execution room.

The runner's loop hands the room every cell of the run (``add``: each backend column on every
case in turn, then the peers case by case, column by column) and takes the cells back in that
order (``ordered``); the room decides where and when each is computed:

* ``Room``: every cell in the harness's process, when its turn comes; between two cases it lets
  every backend free the programs it compiled for the previous one (``release``: JAX keeps
  them all).
* ``Threads``: the command line's quick run: ``Room``, a compiling backend's cells two at a
  time (``Threads``' docstring).
* ``Ahead``: the command line's full run, one per process. It spends most of its time in the
  harness's own process tracing JAX programs, single-threaded; the machine has other cores. So
  before the first cell, ``Ahead`` hands every case × dtype to other processes:

  - **the background peer worker** (``PeerWorker`` here, ``peer_worker`` inside it) computes
    the cells of the peers marked ``background`` (the torch, transformers and onnxruntime
    columns) on every expectation, in the run's order, and streams each cell back as soon as it
    is judged. It runs the harness's ``runner.run_peer_cell`` there, so a cell is the same as
    in-process and no framework's exception has to cross processes; the expectations travel
    pickled (``Expected``, its ``CaseData`` and a ``mods.Mod`` pickle; one that does not is
    computed in-process);
  - **the keras workers** (``keras_worker``, one process per Keras backend) get every case's
    request queued (``Peer.submit``); the harness judges their outputs itself.

  The harness's process computes its own cells first and takes the others' after them
  (``remote``), in the run's order, so the report's order and content do not change. Once the
  first case has run, every column's framework is imported, and ``gc.freeze()`` moves those
  millions of long-lived objects out of the collector's sight, so the collection in each later
  ``release`` scans only what the cases made (milliseconds instead of ~0.4 s per case with all
  peers loaded). Which peers go to the background worker was measured (docs/checking.md,
  "Processes of a run"): the torch-family columns need no JAX and cost the harness's process
  about 37 of its CPU seconds; the JAX peers (``jax.nn``, ``flax.nnx``) stay in the harness's
  process, which has JAX loaded anyway: moved too, they evened out the two processes' CPU
  seconds but cost a second JAX and its programs in the worker (870 MiB more at the run's
  peak).

Every wait on a worker is bounded: the first cell within ``START_TIMEOUT`` seconds of the
worker's start (it imports torch, transformers and onnxruntime), each later one within
``CELL_TIMEOUT`` of the one before. A worker that exits or does not answer in time (it is then
killed) makes its cell and every later cell of its peers an "error" naming what happened, at
once: never a hang, never a traceback. The workers end with the run (``close``, also on Ctrl-C,
which the workers ignore: the harness kills them) and at interpreter exit.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..cases.expected import Expected
from ..comparing.results import Cell, Column
from ..peers import Peer
from . import keras_worker, workers

#: Seconds the background worker may take for its first cell (Python, torch, transformers).
START_TIMEOUT = workers.START_TIMEOUT
#: Seconds it may take for each later cell.
CELL_TIMEOUT = workers.CALL_TIMEOUT
_ENTRY = "conformance.running.peer_worker:serve"
_LIVE: weakref.WeakSet[PeerWorker] = weakref.WeakSet()


def release(columns: list[Column]) -> None:
    """Let every backend of ``columns`` free the programs it compiled (JAX keeps them all)."""
    for col in columns:
        if col.backend is not None:
            col.backend.release()


class Room:
    """One run's cells, each computed in this process when its turn comes, in the run's order
    (module docstring). ``expectations``: the run's, as the loop reads them (here: as given, a
    generator stays one); ``run_peer_cell(peer, exp)``: a peer's cell. A context manager."""

    #: Threads that compute the cells of a backend that compiles (``Threads``: 2).
    compile_threads = 1

    @staticmethod
    def elsewhere(peer: Peer) -> bool:
        """True when this room has ``peer``'s cells computed by another process (``Ahead``);
        the progress bar then counts them as free."""
        return False

    def __init__(self, columns: list[Column], expectations: Iterable[Expected],
                 run_peer_cell: Callable[[Peer, Expected], Cell]) -> None:
        self.columns = columns
        self.expectations = expectations
        self.run_peer_cell = run_peer_cell
        self._order: list[tuple[Column, Expected, Cell | None]] = []  # ``add``'s cells
        self._case: str | None = None

    def add(self, column: Column, exp: Expected, compute: Callable[[], Cell]) -> Cell | None:
        """The run's next cell: ``compute()`` now (returned), or, when another process computes
        it (``remote``), taken by ``ordered`` after this process's own (None). A new case first
        frees what the previous one compiled (``next_case``)."""
        if self._case is not None and exp.case != self._case:
            self.next_case()
        self._case = exp.case
        remote = column.kind == "peer" and self.remote(column.peer, exp)
        cell = None if remote else compute()
        self._order.append((column, exp, cell))
        return cell

    def next_case(self) -> None:
        """Between two cases: every backend frees the programs compiled for the previous one."""
        release(self.columns)

    def ordered(self, take: Callable[[Column, Expected], Cell]) -> list[Cell]:
        """Every cell ``add`` was given, in its order, the others' taken with ``take`` (after
        the last case's programs are freed)."""
        release(self.columns)
        return [take(column, exp) if cell is None else cell for column, exp, cell in self._order]

    def cell(self, peer: Peer, exp: Expected) -> Cell:
        """The cell of ``peer`` on ``exp``: ``run_peer_cell``'s, here."""
        return self.run_peer_cell(peer, exp)

    def remote(self, peer: Peer, exp: Expected) -> bool:
        """True when the cell of ``peer`` on ``exp`` is computed in another process: never
        here."""
        return False

    def close(self) -> None:
        """Nothing runs elsewhere."""

    def __enter__(self) -> Room:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Threads(Room):
    """The command line's quick run: ``Room``, but a backend that compiles (JAX) computes its
    cells two at a time, in two threads. Most of a cold JAX cell is XLA compiling its program,
    which holds no Python lock, so one thread traces the next program while the other compiles
    (docs/checking.md, "Time and memory"). Between batches of ``BATCH`` cells no thread runs,
    and the programs of the batch are freed (``release``) as in ``Room``. Only for a run that
    owns its process: a thread's ``warnings.catch_warnings`` is not thread-safe."""

    compile_threads = 2
    BATCH = 16


class PeerWorker(workers.Channel):
    """The background peer worker process, seen from the harness (module docstring): it
    computes the cells of the peers ``names``, in that order, on each expectation
    ``submit``-ted; ``cell`` waits for one within the time limits."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)
        self.failure = ""
        self._cells: dict[tuple[int, str], Cell] = {}
        self._order: list[tuple[Expected, str]] = []  # what it computes, in its order
        self._done = 0
        self._last = time.monotonic()
        self._changed = threading.Condition()
        super().__init__(_ENTRY)
        self.put(workers.encode(self.names))
        _LIVE.add(self)

    def received(self, message: Any) -> None:
        index, name, cell = message
        with self._changed:
            self._cells[(index, name)] = cell
            self._done += 1
            self._last = time.monotonic()
            self._changed.notify_all()

    def ended(self, code: int | str | None, tail: str) -> None:
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
            data = workers.encode((index, exp))
        except (pickle.PicklingError, TypeError, AttributeError):
            return False
        self.put(data)
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

    def close(self, wait: float = 0.0) -> None:
        """End the worker now (its remaining work is not needed) and its threads."""
        super().close(wait)
        _LIVE.discard(self)


@atexit.register
def close_workers() -> None:
    """End every background peer worker still running (also at interpreter exit)."""
    for worker in list(_LIVE):
        worker.close()


class Ahead(Room):
    """The command line's run (module docstring): the ``background`` peers among ``columns`` in
    a ``PeerWorker``, every peer with a ``submit`` queued in its own worker, for each of
    ``expectations`` (read at once); ``gc.freeze()`` after the first case. The workers end with
    the run."""

    def __init__(self, columns: list[Column], expectations: Iterable[Expected],
                 run_peer_cell: Callable[[Peer, Expected], Cell]) -> None:
        expectations = list(expectations)
        super().__init__(columns, expectations, run_peer_cell)
        peers = [c.peer for c in columns if c.kind == "peer" and c.peer is not None]
        names = [p.name for p in peers if p.background]
        self.index = {(e.case, e.dtype): i for i, e in enumerate(expectations)}
        self.worker = PeerWorker(names) if names and expectations else None
        self.pending: dict[tuple[str, str, str], Callable[[], dict[str, np.ndarray]]] = {}
        self._frozen = False
        for i, exp in enumerate(expectations):
            if self.worker is not None and not self.worker.submit(i, exp):
                del self.index[(exp.case, exp.dtype)]  # computed here when its turn comes
            for peer in peers:
                if peer.submit is not None and not peer.background:
                    self.pending[(peer.name, exp.case, exp.dtype)] = _started(peer, exp)

    @staticmethod
    def elsewhere(peer: Peer) -> bool:
        """True for the peers computed by the background worker or a keras worker."""
        return peer.background or peer.submit is not None

    def next_case(self) -> None:
        """``Room.next_case``; the first time, every framework is loaded: ``gc.freeze()``."""
        super().next_case()
        if not self._frozen:
            gc.freeze()
            self._frozen = True

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
            keras_worker.close_workers()
            self.pending.clear()


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


__all__ = ["CELL_TIMEOUT", "START_TIMEOUT", "Ahead", "PeerWorker", "Room", "Threads",
           "close_workers", "release"]
