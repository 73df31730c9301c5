"""Context-parallel checks: ``context_parallel_attention`` of every backend, forward and
gradients, against the float64 reference, for each world size and strategy, and its bad calls.

Each case is a small attention problem (``CASES``) whose inputs are laid out for the ranks
(``attention_rules.context_parallel.positions``); the output and the gradients of query, key and
value are compared with ``cases.expected`` (float64 reference, the naive float32 baseline,
exact zeros on fully masked rows) by ``compare.compare``, the harness's one tolerance rule.

* NumPy runs in this process (its ranks are simulated);
* JAX runs in ONE subprocess with ``jax_num_cpu_devices`` set to the largest world size, each
  world size a mesh of the first devices, each check one ``jit`` of the forward and the VJP;
* torch runs in ONE subprocess that spawns the largest world of gloo ranks on 127.0.0.1 (each
  smaller world is a ``dist.new_group`` of the first ranks); each rank compares its own shards.
  The process group has a timeout, the subprocess a deadline after which every rank is killed.

Bad calls (``BAD_CALLS``) must raise ValueError naming the function on every rank; in torch a
rank that never joins makes the others fail within a short group timeout.

Entry points: ``run_context_parallel(backends, world_sizes)`` returns ``CPResult`` rows;
``python -m conformance.context_parallel [--backend B ...] [--world-size N ...]`` prints them
(exit 1 on a failure); ``python -m conformance.context_parallel schedule [--world-size 4]
[--strategy ring] [--load-balance] [--causal]`` draws the schedule the backends follow.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from attention_rules import context_parallel as cp

from ..usage import at_least, require_frameworks
from .cases import BACKENDS, CASES, DEADLINE_S, STRATEGIES, WORLD_SIZES
from .checks import CPResult
from .numpy_checks import run_numpy
from .workers import jax_worker, torch_worker

ROOT = Path(__file__).resolve().parents[2]  # the folder that holds ``conformance``


# ------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------


def _start(backend: str, world_sizes: tuple[int, ...], strategies: tuple[str, ...],
           cases: tuple[str, ...] | None) -> subprocess.Popen:
    """Start ``--worker backend`` in a new process group (so a timeout kills its ranks too)."""
    command = [sys.executable, "-m", "conformance.context_parallel", "--worker", backend,
               "--world-size", *map(str, world_sizes), "--strategy", *strategies]
    if cases:
        command += ["--case", *cases]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _collect(backend: str, process: subprocess.Popen, world: int, deadline: float
             ) -> list[CPResult]:
    """The worker's rows; one failed row if it fails or passes ``deadline`` (then killed)."""
    try:
        out, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return [CPResult(backend, world, "-", "subprocess", "error", False,
                         note="killed: past the deadline")]
    rows = [line for line in out.splitlines() if line.startswith("[")]
    if process.returncode != 0 or not rows:
        return [CPResult(backend, world, "-", "subprocess", "error", False,
                         note=f"exit {process.returncode}: {err.strip()[-400:]}")]
    return [CPResult(**row) for row in json.loads(rows[-1])]


def run_context_parallel(backends: tuple[str, ...] = BACKENDS,
                         world_sizes: tuple[int, ...] = WORLD_SIZES,
                         strategies: tuple[str, ...] = STRATEGIES,
                         cases: tuple[str, ...] | dict[str, tuple[str, ...]] | None = None,
                         timeout: float = DEADLINE_S + 60) -> list[CPResult]:
    """Every context-parallel check of ``backends``: NumPy here, JAX and torch each in one
    subprocess, started together (killed after ``timeout`` seconds). ``cases``: names (see
    ``selected``), or per backend a dict of them. A backend that is not installed gives one
    failed row naming the install command."""
    import importlib.util

    def names(backend: str) -> tuple[str, ...] | None:
        return cases.get(backend) if isinstance(cases, dict) else cases

    deadline = time.monotonic() + timeout
    started, results = {}, []
    for backend in backends:
        if backend == "numpy":
            continue
        if importlib.util.find_spec(backend) is None:
            results.append(CPResult(backend, 0, "-", "not installed", "error", False,
                                    note="pip install -r requirements.txt"))
        else:
            started[backend] = _start(backend, tuple(world_sizes), tuple(strategies),
                                      names(backend))
    if "numpy" in backends:
        results += run_numpy(tuple(world_sizes), tuple(strategies), names("numpy"))
    for backend, process in started.items():
        results += _collect(backend, process, max(world_sizes), deadline)
    return results


def report(results: list[CPResult]) -> str:
    """One line per row, then a summary line."""
    failed = [r for r in results if not r.passed]
    lines = [r.line() for r in results]
    lines.append(f"{len(results) - len(failed)}/{len(results)} context-parallel checks pass")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m conformance.context_parallel [run|schedule] ...``: exit 1 on a failure."""
    parser = argparse.ArgumentParser(prog="python -m conformance.context_parallel",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", default="run", choices=("run", "schedule"))
    parser.add_argument("--backend", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--world-size", nargs="+", type=at_least(1), default=None)
    parser.add_argument("--strategy", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--case", nargs="+", default=None,
                        help=f"{', '.join(c.name for c in CASES)}; NAME@N: at world size N only")
    parser.add_argument("--load-balance", action="store_true", help="schedule: zig-zag")
    parser.add_argument("--causal", action="store_true", help="schedule: the causal rule")
    parser.add_argument("--window", nargs=2, type=int, default=None, help="schedule: LEFT RIGHT")
    parser.add_argument("--seq-len", type=at_least(1), default=None,
                        help="schedule: q_len = kv_len")
    parser.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.command == "schedule":
        world = (args.world_size or [4])[0]
        seq_len = args.seq_len or 4 * world * cp.chunks_per_rank(args.load_balance)
        for strategy in args.strategy if len(args.strategy) < len(STRATEGIES) else ["ring"]:
            sched = cp.schedule(strategy, world, seq_len, seq_len, args.causal, "top_left",
                                None if args.window is None else tuple(args.window),
                                args.load_balance)
            print(cp.draw(sched))
        return 0
    world_sizes = tuple(args.world_size or WORLD_SIZES)
    if args.worker:
        worker = jax_worker if args.worker == "jax" else torch_worker
        rows = worker(world_sizes, tuple(args.strategy), args.case and tuple(args.case))
        print(json.dumps([asdict(r) for r in rows]))
        return 0
    require_frameworks(args.backend, "context-parallel " + " ".join(args.backend),
                       "or --backend numpy: numpy_attn's ranks are simulated in one process")
    results = run_context_parallel(tuple(args.backend), world_sizes, tuple(args.strategy),
                                   args.case and tuple(args.case))
    print(report(results))
    return 0 if all(r.passed for r in results) else 1

