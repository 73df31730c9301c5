"""The rotary cases of the harness (``conformance.cases.rotary``): the three backends pass them,
their float64 expected values are right by computations that share nothing with the backends
(hand-computed rotations, the relative-position property, the adjoint identity of the VJP,
the published scaling formulas), a checked module may leave the rotary embedding out or declare
it unsupported, the quick profile has a rotary row, and transformers' rotary modules agree
(float64: the known float32 angles)."""

from __future__ import annotations

import importlib.util
import math
import types
from typing import Any

import numpy as np
import pytest

import numpy_attn
from conformance import spec
from conformance.cases import catalogue as cases
from conformance.cases import expected as expected_mod
from conformance.cases import rotary
from conformance.running import backends, plugins, profiles, runner

ROTARY_CASES = [c.name for c in rotary.ROTARY_CASES]


def _run(names: list[str], case_names: list[str], dtypes: list[str]) -> Any:
    return runner.run(names, case_names, dtypes, check_errors=False, hypothesis=0)


# ------------------------------------------------------------------------------ backends


@pytest.mark.parametrize("backend", ["numpy", pytest.param("torch", marks=pytest.mark.slow),
                                     pytest.param("jax", marks=pytest.mark.slow)])
def test_every_backend_passes_every_rotary_step_in_float32_and_bfloat16(backend: str) -> None:
    result = _run([backend], ["rotary_*", "rope_*"], ["float32", "bfloat16"])
    assert len(result.cells) == 2 * len(ROTARY_CASES)
    for cell in result.cells:
        assert cell.status == "ok", (cell.case, cell.dtype, cell.detail)
        assert sorted(s.step for s in cell.steps) == sorted(rotary.ROTARY_STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_every_backend_passes_the_rotary_cases_in_float64_and_float16(backend: str) -> None:
    result = _run([backend], ["rotary_*", "rope_*"], ["float64", "float16"])
    assert [c.status for c in result.cells] == ["ok"] * (2 * len(ROTARY_CASES)), [
        (c.case, c.dtype, c.detail) for c in result.cells if c.status != "ok"]


# ------------------------------------------------------------------------------ references


def test_the_reference_rotates_a_unit_vector_by_hand() -> None:
    """e_0 at position 1: half pairs (0, r/2), interleaved (0, 1); the rest untouched."""
    x = np.zeros((1, 1, 1, 8))
    x[..., 0] = 1.0
    x[..., 7] = 5.0  # past rotary_dim 6: passes through
    inv = rotary.default_inv_freq(6, 10000.0)
    half = rotary.rotate(x, np.array([1]), inv, "half", 6)
    want = np.zeros(8)
    want[0], want[3], want[7] = math.cos(1.0), math.sin(1.0), 5.0
    np.testing.assert_allclose(half[0, 0, 0], want, atol=1e-15)
    inter = rotary.rotate(x, np.array([1]), inv, "interleaved", 6, attention_factor=2.0)
    want = np.zeros(8)
    want[0], want[1], want[7] = 2 * math.cos(1.0), 2 * math.sin(1.0), 5.0
    np.testing.assert_allclose(inter[0, 0, 0], want, atol=1e-15)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_the_reference_scores_depend_on_the_distance_only(layout: str) -> None:
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 8))
    inv = rotary.default_inv_freq(8, 10000.0)

    def score(p: int, p2: int) -> float:
        rq = rotary.rotate(q[None], np.array([p]), inv, layout, attention_factor=1.5)
        rk = rotary.rotate(k[None], np.array([p2]), inv, layout, attention_factor=1.5)
        return float(rq[0] @ rk[0])

    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-12)
    assert score(7, 3) != pytest.approx(score(8, 3), rel=1e-3)
    assert score(5, 5) == pytest.approx(1.5 ** 2 * float(q @ k), rel=1e-12)


