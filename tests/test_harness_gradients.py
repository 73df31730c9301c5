"""Gradient steps of the harness: every backend's VJP against the float64 reference, and planted
backward bugs (a forgotten soft-cap derivative, a forgotten grouped-query head sum) are caught.
The non-finite cases compare no gradient (the spec's NaN rule covers the forward pass)."""

from __future__ import annotations

import types

import numpy as np
import pytest

import numpy_attn
from conformance import spec
from conformance.cases import catalogue as cases
from conformance.cases import expected, reference
from conformance.running import backends, runner, steps

GRAD_STEPS = set(expected.GRAD_STEPS)


def _expected(case: str, dtype: str) -> expected.Expected:
    return expected.expected(cases.get(case), dtype)


def test_every_finite_sdpa_case_compares_gradients():
    for case in cases.CASES:
        if case.kind != "sdpa":
            continue
        exp = _expected(case.name, "float64")
        names = {s.name for s in steps.steps_for(exp)}
        if not exp.data.finite:  # NaN/Inf cases: forward steps only, blockwise included
            assert not names & {n for n in steps.STEPS if "grad" in n}, case.name
            assert {"output", "weights", "blockwise_output"} <= names, case.name
            continue
        assert {"grad_query", "grad_key", "grad_value"} <= names, case.name
        assert ("grad_bias" in names) == ("bias" in exp.data.arrays), case.name


def _fake(name: str, vjp) -> backends.Backend:  # noqa: ANN001
    module = types.ModuleType(name)
    for fn in spec.FUNCTIONS + spec.MODULES:
        if hasattr(numpy_attn, fn):
            setattr(module, fn, getattr(numpy_attn, fn))
    module.scaled_dot_product_attention_vjp = vjp
    return backends.from_module(module, name=name)


def _forgets_softcap_derivative(q, k, v, grad_output, *, softcap=None, bias=None,
                                scale=None, **kw):  # noqa: ANN001, ANN202
    """Differentiates as if the cap were the identity: the cap enters as a constant bias."""
    if softcap is None:
        return numpy_attn.scaled_dot_product_attention_vjp(
            q, k, v, grad_output, bias=bias, scale=scale, **kw)
    raw = numpy_attn.attention_scores(q, k, scale=scale)
    capped = numpy_attn.attention_scores(q, k, scale=scale, softcap=softcap)
    offset = capped - raw if bias is None else capped - raw + bias
    gq, gk, gv, gb = numpy_attn.scaled_dot_product_attention_vjp(
        q, k, v, grad_output, bias=offset.astype(q.dtype), scale=scale, **kw)
    return gq, gk, gv, None if bias is None else reference.unbroadcast(gb, np.shape(bias))


def _forgets_gqa_head_sum(q, k, v, grad_output, **kw):  # noqa: ANN001, ANN202
    """Keeps the gradient of the first query head of each group instead of the group's sum."""
    if q.ndim < 3 or k.shape[-3] == q.shape[-3]:
        return numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_output, **kw)
    groups = q.shape[-3] // k.shape[-3]
    k_full, v_full = np.repeat(k, groups, axis=-3), np.repeat(v, groups, axis=-3)
    gq, gk, gv, gb = numpy_attn.scaled_dot_product_attention_vjp(
        q, k_full, v_full, grad_output, **kw)
    return gq, gk[..., ::groups, :, :], gv[..., ::groups, :, :], gb


PLANTED = {
    "softcap_derivative": (_forgets_softcap_derivative, {"softcap"}, {"self", "bias", "gqa"},
                           {"grad_query", "grad_key"}),
    "gqa_head_sum": (_forgets_gqa_head_sum, {"gqa", "mqa", "three_d_gqa_causal"},
                     {"self", "softcap", "causal_bottom_right"}, {"grad_key", "grad_value"}),
}


@pytest.mark.parametrize("bug", PLANTED)
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_planted_backward_bug_is_caught(bug, dtype):
    vjp, must_fail, must_pass, steps = PLANTED[bug]
    fake = _fake(f"fake_{bug}", vjp)
    for case in sorted(must_fail | must_pass):
        cell = runner.run_cell(fake, _expected(case, dtype))
        failing = {s.step for s in cell.steps if not s.passed}
        if case in must_fail:
            assert cell.status == "FAIL", f"{bug} {dtype} {case}: not caught"
            assert failing <= GRAD_STEPS and failing & steps, f"{bug} {dtype} {case}: {failing}"
        else:
            assert cell.status == "ok", f"{bug} {dtype} {case}: {cell.detail}"


def test_gradient_tolerance_is_not_vacuous():
    """Scaling a correct gradient by 1.001 fails in float64 and float32."""

    def off_by_a_little(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        gq, gk, gv, gb = numpy_attn.scaled_dot_product_attention_vjp(*args, **kw)
        return gq * 1.001, gk, gv, gb

    fake = _fake("fake_scaled_grad", off_by_a_little)
    for dtype in ("float64", "float32"):
        cell = runner.run_cell(fake, _expected("causal_bottom_right", dtype))
        failing = {s.step for s in cell.steps if not s.passed}
        assert cell.status == "FAIL" and failing == {"grad_query"}, (dtype, failing)


def test_module_weight_gradients_are_compared():
    for name in ("module_self_attention", "module_multihead_wrapper", "module_multihead_attention"):
        exp = _expected(name, "float32")
        assert "grad_weights" in {s.name for s in steps.steps_for(exp)}, name


def test_planted_module_backward_bug_is_caught():
    """A module backward that forgets the output projection's bias gradient fails."""

    class Forgetful(numpy_attn.MultiHeadAttention):
        def parameter_gradients(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            grads = super().parameter_gradients(*args, **kwargs)
            grads["b_out"] = np.zeros_like(grads["b_out"])
            return grads

    module = types.ModuleType("fake_module_backward")
    for fn in spec.FUNCTIONS + spec.MODULES:
        if hasattr(numpy_attn, fn):
            setattr(module, fn, getattr(numpy_attn, fn))
    module.MultiHeadAttention = Forgetful
    fake = backends.from_module(module, name="fake_module_backward")
    cell = runner.run_cell(fake, _expected("module_multihead_attention", "float32"))
    failing = {s.step for s in cell.steps if not s.passed}
    assert failing == {"grad_weights"}, failing
