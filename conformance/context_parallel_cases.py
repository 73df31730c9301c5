"""Context-parallel checks, the data: the cases (``CASES``), their seeded inputs laid out for
the ranks, the float64 expected values, the comparison of each step (``check_steps``), the bad
calls (``BAD_CALLS``), and NumPy's checks, which run in this process (its ranks are simulated).

``context_parallel_workers`` runs the JAX and torch checks in their subprocesses and
``context_parallel`` starts them and reports; see its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attention_rules import context_parallel as cp

from .cases import CaseData
from .compare import compare
from .expected import Expected, expected_for

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


@dataclass
class CPResult:
    """One compared step (or one bad call) of one backend, world size, strategy and case."""

    backend: str
    world_size: int
    strategy: str
    case: str
    step: str
    passed: bool
    ratio: float = 0.0  # worst |actual - expected| / bound (bad calls: 0)
    note: str = ""

    def line(self) -> str:
        mark = "✓" if self.passed else "✗"
        ratio = f"{self.ratio:.2f}" if self.step in STEPS else ""
        return (f"{mark} {self.backend:<6} N={self.world_size} {self.strategy:<10} "
                f"{self.case:<27} {self.step:<12} {ratio:>6} {self.note}").rstrip()


# ------------------------------------------------------------------------------------------
# Inputs and expected values (float64, natural order)
# ------------------------------------------------------------------------------------------


def case_arrays(case: CPCase) -> dict[str, np.ndarray]:
    """Seeded float32-representable inputs in natural order (float64 arrays), the gradient of
    the output, and the padding mask equal to ``kv_lengths``."""
    rng = np.random.default_rng(SEED)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32).astype(np.float64)

    arrays = {"query": normal(BATCH, case.heads, case.q_len, HEAD_DIM),
              "key": normal(BATCH, case.kv_heads, case.kv_len, HEAD_DIM),
              "value": normal(BATCH, case.kv_heads, case.kv_len, HEAD_DIM),
              "grad_output": normal(BATCH, case.heads, case.q_len, HEAD_DIM)}
    if case.kv_lengths is not None:
        lengths = np.asarray(case.kv_lengths)
        arrays["kv_lengths"] = lengths
        arrays["mask"] = (np.arange(case.kv_len) < lengths[:, None])[:, None, None, :]
    return arrays


def selected(names: tuple[str, ...] | None, world_size: int) -> tuple[CPCase, ...]:
    """The cases named (all when None); ``"name@N"`` names a case at world size N only."""
    if not names:
        return CASES
    wanted = {n.split("@")[0] for n in names if "@" not in n or n.endswith(f"@{world_size}")}
    return tuple(c for c in CASES if c.name in wanted)


_EXPECTED: dict[str, Expected] = {}


def expected_values(case: CPCase) -> Expected:
    """``expected.expected_for`` the case in float32 (cached)."""
    if case.name not in _EXPECTED:
        _EXPECTED[case.name] = expected_for(CaseData(case_arrays(case), dict(case.options)),
                                            "sdpa", DTYPE, case.name)
    return _EXPECTED[case.name]


def layout(x: np.ndarray, seq_len: int, world_size: int, load_balance: bool) -> np.ndarray:
    """The sequence axis (-2) from natural order to layout order."""
    return x[..., cp.positions(seq_len, world_size, load_balance), :]


def shard(x: np.ndarray, world_size: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s shard of a layout-ordered array."""
    return np.split(x, world_size, axis=-2)[rank]


def inputs_for(case: CPCase, world_size: int) -> dict[str, np.ndarray]:
    """float32 inputs in layout order: query, key, value, grad_output (and kv_lengths)."""
    arrays = case_arrays(case)
    q_len, kv_len, lb = case.q_len, case.kv_len, case.load_balance
    out = {"query": layout(arrays["query"], q_len, world_size, lb),
           "key": layout(arrays["key"], kv_len, world_size, lb),
           "value": layout(arrays["value"], kv_len, world_size, lb),
           "grad_output": layout(arrays["grad_output"], q_len, world_size, lb)}
    out = {name: x.astype(np.float32) for name, x in out.items()}
    if case.kv_lengths is not None:
        out["kv_lengths"] = np.asarray(case.kv_lengths)
    return out


def options_for(case: CPCase, strategy: str) -> dict[str, Any]:
    """The keyword arguments of ``context_parallel_attention`` (without the devices)."""
    kwargs = {"strategy": strategy, "load_balance": case.load_balance, **case.options}
    if case.kv_lengths is not None:
        kwargs["kv_lengths"] = np.asarray(case.kv_lengths)
    return kwargs


def check_steps(backend: str, world_size: int, strategy: str, case: CPCase,
                actual: dict[str, np.ndarray], rank: int | None = None) -> list[CPResult]:
    """Compare each step (layout order; a rank's shard when ``rank`` is given) with the
    expected value laid out the same way."""
    exp = expected_values(case)
    results = []
    for step in STEPS:
        seq_len = case.kv_len if step in ("grad_key", "grad_value") else case.q_len
        want = layout(exp.values[step], seq_len, world_size, case.load_balance)
        zeros = exp.zeros.get(step)
        if zeros is not None:
            zeros = layout(np.broadcast_to(zeros, exp.values[step].shape), seq_len, world_size,
                           case.load_balance)
        if rank is not None:
            want = shard(want, world_size, rank)
            zeros = None if zeros is None else shard(zeros, world_size, rank)
        res = compare(step, actual[step], want, exp.baseline[step], DTYPE, zeros=zeros)
        note = res.note if rank is None else f"rank {rank} {res.note}".rstrip()
        results.append(CPResult(backend, world_size, strategy, case.name, step, res.passed,
                                res.ratio, note))
    return results


def merge_ranks(results: list[CPResult]) -> list[CPResult]:
    """One row per (backend, world, strategy, case, step): the worst rank's."""
    merged: dict[tuple, CPResult] = {}
    for r in results:
        key = (r.backend, r.world_size, r.strategy, r.case, r.step)
        old = merged.get(key)
        if old is None or (old.passed and not r.passed) or (old.passed == r.passed
                                                            and r.ratio > old.ratio):
            merged[key] = r
    return list(merged.values())


# ------------------------------------------------------------------------------------------
# Bad calls: (name, how to break a good call); each must raise ValueError on every rank
# ------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------
# NumPy: in this process
# ------------------------------------------------------------------------------------------


def run_numpy(world_sizes: tuple[int, ...], strategies: tuple[str, ...] = STRATEGIES,
              cases: tuple[str, ...] | None = None) -> list[CPResult]:
    """numpy_attn's simulated ranks, every world size, strategy and case, and the bad calls."""
    from numpy_attn import context_parallel as ncp

    results = []
    for world in world_sizes:
        for strategy in strategies:
            for case in selected(cases, world):
                x = inputs_for(case, world)
                kwargs = options_for(case, strategy)
                q, k, v, g = x["query"], x["key"], x["value"], x["grad_output"]
                output = ncp.context_parallel_attention(q, k, v, world_size=world, **kwargs)
                grads = ncp.context_parallel_attention_vjp(q, k, v, g, world_size=world, **kwargs)
                actual = dict(zip(STEPS, (output, *grads), strict=True))
                results += check_steps("numpy", world, strategy, case, actual)
        for name in BAD_CALLS:
            arrays, options = bad_inputs(name, world)
            try:
                ncp.context_parallel_attention(**arrays, world_size=world, **options)
                error = None
            except Exception as exc:  # noqa: BLE001 - the type is what is checked
                error = exc
            results.append(bad_call_result("numpy", world, name, error))
    return results
