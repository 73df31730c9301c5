"""One training step on a packed batch with ``varlen_attention`` equals the padded batch's step.

Training packs documents of different lengths into one stream of tokens instead of padding each
to the longest: no work on padding, and attention is kept inside each document by cumulative
sequence offsets (``cu_seq``). This example takes one batch of 5 sequences (lengths 7, 3, 12,
1, 9: 32 tokens; padded, 5 × 12 = 60 positions) through the same tiny causal language model
twice, with the same weights:

* **padded** (the reference): ids ``(5, 12)`` right-padded, torch's own
  ``torch.nn.functional.scaled_dot_product_attention`` with a boolean mask ``(5, 1, 12, 12)``
  (causal, and the key is a real token); the loss leaves out every padding position;
* **packed**: the 32 tokens in one row, ``torch_attn.varlen_attention(q, k, v, cu_seq, cu_seq,
  12, 12, window_size=(-1, 0), enable_gqa=True)`` (``(-1, 0)``: causal within each sequence);
  with JAX installed, the same model written in ``jax.numpy`` around
  ``jax_attn.varlen_attention``, differentiated by ``jax.value_and_grad``.

The model: token embeddings plus learned position embeddings counted from each sequence's
start (position ids restart at 0 in the packed row), 2 pre-norm blocks (RMSNorm, grouped-query
attention with 4 query heads and 2 key/value heads, a SiLU MLP), a final RMSNorm and an output
projection; seeded weights drawn in float64. The loss is the mean next-token cross-entropy over
the predictions inside the sequences (27 of them: a sequence of length n makes n - 1), so in the
packed row no prediction crosses from one sequence into the next.

What is checked (``run()``; ``tests/test_packed_training.py``): the loss and every parameter's
gradient of the packed step against the padded float64 step, under the spec's tolerance rule
``|x - ref| <= atol + rtol·|ref| + k·e`` (``conformance.comparing.compare.bound``; float64:
``e = 0``; float32: ``e`` the padded float32 step's own error). A planted bug, offsets off by one
(the boundary between the second and third sequences moved one token), must fail it.

Run: ``python examples/packed_training.py [--no-jax]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch_attn  # noqa: E402
from conformance.comparing import compare  # noqa: E402

LENGTHS = (7, 3, 12, 1, 9)
VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS = 40, 32, 4, 2, 8, 64, 2
MAX_LEN = max(LENGTHS)


def make_batch(lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> dict[str, Any]:
    """One batch in both layouts.

    Returns:
      ``padded_ids (batch, max_len)`` int64 (0 after each sequence's end), ``real (batch,
      max_len)`` bool, ``packed_ids (total,)``, ``positions (total,)`` (restarting at 0 per
      sequence), ``cu_seq (batch + 1,)`` int32 offsets, ``max_len`` and ``lengths``.
    """
    generator = torch.Generator().manual_seed(seed)
    max_len = max(lengths)
    real = torch.arange(max_len) < torch.tensor(lengths)[:, None]
    padded = torch.randint(1, VOCAB, (len(lengths), max_len), generator=generator)
    padded = padded.masked_fill(~real, 0)
    cu_seq = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seq[1:] = torch.tensor(lengths).cumsum(0)
    return {"padded_ids": padded, "real": real, "packed_ids": padded[real],
            "positions": torch.arange(max_len).expand(len(lengths), -1)[real],
            "cu_seq": cu_seq, "max_len": max_len, "lengths": tuple(lengths)}


class TinyLM(torch.nn.Module):
    """A 2-block causal language model whose attention is a callable, so one set of weights
    runs padded (``(batch, seq, ...)``) or packed (``(total, ...)``) tokens.

    Args:
      seed: the weights are drawn from a ``torch.Generator`` seeded with it, in float64 (cast with
        ``.to(dtype)``: every dtype holds the same numbers).
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)

        def weight(*shape: int, scale: float = 0.3) -> torch.nn.Parameter:
            return torch.nn.Parameter(
                scale * torch.randn(shape, generator=generator, dtype=torch.float64))

        self.embed, self.position = weight(VOCAB, DIM, scale=1.0), weight(MAX_LEN, DIM)
        self.blocks = torch.nn.ModuleList()
        for _ in range(LAYERS):
            block = torch.nn.ParameterDict({
                "norm1": weight(DIM, scale=0.1), "wq": weight(DIM, HEADS * HEAD_DIM),
                "wk": weight(DIM, KV_HEADS * HEAD_DIM), "wv": weight(DIM, KV_HEADS * HEAD_DIM),
                "wo": weight(HEADS * HEAD_DIM, DIM), "norm2": weight(DIM, scale=0.1),
                "w1": weight(DIM, HIDDEN), "w2": weight(HIDDEN, DIM)})
            self.blocks.append(block)
        self.norm, self.head = weight(DIM, scale=0.1), weight(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                ) -> torch.Tensor:
        """Logits ``(..., vocab)`` for ids and positions ``(...)`` (``(batch, seq)`` or
        ``(total,)``); ``attend(q (..., heads, head_dim), k, v (..., kv_heads, head_dim))``
        returns ``(..., heads, head_dim)``."""
        x = self.embed[ids] + self.position[positions]
        for block in self.blocks:
            h = _rms(x, block["norm1"])
            q = (h @ block["wq"]).unflatten(-1, (HEADS, HEAD_DIM))
            k = (h @ block["wk"]).unflatten(-1, (KV_HEADS, HEAD_DIM))
            v = (h @ block["wv"]).unflatten(-1, (KV_HEADS, HEAD_DIM))
            x = x + attend(q, k, v).flatten(-2) @ block["wo"]
            x = x + torch.nn.functional.silu(_rms(x, block["norm2"]) @ block["w1"]) @ block["w2"]
        return _rms(x, self.norm) @ self.head


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm with a ``1 + weight`` gain."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + weight)


