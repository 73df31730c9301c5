"""jax_attn inside a Flax NNX model: same logits, same greedy tokens as Flax's own attention.

A small causal language model made of ``nnx.MultiHeadAttention`` layers is built with seeded
random weights, once with Flax's ``nnx.dot_product_attention`` and once with jax_attn
(``jax_attn.integrations.flax.use_jax_attn(model)``), and run on the same left-padded batch of
two prompts. The script prints the largest logit difference at the real tokens (a padding query
attends no key: Flax gives it the mean of the values, jax_attn 0), the 20 greedily generated
tokens of each, and each one's generation speed in tokens per second (median of 3 interleaved
rounds). Generation recomputes the whole sequence, padded to its final length, at every step
with one jitted forward pass, so each model compiles once.

Run: ``python examples/flax_nnx.py [--new-tokens 20]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jax_attn.integrations.flax import use_jax_attn  # noqa: E402

VOCAB, DIM, HEADS, LAYERS, PROMPT = 128, 64, 4, 2, 12


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, rngs: nnx.Rngs):
        self.attention = nnx.MultiHeadAttention(HEADS, DIM, decode=False, rngs=rngs)
        self.norm1, self.norm2 = nnx.LayerNorm(DIM, rngs=rngs), nnx.LayerNorm(DIM, rngs=rngs)
        self.mlp = nnx.Linear(DIM, DIM, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm1(x), mask=mask)  # (batch, seq, dim)
        return x + jax.nn.gelu(self.mlp(self.norm2(x)))


class TinyLM(nnx.Module):
    """Token ids ``(batch, seq)`` (0 = padding) → logits ``(batch, seq, VOCAB)``."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        mask = nnx.make_attention_mask(tokens > 0, tokens > 0)  # (batch, 1, seq, seq)
        mask = nnx.combine_masks(mask, nnx.make_causal_mask(tokens))
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


@nnx.jit
def forward(model: TinyLM, tokens: jax.Array) -> jax.Array:
    return model(tokens)


def prompts() -> tuple[np.ndarray, np.ndarray]:
    """Token ids ``(2, PROMPT)``, the second prompt left-padded by 5, and the real-token mask."""
    tokens = np.random.default_rng(1).integers(1, VOCAB, (2, PROMPT))
    tokens[1, :5] = 0
    return tokens, tokens > 0


def padded(tokens: np.ndarray, new_tokens: int) -> np.ndarray:
    """``tokens`` with ``new_tokens`` zeros on the right: every forward pass has this length,
    so each model compiles once (the causal mask hides the zeros from the tokens before)."""
    return np.pad(tokens, ((0, 0), (0, new_tokens))).astype(np.int32)


def generate(model: TinyLM, tokens: np.ndarray, new_tokens: int) -> np.ndarray:
    """Greedy tokens ``(batch, new_tokens)``: each step the argmax over the real tokens
    1..VOCAB-1 at the last position so far."""
    length = tokens.shape[1]
    buffer = padded(tokens, new_tokens)
    for t in range(length, length + new_tokens):
        logits = forward(model, jnp.asarray(buffer))  # (batch, seq, vocab)
        buffer[:, t] = np.asarray(jnp.argmax(logits[:, t - 1, 1:], -1)) + 1  # never 0 (padding)
    return buffer[:, length:]


def run(new_tokens: int = 20, rounds: int = 3) -> dict[str, dict]:
    """Logits, greedy tokens and tokens/s (median of ``rounds`` interleaved rounds) with Flax's
    attention and with jax_attn.

    Returns:
      ``{"max_logit_diff": float, "tokens": {name: (2, new_tokens) list},
      "tokens_per_s": {name: float}}``; the difference is at the real tokens.
    """
    tokens, real = prompts()
    models = {"flax": TinyLM(nnx.Rngs(0))}
    models["jax_attn"] = nnx.clone(models["flax"])
    assert use_jax_attn(models["jax_attn"]) == LAYERS
    logits, generated, rates = {}, {}, {name: [] for name in models}
    for name, model in models.items():
        logits[name] = np.asarray(forward(model, jnp.asarray(padded(tokens, new_tokens))))
        logits[name] = logits[name][:, :PROMPT]  # (batch, PROMPT, VOCAB); compiled now
    for round_ in range(rounds + 1):  # interleaved rounds; round 0 warms up
        for name, model in models.items():
            start = time.perf_counter()
            generated[name] = generate(model, tokens, new_tokens).tolist()
            if round_:
                rates[name].append(tokens.shape[0] * new_tokens / (time.perf_counter() - start))
    speed = {name: statistics.median(rates[name]) for name in models}
    diff = float(np.abs(logits["jax_attn"] - logits["flax"])[real].max())
    return {"max_logit_diff": diff, "tokens": generated, "tokens_per_s": speed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=20)
    args = parser.parse_args()
    result = run(args.new_tokens)
    print(f"max |logits(jax_attn) - logits(flax)| at real tokens: {result['max_logit_diff']:.2e}")
    for name in ("flax", "jax_attn"):
        print(f"{name:>9}: {result['tokens_per_s'][name]:7.1f} tokens/s")
        for row in result["tokens"][name]:
            print(f"{'':>11}{row}")
    print("greedy tokens identical:", result["tokens"]["flax"] == result["tokens"]["jax_attn"])


if __name__ == "__main__":
    main()
