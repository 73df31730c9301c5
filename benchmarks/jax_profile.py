"""Where jax_attn's blocked path spends its time: the steps of one forward block and of one
backward step, each jitted alone, next to the whole call and torch's SDPA.

    python benchmarks/jax_profile.py [--lengths 2048 4096] [--rounds 15]

Shapes: batch 1, 8 heads, head_dim 64, float32, full attention. The blocked path
(``jax_attn/_fast/forward.py``, ``backward.py``) runs one (batch, kv head) item at a time; its
forward pass cuts the item's queries into blocks of ``rows`` (``BLOCK_Q`` grown within
``BLOCK_SCORES``: 256 at 2,048 keys, 128 at 4,096), a block being

* ``q kᵀ``: the scores, ``(rows, 64) @ (64, T)``;
* ``max``: the row maxima;
* ``exp, sum``: the weights and their row sums;
* ``P v``: the unnormalised output, ``(rows, T) @ (T, 64)``;
* ``divide``: by the row sums (and the log-sum-exp the backward pass keeps).

Its backward pass walks ``BLOCK_KV`` keys at a time against all ``T`` rows; a step is

* ``S = q kᵀ``, ``P = exp(S - lse)``, ``dP = dO vᵀ``, ``dS = P (dP - delta)``,
  ``dQ += dS k`` (carried);
* ``dVᵀ = dOᵀ P`` and ``dKᵀ = Qᵀ dS`` with ``Qᵀ``, ``dOᵀ`` made once per item (what the code
  runs), and beside them ``Pᵀ dO`` and ``dSᵀ Q``, the same products with a transposed left
  operand (what it ran before: XLA:CPU then copies the operand).

Each step is jitted alone and called 20 times back to back (both of XLA's threads, as in the
call), interleaved round after round with the whole calls, median; each such call also pays
the dispatch of a jitted call, printed as "a jitted call that does almost nothing" (inside
the compiled path a block is a loop step instead). "predicted" is a block's or a step's time
× the number of them; "measured" the jitted call itself (forward: the output;
backward: forward + backward minus forward). The floor is the products at the rate XLA's own
``2048 × 2048`` float32 product reaches here (2 products forward, 5 in the backward: the
scores are recomputed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from timing import interleaved  # noqa: E402

HEADS, HEAD_DIM, REPEAT = 8, 64, 20
PRODUCTS = {"S = q kᵀ", "dVᵀ = dOᵀ P", "dP = dO vᵀ", "dQ += dS k", "dKᵀ = Qᵀ dS",
            "(before) dV = Pᵀ dO", "(before) dK = dSᵀ Q"}  # backward steps with a product


def _steps(T: int) -> tuple[dict, dict, dict, dict]:
    """The forward block's steps, the backward step's, and the whole calls, as callables."""
    import jax
    import jax.numpy as jnp
    import torch

    import jax_attn
    from jax_attn import _fast
    from jax_attn._fast import slicing

    mm = partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
    tr = partial(jnp.swapaxes, axis1=-1, axis2=-2)
    gen = np.random.default_rng(0)
    rows = slicing._grown(_fast._blocks(), 1, T)[0]
    n = _fast.BLOCK_KV

    def arr(*shape: int) -> jax.Array:
        return jax.device_put(gen.standard_normal(shape, dtype=np.float32) * 0.35)

    def timed(fn, *args) -> callable:
        compiled = jax.jit(fn).lower(*args).compile()

        def run() -> None:
            for _ in range(REPEAT):
                out = compiled(*args)
            jax.block_until_ready(out)
        return run

    q_blk, k, v = arr(rows, HEAD_DIM), arr(T, HEAD_DIM), arr(T, HEAD_DIM)
    s = mm(q_blk, tr(k))
    m = s.max(-1, keepdims=True)
    p = jnp.exp(s - m)
    total = p.sum(-1, keepdims=True)
    o = mm(p, v)

    def block(q, k, v):
        s = mm(q, tr(k))
        m = s.max(-1, keepdims=True)
        p = jnp.exp(s - m)
        total = p.sum(-1, keepdims=True)
        return mm(p, v) / total, m + jnp.log(total)

    forward = {
        "q kᵀ": timed(lambda q, k: mm(q, tr(k)), q_blk, k),
        "max": timed(lambda s: s.max(-1, keepdims=True), s),
        "exp, sum": timed(lambda s, m: (lambda p: (p, p.sum(-1, keepdims=True)))(
            jnp.exp(s - m)), s, m),
        "P v": timed(mm, p, v),
        "divide": timed(lambda o, t, m: (o / t, m + jnp.log(t)), o, total, m),
        "block": timed(block, q_blk, k, v),
        "a jitted call that does almost nothing": timed(lambda x: x + 1.0, total),
    }

    qs, d_out, k_blk, v_blk = arr(T, HEAD_DIM), arr(T, HEAD_DIM), arr(n, HEAD_DIM), arr(n,
                                                                                      HEAD_DIM)
    q_t, d_out_t = tr(qs) + 0, tr(d_out) + 0  # materialised, as made once per item
    lse, delta, grad_q = jnp.full((T, 1), 3.0), arr(T, 1), arr(T, HEAD_DIM)
    s = mm(qs, tr(k_blk))
    p = jnp.exp(s - lse)
    dp = mm(d_out, tr(v_blk))
    ds = p * (dp - delta)

    def step(qs, d_out, q_t, d_out_t, lse, delta, k_blk, v_blk, grad_q):
        p = jnp.exp(mm(qs, tr(k_blk)) - lse)
        grad_s = p * (mm(d_out, tr(v_blk)) - delta)
        return grad_q + mm(grad_s, k_blk), mm(q_t, grad_s), mm(d_out_t, p)

    backward = {
        "S = q kᵀ": timed(lambda q, k: mm(q, tr(k)), qs, k_blk),
        "P = exp(S - lse)": timed(lambda s, lse: jnp.exp(s - lse), s, lse),
        "dVᵀ = dOᵀ P": timed(mm, d_out_t, p),
        "dP = dO vᵀ": timed(lambda d, v: mm(d, tr(v)), d_out, v_blk),
        "dS = P (dP - delta)": timed(lambda p, dp, d: p * (dp - d), p, dp, delta),
        "dQ += dS k": timed(lambda g, ds, k: g + mm(ds, k), grad_q, ds, k_blk),
        "dKᵀ = Qᵀ dS": timed(mm, q_t, ds),
        "step": timed(step, qs, d_out, q_t, d_out_t, lse, delta, k_blk, v_blk, grad_q),
        "(before) dV = Pᵀ dO": timed(lambda p, d: mm(tr(p), d), p, d_out),
        "(before) dK = dSᵀ Q": timed(lambda ds, q: mm(tr(ds), q), ds, qs),
    }

    shape = (1, HEADS, T, HEAD_DIM)
    jq, jk, jv, jg = (jax.device_put(gen.standard_normal(shape, dtype=np.float32))
                      for _ in range(4))
    fwd = jax.jit(jax_attn.scaled_dot_product_attention).lower(jq, jk, jv).compile()
    fwd_bwd = jax.jit(lambda q, k, v, g: jax_attn.scaled_dot_product_attention_vjp(
        q, k, v, g)[:3]).lower(jq, jk, jv, jg).compile()
    tq, tk, tv, tg = (torch.from_numpy(np.array(x)) for x in (jq, jk, jv, jg))
    gq, gk, gv = (x.clone().requires_grad_(True) for x in (tq, tk, tv))

    def sdpa_fwd_bwd() -> None:
        gq.grad = gk.grad = gv.grad = None
        torch.nn.functional.scaled_dot_product_attention(gq, gk, gv).backward(tg)

    square = jax.device_put(gen.standard_normal((2048, 2048), dtype=np.float32))
    product = jax.jit(lambda a: a @ a).lower(square).compile()
    calls = {
        "jax_attn forward": lambda: jax.block_until_ready(fwd(jq, jk, jv)),
        "jax_attn forward + backward": lambda: jax.block_until_ready(fwd_bwd(jq, jk, jv, jg)),
        "torch SDPA forward": lambda: torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv),
        "torch SDPA forward + backward": sdpa_fwd_bwd,
        "XLA 2048² product": lambda: jax.block_until_ready(product(square)),
    }
    return forward, backward, calls, {"rows": rows, "block_kv": n}


def report(T: int, rounds: int) -> None:
    forward, backward, calls, sizes = _steps(T)
    steps = {**{("f", k): v for k, v in forward.items()}, **{("b", k): v for k, v in
                                                            backward.items()}}
    times = interleaved({**steps, **{("c", k): v for k, v in calls.items()}}, rounds,
                        pause_s=0.02)
    med = {key: statistics.median(t) for key, t in times.items()}
    us = {key: med[key] / REPEAT * 1e6 for key in steps}
    ms = {key[1]: med[key] * 1e3 for key in times if key[0] == "c"}
    rate = 2 * 2048**3 / (ms["XLA 2048² product"] / 1e3) / 1e9
    rows, n = sizes["rows"], sizes["block_kv"]
    items, blocks, kv_steps = HEADS, T // rows, T // n
    fwd_flop = 4 * HEADS * T * T * HEAD_DIM
    bwd_flop = 10 * HEADS * T * T * HEAD_DIM
    print(f"\n### {T} tokens (batch 1, {HEADS} heads, head_dim {HEAD_DIM}, float32, full); "
          f"XLA's 2048² product: {rate:.0f} GFLOP/s\n")
    print(f"Forward: one block of {rows} rows × {T} keys, {items} items × {blocks} blocks\n")
    print("| step | µs | share of the block's steps | GFLOP/s |")
    print("|---|---:|---:|---:|")
    empty = "a jitted call that does almost nothing"
    parts = [k for k in forward if k not in ("block", empty)]
    total = sum(us[("f", k)] for k in parts)
    for k in parts:
        flop = 2 * rows * T * HEAD_DIM if k in ("q kᵀ", "P v") else None
        speed = f"{flop / us[('f', k)] / 1e3:.0f}" if flop else ""
        print(f"| `{k}` | {us[('f', k)]:.0f} | {us[('f', k)] / total:.0%} | {speed} |")
    print(f"| the block, jitted whole | {us[('f', 'block')]:.0f} | | |")
    print(f"| {empty} (x + 1 on {rows} numbers: the cost of a call) | {us[('f', empty)]:.0f} "
          "| | |")
    predicted = us[("f", "block")] * items * blocks / 1e3
    print(f"\n- call, predicted (block × {items * blocks}): {predicted:.1f} ms; measured: "
          f"{ms['jax_attn forward']:.1f} ms; torch SDPA {ms['torch SDPA forward']:.1f} ms "
          f"(jax_attn × SDPA {ms['jax_attn forward'] / ms['torch SDPA forward']:.2f})")
    floor = fwd_flop / rate / 1e6
    products = (us[("f", "q kᵀ")] + us[("f", "P v")]) * items * blocks / 1e3
    print(f"- the two products alone, at the rates above: {products:.1f} ms; the floor "
          f"(at {rate:.0f} GFLOP/s) {floor:.1f} ms; SDPA runs at "
          f"{fwd_flop / ms['torch SDPA forward'] / 1e6:.0f} GFLOP/s overall")
    print(f"\nBackward: one step of {n} keys × {T} rows, {items} items × {kv_steps} steps\n")
    print("| step | µs | GFLOP/s |")
    print("|---|---:|---:|")
    for k in backward:
        flop = 2 * T * n * HEAD_DIM if k in PRODUCTS else None
        speed = f"{flop / us[('b', k)] / 1e3:.0f}" if flop else ""
        print(f"| `{k}` | {us[('b', k)]:.0f} | {speed} |")
    predicted = us[("b", "step")] * items * kv_steps / 1e3
    measured = ms["jax_attn forward + backward"] - ms["jax_attn forward"]
    sdpa_bwd = ms["torch SDPA forward + backward"] - ms["torch SDPA forward"]
    print(f"\n- backward, predicted (step × {items * kv_steps}): {predicted:.1f} ms; measured "
          f"(forward + backward − forward): {measured:.1f} ms; torch SDPA's {sdpa_bwd:.1f} ms "
          f"(× {measured / sdpa_bwd:.2f}); the floor {bwd_flop / rate / 1e6:.1f} ms")
    print(f"- forward + backward: jax_attn {ms['jax_attn forward + backward']:.1f} ms, "
          f"torch SDPA {ms['torch SDPA forward + backward']:.1f} ms (× "
          f"{ms['jax_attn forward + backward'] / ms['torch SDPA forward + backward']:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for T in args.lengths:
        report(T, args.rounds)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
