"""The MLA module case's ``grad_weights`` step (``conformance.cases.latent_grads``): the harness's
float64 chain rule equals central finite differences of its float64 MLA forward, every spec
backend passes the step, and a module whose ``parameter_gradients`` gets one weight wrong fails
it (and only it).

Independence: the finite differences perturb the case's weights and rerun ``latent.mla`` (the
forward that ``tests/test_harness_latent_quantized.py`` checks against an einsum-only formula),
so no backward pass is involved on that side.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

import numpy_attn
from conformance.cases import catalogue as cases_mod
from conformance.cases import latent, latent_grads
from conformance.cases.expected import expected, grad_output_for
from conformance.cases.inputs import CaseData
from conformance.cases.naive import Precision
from conformance.running import backends, runner

CASE = latent.LATENT_CASES[0].name
#: Entries per weight matrix whose derivative is taken (the RMSNorm gains: every entry).
SAMPLED = 48


def _loss(data: CaseData, name: str, index: tuple[int, ...], step: float) -> float:
    """``<grad_output, mla(data)>`` with weight ``name``'s entry ``index`` moved by ``step``."""
    weight = np.array(data.arrays[f"w:{name}"], dtype=np.float64)
    weight[index] += step
    moved = CaseData({**data.arrays, f"w:{name}": weight}, data.options)
    return float(np.sum(latent.mla(moved) * np.asarray(data.arrays["grad_output"])))


def _finite_difference(data: CaseData, name: str, index: tuple[int, ...],
                       h: float = 1e-3) -> float:
    """Central differences at ``h`` and ``h / 2`` combined by Richardson: error O(h⁴)."""
    wide = (_loss(data, name, index, h) - _loss(data, name, index, -h)) / (2 * h)
    narrow = (_loss(data, name, index, h / 2) - _loss(data, name, index, -h / 2)) / h
    return (4 * narrow - wide) / 3


def _indices(shape: tuple[int, ...], rng: np.random.Generator) -> list[tuple[int, ...]]:
    """Every entry of a gain, ``SAMPLED`` distinct entries of a matrix."""
    every = list(np.ndindex(shape))
    if len(every) <= SAMPLED:
        return every
    return [every[i] for i in rng.choice(len(every), SAMPLED, replace=False)]


def _check_against_finite_differences(data: CaseData, grads: dict[str, np.ndarray]) -> int:
    """Each sampled entry of ``grads`` within 1e-7 of its finite difference, relative to the
    largest gradient of that weight; returns how many entries were checked."""
    rng = np.random.default_rng(11)
    checked = 0
    for name, grad in sorted(grads.items()):
        assert grad.shape == np.shape(data.arrays[f"w:{name}"]), name
        largest = float(np.abs(grad).max())
        assert largest > 0, name
        for index in _indices(grad.shape, rng):
            fd = _finite_difference(data, name, index)
            assert abs(fd - grad[index]) <= 1e-7 * largest, (name, index, fd, grad[index])
            checked += 1
    return checked


