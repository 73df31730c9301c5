"""The JAX column of the harness grid, computed in another process while the suite runs.

``tests/test_harness_grid.py::test_backend_conforms`` checks every backend × case × dtype. The
NumPy and torch cells take milliseconds each; a JAX cell traces and lowers a program of every
step of its case (about a quarter of a second on 2 cores, single-threaded Python), and the
whole JAX column is about a fifth of the suite's time, while the suite's own process keeps one
core busy and leaves the other mostly idle. So when the collected tests include JAX grid
cells, ``GRID.run``, a job of the suite's background lane (``background_lane``, planned by
``conftest.pytest_collection_modifyitems``), runs the harness's own command line for exactly
those cases and dtypes in a subprocess::

    python -m conformance run --backend jax --no-peers --no-errors --hypothesis 0 \
        --case C ... --dtype D ... --json FILE

and each JAX grid item reads its cell from that report (``GRID.cell``): the cell the command line's
``runner.run_cell`` judged, with its status, ratio, detail and rerun command, as a user's run
gives it. The wait is bounded (``TIMEOUT``): a subprocess that dies, hangs or writes no report
fails every JAX grid item with its exit status and the end of its error output, never a hang.
The subprocess ends with the session (``GRID.stop``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Seconds the JAX column may take (about 60 s on 2 quiet cores).
TIMEOUT = 900
#: Its name in the background lane (``background_lane``).
JOB = "the grid's JAX column"

class Column:
    """One subprocess computing JAX cells (``GRID``: the one the grid's items read)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.cells: dict[tuple[str, str], dict[str, Any]] | str | None = None
        self.planned = False

    def plan(self) -> None:
        """The background lane will ``run`` this column: ``cell`` waits for the lane's job."""
        self.planned = True

    def run(self, pairs: set[tuple[str, str]]) -> int | None:
        """``start``, then wait for the subprocess (the background lane's job: the next job
        starts after it); its exit status, or None when it passed ``TIMEOUT`` (then killed)."""
        self.start(pairs)
        try:
            return self.proc.wait(timeout=TIMEOUT) if self.proc is not None else None
        except subprocess.TimeoutExpired:
            self.stop()
            return None

    def start(self, pairs: set[tuple[str, str]]) -> None:
        """Compute the JAX cells of ``pairs`` (case, dtype) in a subprocess, started now."""
        if not pairs or self.proc is not None:
            return
        folder = Path(tempfile.mkdtemp(prefix="jax-column-"))
        self.report, self.stderr = folder / "jax.json", folder / "stderr.txt"
        args = [sys.executable, "-m", "conformance", "run", "--backend", "jax", "--no-peers",
                "--no-errors", "--hypothesis", "0", "--json", str(self.report)]
        for case in sorted({c for c, _ in pairs}):
            args += ["--case", case]
        for dtype in sorted({d for _, d in pairs}):
            args += ["--dtype", dtype]
        root = Path(__file__).resolve().parent.parent
        with open(self.stderr, "w") as err:
            self.proc = subprocess.Popen(args, cwd=root, stdout=subprocess.DEVNULL, stderr=err)

    def cell(self, case: str, dtype: str, timeout: float = TIMEOUT) -> dict[str, Any] | None:
        """The report's JAX cell of ``case`` in ``dtype``, waiting for the subprocess (at
        most ``timeout`` seconds); None when ``start`` was not asked for it. Raises
        ``AssertionError`` naming what went wrong when the subprocess gives no report."""
        if self.planned:  # the lane's job (run here when the lane is busy with another)
            from background_lane import LANE

            LANE.result(JOB, lambda: None, timeout)
        if self.proc is None:
            return None
        if self.cells is None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                self.cells = f"no JAX column after {timeout} s (killed)"
            else:
                self.cells = self._read(self.proc.returncode)
        if isinstance(self.cells, str):
            raise AssertionError(self.cells)
        found = self.cells.get((case, dtype))
        assert found is not None, f"the JAX column's report has no cell {case} {dtype}"
        return found

    def _read(self, returncode: int) -> dict[tuple[str, str], dict[str, Any]] | str:
        """The report's JAX cells by (case, dtype), or why there are none."""
        tail = self.stderr.read_text(errors="replace")[-2000:]
        try:
            report = json.loads(self.report.read_text())
            return {(c["case"], c["dtype"]): c for c in report["cells"] if c["column"] == "jax"}
        except (OSError, ValueError, KeyError, TypeError) as error:
            return (f"the JAX column's subprocess (exit {returncode}) wrote no report "
                    f"({type(error).__name__}: {error}):\n{tail}")

    def stop(self) -> None:
        """End the subprocess if it still runs (the session ends)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


#: The grid's JAX column (``conftest`` starts it, ``test_backend_conforms`` reads it).
GRID = Column()
