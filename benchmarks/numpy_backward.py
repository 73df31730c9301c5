"""numpy_attn's forward and forward + backward next to torch SDPA, as ratios of one run.

    python benchmarks/numpy_backward.py [--lengths 2048 4096] [--rounds 7] [--memory 16384]

Shapes: batch 1, 8 heads, head_dim 64, float32, ``T`` queries and keys, full and causal.
Variants, per ``(T, causal)``, run interleaved round after round (load on a shared machine
affects them alike) and their medians are printed with the ratios the targets name:

* ``numpy fwd / SDPA fwd``: ``numpy_attn.scaled_dot_product_attention`` over
  ``torch.nn.functional.scaled_dot_product_attention``;
* ``numpy fwd+bwd / SDPA fwd+bwd``: ``numpy_attn.scaled_dot_product_attention_vjp`` (it runs
  the forward pass itself) over SDPA's forward + ``backward`` (autograd);
* ``causal / full``: each variant's causal median over its full one at the same ``T``.

``--memory N``: the extra memory of ``scaled_dot_product_attention_vjp`` for one head of ``N``
tokens (head_dim 64, float32, causal and not), in a fresh subprocess: tracemalloc's peak during
the call (NumPy reports its allocations to tracemalloc) minus the four gradients it returns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from timing import interleaved

HEADS, HEAD_DIM = 8, 64
PAUSE_S = 0.1  # torch's OpenMP threads spin after a call: let them sleep before the next


def variants(T: int, causal: bool) -> dict:
    import torch
    import torch.nn.functional as F

    import numpy_attn

    gen = np.random.default_rng(0)
    q, k, v, g = (gen.standard_normal((1, HEADS, T, HEAD_DIM)).astype(np.float32)
                  for _ in range(4))
    tq, tk, tv, tg = (torch.from_numpy(x) for x in (q, k, v, g))
    gq, gk, gv = (x.clone().requires_grad_(True) for x in (tq, tk, tv))

    def sdpa_fwd_bwd():
        gq.grad = gk.grad = gv.grad = None
        F.scaled_dot_product_attention(gq, gk, gv, is_causal=causal).backward(tg)

    def sdpa_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

    return {
        "SDPA fwd": sdpa_fwd,
        "numpy fwd": lambda: numpy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "SDPA fwd+bwd": sdpa_fwd_bwd,
        "numpy fwd+bwd": lambda: numpy_attn.scaled_dot_product_attention_vjp(
            q, k, v, g, is_causal=causal),
    }


def timings(lengths: list[int], rounds: int) -> dict:
    """Median seconds per (T, causal, variant), every variant of a T interleaved."""
    medians = {}
    for T in lengths:
        runs = {(causal, name): fn for causal in (False, True)
                for name, fn in variants(T, causal).items()}
        for (causal, name), ts in interleaved(runs, rounds, PAUSE_S).items():
            medians[T, causal, name] = statistics.median(ts)
    return medians


def memory(T: int, causal: bool) -> float:
    """MiB of extra memory of one VJP call, one head of T tokens (run in this process)."""
    import tracemalloc

    import numpy_attn

    gen = np.random.default_rng(0)
    q, k, v, g = (gen.standard_normal((1, T, HEAD_DIM)).astype(np.float32) for _ in range(4))
    numpy_attn.scaled_dot_product_attention_vjp(q[:, :1024], k[:, :1024], v[:, :1024],
                                                g[:, :1024], is_causal=causal)  # pool started
    tracemalloc.start()
    grads = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, g, is_causal=causal)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    returned = sum(x.nbytes for x in grads if x is not None)
    return (peak - returned) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--memory", type=int, default=0, help="tokens for the memory row")
    parser.add_argument("--memory-only", type=int, nargs=2, metavar=("T", "CAUSAL"),
                        help=argparse.SUPPRESS)  # the subprocess of --memory
    options = parser.parse_args()
    if options.memory_only:
        print(memory(options.memory_only[0], bool(options.memory_only[1])))
        return
    load = os.getloadavg()
    start = time.perf_counter()
    medians = timings(options.lengths, options.rounds)
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; after: "
          + " ".join(f"{x:.2f}" for x in os.getloadavg())
          + f"; {options.rounds} rounds, {time.perf_counter() - start:.0f} s")
    print("\n| T | mask | SDPA fwd ms | numpy fwd ms | fwd × SDPA | SDPA fwd+bwd ms "
          "| numpy fwd+bwd ms | fwd+bwd × SDPA |")
    print("|---|---|---|---|---|---|---|---|")
    for T in options.lengths:
        for causal in (False, True):
            m = {name: medians[T, causal, name] * 1e3 for name in
                 ("SDPA fwd", "numpy fwd", "SDPA fwd+bwd", "numpy fwd+bwd")}
            print(f"| {T} | {'causal' if causal else 'full'} | {m['SDPA fwd']:.1f} "
                  f"| {m['numpy fwd']:.1f} | {m['numpy fwd'] / m['SDPA fwd']:.2f} "
                  f"| {m['SDPA fwd+bwd']:.1f} | {m['numpy fwd+bwd']:.1f} "
                  f"| {m['numpy fwd+bwd'] / m['SDPA fwd+bwd']:.2f} |")
    print("\n| T | causal / full: SDPA fwd | numpy fwd | SDPA fwd+bwd | numpy fwd+bwd |")
    print("|---|---|---|---|---|")
    for T in options.lengths:
        ratios = [medians[T, True, name] / medians[T, False, name] for name in
                  ("SDPA fwd", "numpy fwd", "SDPA fwd+bwd", "numpy fwd+bwd")]
        print(f"| {T} | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")
    if options.memory:
        print(f"\nVJP extra memory, one head of {options.memory} tokens (tracemalloc peak "
              "minus the gradients):")
        for causal in (False, True):
            result = subprocess.run(
                [sys.executable, __file__, "--memory-only", str(options.memory),
                 str(int(causal))], capture_output=True, text=True, check=True, timeout=600)
            print(f"  {'causal' if causal else 'full'}: {float(result.stdout):.1f} MiB")


if __name__ == "__main__":
    main()
