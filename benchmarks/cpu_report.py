"""Your CPU's row of the "Per CPU kind" table of benchmarks/RESULTS.md.

    python benchmarks/cpu_report.py [--length 2048] [--rounds 7] [--keep-cache] [--no-jax]
                                    [--before REVISION]

Shapes: batch 1, 8 heads, ``T`` tokens (2,048), head_dim 64, float32, full and causal. It
prints, for this machine:

* the CPU model, its SIMD level (NumPy's CPU dispatch, ``__cpu_features__``: AVX-512, AVX2,
  NEON, ...), the usable cores, NumPy's BLAS (``threadpoolctl``) and the load average;
* the SGEMM rate measured in the same run: a ``2048 × 2048`` product on every core, and the
  attention's own product shapes on one thread (as the blocked path runs them: BLAS in one
  thread per lane) times the cores: the forward's ``q kᵀ`` ``(128, 64) @ (64, T)`` or ``(T,
  64) @ (64, 128)`` (the faster order) and ``P v`` ``(128, T) @ (T, 64)``, the backward tile's
  scores ``(128, 64) @ (64, 512)`` or ``(512, 64) @ (64, 128)`` (the faster), ``(128, 512) @
  (512, 64)`` and ``(512, 128) @ (128, 64)``;
* the floor: the products of forward (2) and forward + backward (7: the backward recomputes
  ``S``) at the attention-shape rate, causal counting only the allowed pairs;
* every ratio to torch SDPA in the same rounds: numpy_attn with the fixed table
  (``ATTENTION_TUNING=off``, "old") and with the choices the tuner makes on this machine
  ("new"), jax_attn (jitted), forward and forward + backward, full and causal; with
  ``--before REVISION`` (a git revision of this checkout, e.g. the commit before the tuner,
  ``a9380db^``) also numpy_attn as it was at that revision, "before": its ``numpy_attn`` and
  ``attention_rules`` extracted by ``git archive`` and imported under other names, so old and
  new code run in one process, in the same rounds.

numpy_attn's tuner (``numpy_attn/_fast/tuning.py``) measures in a fresh temporary cache folder
(its time is printed; ``--keep-cache`` uses your cache instead). The variants run interleaved,
round after round (``timing.interleaved``, half the rounds in reverse order; median), so load
on a shared machine hits them alike: compare ratios, and run twice when the load average is
above the core count. numpy_attn new against old is also timed by the process's CPU time, which
other processes' load does not add to. The "of floor" column assumes every core free (the
attention-shape rate is one thread's times the cores): under load it is low. Paste the row
into the table of benchmarks/RESULTS.md with the date.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from timing import interleaved  # noqa: E402

HEADS, HEAD_DIM = 8, 64
# the SIMD levels NumPy's dispatch names, best first
SIMD = (("AVX512_SPR", "AVX-512 (Sapphire Rapids)"), ("AVX512_ICL", "AVX-512 (Ice Lake)"),
        ("AVX512_SKX", "AVX-512"), ("AVX512F", "AVX-512F"), ("AVX2", "AVX2"), ("AVX", "AVX"),
        ("SVE", "SVE"), ("ASIMD", "NEON"), ("NEON", "NEON"), ("SSE42", "SSE4.2"))


def simd_level() -> str:
    """The widest SIMD level NumPy dispatches to on this CPU (``__cpu_features__``), else the
    flags of ``/proc/cpuinfo``."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # NumPy 1.x
        from numpy.core._multiarray_umath import __cpu_features__ as features
    for name, label in SIMD:
        if features.get(name):
            return label
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
        return next(label for name, label in SIMD if name.lower() in flags)
    except (OSError, StopIteration):
        return "unknown"


