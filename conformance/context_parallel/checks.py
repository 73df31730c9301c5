"""Context parallelism's checks: one row per compared step (``CPResult``), each step compared
with its expected value laid out like the backend's result by ``compare.compare``, the harness's
one tolerance rule, and the ranks' rows merged into the worst one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..comparing.compare import compare
from .cases import DTYPE, STEPS, CPCase
from .inputs import expected_values, layout, shard


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
