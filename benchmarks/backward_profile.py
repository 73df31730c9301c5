"""Where numpy_attn's blocked backward pass spends its time: each step of one tile, one thread.

    python benchmarks/backward_profile.py [--lengths 2048 4096] [--rounds 41]

Shapes: batch 1, 8 heads, head_dim 64, float32, full attention. ``numpy_attn/_fast/backward.py``
walks, per lane, ``BLOCK_KV`` keys against ``BLOCK_Q_BACKWARD`` query rows at a time, in the
transposed layout ``(keys, rows)``; a tile is

* ``Sᵀ = k qᵀ``: the scores, ``(BLOCK_KV, 64) @ (64, rows)``;
* ``- lse, exp``: the weights recomputed from the saved log-sum-exp, in place;
* ``dV += Pᵀ dO``: ``(BLOCK_KV, rows) @ (rows, 64)``, into a buffer and added;
* ``dSᵀ = v (dO - delta)ᵀ ⊙ Pᵀ``: one product (value and ``dO`` carry a column of ones and of
  ``-delta``) and a multiplication;
* ``dK += dSᵀ q``: ``(BLOCK_KV, rows) @ (rows, 64)``, into a buffer and added;
* ``dQ += dS k``: ``(rows, BLOCK_KV) @ (BLOCK_KV, 64)`` and an addition.

Each step is timed on one thread (BLAS limited to one, as in the lanes), interleaved round after
round, median; "predicted" is a tile's steps × the tiles / the lanes, "measured" the VJP
(``scaled_dot_product_attention_vjp``, forward included) minus the forward, next to torch
SDPA's backward (its forward + backward minus its forward) in the same rounds. The floor is the
five products at the SGEMM rate measured here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from forward_profile import _median_us, sgemm_rate  # noqa: E402
from timing import interleaved  # noqa: E402

import numpy_attn  # noqa: E402
from numpy_attn import _fast, _threads  # noqa: E402

HEADS, HEAD_DIM = 8, 64


def tile_steps(T: int, rounds: int) -> tuple[dict[str, float], int, int]:
    """Microseconds of each step of one ``(BLOCK_KV, rows)`` tile on one thread."""
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    keys, rows = _fast.BLOCK_KV, min(_fast.BLOCK_Q_BACKWARD, T)

    def arr(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.35).astype(np.float32)

    k, v1, q, d_out, d_out1 = arr(keys, HEAD_DIM), arr(keys, HEAD_DIM + 1), arr(rows, HEAD_DIM), \
        arr(rows, HEAD_DIM), arr(rows, HEAD_DIM + 1)
    neg_lse = arr(rows) - 3.0
    weights_t, grad_s = np.empty((keys, rows), np.float32), np.empty((keys, rows), np.float32)
    np.matmul(k, q.T, out=weights_t)
    weights_t += neg_lse
    np.exp(weights_t, out=weights_t)
    grad_k, grad_v, buffer = (np.zeros((keys, HEAD_DIM), np.float32) for _ in range(3))
    grad_q, part = np.zeros((rows, HEAD_DIM), np.float32), np.empty((rows, HEAD_DIM), np.float32)
    work = np.empty_like(weights_t)

    def add_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        np.matmul(a, b, out=buffer)
        out += buffer

    def scores() -> None:
        np.matmul(k, q.T, out=work)

    def scores_rows_first() -> None:  # the other product order (keys_first_backward=False)
        np.matmul(q, k.T, out=work.reshape(rows, keys))

    def weights() -> None:
        np.add(weights_t, neg_lse, out=work)
        np.exp(work, out=work)

    def grad_scores() -> None:
        np.matmul(v1, d_out1.T, out=grad_s)
        grad_s.__imul__(weights_t)

    def grad_query() -> None:
        np.matmul(grad_s.T, k, out=part)
        grad_q.__iadd__(part)

    with threadpool_limits(1, user_api="blas"):
        steps = _median_us({
            "Sᵀ = k qᵀ": scores,
            "- lse, exp": weights,
            "dV += Pᵀ dO": lambda: add_into(weights_t, d_out, grad_v),
            "dSᵀ = v (dO - delta)ᵀ ⊙ Pᵀ": grad_scores,
            "dK += dSᵀ q": lambda: add_into(grad_s, q, grad_k),
            "dQ += dS k": grad_query,
            "Sᵀ as (q kᵀ)ᵀ, rows first (the other order; not summed)": scores_rows_first,
        }, rounds)
    return steps, keys, rows


def calls(T: int, rounds: int) -> dict[str, float]:
    """Milliseconds of numpy_attn's forward and VJP and of torch SDPA's forward and forward +
    backward, median of ``timing.interleaved``."""
    import torch

    rng = np.random.default_rng(2)
    q, k, v, g = (rng.standard_normal((1, HEADS, T, HEAD_DIM)).astype(np.float32)
                  for _ in range(4))
    tq, tk, tv, tg = (torch.from_numpy(x) for x in (q, k, v, g))
    gq, gk, gv = (x.clone().requires_grad_(True) for x in (tq, tk, tv))

    def sdpa_fwd_bwd() -> None:
        gq.grad = gk.grad = gv.grad = None
        torch.nn.functional.scaled_dot_product_attention(gq, gk, gv).backward(tg)

    runs = {
        "numpy_attn forward": lambda: numpy_attn.scaled_dot_product_attention(q, k, v),
        "numpy_attn VJP": lambda: numpy_attn.scaled_dot_product_attention_vjp(q, k, v, g),
        "torch SDPA forward": lambda: torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv),
        "torch SDPA forward + backward": sdpa_fwd_bwd,
    }
    return {name: statistics.median(t) * 1e3 for name, t in interleaved(runs, rounds).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--rounds", type=int, default=41)
    args = parser.parse_args(argv)
    rate = sgemm_rate(args.rounds)
    lanes = _threads._cores()
    print(f"SGEMM {rate:.0f} GFLOP/s; the pool's lanes: {lanes}; load "
          f"{os.getloadavg()[0]:.2f}")
    for T in args.lengths:
        steps, keys, rows = tile_steps(T, args.rounds)
        tile = sum(us for name, us in steps.items() if "not summed" not in name)
        tiles = HEADS * (T // keys) * -(-T // rows)
        measured = calls(T, max(7, args.rounds // 6))
        print(f"\n| T = {T}: step of one {keys} × {rows} tile, one thread | µs | share |")
        print("|---|---:|---:|")
        for name, us in steps.items():
            share = "–" if "not summed" in name else f"{us / tile:.0%}"
            print(f"| {name} | {us:.0f} | {share} |")
        print(f"| tile | {tile:.0f} | 100% |")
        backward = measured["numpy_attn VJP"] - measured["numpy_attn forward"]
        sdpa = measured["torch SDPA forward + backward"] - measured["torch SDPA forward"]
        floor = 10 * HEADS * T * T * HEAD_DIM / (rate * 1e9) * 1e3
        print(f"\n| T = {T}, backward | ms |\n|---|---:|")
        print(f"| floor: the five products at {rate:.0f} GFLOP/s | {floor:.1f} |")
        print(f"| numpy_attn, predicted ({tiles} tiles × {tile:.0f} µs / {lanes} lanes) | "
              f"{tile * tiles / lanes / 1e3:.1f} |")
        print(f"| numpy_attn, measured (VJP − forward) | {backward:.1f} |")
        print(f"| torch SDPA, measured (forward + backward − forward) | {sdpa:.1f} |")
        print(f"| numpy_attn × torch SDPA, backward | {backward / sdpa:.2f} |")
    print(f"\nload after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
