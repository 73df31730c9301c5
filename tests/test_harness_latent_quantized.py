"""The harness's quantised-cache cases (``conformance.cases.quantized``) and its MLA module case
(``conformance.cases.latent``): every backend passes them, and their expected values are
independent of the backends.

Independence: the quantiser's rounding is checked against hand-counted codes (ties to even, an
all-zero group, fp8 saturation and ties on the fp8 grid), the fp8 ordinals against the grid's
own neighbours, the cache's window rule against transformers' ``QuantizedLayer.update`` steps
counted by hand, and the float64 MLA against an einsum-only formula of the naive form written
here and against its own absorbed form (the spec says the two are equal).
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.cases import catalogue as cases_mod
from conformance.cases import latent, quantized, quantizer
from conformance.cases.expected import expected
from conformance.running import backends, plugins, runner
from conformance.spec import PLUGIN_FEATURES

QUANT_CASES = [c.name for c in quantized.QUANTIZED_CASES]
LATENT_CASES = [c.name for c in latent.LATENT_CASES]


# ------------------------------------------------------------------------------ independence


def test_round_half_even_and_away_on_ties() -> None:
    r = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 2.4999, 2.5001])
    assert quantizer.round_half_even(r).tolist() == [-2, -2, -0, 0, 2, 2, 2, 3]
    assert quantizer.round_half_away(r).tolist() == [-3, -2, -1, 1, 2, 3, 2, 3]


def test_integer_codes_of_planted_ties_and_zeros() -> None:
    """The first group of token 0 is (127, 2.5, -0.5, -3.5) · 2^-4: codes 127, 2, 0, -4; the
    all-zero group has scale 0, codes 0 and values exactly +0."""
    data = cases_mod.get("quant_int8_group").data()
    got = quantizer.quantize(data.arrays["x"], quantized.scheme_options(data.options))
    assert got["codes"][0, 0, 0, :4].tolist() == [127, 2, 0, -4]
    assert got["scales"][0, 0, 0, 0] == 2.0 ** -4
    assert got["scales"][1, 1, 1, 0] == 0.0
    zeros = got["values"][1, 1, 1, :4]
    assert (zeros == 0).all() and not np.signbit(zeros).any()


def test_zero_point_codes_and_a_constant_group() -> None:
    data = cases_mod.get("quant_int4_zero_point_group").data()
    got = quantizer.quantize(data.arrays["x"], quantized.scheme_options(data.options))
    assert got["codes"][0, 0, 0, :4].tolist() == [0, 15, 2, 4]  # ratios 0, 15, 2.5, 4.5
    assert got["zero_points"][0, 0, 0, 0] == -1.0
    assert (got["values"][1, 1, 2, 4:] == 0.75).all()  # a constant group: its value exactly


def test_fp8_ties_saturation_and_ordinals() -> None:
    """At scale 0.5 the e4m3 ties 1.0625 → 1.0 and 1.1875 → 1.25 (even mantissas); 600 and 2000
    saturate to 448 (ml_dtypes alone gives NaN); e5m2's 80000 saturates to 57344, not inf."""
    data = cases_mod.get("quant_fp8_e4m3_head_saturate").data()
    scheme = quantized.scheme_options(data.options)
    got = quantizer.quantize(data.arrays["x"], scheme)
    assert got["codes"][0, 0, 0, :2].tolist() == [1.0, 1.25]
    assert got["codes"][1, 0, 3, :4].tolist() == [448.0, -448.0, 448.0, -448.0]
    raw = quantizer.quantize(data.arrays["x"], scheme, saturate=False)
    assert np.isnan(raw["codes"][1, 0, 3, :4]).all()
    e5 = cases_mod.get("quant_fp8_e5m2_tensor_saturate").data()
    got5 = quantizer.quantize(e5.arrays["x"], quantized.scheme_options(e5.options))
    assert got5["codes"][1, 0, 3, 2] == 57344.0
    grid = quantizer.fp8_grid("float8_e4m3")
    assert len(grid) == 127 and grid[-1] == 448.0  # 0x00 .. 0x7e, 0x7f is NaN
    ords = quantizer.fp8_ordinals(np.array([0.0, grid[1], -grid[5], 448.0]), "float8_e4m3")
    assert ords.tolist() == [0, 1, -5, 126]


def test_the_window_rule_counted_by_hand() -> None:
    """Appends 4 1 1 1 2 with a window of 3: the prompt quantised, two tokens held, the third
    single token fills the window (2 + 1 >= 3: all three quantised), the last two held."""
    held, stored, moves = 0, 0, []
    for n in quantized.CACHE_APPENDS:
        move = quantized.moves_to_store(stored + held, held, n, 3)
        moves.append(move)
        stored, held = (stored + held + n, 0) if move else (stored, held + n)
    assert moves == [True, False, False, True, False]
    assert (stored, held) == (7, 2)


