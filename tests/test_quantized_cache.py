"""Quantised KV caches (``conformance/spec/quantized_cache.py``): the quantiser against an
independent float64 quantiser written here, fp8 rounding against ml_dtypes and torch's float8
casts, the three backends against each other, the cache's attention against attention over
the dequantised keys and values, the residual window against transformers' rule, and errors."""

from __future__ import annotations

import importlib
import inspect

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from quantized_helpers import IDS, SCHEMES, reference_attention, seeded_keys

import jax_attn
import numpy_attn
import torch_attn
from conformance import spec

KVQuantization = numpy_attn.KVQuantization
BACKENDS = {"numpy_attn": (numpy_attn, np.asarray), "jax_attn": (jax_attn, jnp.asarray),
            "torch_attn": (torch_attn, torch.from_numpy)}
# ------------------------------------------------------------------------------------------
# The independent float64 quantiser (each float32 operation: float64 then one rounding to
# float32, which equals float32's correctly rounded +, -, *, /)
# ------------------------------------------------------------------------------------------

f32 = np.float32


def round_half_even(y: np.ndarray) -> np.ndarray:
    """Round to the nearest integer, ties to the even one, written out (not np.rint)."""
    low = np.floor(y)
    frac = y - low
    odd = np.mod(low, 2) == 1
    return np.where(frac > 0.5, low + 1, np.where(frac < 0.5, low, np.where(odd, low + 1, low)))


def ref_integer(x: np.ndarray, scheme: KVQuantization) -> tuple[np.ndarray, np.ndarray]:
    """Codes and dequantised values (float32) of integer schemes."""
    bits = {"int8": 8, "int4": 4}[scheme.dtype]
    size = x.shape[-1] if scheme.granularity == "token" else scheme.group_size
    g = x.astype(np.float64).reshape(x.shape[:-1] + (-1, size))
    if scheme.zero_point:
        top, bottom = 2.0**bits - 1, 0.0
        lo = g.min(-1, keepdims=True)
        scale = f32(f32(g.max(-1, keepdims=True) - lo).astype(np.float64) / top).astype(float)
        shifted = f32(g - lo).astype(np.float64)
    else:
        top = 2.0 ** (bits - 1) - 1
        bottom, lo = -top, 0.0
        scale = f32(np.abs(g).max(-1, keepdims=True) / top).astype(np.float64)
        shifted = g
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(scale > 0, f32(shifted / scale).astype(np.float64), 0.0)
    codes = np.clip(round_half_even(y), bottom, top)
    values = f32(codes * scale).astype(np.float64)
    if scheme.zero_point:
        values = f32(values + lo)
    return codes.reshape(x.shape), f32(values).reshape(x.shape)


def fp8_grid(dtype: str) -> np.ndarray:
    """Every non-negative finite value of the format, in code order (written from the format:
    e4m3fn bias 7, 3 mantissa bits, no inf, top code NaN; e5m2 bias 15, 2 bits, IEEE)."""
    man, bias, top_exp = (3, 7, 15) if dtype == "float8_e4m3" else (2, 15, 30)
    values = [m / 2**man * 2.0 ** (1 - bias) for m in range(2**man)]  # 0 and subnormals
    for e in range(1, top_exp + 1):
        values += [(1 + m / 2**man) * 2.0 ** (e - bias) for m in range(2**man)]
    if dtype == "float8_e4m3":
        values = values[:-1]  # S.1111.111 is NaN
    return np.array(values)


