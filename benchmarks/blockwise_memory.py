"""Peak memory and time of blockwise_attention against plain attention, at growing lengths.

One head, head_dim 64, float32, self-attention without a mask (every tile is computed), one
forward pass. Every measurement runs in a fresh subprocess, so peaks do not mix:

* ``extra MiB``: for NumPy the tracemalloc peak during the call (NumPy reports its allocations
  to tracemalloc) minus the output; for JAX and PyTorch the growth of the process's peak RSS
  (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) during the call, over a baseline taken after
  imports, input allocation and one warm-up call at a small length (so allocator start-up is
  not counted), minus the output; for JAX the temporary buffers of the compiled program
  (``compiled.memory_analysis().temp_size_in_bytes``: XLA's allocation beyond arguments and
  outputs; RSS cannot see a second run, which reuses the first run's freed memory). JAX
  functions are jitted; the timed call is the second run of the compiled program.
* ``s``: wall time of one call after a first one (best of 3 up to 4096 tokens);
  ``ns per q·k·d``: time divided by ``q_len · kv_len · head_dim`` (the work of both matrix
  products per head), comparable across lengths.

Paths: ``numpy-plain`` is numpy_attn's explicit step-by-step pipeline (``return_weights=True``,
which materialises the ``(q_len, kv_len)`` scores and softmaxes them in place; the weights it
returns are not counted as output); ``numpy-sdpa`` is ``numpy_attn.scaled_dot_product_attention`` as
shipped (query-blocked multi-threaded fast path for large inputs); ``jax-plain`` and
``torch-plain`` are each backend's ``scaled_dot_product_attention`` (torch: its fused SDPA).

Usage: ``python benchmarks/blockwise_memory.py [--max-len 32768] [--plain-max-len 16384]
[--paths numpy-blockwise,...] [--block-q 512 --block-kv 1024]``. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

HEAD_DIM = 64
PATHS = ("numpy-plain", "numpy-sdpa", "numpy-blockwise", "jax-plain", "jax-blockwise",
         "torch-plain", "torch-blockwise")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _best_time(fn, q, k, v, length: int) -> float:  # noqa: ANN001
    """Best of 3 calls up to 4096 tokens, else one (the machine is shared: noise is upward)."""
    best = float("inf")
    for _ in range(3 if length <= 4096 else 1):
        start = time.perf_counter()
        fn(q, k, v)
        best = min(best, time.perf_counter() - start)
    return best


def _measure(path: str, length: int, block_q: int, block_kv: int) -> dict:
    """Run one measurement in this process; returns a dict of figures."""
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (1, 1, length, HEAD_DIM)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    out_mib = q.nbytes / 2**20
    backend, kind = path.split("-")
    blocks = {"block_q": block_q, "block_kv": block_kv}

    if backend == "numpy":
        import tracemalloc

        import numpy_attn

        if kind == "plain":  # return_weights: the explicit steps, softmax in place in the scores
            def fn(q, k, v):
                return numpy_attn.scaled_dot_product_attention(q, k, v, return_weights=True)[0]
        elif kind == "sdpa":
            fn = numpy_attn.scaled_dot_product_attention
        else:
            def fn(q, k, v):
                return numpy_attn.blockwise_attention(q, k, v, **blocks)
        small = (x[..., :256, :] for x in (q, k, v))
        fn(*small)  # warm-up: thread pools, BLAS
        tracemalloc.start()
        out = fn(q, k, v)
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        extra = peak - out.nbytes / 2**20
        seconds = _best_time(fn, q, k, v, length)
    elif backend == "jax":
        import jax
        import jax.numpy as jnp

        import jax_attn

        if kind == "plain":
            fn = jax.jit(jax_attn.scaled_dot_product_attention)
        else:
            fn = jax.jit(lambda q, k, v: jax_attn.blockwise_attention(q, k, v, **blocks))
        q, k, v = (jnp.asarray(x) for x in (q, k, v))
        compiled = fn.lower(q, k, v).compile()
        # XLA's own account of the buffers it allocates beyond arguments and outputs
        extra = compiled.memory_analysis().temp_size_in_bytes / 2**20
        compiled(q, k, v).block_until_ready()  # first run
        seconds = _best_time(lambda *a: compiled(*a).block_until_ready(), q, k, v, length)
    else:
        import torch

        import torch_attn

        if kind == "plain":
            fn = torch_attn.scaled_dot_product_attention
        else:
            def fn(q, k, v):
                return torch_attn.blockwise_attention(q, k, v, **blocks)
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
        with torch.no_grad():
            fn(*(x[..., :256, :] for x in (q, k, v)))
            base = _rss_mib()
            out = fn(q, k, v)  # memory: the first call at this length
            extra = _rss_mib() - base - out.numel() * 4 / 2**20
            seconds = _best_time(fn, q, k, v, length)  # after the first call (kernel set-up)
    return {"extra_mib": extra, "seconds": seconds, "rss_peak_mib": _rss_mib(),
            "out_mib": out_mib}


def _settings() -> str:
    import numpy as np

    threads = {name: os.environ.get(name, "unset") for name in
               ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    try:
        from threadpoolctl import threadpool_info

        blas = ", ".join(f"{i['internal_api']} {i['version']} ({i['num_threads']} threads)"
                         for i in threadpool_info() if i["user_api"] == "blas")
    except ImportError:
        blas = "threadpoolctl not installed"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"python {platform.python_version()}, numpy {np.__version__}, {cores} usable cores, "
            f"BLAS: {blas}, env: {threads}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-len", type=int, default=32768)
    parser.add_argument("--min-len", type=int, default=1024)
    parser.add_argument("--plain-max-len", type=int, default=16384,
                        help="longest length for the plain paths (their scores need 4·n² bytes)")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--block-q", type=int, default=512)
    parser.add_argument("--block-kv", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one measurement, printed as JSON
        path, length = args.child.split(":")
        print(json.dumps(_measure(path, int(length), args.block_q, args.block_kv)))
        return 0

    print(f"<!-- {_settings()}; blocks {args.block_q}×{args.block_kv} -->\n")
    print("| path | tokens | extra MiB | s | ns per q·k·d |")
    print("|---|---:|---:|---:|---:|")
    length = args.min_len
    while length <= args.max_len:
        for path in args.paths.split(","):
            if "blockwise" not in path and length > args.plain_max_len:
                continue
            command = [sys.executable, __file__, "--child", f"{path}:{length}",
                       "--block-q", str(args.block_q), "--block-kv", str(args.block_kv)]
            try:
                done = subprocess.run(command, capture_output=True, text=True,
                                      timeout=args.timeout, check=True)
                result = json.loads(done.stdout.strip().splitlines()[-1])
            except (subprocess.SubprocessError, ValueError, IndexError) as exc:
                print(f"| {path} | {length} | failed: {type(exc).__name__} | | |", flush=True)
                continue
            per_unit = result["seconds"] / (length * length * HEAD_DIM) * 1e9
            print(f"| {path} | {length} | {result['extra_mib']:.1f} | {result['seconds']:.3f} "
                  f"| {per_unit:.3f} |", flush=True)
        length *= 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