def _einsum_naive(data: cases_mod.CaseData) -> np.ndarray:
    """The naive MLA of the case with einsums only, from the spec's formulas."""
    o, a = data.options["init"], data.arrays
    w = {n[2:]: x for n, x in a.items() if n.startswith("w:")}
    x = a["x"]
    h, r, dn, dr, dv = (o[k] for k in ("num_heads", "kv_lora_rank", "qk_nope_head_dim",
                                       "qk_rope_head_dim", "v_head_dim"))

    def rms(t: np.ndarray, g: np.ndarray) -> np.ndarray:
        return g * t / np.sqrt((t ** 2).mean(-1, keepdims=True) + 1e-6)

    def rope(t: np.ndarray) -> np.ndarray:  # interleaved pairs as complex numbers
        pos = np.arange(t.shape[-2])[:, None]
        inv = 10000.0 ** (-np.arange(0, t.shape[-1], 2) / t.shape[-1])
        z = (t[..., 0::2] + 1j * t[..., 1::2]) * np.exp(1j * pos * inv)
        out = np.empty_like(t)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out

    q = rms(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"]) @ w["q_b_proj.weight"].T
    q = q.reshape(*q.shape[:-1], h, dn + dr).swapaxes(-2, -3)
    kv_a = x @ w["kv_a_proj_with_mqa.weight"].T
    c = rms(kv_a[..., :r], w["kv_a_layernorm.weight"])
    kv = (c @ w["kv_b_proj.weight"].T).reshape(*c.shape[:-1], h, dn + dv).swapaxes(-2, -3)
    k_pe = rope(kv_a[..., None, :, r:])
    scores = (np.einsum("bhqd,bhkd->bhqk", q[..., :dn], kv[..., :dn])
              + np.einsum("bhqd,bxkd->bhqk", rope(q[..., dn:]), k_pe)) / np.sqrt(dn + dr)
    s = x.shape[-2]
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    context = np.einsum("bhqk,bhkd->bhqd", p, kv[..., dn:]).swapaxes(-2, -3)
    return context.reshape(*context.shape[:-2], -1) @ w["o_proj.weight"].T


def test_the_float64_mla_equals_an_einsum_formula_and_its_absorbed_form() -> None:
    data = cases_mod.get(LATENT_CASES[0]).data()
    independent = _einsum_naive(data)
    np.testing.assert_allclose(latent.mla(data), independent, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(latent.mla(data, absorbed=True), independent, rtol=1e-12,
                               atol=1e-12)
    assert np.abs(latent.mla(data, rope_all=True) - independent).max() > 0.1


# ------------------------------------------------------------------------------ the harness


def test_the_cases_and_their_steps() -> None:
    steps = set()
    for name in QUANT_CASES + LATENT_CASES:
        exp = expected(cases_mod.get(name), "float32")
        steps |= set(exp.values)
    assert set(quantized.QUANTIZED_STEPS) | {"latent_absorbed_output", "decode_output",
                                             "output"} <= steps
    assert "grad_weights" in expected(cases_mod.get(LATENT_CASES[0]), "float32").values


def test_codes_are_exact_under_the_tolerance() -> None:
    """An integer or fp8 code one step off fails even in bfloat16 (baseline 0)."""
    for name in ("quant_int8_group", "quant_fp8_e5m2_head"):
        exp = expected(cases_mod.get(name), "bfloat16")
        assert exp.baseline["quantized_codes"] == 0.0


def test_features_and_contract() -> None:
    assert {"latent_attention", "quantized_cache"} <= set(PLUGIN_FEATURES)
    exp = expected(cases_mod.get("quant_cache_residual"), "float32")
    assert "quantized_cache" in plugins.features(exp.data.arrays, exp.data.options, "float32")
    exp = expected(cases_mod.get(LATENT_CASES[0]), "float32")
    assert "latent_attention" in plugins.features(exp.data.arrays, exp.data.options, "float32")
    assert {"MultiHeadLatentAttention", "QuantizedKVCache"} <= set(plugins.OPTIONAL)


def test_numpy_passes_every_case_in_every_dtype() -> None:
    result = runner.run(["numpy"], QUANT_CASES + LATENT_CASES, None, check_errors=False,
                        hypothesis=0)
    assert len(result.cells) == 4 * len(QUANT_CASES + LATENT_CASES)
    assert all(c.status == "ok" for c in result.cells), [
        (c.case, c.dtype, c.detail, [s for s in c.steps if not s.passed])
        for c in result.cells if c.status != "ok"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_jax_and_torch_pass_every_case(backend: str) -> None:
    if not backends.get(backend).available():
        pytest.skip(f"{backend} is not installed")
    result = runner.run([backend], QUANT_CASES + LATENT_CASES, ["float32", "bfloat16"],
                        check_errors=False, hypothesis=0)
    assert all(c.status == "ok" for c in result.cells), [
        (c.case, c.dtype, c.detail, [s for s in c.steps if not s.passed])
        for c in result.cells if c.status != "ok"]


def test_a_module_without_them_lists_them_as_not_provided_and_may_declare_them() -> None:
    import types

    import numpy_attn

    module = types.ModuleType("bare")
    module.scaled_dot_product_attention = numpy_attn.scaled_dot_product_attention
    contract = plugins.contract_of(module)
    assert {"quantize_kv", "dequantize_kv", "QuantizedKVCache",
            "MultiHeadLatentAttention"} <= set(contract.not_provided)
    backends.register(backends.from_module(module, name="bare"))
    try:
        result = runner.run(["bare"], ["quant_int8_group", LATENT_CASES[0]], ["float32"],
                            check_errors=False, hypothesis=0)
    finally:
        backends.unregister("bare")
    assert [c.status for c in result.cells] == ["not provided"] * 2
    module.UNSUPPORTED = {"latent_attention", "quantized_cache"}
    module.quantize_kv = numpy_attn.quantize_kv
    backends.register(backends.from_module(module, name="declares"))
    try:
        result = runner.run(["declares"], ["quant_int8_group", LATENT_CASES[0]], ["float32"],
                            check_errors=False, hypothesis=0)
    finally:
        backends.unregister("declares")
    assert [c.status for c in result.cells] == ["unsupported"] * 2
