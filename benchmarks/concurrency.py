"""numpy_attn under concurrent callers: throughput with 1, 2 and 4 calling threads, and what a
neighbour thread's own matrix products see meanwhile.

    python benchmarks/concurrency.py [--length 1024] [--calls 24] [--rounds 3]

Shapes: batch 1, 4 heads, head_dim 64, float32, ``T`` queries and keys, causal (the fast path).
Each round runs every variant once, interleaved (load on a shared machine affects them alike);
the medians are printed.

* ``throughput``: ``calls`` calls of ``scaled_dot_product_attention`` (``fwd``) or
  ``scaled_dot_product_attention_vjp`` (``fwd+bwd``) shared out among 1, 2 or 4 threads started
  together; calls per second, and the ratio to one thread (1.0: the pool's cores are already
  busy with one caller; > 1: more callers use cores one caller leaves idle).
* ``neighbour``: a thread multiplying two 512 x 512 float32 matrices in a loop, alone and while
  another thread calls ``scaled_dot_product_attention_vjp``; its products per second and the
  BLAS thread counts it reads (``threadpoolctl``) during the attention calls
  (``spec.BLAS_LIMIT``).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

HEADS, HEAD_DIM = 4, 64


def throughput(fn, calls: int, threads: int) -> float:
    """Calls per second of ``fn`` made ``calls`` times, shared among ``threads`` threads."""
    share = [calls // threads + (i < calls % threads) for i in range(threads)]
    barrier = threading.Barrier(threads + 1)

    def work(n: int) -> None:
        barrier.wait()
        for _ in range(n):
            fn()

    workers = [threading.Thread(target=work, args=(n,)) for n in share]
    for w in workers:
        w.start()
    barrier.wait()
    start = time.perf_counter()
    for w in workers:
        w.join()
    return calls / (time.perf_counter() - start)


def neighbour(attention, seconds: float) -> tuple[float, float, list[int]]:
    """Products per second of a 512 x 512 matmul loop alone and beside ``attention`` calls,
    and the BLAS thread counts read while the attention calls ran."""
    from threadpoolctl import threadpool_info

    a = np.random.default_rng(1).standard_normal((512, 512)).astype(np.float32)

    def loop(stop: threading.Event, seen: list[int] | None) -> int:
        n = 0
        while not stop.is_set():
            a @ a
            n += 1
            if seen is not None and n % 4 == 0:
                seen += [lib["num_threads"] for lib in threadpool_info()
                         if lib["user_api"] == "blas"]
        return n

    def timed(with_attention: bool) -> tuple[float, list[int]]:
        stop, seen, count = threading.Event(), [], [0]
        runner = threading.Thread(target=lambda: count.__setitem__(0, loop(stop, seen)))
        busy = threading.Thread(target=lambda: [attention() for _ in iter(stop.is_set, True)])
        start = time.perf_counter()
        runner.start()
        if with_attention:
            busy.start()
        time.sleep(seconds)
        stop.set()
        runner.join()
        if with_attention:
            busy.join()
        return count[0] / (time.perf_counter() - start), seen

    alone, _ = timed(False)
    beside, seen = timed(True)
    return alone, beside, sorted(set(seen))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--neighbour-seconds", type=float, default=2.0)
    args = parser.parse_args()

    import numpy_attn

    gen = np.random.default_rng(0)
    q, k, v, g = (gen.standard_normal((1, HEADS, args.length, HEAD_DIM)).astype(np.float32)
                  for _ in range(4))
    variants = {
        "fwd": lambda: numpy_attn.scaled_dot_product_attention(q, k, v, is_causal=True),
        "fwd+bwd": lambda: numpy_attn.scaled_dot_product_attention_vjp(q, k, v, g,
                                                                       is_causal=True),
    }
    for fn in variants.values():
        fn()  # warm up: the pool and the BLAS controller are made on first use
    threads = (1, 2, 4)
    rates: dict = {(name, t): [] for name in variants for t in threads}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            for t in threads:
                rates[name, t].append(throughput(fn, args.calls, t))
    print(f"throughput, (1, {HEADS}, {args.length}, {HEAD_DIM}) float32 causal, "
          f"{args.calls} calls, median of {args.rounds} rounds")
    print(f"{'call':8} {'threads':>7} {'calls/s':>9} {'vs 1 thread':>12}")
    for name in variants:
        one = statistics.median(rates[name, 1])
        for t in threads:
            rate = statistics.median(rates[name, t])
            print(f"{name:8} {t:7d} {rate:9.2f} {rate / one:12.2f}")
    try:
        import threadpoolctl  # noqa: F401
    except ImportError:
        print("\nneighbour: needs threadpoolctl (pip install threadpoolctl)")
        return
    alone, beside, seen = neighbour(variants["fwd+bwd"], args.neighbour_seconds)
    print("\nneighbour: 512 x 512 float32 matmul loop in another thread")
    print(f"  alone {alone:.1f}/s, beside fwd+bwd calls {beside:.1f}/s ({beside / alone:.2f}); "
          f"BLAS threads it read meanwhile: {seen}")


if __name__ == "__main__":
    main()
