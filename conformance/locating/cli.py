"""``python -m conformance locate A B``: where two attention blocks part.

``A`` and ``B`` name blocks: ``numpy``, ``jax``, ``torch`` (the backend's ``MultiHeadAttention``
of ``--d-model``/``--heads``, no biases, a ``RoPE`` of ``--theta`` in ``--layout``, seeded),
``transformers:llama`` (a seeded ``LlamaAttention`` of a tiny ``LlamaConfig``: the same sizes
and theta, half layout), or a factory: ``path/to/file.py:name`` or ``package.module:name``, a
callable returning a block (called without arguments). Exit code 0 when they agree, 1 when
they part, 2 on bad input (an unknown name, a factory that fails, blocks that cannot be
compared).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from pathlib import Path
from typing import Any

from ..usage import UsageError, at_least, require_frameworks
from .blocks import BadBlock
from .locate import DTYPES, LocateInputs, locate

BACKENDS = {"numpy": "numpy_attn", "jax": "jax_attn", "torch": "torch_attn"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``locate``."""
    p.add_argument("a", metavar="A", help="numpy, jax, torch, transformers:llama, "
                   "file.py:factory or package.module:factory (the reference)")
    p.add_argument("b", metavar="B", help="the block compared with A (same names)")
    p.add_argument("--d-model", type=at_least(2), default=32, help="model width (32)")
    p.add_argument("--heads", type=at_least(1), default=4, help="attention heads (4)")
    p.add_argument("--seq", type=at_least(1), default=16, help="sequence length (16)")
    p.add_argument("--batch", type=at_least(1), default=2, help="batch size (2)")
    p.add_argument("--seed", type=at_least(0), default=0, help="seed of weights and input")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--theta", type=float, default=10000.0, help="RoPE base (10000)")
    p.add_argument("--layout", choices=("half", "interleaved"), default="half",
                   help="RoPE layout of the project's blocks")
    p.add_argument("--layout-b", choices=("half", "interleaved"), default=None,
                   help="B's layout when it differs (see a swapped layout part)")
    p.add_argument("--start", type=int, default=0, help="position of the first token (0)")
    p.add_argument("--no-causal", dest="causal", action="store_false",
                   help="attend to every key (default: causal)")


def make_block(name: str, args: argparse.Namespace, layout: str) -> Any:
    """The block a command-line name stands for (``UsageError`` for a name that is none)."""
    if name in BACKENDS:
        require_frameworks([name] if name != "numpy" else [], f"locate {name}")
        module = importlib.import_module(BACKENDS[name])
        rope = module.RoPE(theta=args.theta, layout=layout)
        return module.MultiHeadAttention(args.d_model, args.heads, bias=False, rope=rope,
                                         rng=_rng(name, args.seed))
    if name == "transformers:llama":
        require_frameworks(["torch", "transformers"], "locate transformers:llama")
        return llama_attention(args.d_model, args.heads, args.theta, args.seed)
    if ":" in name:
        return _factory(name)()
    raise UsageError(f"locate: unknown block {name!r}; give numpy, jax, torch, "
                     f"transformers:llama, path/to/file.py:factory or package.module:factory")


def _rng(backend: str, seed: int) -> Any:
    """The backend's random source for the initial weights."""
    if backend == "jax":
        import jax

        return jax.random.key(seed)
    if backend == "torch":
        import torch

        return torch.Generator().manual_seed(seed)
    import numpy as np

    return np.random.default_rng(seed)


def llama_attention(d_model: int, heads: int, theta: float, seed: int) -> Any:
    """A seeded ``LlamaAttention`` of a tiny ``LlamaConfig`` (random weights, float32)."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = LlamaConfig(hidden_size=d_model, num_attention_heads=heads,
                         num_key_value_heads=heads, intermediate_size=2 * d_model,
                         num_hidden_layers=1, vocab_size=16, rope_theta=theta)
    torch.manual_seed(seed)
    return LlamaAttention(config, layer_idx=0)


def _factory(name: str) -> Any:
    """``file.py:factory`` or ``package.module:factory`` → the callable."""
    where, _, attribute = name.rpartition(":")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise UsageError(f"locate: no file {where}")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(where)
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's module: its failure in one line
        raise UsageError(f"locate: importing {where} raised {type(exc).__name__}: {exc}"
                         ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise UsageError(f"locate: {where} has no callable {attribute!r}")
    return factory


def main(argv: list[str]) -> int:
    """``python -m conformance locate A B [options]``; returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m conformance locate",
                                description="where two attention blocks part, stage by stage")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        a = make_block(args.a, args, args.layout)
        b = make_block(args.b, args, args.layout_b or args.layout)
    except (BadBlock, TypeError, ValueError) as exc:
        raise UsageError(f"locate: making a block raised {type(exc).__name__}: {exc}") from None
    positions = list(range(args.start, args.start + args.seq))
    inputs = LocateInputs(batch=args.batch, seq=args.seq, seed=args.seed, dtype=args.dtype,
                          is_causal=args.causal, positions=positions)
    result = locate(a, b, inputs)
    result.a, result.b = f"{args.a} ({result.a})", f"{args.b} ({result.b})"
    print(result.text())
    return result.exit_code
