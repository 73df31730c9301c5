"""What a ``mask_mod`` and chunked local attention cost on the fast paths, in every backend.

Two targets of issue 24 (``spec.TILE_SKIPPING``): a causal ``mask_mod`` (``masks.causal_mod()``)
costs at most 1.15× the dedicated ``is_causal=True`` (the tiles above the diagonal are skipped,
not just masked), and chunked attention with ``chunk_size=512`` at 4,096 tokens at most 0.35×
full attention. One run, interleaved rounds (``timing.interleaved``), medians, each ratio
against the same backend in the same run: batch 1, 8 heads, head_dim 64, float32, forward
(``--backward``: forward + backward through each backend's VJP).

    python benchmarks/masks.py [--tokens 4096] [--rounds 5] [--backward] [--backends numpy,jax]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timing import interleaved  # noqa: E402

CHUNK = 512
TARGETS = {("causal mask_mod", "is_causal"): 1.15, ("chunk 512", "full"): 0.35}


def variants(masks: object) -> dict[str, dict]:
    """The options of each variant, with the backend's ready-made causal mod."""
    return {"full": {}, "is_causal": {"is_causal": True},
            "causal mask_mod": {"mask_mod": masks.causal_mod()},
            "chunk 512": {"chunk_size": CHUNK}}


def numpy_runs(q: np.ndarray, grad: np.ndarray, backward: bool) -> dict:
    import numpy_attn
    from numpy_attn import masks

    fn = numpy_attn.scaled_dot_product_attention_vjp if backward else \
        numpy_attn.scaled_dot_product_attention
    extra = (grad,) if backward else ()
    return {name: functools.partial(fn, q, q, q, *extra, **options)
            for name, options in variants(masks).items()}


def jax_runs(q: np.ndarray, grad: np.ndarray, backward: bool) -> dict:
    import jax
    import jax.numpy as jnp

    import jax_attn
    from jax_attn import masks

    jq, jg = jnp.asarray(q), jnp.asarray(grad)
    runs = {}
    for name, options in variants(masks).items():  # the mods are static: inside the closure
        if backward:
            fn = jax.jit(lambda q, g, options=options: jax.vjp(functools.partial(
                jax_attn.scaled_dot_product_attention, **options), q, q, q)[1](g))
            runs[name] = lambda f=fn: jax.block_until_ready(f(jq, jg))
        else:
            fn = jax.jit(lambda q, options=options: jax_attn.scaled_dot_product_attention(
                q, q, q, **options))
            runs[name] = lambda f=fn: jax.block_until_ready(f(jq))
    return runs


def torch_runs(q: np.ndarray, grad: np.ndarray, backward: bool) -> dict:
    import torch

    import torch_attn
    from torch_attn import masks

    tq, tg = torch.from_numpy(q), torch.from_numpy(grad)

    def run(options: dict) -> None:
        if not backward:
            with torch.no_grad():
                torch_attn.scaled_dot_product_attention(tq, tq, tq, **options)
            return
        x = tq.clone().requires_grad_(True)
        torch_attn.scaled_dot_product_attention(x, x, x, **options).backward(tg)

    return {name: functools.partial(run, options) for name, options in variants(masks).items()}


def main(argv: list[str] | None = None) -> None:
    """Time the variants and print one table with the ratios and their targets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--backends", default="numpy,jax,torch")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    q, grad = (rng.standard_normal((1, 8, args.tokens, 64), dtype=np.float32) for _ in range(2))
    makers = {"numpy": numpy_runs, "jax": jax_runs, "torch": torch_runs}
    runs = {}
    for backend in args.backends.split(","):
        for name, fn in makers[backend](q, grad, args.backward).items():
            runs[backend, name] = fn
    load = os.getloadavg()[0]
    times = {key: statistics.median(t) for key, t in interleaved(runs, args.rounds).items()}
    what = "forward + backward" if args.backward else "forward"
    print(f"{args.tokens} tokens, batch 1, 8 heads, head_dim 64, float32, {what}; "
          f"median of {args.rounds} rounds; load average {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)")
    print(f"{'backend':<8} {'variant':<16} {'ms':>9} {'ratio':>7} {'target':>8}")
    for (backend, name), seconds in times.items():
        line = f"{backend:<8} {name:<16} {seconds * 1e3:9.1f}"
        for (variant, base), target in TARGETS.items():
            if name == variant:
                ratio = seconds / times[backend, base]
                verdict = "ok" if ratio <= target else "MISSED"
                line += f" {ratio:7.2f} {'≤ ' + str(target):>8} {verdict} (vs {base})"
        print(line)


if __name__ == "__main__":
    main()