def test_the_reference_vjp_is_the_adjoint_of_the_rotation() -> None:
    """<rotate(x), g> = <x, vjp(g)> for every x and g (the transpose, independently)."""
    rng = np.random.default_rng(1)
    x, g = rng.standard_normal((2, 2, 3, 6, 8))
    positions = np.array([-4, 0, 3, 9, 100, 7])
    inv = rotary.default_inv_freq(6, 500000.0)
    for layout in ("half", "interleaved"):
        forward = rotary.rotate(x, positions, inv, layout, 6, 1.3)
        back = rotary.rotate(g, positions, inv, layout, 6, 1.3, inverse=True)
        assert float(np.sum(forward * g)) == pytest.approx(float(np.sum(x * back)), rel=1e-12)


def test_the_reference_frequencies_follow_the_published_formulas() -> None:
    inv0 = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    linear, one = rotary.frequencies(8, 10000.0, {"rope_type": "linear", "factor": 4.0})
    np.testing.assert_allclose(linear, inv0 / 4, rtol=1e-15)
    assert one == 1.0
    _, yarn_factor = rotary.frequencies(8, 10000.0, rotary.YARN, max_position_embeddings=256)
    assert yarn_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)  # YaRN's mscale
    _, long_factor = rotary.frequencies(8, 10000.0, rotary.LONGROPE, seq_len=30)
    assert long_factor == pytest.approx(math.sqrt(1.5))  # sqrt(1 + ln 4 / ln 16)
    longs, _ = rotary.frequencies(8, 10000.0, rotary.LONGROPE, seq_len=30)
    shorts, _ = rotary.frequencies(8, 10000.0, rotary.LONGROPE, seq_len=16)
    np.testing.assert_allclose(longs, inv0 / np.array(rotary.LONGROPE["long_factor"]))
    np.testing.assert_allclose(shorts, inv0 / np.array(rotary.LONGROPE["short_factor"]))
    # Llama 3.1 at base 500000, head_dim 8: wavelengths 6.3 and 167 kept (< 8192 / 4),
    # 118 000 divided by 8 (> 8192), 4 450 in between.
    llama3, _ = rotary.frequencies(8, 500000.0, rotary.LLAMA3)
    base = 1.0 / 500000.0 ** (np.arange(0, 8, 2) / 8)
    smooth = (8192 * base[2] / (2 * math.pi) - 1.0) / 3.0
    np.testing.assert_allclose(llama3, [base[0], base[1], (1 - smooth) * base[2] / 8 +
                                        smooth * base[2], base[3] / 8], rtol=1e-14)


def test_the_expected_values_are_not_the_backends_own() -> None:
    """The module never calls a backend: a numpy_attn whose rotation is patched away leaves the
    expected values unchanged."""
    case = cases.get("rope_yarn_interleaved_decode")
    before = expected_mod.expected(case, "float64").values["rotary_output"]
    patched = pytest.MonkeyPatch()
    patched.setattr(numpy_attn, "rotary_embedding", lambda *a, **k: 0 / 0)
    try:
        after = expected_mod.expected(case, "float64").values["rotary_output"]
    finally:
        patched.undo()
    np.testing.assert_array_equal(before, after)


# ------------------------------------------------------------------------------ plugins


