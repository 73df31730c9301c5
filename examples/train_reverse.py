"""Train one attention layer to reverse a sequence — in NumPy (hand-written backward), JAX and
PyTorch, from the same initial weights — and show that the three loss curves coincide.

Task: each input token is a one-hot symbol concatenated with a one-hot position; the target at
position ``i`` is the symbol at position ``T - 1 - i``. A single ``MultiHeadAttention`` layer
can solve it by attending from position ``i`` to position ``T - 1 - i``. Loss: mean squared
error between the layer's output and the target's one-hot symbol (zeros on the position part).

Every backend trains in float64 with Adam (numpy_attn.Adam, a hand-written Adam in JAX,
torch.optim.Adam) on identical batches, so the curves agree to rounding error.

What it learns is visible: after training, each head's attention weights on a fresh batch are a
clean anti-diagonal (query ``i`` puts nearly all its weight on key ``T - 1 - i``):
``--plot-weights`` draws them, with the share of each row's weight on the anti-diagonal.

Run: ``python examples/train_reverse.py [--steps 200] [--plot [FILE]] [--plot-weights [FILE]]``
(the plots go to ``out/reverse_loss.png`` and ``out/reverse_weights.png`` by default: ``out/``
is git-ignored).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy_attn  # noqa: E402

SYMBOLS, LENGTH, HEADS, BATCH = 6, 6, 2, 32
D_MODEL = SYMBOLS + LENGTH
LEARNING_RATE = 0.03
#: Where ``--plot`` and ``--plot-weights`` write without a file name (git-ignored).
LOSS_PLOT, WEIGHTS_PLOT = Path("out/reverse_loss.png"), Path("out/reverse_weights.png")


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
    """numpy_attn: forward, hand-written backward, numpy_attn.Adam; the loss curve."""
    return train_numpy_module(data, weights)[0]


def train_numpy_module(data: list, weights: dict) -> tuple[list[float], Any]:
    """``train_numpy``'s loss curve and the trained ``numpy_attn.MultiHeadAttention``."""
    module = numpy_attn.MultiHeadAttention(D_MODEL, HEADS).load_weights(weights)
    adam = numpy_attn.Adam(learning_rate=LEARNING_RATE)
    losses = []
    for x, target in data:
        error = module(x) - target  # (batch, seq, d_model)
        losses.append(float(np.mean(error**2)))
        # the backward pass by hand, from d mean(error²) / d output
        grads = module.parameter_gradients(x, 2.0 * error / error.size)
        module = adam.step(module, grads)
    return losses, module


def attention_of(module: Any, seed: int = 1) -> np.ndarray:
    """The module's attention weights ``(heads, LENGTH, LENGTH)``, averaged over a fresh batch
    (``seed`` differs from the training batches')."""
    x, _ = batches(1, seed=seed)[0]
    _, weights = module(x, return_weights=True)  # (batch, heads, q_len, kv_len)
    return weights.mean(axis=0)


def anti_diagonal_share(weights: np.ndarray) -> np.ndarray:
    """Per head, the mean weight that query ``i`` puts on key ``T - 1 - i``
    (``weights (heads, T, T)``; 1 is a perfect reversal)."""
    anti = np.fliplr(np.eye(weights.shape[-1]))
    return (weights * anti).sum(-1).mean(-1)


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
    return run_with_module(steps)[0]


def run_with_module(steps: int) -> tuple[dict[str, list[float]], Any]:
    """Loss curves per installed backend, and numpy_attn's trained module."""
    data, weights = batches(steps), initial_weights()
    losses, module = train_numpy_module(data, weights)
    curves = {"numpy_attn": losses}
    for name, trainer in (("jax_attn", train_jax), ("torch_attn", train_torch)):
        try:
            curves[name] = trainer(data, weights)
        except ImportError as exc:
            print(f"{name}: skipped ({exc})")
    return curves, module


def plot_weights(weights: np.ndarray, path: Path) -> None:
    """Draw each head's trained attention weights ``(heads, T, T)`` into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    share = anti_diagonal_share(weights)
    fig, axes = plt.subplots(1, len(weights), figsize=(3.6 * len(weights) + 0.8, 3.6),
                             squeeze=False, layout="constrained")
    for h, ax in enumerate(axes[0]):
        image = ax.imshow(weights[h], cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"head {h}: {share[h]:.0%} on j = T-1-i", fontsize=10)
        ax.set_xlabel("key (position)")
        ax.set_ylabel("query (position)")
        ax.set_xticks(range(LENGTH))
        ax.set_yticks(range(LENGTH))
    fig.colorbar(image, ax=list(axes[0]), shrink=0.85, label="attention weight")
    fig.suptitle("After training to reverse: query i attends key T-1-i (batch mean)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    """The command line: ``--steps``, ``--plot [FILE]``, ``--plot-weights [FILE]``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--plot", type=Path, nargs="?", const=LOSS_PLOT, metavar="FILE",
                   help=f"write the loss curves as a PNG (default file: {LOSS_PLOT})")
    p.add_argument("--plot-weights", type=Path, nargs="?", const=WEIGHTS_PLOT, metavar="FILE",
                   help="write the trained attention weights of each head as a PNG (default "
                        f"file: {WEIGHTS_PLOT})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    curves, module = run_with_module(args.steps)
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
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    if args.plot_weights:
        weights = attention_of(module)
        shares = ", ".join(f"head {h} {s:.0%}" for h, s in enumerate(anti_diagonal_share(weights)))
        plot_weights(weights, args.plot_weights)
        print(f"wrote {args.plot_weights} (weight on the anti-diagonal: {shares})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
