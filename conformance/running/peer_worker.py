"""Inside the background peer worker (``room.PeerWorker``): every cell of its peers.

The process is a fresh interpreter started by the harness (``workers.start``: the harness's
``sys.path``; never a fork of a process that has JAX or torch loaded). Over its socket
(``workers``' messages) it reads first the names of its peers, then one ``(index, Expected)``
per case × dtype, in the run's order, and answers each with one ``(index, peer name, Cell)``
per peer, in the order of the names: the cell is ``runner.run_peer_cell``'s, the same function
the harness runs in its own process, so the verdicts, known differences and their checks are
the same by construction. A cell whose judging itself raises (a bug of the harness) comes back
as an "error" cell naming it. The process runs at a lower priority (``workers.NICE``), ignores
SIGINT (Ctrl-C is the harness's to handle: it kills this process) and ends, without waiting for
anything (``os._exit``), when its socket closes.
"""

from __future__ import annotations

import os

from .. import peers
from ..cases.expected import Expected
from ..comparing.results import Cell, error_text
from . import runner, workers


def cell_of(peer_name: str, exp: Expected) -> Cell:
    """``runner.run_peer_cell`` of the peer called ``peer_name`` on ``exp``; an exception
    escaping it is an "error" cell naming the exception."""
    try:
        return runner.run_peer_cell(peers.get(peer_name), exp)
    except Exception as exc:  # noqa: BLE001 - reported as the cell, never a traceback
        return Cell(exp.case, exp.dtype, peer_name, status="error", ratio=None,
                    spec_backend=False,
                    detail=f"the background peer worker failed judging it: {error_text(exc)}")


def serve(fd: str) -> None:
    """The worker's main loop on the connected socket ``fd`` (module docstring)."""
    conn = workers.connect(fd)
    workers.lower_priority()
    try:
        names: tuple[str, ...] = workers.receive(conn)
        while True:
            index, exp = workers.receive(conn)
            for name in names:
                workers.send(conn, (index, name, cell_of(name, exp)))
    except (EOFError, OSError):
        pass  # the harness closed the socket (the run is over) or is gone
    os._exit(0)


__all__ = ["cell_of", "serve"]
