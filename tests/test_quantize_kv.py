"""``quantize_kv`` and ``dequantize_kv`` (``conformance/spec/quantized_cache.py``): the quantiser
against an independent float64 quantiser (``quantized_helpers.py``), fp8 rounding against
ml_dtypes and torch's float8 casts, and the three backends against each other, bit for bit,
eager and jitted. The cache that holds their codes is ``test_quantized_cache.py``."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from quantized_helpers import (
    IDS,
    SCHEMES,
    as_numpy,
    codes_float64,
    fp8_grid,
    ref_fp8_round,
    reference,
    seeded_keys,
)

import jax_attn
import numpy_attn
import torch_attn

KVQuantization = numpy_attn.KVQuantization
BACKENDS = {"numpy_attn": (numpy_attn, np.asarray), "jax_attn": (jax_attn, jnp.asarray),
            "torch_attn": (torch_attn, torch.from_numpy)}

# ------------------------------------------------------------------------------------------
# The quantiser
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
@pytest.mark.parametrize("name", [  # jax: a compile per case
    pytest.param(name, marks=pytest.mark.slow) if name == "jax_attn" else name
    for name in BACKENDS])
def test_quantize_matches_the_float64_quantiser(name, scheme):
    module, convert = BACKENDS[name]
    x = seeded_keys()
    want_codes, want_values = reference(x, scheme)
    q = module.quantize_kv(convert(x), scheme)
    np.testing.assert_array_equal(codes_float64(q), want_codes, err_msg=f"{name} codes")
    values = as_numpy(module.dequantize_kv(q))
    assert values.dtype == np.float32
    np.testing.assert_array_equal(values, want_values, err_msg=f"{name} values")
    low, high = scheme.code_range
    assert np.all((codes_float64(q) >= low) & (codes_float64(q) <= high))


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_three_backends_give_the_same_bits(scheme):
    x = seeded_keys(seed=1)
    results = {}
    for name, (module, convert) in BACKENDS.items():
        q = module.quantize_kv(convert(x), scheme)
        codes = q.codes.view(torch.uint8) if isinstance(q.codes, torch.Tensor) else q.codes
        results[name] = (as_numpy(codes).view(np.uint8), as_numpy(q.scales),
                         as_numpy(module.dequantize_kv(q)).view(np.uint32))
    for name in ("jax_attn", "torch_attn"):
        for got, want in zip(results[name], results["numpy_attn"], strict=True):
            np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("scheme", [scheme for scheme in SCHEMES if scheme.zero_point],
                         ids=[name for scheme, name in zip(SCHEMES, IDS, strict=True)
                              if scheme.zero_point])
def test_jitted_dequantize_kv_keeps_the_zero_points_two_roundings(scheme):
    """Under ``jax.jit`` XLA's CPU backend would contract ``code · scale + zero_point`` into one
    fused multiply-add (one rounding; it did for most values before the guard): jitted
    ``dequantize_kv`` gives numpy_attn's bits, product rounded, then sum."""
    import jax

    x = seeded_keys(seed=4)
    want = numpy_attn.dequantize_kv(numpy_attn.quantize_kv(x, scheme)).view(np.uint32)
    q = jax_attn.quantize_kv(jnp.asarray(x), scheme)
    got = np.asarray(jax.jit(jax_attn.dequantize_kv)(q)).view(np.uint32)
    np.testing.assert_array_equal(got, want)


def test_all_zero_groups_dequantise_to_zero_and_constant_groups_exactly():
    x = seeded_keys()
    for scheme in [s for s in SCHEMES[:6] if s.granularity == "group"]:
        for module, convert in BACKENDS.values():
            values = as_numpy(module.dequantize_kv(module.quantize_kv(convert(x), scheme)))
            assert np.all(values[0, 0, 0, :32] == 0) and not np.isnan(values).any()
            if scheme.zero_point and scheme.granularity == "group":  # min = max = -1.25
                assert np.all(values[0, 0, 1, 64:] == -1.25)
    zeros = np.zeros((1, 2, 3, 64), np.float32)
    fp8 = (KVQuantization("float8_e4m3"), KVQuantization("float8_e5m2", granularity="head"))
    for scheme in fp8:
        for module, convert in BACKENDS.values():
            q = module.quantize_kv(convert(zeros), scheme)
            assert np.all(as_numpy(q.scales) == 0)
            assert np.all(as_numpy(module.dequantize_kv(q)) == 0)


