"""What one token costs in the KV cache of one layer, for real model families: the numbers of
``docs/images/kv_cache_per_token.png`` and of the table in ``docs/paged_decoding.md``.

Every size comes from a formula over the model's published attention config (its
``config.json`` on the Hugging Face Hub, named in ``source``), never from a measurement:

- multi-head, grouped-query and multi-query attention cache a key and a value per kv head:
  ``2 × kv_heads × head_dim × bytes``;
- MLA run naive (K and V materialised per head, as in prefill): ``heads × (qk_nope_head_dim +
  qk_rope_head_dim + v_head_dim) × bytes``;
- MLA's latent cache (decoding in the absorbed form, ``spec.LATENT_CACHE``): ``(kv_lora_rank +
  qk_rope_head_dim) × bytes``, no values; quantised, ``bits / 8`` per number plus the scales a
  token carries (``spec.QUANTIZATION_SCHEMES``: int4 per group of 64 numbers, one float32 scale
  each; fp8 per tensor, one scale shared by every token, 0 per token).

``tests/test_learn.py`` checks these against the project's own caches: numpy_attn's
``KVCache`` buffers in bfloat16 and ``QuantizedKVCache.nbytes`` (int4 codes are stored one per
byte there, so the packed size is the stored one less half a byte per code), and
``attention_rules.quantizing.bytes_per_token``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CacheLayout:
    """One model's attention config, as far as the cache is concerned.

    ``kind``: "MHA", "GQA", "MQA" (``kv_heads × head_dim`` keys and values), "MLA naive"
    (``kv_heads`` heads of ``head_dim`` key dims and ``v_head_dim`` value dims) or "MLA" (a
    latent of ``kv_lora_rank`` plus ``rope_dim``); ``bits`` per cached number; ``group``: the
    numbers per float32 scale of a per-group quantisation (0: none per token); ``layers``: the
    model's attention layers."""

    name: str
    kind: str
    layers: int
    bits: int
    source: str
    kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    group: int = 0
    number_format: str = "bf16"


#: The models, in the picture's order (top to bottom).
MODELS: tuple[CacheLayout, ...] = (
    CacheLayout("Llama-2-7B", "MHA", 32, 16, "meta-llama/Llama-2-7b-hf config.json: "
                "num_attention_heads = num_key_value_heads = 32, hidden_size 4096 (head_dim "
                "128), 32 layers, float16", kv_heads=32, head_dim=128, number_format="fp16"),
    CacheLayout("Llama-3-8B", "GQA", 32, 16, "meta-llama/Meta-Llama-3-8B config.json: "
                "num_attention_heads 32, num_key_value_heads 8, hidden_size 4096 (head_dim "
                "128), 32 layers, bfloat16", kv_heads=8, head_dim=128),
    CacheLayout("Falcon-7B", "MQA", 32, 16, "tiiuae/falcon-7b config.json: multi_query true "
                "(1 kv head), n_head 71, hidden_size 4544 (head_dim 64), 32 layers, bfloat16",
                kv_heads=1, head_dim=64),
    CacheLayout("DeepSeek-V3", "MLA naive", 61, 16, "deepseek-ai/DeepSeek-V3 config.json: "
                "num_attention_heads 128, qk_nope_head_dim 128 + qk_rope_head_dim 64 (keys), "
                "v_head_dim 128, 61 layers: K and V materialised", kv_heads=128,
                head_dim=192, v_head_dim=128),
    CacheLayout("DeepSeek-V3", "MLA", 61, 16, "deepseek-ai/DeepSeek-V3 config.json: "
                "kv_lora_rank 512, qk_rope_head_dim 64, 61 layers; bf16 latent cache",
                kv_lora_rank=512, rope_dim=64),
    CacheLayout("DeepSeek-V3", "MLA", 61, 8, "the same latent in fp8 e4m3 with one per-tensor "
                "scale (AMD's MLA decode kernels, vLLM kv_cache_dtype='fp8')",
                kv_lora_rank=512, rope_dim=64, number_format="fp8"),
    CacheLayout("DeepSeek-V3", "MLA", 61, 4, "the same latent in int4, one float32 scale per "
                "group of 64 (mlx-lm's and transformers' group size; symmetric)",
                kv_lora_rank=512, rope_dim=64, group=64, number_format="int4"),
)


def numbers_per_token(m: CacheLayout) -> int:
    """The numbers one token caches in one layer (keys and values, or the latent)."""
    if m.kind == "MLA":
        return m.kv_lora_rank + m.rope_dim
    if m.kind == "MLA naive":
        return m.kv_heads * (m.head_dim + m.v_head_dim)
    return 2 * m.kv_heads * m.head_dim


