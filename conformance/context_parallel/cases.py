"""Context parallelism's cases: the problems every backend attends over (``CASES``), the world
sizes, strategies and compared steps, and the choice of cases for a run (``selected``).

Each case is a small attention problem whose global lengths, heads, options, ``kv_lengths`` and
layout (contiguous or zig-zag) are data; ``inputs`` seeds its arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attention_rules import context_parallel as cp

BACKENDS = ("numpy", "jax", "torch")
WORLD_SIZES = (2, 4)
STRATEGIES = cp.STRATEGIES
DTYPE = "float32"
BATCH, HEAD_DIM = 2, 4
STEPS = ("output", "grad_query", "grad_key", "grad_value")
SEED = 20261201
DEADLINE_S = 600  # a whole backend's subprocess


@dataclass(frozen=True)
class CPCase:
    """One context-parallel problem: global lengths, heads, options, ``kv_lengths``, layout."""

    name: str
    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    options: dict = field(default_factory=dict)
    kv_lengths: tuple | None = None
    load_balance: bool = False


CASES = (
    # zig-zag causal, grouped-query heads, soft-cap; sequence 1 has no key: fully masked rows
    CPCase("causal_zigzag_gqa_lengths", 16, 16, 8, 4, {"is_causal": True, "softcap": 5.0},
           (13, 0), True),
    # cross-attention, bottom-right causal with a window, zig-zag: blocks outside are skipped
    CPCase("cross_bottom_right_window", 8, 16, 8, 4,
           {"is_causal": True, "causal_alignment": "bottom_right", "window": (3, 0)}, None, True),
    # a two-sided window without the causal rule, padding keys, contiguous layout
    CPCase("window_padding", 16, 16, 8, 8, {"window": (5, 2)}, (16, 9), False),
)


def selected(names: tuple[str, ...] | None, world_size: int) -> tuple[CPCase, ...]:
    """The cases named (all when None); ``"name@N"`` names a case at world size N only."""
    if not names:
        return CASES
    wanted = {n.split("@")[0] for n in names if "@" not in n or n.endswith(f"@{world_size}")}
    return tuple(c for c in CASES if c.name in wanted)
