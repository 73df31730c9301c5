"""The progress bar of a run: the share of its cells done and the time left, on a terminal only.

Cells cost very different times (a cold JAX cell compiles its program: about a second; a NumPy
cell is a hundredth of that), so each counts by its column's weight (``CELL_WEIGHTS``), and a
cell another process computes meanwhile (``Room.elsewhere``: the background peer worker, the
keras workers) counts as free, so the bar does not jump when the run takes those cells at the
end.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable

from ..cases.expected import Expected
from ..comparing.results import Column
from ..peers import Peer
from .room import Room

#: Relative cost of one cell, for the progress bar's share and time left: a cell of a backend
#: that compiles (JAX: tracing and compiling its program) against one that does not, and a
#: peer's (one on JAX compiles too). Measured on the quick profile (docs/checking.md, "Time
#: and memory"): a JAX cell takes 0.3–1.5 s, a NumPy or PyTorch cell 0.01–0.1 s.
CELL_WEIGHTS = {"compiles": 1.0, "eager": 0.05, "peer_compiles": 0.3, "peer": 0.05}


def cell_weight(col: Column, elsewhere: Callable[[Peer], bool] = Room.elsewhere
                ) -> float:
    """``CELL_WEIGHTS`` of a cell of ``col``; 0 for a peer whose cells another process
    computes meanwhile (``elsewhere``, the room's)."""
    if col.peer is not None and elsewhere(col.peer):
        return 0.0
    if col.backend is not None:
        return CELL_WEIGHTS["compiles" if col.backend.compiles else "eager"]
    compiles = col.peer is not None and col.peer.framework in ("jax", "flax", "keras")
    return CELL_WEIGHTS["peer_compiles" if compiles else "peer"]


class Progress:
    """A tqdm bar on stderr while cells run, only on a terminal (silent when piped): the share
    of the run done and the time left, each cell weighted by ``cell_weight``."""

    def __init__(self, columns: list[Column], rows: int, enabled: bool | None = None,
                 elsewhere: Callable[[Peer], bool] = Room.elsewhere) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._bar = None
        self._weight = {c.name: cell_weight(c, elsewhere) for c in columns}
        total = rows * sum(self._weight.values())
        if self.enabled and total and importlib.util.find_spec("tqdm") is not None:
            from tqdm import tqdm
            self._bar = tqdm(total=total, file=sys.stderr, leave=False, dynamic_ncols=True,
                             bar_format="{percentage:3.0f}% {bar} {elapsed}, about {remaining} "
                                        "left{postfix}")

    def running(self, col: Column, exp: Expected) -> None:
        """The cell of ``col`` on ``exp`` starts (named after the bar)."""
        if self._bar is not None:
            self._bar.set_postfix_str(f" {col.name} {exp.case} {exp.dtype}")

    def done(self, col: Column) -> None:
        """A cell of ``col`` is done."""
        if self._bar is not None:
            self._bar.update(self._weight[col.name])

    def clear(self) -> None:
        """Take the bar off the terminal until its next update (a line is printed)."""
        if self._bar is not None:
            self._bar.clear()

    def close(self) -> None:
        """Clear the bar."""
        if self._bar is not None:
            self._bar.close()


__all__ = ["CELL_WEIGHTS", "Progress", "cell_weight"]
