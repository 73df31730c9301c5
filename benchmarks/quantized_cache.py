"""Quantised KV caches: the error each scheme costs, the memory it saves, and one decoding step's
time, next to the float32 ``KVCache`` (``conformance/spec/quantized_cache.py``).

Seeded inputs: batch 1, 8 kv heads, 8 query heads, 4,096 cached tokens, head_dim 128, float32
(keys and values unit normal, one query token). For each scheme:

* ``rel. error``: ``‖o - o_f32‖ / ‖o_f32‖`` of the attention output over the quantised cache
  against the output over the float32 keys and values (``QuantizedKVCache.attend``, numpy_attn);
* ``key max err``: the largest ``|k - dequantised k|``;
* ``bytes/token/layer``: keys and values of one token in the quantised store
  (``attention_rules.quantizing.bytes_per_token``; int4 as packed 4-bit codes, what a packed
  kernel stores; this project stores int4 codes unpacked, one per byte: the int8 figure), and
  its ratio to float32's 8,192;
* ``decode``: one decoding step (append one token, attend one query over 4,097 tokens): median
  of interleaved rounds, numpy_attn and torch_attn, the ratio to the float32 ``KVCache`` step
  of the same backend (``kv_cache.decode_step``) in the same run.

    python benchmarks/quantized_cache.py [--rounds 15] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))

from timing import interleaved  # noqa: E402

import numpy_attn  # noqa: E402
import torch_attn  # noqa: E402
from attention_rules.quantizing import KVQuantization, bytes_per_token  # noqa: E402
from numpy_attn.kv_cache import decode_step as numpy_decode_step  # noqa: E402
from torch_attn.kv_cache import decode_step as torch_decode_step  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 8, 128
SCHEMES = {
    "int8 group 64": KVQuantization("int8"),
    "int8 token": KVQuantization("int8", granularity="token"),
    "int8 group 64, zero point": KVQuantization("int8", zero_point=True),
    "int4 group 64": KVQuantization("int4"),
    "int4 group 64, zero point (mlx-lm)": KVQuantization("int4", zero_point=True),
    "int4 group 64, zero point, residual 128": KVQuantization("int4", zero_point=True,
                                                              residual=128),
    "fp8 e4m3 tensor": KVQuantization("float8_e4m3"),
    "fp8 e4m3 head": KVQuantization("float8_e4m3", granularity="head"),
    "fp8 e5m2 tensor": KVQuantization("float8_e5m2"),
}
BACKENDS = {"numpy_attn": (numpy_attn, np.asarray, numpy_decode_step),
            "torch_attn": (torch_attn, torch.from_numpy, torch_decode_step)}


def _inputs(tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((1, KV_HEADS, tokens, HEAD_DIM)).astype(np.float32)
    values = rng.standard_normal((1, KV_HEADS, tokens, HEAD_DIM)).astype(np.float32)
    query = rng.standard_normal((1, HEADS, 1, HEAD_DIM)).astype(np.float32)
    new_key = rng.standard_normal((1, KV_HEADS, 1, HEAD_DIM)).astype(np.float32)
    new_value = rng.standard_normal((1, KV_HEADS, 1, HEAD_DIM)).astype(np.float32)
    return keys, values, query, new_key, new_value


def _errors(keys, values, query) -> dict[str, tuple[float, float]]:
    """``{scheme: (relative error of the output, max |key error|)}`` (numpy_attn)."""
    want = numpy_attn.scaled_dot_product_attention(query, keys, values)
    errors = {}
    for name, scheme in SCHEMES.items():
        cache = numpy_attn.QuantizedKVCache.empty((1,), KV_HEADS, keys.shape[-2], HEAD_DIM,
                                                  scheme=scheme)
        cache.append(keys, values)
        got = cache.attend(query)
        errors[name] = (float(np.linalg.norm(got - want) / np.linalg.norm(want)),
                        float(np.abs(cache.keys - keys).max()))
    return errors


def _decode_times(keys, values, query, new_key, new_value, rounds: int
                  ) -> dict[tuple[str, str], float]:
    """Median seconds of one step (append a token, attend one query), per backend and scheme
    (``"float32 KVCache"`` the baseline)."""
    runs = {}
    tokens = keys.shape[-2]
    for backend, (module, convert, decode_step) in BACKENDS.items():
        k, v, q, nk, nv = map(convert, (keys, values, query, new_key, new_value))
        max_len = tokens + rounds + 4
        base = module.KVCache.empty((1,), KV_HEADS, max_len, HEAD_DIM).append(k, v)

        def float_step(base=base, q=q, nk=nk, nv=nv, decode_step=decode_step):
            decode_step(q, nk, nv, base, None)

        runs[(backend, "float32 KVCache")] = float_step
        for name, scheme in SCHEMES.items():
            cache = module.QuantizedKVCache.empty((1,), KV_HEADS, max_len, HEAD_DIM,
                                                  scheme=scheme).append(k, v)

            def step(cache=cache, q=q, nk=nk, nv=nv):
                cache.append(nk, nv).attend(q)

            runs[(backend, name)] = step
    with torch.no_grad():
        times = interleaved(runs, rounds)
    return {key: statistics.median(values) for key, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args(argv)
    keys, values, query, new_key, new_value = _inputs(args.tokens)
    errors = _errors(keys, values, query)
    times = _decode_times(keys, values, query, new_key, new_value, args.rounds)
    float_bytes = 2 * KV_HEADS * HEAD_DIM * 4
    print(f"batch 1, {KV_HEADS} kv heads, {HEADS} heads, {args.tokens} tokens, head_dim "
          f"{HEAD_DIM}, float32; decode: median of {args.rounds} rounds, torch threads "
          f"{torch.get_num_threads()}")
    print()
    print("| scheme | rel. error | key max err | bytes/token/layer | vs float32 | "
          "numpy decode ms (× float32) | torch decode ms (× float32) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = [("float32 KVCache", None)] + list(SCHEMES.items())
    for name, scheme in rows:
        if scheme is None:
            error, key_error, nbytes = "0", "0", float_bytes
        else:
            error, key_error = (f"{e:.2e}" for e in errors[name])
            nbytes = 2 * bytes_per_token(scheme, KV_HEADS, HEAD_DIM)
        cells = []
        for backend in BACKENDS:
            t, base = times[(backend, name)], times[(backend, "float32 KVCache")]
            cells.append(f"{t * 1e3:.2f} ({t / base:.2f}×)")
        print(f"| {name} | {error} | {key_error} | {nbytes:,.0f} | {nbytes / float_bytes:.3f} | "
              f"{cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
