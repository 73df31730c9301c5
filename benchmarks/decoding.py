"""Decoding at scale: one token over a long cache, contiguous (split-KV) and paged, in every
backend, next to torch's SDPA decode step.

One decoding step's attention (the append is not timed): batch 1, 8 query heads over 2 kv heads
(GQA 8:2), head_dim 64, float32, one query token over ``--tokens`` cached positions (4,096 and
32,768 by default). Rows, per backend:

* ``contiguous``: the step over a ``KVCache``'s keys as ``decode`` runs it now: split-KV
  (``spec.SPLIT_DECODING``; jax_attn: jitted, over the buffer with its length traced) from
  ``SPLIT_KV["min_kv_len"]`` keys, else the ``unsplit`` row (torch_attn: its split-KV kernel
  with one chunk, what its ``decode`` runs for a few query rows);
* ``unsplit``: the same step as one ``scaled_dot_product_attention`` (before split-KV);
* ``one chunk`` (numpy_attn): ``split_kv_attention`` with a single chunk: one task, one core;
* ``paged (in order)`` / ``paged (scattered)``: ``paged_attention`` over a pool of 256-position
  pages (flash-attn's page size), the sequence's pages in order (as a lone sequence appended in
  one go gets them) or in a random order (every page elsewhere: a pool shared with other
  sequences after many frees); jax_attn: jitted with the table traced;
* ``torch SDPA``: ``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)``
  on the contiguous keys, the decode step of issue 26's target.

Medians of interleaved rounds (``timing.interleaved``); the ratios are of one run. In a round,
each backend's rows run in the order ``unsplit``, ``one chunk`` / ``torch SDPA``,
``contiguous``, ``paged``: a call that leaves threads spinning for a while after it (numpy_attn's
``unsplit`` on OpenBLAS's threads) never runs right before a ``contiguous`` or ``paged`` row of
its backend, which it would slow down (the table lists the rows in the usual order). A control
first: two threads of single-threaded matrix products against the same work in one thread, what
two cores give on this machine at the time (the numpy split's speed-up cannot exceed it), and
the load average. ``--clock cpu`` times each call by the process's CPU time instead of the wall
clock: on a machine shared with other work the waits for a core drop out (threads that spin
while they wait, OpenMP's and XLA's, still count), so the ratios of paged against contiguous
move less from run to run; the issue's targets are wall time.

    python benchmarks/decoding.py [--tokens 4096 32768] [--rounds 15] [--torch-threads N]
                                  [--clock wall|cpu] [--backend numpy|jax|torch ...]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timing import interleaved  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 64, 256
BACKENDS = ("numpy", "jax", "torch")
#: The order of a backend's rows within a round (see the module docstring).
ROW_ORDER = ("unsplit", "one chunk", "torch SDPA", "contiguous", "paged (in order)",
             "paged (scattered)")


def _pools(keys: np.ndarray, values: np.ndarray, order: np.ndarray) -> tuple:
    """The keys and values ``(kv_heads, tokens, dim)`` in pages ``(pages, BLOCK, kv_heads,
    dim)``, page ``i`` of the sequence at ``order[i]``; the table ``(1, pages)``."""
    pages = keys.shape[1] // BLOCK

    def paged(x: np.ndarray) -> np.ndarray:
        pool = np.empty((pages, BLOCK) + (x.shape[0], x.shape[2]), x.dtype)
        pool[order] = x.reshape(x.shape[0], pages, BLOCK, x.shape[2]).transpose(1, 2, 0, 3)
        return pool

    return paged(keys), paged(values), order[None].astype(np.int32)


def _runs(tokens: int) -> dict:
    """Every row's call for one cache length."""
    import jax
    import jax.numpy as jnp
    import torch

    import attention_rules as rules
    import jax_attn
    import numpy_attn
    import torch_attn
    from jax_attn import paged as jax_paged
    from numpy_attn import paged as numpy_paged
    from torch_attn import paged as torch_paged

    rng = np.random.default_rng(tokens)
    query = rng.standard_normal((1, HEADS, 1, HEAD_DIM), dtype=np.float32)
    keys = rng.standard_normal((KV_HEADS, tokens, HEAD_DIM), dtype=np.float32)
    values = rng.standard_normal((KV_HEADS, tokens, HEAD_DIM), dtype=np.float32)
    chunk = rules.split_chunk(1, tokens) or tokens
    lens = np.array([tokens], np.int32)
    orders = {"in order": np.arange(tokens // BLOCK),
              "scattered": rng.permutation(tokens // BLOCK)}
    pools = {name: _pools(keys, values, order) for name, order in orders.items()}
    k, v = keys[None], values[None]
    runs = {}
    # numpy_attn
    split = rules.split_chunk(1, tokens) is not None  # what decode runs: split, or one piece
    runs["numpy", "contiguous"] = functools.partial(numpy_paged.split_kv_attention, query, k, v,
                                                    chunk) if split else functools.partial(
        numpy_attn.scaled_dot_product_attention, query, k, v, is_causal=True,
        causal_alignment="bottom_right")
    runs["numpy", "one chunk"] = functools.partial(numpy_paged.split_kv_attention, query, k, v,
                                                   tokens)
    runs["numpy", "unsplit"] = functools.partial(
        numpy_attn.scaled_dot_product_attention, query, k, v, is_causal=True,
        causal_alignment="bottom_right")
    for name, (kp, vp, table) in pools.items():
        runs["numpy", f"paged ({name})"] = functools.partial(
            numpy_attn.paged_attention, query, kp, vp, table, lens)
    # jax_attn: jitted; the contiguous step over a buffer with a traced length
    jq, jk, jv, jlen = jnp.asarray(query), jnp.asarray(k), jnp.asarray(v), jnp.asarray(tokens)
    split_step = jax.jit(lambda q, kb, vb, n: jax_paged.split_kv_attention(q, kb, vb, chunk,
                                                                           length=n)[0])
    whole = jax.jit(functools.partial(jax_attn.scaled_dot_product_attention, is_causal=True,
                                      causal_alignment="bottom_right"))
    runs["jax", "contiguous"] = (lambda: jax.block_until_ready(split_step(jq, jk, jv, jlen))) \
        if split else (lambda: jax.block_until_ready(whole(jq, jk, jv)))
    runs["jax", "unsplit"] = lambda: jax.block_until_ready(whole(jq, jk, jv))
    paged = jax.jit(jax_attn.paged_attention)
    jlens = jnp.asarray(lens)  # on the device once, as the contiguous row's length
    for name, arrays in pools.items():
        kp, vp, table = map(jnp.asarray, arrays)
        runs["jax", f"paged ({name})"] = functools.partial(
            lambda kp, vp, table: jax.block_until_ready(paged(jq, kp, vp, table, jlens)),
            kp, vp, table)
    # torch_attn, and torch's own SDPA
    tq, tk, tv = (torch.from_numpy(x) for x in (query, k, v))
    with torch.no_grad():
        # torch_attn's decode runs its own kernel for few query rows, split or in one piece
        runs["torch", "contiguous"] = functools.partial(
            torch_paged.split_kv_attention, tq, tk, tv, chunk)
        runs["torch", "unsplit"] = functools.partial(
            torch_attn.scaled_dot_product_attention, tq, tk, tv, is_causal=True,
            causal_alignment="bottom_right")
        for name, arrays in pools.items():
            kp, vp, table = (torch.from_numpy(x) for x in arrays)
            runs["torch", f"paged ({name})"] = functools.partial(
                torch_attn.paged_attention, tq, kp, vp, table, torch.from_numpy(lens))
        runs["torch", "torch SDPA"] = functools.partial(
            torch.nn.functional.scaled_dot_product_attention, tq, tk, tv, enable_gqa=True)
    reference = runs["numpy", "unsplit"]()
    for key, run in runs.items():  # every row computes the same attention
        np.testing.assert_allclose(np.asarray(_first(run())), reference, rtol=1e-4, atol=1e-5,
                                   err_msg=str(key))
    return runs


def parallel_ceiling(rounds: int = 5) -> float:
    """What two threads can gain on this machine now: the same single-threaded BLAS products
    run twice in a row over both at once in two threads (the split's speed-up is bounded by
    it; on a machine whose second core is busy elsewhere it is about 1)."""
    import threading

    from threadpoolctl import threadpool_limits

    a = np.random.default_rng(0).standard_normal((400, 400), dtype=np.float32)

    def work() -> None:
        for _ in range(40):
            a @ a

    ratios = []
    with threadpool_limits(1):
        work()
        for _ in range(rounds):
            start = time.perf_counter()
            work()
            work()
            serial = time.perf_counter() - start
            threads = [threading.Thread(target=work) for _ in range(2)]
            start = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            ratios.append(serial / (time.perf_counter() - start))
    return statistics.median(ratios)


def _first(result: object) -> object:
    return result[0] if isinstance(result, tuple) else result


def main(argv: list[str] | None = None) -> None:
    """Time every row for each cache length and print one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's own, one per core)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="time a call by the wall clock (default) or the process's CPU time")
    parser.add_argument("--backend", choices=["numpy", "jax", "torch"], action="append",
                        help="time only this backend's rows (repeatable; default: all); the "
                             "others still run once, to check that every row agrees")
    args = parser.parse_args(argv)
    chosen = set(args.backend or BACKENDS)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    import torch

    torch.set_grad_enabled(False)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    print(f"batch 1, {HEADS} heads over {KV_HEADS} kv heads, head_dim {HEAD_DIM}, float32, one "
          f"query token, pages of {BLOCK}; median of {args.rounds} interleaved rounds; "
          f"{torch.get_num_threads()} torch threads; {args.clock} clock; load average "
          + " ".join(f"{x:.1f}" for x in os.getloadavg()))
    print(f"{'tokens':>7} {'backend':<7} {'row':<19} {'ms':>8} {'× contiguous':>13} "
          f"{'× torch SDPA':>13}")
    print(f"two threads of single-threaded matmuls: {parallel_ceiling():.2f}× over one "
          f"(what two cores give here now)")
    for tokens in args.tokens:
        runs = {key: run for key, run in _runs(tokens).items() if key[0] in chosen}
        order = sorted(runs, key=lambda key: (BACKENDS.index(key[0]), ROW_ORDER.index(key[1])))
        timed = interleaved({key: runs[key] for key in order}, args.rounds, clock=clock)
        times = {key: statistics.median(timed[key]) for key in runs}  # listed as built
        sdpa = times.get(("torch", "torch SDPA"))
        for (backend, row), seconds in times.items():
            against = "-" if sdpa is None else f"{seconds / sdpa:.2f}"
            print(f"{tokens:>7} {backend:<7} {row:<19} {seconds * 1e3:8.2f} "
                  f"{seconds / times[backend, 'contiguous']:13.2f} {against:>13}")


if __name__ == "__main__":
    main()
