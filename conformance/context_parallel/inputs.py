"""Context parallelism's inputs and expected values: a case's seeded arrays in natural order,
laid out for the ranks (``attention_rules.context_parallel.positions``) and cut into shards, the
keyword arguments of a call, and the float64 expected values (``conformance.cases.expected``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attention_rules import context_parallel as cp

from ..cases.catalogue import CaseData
from ..cases.expected import Expected, expected_for
from .cases import BATCH, DTYPE, HEAD_DIM, SEED, CPCase


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
