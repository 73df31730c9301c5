"""Shared inputs of ``tests/test_sinks_and_lse.py`` and ``tests/test_merge_attention.py``: one
set of small shapes, the cases, their float64 expected values and the harness's tolerance rule.

Expected values come from the float64 reference (``conformance.cases.reference``: the sink is one
more score column, dropped after the softmax) of the dtype-cast inputs; a step passes under
``conformance.comparing.compare``'s rule, ``|x - ref| <= atol + rtol·|ref| + k·e`` with ``e`` the
naive implementation's error in the same dtype (``conformance.cases.naive``, sinks included), NaN,
``±inf`` and the exact zeros matched exactly. Never from a backend itself.
"""

from __future__ import annotations

import numpy as np

from conformance.cases import naive, reference
from conformance.cases.dtypes import numpy_dtype
from conformance.cases.expected import baseline_error
from conformance.comparing import compare

# batch 2, 4 query heads over 2 kv heads, 5 queries, 7 keys (q_len < kv_len: the causal
# alignments differ), head_dim 8, v_dim 3
_R = np.random.default_rng(2023)
Q, K, V = _R.standard_normal((2, 4, 5, 8)), _R.standard_normal((2, 2, 7, 8)), \
    _R.standard_normal((2, 2, 7, 3))
SINKS = _R.standard_normal(4) + 1.0
BIAS = _R.standard_normal((4, 5, 7))
MASK = _R.random((2, 1, 5, 7)) > 0.4
MASK[..., 0] = True
MASK[0, 0, 2] = False  # batch 0, query 2: a fully masked row in every head
GRAD_OUT, GRAD_LSE = _R.standard_normal((2, 4, 5, 3)), _R.standard_normal((2, 4, 5))

CASES = {  # options, and whether the sinks are given
    "plain": ({}, True),
    "mask_bias": ({"mask": MASK, "bias": BIAS}, True),
    "mask_bias_no_sinks": ({"mask": MASK, "bias": BIAS}, False),
    "causal_top_left": ({"is_causal": True}, True),
    "causal_bottom_right_softcap": (
        {"is_causal": True, "causal_alignment": "bottom_right", "softcap": 3.0}, True),
    "window_no_sinks": ({"window": (2, 1)}, False),
    # scores in the hundreds: exp(lse) overflows float32, so every lse step needs its max
    "large_scores": ({"mask": MASK, "bias": BIAS, "scale": 40.0}, True),
}
GRAD_CASES = ("mask_bias", "causal_bottom_right_softcap", "window_no_sinks")


def cast(x, dtype):
    """A NumPy input in ``dtype`` (bool masks as they are)."""
    return None if x is None or x.dtype == bool else x.astype(numpy_dtype(dtype))


def to_backend(backend, x, dtype):
    return None if x is None else backend.asarray(x if x.dtype == bool else cast(x, dtype))


def as_float64(backend, x):
    return None if x is None else backend.to_numpy(x).astype(np.float64)


def expected_values(dtype, case, grads=False):
    """Float64 values of the dtype-cast inputs and the naive baseline ``e`` of every step."""
    options, with_sinks = CASES[case]
    arrays = {"query": Q, "key": K, "value": V, "bias": options.get("bias"),
              "sinks": SINKS if with_sinks else None, "grad_output": GRAD_OUT}
    arrays = {n: None if x is None else cast(x, dtype).astype(np.float64)
              for n, x in arrays.items()}
    arrays["mask"] = options.get("mask")
    scalars = {n: v for n, v in options.items() if n not in ("mask", "bias")}
    p = naive.Precision(dtype)
    ref = reference.attention(arrays["query"], arrays["key"], arrays["value"], mask=arrays["mask"],
                              bias=arrays["bias"], sinks=arrays["sinks"], **scalars)
    low = naive.naive_attention(arrays, scalars, p)
    values = {"output": ref.output, "weights": ref.weights, "lse": ref.lse}
    base = {n: baseline_error(getattr(low, n), v, p) for n, v in values.items()}
    floor = naive.rounding_error(arrays, scalars, p, ref)
    base = {n: max(e, floor.get(n, 0.0)) for n, e in base.items()}
    if grads:
        extra = {n: arrays[n] for n in ("mask", "bias", "sinks")}
        exact = reference.attention_vjp(arrays["query"], arrays["key"], arrays["value"],
                                        arrays["grad_output"], **extra, **scalars)
        rough = naive.naive_attention_vjp(arrays, scalars, p)
        for name in ("query", "key", "value", "bias", "sinks"):
            if getattr(exact, name) is not None:
                values[f"grad_{name}"] = getattr(exact, name)
                base[f"grad_{name}"] = baseline_error(getattr(rough, name), values[f"grad_{name}"],
                                                      p)
    return values, base, ref


def assert_close(step, actual, values, base, dtype, result_dtype=None, zeros=None):
    """The harness's tolerance rule; NaN, ``±inf`` and the ``zeros`` positions exactly."""
    result = compare.compare(step, actual, values[step], base[step], dtype, zeros, result_dtype)
    assert result.passed, (f"{step}: {result.ratio:.3g} × tolerance at {result.index}: "
                           f"{result.actual} vs {result.expected} {result.note} [{dtype}]")


def call(backend, fn, dtype, case, *extra, **kwargs):
    """``backend.fn(query, key, value, *extra, **options, **kwargs)`` on the case's inputs."""
    options, with_sinks = CASES[case]
    arrays = {n: to_backend(backend, options.get(n), dtype) for n in ("mask", "bias")}
    scalars = {n: v for n, v in options.items() if n not in ("mask", "bias")}
    if fn.startswith("blockwise"):  # masks are structure there
        arrays.pop("mask")
    sinks = to_backend(backend, SINKS, dtype) if with_sinks else None
    qkv = (to_backend(backend, x, dtype) for x in (Q, K, V, *extra))
    call = getattr(backend.module, fn)
    return call(*qkv, **{n: a for n, a in arrays.items() if a is not None}, **scalars,
                sinks=sinks, **kwargs)
