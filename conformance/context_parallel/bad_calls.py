"""Context parallelism's bad calls (``BAD_CALLS``): how each breaks a good call, its inputs, and
the check that it raised a ValueError naming the function (on every rank).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .cases import HEAD_DIM
from .checks import CPResult

#: name → how it breaks a good call; each must raise ValueError on every rank.
BAD_CALLS = {
    "indivisible_sequence": "q_len not a multiple of 2 × world_size with load_balance",
    "ulysses_heads": "strategy='ulysses' with heads not a multiple of world_size",
    "unknown_strategy": "strategy='tree'",
}


def bad_inputs(name: str, world_size: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Global (layout-ordered) float32 inputs and options of a bad call."""
    rng = np.random.default_rng(0)
    heads, length, options = 4, 4 * world_size, {"strategy": "ring"}
    if name == "indivisible_sequence":
        length, options = 3 * world_size, {"strategy": "ring", "load_balance": True}
    elif name == "ulysses_heads":
        heads, options = world_size + 1, {"strategy": "ulysses"}
    elif name == "unknown_strategy":
        options = {"strategy": "tree"}
    shape = (1, heads, length, HEAD_DIM)
    arrays = {n: rng.standard_normal(shape).astype(np.float32) for n in ("query", "key", "value")}
    return arrays, options


def bad_call_result(backend: str, world_size: int, name: str, error: BaseException | None,
                    rank: int | None = None) -> CPResult:
    """Passed when ``error`` is a ValueError whose message starts with the function's name."""
    where = "" if rank is None else f"rank {rank}: "
    if error is None:
        return CPResult(backend, world_size, "-", name, "bad call", False, note=where
                        + "no error raised")
    ok = isinstance(error, ValueError) and str(error).startswith("context_parallel_attention")
    text = f"{type(error).__name__}: {str(error)[:110]}"
    return CPResult(backend, world_size, "-", name, "bad call", ok, note=where + text)