def _median_s(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sgemm_rates(T: int, rounds: int, lanes: int) -> dict[str, float]:
    """GFLOP/s: ``square`` (2048², every core), ``forward`` and ``backward`` (the attention's
    product shapes on one thread, times ``lanes``)."""
    from threadpoolctl import threadpool_limits

    gen = np.random.default_rng(0)

    def arr(*shape: int) -> np.ndarray:
        return gen.standard_normal(shape).astype(np.float32)

    a, b = arr(2048, 2048), arr(2048, 2048)
    rates = {"square": 2 * 2048**3 / _median_s(lambda: a @ b, rounds) / 1e9}
    # each product's shapes, in the orders the blocked path may run it (the faster counts)
    shapes = {"forward": [(((128, 64), (64, T)), ((T, 64), (64, 128))),
                          (((128, T), (T, 64)),)],
              "backward": [(((128, 64), (64, 512)), ((512, 64), (64, 128))),
                           (((128, 512), (512, 64)),), (((128, 512), (512, 64)),),
                           (((512, 128), (128, 64)),)]}
    with threadpool_limits(1, user_api="blas"):
        for name, products in shapes.items():
            flops = seconds = 0.0
            for orders in products:
                times = []
                for left, right in orders:
                    x, y = arr(*left), arr(*right)
                    out = np.empty((left[0], right[1]), np.float32)
                    times.append(_median_s(lambda x=x, y=y, out=out: np.matmul(x, y, out=out),
                                           rounds * 20))
                seconds += min(times)
                flops += 2 * left[0] * left[1] * right[1]
            rates[name] = flops / seconds / 1e9 * lanes
    return rates


def import_before(revision: str) -> object:
    """numpy_attn as it was at git ``revision`` of this checkout, imported as
    ``numpy_attn_before`` (with that revision's ``attention_rules`` as
    ``attention_rules_before``) from a temporary folder: ``git archive``, then every import of
    the two packages renamed."""
    import importlib
    import re
    import subprocess
    import tarfile

    root = Path(__file__).resolve().parent.parent
    folder = Path(tempfile.mkdtemp(prefix="numpy-attn-before-"))
    archive = subprocess.run(["git", "archive", "--format=tar", revision, "numpy_attn",
                              "attention_rules"], cwd=root, capture_output=True, check=True)
    tar = folder / "before.tar"
    tar.write_bytes(archive.stdout)
    with tarfile.open(tar) as members:
        members.extractall(folder, filter="data")
    imports = re.compile(r"^(\s*(?:from|import)\s+)(numpy_attn|attention_rules)\b", re.M)
    for name in ("numpy_attn", "attention_rules"):
        (folder / name).rename(folder / f"{name}_before")
    for path in folder.rglob("*.py"):
        path.write_text(imports.sub(r"\1\2_before", path.read_text()))
    sys.path.insert(0, str(folder))
    return importlib.import_module("numpy_attn_before")


def variants(T: int, with_jax: bool, before: object | None = None
             ) -> dict[tuple[str, str, str], Callable[[], object]]:
    """(variant, mode, mask) → one call: torch SDPA, numpy_attn old (fixed table) and new
    (tuned), jax_attn (jitted), and ``before`` (numpy_attn at an earlier revision)."""
    import torch
    import torch.nn.functional as F

    import numpy_attn
    from numpy_attn._fast import tuning

    gen = np.random.default_rng(1)
    q, k, v, g = (gen.standard_normal((1, HEADS, T, HEAD_DIM)).astype(np.float32)
                  for _ in range(4))
    tq, tk, tv, tg = (torch.from_numpy(x) for x in (q, k, v, g))
    gq, gk, gv = (x.clone().requires_grad_(True) for x in (tq, tk, tv))
    runs: dict[tuple[str, str, str], Callable[[], object]] = {}
    for mask, causal in (("full", False), ("causal", True)):
        def sdpa(causal: bool = causal) -> object:
            with torch.no_grad():
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

        def sdpa_grad(causal: bool = causal) -> object:
            gq.grad = gk.grad = gv.grad = None
            F.scaled_dot_product_attention(gq, gk, gv, is_causal=causal).backward(tg)
            return gq.grad

        runs["torch SDPA", "fwd", mask] = sdpa
        runs["torch SDPA", "fwd+bwd", mask] = sdpa_grad
        for name, mode in (("numpy_attn old", "off"), ("numpy_attn new", "on")):
            def forward(mode: str = mode, causal: bool = causal) -> object:
                tuning.set_tuning(mode)
                return numpy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal)

            def vjp(mode: str = mode, causal: bool = causal) -> object:
                tuning.set_tuning(mode)
                return numpy_attn.scaled_dot_product_attention_vjp(q, k, v, g, is_causal=causal)

            runs[name, "fwd", mask] = forward
            runs[name, "fwd+bwd", mask] = vjp
        if before is not None:
            runs["numpy_attn before", "fwd", mask] = (
                lambda causal=causal: before.scaled_dot_product_attention(q, k, v,
                                                                          is_causal=causal))
            runs["numpy_attn before", "fwd+bwd", mask] = (
                lambda causal=causal: before.scaled_dot_product_attention_vjp(
                    q, k, v, g, is_causal=causal))
    if with_jax:
        import jax
        import jax.numpy as jnp

        import jax_attn

        jq, jk, jv, jg = (jnp.asarray(x) for x in (q, k, v, g))
        for mask, causal in (("full", False), ("causal", True)):
            def fn(q: object, k: object, v: object, causal: bool = causal) -> object:
                return jax_attn.scaled_dot_product_attention(q, k, v, is_causal=causal)

            def with_grads(q: object, k: object, v: object, g: object, fn: Callable = fn
                           ) -> object:
                output, pullback = jax.vjp(fn, q, k, v)
                return output, pullback(g)

            fwd, grad = jax.jit(fn), jax.jit(with_grads)
            runs["jax_attn", "fwd", mask] = (
                lambda fwd=fwd: jax.block_until_ready(fwd(jq, jk, jv)))
            runs["jax_attn", "fwd+bwd", mask] = (
                lambda grad=grad: jax.block_until_ready(grad(jq, jk, jv, jg)))
    return runs