def _plugin(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.scaled_dot_product_attention = numpy_attn.scaled_dot_product_attention
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def _plugin_cells(module: types.ModuleType) -> list[Any]:
    backends.register(backends.from_module(module, name=module.__name__))
    try:
        return _run([module.__name__], ["rotary_half"], ["float32"]).cells
    finally:
        backends.unregister(module.__name__)


def test_a_rotary_case_uses_the_rotary_feature() -> None:
    assert "rotary" in spec.PLUGIN_FEATURES
    data = cases.prepare_inputs(cases.get("rotary_half"), "float32")
    assert "rotary" in plugins.features(data.arrays, data.options, "float32")
    sdpa = cases.prepare_inputs(cases.get("self"), "float32")
    assert "rotary" not in plugins.features(sdpa.arrays, sdpa.options, "float32")


def test_a_module_without_the_rotary_embedding_lists_it_as_not_provided() -> None:
    (cell,) = _plugin_cells(_plugin("no_rotary_attention"))
    assert cell.status == "not provided"
    assert "rotary_embedding" in cell.detail and "rope_frequencies" in cell.detail


def test_a_module_that_declares_rotary_unsupported_is_not_run() -> None:
    module = _plugin("declared_rotary_attention", UNSUPPORTED={"rotary"},
                     rotary_embedding=numpy_attn.rotary_embedding)
    (cell,) = _plugin_cells(module)
    assert (cell.status, cell.detail) == ("unsupported", "declared unsupported: rotary")


def test_a_module_with_the_rotation_alone_runs_that_step() -> None:
    (cell,) = _plugin_cells(_plugin("rotation_only", rotary_embedding=numpy_attn.rotary_embedding))
    assert cell.status == "ok"
    assert [s.step for s in cell.steps] == ["rotary_output"]
    assert set(cell.skipped) == {"rotary_grad_x", "rope_inv_freq", "rope_attention_factor"}


def test_a_bshd_module_gets_x_with_the_sequence_axis_first() -> None:
    def rotary_embedding(x: Any, positions: Any, **kw: Any) -> Any:
        assert np.shape(x)[-2] == 2  # (batch, seq, heads, head_dim): heads 2, seq 6
        turned = numpy_attn.rotary_embedding(np.swapaxes(x, -3, -2), positions, **kw)
        return np.swapaxes(turned, -3, -2)

    (cell,) = _plugin_cells(_plugin("bshd_rotary", LAYOUT="bshd",
                                    rotary_embedding=rotary_embedding))
    assert cell.status == "ok", cell.detail


# ------------------------------------------------------------------------------ profiles


def test_the_quick_profile_has_one_rotary_row_covering_every_rotary_step() -> None:
    rows = [r for r in profiles.quick_rows() if r[0] in ROTARY_CASES]
    assert len(rows) == 1, rows
    assert {"rotary", *(f"step:{s}" for s in rotary.ROTARY_STEPS)} <= profiles.required_items()


# ------------------------------------------------------------------------------ peers

ROPE_PEERS = ("transformers.rope[llama]", "transformers.rope[deepseek_v3]",
              "transformers.rope[gpt_neox]")


@pytest.mark.slow
@pytest.mark.parametrize("name", ROPE_PEERS)
def test_transformers_rotary_columns_agree(name: str) -> None:
    """float32 and bfloat16: ok or n/a (at least three cases ok); float64: the known float32
    angles, verified against that alternative."""
    pytest.importorskip("transformers")
    from conformance import peers

    peer = peers.get(name)
    statuses: dict[str, list[str]] = {"float32": [], "bfloat16": [], "float64": []}
    for case in rotary.ROTARY_CASES:
        for dtype in statuses:
            cell = runner.run_peer_cell(peer, expected_mod.expected(case, dtype))
            statuses[dtype].append(cell.status)
            if dtype == "float64" and cell.status != "n/a":
                assert cell.status == "known", (case.name, cell.detail)
                assert cell.alternatives == ("f32 angles",)
            elif dtype != "float64":
                assert cell.status in ("ok", "n/a"), (case.name, dtype, cell.detail)
    assert statuses["float32"].count("ok") >= 3
    assert statuses["float32"] == statuses["bfloat16"]


@pytest.mark.slow
def test_deepseek_returns_the_rotated_pairs_deinterleaved() -> None:
    """Unchanged, apply_rotary_pos_emb_interleave's result is far from the interleaved rotation
    (the pairs in half order); re-interleaved it equals it."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers: pip install transformers torch")
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb_interleave,
    )

    from conformance.peers.transformers_rotary import reinterleave

    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 6, 8))
    positions = np.arange(6)
    inv = rotary.default_inv_freq(8, 10000.0)
    angles = positions[:, None] * inv  # (seq, 4)
    emb = np.concatenate([angles, angles], -1)[None]  # (1, seq, 8): cat(freqs, freqs)
    t = torch.from_numpy
    raw, _ = apply_rotary_pos_emb_interleave(t(x), t(x), t(np.cos(emb)), t(np.sin(emb)))
    want = rotary.rotate(x, positions, inv, "interleaved")
    assert np.abs(raw.numpy() - want).max() > 0.5
    np.testing.assert_allclose(reinterleave(raw.numpy(), 8), want, atol=1e-12)
