"""Numerical helpers shared by the tests: central differences, and the harness's one tolerance
rule against the float64 reference for arrays a test made itself.

``assert_matches_reference`` and ``assert_vjp_matches_reference`` judge a backend's result the way
the harness judges a cell: the expected value is ``conformance.cases.reference`` (float64 NumPy, on
exactly the bits the backend received), the bound is ``spec.TOLERANCES[dtype]`` scaled by a naive
implementation's error on the same inputs (``conformance.comparing.compare``), exact zeros (masked
weights, fully masked rows) must be exactly 0 and NaN must be NaN where the spec's IEEE rule puts
it. Fast paths are judged this way, never against the same backend's explicit path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from conformance.cases import expected
from conformance.cases.catalogue import CaseData
from conformance.comparing import compare

GRADS = ("query", "key", "value", "bias")


def finite_differences(loss: Callable[[], float], x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of ``loss()`` with respect to every element of ``x`` (changed in
    place and restored): ``(loss(x + eps) - loss(x - eps)) / (2 eps)``, shaped like ``x``."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        old = x[index]
        x[index] = old + eps
        up = loss()
        x[index] = old - eps
        down = loss()
        x[index] = old
        grad[index] = (up - down) / (2 * eps)
    return grad


def _numpy(arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """NumPy copies of ``arrays`` (JAX arrays convert with ``np.asarray``, bfloat16 included)."""
    return {name: np.asarray(a) for name, a in arrays.items() if a is not None}


def expected_values(arrays: Mapping[str, Any], dtype: str, *, gradients: bool = False,
                    **options: Any) -> expected.Expected:
    """What ``scaled_dot_product_attention(**arrays, **options)`` must give in ``dtype``.

    Args:
      arrays: ``query (..., heads, q_len, head_dim)``, ``key``/``value (..., kv_heads, kv_len,
        ·)`` and optionally ``mask``, ``bias``, ``dropout_mask`` (broadcastable to ``(...,
        heads, q_len, kv_len)``) and, for gradients, ``grad_output (..., heads, q_len,
        v_dim)``: the arrays the backend received, in ``dtype``.
      dtype: the input dtype (``"float64"``, ``"float32"``, ``"bfloat16"``, ``"float16"``).
      gradients: also the gradient steps ``grad_query`` … (against ``grad_output`` when given,
        else a seeded one).
      options: the scalar options (``is_causal``, ``window``, ``scale``, …).
    """
    data = CaseData(_numpy(arrays), dict(options))
    return expected.expected_for(data, "sdpa", dtype, gradients=gradients)


def assert_conforms(exp: expected.Expected, step: str, actual: Any, what: str = "",
                    result_dtype: str | None = "input") -> None:
    """``compare.compare_step`` of ``actual`` (any array type NumPy converts) passes; the
    failure message names the step, the worst position and ``what``."""
    result = compare.compare_step(exp, step, np.asarray(actual), result_dtype)
    assert result.passed, (
        f"{step}: |diff| {result.ratio:.3g} × tolerance at {result.index} (got {result.actual}, "
        f"expected {result.expected}, bound {result.bound}) {result.note} [dtype={exp.dtype}"
        f"{', ' + what if what else ''}]"
    )


def assert_matches_reference(actual: Any, arrays: Mapping[str, Any], dtype: str,
                             step: str = "output", what: str = "", **options: Any
                             ) -> expected.Expected:
    """``actual`` (the output, or the weights with ``step="output_weights"``) of
    ``scaled_dot_product_attention(**arrays, **options)`` in ``dtype`` is within the harness's
    tolerance of the float64 reference; returns the expected values."""
    exp = expected_values(arrays, dtype, **options)
    assert_conforms(exp, step, actual, what or f"options={options}")
    return exp


def assert_vjp_matches_reference(grads: Any, arrays: Mapping[str, Any], dtype: str,
                                 what: str = "", **options: Any) -> expected.Expected:
    """The gradients ``(query, key, value[, bias])`` of ``sum(output · grad_output)`` are
    within the harness's tolerance of the float64 reference VJP (``arrays`` holds
    ``grad_output``); a None gradient must be None in the reference too."""
    exp = expected_values(arrays, dtype, gradients=True, **options)
    for name, grad in zip(GRADS, grads, strict=False):
        if grad is None:
            assert f"grad_{name}" not in exp.values, f"no gradient of {name} [{what}]"
            continue
        assert_conforms(exp, f"grad_{name}", grad, what or f"options={options}")
    return exp


__all__ = ["GRADS", "assert_conforms", "assert_matches_reference",
           "assert_vjp_matches_reference", "expected_values", "finite_differences"]
