"""Every candidate of numpy_attn's tuner at one real shape, against torch SDPA in the same rounds.

    python benchmarks/tuning_sweep.py [--step forward|vjp] [--length 2048] [--causal]
                                      [--rounds 7] [--clock wall|cpu]

Shapes: batch 1, 8 heads, ``T`` tokens, head_dim 64, float32. The tuner (``numpy_attn/_fast/
tuning.py``) decides on a small trial problem; this script times its candidates
(``attention_rules.fast_paths.TUNING``) on the shape itself, each forced with
``set_tuning({...})``: the forward's block_q × exponential × product order, or the VJP's tiles
× product order (with the forward's entries as the tuner would pass them, ``--forward
block_q=256,exp2=1,keys_first=1``). Rounds alternate the variants' order; each call is made
twice and the second is timed (the first lets the allocator settle after the previous
variant's buffers). It prints the median time and its ratio to torch SDPA's (forward, or
forward + backward with autograd), by wall time or the process's CPU time (``--clock cpu``;
torch's threads spin, so its CPU time is not comparable and the ratio is to the fixed table).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import numpy as np

HEADS, HEAD_DIM = 8, 64


def candidates(step: str, forward: dict) -> dict[str, dict]:
    """The tuner's candidates for ``step``, by label: the entries to force."""
    from attention_rules.fast_paths import TUNING

    grid = TUNING["numpy_attn"]
    if step == "forward":
        return {f"block_q {b}, {'exp2' if e else 'exp'}, {'keys' if f else 'rows'} first":
                {"block_q": b, "exp2": e, "keys_first": f}
                for e, f, b in itertools.product(grid["exp2"], grid["keys_first"],
                                                 grid["block_q"])}
    return {f"tiles {kv} × {rows}, {'keys' if f else 'rows'} first":
            dict(forward, block_kv=kv, block_q_backward=rows, keys_first_backward=f)
            for f, (kv, rows) in itertools.product(grid["keys_first"], grid["backward_tiles"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", choices=("forward", "vjp"), default="forward")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--forward", default="keys_first=1",
                        help="the forward's entries for the VJP's candidates")
    args = parser.parse_args(argv)
    import torch

    import numpy_attn
    from numpy_attn._fast import tuning

    forward = tuning._parsed(args.forward, "--forward")
    gen = np.random.default_rng(0)
    q, k, v, g = (gen.standard_normal((1, HEADS, args.length, HEAD_DIM)).astype(np.float32)
                  for _ in range(4))
    tq, tk, tv, tg = (torch.from_numpy(x) for x in (q, k, v, g))
    leaves = [x.clone().requires_grad_(True) for x in (tq, tk, tv)]

    def ours() -> object:
        if args.step == "forward":
            return numpy_attn.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        return numpy_attn.scaled_dot_product_attention_vjp(q, k, v, g, is_causal=args.causal)

    def sdpa() -> object:
        if args.step == "forward":
            with torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(
                    tq, tk, tv, is_causal=args.causal)
        for leaf in leaves:
            leaf.grad = None
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=args.causal)
        out.backward(tg)
        return leaves[0].grad

    runs = {"the fixed table": "off", **candidates(args.step, forward)}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in [*runs, "torch SDPA"]}
    order = list(runs.items())
    for round_ in range(args.rounds):
        for name, mode in order if round_ % 2 == 0 else order[::-1]:
            tuning.set_tuning(mode)
            ours()  # untimed: the allocator settles
            start = clock()
            ours()
            times[name].append(clock() - start)
        sdpa()
        start = clock()
        sdpa()
        times["torch SDPA"].append(clock() - start)
    tuning.set_tuning(None)
    median = {name: statistics.median(t) for name, t in times.items()}
    base = median["the fixed table" if args.clock == "cpu" else "torch SDPA"]
    what = "the fixed table" if args.clock == "cpu" else "torch SDPA"
    print(f"| B1 H{HEADS} T{args.length} D{HEAD_DIM} float32, {args.step}, "
          f"{'causal' if args.causal else 'full'}, {args.clock} | ms | × {what} |")
    print("|---|---:|---:|")
    for name, seconds in median.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
