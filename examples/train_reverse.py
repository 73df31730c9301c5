"""Train one attention layer to reverse a sequence — in NumPy (hand-written backward), JAX and
PyTorch, from the same initial weights — and show that the three loss curves coincide.

Task: each input token is a one-hot symbol concatenated with a one-hot position; the target at
position ``i`` is the symbol at position ``T - 1 - i``. A single ``MultiHeadAttention`` layer
can solve it by attending from position ``i`` to position ``T - 1 - i``. Loss: mean squared
error between the layer's output and the target's one-hot symbol (zeros on the position part).

Every backend trains in float64 with Adam (numpy_attn.Adam, a hand-written Adam in JAX,
torch.optim.Adam) on identical batches, so the curves agree to rounding error.

Run: ``python examples/train_reverse.py [--steps 200] [--plot reverse_loss.png]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy_attn  # noqa: E402

SYMBOLS, LENGTH, HEADS, BATCH = 6, 6, 2, 32
D_MODEL = SYMBOLS + LENGTH
LEARNING_RATE = 0.03


def batches(steps: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``steps`` batches of (inputs ``(BATCH, LENGTH, D_MODEL)``, targets, same shape)."""
    rng = np.random.default_rng(seed)
    eye_symbols, eye_positions = np.eye(SYMBOLS), np.eye(LENGTH)
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, SYMBOLS, (BATCH, LENGTH))
        positions = np.broadcast_to(eye_positions, (BATCH, LENGTH, LENGTH))
        x = np.concatenate([eye_symbols[tokens], positions], axis=-1)  # (batch, seq, d_model)
        target = np.concatenate(
            [eye_symbols[tokens[:, ::-1]], np.zeros((BATCH, LENGTH, LENGTH))], axis=-1
        )
        out.append((x, target))
    return out


def initial_weights() -> dict[str, np.ndarray]:
    """Xavier-initialised float64 weights, shared by the three backends."""
    module = numpy_attn.MultiHeadAttention(D_MODEL, HEADS, rng=np.random.default_rng(42))
    return {k: v.astype(np.float64) for k, v in module.export_weights().items()}


def train_numpy(data: list, weights: dict) -> list[float]:
    """numpy_attn: forward, hand-written backward, numpy_attn.Adam."""
    module = numpy_attn.MultiHeadAttention(D_MODEL, HEADS).load_weights(weights)
    adam = numpy_attn.Adam(learning_rate=LEARNING_RATE)
    losses = []
    for x, target in data:
        error = module(x) - target  # (batch, seq, d_model)
        losses.append(float(np.mean(error**2)))
        grads = module.backward(x, 2.0 * error / error.size)  # d mean(error²) / d output
        module = adam.step(module, grads)
    return losses


def train_jax(data: list, weights: dict) -> list[float]:
    """jax_attn: jax.value_and_grad of the loss with respect to the module (a pytree)."""
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    import jax_attn

    module = jax_attn.MultiHeadAttention(D_MODEL, HEADS, rng=jax.random.key(0))
    module = module.load_weights(weights)

    def loss_fn(m, x, target):
        return jnp.mean((m(x) - target) ** 2)

    value_and_grad = jax.jit(jax.value_and_grad(loss_fn))
    names = list(weights)
    first = {n: np.zeros_like(w) for n, w in weights.items()}
    second = {n: np.zeros_like(w) for n, w in weights.items()}
    losses = []
    for step, (x, target) in enumerate(data, start=1):
        loss, grad_module = value_and_grad(module, jnp.asarray(x), jnp.asarray(target))
        losses.append(float(loss))
        grads, current = grad_module.export_weights(), module.export_weights()
        updated = {}
        for n in names:  # Adam, as torch.optim.Adam and numpy_attn.Adam
            first[n] = 0.9 * first[n] + 0.1 * grads[n]
            second[n] = 0.999 * second[n] + 0.001 * grads[n] ** 2
            m_hat, v_hat = first[n] / (1 - 0.9**step), second[n] / (1 - 0.999**step)
            updated[n] = current[n] - LEARNING_RATE * m_hat / (np.sqrt(v_hat) + 1e-8)
        module = module.load_weights(updated)
    return losses


def train_torch(data: list, weights: dict) -> list[float]:
    """torch_attn: autograd and torch.optim.Adam."""
    import torch

    import torch_attn

    module = torch_attn.MultiHeadAttention(D_MODEL, HEADS).load_weights(weights)
    optimiser = torch.optim.Adam(module.parameters(), lr=LEARNING_RATE)
    losses = []
    for x, target in data:
        optimiser.zero_grad()
        loss = torch.mean((module(torch.from_numpy(x)) - torch.from_numpy(target)) ** 2)
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return losses


def run(steps: int) -> dict[str, list[float]]:
    """Loss curves per installed backend."""
    data, weights = batches(steps), initial_weights()
    curves = {"numpy_attn": train_numpy(data, weights)}
    for name, trainer in (("jax_attn", train_jax), ("torch_attn", train_torch)):
        try:
            curves[name] = trainer(data, weights)
        except ImportError as exc:
            print(f"{name}: skipped ({exc})")
    return curves


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--plot", type=Path, help="write the loss curves as a PNG")
    args = parser.parse_args(argv)
    curves = run(args.steps)
    reference = np.array(curves["numpy_attn"])
    print(f"{'step':>6} " + " ".join(f"{name:>14}" for name in curves))
    for step in sorted({0, 1, 10, 50, 100, args.steps - 1} & set(range(args.steps))):
        print(f"{step:>6} " + " ".join(f"{c[step]:>14.8f}" for c in curves.values()))
    for name, curve in curves.items():
        gap = np.max(np.abs(np.array(curve) - reference))
        print(f"{name}: final loss {curve[-1]:.6f}, max |loss - numpy_attn loss| = {gap:.2e}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        styles = {"numpy_attn": "-", "jax_attn": "--", "torch_attn": ":"}
        for name, curve in curves.items():
            ax.plot(curve, styles[name], label=name, linewidth=2)
        ax.set_yscale("log")
        ax.set_xlabel("Adam step")
        ax.set_ylabel("mean squared error")
        ax.set_title("Reversing a sequence with one attention layer")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
