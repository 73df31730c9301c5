"""Benchmark: scaled_dot_product_attention in each backend next to the frameworks' kernels.

    python benchmarks/run.py [--quick] [--lengths 512 1024 ...] [--out DIR]

Shapes: batch 1, 8 heads, head_dim 64, sequence length ``T`` for queries and keys. Rows, per
``T``, causal and not:

* forward, float32: ``numpy_attn``, ``jax_attn`` (jitted), ``torch_attn``, next to
  ``torch.nn.functional.scaled_dot_product_attention`` (torch SDPA),
  ``jax.nn.dot_product_attention`` (jitted, in the (batch, seq, heads, dim) layout it
  expects) and, without the causal rule, the
  "GEMM floor" of each framework: the two matrix products ``(q kᵀ) v`` alone;
* forward, float64: ``numpy_attn`` and NumPy's GEMM floor next to torch SDPA in float64;
* forward + backward, float32: ``scaled_dot_product_attention_vjp`` of each backend (numpy_attn's
  is written by hand; jax_attn's is ``jax.vjp``, jitted; torch_attn's is autograd) next to torch
  SDPA's forward + ``backward``.

Each row gives the median time over repeats after a warm-up (JAX's compile time is reported
separately), the achieved GFLOP/s, the ratio to torch SDPA measured in the same run (the variants
of one shape run interleaved, round after round, so load on a shared machine affects them alike)
and the peak extra memory (peak RSS minus RSS before the call, measured in a separate
subprocess per variant, see ``measure_memory``).

FLOPs: the forward counts ``4·B·H·Tq·Tk·D`` (two matrix products), the forward + backward
``12·B·H·Tq·Tk·D`` (two products forward, four backward, no recomputation); with the causal rule
only the allowed (query, key) pairs count, ``Tq·(Tq + 1)/2`` instead of ``Tq·Tk``, so a causal
kernel that skips masked blocks reaches the same GFLOP/s as a full one.

The long-sequence (8k to 32k tokens) blockwise rows are in ``benchmarks/blockwise_memory.py``;
training (forward and forward + backward of every backend, the SGEMM floor, the VJP memory at
16,384 tokens) in ``benchmarks/training.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

BATCH, HEADS, HEAD_DIM = 1, 8, 64
LENGTHS = (512, 1024, 2048, 4096)
QUICK_LENGTHS = (512, 1024)
# OpenMP (torch), Eigen (XLA) and OpenBLAS threads spin for a while after each call; on 2 cores
# the next framework's threads then wait for a core (10x slower small NumPy GEMMs were seen).
PAUSE_S = 0.1

# (mode, dtype, name) for every variant; the first of each (mode, dtype) group is the baseline
VARIANTS = {
    ("fwd", "float32"): ["torch SDPA", "torch_attn", "numpy_attn", "jax_attn",
                         "jax.nn.dot_product_attention", "GEMM floor (torch)",
                         "GEMM floor (NumPy)", "GEMM floor (JAX)"],
    ("fwd", "float64"): ["torch SDPA", "numpy_attn", "GEMM floor (NumPy)"],
    ("fwd+bwd", "float32"): ["torch SDPA", "torch_attn", "numpy_attn", "jax_attn"],
}
FRAMEWORK = {"torch SDPA": "torch", "torch_attn": "torch", "GEMM floor (torch)": "torch",
             "numpy_attn": "numpy", "GEMM floor (NumPy)": "numpy", "jax_attn": "jax",
             "jax.nn.dot_product_attention": "jax", "GEMM floor (JAX)": "jax"}


# ------------------------------------------------------------------------------------------
# Variants: build(name, mode, T, causal, dtype) → (run once, JAX compile seconds or None)
# ------------------------------------------------------------------------------------------


def _inputs(T: int, dtype: str, seed: int = 0) -> list[np.ndarray]:
    gen = np.random.default_rng(seed)
    shape = (BATCH, HEADS, T, HEAD_DIM)
    return [gen.standard_normal(shape).astype(dtype) for _ in range(4)]  # q, k, v, grad_out


def build(name: str, mode: str, T: int, causal: bool, dtype: str
          ) -> tuple[Callable[[], object], float | None] | None:
    """A callable that runs the variant once (blocking until done), or None if not measured."""
    if name.startswith("GEMM floor") and causal:
        return None  # the floor is the full products; compare it with the non-causal rows
    q, k, v, g = _inputs(T, dtype)
    scale = HEAD_DIM**-0.5
    framework = FRAMEWORK[name]
    if framework == "numpy":
        import numpy_attn

        if name == "GEMM floor (NumPy)":
            kt = np.swapaxes(k, -1, -2)
            return (lambda: (q @ kt) @ v), None
        if mode == "fwd":
            return (lambda: numpy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    ), None
        return (lambda: numpy_attn.scaled_dot_product_attention_vjp(q, k, v, g,
                                                                    is_causal=causal)), None
    if framework == "torch":
        import torch
        import torch.nn.functional as F

        import torch_attn

        tq, tk, tv, tg = (torch.from_numpy(x) for x in (q, k, v, g))
        if name == "GEMM floor (torch)":
            return (lambda: (tq @ tk.transpose(-1, -2)) @ tv), None
        sdpa = F.scaled_dot_product_attention if name == "torch SDPA" else None
        if mode == "fwd":
            if sdpa is not None:
                return (lambda: sdpa(tq, tk, tv, is_causal=causal)), None

            def forward():
                with torch.no_grad():
                    return torch_attn.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

            return forward, None
        if sdpa is None:
            return (lambda: torch_attn.scaled_dot_product_attention_vjp(
                tq, tk, tv, tg, is_causal=causal)), None
        gq, gk, gv = (x.clone().requires_grad_(True) for x in (tq, tk, tv))

        def forward_backward():
            gq.grad = gk.grad = gv.grad = None
            sdpa(gq, gk, gv, is_causal=causal).backward(tg)
            return gq.grad

        return forward_backward, None
    import jax
    import jax.numpy as jnp

    import jax_attn

    hi = jax.lax.Precision.HIGHEST
    jq, jk, jv, jg = (jnp.asarray(x) for x in (q, k, v, g))
    if name == "GEMM floor (JAX)":
        def fn(q, k, v):
            return jnp.matmul(jnp.matmul(q, jnp.swapaxes(k, -1, -2), precision=hi), v,
                              precision=hi)
        args = (jq, jk, jv)
    elif name == "jax.nn.dot_product_attention":
        def fn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal)
        args = tuple(jnp.swapaxes(x, 1, 2) for x in (jq, jk, jv))  # BTNH, as it expects
    elif mode == "fwd":
        def fn(q, k, v):
            return jax_attn.scaled_dot_product_attention(q, k, v, is_causal=causal)
        args = (jq, jk, jv)
    else:
        def fn(q, k, v, g):
            return jax_attn.scaled_dot_product_attention_vjp(q, k, v, g, is_causal=causal)[:3]
        args = (jq, jk, jv, jg)
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    return (lambda: jax.block_until_ready(compiled(*args))), compile_s


def flops(mode: str, T: int, causal: bool, name: str) -> float:
    pairs = T * (T + 1) / 2 if causal else T * T
    return (4 if mode == "fwd" else 12) * BATCH * HEADS * pairs * HEAD_DIM


# ------------------------------------------------------------------------------------------
# Timing (interleaved) and memory (one subprocess per variant)
# ------------------------------------------------------------------------------------------


def time_group(names: list[str], mode: str, T: int, causal: bool, dtype: str, repeats: int,
               budget_s: float) -> dict[str, dict]:
    """Median seconds per variant; the variants run interleaved, ``repeats`` rounds (fewer if a
    round takes more than ``budget_s / repeats``)."""
    runs, results = {}, {}
    for name in names:
        built = build(name, mode, T, causal, dtype)
        if built is not None:
            fn, compile_s = built
            start = time.perf_counter()
            fn()  # warm-up (and the pool, the caches, the allocator)
            first = time.perf_counter() - start
            runs[name] = fn
            results[name] = {"times": [], "compile_s": compile_s, "first_s": first}
    deadline = time.perf_counter() + budget_s
    for r in range(repeats):
        for name, fn in runs.items():
            time.sleep(PAUSE_S)  # let the previous framework's spinning threads go to sleep
            start = time.perf_counter()
            fn()
            results[name]["times"].append(time.perf_counter() - start)
        if r >= 2 and time.perf_counter() > deadline:
            break
    for res in results.values():
        res["median_s"] = statistics.median(res["times"])
    return results


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def measure_memory(name: str, mode: str, dtype: str, lengths: list[int]) -> dict[str, float]:
    """In this (fresh) process: peak RSS growth of one call, per (T, causal), in MiB.

    The inputs are made (and JAX's executable compiled) first; then the peak RSS of the first
    call (``VmHWM``, reset through ``/proc/self/clear_refs``) minus the RSS just before it (a
    warm-up call would leave XLA's and the allocators' buffers behind for the next to reuse).
    The parent sets ``MALLOC_MMAP_THRESHOLD_`` so that glibc returns large blocks to the system
    when they are freed, and memory kept from an earlier call is not counted as reused.
    """
    out = {}
    for T in lengths:
        for causal in (False, True):
            built = build(name, mode, T, causal, dtype)
            if built is None:
                continue
            fn, _ = built  # JAX: compiled already, so the compiler's memory is not counted
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            before = _rss_kib("VmRSS")
            fn()
            out[f"{T},{int(causal)}"] = (_rss_kib("VmHWM") - before) / 1024
            del fn, built
    return out


def memory_in_subprocess(name: str, mode: str, dtype: str, lengths: list[int]) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    cmd = [sys.executable, __file__, "--_memory", json.dumps([name, mode, dtype, lengths])]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        print(f"memory of {name} ({mode}, {dtype}) failed:\n{result.stderr[-2000:]}",
              file=sys.stderr)
        return {}
    return json.loads(result.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------
# Settings, table, plot
# ------------------------------------------------------------------------------------------


def settings() -> dict:
    import jax
    import threadpoolctl
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    blas = [{k: lib.get(k) for k in ("internal_api", "version", "num_threads", "architecture",
                                      "threading_layer", "filepath")}
            for lib in threadpoolctl.threadpool_info()]
    return {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "cpu": cpu, "usable_cores": cores, "python": platform.python_version(),
        "numpy": np.__version__, "jax": jax.__version__, "torch": torch.__version__,
        "threadpools": blas, "torch_num_threads": torch.get_num_threads(),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("OPENBLAS", "OMP_", "MKL_", "XLA", "JAX_"))},
    }


def table(rows: list[dict]) -> str:
    head = ("| mode | dtype | T | causal | variant | median ms | GFLOP/s | × torch SDPA "
            "| peak extra MiB | JAX compile s |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        mem = "" if r.get("mem_mib") is None else f"{r['mem_mib']:.0f}"
        comp = "" if r.get("compile_s") is None else f"{r['compile_s']:.2f}"
        lines.append(
            f"| {r['mode']} | {r['dtype']} | {r['T']} | {'yes' if r['causal'] else 'no'} "
            f"| {r['name']} | {r['median_s'] * 1e3:.1f} | {r['gflops']:.0f} | {r['ratio']:.2f} "
            f"| {mem} | {comp} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 5))
    selected = [r for r in rows if r["mode"] == "fwd" and r["dtype"] == "float32"]
    names = list(dict.fromkeys(r["name"] for r in selected))
    for i, name in enumerate(names):
        color = f"C{i}"
        for causal, style in ((False, "-"), (True, "--")):
            pts = sorted((r["T"], r["median_s"], r.get("mem_mib")) for r in selected
                         if r["name"] == name and r["causal"] == causal)
            if not pts:
                continue
            label = name + (" (causal)" if causal else "")
            ax_t.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], style, color=color,
                      marker="o", label=label)
            mem = [(p[0], p[2]) for p in pts if p[2] is not None and p[2] > 0]
            if mem:
                ax_m.plot([m[0] for m in mem], [m[1] for m in mem], style, color=color,
                          marker="o", label=label)
    for ax, ylabel in ((ax_t, "median time (ms)"), (ax_m, "peak extra memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (batch 1, 8 heads, head_dim 64, float32, forward)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512 and 1024 tokens, 3 repeats")
    parser.add_argument("--lengths", type=int, nargs="+", help="sequence lengths")
    parser.add_argument("--repeats", type=int, default=None, help="rounds per shape (7)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    parser.add_argument("--out", type=Path, help="write RESULTS.md-style results.md and a PNG")
    parser.add_argument("--_memory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._memory:
        name, mode, dtype, lengths = json.loads(args._memory)
        print(json.dumps(measure_memory(name, mode, dtype, lengths)))
        return

    lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    repeats = args.repeats or (3 if args.quick else 7)
    info = settings()
    load_before = os.getloadavg()
    rows = []
    for (mode, dtype), names in VARIANTS.items():
        for T in lengths:
            for causal in (False, True):
                res = time_group(names, mode, T, causal, dtype, repeats, budget_s=60.0)
                base = res["torch SDPA"]["median_s"]
                for name, r in res.items():
                    rows.append({"mode": mode, "dtype": dtype, "T": T, "causal": causal,
                                 "name": name, "median_s": r["median_s"],
                                 "repeats": len(r["times"]), "compile_s": r["compile_s"],
                                 "gflops": flops(mode, T, causal, name) / r["median_s"] / 1e9,
                                 "ratio": r["median_s"] / base})
                print(f"{mode} {dtype} T={T} causal={causal}: " + ", ".join(
                    f"{n} {r['median_s'] * 1e3:.1f} ms" for n, r in res.items()), flush=True)
    if not args.no_memory:
        for (mode, dtype), names in VARIANTS.items():
            for name in names:
                mem = memory_in_subprocess(name, mode, dtype, list(lengths))
                for r in rows:
                    if (r["mode"], r["dtype"], r["name"]) == (mode, dtype, name):
                        r["mem_mib"] = mem.get(f"{r['T']},{int(r['causal'])}")
    load_after = os.getloadavg()
    text = table(rows)
    print(text)
    print(json.dumps(info, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(
            {"settings": info, "load_before": load_before, "load_after": load_after,
             "rows": rows}, indent=1))
        (args.out / "results.md").write_text(text + "\n")
        plot(rows, args.out / "attention_time_memory.png")
        print(f"wrote {args.out}/results.md, results.json, attention_time_memory.png")


if __name__ == "__main__":
    main()