def _unflatten(flat: np.ndarray, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """``flatten_weight_grads``' vector back into the weights' shapes (sorted name order)."""
    out, start = {}, 0
    for name in sorted(shapes):
        size = int(np.prod(shapes[name]))
        out[name] = flat[start:start + size].reshape(shapes[name])
        start += size
    assert start == flat.size
    return out


def test_the_expected_grad_weights_equal_finite_differences() -> None:
    """The harness's float64 expected value of the case (with the ``grad_output`` it seeds)
    against Richardson-extrapolated central differences of ``latent.mla``."""
    exp = expected(cases_mod.get(CASE), "float64")
    shapes = latent.weight_shapes(exp.data.options["init"])
    grads = _unflatten(exp.values["grad_weights"], shapes)
    assert sorted(grads) == sorted(shapes)
    assert _check_against_finite_differences(exp.data, grads) >= 250


def test_the_q_proj_path_and_a_non_causal_forward_equal_finite_differences() -> None:
    """``q_lora_rank=None`` (one ``q_proj``) and ``is_causal=False``: the branches the case
    does not take."""
    init = {**latent.INIT, "q_lora_rank": None}
    rng = np.random.default_rng(3)
    arrays = {"x": rng.standard_normal((2, 4, init["d_model"]))}
    for name, shape in latent.weight_shapes(init).items():
        arrays[f"w:{name}"] = (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1
                               else rng.standard_normal(shape) / np.sqrt(shape[1]))
    arrays["grad_output"] = rng.standard_normal(arrays["x"].shape)
    data = CaseData(arrays, {"module": latent.MODULE, "init": init,
                             "forward": {"is_causal": False}})
    grads = latent_grads.weight_grads(data)
    assert "q_proj.weight" in grads and "q_a_proj.weight" not in grads
    assert _check_against_finite_differences(data, grads) >= 150


def test_the_naive_baseline_is_the_float64_gradient_rounded() -> None:
    """The float32 and bfloat16 baselines differ from the float64 gradient (they round) by a
    few of their units, the bfloat16 one more."""
    exp = expected(cases_mod.get(CASE), "float64")
    exact = latent_grads.weight_grads(exp.data)
    errors = {}
    for dtype in ("float32", "bfloat16"):
        rounded = latent_grads.weight_grads(exp.data, Precision(dtype))
        errors[dtype] = max(float(np.abs(rounded[n] - exact[n]).max() / np.abs(exact[n]).max())
                            for n in exact)
    assert 0 < errors["float32"] < 1e-5, errors
    assert 1e-4 < errors["bfloat16"] < 0.1, errors


def test_the_case_compares_grad_weights_against_a_seeded_grad_output() -> None:
    exp = expected(cases_mod.get(CASE), "float32")
    assert "grad_weights" in exp.values
    x = exp.data.arrays["x"]
    np.testing.assert_array_equal(exp.data.arrays["grad_output"],
                                  grad_output_for(x.shape, "float32"))
    size = sum(int(np.prod(s)) for s in latent.weight_shapes(exp.data.options["init"]).values())
    assert exp.values["grad_weights"].shape == (size,)
    assert 0 < exp.baseline["grad_weights"] < 1e-4


@pytest.mark.parametrize("backend", ["numpy", pytest.param("jax", marks=pytest.mark.slow),
                                     pytest.param("torch", marks=pytest.mark.slow)])
def test_every_backend_passes_grad_weights(backend: str) -> None:
    if not backends.get(backend).available():
        pytest.skip(f"{backend} is not installed")
    result = runner.run([backend], [CASE], ["float64", "float32"], check_errors=False,
                        hypothesis=0)
    assert [c.dtype for c in result.cells] == ["float64", "float32"]
    for cell in result.cells:
        steps = {s.step: s for s in cell.steps}
        assert "grad_weights" in steps, (cell.dtype, sorted(steps))
        assert steps["grad_weights"].passed, (cell.dtype, steps["grad_weights"])
        assert cell.status == "ok", (cell.dtype, cell.detail)


def _planted(name: str, cls: type) -> Any:
    module = types.ModuleType(name)
    module.scaled_dot_product_attention = numpy_attn.scaled_dot_product_attention
    module.MultiHeadLatentAttention = cls
    return backends.from_module(module, name=name)


class _ScaledGainGradient(numpy_attn.MultiHeadLatentAttention):
    """The latent RMSNorm gain's gradient 2% too large."""

    def parameter_gradients(self, *args: Any, **kwargs: Any) -> dict[str, np.ndarray]:
        grads = super().parameter_gradients(*args, **kwargs)
        grads["kv_a_layernorm.weight"] = grads["kv_a_layernorm.weight"] * 1.02
        return grads


class _NotCausal(numpy_attn.MultiHeadLatentAttention):
    """The backward of the full (non-causal) attention whatever the forward options."""

    def parameter_gradients(self, x: Any, grad_output: Any, **kwargs: Any
                            ) -> dict[str, np.ndarray]:
        return super().parameter_gradients(x, grad_output, **{**kwargs, "is_causal": False})


@pytest.mark.parametrize("cls", [_ScaledGainGradient, _NotCausal])
def test_a_wrong_parameter_gradient_fails_grad_weights_alone(cls: type) -> None:
    for dtype in ("float64", "float32"):
        cell = runner.run_cell(_planted(f"planted_{cls.__name__}", cls),
                               expected(cases_mod.get(CASE), dtype))
        failing = {s.step for s in cell.steps if not s.passed}
        assert cell.status == "FAIL" and failing == {"grad_weights"}, (dtype, failing)