def padded_loss(model: TinyLM, batch: dict[str, Any]) -> torch.Tensor:
    """The padded step's loss: torch's own SDPA with a boolean ``(batch, 1, seq, seq)`` mask
    (causal and real keys), mean cross-entropy over the predictions inside the sequences."""
    real = batch["real"]
    length = real.shape[1]
    allowed = torch.ones(length, length, dtype=torch.bool).tril() & real[:, None, None, :]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed,
            enable_gqa=True)  # (batch, heads, seq, head_dim)
        return out.transpose(1, 2)

    positions = torch.arange(length).expand_as(real)
    logits = model(batch["padded_ids"], positions, attend)  # (batch, seq, vocab)
    predicts = real[:, 1:]  # position t predicts token t + 1 of the same sequence
    return torch.nn.functional.cross_entropy(logits[:, :-1][predicts],
                                             batch["padded_ids"][:, 1:][predicts])


def packed_loss(model: TinyLM, batch: dict[str, Any], cu_seq: torch.Tensor | None = None,
                ) -> torch.Tensor:
    """The packed step's loss: ``torch_attn.varlen_attention`` over the ``(total,)`` tokens
    with ``cu_seq`` (default: the batch's; a wrong one plants a bug), the same predictions."""
    cu_seq = batch["cu_seq"] if cu_seq is None else cu_seq
    max_len = int((cu_seq[1:] - cu_seq[:-1]).max())

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch_attn.varlen_attention(q, k, v, cu_seq, cu_seq, max_len, max_len,
                                           window_size=(-1, 0), enable_gqa=True)

    ids = batch["packed_ids"]
    logits = model(ids, batch["positions"], attend)  # (total, vocab)
    predicts = _packed_predictions(batch)
    return torch.nn.functional.cross_entropy(logits[:-1][predicts], ids[1:][predicts])


def _packed_predictions(batch: dict[str, Any]) -> torch.Tensor:
    """``(total - 1,)`` bool: token t predicts token t + 1 (not the last of its sequence)."""
    last = batch["cu_seq"][1:].long() - 1
    keep = torch.ones(len(batch["packed_ids"]), dtype=torch.bool)
    keep[last[last >= 0]] = False
    return keep[:-1]


def step(model: TinyLM, loss_fn: Callable[..., torch.Tensor], *args: Any,
         ) -> tuple[float, dict[str, np.ndarray]]:
    """One training step's loss and every parameter's gradient (float64 NumPy, by name)."""
    model.zero_grad()
    loss = loss_fn(model, *args)
    loss.backward()
    return loss.item(), {name: p.grad.double().numpy().copy()
                         for name, p in model.named_parameters()}


def worst(actual: tuple[float, dict], expected: tuple[float, dict], dtype: str,
          baseline: tuple[float, dict] | None = None) -> float:
    """The worst ``|actual - expected| / bound`` over the loss and every gradient (pass: at
    most 1). ``baseline``: a step whose error against ``expected`` is each entry's ``e``."""
    ratios = []
    for name in ["loss", *expected[1]]:
        def pick(result: tuple[float, dict]) -> np.ndarray:
            return np.float64(result[0]) if name == "loss" else result[1][name]  # noqa: B023

        ref = pick(expected)
        e = 0.0 if baseline is None else float(np.max(np.abs(pick(baseline) - ref)))
        bound = compare.bound(np.asarray(ref), e, dtype)
        ratios.append(float(np.max(np.abs(pick(actual) - ref) / bound)))
    return max(ratios)


