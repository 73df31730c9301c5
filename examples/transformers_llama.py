"""torch_attn inside a Hugging Face transformers Llama: same logits, same greedy tokens.

A small Llama (grouped-query heads) is built from a config with seeded random weights (nothing
is downloaded) and run three times on the same left-padded batch of two prompts: with
torch_attn (``torch_attn.integrations.transformers.register()``), with transformers' ``eager``
attention and with its ``sdpa`` attention. The script prints the largest logit difference from
``eager`` at the real tokens (padding positions attend no key: eager gives them the mean of the
values, torch_attn and sdpa 0), the 20 greedily generated tokens of each (KV cache), and each
one's generation speed in tokens per second (median of 3 interleaved rounds).

Run: ``python examples/transformers_llama.py [--new-tokens 20]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch_attn.integrations import transformers as hf  # noqa: E402

IMPLEMENTATIONS = (hf.register(), "eager", "sdpa")


def build(attn_implementation: str, hidden_size: int = 64, layers: int = 2):
    """The seeded Llama (vocab 128, 4 query heads over 2 key/value heads) in float32."""
    config = LlamaConfig(
        vocab_size=128, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, initializer_range=0.2, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.eval()


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(2, 12)`` and the attention mask: the second prompt is left-padded by 5."""
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    return ids.masked_fill(mask == 0, 0), mask


def run(new_tokens: int = 20, hidden_size: int = 64, layers: int = 2, rounds: int = 3
        ) -> dict[str, dict]:
    """Logits, greedy tokens and tokens/s (median of ``rounds`` interleaved rounds) of each
    implementation.

    Returns:
      ``{"max_logit_diff": {impl: float}, "tokens": {impl: (2, new_tokens) list},
      "tokens_per_s": {impl: float}}``; differences are from ``eager`` at the real tokens.
    """
    ids, mask = prompts()
    models = {impl: build(impl, hidden_size, layers) for impl in IMPLEMENTATIONS}
    logits, tokens, rates = {}, {}, {impl: [] for impl in IMPLEMENTATIONS}
    for impl, model in models.items():
        with torch.no_grad():
            logits[impl] = model(input_ids=ids, attention_mask=mask).logits
    generate = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    for round_ in range(rounds + 1):  # interleaved rounds; round 0 warms up
        for impl, model in models.items():
            start = time.perf_counter()
            out = model.generate(**generate)
            if round_:
                rates[impl].append(ids.shape[0] * new_tokens / (time.perf_counter() - start))
            tokens[impl] = out[:, ids.shape[1]:].tolist()
    speed = {impl: statistics.median(rates[impl]) for impl in IMPLEMENTATIONS}
    real = mask.bool()
    diff = {impl: (logits[impl] - logits["eager"])[real].abs().max().item()
            for impl in IMPLEMENTATIONS}
    return {"max_logit_diff": diff, "tokens": tokens, "tokens_per_s": speed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=20)
    args = parser.parse_args()
    result = run(args.new_tokens)
    for impl in IMPLEMENTATIONS:
        print(f"{impl:>10}: max |logits - eager| = {result['max_logit_diff'][impl]:.2e}   "
              f"{result['tokens_per_s'][impl]:7.1f} tokens/s")
        for row in result["tokens"][impl]:
            print(f"{'':>12}{row}")
    same = all(result["tokens"][impl] == result["tokens"]["eager"] for impl in IMPLEMENTATIONS)
    print("greedy tokens identical:", same)


if __name__ == "__main__":
    main()
