"""Benchmark: jax_attn's forward and forward + backward next to torch SDPA and jax.nn.

    python benchmarks/jax_backward.py [--lengths 2048 4096] [--repeats 7] [--long 16384]

Shapes: batch 1, 8 heads, head_dim 64, float32, full and causal. Variants, per (T, causal):

* ``torch SDPA``: ``torch.nn.functional.scaled_dot_product_attention``, forward; ``+ backward``
  with autograd;
* ``jax_attn``: ``scaled_dot_product_attention`` (jitted); forward + backward through
  ``scaled_dot_product_attention_vjp`` (jitted; the blocked path's ``custom_vjp``);
* ``jax.nn``: ``jax.nn.dot_product_attention`` (jitted, in its (batch, seq, heads, dim) layout);
  forward + backward through ``jax.vjp``, jitted.

All variants of one T run interleaved, round after round, with a short pause before each call;
the table gives medians and ratios from the same run, plus the ratios the targets speak of
(jax_attn / SDPA, jax.nn / jax_attn, causal / full). The load average is printed before and
after: compare ratios, not absolute times, on a shared machine.

``--long N``: forward + backward of jax_attn for one head of N tokens: the compiled program's
temporary memory (XLA's ``memory_analysis``) next to the size of one ``(N, N)`` float32 array,
whether the jaxpr holds an array whose last axes are ``(N, N)``, and the time of one call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from timing import interleaved

HEADS, HEAD_DIM = 8, 64
PAUSE_S = 0.05


def _inputs(T: int, heads: int) -> list[np.ndarray]:
    gen = np.random.default_rng(0)
    return [gen.standard_normal((1, heads, T, HEAD_DIM), dtype=np.float32) for _ in range(4)]


def variants(T: int, causal: bool) -> dict[str, object]:
    """name → a callable that runs the variant once and waits for it."""
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F

    import jax_attn

    q, k, v, g = _inputs(T, HEADS)
    tq, tk, tv, tg = (torch.from_numpy(x) for x in (q, k, v, g))
    jq, jk, jv, jg = (jnp.asarray(x) for x in (q, k, v, g))
    bq, bk, bv, bg = (jnp.swapaxes(x, 1, 2) for x in (jq, jk, jv, jg))  # jax.nn's layout
    gq, gk, gv = (x.clone().requires_grad_(True) for x in (tq, tk, tv))

    def sdpa_fwd_bwd():
        gq.grad = gk.grad = gv.grad = None
        F.scaled_dot_product_attention(gq, gk, gv, is_causal=causal).backward(tg)

    def compiled(fn, *args):
        fn = jax.jit(fn).lower(*args).compile()
        return lambda: jax.block_until_ready(fn(*args))

    def nn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)

    def nn_vjp(q, k, v, g):
        return jax.vjp(nn, q, k, v)[1](g)

    return {
        "fwd torch SDPA": lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal),
        "fwd jax_attn": compiled(lambda q, k, v: jax_attn.scaled_dot_product_attention(
            q, k, v, is_causal=causal), jq, jk, jv),
        "fwd jax.nn": compiled(nn, bq, bk, bv),
        "fwd+bwd torch SDPA": sdpa_fwd_bwd,
        "fwd+bwd jax_attn": compiled(lambda q, k, v, g: jax_attn.scaled_dot_product_attention_vjp(
            q, k, v, g, is_causal=causal)[:3], jq, jk, jv, jg),
        "fwd+bwd jax.nn": compiled(nn_vjp, bq, bk, bv, bg),
    }


def measure(T: int, repeats: int) -> dict[tuple[str, bool], float]:
    """Median seconds per (variant, causal), all variants of T interleaved."""
    runs = {(name, causal): fn for causal in (False, True)
            for name, fn in variants(T, causal).items()}
    return {key: statistics.median(t) for key, t in interleaved(runs, repeats, PAUSE_S).items()}


def report(T: int, medians: dict[tuple[str, bool], float]) -> None:
    print(f"\n### {T} tokens (batch 1, {HEADS} heads, head_dim {HEAD_DIM}, float32)\n")
    print("| variant | full ms | causal ms | causal / full |")
    print("|---|---|---|---|")
    for name in dict.fromkeys(name for name, _ in medians):
        full, causal = medians[name, False], medians[name, True]
        print(f"| {name} | {full * 1e3:.1f} | {causal * 1e3:.1f} | {causal / full:.2f} |")
    print("\n| ratio | full | causal | target |")
    print("|---|---|---|---|")
    for mode, target in (("fwd", "≤ 1.3"), ("fwd+bwd", "≤ 1.5")):
        r = [medians[f"{mode} jax_attn", c] / medians[f"{mode} torch SDPA", c] for c in (0, 1)]
        print(f"| {mode}: jax_attn / torch SDPA | {r[0]:.2f} | {r[1]:.2f} | {target} |")
    r = [medians["fwd+bwd jax.nn", c] / medians["fwd+bwd jax_attn", c] for c in (0, 1)]
    print(f"| fwd+bwd: jax.nn / jax_attn (speed-up) | {r[0]:.2f} | {r[1]:.2f} | ≥ 1.5 |")


def long_sequence(T: int) -> None:
    """One head of T tokens: compiled temporary memory, (T, T) arrays in the jaxpr, time."""
    import jax
    import jax.numpy as jnp

    import jax_attn

    q, k, v, g = (jnp.asarray(x) for x in _inputs(T, 1))

    def fwd_bwd(q, k, v, g):
        return jax_attn.scaled_dot_product_attention_vjp(q, k, v, g, is_causal=causal)[:3]

    def shapes(jaxpr):
        for eqn in jaxpr.eqns:
            yield from (var.aval.shape for var in eqn.outvars)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from shapes(inner)

    print(f"\n### forward + backward, one head of {T} tokens\n")
    print("| causal | temp MiB (XLA) | one (T, T) float32 MiB | (T, T) array in jaxpr | s |")
    print("|---|---|---|---|---|")
    for causal in (False, True):
        square = any(s[-2:] == (T, T) for s in shapes(jax.make_jaxpr(fwd_bwd)(q, k, v, g).jaxpr))
        fn = jax.jit(fwd_bwd).lower(q, k, v, g).compile()
        temp = fn.memory_analysis().temp_size_in_bytes / 2**20
        start = time.perf_counter()
        jax.block_until_ready(fn(q, k, v, g))
        seconds = time.perf_counter() - start
        print(f"| {'yes' if causal else 'no'} | {temp:.0f} | {T * T * 4 / 2**20:.0f} "
              f"| {'yes' if square else 'no'} | {seconds:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[2048, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--long", type=int, default=None, help="one head of this many tokens")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for T in args.lengths:
        report(T, measure(T, args.repeats))
        print(f"\nload average: {os.getloadavg()[0]:.2f}")
    if args.long:
        long_sequence(args.long)
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
