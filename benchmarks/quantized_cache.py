"""Quantised KV caches: the error each scheme costs, the memory it saves, and one decoding step's
time, next to the float32 ``KVCache`` (``conformance/spec/quantized_cache.py``).

Seeded inputs: batch 1, 8 kv heads, 8 query heads, head_dim 128, float32 (keys and values
unit normal, one query token), cached tokens as ``--tokens`` says (the errors at the first
length). For each scheme:

* ``rel. error``: ``‖o - o_f32‖ / ‖o_f32‖`` of the attention output over the quantised cache
  against the output over the float32 keys and values (``QuantizedKVCache.attend``, numpy_attn);
* ``key max err``: the largest ``|k - dequantised k|``;
* ``bytes/token/layer``: keys and values of one token in the quantised store
  (``attention_rules.quantizing.bytes_per_token``; int4 as packed 4-bit codes, what a packed
  kernel stores; this project stores int4 codes unpacked, one per byte: the int8 figure), and
  its ratio to float32's 8,192;
* ``decode``: one decoding step (append one token, attend one query over ``tokens + 1``):
  median of interleaved rounds, numpy_attn, torch_attn and jax_attn, the ratio to the float32
  ``KVCache`` step of the same backend (``kv_cache.decode_step``) in the same run. ``attend``
  dequantises a part of the codes at a time inside the split-KV chunks; ``previous`` is the
  same step with the whole cache dequantised first (``cache.keys`` / ``cache.values``, then
  the float cache's attention: what ``attend`` did before), timed in rounds of its own with
  the float32 step again (its copies of the cache slow whatever runs next; in its row of the
  table, the ``previous`` cells are that float32 step); ``--no-previous`` leaves it out.

jax_attn's steps run as a decoding loop calls them, each timed until its output is ready
(``block_until_ready``): the float32 ``KVCache`` step is ``decode_step`` under ``jax.jit``
with the cache donated (XLA may reuse its buffers; the cache's length is traced, so it
compiles once and the cache grows by a token per call, as numpy_attn's and torch_attn's do);
the quantised step is ``cache.append(k, v).attend(q)`` called eagerly (the cache's lengths
are static Python ints: ``append`` runs eagerly; ``attend``'s decoding step is one jitted
program per cache shape, its lengths traced). jax's ``append`` returns a new cache, so every
round times the same lengths. An eager ``append`` that quantises into the store writes a new
store (a copy of every code and scale): most of the jax step at 32k tokens; one that joins
the residual window copies the window only (``residual 128``), so that row is close to
``attend`` alone.

Below ``SPLIT_KV["min_kv_len"]`` (8,192) keys the float32 step attends in one piece through
``scaled_dot_product_attention``, from 8,192 in split-KV chunks, as the quantised ``attend``
always does; ``--tokens 4096 32768`` (the default) gives a table for each. ``--torch-threads 1``
is steadier on a loaded machine (torch's threads wait for each other when the cores are busy).

    python benchmarks/quantized_cache.py [--rounds 7] [--tokens 4096 32768] [--torch-threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))

from timing import interleaved  # noqa: E402

import attention_rules  # noqa: E402
import jax_attn  # noqa: E402
import numpy_attn  # noqa: E402
import torch_attn  # noqa: E402
from attention_rules.quantizing import KVQuantization, bytes_per_token  # noqa: E402
from jax_attn.kv_cache import decode_step as jax_decode_step  # noqa: E402
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
            "torch_attn": (torch_attn, torch.from_numpy, torch_decode_step),
            "jax_attn": (jax_attn, jnp.asarray, jax_decode_step)}


def _previous_attend(module, cache, query):
    """The step's attention as ``QuantizedKVCache.attend`` ran it before: the whole cache
    dequantised (``cache.keys``, ``cache.values``), then split-KV or one piece."""
    keys, values = cache.keys, cache.values
    chunk = attention_rules.split_chunk(query.shape[-2], keys.shape[-2])
    if chunk is not None:
        return module.paged.split_kv_attention(query, keys, values, chunk)[0]
    return module.scaled_dot_product_attention(query, keys, values, is_causal=True,
                                               causal_alignment="bottom_right")


def _ready(x):
    """``x`` once computed: jax dispatches asynchronously, so its steps wait for their
    output (numpy and torch return finished arrays)."""
    return x.block_until_ready() if hasattr(x, "block_until_ready") else x


def _jax_float_step(cache, q, nk, nv):
    """jax_attn's float32 step as a decoding loop runs it: ``decode_step`` jitted, the cache
    donated (updated in place) and the new one kept for the next call."""
    step = jax.jit(lambda q, k, v, c: jax_decode_step(q, k, v, c, None), donate_argnums=3)
    state = [cache]

    def run():
        output, state[0] = step(q, nk, nv, state[0])
        _ready(output)

    return run


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


def _decode_times(keys, values, query, new_key, new_value, rounds: int, previous_too: bool
                  ) -> dict[tuple[str, str], float]:
    """Median seconds of one step (append a token, attend one query), per backend and scheme
    (``"float32 KVCache"`` the baseline)."""
    runs = {}
    tokens = keys.shape[-2]
    for backend, (module, convert, decode_step) in BACKENDS.items():
        k, v, q, nk, nv = map(convert, (keys, values, query, new_key, new_value))
        max_len = tokens + 2 * rounds + 4  # a step and a previous step per round
        base = module.KVCache.empty((1,), KV_HEADS, max_len, HEAD_DIM).append(k, v)

        def float_step(base=base, q=q, nk=nk, nv=nv, decode_step=decode_step):
            decode_step(q, nk, nv, base, None)

        runs[(backend, "float32 KVCache")] = (
            _jax_float_step(base, q, nk, nv) if module is jax_attn else float_step)
        for name, scheme in SCHEMES.items():
            cache = module.QuantizedKVCache.empty((1,), KV_HEADS, max_len, HEAD_DIM,
                                                  scheme=scheme).append(k, v)

            def step(cache=cache, q=q, nk=nk, nv=nv):
                _ready(cache.append(nk, nv).attend(q))

            def previous(cache=cache, q=q, nk=nk, nv=nv, module=module):
                _ready(_previous_attend(module, cache.append(nk, nv), q))

            runs[(backend, name)] = step
            runs[(backend, name, "previous")] = previous
    # the previous steps make two fresh copies of the cache per call, which slows whatever
    # runs next: they are timed in rounds of their own, beside the float32 step again
    now = {key: run for key, run in runs.items() if len(key) == 2}
    before = {key + ("previous",) if len(key) == 2 else key: run for key, run in runs.items()
              if len(key) == 3 or key[1] == "float32 KVCache"} if previous_too else {}
    with torch.no_grad():
        times = interleaved(now, rounds)
        if before:
            times.update(interleaved(before, rounds))
    return {key: statistics.median(values) for key, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    """Print the tables: errors and bytes, then the decoding step at each length."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's own choice)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--no-previous", action="store_true",
                        help="leave out the previous steps (the whole cache dequantised)")
    args = parser.parse_args(argv)
    if args.torch_threads is not None:  # one thread: steadier on a loaded machine
        torch.set_num_threads(args.torch_threads)
    float_bytes = 2 * KV_HEADS * HEAD_DIM * 4
    errors = _errors(*_inputs(args.tokens[0])[:3])
    print(f"batch 1, {KV_HEADS} kv heads, {HEADS} heads, {args.tokens[0]} tokens, head_dim "
          f"{HEAD_DIM}, float32")
    print()
    print("| scheme | rel. error | key max err | bytes/token/layer | vs float32 |")
    print("|---|---:|---:|---:|---:|")
    print(f"| float32 KVCache | 0 | 0 | {float_bytes:,} | 1.000 |")
    for name, scheme in SCHEMES.items():
        error, key_error = (f"{e:.2e}" for e in errors[name])
        nbytes = 2 * bytes_per_token(scheme, KV_HEADS, HEAD_DIM)
        print(f"| {name} | {error} | {key_error} | {nbytes:,.0f} | "
              f"{nbytes / float_bytes:.3f} |")
    for tokens in args.tokens:
        keys, values, query, new_key, new_value = _inputs(tokens)
        times = _decode_times(keys, values, query, new_key, new_value, args.rounds,
                              not args.no_previous)
        print()
        print(f"decode over {tokens + 1:,} tokens: median of {args.rounds} interleaved rounds, "
              f"torch threads {torch.get_num_threads()}; ms (× the float32 KVCache step)")
        print()
        print("| scheme | numpy attend | numpy previous | torch attend | torch previous "
              "| jax attend | jax previous |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name in ["float32 KVCache"] + list(SCHEMES):
            cells = []
            for backend in BACKENDS:
                for key in [(backend, name), (backend, name, "previous")]:
                    t = times.get(key)
                    base = times.get((backend, "float32 KVCache") + key[2:])  # its own rounds
                    cells.append("" if t is None else f"{t * 1e3:.1f} ({t / base:.2f}×)")
            print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
