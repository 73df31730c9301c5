"""torch_attn forward + backward where SDPA's own options end: the tiles against the other route.

    python benchmarks/torch_beyond_sdpa.py [--tokens 4096] [--rounds 3]

Batch 1, 8 heads, head_dim 64, float32, ``.backward()`` through
``torch_attn.scaled_dot_product_attention``. Per feature, the route ``_fast.use_fast_path``
takes for large inputs (``"blocked"``: ``_tiles.BlockwiseFunction``) against the route it
would take without the tiles (``MIN_SCORES`` patched out of reach): the explicit steps for a
soft-cap, SDPA with the band as a boolean mask for a window or bottom-right causal. Each
(feature, route) runs in a fresh subprocess: the best of ``--rounds`` calls, and the peak RSS
growth of the first call (``VmHWM`` reset through ``/proc/self/clear_refs``; the parent sets
``MALLOC_MMAP_THRESHOLD_`` so freed blocks go back to the system).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HEADS, HEAD_DIM = 8, 64
FEATURES = {  # name → (query tokens, key tokens as fractions of --tokens, options)
    "softcap 30": (1, 1, {"softcap": 30.0}),
    "softcap 30, causal": (1, 1, {"softcap": 30.0, "is_causal": True}),
    "window (256, 0)": (1, 1, {"window": (256, 0)}),
    "bottom-right, kv_len = q_len / 4": (1, 0.25, {"is_causal": True,
                                                   "causal_alignment": "bottom_right"}),
}


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def measure(feature: str, tiles: bool, tokens: int, rounds: int) -> dict:
    """In this (fresh) process: the route taken, peak extra MiB of the first call, best s."""
    import torch

    import attention_rules
    import torch_attn
    from torch_attn import _fast

    q_frac, kv_frac, options = FEATURES[feature]
    gen = torch.Generator().manual_seed(0)
    q_len, kv_len = int(tokens * q_frac), int(tokens * kv_frac)
    q, g = (torch.randn(1, HEADS, q_len, HEAD_DIM, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, HEADS, kv_len, HEAD_DIM, generator=gen) for _ in range(2))
    if not tiles:
        _fast.MIN_SCORES = 1 << 62  # the route without the tiles
    info = [(tuple(t.shape), "float32") for t in (q, k, v)]
    path = _fast.use_fast_path(q, k, v, None, None,
                               attention_rules.attention_arguments("benchmark", *info, **options))
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]

    def step() -> None:
        for t in inputs:
            t.grad = None
        torch_attn.scaled_dot_product_attention(*inputs, **options).backward(g)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _rss_mib("VmRSS")
    start = time.perf_counter()
    step()
    times = [time.perf_counter() - start]
    peak = _rss_mib("VmHWM") - before
    for _ in range(rounds - 1):
        time.sleep(0.1)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"path": path or "steps", "peak_mib": peak, "best_s": min(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--_one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._one:
        feature, tiles = json.loads(args._one)
        print(json.dumps(measure(feature, tiles, args.tokens, args.rounds)))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    print(f"load average before: {os.getloadavg()[0]:.2f}; {args.tokens} query tokens, "
          f"{HEADS} heads, head_dim {HEAD_DIM}, float32, forward + backward, best of "
          f"{args.rounds}\n")
    print("| feature | route | fwd+bwd ms | peak extra MiB |")
    print("|---|---|---|---|")
    for feature in FEATURES:
        for tiles in (False, True):
            cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--rounds",
                   str(args.rounds), "--_one", json.dumps([feature, tiles])]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800,
                                  check=False)
            if done.returncode != 0:
                print(f"| {feature} | {'tiles' if tiles else 'without'} | failed: "
                      f"{done.stderr.strip().splitlines()[-1:]} | |")
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"| {feature} | {r['path']} | {r['best_s'] * 1e3:.0f} "
                  f"| {r['peak_mib']:.0f} |", flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