def jax_step(model: TinyLM, batch: dict[str, Any], dtype: str) -> tuple[float, dict]:
    """The packed step in JAX: the same model in ``jax.numpy`` (the torch model's weights)
    around ``jax_attn.varlen_attention``, loss and gradients by ``jax.value_and_grad`` (x64
    on inside this call only, so float64 stays float64)."""
    import jax
    import jax.numpy as jnp

    import jax_attn

    cu_seq = batch["cu_seq"].numpy()  # host offsets: the grouped path
    ids, positions = batch["packed_ids"].numpy(), batch["positions"].numpy()
    predicts = _packed_predictions(batch).numpy()
    inputs, targets = np.flatnonzero(predicts), np.flatnonzero(predicts) + 1

    def rms(x: Any, weight: Any) -> Any:
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * (1 + weight)

    def loss(params: dict) -> Any:
        x = params["embed"][ids] + params["position"][positions]
        for i in range(LAYERS):
            p = {name[len(f"blocks.{i}."):]: w for name, w in params.items()
                 if name.startswith(f"blocks.{i}.")}
            h = rms(x, p["norm1"])
            q = (h @ p["wq"]).reshape(-1, HEADS, HEAD_DIM)
            k = (h @ p["wk"]).reshape(-1, KV_HEADS, HEAD_DIM)
            v = (h @ p["wv"]).reshape(-1, KV_HEADS, HEAD_DIM)
            out = jax_attn.varlen_attention(q, k, v, cu_seq, cu_seq, MAX_LEN, MAX_LEN,
                                            window_size=(-1, 0), enable_gqa=True)
            x = x + out.reshape(len(ids), -1) @ p["wo"]
            x = x + jax.nn.silu(rms(x, p["norm2"]) @ p["w1"]) @ p["w2"]
        logits = rms(x, params["norm"]) @ params["head"]  # (total, vocab)
        logp = jax.nn.log_softmax(logits[inputs], -1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[targets][:, None], -1))

    with jax.enable_x64(True):
        params = {name: jnp.asarray(p.detach().double().numpy(), dtype)
                  for name, p in model.named_parameters()}
        value, grads = jax.jit(jax.value_and_grad(loss))(params)
        return float(value), {name: np.asarray(g, np.float64) for name, g in grads.items()}


def run(jax_dtypes: tuple[str, ...] = ("float64", "float32")) -> dict[str, Any]:
    """Every step of the comparison.

    Args:
      jax_dtypes: the dtypes of the JAX packed step (each compiles one program); ``()``: none.

    Returns:
      ``{"losses": {label: loss}, "worst": {label: worst ratio against the padded float64
      step}}`` for ``packed float64``, ``packed float32``, ``planted: offsets off by one``
      (float64; must be above 1) and ``jax packed <dtype>``; ``losses`` also has ``padded
      float64`` and ``padded float32``; ``baseline_error``: the padded float32 step's largest
      error (loss or gradient entry) against float64; ``tokens``, ``padded_positions`` and
      ``predictions``.
    """
    batch = make_batch()
    model64 = TinyLM()
    reference = step(model64, padded_loss, batch)
    model32 = TinyLM().float()
    padded32 = step(model32, padded_loss, batch)
    wrong = batch["cu_seq"].clone()
    wrong[2] += 1  # the second sequence takes the third's first token
    results = {
        "packed float64": (step(model64, packed_loss, batch), "float64", None),
        "packed float32": (step(model32, packed_loss, batch), "float32", padded32),
        "planted: offsets off by one": (step(model64, packed_loss, batch, wrong), "float64",
                                        None),
    }
    for dtype in jax_dtypes:
        results[f"jax packed {dtype}"] = (jax_step(model64, batch, dtype), dtype,
                                          padded32 if dtype == "float32" else None)
    losses = {"padded float64": reference[0], "padded float32": padded32[0]}
    ratios = {}
    for label, (result, dtype, baseline) in results.items():
        losses[label] = result[0]
        ratios[label] = worst(result, reference, dtype, baseline)
    errors = [abs(padded32[0] - reference[0])] + [
        float(np.max(np.abs(padded32[1][name] - grad))) for name, grad in reference[1].items()]
    return {"losses": losses, "worst": ratios, "baseline_error": max(errors),
            "tokens": int(batch["cu_seq"][-1]),
            "padded_positions": batch["real"].numel(),
            "predictions": int(_packed_predictions(batch).sum())}


def main(argv: list[str] | None = None) -> int:
    """Print the comparison; exit code 1 if a check fails (or the planted bug passes)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-jax", action="store_true", help="torch only")
    args = parser.parse_args(argv)
    result = run(jax_dtypes=() if args.no_jax else ("float64", "float32"))
    print(f"{len(LENGTHS)} sequences, lengths {list(LENGTHS)}: {result['tokens']} tokens packed "
          f"({result['padded_positions']} padded), {result['predictions']} predictions")
    print(f"{'step':<30} {'loss':>20}  worst |Δ|/bound (loss and every gradient)")
    losses = result["losses"]
    print(f"{'padded float64':<30} {losses['padded float64']:>20.15f}  the reference")
    print(f"{'padded float32':<30} {losses['padded float32']:>20.15f}  "
          f"e: max |Δ| {result['baseline_error']:.2g}")
    ok = True
    for label, ratio in result["worst"].items():
        if label.startswith("planted"):
            verdict = "✓ caught" if ratio > 1 else "✗ NOT caught"
            ok &= ratio > 1
        else:
            verdict = "✓" if ratio <= 1 else "✗"
            ok &= ratio <= 1
        print(f"{label:<30} {result['losses'][label]:>20.15f}  {ratio:.3g} {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
