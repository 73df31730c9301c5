"""Shared inputs of the jax_attn tests (``tests/test_jax_*.py``) and their reference checks.

The arrays are drawn in one fixed order from one seeded generator, so every test file sees the
same numbers whichever files run. Importing this module turns on ``jax_enable_x64`` (float64
inputs stay float64). Expected values come from ``conformance.reference`` (float64) and the
harness's tolerance rule (``conformance.compare``); never from jax_attn itself.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)

import jax_attn as ja  # noqa: E402
from conformance import compare, expected, reference  # noqa: E402
from conformance.cases import CaseData  # noqa: E402

HALF = ("bfloat16", "float16")

# One set of shapes for most tests: batch 2, 4 query heads over 2 kv heads (GQA), 5 queries,
# 6 keys, head_dim 8, v_dim 3.
_R = np.random.default_rng(20261130)
Q = _R.standard_normal((2, 4, 5, 8))
K = _R.standard_normal((2, 2, 6, 8))
V = _R.standard_normal((2, 2, 6, 3))
BIAS = _R.standard_normal((4, 5, 6))
MASK = _R.random((2, 1, 5, 6)) > 0.3
MASK[0, 0, 2] = False  # a fully masked row: batch 0, query 2, every head
MASK[1, 0, :, 0] = True
KEEP = _R.random((2, 4, 5, 6)) > 0.25

# The gradient tests: batch 1, 2 query heads over 1 kv head, 3 queries, 4 keys.
GQ = _R.standard_normal((1, 2, 3, 4))
GK = _R.standard_normal((1, 1, 4, 4))
GV = _R.standard_normal((1, 1, 4, 3))
GBIAS = _R.standard_normal((1, 2, 3, 4))
GMASK = np.ones((1, 1, 3, 4), dtype=bool)
GMASK[0, 0, 1] = False  # query 1 sees no key
GMASK[0, 0, 2, 3] = False
GCOT = _R.standard_normal((1, 2, 3, 3))  # cotangent of the output

# The modules' inputs: (batch 2, seq 5 / 7, d_in 8), float32.
X = _R.standard_normal((2, 5, 8)).astype(np.float32)
X2 = _R.standard_normal((2, 7, 8)).astype(np.float32)


def _ref(query, key, value, **config):
    return reference.attention(query, key, value, **config)


def _f64(x):
    return np.asarray(x, dtype=np.float64)


@functools.cache
def _jitted(static_items):
    """One jitted SDPA per set of static options (cached: compiled once per shape)."""
    return jax.jit(functools.partial(ja.scaled_dot_product_attention, **dict(static_items)))


def _assert_matches_reference(actual, step, dtype, arrays, **options):
    """The harness's one tolerance rule (``conformance.compare``: ``spec.TOLERANCES`` scaled by
    a naive implementation's error in ``dtype``) against the float64 reference."""
    data = CaseData({n: np.asarray(a) for n, a in arrays.items()}, options)
    exp = expected.expected_for(data, "sdpa", dtype, gradients=False)
    result = compare.compare_step(exp, step, np.asarray(actual), "input")
    assert result.passed, (
        f"{step}: |diff| {result.ratio:.3g} × tolerance at {result.index} {result.note} "
        f"[dtype={dtype}, options={options}]"
    )



__all__ = ["BIAS", "GBIAS", "GCOT", "GK", "GMASK", "GQ", "GV", "HALF", "KEEP", "MASK", "K", "Q",
           "V", "X", "X2", "_assert_matches_reference", "_f64", "_jitted", "_ref"]