def bytes_per_token(m: CacheLayout) -> float:
    """Bytes one token costs in one layer's cache: ``numbers × bits / 8`` (2 × kv_heads ×
    head_dim × bytes for K and V; (kv_lora_rank + rope) × bytes for MLA's latent), plus a
    float32 scale per ``group`` numbers where the scales are per group (per-tensor scales
    are shared by all tokens: 0 per token)."""
    numbers = numbers_per_token(m)
    scales = numbers // m.group * 4 if m.group else 0
    return numbers * m.bits / 8 + scales


def label(m: CacheLayout) -> str:
    """The picture's and the table's name of a row: ``"DeepSeek-V3 MLA, fp8"``."""
    if m.kind == "MLA naive":
        return f"{m.name}, naive K/V"
    if m.kind == "MLA":
        return f"{m.name} MLA, {m.number_format}"
    return f"{m.name} {m.kind}"


def config_text(m: CacheLayout) -> str:
    """The config in a few words: ``"8 kv heads × 128"``, ``"latent 512 + rope 64"``."""
    if m.kind == "MLA":
        scale = f", scale per {m.group}" if m.group else (
            ", per-tensor scale" if m.bits < 16 else "")
        return f"latent {m.kv_lora_rank} + rope {m.rope_dim}{scale}"
    if m.kind == "MLA naive":
        return f"{m.kv_heads} heads × (K {m.head_dim} + V {m.v_head_dim})"
    heads = "kv head" if m.kv_heads == 1 else "kv heads"
    return f"{m.kv_heads} {heads} × {m.head_dim}"


def _size(n: float) -> str:
    """``16384`` → ``"16 KiB"``, ``1152`` → ``"1.1 KiB"``, ``576`` → ``"576 B"``."""
    if n >= 1024 * 1024:
        return f"{n / 1024 / 1024:.3g} MiB"
    return f"{n / 1024:.3g} KiB" if n >= 1024 else f"{n:g} B"


def table() -> str:
    """The Markdown table of ``docs/paged_decoding.md``: one row per model, bytes per token
    per layer, the model's layers, the cost per token of the whole model, and the ratio to
    the first row (MHA)."""
    first = bytes_per_token(MODELS[0])
    rows = ["| model, attention | cache per token | format | bytes / token / layer | layers "
            "| per token, all layers | vs MHA |", "|---|---|---|---:|---:|---:|---:|"]
    for m in MODELS:
        b = bytes_per_token(m)
        ratio = "1×" if b == first else (f"{first / b:.3g}× less" if b < first
                                          else f"{b / first:.3g}× more")
        rows.append(f"| {label(m)} | {config_text(m)} | {m.number_format} | {b:,.0f} | "
                    f"{m.layers} | {_size(b * m.layers)} | {ratio} |")
    return "\n".join(rows)


TITLE = ("the KV cache per token and layer: MHA, GQA, MQA, MLA and quantised MLA (bytes, log "
         "scale; real models' configs)")
COLOURS = {"MHA": "#4c72b0", "GQA": "#55a868", "MQA": "#8172b2", "MLA naive": "#bbbbbb",
           "MLA": "#c44e52"}


def draw() -> Any:
    """``kv_cache_per_token.png``: one horizontal bar per model (log scale), its bytes, its
    config and its ratio to MHA written beside it."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10.0, 4.2), layout="constrained")
    sizes = [bytes_per_token(m) for m in MODELS]
    rows = list(range(len(MODELS)))[::-1]  # the first model on top
    ax.barh(rows, sizes, color=[COLOURS[m.kind] for m in MODELS], height=0.7)
    first = sizes[0]
    for y, m, b in zip(rows, MODELS, sizes, strict=True):
        ratio = "" if b == first else (f": {first / b:.3g}× less than MHA" if b < first
                                       else f": {b / first:.3g}× MHA")
        naive = [n for n in MODELS if n.kind == "MLA naive" and n.name == m.name]
        if m.kind == "MLA" and naive:
            ratio += f", {bytes_per_token(naive[0]) / b:.3g}× less than naive"
        ax.text(b * 1.08, y, f"{b:,.0f} B — {config_text(m)}, {m.number_format}{ratio}",
                va="center", fontsize=8.5)
    ax.set_yticks(rows, [label(m) for m in MODELS], fontsize=9)
    ax.set_xscale("log")
    ax.set_xlim(100, 1e7)
    ax.set_xlabel("bytes per token per layer (K and V, or MLA's latent [c ; k_pe] and its "
                  "scales)", fontsize=9)
    ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle(TITLE, fontsize=11)
    return fig


__all__ = ["MODELS", "TITLE", "CacheLayout", "bytes_per_token", "config_text", "draw", "label",
           "numbers_per_token", "table"]
