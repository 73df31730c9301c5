"""Benchmark: attention for training — forward and forward + backward of every backend.

    python benchmarks/training.py [--quick] [--lengths 2048 4096] [--rounds 7]
                                  [--memory-tokens 16384] [--write] [--results PATH]

Shapes: batch 1, 8 heads, head_dim 64, float32, ``T`` queries and keys, full and causal.
Variants (each as a training step uses it):

* ``torch SDPA``: ``torch.nn.functional.scaled_dot_product_attention``; forward under
  ``no_grad``, forward + backward with autograd (``.backward(grad_output)``), the baseline;
* ``torch_attn``: ``torch_attn.scaled_dot_product_attention``, the same way;
* ``numpy_attn``: forward ``numpy_attn.scaled_dot_product_attention``; forward + backward
  ``numpy_attn.scaled_dot_product_attention_vjp``, which runs the forward pass itself;
* ``jax_attn``: ``jax.jit`` of the forward, and of ``jax.vjp`` of the forward with its
  gradients (output and gradients returned);
* ``jax.nn``: ``jax.nn.dot_product_attention`` (its (batch, seq, heads, dim) layout), the same.

The variants of one ``T``, full and causal, run interleaved round after round (``--rounds``,
median; a pause before every call lets the previous framework's spinning threads sleep), so load
on a shared machine affects them alike; compare ratios. JAX compiles before the rounds.

Floor: the matrix products alone at the machine's SGEMM rate, measured in the same run (the
median GFLOP/s of NumPy's ``matmul`` and of ``torch.mm`` on ``SGEMM_N × SGEMM_N`` float32
matrices; the floor uses the faster). The forward is two products, ``q kᵀ`` and ``P v``,
``4·B·H·Tq·Tk·D`` FLOPs; the backward four more (``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``dQ = dS K``,
``dK = dSᵀ Q``), so forward + backward is ``12·B·H·Tq·Tk·D`` (a kernel that recomputes the
weights in its backward pass does a seventh); causal counts only the allowed pairs,
``T·(T + 1)/2``. "of floor" is floor time over measured time (1.0: at the SGEMM rate).

Memory (``--memory-tokens N``, each in a fresh subprocess, one head of ``N`` tokens):
numpy_attn's VJP extra memory (tracemalloc's peak during the call — NumPy reports its
allocations to it — minus the gradients it returns), and jax_attn's forward + backward: the
largest array of its jaxpr (``jax.make_jaxpr``, inner ``scan``/``map`` bodies included) against
``N × N``, and XLA's temporary buffer size (``memory_analysis``).

``--write`` puts the forward + backward table, the machine and the plot
(``benchmarks/training_fwd_bwd.png``) into ``benchmarks/RESULTS.md`` (``--results``), between
the markers of its training section, replacing an earlier one and keeping everything else
(the floor, tables, targets and plot: ``benchmarks/training_report.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from timing import interleaved
from training_report import (
    BATCH,
    HEAD_DIM,
    HEADS,
    SGEMM_N,
    machine,
    memory_lines,
    plot,
    section,
    tables,
    targets,
    write_results,
)

HERE = Path(__file__).resolve().parent
LENGTHS = (2048, 4096)
PAUSE_S = 0.1  # OpenMP (torch), Eigen (XLA) and OpenBLAS threads spin for a while after a call


# ------------------------------------------------------------------------------------------
# Variants: (backend, mode, causal) → run once, blocking until done
# ------------------------------------------------------------------------------------------


def _inputs(T: int, heads: int = HEADS) -> list[np.ndarray]:
    gen = np.random.default_rng(0)
    return [gen.standard_normal((BATCH, heads, T, HEAD_DIM)).astype(np.float32)
            for _ in range(4)]  # query, key, value, grad_output


def variants(T: int) -> dict[tuple[str, str, bool], Callable[[], object]]:
    """Every (backend, mode, causal) of one ``T``, ready to run (JAX compiled)."""
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F

    import jax_attn
    import numpy_attn
    import torch_attn

    q, k, v, g = _inputs(T)
    tq, tk, tv, tg = (torch.from_numpy(x) for x in (q, k, v, g))
    gq, gk, gv = (x.clone().requires_grad_(True) for x in (tq, tk, tv))
    jq, jk, jv, jg = (jnp.asarray(x) for x in (q, k, v, g))
    bthd = [jnp.swapaxes(x, 1, 2) for x in (jq, jk, jv, jg)]  # jax.nn's layout
    scale = HEAD_DIM**-0.5
    out: dict[tuple[str, str, bool], Callable[[], object]] = {}
    for causal in (False, True):
        torch_fns = {"torch SDPA": F.scaled_dot_product_attention,
                     "torch_attn": torch_attn.scaled_dot_product_attention}
        for name, fn in torch_fns.items():
            def forward(fn=fn, causal=causal):
                with torch.no_grad():
                    return fn(tq, tk, tv, is_causal=causal)

            def forward_backward(fn=fn, causal=causal):
                gq.grad = gk.grad = gv.grad = None
                fn(gq, gk, gv, is_causal=causal).backward(tg)
                return gq.grad

            out[name, "fwd", causal] = forward
            out[name, "fwd+bwd", causal] = forward_backward

        out["numpy_attn", "fwd", causal] = (
            lambda causal=causal: numpy_attn.scaled_dot_product_attention(
                q, k, v, is_causal=causal))
        out["numpy_attn", "fwd+bwd", causal] = (
            lambda causal=causal: numpy_attn.scaled_dot_product_attention_vjp(
                q, k, v, g, is_causal=causal))

        def ours(q, k, v, causal=causal):
            return jax_attn.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def theirs(q, k, v, causal=causal):
            return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal)

        for name, fn, args in (("jax_attn", ours, (jq, jk, jv, jg)),
                               ("jax.nn", theirs, tuple(bthd))):
            def with_grads(q, k, v, g, fn=fn):
                output, pullback = jax.vjp(fn, q, k, v)
                return output, pullback(g)

            for mode, f in (("fwd", fn), ("fwd+bwd", with_grads)):
                call_args = args[:3] if mode == "fwd" else args
                compiled = jax.jit(f).lower(*call_args).compile()
                out[name, mode, causal] = (
                    lambda c=compiled, a=call_args: jax.block_until_ready(c(*a)))
    return out



def sgemm_rates(rounds: int) -> dict[str, float]:
    """GFLOP/s of a large float32 matrix product, NumPy and torch, interleaved, median."""
    import torch

    gen = np.random.default_rng(1)
    a, b = (gen.standard_normal((SGEMM_N, SGEMM_N)).astype(np.float32) for _ in range(2))
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    fns = {"NumPy matmul": lambda: a @ b, "torch.mm": lambda: torch.mm(ta, tb)}
    times = interleaved(fns, max(rounds, 3), PAUSE_S)
    return {name: 2 * SGEMM_N**3 / statistics.median(ts) / 1e9 for name, ts in times.items()}


def time_length(T: int, rounds: int) -> dict[tuple[str, str, bool], dict]:
    """Median seconds of every variant of one ``T``, all interleaved."""
    times = interleaved(variants(T), rounds, PAUSE_S)
    return {key: {"median_s": statistics.median(ts), "times": ts} for key, ts in times.items()}


# ------------------------------------------------------------------------------------------
# Memory, one head of N tokens, each in a fresh process
# ------------------------------------------------------------------------------------------


def numpy_vjp_memory(T: int, causal: bool) -> dict:
    """MiB: tracemalloc's peak during one VJP call minus the gradients it returns."""
    import tracemalloc

    import numpy_attn

    q, k, v, g = (x[0] for x in _inputs(T, heads=1))  # (T, head_dim)
    numpy_attn.scaled_dot_product_attention_vjp(q[:1024], k[:1024], v[:1024], g[:1024],
                                                is_causal=causal)  # thread pool started
    tracemalloc.start()
    grads = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, g, is_causal=causal)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    returned = sum(x.nbytes for x in grads if x is not None)
    return {"extra_mib": (peak - returned) / 2**20, "square_mib": T * T * 4 / 2**20}