def _cpu_ratio(cpu: dict, other: str, mode: str, mask: str) -> float:
    """numpy_attn new's median CPU time over ``numpy_attn <other>``'s."""
    return (statistics.median(cpu["numpy_attn new", mode, mask])
            / statistics.median(cpu["numpy_attn " + other, mode, mask]))


def _both_orders(runs: dict, rounds: int, **options: object) -> dict[object, list[float]]:
    """``timing.interleaved`` in the variants' order for half the rounds, then in the reverse
    order, so that no variant always follows the same one."""
    first = interleaved(runs, (rounds + 1) // 2, **options)
    second = interleaved(dict(reversed(list(runs.items()))), rounds // 2, **options)
    return {key: first[key] + second[key] for key in runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--keep-cache", action="store_true",
                        help="tune in your cache folder, not a fresh temporary one")
    parser.add_argument("--no-jax", action="store_true")
    parser.add_argument("--before", metavar="REVISION",
                        help="also time numpy_attn at this git revision, in the same rounds")
    args = parser.parse_args(argv)
    if not args.keep_cache:
        os.environ["ATTENTION_TUNING_CACHE"] = tempfile.mkdtemp(prefix="attention-tuning-")
    import torch

    from numpy_attn import _threads
    from numpy_attn._fast import tuning

    T, lanes = args.length, _threads._cores()
    torch.set_num_threads(lanes)
    load_before = os.getloadavg()[0]
    machine = tuning.machine()
    print(f"CPU: {machine['cpu']}; SIMD: {simd_level()}; cores: {lanes}; BLAS: "
          f"{machine['blas']}; numpy {machine['numpy']}, torch {torch.__version__}")
    rates = sgemm_rates(T, args.rounds, lanes)
    print("SGEMM GFLOP/s: " + ", ".join(f"{name} {rate:.0f}" for name, rate in rates.items()))
    before = None if args.before is None else import_before(args.before)
    runs = variants(T, not args.no_jax, before)
    tuning.set_tuning("on")
    start = time.perf_counter()
    for key in (("numpy_attn new", "fwd", "full"), ("numpy_attn new", "fwd+bwd", "full")):
        runs[key]()  # the tuner measures here (forward, then the VJP's tiles)
    tune_s = time.perf_counter() - start
    times = _both_orders(runs, args.rounds)
    # numpy_attn new against old once more by the CPU time of the process, which other
    # processes' load does not add to (numpy_attn's threads do not spin)
    ours = {key: fn for key, fn in runs.items() if key[0].startswith("numpy_attn")}
    cpu = _both_orders(ours, args.rounds, clock=time.process_time)
    tuning.set_tuning(None)
    median = {key: statistics.median(t) for key, t in times.items()}
    spread = {key: (max(t) - min(t)) / statistics.median(t) for key, t in times.items()}
    load_after = os.getloadavg()[0]
    from numpy_attn import _fast

    chosen = dict(tuning._state["memory"])
    print(f"tuner: {tune_s:.2f} s for its first forward and VJP (trial calls included); "
          f"choices {chosen}; the fixed table {_fast._fixed()}")
    fixed = _fast._fixed()
    if all(getattr(fixed, name) == value for entries in chosen.values()
           for name, value in entries.items()):
        print("the tuner kept the fixed table: numpy_attn new and old ran the same code, and "
              "their difference below is the noise of this run")
    print(f"load average {load_before:.2f} before, {load_after:.2f} after\n")

    flops_full = {"fwd": 4 * HEADS * T * T * HEAD_DIM, "fwd+bwd": 14 * HEADS * T * T * HEAD_DIM}
    print(f"| T = {T} | mode | mask | ms | × torch SDPA | of floor | spread |")
    print("|---|---|---|---:|---:|---:|---:|")
    for mode in ("fwd", "fwd+bwd"):
        for mask in ("full", "causal"):
            base = median["torch SDPA", mode, mask]
            pairs = (T * (T + 1) / 2) / (T * T) if mask == "causal" else 1.0
            rate = rates["forward" if mode == "fwd" else "backward"]
            floor = flops_full[mode] * pairs / (rate * 1e9)
            for name in ("torch SDPA", "numpy_attn before", "numpy_attn old", "numpy_attn new",
                         "jax_attn"):
                if (name, mode, mask) in median:
                    s = median[name, mode, mask]
                    print(f"| {name} | {mode} | {mask} | {s * 1e3:.1f} | {s / base:.2f} | "
                          f"{floor / s:.2f} | {spread[name, mode, mask]:.0%} |")

    for other in ("old", "before"):
        if ("numpy_attn " + other, "fwd", "full") in cpu:
            print(f"\nnumpy_attn new / {other} by the process's CPU time (load-robust), full / "
                  "causal: " + "; ".join(f"{mode} " + " / ".join(
                      f"{_cpu_ratio(cpu, other, mode, m):.2f}" for m in ("full", "causal"))
                      for mode in ("fwd", "fwd+bwd")))

    def ratios(name: str, mode: str) -> str:
        if (name, mode, "full") not in median:
            return "–"
        return " / ".join(f"{median[name, mode, m] / median['torch SDPA', mode, m]:.2f}"
                          for m in ("full", "causal"))

    old = "numpy_attn before" if before is not None else "numpy_attn old"
    print("\nThe row for benchmarks/RESULTS.md (× torch SDPA, full / causal; old: "
          + (f"the code of {args.before}" if before is not None else "the fixed table")
          + "):\n")
    print("| CPU | SIMD | cores | SGEMM GFLOP/s: 2048², fwd / bwd shapes | numpy fwd old → new "
          "| numpy fwd+bwd old → new | jax fwd | jax fwd+bwd | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {machine['cpu']} | {simd_level()} | {lanes} | {rates['square']:.0f}, "
          f"{rates['forward']:.0f} / {rates['backward']:.0f} | "
          f"{ratios(old, 'fwd')} → {ratios('numpy_attn new', 'fwd')} | "
          f"{ratios(old, 'fwd+bwd')} → {ratios('numpy_attn new', 'fwd+bwd')} | "
          f"{ratios('jax_attn', 'fwd')} | {ratios('jax_attn', 'fwd+bwd')} | "
          f"{load_before:.1f}–{load_after:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
