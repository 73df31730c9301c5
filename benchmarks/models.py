"""Benchmark: torch_attn inside a transformers Llama next to transformers' own ``sdpa``.

    python benchmarks/models.py [--prefill 2048] [--prompt 128] [--new-tokens 64] [--repeats 5]
                                [--threads N]

The model: a small Llama built from a config with seeded random weights (hidden 512, 4 layers,
8 query heads over 2 key/value heads of 64 dimensions, MLP 1,408, vocabulary 8,192; 23 M
parameters; float32; nothing is downloaded), once per attention implementation with the same
weights. Two measurements, each a ratio to ``sdpa`` within one run:

* prefill: one forward pass over ``--prefill`` tokens (batch 1, no padding), no gradient;
* decoding: greedy ``generate`` of ``--new-tokens`` tokens after a ``--prompt``-token prompt
  (batch 1, KV cache), reported as tokens per second of the whole call.

``eager`` runs too, as the reference the tests compare with. The implementations run
interleaved, round after round (``--repeats`` rounds after one warm-up round; who goes first
rotates), so load on a shared machine affects them alike; the table gives the median of each
and the median over rounds of its ratio to ``sdpa`` in the same round (time ratio for prefill:
< 1 is faster; tokens/s ratio for decoding: > 1 is faster). The generated tokens of every
implementation are checked to be identical.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch_attn.integrations import transformers as hf  # noqa: E402

IMPLEMENTATIONS = ("sdpa", hf.register(), "eager")  # the first is the baseline


def build(attn_implementation: str) -> torch.nn.Module:
    """The seeded small Llama in float32, evaluation mode."""
    config = LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.eval()


def prefill_seconds(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """Seconds for one forward pass over ``ids`` ``(1, T)`` without a gradient."""
    with torch.no_grad():
        start = time.perf_counter()
        model(input_ids=ids, use_cache=False)
        return time.perf_counter() - start


def decode_rate(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int
                ) -> tuple[float, list[int]]:
    """Tokens per second of greedy ``generate`` (KV cache), and the tokens."""
    start = time.perf_counter()
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - start
    return new_tokens / seconds, out[0, prompt.shape[1]:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: "
                        "torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    models = {impl: build(impl) for impl in IMPLEMENTATIONS}
    generator = torch.Generator().manual_seed(1)
    long_ids = torch.randint(1, 8192, (1, args.prefill), generator=generator)
    prompt = torch.randint(1, 8192, (1, args.prompt), generator=generator)
    prefill = {impl: [] for impl in IMPLEMENTATIONS}
    decode = {impl: [] for impl in IMPLEMENTATIONS}
    tokens = {}
    for round_ in range(args.repeats + 1):  # round 0 warms up
        order = IMPLEMENTATIONS[round_ % 3:] + IMPLEMENTATIONS[:round_ % 3]  # who goes first
        for impl in order:
            seconds = prefill_seconds(models[impl], long_ids)
            rate, tokens[impl] = decode_rate(models[impl], prompt, args.new_tokens)
            if round_:
                prefill[impl].append(seconds)
                decode[impl].append(rate)
    same = all(tokens[impl] == tokens["sdpa"] for impl in IMPLEMENTATIONS)
    print(f"torch {torch.__version__}, {platform.machine()}, "
          f"{torch.get_num_threads()} threads, {args.repeats} rounds, medians")
    print(f"greedy tokens identical across implementations: {same}\n")
    print(f"| implementation | prefill {args.prefill} tokens (ms) | ratio to sdpa "
          f"| decoding (tokens/s) | ratio to sdpa |")
    print("|---|---|---|---|---|")
    for impl in IMPLEMENTATIONS:  # ratios: the median of the per-round ratios
        p_ratio = statistics.median(
            a / b for a, b in zip(prefill[impl], prefill["sdpa"], strict=True))
        d_ratio = statistics.median(
            a / b for a, b in zip(decode[impl], decode["sdpa"], strict=True))
        p, d = statistics.median(prefill[impl]), statistics.median(decode[impl])
        print(f"| {impl} | {1000 * p:.0f} | {p_ratio:.2f} | {d:.1f} | {d_ratio:.2f} |")


if __name__ == "__main__":
    main()