def ref_fp8_round(y: np.ndarray, dtype: str) -> np.ndarray:
    """Round to nearest, ties to even code, on the grid; |y| <= max (NaN stays NaN)."""
    grid = fp8_grid(dtype)
    mag = np.abs(y)
    hi = np.clip(np.searchsorted(grid, mag), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    out = np.copysign(grid[pick], y)
    return np.where(np.isnan(y), np.nan, out)


def ref_fp8(x: np.ndarray, scheme: KVQuantization) -> tuple[np.ndarray, np.ndarray]:
    """Codes (as float64 values) and dequantised values (float32) of fp8 schemes."""
    top = {"float8_e4m3": 448.0, "float8_e5m2": 57344.0}[scheme.dtype]
    x = x.astype(np.float64)
    if scheme.scale is not None:  # a given scale, rounded to float32
        scale = f32(np.asarray(scheme.scale)).astype(np.float64)
    elif scheme.granularity == "head":
        scale = f32(np.abs(x).max(axis=(0, 2, 3)) / top).astype(np.float64)
    else:
        scale = f32(np.abs(x).max() / top).astype(np.float64)
    scale = scale.reshape(scale.shape + (1, 1)) if scale.ndim == 1 else scale
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(scale > 0, f32(x / scale).astype(np.float64), 0.0)
    codes = ref_fp8_round(np.clip(y, -top, top), scheme.dtype)
    return codes, f32(codes * scale)


def reference(x: np.ndarray, scheme: KVQuantization) -> tuple[np.ndarray, np.ndarray]:
    return ref_fp8(x, scheme) if scheme.is_float8 else ref_integer(x, scheme)


def _numpy(x: object) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _codes(q: object) -> np.ndarray:
    """The codes as float64 numbers (fp8 through float32: exact)."""
    codes = q.codes
    if isinstance(codes, torch.Tensor):
        codes = codes.to(torch.float32) if codes.dtype.is_floating_point else codes
    return _numpy(codes).astype(np.float64)


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
    np.testing.assert_array_equal(_codes(q), want_codes, err_msg=f"{name} codes")
    values = _numpy(module.dequantize_kv(q))
    assert values.dtype == np.float32
    np.testing.assert_array_equal(values, want_values, err_msg=f"{name} values")
    low, high = scheme.code_range
    assert np.all((_codes(q) >= low) & (_codes(q) <= high))


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_three_backends_give_the_same_bits(scheme):
    x = seeded_keys(seed=1)
    results = {}
    for name, (module, convert) in BACKENDS.items():
        q = module.quantize_kv(convert(x), scheme)
        codes = q.codes.view(torch.uint8) if isinstance(q.codes, torch.Tensor) else q.codes
        results[name] = (_numpy(codes).view(np.uint8), _numpy(q.scales),
                         _numpy(module.dequantize_kv(q)).view(np.uint32))
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
            values = _numpy(module.dequantize_kv(module.quantize_kv(convert(x), scheme)))
            assert np.all(values[0, 0, 0, :32] == 0) and not np.isnan(values).any()
            if scheme.zero_point and scheme.granularity == "group":  # min = max = -1.25
                assert np.all(values[0, 0, 1, 64:] == -1.25)
    zeros = np.zeros((1, 2, 3, 64), np.float32)
    fp8 = (KVQuantization("float8_e4m3"), KVQuantization("float8_e5m2", granularity="head"))
    for scheme in fp8:
        for module, convert in BACKENDS.values():
            q = module.quantize_kv(convert(zeros), scheme)
            assert np.all(_numpy(q.scales) == 0)
            assert np.all(_numpy(module.dequantize_kv(q)) == 0)


def test_non_finite_values_poison_their_group_only():
    x = seeded_keys()[:1, :1, :2, :128].copy()
    x[0, 0, 0, 5], x[0, 0, 1, 70] = np.nan, np.inf
    for module, convert in BACKENDS.values():
        values = _numpy(module.dequantize_kv(module.quantize_kv(convert(x), KVQuantization())))
        assert np.isnan(values[0, 0, 0, :64]).all() and np.isnan(values[0, 0, 1, 64:]).all()
        assert np.isfinite(values[0, 0, 0, 64:]).all() and np.isfinite(values[0, 0, 1, :64]).all()
        given = KVQuantization("float8_e4m3", scale=1.0)
        values = _numpy(module.dequantize_kv(module.quantize_kv(convert(x), given)))
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
        np.testing.assert_array_equal(_codes(module.quantize_kv(convert(x), scheme)).ravel(),
                                      want)


def test_fp8_casts_differ_beyond_the_maximum_so_the_spec_saturates_first():
    y = np.array([464.0, 465.0, 1000.0, np.inf], np.float32)  # e4m3fn max 448
    by_ml = y.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    by_torch = torch.from_numpy(y).to(torch.float8_e4m3fn).float().numpy()
    assert np.isnan(by_ml[1:]).all() and np.all(by_torch == 448.0)  # spec.QUANTIZED_SPECIAL_VALUES
    scheme = KVQuantization("float8_e4m3", scale=1.0)
    for module, convert in BACKENDS.values():
        codes = _codes(module.quantize_kv(convert(np.concatenate([y, -y]).reshape(1, 1, 1, -1)),
                                          scheme))
        np.testing.assert_array_equal(codes.ravel(), [448.0] * 4 + [-448.0] * 4)


# ------------------------------------------------------------------------------------------
# The cache
# ------------------------------------------------------------------------------------------


def transformers_residual_rule(appends: list[int], residual: int) -> list[tuple[int, int]]:
    """(stored, window) after each append, replaying transformers 5.25's
    QuantizedLayer.update (read from its source): the first update quantises everything;
    later, ``if residual_in_window + n >= residual_length`` everything is re-quantised and the
    window emptied, else the new tokens join the window."""
    stored = window = 0
    initialised = False
    out = []
    for n in appends:
        if not initialised:
            initialised, stored = True, n
        elif window + n >= residual:
            stored, window = stored + window + n, 0
        else:
            window += n
        out.append((stored, window))
    return out


@pytest.mark.slow  # jax: an eager op per append
@pytest.mark.parametrize("residual", [0, 1, 2, 3, 5])
def test_the_residual_window_moves_tokens_as_transformers_does(residual):
    appends = [3, 1, 1, 1, 2, 1, 4, 1, 1, 1, 1]
    want = transformers_residual_rule(appends, max(residual, 1) if residual else 0)
    if residual == 0:
        want = [(sum(appends[: i + 1]), 0) for i in range(len(appends))]
    scheme = KVQuantization("int4", residual=residual, group_size=32)
    rng = np.random.default_rng(2)
    chunks = [rng.standard_normal((1, 2, n, 64)).astype(np.float32) for n in appends]
    for name, (module, convert) in BACKENDS.items():
        cache = module.QuantizedKVCache.empty((1,), 2, sum(appends), 64, scheme=scheme)
        for i, chunk in enumerate(chunks):
            cache = cache.append(convert(chunk), convert(chunk * 2))
            assert (cache.stored_length, cache.residual_length) == want[i], (name, i)
            everything = np.concatenate(chunks[: i + 1], axis=-2)
            stored = cache.stored_length
            keys = _numpy(cache.keys)
            np.testing.assert_array_equal(keys[..., stored:, :], everything[..., stored:, :])
            np.testing.assert_array_equal(keys[..., :stored, :],
                                          ref_integer(everything[..., :stored, :], scheme)[1])
            np.testing.assert_array_equal(_numpy(cache.values)[..., :stored, :], ref_integer(
                2 * everything[..., :stored, :], scheme)[1])


def test_residual_window_off_by_one_boundaries():
    """R = 4: a window of 3 plus 1 token flushes (3 + 1 >= 4); 2 + 1 does not."""
    scheme = KVQuantization("int8", residual=4)
    x = np.ones((1, 1, 1, 64), np.float32)
    for module, convert in BACKENDS.values():
        cache = module.QuantizedKVCache.empty((), 1, 16, 64, scheme=scheme)
        cache = cache.append(convert(x[0]), convert(x[0]))  # the first append: quantised
        sizes = []
        for _ in range(5):
            cache = cache.append(convert(x[0]), convert(x[0]))
            sizes.append((cache.stored_length, cache.residual_length))
        assert sizes == [(1, 1), (1, 2), (1, 3), (5, 0), (5, 1)]


@pytest.mark.slow  # jax: a compile per cache length
@pytest.mark.parametrize("scheme", [
    KVQuantization("int8", residual=3),
    KVQuantization("int4", zero_point=True, granularity="token"),
    KVQuantization("float8_e4m3", granularity="head", residual=2),
], ids=["int8-r3", "int4-zp-token", "e4m3-head-r2"])
@pytest.mark.parametrize("kv_len", [9, 300])  # 300: split-KV decoding (SPLIT_KV min_kv_len)
def test_cache_attention_equals_attention_over_dequantised_keys(scheme, kv_len):
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((1, 2, kv_len, 64)).astype(np.float32)
    values = rng.standard_normal((1, 2, kv_len, 32)).astype(np.float32)
    query = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    value_scheme = KVQuantization(scheme.dtype, granularity=scheme.granularity,
                                  zero_point=scheme.zero_point, group_size=32,
                                  residual=scheme.residual)
    first = kv_len - 2
    outputs = {}
    for name, (module, convert) in BACKENDS.items():
        cache = module.QuantizedKVCache.empty((1,), 2, kv_len, 64, 32, scheme=scheme,
                                              value_scheme=value_scheme)
        cache = cache.append(convert(keys[..., :first, :]), convert(values[..., :first, :]))
        for t in range(first, kv_len):
            cache = cache.append(convert(keys[..., t:t + 1, :]), convert(values[..., t:t + 1, :]))
        outputs[name] = _numpy(cache.attend(convert(query)))
        stored = cache.stored_length
        # the expected cache: the float64 quantiser's values, the window as appended
        want_k = keys.copy()
        want_v = values.copy()
        if scheme.is_float8:  # calibrated on the first append, then kept
            k_scale = f32(np.abs(keys[..., :first, :]).max(axis=(0, 2, 3)) / 448.0)
            v_scale = f32(np.abs(values[..., :first, :]).max(axis=(0, 2, 3)) / 448.0)
            want_k[..., :stored, :] = ref_fp8(keys[..., :stored, :], KVQuantization(
                scheme.dtype, granularity="head", scale=tuple(map(float, k_scale))))[1]
            want_v[..., :stored, :] = ref_fp8(values[..., :stored, :], KVQuantization(
                scheme.dtype, granularity="head", scale=tuple(map(float, v_scale))))[1]
        else:
            want_k[..., :stored, :] = ref_integer(keys[..., :stored, :], scheme)[1]
            want_v[..., :stored, :] = ref_integer(values[..., :stored, :], value_scheme)[1]
        np.testing.assert_array_equal(_numpy(cache.keys), want_k)
        np.testing.assert_array_equal(_numpy(cache.values), want_v)
        want = reference_attention(query, want_k, want_v)
        np.testing.assert_allclose(outputs[name], want, rtol=2e-5, atol=2e-6, err_msg=name)
        float_output = reference_attention(query, keys, values)
        assert np.abs(outputs[name] - float_output).max() > 0  # the quantisation is visible


def test_transformers_fp8_layer_matches_a_given_first_append_scale():
    """transformers 5.25's Fp8QuantizedLayer (torch only: it runs here) calibrates a
    per-tensor e4m3 scale on its first update and keeps it: the same rule as a dynamic
    float8_e4m3 'tensor' cache."""
    cache_utils = pytest.importorskip("transformers.cache_utils")
    layer_class = getattr(cache_utils, "Fp8QuantizedLayer", None)
    if layer_class is None:
        pytest.skip("this transformers has no Fp8QuantizedLayer")
    rng = np.random.default_rng(4)
    k1, v1 = (torch.from_numpy(rng.standard_normal((1, 2, 6, 64)).astype(np.float32))
              for _ in range(2))
    k2, v2 = (torch.from_numpy(rng.standard_normal((1, 2, 3, 64)).astype(np.float32) * 4)
              for _ in range(2))
    layer = layer_class()
    layer.update(k1, v1)
    keys, values = layer.update(k2, v2)
    scheme = KVQuantization("float8_e4m3")
    cache = torch_attn.QuantizedKVCache.empty((1,), 2, 9, 64, scheme=scheme)
    cache.append(k1, v1).append(k2, v2)
    assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)


