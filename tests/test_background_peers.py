"""The peer columns computed ahead in other processes (``conformance.peers.background``).

The command line's run computes the torch-family peers in a background worker process and
queues every keras request up front; its cells must be the ones the harness computes in its own
process (the same statuses, ratios, steps and known-difference checks), and a worker that dies
or hangs must give "error" cells that say so, at once, never a hang. The cases are cheap
(float32 ``self``, ``padding``: a known difference of ``torch.MHA``, ``window``: n/a, and a
case with mods, whose ``conformance.mods.Mod`` objects travel pickled and are read there).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import time

import pytest
from harness_helpers import _expected

from conformance import peers, runner
from conformance.expected import Expected
from conformance.peers import background
from conformance.results import Cell, Column

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="needs torch: pip install torch")
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

    made: list[background.Ahead] = []

    class Recorded(background.Ahead):
        def __init__(self, *args: object) -> None:
            super().__init__(*args)
            made.append(self)

    in_this_process = []
    judge = runner.run_peer_cell

    def judged_here(peer: peers.Peer, exp: Expected) -> Cell:
        in_this_process.append(peer.name)
        return judge(peer, exp)

    monkeypatch.setattr(background, "Ahead", Recorded)
    monkeypatch.setattr(runner, "run_peer_cell", judged_here)
    ahead = runner.run_columns(columns, exps, concurrent=True)
    # repr: every field, floats to the last bit, NaN equal to NaN (a fully masked row)
    assert [repr(dataclasses.asdict(c)) for c in ahead.cells] == [
        repr(dataclasses.asdict(c)) for c in here.cells]
    # the torch peers were computed and judged in the worker, keras judged here on its output
    assert set(in_this_process) <= {"keras[numpy]"}
    assert made and made[0].worker is not None and made[0].worker.names == TORCH_PEERS
    assert made[0].worker.proc.poll() is not None  # the worker ended with the run


def _worker_after_one_cell() -> tuple[background.PeerWorker, list]:
    """A worker of torch.sdpa that has given the cell of ``self`` and is then stopped
    (SIGSTOP) before ``cross`` is queued: it cannot compute anything more."""
    exps = [_expected(case, "float32") for case in ("self", "cross")]
    worker = background.PeerWorker(["torch.sdpa"])
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
    monkeypatch.setattr(background, "CELL_TIMEOUT", 1.0)
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