def jax_fwd_bwd_memory(T: int, causal: bool) -> dict:
    """The largest array of jax_attn's forward + backward jaxpr and XLA's temporary bytes."""
    import jax
    import jax.numpy as jnp

    import jax_attn

    q, k, v, g = (jnp.asarray(x[0]) for x in _inputs(T, heads=1))

    def fwd_bwd(q, k, v, g):
        output, pullback = jax.vjp(
            lambda q, k, v: jax_attn.scaled_dot_product_attention(q, k, v, is_causal=causal),
            q, k, v)
        return output, pullback(g)

    def shapes(jaxpr):
        for eqn in jaxpr.eqns:
            yield from (tuple(var.aval.shape) for var in eqn.outvars if hasattr(var.aval, "shape"))
            for param in eqn.params.values():
                for inner in param if isinstance(param, (list, tuple)) else (param,):
                    inner = getattr(inner, "jaxpr", inner)
                    if hasattr(inner, "eqns"):
                        yield from shapes(inner)

    largest = max(shapes(jax.make_jaxpr(fwd_bwd)(q, k, v, g).jaxpr), key=lambda s: np.prod(s))
    compiled = jax.jit(fwd_bwd).lower(q, k, v, g).compile()
    analysis = compiled.memory_analysis()
    temp = None if analysis is None else analysis.temp_size_in_bytes / 2**20
    start = time.perf_counter()
    jax.block_until_ready(compiled(q, k, v, g))
    return {"largest_shape": list(largest), "largest_elements": int(np.prod(largest)),
            "square_elements": T * T, "temp_mib": temp, "seconds": time.perf_counter() - start}