def test_transformers_integer_backends_in_the_spec():
    """transformers' QuantizedCache integer backends: quanto is compared
    (tests/test_quantized_cache_transformers.py, optimum-quanto in requirements-test.txt);
    HQQ is not installed, and the spec says so (QUANTIZED_PEERS). Fails once hqq is
    installed, so its peer gets written."""
    with pytest.raises(ImportError):
        importlib.import_module("hqq")
    assert "optimum-quanto 0.2.7" in spec.QUANTIZED_PEERS
    assert "hqq is not installed" in spec.QUANTIZED_PEERS


# ------------------------------------------------------------------------------------------
# Errors and signatures
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"dtype": "int3"}, {"dtype": "int8", "granularity": "head"},
    {"dtype": "float8_e4m3", "granularity": "group"}, {"group_size": 0},
    {"zero_point": 1}, {"dtype": "float8_e5m2", "zero_point": True},
    {"dtype": "int8", "scale": 0.1}, {"dtype": "float8_e4m3", "scale": 0.0},
    {"dtype": "float8_e4m3", "scale": float("nan")},
    {"dtype": "float8_e4m3", "granularity": "head", "scale": 1.0}, {"residual": -1},
])
def test_scheme_errors_name_the_argument(kwargs):
    name = [k for k in kwargs if k != "dtype"][-1] if len(kwargs) > 1 or "dtype" not in kwargs \
        else "dtype"
    with pytest.raises(ValueError, match=f"KVQuantization: {name}"):
        KVQuantization(**kwargs)