def test_non_finite_values_poison_their_group_only():
    x = seeded_keys()[:1, :1, :2, :128].copy()
    x[0, 0, 0, 5], x[0, 0, 1, 70] = np.nan, np.inf
    for module, convert in BACKENDS.values():
        values = as_numpy(module.dequantize_kv(module.quantize_kv(convert(x), KVQuantization())))
        assert np.isnan(values[0, 0, 0, :64]).all() and np.isnan(values[0, 0, 1, 64:]).all()
        assert np.isfinite(values[0, 0, 0, 64:]).all() and np.isfinite(values[0, 0, 1, :64]).all()
        given = KVQuantization("float8_e4m3", scale=1.0)
        values = as_numpy(module.dequantize_kv(module.quantize_kv(convert(x), given)))
        assert np.isnan(values[0, 0, 0, 5]) and values[0, 0, 1, 70] == 448.0  # saturated
        assert np.isfinite(np.delete(values.ravel(), 5)).all()


# ------------------------------------------------------------------------------------------
# fp8 rounding: ml_dtypes and torch as external truth
# ------------------------------------------------------------------------------------------


def _sweep(dtype: str) -> np.ndarray:
    """Every fp8 value, every midpoint (a tie), each nudged by one float32 ulp, ±0."""
    grid = fp8_grid(dtype)
    mids = (grid[1:] + grid[:-1]) / 2
    values = np.concatenate([grid, mids]).astype(np.float32)
    nudged = np.concatenate([np.nextafter(values, np.float32(np.inf)),
                             np.nextafter(values, np.float32(0))])
    values = np.concatenate([values, nudged, [2.0**-12, 2.0**-20]]).astype(np.float32)
    values = values[values <= grid[-1]]
    return np.concatenate([values, -values, [np.float32(-0.0)]]).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float8_e4m3", "float8_e5m2"])
def test_fp8_casts_of_ml_dtypes_and_torch_agree_with_round_to_nearest_even(dtype):
    y = _sweep(dtype)
    ml = {"float8_e4m3": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}[dtype]
    th = {"float8_e4m3": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}[dtype]
    by_ml = y.astype(ml)
    by_torch = torch.from_numpy(y).to(th)
    np.testing.assert_array_equal(by_ml.view(np.uint8), by_torch.view(torch.uint8).numpy())
    want = ref_fp8_round(y.astype(np.float64), dtype)
    np.testing.assert_array_equal(by_ml.astype(np.float64), want)
    assert np.signbit(by_ml.astype(np.float32)[-1])  # -0 stays -0
    # the backends, scale 1: the same casts
    scheme = KVQuantization(dtype, scale=1.0)
    x = y.reshape(1, 1, 1, -1)
    for module, convert in BACKENDS.values():
        np.testing.assert_array_equal(codes_float64(module.quantize_kv(convert(x), scheme)).ravel(),
                                      want)


def test_fp8_casts_differ_beyond_the_maximum_so_the_spec_saturates_first():
    y = np.array([464.0, 465.0, 1000.0, np.inf], np.float32)  # e4m3fn max 448
    by_ml = y.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    by_torch = torch.from_numpy(y).to(torch.float8_e4m3fn).float().numpy()
    assert np.isnan(by_ml[1:]).all() and np.all(by_torch == 448.0)  # spec.QUANTIZED_SPECIAL_VALUES
    scheme = KVQuantization("float8_e4m3", scale=1.0)
    for module, convert in BACKENDS.values():
        x = np.concatenate([y, -y]).reshape(1, 1, 1, -1)
        codes = codes_float64(module.quantize_kv(convert(x), scheme))
        np.testing.assert_array_equal(codes.ravel(), [448.0] * 4 + [-448.0] * 4)