def memory_in_subprocess(kind: str, T: int, causal: bool) -> dict:
    cmd = [sys.executable, __file__, "--_memory", json.dumps([kind, T, causal])]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr else "failed"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 512 and 1024 tokens, 2 rounds, memory at 2048")
    parser.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (2048 4096)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per length (7)")
    parser.add_argument("--memory-tokens", type=int, help="tokens of the memory rows (16384; "
                        "0: none)")
    parser.add_argument("--write", action="store_true", help="write RESULTS.md and the plot")
    parser.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--_memory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._memory:
        kind, T, causal = json.loads(args._memory)
        fn = numpy_vjp_memory if kind == "numpy_attn VJP" else jax_fwd_bwd_memory
        print(json.dumps(fn(T, causal)))
        return

    lengths = args.lengths or ([512, 1024] if args.quick else list(LENGTHS))
    rounds = args.rounds or (2 if args.quick else 7)
    tokens = args.memory_tokens if args.memory_tokens is not None else (
        2048 if args.quick else 16384)
    info = machine()
    load_before = os.getloadavg()
    rates = sgemm_rates(rounds)
    print("SGEMM: " + ", ".join(f"{n} {r:.0f} GFLOP/s" for n, r in rates.items()), flush=True)
    medians = {}
    for T in lengths:
        medians[T] = time_length(T, rounds)
        print(f"T={T}: " + ", ".join(f"{n} {m} {'causal' if c else 'full'} "
                                     f"{r['median_s'] * 1e3:.1f} ms"
                                     for (n, m, c), r in medians[T].items()), flush=True)
    rates_after = sgemm_rates(rounds)  # the rate again: a busy machine shows here
    rates = {name: max(rates[name], rates_after[name]) for name in rates}
    memory = {}
    if tokens:
        for kind in ("numpy_attn VJP", "jax_attn fwd+bwd"):
            for causal in (False, True):
                memory[kind, causal] = memory_in_subprocess(kind, tokens, causal)
                print(f"memory {kind} causal={causal}: {memory[kind, causal]}", flush=True)
    load_after = os.getloadavg()
    body = "\n".join([targets(medians, memory, lengths, tokens),
                      tables(medians, rates, lengths), memory_lines(memory, tokens)])
    print(body)
    print(f"load average before {load_before}, after {load_after}")
    if args.write:
        png = args.results.parent / "training_fwd_bwd.png"
        plot(medians, rates, lengths, png)
        command = "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
        text = section(command, info, (load_before, load_after), rates, rounds, body, png.name)
        write_results(args.results, text)
        print(f"wrote {args.results} and {png}")


if __name__ == "__main__":
    main()
