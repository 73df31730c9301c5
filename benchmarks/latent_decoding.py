"""Latent attention: decoding one token over a 32k latent cache (the absorbed form) against the
naive form over the materialised keys and values of the same model
(``MultiHeadLatentAttention``, ``conformance/spec/latent_attention.py``).

DeepSeek-V3's head shapes with fewer heads, to fit two cores: 16 heads, kv_lora_rank 512,
qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, d_model 1,024, no q_lora_rank,
batch 1, float32, ``--tokens`` (32,768) cached tokens. Both caches hold the same tokens: seeded
latents ``c`` (unit normal, the RMS a normalised latent has) and rotated keys ``k_pe``; the naive
cache holds their up-projections through ``kv_b_proj``, so the two forms compute the same output
(the table prints the largest difference of the first step's outputs, relative to their
largest value).

* ``absorbed``: ``MultiHeadLatentAttention.decode`` over the latent ``KVCache`` (one kv head
  of ``kv_lora_rank + qk_rope_head_dim`` = 576 dims, values a view of the keys' first 512):
  split-KV attention with 16 query rows per chunk;
* ``naive``: the same projections, ``kv_b_proj``'s per-head keys ``(16, 192)`` and values
  ``(16, 128)`` of the new token appended to a ``KVCache`` of the materialised keys and values,
  ``kv_cache.decode_step`` (split-KV, one query row per head), ``o_proj``.

Columns: ``ms/token``, one step (append and attend one token, the layer's projections
included), median of interleaved rounds, with the naive step's time over the absorbed one's in
the same run; ``attention ms`` the attention call alone (``split_kv_attention`` over the
cache, no projections); ``cache MiB``, the cache's buffers for ``--tokens`` positions;
``bytes read/token``, the cache bytes one step reads per cached token: naive 16 heads × (192 +
128) × 4; absorbed 576 × 4 for the scores and 512 × 4 again for the values (the split-KV
kernels read a chunk's keys, then its values: 4,096 tokens of 2,304 bytes do not stay in a
CPU's L2 cache between the two); ``GFLOP``, the attention's multiply-adds × 2 per step.

    python benchmarks/latent_decoding.py [--rounds 7] [--tokens 32768] [--torch-threads N]
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
from attention_rules import default_scale, split_chunk  # noqa: E402
from numpy_attn.kv_cache import decode_step as numpy_decode_step  # noqa: E402
from numpy_attn.paged import split_kv_attention as numpy_split_kv  # noqa: E402
from torch_attn.kv_cache import decode_step as torch_decode_step  # noqa: E402
from torch_attn.paged import split_kv_attention as torch_split_kv  # noqa: E402

D_MODEL, HEADS, RANK, ROPE, NOPE, V_DIM = 1024, 16, 512, 64, 128, 128
LATENT, QK = RANK + ROPE, NOPE + ROPE
BACKENDS = {"numpy_attn": (numpy_attn, numpy_decode_step, numpy_split_kv),
            "torch_attn": (torch_attn, torch_decode_step, torch_split_kv)}


def _model_and_cache(tokens: int) -> tuple[dict, np.ndarray, np.ndarray]:
    """Seeded weights (transformers' names), the latent keys ``(1, 1, tokens, 576)`` and the
    new token ``x (1, 1, d_model)``."""
    model = numpy_attn.MultiHeadLatentAttention(
        D_MODEL, HEADS, kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=V_DIM, rng=np.random.default_rng(0))
    rng = np.random.default_rng(1)
    latent = rng.standard_normal((1, 1, tokens, LATENT), dtype=np.float32)  # [c ; k_pe]
    x = rng.standard_normal((1, 1, D_MODEL), dtype=np.float32)
    return model.export_weights(), latent, x


def _naive_kv(weights: dict, latent: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The materialised keys ``(1, heads, tokens, 192)`` and values ``(1, heads, tokens,
    128)`` of ``latent``: ``c @ kv_b_projᵀ`` per head, ``k_pe`` repeated for every head."""
    c, k_pe = torch.from_numpy(latent[..., :RANK]), torch.from_numpy(latent[..., RANK:])
    kv = c[:, 0] @ torch.from_numpy(weights["kv_b_proj.weight"]).T  # (1, tokens, heads·256)
    kv = kv.unflatten(-1, (HEADS, NOPE + V_DIM)).transpose(1, 2)  # (1, heads, tokens, 256)
    keys = torch.cat([kv[..., :NOPE], k_pe.expand(-1, HEADS, -1, -1)], dim=-1)
    return keys, kv[..., NOPE:]


def _steps(backend: str, weights: dict, latent: np.ndarray, keys: torch.Tensor,
           values: torch.Tensor, x: np.ndarray, rounds: int) -> tuple[dict, float]:
    """The four timed calls of one backend and the first step's relative difference."""
    module, decode_step, split_kv = BACKENDS[backend]
    convert = np.asarray if backend == "numpy_attn" else torch.from_numpy
    tokens = latent.shape[-2]
    max_len = tokens + rounds + 4  # a step appends one token
    model = module.MultiHeadLatentAttention(
        D_MODEL, HEADS, kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=V_DIM).load_weights(weights)
    latent_cache = module.KVCache.empty((1,), 1, max_len, LATENT, 0).append(
        convert(latent), convert(np.zeros(latent.shape[:-1] + (0,), np.float32)))
    naive_cache = module.KVCache.empty((1,), HEADS, max_len, QK, V_DIM)
    naive_cache.append(convert(keys.numpy()), convert(values.numpy()))
    x = convert(x)
    ratio = model.scale / default_scale(QK)  # the module's softmax scale, in the query

    def absorbed() -> object:
        return model.decode(x, latent_cache)[0]

    def naive() -> object:
        # the naive form's projections (the module's own steps), then the materialised cache
        stages = model._stages(x, convert(np.array([naive_cache.length])))
        query, key, value = model._naive(stages)
        context, _ = decode_step(query * ratio, key, value, naive_cache, None)
        return model._out(context)

    want, got = np.asarray(naive()), np.asarray(absorbed())  # both at position ``tokens``
    first = np.abs(got - want).max() / np.abs(want).max()
    q_latent = convert(np.random.default_rng(2).standard_normal((1, HEADS, 1, LATENT),
                                                                dtype=np.float32))
    q_naive = convert(np.random.default_rng(2).standard_normal((1, HEADS, 1, QK),
                                                               dtype=np.float32))
    chunk = split_chunk(1, tokens)  # one query token: split-KV from SPLIT_KV["min_kv_len"]
    keys_l = latent_cache.keys
    keys_n, values_n = naive_cache.keys, naive_cache.values
    runs = {
        (backend, "naive step"): naive,
        (backend, "absorbed step"): absorbed,
        (backend, "naive attention"): lambda: split_kv(q_naive, keys_n, values_n, chunk),
        (backend, "absorbed attention"): lambda: split_kv(q_latent, keys_l,
                                                          keys_l[..., :RANK], chunk),
    }
    return runs, float(first)


def main(argv: list[str] | None = None) -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's own choice)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=32768)
    args = parser.parse_args(argv)
    if args.torch_threads is not None:  # one thread: steadier on a loaded machine
        torch.set_num_threads(args.torch_threads)
    weights, latent, x = _model_and_cache(args.tokens)
    keys, values = _naive_kv(weights, latent)
    runs, differences = {}, {}
    with torch.no_grad():
        for backend in BACKENDS:
            backend_runs, differences[backend] = _steps(backend, weights, latent, keys, values,
                                                        x, args.rounds)
            runs.update(backend_runs)
        del keys, values
        times = {key: statistics.median(t) for key, t in interleaved(runs, args.rounds).items()}
    t = args.tokens
    forms = {  # cache bytes per token, bytes read per cached token per step, attention GFLOP
        "naive": (HEADS * (QK + V_DIM) * 4, HEADS * (QK + V_DIM) * 4,
                  2 * HEADS * t * (QK + V_DIM) / 1e9),
        "absorbed": (LATENT * 4, (LATENT + RANK) * 4, 2 * HEADS * t * (LATENT + RANK) / 1e9),
    }
    print(f"MLA decoding, batch 1, {t:,} cached tokens, {HEADS} heads, kv_lora_rank {RANK}, "
          f"qk_rope_head_dim {ROPE}, qk_nope_head_dim {NOPE}, v_head_dim {V_DIM}, d_model "
          f"{D_MODEL}, float32; median of {args.rounds} interleaved rounds, torch threads "
          f"{torch.get_num_threads()}")
    print()
    print("| backend | form | ms/token | naive ÷ absorbed | attention ms | cache MiB | "
          "bytes read/token | attention GFLOP | first step max diff (rel.) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for backend in BACKENDS:
        for form, (cache_bytes, read_bytes, gflop) in forms.items():
            step = times[(backend, f"{form} step")]
            ratio = step / times[(backend, "absorbed step")]
            attention = times[(backend, f"{form} attention")]
            print(f"| {backend} | {form} | {step * 1e3:.1f} | {ratio:.2f}× | "
                  f"{attention * 1e3:.1f} | {cache_bytes * t / 2**20:,.0f} | {read_bytes:,} | "
                  f"{gflop:.2f} | {differences[backend]:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
