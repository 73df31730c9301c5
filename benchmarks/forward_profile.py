"""Where numpy_attn's forward pass spends its time: each step of one block, and the whole call.

    python benchmarks/forward_profile.py [--lengths 2048 4096] [--rounds 41]

Shapes: batch 1, 8 heads, head_dim 64, float32, full attention (no mask: every block takes the
unshifted softmax of ``numpy_attn/_fast/forward.py``). The blocked forward pass cuts each head's
queries into blocks of ``BLOCK_Q`` rows; a block is five steps on ``(BLOCK_Q, T)`` scores:

* ``q kᵀ``: the scores, a ``(BLOCK_Q, 64) @ (64, T)`` product;
* ``exp2``: the weights, in place (the query carries ``scale · log2 e``), where NumPy
  vectorises float32 ``exp2`` (``_fast.forward.USE_EXP2``: its AVX-512 loops); elsewhere ``exp``
  in natural units; the other one is timed beside it;
* ``row sums``: ``weights @ ones`` (BLAS); ``sum(axis=-1)`` beside it;
* ``P v``: the unnormalised output, ``(BLOCK_Q, T) @ (T, 64)``;
* ``divide``: by the row sums.

Each step is timed on one thread (BLAS limited to one, as in the blocks), interleaved round after
round, median. "call, predicted" is the sum of the steps × the number of blocks / the cores the
thread pool uses; "call, measured" is ``numpy_attn.scaled_dot_product_attention`` itself; the
difference is what the steps do not count (the thread pool's hand-offs, Python per block, the
input copies). The floor is the two products at the SGEMM rate measured here
(``2048 × 2048`` float32 ``matmul``, both cores), and torch's SDPA is timed in the same rounds.

NumPy's matrix products are OpenBLAS's; which kernels it runs is printed (``threadpoolctl``):
``OPENBLAS_CORETYPE`` in the environment overrides OpenBLAS's own choice for the CPU (e.g.
``Haswell``, AVX2, on an AVX-512 machine: about half its SGEMM rate). Run it both ways to see
what the kernels are worth (``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python ...``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from timing import interleaved  # noqa: E402

import numpy_attn  # noqa: E402
from numpy_attn import _fast, _threads  # noqa: E402

HEADS, HEAD_DIM = 8, 64


def _median_us(runs: dict, rounds: int) -> dict[str, float]:
    """Median microseconds of each function, interleaved round after round."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def block_steps(T: int, rounds: int) -> dict[str, float]:
    """Microseconds of each step of one ``(BLOCK_Q, T)`` block on one thread."""
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    rows = _fast.BLOCK_Q
    q = (rng.standard_normal((rows, HEAD_DIM)) * HEAD_DIM ** -0.5 * _fast.forward.LOG2E
         ).astype(np.float32)
    k, v = (rng.standard_normal((T, HEAD_DIM)).astype(np.float32) for _ in range(2))
    scores = np.empty((rows, T), np.float32)
    np.matmul(q, k.T, out=scores)
    weights = np.exp2(scores)
    out, ones = np.empty((rows, HEAD_DIM), np.float32), np.ones(T, np.float32)
    sums = weights @ ones
    work = np.empty_like(scores)
    # the exponential the blocks run on this CPU (``_fast.forward.USE_EXP2``), and the other one
    used, other = ("exp2", "exp") if _fast.forward.USE_EXP2 else ("exp", "exp2")
    with threadpool_limits(1, user_api="blas"):
        return _median_us({
            "q kᵀ": lambda: np.matmul(q, k.T, out=work),
            "(k qᵀ)ᵀ, keys first (the other order: not run by the fixed table)":
                lambda: np.matmul(k, q.T, out=work.reshape(T, rows)),
            used: lambda: getattr(np, used)(scores, out=work),
            f"{other} (not run on this CPU)": lambda: getattr(np, other)(scores, out=work),
            "row sums (weights @ ones)": lambda: np.matmul(weights, ones),
            "row sums (sum, before)": lambda: weights.sum(axis=-1),
            "P v": lambda: np.matmul(weights, v, out=out),
            "divide": lambda: np.divide(out, sums[:, None], out=out),
        }, rounds)


def sgemm_rate(rounds: int) -> float:
    """GFLOP/s of a 2048 × 2048 float32 ``matmul`` (BLAS as configured: every core)."""
    a, b = (np.random.default_rng(1).standard_normal((2048, 2048)).astype(np.float32)
            for _ in range(2))
    us = _median_us({"mm": lambda: a @ b}, max(5, rounds // 4))["mm"]
    return 2 * 2048**3 / (us * 1e-6) / 1e9


def calls(T: int, rounds: int) -> dict[str, float]:
    """Microseconds of numpy_attn's forward call and of torch's SDPA (if installed), median of
    ``timing.interleaved`` (a pause before each call lets torch's spinning threads sleep)."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, HEADS, T, HEAD_DIM)).astype(np.float32)
               for _ in range(3))
    runs = {"numpy_attn": lambda: numpy_attn.scaled_dot_product_attention(q, k, v)}
    try:
        import torch
    except ImportError:
        torch = None
    tq, tk, tv = (None, None, None) if torch is None else (torch.from_numpy(x) for x in (q, k, v))

    def sdpa() -> None:
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)

    if torch is not None:
        runs["torch SDPA"] = sdpa
    return {name: statistics.median(t) * 1e6 for name, t in interleaved(runs, rounds).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--rounds", type=int, default=41)
    args = parser.parse_args(argv)
    from threadpoolctl import threadpool_info

    blas = [f"{i['internal_api']} {i.get('version')} {i.get('architecture')}"
            for i in threadpool_info() if i["user_api"] == "blas"]
    env = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ}
    rate = sgemm_rate(args.rounds)
    cores = _threads._cores()
    print(f"BLAS: {', '.join(blas)}; environment: {env or 'no OPENBLAS_* override'}; "
          f"SGEMM {rate:.0f} GFLOP/s; the pool's lanes: {cores}; "
          f"load {os.getloadavg()[0]:.2f}")
    for T in args.lengths:
        steps = block_steps(T, args.rounds)
        now = [s for s in steps if "before" not in s and "not run" not in s]
        block = sum(steps[s] for s in now)
        blocks = HEADS * T // _fast.BLOCK_Q
        measured = calls(T, max(7, args.rounds // 6))
        floor_ms = 4 * HEADS * T * T * HEAD_DIM / (rate * 1e9) * 1e3
        print(f"\n| T = {T}: step of one {_fast.BLOCK_Q} × {T} block, one thread | µs | "
              f"share of the block |\n|---|---:|---:|")
        for name, us in steps.items():
            share = f"{us / block:.0%}" if name in now else "(not run)"
            print(f"| {name} | {us:.0f} | {share} |")
        print(f"| block ({' + '.join(now)}) | {block:.0f} | 100% |")
        predicted = block * blocks / cores / 1e3
        print(f"\n| T = {T}, whole call | ms |\n|---|---:|")
        print(f"| floor: the two products at {rate:.0f} GFLOP/s | {floor_ms:.1f} |")
        print(f"| numpy_attn, predicted ({blocks} blocks × {block:.0f} µs / {cores} lanes) | "
              f"{predicted:.1f} |")
        for name, us in measured.items():
            print(f"| {name}, measured | {us / 1e3:.1f} |")
        if "torch SDPA" in measured:
            print(f"| numpy_attn × torch SDPA | "
                  f"{measured['numpy_attn'] / measured['torch SDPA']:.2f} |")
    print(f"\nload after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
