"""Shared inputs of the jax_attn tests (``tests/test_jax_*.py``) and their reference checks.

The arrays are drawn in one fixed order from one seeded generator, so every test file sees the same
numbers whichever files run. They are NumPy float64 arrays: a test that hands them to JAX as float64
runs with x64 on (``conftest.x64_on``; importing this module changes no JAX setting, so other tests
see JAX's default, x64 off). Expected values come from ``conformance.cases.reference`` (float64) and
the harness's tolerance rule (``conformance.comparing.compare``, ``tests/numerics.py``); never from
jax_attn itself.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from numerics import assert_matches_reference

import jax_attn as ja
from conformance.cases import reference

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
    """The harness's one tolerance rule (``conformance.comparing.compare``: ``spec.TOLERANCES``
    scaled by a naive implementation's error in ``dtype``) against the float64 reference."""
    assert_matches_reference(actual, arrays, dtype, step, **options)


__all__ = ["BIAS", "GBIAS", "GCOT", "GK", "GMASK", "GQ", "GV", "HALF", "KEEP", "MASK", "K", "Q",
           "V", "X", "X2", "_assert_matches_reference", "_f64", "_jitted", "_ref"]
