"""Context parallelism measured: bytes sent, per-device memory, time against one device.

    python benchmarks/context_parallel.py [--comm] [--memory] [--time] [--lengths 4096 16384]

Three tables (all by default), batch 1, 8 heads (kv_heads 8), head_dim 64, float32, causal with
the zig-zag layout:

* **bytes**: what one rank sends, per ring step and in total, forward and backward, counted by
  numpy_attn's simulation (its ``trace`` records every message with its size) next to the
  formula of ``attention_rules.context_parallel.message_bytes``, at 1,024 tokens for N = 2, 4, 8
  (every figure is linear in the length);
* **memory**: per-device bytes of forward + backward, ``benchmarks/context_parallel_memory.py``
  (JAX: ``memory_analysis()`` of the compiled per-device program, compiled only; torch: the
  live-tensor peak of a gloo rank); single-device ``blockwise_attention`` on the whole
  sequence is the N = 1 row;
* **time**: ``benchmarks/multi_device.py``'s timing (JAX host devices and torch gloo ranks on
  this machine) at 2,048 tokens.

On this machine the "devices" share 2 CPU cores: the time table shows the overhead of
splitting (communication, the per-pair merges, the schedule), not a speed-up the hardware
cannot give.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from attention_rules import context_parallel as cp  # noqa: E402

HEADS, HEAD_DIM = 8, 64
STRATEGIES = cp.STRATEGIES


def comm_table(length: int = 1024, world_sizes: tuple[int, ...] = (2, 4, 8)) -> str:
    """Bytes one rank sends (numpy's trace) against the formula, forward and backward."""
    from numpy_attn import context_parallel as ncp

    rng = np.random.default_rng(0)
    shape = (1, HEADS, length, HEAD_DIM)
    q, k, v, g = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    lines = ["| strategy | N | steps | fwd KiB/step | fwd KiB | formula | bwd KiB | formula | "
             "fwd+bwd / (K+V) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    kv_bytes = k.nbytes + v.nbytes
    for strategy in STRATEGIES:
        for world in world_sizes:
            kwargs = {"world_size": world, "strategy": strategy, "is_causal": True,
                      "load_balance": True}
            forward, both = [], []
            ncp.context_parallel_attention(q, k, v, trace=forward, **kwargs)
            ncp.context_parallel_attention_vjp(q, k, v, g, trace=both, **kwargs)
            sent = sum(e["bytes"] for e in forward if e["event"] == "send" and e["rank"] == 0)
            total = sum(e["bytes"] for e in both if e["event"] == "send" and e["rank"] == 0)
            sched = cp.schedule(strategy, world, length, length, True, "top_left", None, True)
            elements = {n: x.size // world for n, x in
                        (("query", q), ("key", k), ("value", v), ("output", q))}
            f_fwd = cp.message_bytes(strategy, world, elements, 4, sched.steps, "forward")
            f_bwd = cp.message_bytes(strategy, world, elements, 4, sched.steps, "backward")
            per_step = sent / max(sched.steps - 1, 1) if strategy == "ring" else sent
            lines.append(
                f"| {strategy} | {world} | {sched.steps} | {per_step / 1024:.0f} | "
                f"{sent / 1024:.0f} | {f_fwd / 1024:.0f} | {(total - sent) / 1024:.0f} | "
                f"{f_bwd / 1024:.0f} | {total / kv_bytes:.2f} |")
    return "\n".join(lines)


def memory_table(lengths: tuple[int, ...]) -> str:
    """Per-device MiB of forward + backward, JAX and torch (``context_parallel_memory.py``),
    with JAX's all-gather and Ulysses rows at 4 devices too."""
    from context_parallel_memory import memory_table as table

    return table(lengths, jax_rows=((2, "ring"), (4, "ring"), (4, "all_gather"), (4, "ulysses")))


def time_tables(length: int) -> str:
    """``multi_device.py`` at ``length`` tokens on this machine, in a fresh process."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi_device.py"),
                          "--length", str(length)], capture_output=True, text=True, cwd=ROOT,
                         timeout=3000)
    return out.stdout + (out.stderr[-2000:] if out.returncode else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comm", action="store_true")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--time-length", type=int, default=2048)
    args = parser.parse_args(argv)
    every = not (args.comm or args.memory or args.time)
    if every or args.comm:
        print("## Bytes one rank sends (1,024 tokens, causal, zig-zag)\n")
        print(comm_table())
        print()
    if every or args.memory:
        print("## Per-device memory of forward + backward\n")
        print(memory_table(tuple(args.lengths)))
        print()
    if every or args.time:
        print(f"## Time, forward + backward ({args.time_length} tokens)\n")
        print(time_tables(args.time_length))
    return 0


if __name__ == "__main__":
    sys.exit(main())
