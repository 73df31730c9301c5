"""Quantised KV caches (``conformance/spec/quantized_cache.py``): the cache's attention against
attention over the dequantised keys and values, the residual window against transformers'
rule, errors, signatures and sizes. The quantiser itself is ``test_quantize_kv.py``."""

from __future__ import annotations

import importlib
import inspect

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from quantized_helpers import as_numpy, f32, ref_fp8, ref_integer, reference_attention

import jax_attn
import numpy_attn
import torch_attn
from conformance import spec

KVQuantization = numpy_attn.KVQuantization
BACKENDS = {"numpy_attn": (numpy_attn, np.asarray), "jax_attn": (jax_attn, jnp.asarray),
            "torch_attn": (torch_attn, torch.from_numpy)}

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
            keys = as_numpy(cache.keys)
            np.testing.assert_array_equal(keys[..., stored:, :], everything[..., stored:, :])
            np.testing.assert_array_equal(keys[..., :stored, :],
                                          ref_integer(everything[..., :stored, :], scheme)[1])
            np.testing.assert_array_equal(as_numpy(cache.values)[..., :stored, :], ref_integer(
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
        outputs[name] = as_numpy(cache.attend(convert(query)))
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
        np.testing.assert_array_equal(as_numpy(cache.keys), want_k)
        np.testing.assert_array_equal(as_numpy(cache.values), want_v)
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