def _error(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the type and message are compared
        return type(error), str(error)
    return None


def _failing_calls(module, convert) -> dict:
    """One bad call per error rule, for one backend."""
    x = np.zeros((1, 3, 2, 48), np.float32)
    empty = module.QuantizedKVCache.empty
    return {
        "scheme": lambda: module.quantize_kv(convert(x), "int8"),
        "dtype": lambda: module.quantize_kv(convert(x.astype(np.int32)), KVQuantization()),
        "rank": lambda: module.quantize_kv(convert(x[0, 0]), KVQuantization()),
        "group_size": lambda: module.quantize_kv(convert(x), KVQuantization()),
        "head_scale": lambda: module.quantize_kv(convert(x), KVQuantization(
            "float8_e4m3", granularity="head", scale=(1.0, 2.0))),
        "dequantize": lambda: module.dequantize_kv(convert(x)),
        "cache_scheme": lambda: empty((1,), 3, 4, 48, scheme=None),
        "cache_residuals": lambda: empty((1,), 3, 4, 48, scheme=KVQuantization(residual=2),
                                         value_scheme=KVQuantization()),
        "cache_group": lambda: empty((1,), 3, 4, 48, scheme=KVQuantization()),
        "append_shape": lambda: empty((1,), 3, 4, 64, scheme=KVQuantization()).append(
            convert(x), convert(x)),
        "append_room": lambda: empty((1,), 3, 1, 48, scheme=KVQuantization(
            granularity="token")).append(convert(x), convert(x)),
    }


@pytest.mark.parametrize("case", [
    "scheme", "dtype", "rank", "group_size", "head_scale", "dequantize", "cache_scheme",
    "cache_residuals", "cache_group", "append_shape", "append_room",
])
def test_errors_are_the_same_in_every_backend(case):
    errors = {name: _error(_failing_calls(module, convert)[case])
              for name, (module, convert) in BACKENDS.items()}
    assert errors["numpy_attn"] is not None
    same = {name: (kind, text.split("; got type(")[0])  # type names are the library's
            for name, (kind, text) in errors.items()}
    assert same["numpy_attn"] == same["jax_attn"] == same["torch_attn"], errors
    kind, message = errors["numpy_attn"]
    named = {"scheme": "scheme", "dtype": "x", "rank": "x", "group_size": "group_size",
             "head_scale": "scale", "dequantize": "q", "cache_scheme": "scheme",
             "cache_residuals": "residual", "cache_group": "group_size",
             "append_shape": "key", "append_room": "max_len"}[case]
    assert named in message, message


def _parameters(obj):
    return [(p.name, p.kind, p.default) for p in inspect.signature(obj).parameters.values()
            if p.name != "self"]


@pytest.mark.parametrize("name", list(BACKENDS))
def test_cache_methods_have_the_spec_signatures(name):
    module = BACKENDS[name][0]
    for method in ("empty", "append", "attend"):
        assert _parameters(getattr(module.QuantizedKVCache, method)) == _parameters(
            getattr(spec.QuantizedKVCache, method)), method
    assert _parameters(module.KVQuantization) == _parameters(spec.KVQuantization.__init__)


def test_bytes_per_token_and_nbytes():
    from attention_rules.quantizing import bytes_per_token

    assert bytes_per_token(KVQuantization("int8"), 8, 128) == 8 * 128 + 8 * 2 * 4
    assert bytes_per_token(KVQuantization("int4", zero_point=True), 8, 128) == 8 * 64 + 8 * 2 * 8
    assert bytes_per_token(KVQuantization("float8_e5m2"), 8, 128) == 8 * 128
    for module, _ in BACKENDS.values():
        cache = module.QuantizedKVCache.empty((1,), 2, 10, 64, scheme=KVQuantization(
            "int8", residual=3))
        # codes 1 byte, one float32 scale per (head, position), windows of 3 float32 tokens
        assert cache.nbytes == 2 * (2 * 10 * 64 + 2 * 10 * 4 + 2 * 3 * 64 * 4)


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("scheme", [
    numpy_attn.KVQuantization("int4", group_size=4, zero_point=True),
    numpy_attn.KVQuantization("int8", granularity="token"),
    numpy_attn.KVQuantization("float8_e4m3"),
], ids=["int4_group_zero_point", "int8_token", "float8_tensor"])
def test_zero_tokens_quantise_and_an_empty_cache_reads_empty(name, scheme):
    """No token is no error (the spec lists none): ``quantize_kv`` of ``(..., kv_heads, 0,
    head_dim)`` and an empty cache's keys are empty arrays. A ``reshape(..., -1)`` of the
    empty groups raised in all three backends."""
    module, asarray = BACKENDS[name]
    q = module.quantize_kv(asarray(np.zeros((1, 2, 0, 8), np.float32)), scheme)
    assert tuple(q.codes.shape) == (1, 2, 0, 8)
    assert tuple(module.dequantize_kv(q).shape) == (1, 2, 0, 8)
    cache = module.QuantizedKVCache.empty((1,), 2, 4, 8, scheme=scheme)
    assert tuple(cache.keys.shape) == (1, 2, 0, 8) and tuple(cache.values.shape) == (1, 2, 0, 8)
