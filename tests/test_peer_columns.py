"""The peer columns the command line's run computes ahead, in other processes.

The command line's run computes the torch-family peers in a background worker process and
queues every keras request up front; its cells must be the ones the harness computes in its own
process (the same statuses, ratios, steps and known-difference checks), and a worker that dies
or hangs must give "error" cells that say so, at once, never a hang. The cases are cheap
(float32 ``self``, ``padding``: a known difference of ``torch.MHA``, ``window``: n/a, and a
case with mods, whose ``conformance.cases.mods.Mod`` objects travel pickled and are read there).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import time

import pytest
from harness_helpers import _expected

from conformance import peers
from conformance.cases.expected import Expected
from conformance.comparing.results import Cell, Column
from conformance.running import keras_worker, room, runner
from conformance.running.workers import NICE

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="needs torch: pip install torch"),
              pytest.mark.slow]  # each test starts worker processes that import torch
TORCH_PEERS = ("torch.sdpa", "torch.MHA")


def _columns(names: tuple[str, ...]) -> list[Column]:
    return [Column(n, "peer", peer=peers.get(n)) for n in names if peers.get(n).available()]


def test_the_background_cells_are_the_in_process_cells(monkeypatch) -> None:
    names = (*TORCH_PEERS, "keras[numpy]")
    columns = _columns(names)
    exps = [_expected(case, "float32")
            for case in ("self", "padding", "window", "mods_causal_alibi")]
    here = runner.run_columns(columns, exps)
    assert {c.case: c.status for c in here.cells if c.column == "torch.MHA"} == {
        "self": "ok", "padding": "known", "window": "n/a",
        "mods_causal_alibi": "n/a"}  # every path of run_peer_cell is crossed

    made: list[room.Ahead] = []

    class Recorded(room.Ahead):
        def __init__(self, *args: object) -> None:
            super().__init__(*args)
            made.append(self)

    in_this_process = []
    judge = runner.run_peer_cell

    def judged_here(peer: peers.Peer, exp: Expected) -> Cell:
        in_this_process.append(peer.name)
        return judge(peer, exp)

    monkeypatch.setattr(runner, "run_peer_cell", judged_here)
    ahead = runner.run_columns(columns, exps, room=Recorded)
    # repr: every field, floats to the last bit, NaN equal to NaN (a fully masked row)
    assert [repr(dataclasses.asdict(c)) for c in ahead.cells] == [
        repr(dataclasses.asdict(c)) for c in here.cells]
    # the torch peers were computed and judged in the worker, keras judged here on its output
    assert set(in_this_process) <= {"keras[numpy]"}
    assert made and made[0].worker is not None and made[0].worker.names == TORCH_PEERS
    assert made[0].worker.proc.poll() is not None  # the worker ended with the run


def _worker_after_one_cell() -> tuple[room.PeerWorker, list]:
    """A worker of torch.sdpa that has given the cell of ``self`` and is then stopped
    (SIGSTOP) before ``cross`` is queued: it cannot compute anything more."""
    exps = [_expected(case, "float32") for case in ("self", "cross")]
    worker = room.PeerWorker(["torch.sdpa"])
    worker.submit(0, exps[0])
    assert worker.cell(0, exps[0], "torch.sdpa").status == "ok"
    os.kill(worker.proc.pid, signal.SIGSTOP)
    worker.submit(1, exps[1])
    return worker, exps


def test_a_worker_that_dies_mid_run_gives_error_cells_not_a_hang() -> None:
    worker, exps = _worker_after_one_cell()
    try:
        os.kill(worker.proc.pid, signal.SIGKILL)
        start = time.monotonic()
        cell = worker.cell(1, exps[1], "torch.sdpa")
        assert time.monotonic() - start < 10
        assert (cell.status, cell.case, cell.column) == ("error", "cross", "torch.sdpa")
        assert "background peer worker exited (code -9)" in cell.detail
        assert "were not computed" in cell.detail and not cell.spec_backend
    finally:
        worker.close()


def test_a_worker_that_hangs_is_killed_after_the_timeout(monkeypatch) -> None:
    monkeypatch.setattr(room, "CELL_TIMEOUT", 1.0)
    worker, exps = _worker_after_one_cell()
    try:
        start = time.monotonic()
        cell = worker.cell(1, exps[1], "torch.sdpa")
        assert time.monotonic() - start < 10
        assert cell.status == "error"
        assert "gave no cell within 1 s (on torch.sdpa cross float32)" in cell.detail
        assert worker.proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        worker.close()


def test_the_harness_takes_the_workers_cells_after_its_own_in_the_runs_order(
        monkeypatch) -> None:
    """With a spec backend beside the peers, the concurrent run computes every cell of its own
    process first (the backend's, and the peers it judges itself) and takes the workers' cells
    after them, never waiting for a worker mid-run; the cells keep the run's order (that of an
    in-process run)."""
    numpy_col = Column("numpy", "backend", backend=runner.backends_mod.get("numpy"))
    columns = [numpy_col, *_columns(("torch.sdpa", "keras[numpy]"))]
    exps = [_expected(case, "float32") for case in ("self", "padding")]
    here = runner.run_columns(columns, exps)
    events: list[str] = []
    own, take = runner.run_cell, room.Ahead.cell

    def run_cell(*args: object, **kwargs: object) -> Cell:
        events.append("own")
        return own(*args, **kwargs)

    def cell(self: room.Ahead, peer: peers.Peer, exp: Expected) -> Cell:
        events.append("remote" if self.remote(peer, exp) else "own")
        return take(self, peer, exp)

    monkeypatch.setattr(runner, "run_cell", run_cell)
    monkeypatch.setattr(room.Ahead, "cell", cell)
    ahead = runner.run_columns(columns, exps, room=room.Ahead)
    assert [(c.case, c.column, c.status) for c in ahead.cells] == [
        (c.case, c.column, c.status) for c in here.cells]
    assert [(c.case, c.column) for c in ahead.cells] == [
        (e.case, col.name) for e in exps for col in columns]  # case by case, column by column
    assert events == ["own"] * 2 + ["remote"] * 4  # numpy ×2, then torch.sdpa and keras ×2


def test_ahead_names_the_cells_computed_elsewhere() -> None:
    """``Ahead.remote``: the background worker's peers and the queued keras requests, not a
    peer judged in this process, nor a case the worker was not given."""
    columns = _columns(("torch.sdpa", "keras[numpy]", "jax.nn"))
    exps = [_expected("self", "float32")]
    by_name = {c.name: c.peer for c in columns}
    with room.Ahead(columns, exps, runner.run_peer_cell) as ahead:
        assert ahead.remote(by_name["torch.sdpa"], exps[0])
        if "keras[numpy]" in by_name:
            assert ahead.remote(by_name["keras[numpy]"], exps[0])
        if "jax.nn" in by_name:
            assert not ahead.remote(by_name["jax.nn"], exps[0])
        assert not ahead.remote(by_name["torch.sdpa"], _expected("cross", "float32"))
        for peer in by_name.values():  # taken, so the workers have nothing left queued
            ahead.cell(peer, exps[0])


def test_the_workers_run_at_a_lower_cpu_priority() -> None:
    """The background worker and a keras worker lower their priority by
    ``workers.NICE`` (the harness's own process is the run's longest: it goes first on a
    busy machine)."""
    assert NICE > 0
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    exp = _expected("self", "float32")
    worker = room.PeerWorker(["torch.sdpa"])
    try:
        worker.submit(0, exp)
        assert worker.cell(0, exp, "torch.sdpa").status == "ok"  # it is serving
        assert os.getpriority(os.PRIO_PROCESS, worker.proc.pid) == min(19, ours + NICE)
    finally:
        worker.close()
    if importlib.util.find_spec("keras") is None:
        return
    keras = keras_worker.Worker("numpy")
    try:
        keras._started()  # its ready message: it has set its priority
        assert os.getpriority(os.PRIO_PROCESS, keras.proc.pid) == min(19, ours + NICE)
    finally:
        keras.close()
