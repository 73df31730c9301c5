"""A packed batch (``varlen_attention``) against the same batch padded, in every backend.

Eight sequences with lengths spread evenly over 256–2,048 tokens (256, 512, …, 2,048), as one
packed batch through ``varlen_attention`` and as the same batch padded to 2,048 through
``scaled_dot_product_attention`` with a padding mask on keys and queries
(``padding_mask(lengths, 2048, q_lengths=lengths, q_len=2048)``), forward and forward +
backward (numpy_attn: the hand-written VJPs, which run their own forward pass; jax_attn: one
jitted ``jax.vjp`` and its pullback, offsets closed over as NumPy constants; torch_attn:
autograd). Full (not causal) attention, float32. It prints each variant's median time
(interleaved rounds, ``timing.interleaved``) and the ratio packed / padded measured in the same
run; the target is ≤ 0.6 (the packed batch does Σ len² = 40% of the padded score entries).

    python benchmarks/varlen.py [--heads 4] [--head-dim 64] [--rounds 3] [--backends numpy,jax]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timing import interleaved  # noqa: E402

LENGTHS = np.linspace(256, 2048, 8).astype(np.int64)  # 256, 512, ..., 2048
MAX_LEN = 2048


def _numpy(padded: tuple, grad: np.ndarray, mask: np.ndarray) -> dict[tuple, Callable]:
    import numpy_attn as na

    (q, k, v), (pq, pk, pv, pg, cu) = padded, _packed(na, padded, grad)
    longest = int(LENGTHS.max())
    return {
        ("forward", "padded"): lambda: na.scaled_dot_product_attention(q, k, v, mask=mask),
        ("forward", "packed"): lambda: na.varlen_attention(pq, pk, pv, cu, cu, longest, longest),
        ("forward + backward", "padded"): lambda: na.scaled_dot_product_attention_vjp(
            q, k, v, grad, mask=mask),
        ("forward + backward", "packed"): lambda: na.varlen_attention_vjp(
            pq, pk, pv, pg, cu, cu, longest, longest),
    }


def _jax(padded: tuple, grad: np.ndarray, mask: np.ndarray) -> dict[tuple, Callable]:
    import jax
    import jax.numpy as jnp

    import jax_attn as ja
    import numpy_attn as na

    pq, pk, pv, pg, cu = _packed(na, padded, grad)
    longest = int(LENGTHS.max())

    def padded_fn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return ja.scaled_dot_product_attention(q, k, v, mask=jnp.asarray(mask))

    def packed_fn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return ja.varlen_attention(q, k, v, cu, cu, longest, longest)  # host offsets

    def both(fn: Callable) -> Callable:
        def run(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array) -> tuple:
            out, pullback = jax.vjp(fn, q, k, v)
            return out, pullback(g)
        return jax.jit(run)

    arrays = [jnp.asarray(x) for x in (*padded, grad)]
    packed = [jnp.asarray(x) for x in (pq, pk, pv, pg)]
    forward = {"padded": (jax.jit(padded_fn), arrays[:3]), "packed": (jax.jit(packed_fn),
                                                                       packed[:3])}
    backward = {"padded": (both(padded_fn), arrays), "packed": (both(packed_fn), packed)}
    runs = {}
    for name, table in (("forward", forward), ("forward + backward", backward)):
        for kind, (fn, args) in table.items():
            runs[name, kind] = lambda fn=fn, args=args: jax.block_until_ready(fn(*args))
    return runs


def _torch(padded: tuple, grad: np.ndarray, mask: np.ndarray) -> dict[tuple, Callable]:
    import torch

    import numpy_attn as na
    import torch_attn as ta

    pq, pk, pv, pg, cu = _packed(na, padded, grad)
    longest = int(LENGTHS.max())
    arrays = [torch.from_numpy(x) for x in padded]
    packed = [torch.from_numpy(x) for x in (pq, pk, pv)]
    t_mask, t_cu, t_grad, t_pgrad = map(torch.from_numpy, (mask, cu, grad, pg))

    def padded_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ta.scaled_dot_product_attention(q, k, v, mask=t_mask)

    def packed_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ta.varlen_attention(q, k, v, t_cu, t_cu, longest, longest)

    def both(fn: Callable, inputs: list, g: torch.Tensor) -> Callable:
        def run() -> tuple:
            leaves = [x.detach().requires_grad_(True) for x in inputs]
            return torch.autograd.grad(fn(*leaves), leaves, grad_outputs=g)
        return run

    def forward(fn: Callable, inputs: list) -> Callable:
        def run() -> torch.Tensor:
            with torch.no_grad():
                return fn(*inputs)
        return run

    return {
        ("forward", "padded"): forward(padded_fn, arrays),
        ("forward", "packed"): forward(packed_fn, packed),
        ("forward + backward", "padded"): both(padded_fn, arrays, t_grad),
        ("forward + backward", "packed"): both(packed_fn, packed, t_pgrad),
    }


def _packed(na: object, padded: tuple, grad: np.ndarray) -> tuple:
    """The padded batch and its output gradient packed (``pack_sequences``), and the offsets."""
    q, k, v = padded
    pq, cu = na.pack_sequences(q, LENGTHS)
    pk, _ = na.pack_sequences(k, LENGTHS)
    pv, _ = na.pack_sequences(v, LENGTHS)
    pg, _ = na.pack_sequences(grad, LENGTHS)
    return pq, pk, pv, pg, cu


BACKENDS = {"numpy": _numpy, "jax": _jax, "torch": _torch}


def main(argv: list[str] | None = None) -> None:
    """Time the variants and print one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="numpy,jax,torch")
    args = parser.parse_args(argv)
    import numpy_attn as na

    rng = np.random.default_rng(0)
    shape = (len(LENGTHS), args.heads, MAX_LEN, args.head_dim)
    padded = tuple(rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    grad = rng.standard_normal(shape, dtype=np.float32)
    mask = na.padding_mask(LENGTHS, MAX_LEN, q_lengths=LENGTHS, q_len=MAX_LEN)
    runs = {}
    for backend in args.backends.split(","):
        for (step, kind), fn in BACKENDS[backend](padded, grad, mask).items():
            runs[backend, step, kind] = fn
    times = {key: statistics.median(t) for key, t in interleaved(runs, args.rounds).items()}
    print(f"8 sequences of {', '.join(map(str, LENGTHS))} tokens ({LENGTHS.sum()} in all), "
          f"{args.heads} heads, head_dim {args.head_dim}, float32; median of {args.rounds} "
          f"rounds; packed / padded (target <= 0.6)")
    print(f"{'backend':<8} {'step':<20} {'padded ms':>10} {'packed ms':>10} {'ratio':>6}")
    for (backend, step, kind), seconds in times.items():
        if kind == "packed":
            base = times[backend, step, "padded"]
            print(f"{backend:<8} {step:<20} {base * 1e3:10.1f} {seconds * 1e3:10.1f} "
                  f"{seconds / base:6.2f}")


if __name__ == "__main__":
    main()
