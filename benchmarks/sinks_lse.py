"""What attention sinks and ``return_lse`` cost on the fast paths: numpy_attn and jax_attn.

numpy_attn's blocked path and jax_attn's ``lax.map`` blocks compute each row's log-sum-exp
anyway; ``return_lse`` returns it without another pass, and a sink joins each row's denominator
once, at the end (``spec.SINKS``). This prints each variant's median time (interleaved rounds,
``timing.interleaved``) and its ratio to the same backend without sinks or lse, measured in the
same run: batch 1, 8 heads, head_dim 64, float32, forward, plain and causal; and numpy_attn's
hand-written VJP with and without sinks.

    python benchmarks/sinks_lse.py [--tokens 2048] [--rounds 7]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timing import interleaved  # noqa: E402

VARIANTS = {"plain": {}, "sinks": {"sinks": True}, "return_lse": {"return_lse": True},
            "sinks + lse": {"sinks": True, "return_lse": True}}


def main(argv: list[str] | None = None) -> None:
    """Time the variants and print one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    import jax
    import jax.numpy as jnp

    import jax_attn
    import numpy_attn

    rng = np.random.default_rng(0)
    q, k, v, grad = (rng.standard_normal((1, 8, args.tokens, 64), dtype=np.float32)
                     for _ in range(4))
    sinks = rng.standard_normal(8).astype(np.float32)
    jq, jk, jv, js = map(jnp.asarray, (q, k, v, sinks))
    runs = {}
    for causal in (False, True):
        for name, variant in VARIANTS.items():
            given = sinks if variant.get("sinks") else None
            lse = variant.get("return_lse", False)
            runs["numpy", causal, name] = functools.partial(
                numpy_attn.scaled_dot_product_attention, q, k, v, is_causal=causal,
                sinks=given, return_lse=lse)
            jitted = jax.jit(functools.partial(
                jax_attn.scaled_dot_product_attention, is_causal=causal, return_lse=lse))
            jax_sinks = js if variant.get("sinks") else None
            runs["jax", causal, name] = lambda f=jitted, s=jax_sinks: jax.block_until_ready(
                f(jq, jk, jv, sinks=s))
        for name in ("plain", "sinks"):
            runs["numpy vjp", causal, name] = functools.partial(
                numpy_attn.scaled_dot_product_attention_vjp, q, k, v, grad, is_causal=causal,
                sinks=sinks if name == "sinks" else None)
    times = {key: statistics.median(t) for key, t in interleaved(runs, args.rounds).items()}
    print(f"{args.tokens} tokens, 8 heads, head_dim 64, float32; median of {args.rounds} rounds")
    print(f"{'backend':<10} {'causal':<7} {'variant':<12} {'ms':>8} {'× plain':>8}")
    for (backend, causal, name), seconds in times.items():
        ratio = seconds / times[backend, causal, "plain"]
        print(f"{backend:<10} {causal!s:<7} {name:<12} {seconds * 1e3:8.1f} {ratio:8.2f}")


if __name__ == "__main__":
    main()
