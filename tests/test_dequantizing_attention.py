"""``QuantizedKVCache.attend``'s decoding step dequantises the codes a part at a time inside the
split-KV chunks (numpy_attn and torch_attn ``_dequantizing.py``): the chunks, the parts and the
residual window's boundaries are made small here, so a step crosses all of them, and the result
must equal float64 attention over the cache's dequantised keys and values (``cache.keys`` /
``cache.values``, which test_quantized_cache.py checks against a float64 quantiser)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quantized_helpers import reference_attention

import attention_rules
import numpy_attn
import numpy_attn._dequantizing
import torch_attn
import torch_attn._dequantizing
from attention_rules.quantizing import KVQuantization

BACKENDS = {"numpy_attn": (numpy_attn, numpy_attn._dequantizing, np.asarray),
            "torch_attn": (torch_attn, torch_attn._dequantizing, torch.from_numpy)}
SCHEMES = [
    KVQuantization("int8", residual=3),
    KVQuantization("int4", zero_point=True, granularity="token"),
    KVQuantization("int8", zero_point=True),  # two groups of 16 channels with zero points
    KVQuantization("float8_e4m3", granularity="head", residual=2),
    KVQuantization("float8_e5m2"),
]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.dtype}-{s.granularity}"
                         + ("-zp" if s.zero_point else ""))
def test_chunks_parts_and_window_equal_float64_attention(backend, scheme, monkeypatch):
    """Chunks of 8 keys from 16 (``SPLIT_KV``), parts of 3 positions (``PART_BYTES``), a
    window of ``residual`` tokens after the store, q_len 2 with grouped heads and sinks; and
    one step in one chunk below ``min_kv_len``."""
    module, dequantizing, convert = BACKENDS[backend]
    for name, value in (("chunk", 8), ("min_kv_len", 16), ("max_q_len", 2)):
        monkeypatch.setitem(attention_rules.SPLIT_KV, name, value)
    monkeypatch.setattr(dequantizing, "PART_BYTES", 3 * 2 * 32 * 4)  # 3 positions, 2 kv heads
    rng = np.random.default_rng(11)
    kv_len, first = 29, 21
    keys = rng.standard_normal((2, 2, kv_len, 32)).astype(np.float32)
    values = rng.standard_normal((2, 2, kv_len, 32)).astype(np.float32)
    sinks = rng.standard_normal(4).astype(np.float32)
    cache = module.QuantizedKVCache.empty((2,), 2, kv_len, 32, scheme=KVQuantization(
        scheme.dtype, granularity=scheme.granularity, zero_point=scheme.zero_point,
        group_size=16, residual=scheme.residual))
    cache = cache.append(convert(keys[..., :first, :]), convert(values[..., :first, :]))
    held = []
    for length in range(first + 1, kv_len + 1):  # token by token: the window fills and moves
        t = length - 1
        cache = cache.append(convert(keys[..., t:t + 1, :]), convert(values[..., t:t + 1, :]))
        query = rng.standard_normal((2, 4, 2, 32)).astype(np.float32)
        got = np.asarray(cache.attend(convert(query), sinks=convert(sinks)))
        held.append(cache.residual_length)
        want = reference_attention(query, np.asarray(cache.keys), np.asarray(cache.values), sinks)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6,
                                   err_msg=f"{backend}, length {length}")
    assert (max(held) > 0) == (scheme.residual > 0)  # the window is in use where it exists
    short = module.QuantizedKVCache.empty((2,), 2, 9, 32,
                                          scheme=KVQuantization("int8", group_size=16))
    short = short.append(convert(keys[..., :9, :]), convert(values[..., :9, :]))
    query = rng.standard_normal((2, 4, 1, 32)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(short.attend(convert(query))),
                               reference_attention(query, np.asarray(short.keys),
                                          np.asarray(short.values)), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_the_step_makes_no_float_copy_of_the_cache(backend, monkeypatch):
    """The decoding step never dequantises the whole store (``dequantize_kv`` is not called;
    the previous ``attend`` called it through ``cache.keys``)."""
    module, _, convert = BACKENDS[backend]
    calls = []
    original = module.quantized_cache.dequantize_kv
    monkeypatch.setattr(module.quantized_cache, "dequantize_kv",
                        lambda q: calls.append(q.shape) or original(q))
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((1, 2, 40, 32)).astype(np.float32)
    cache = module.QuantizedKVCache.empty((1,), 2, 40, 32, scheme=KVQuantization(
        "int8", group_size=16)).append(convert(keys), convert(keys))
    cache.attend(convert(rng.standard_normal((1, 2, 1, 32)).astype(np.float32)))
    assert calls == []
    cache.keys  # noqa: B018 - the property does dequantise: the monkeypatch is in place
    assert calls == [(1, 2, 40, 32)]


@pytest.mark.parametrize("code_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_widening_by_bits_is_exact_for_every_code_but_nan(code_dtype):
    """Every one of the 256 codes widened by bits equals ml_dtypes' and torch's casts (the
    truth of the fp8 values), subnormals and both zeros included; the NaN (and e5m2's inf)
    codes are the ones the lookup or torch's cast handles (``nan_codes``)."""
    import ml_dtypes

    from numpy_attn._dequantizing import _widen_float8
    from torch_attn._dequantizing import _widened_float8

    codes = np.arange(256, dtype=np.uint8).view(np.int8).reshape(1, 2, 128)
    want = codes.view(getattr(ml_dtypes, code_dtype)).astype(np.float32)
    finite = np.isfinite(want)
    assert finite.sum() == {"float8_e4m3fn": 254, "float8_e5m2": 248}[code_dtype]
    got_numpy = np.empty(codes.shape, np.float32)
    _widen_float8(codes, got_numpy, code_dtype)
    got_torch = _widened_float8(torch.from_numpy(codes).view(getattr(torch, code_dtype)), None)
    for got in (got_numpy, got_torch.numpy()):
        np.testing.assert_array_equal(got[finite], want[finite])
        assert (np.signbit(got) == np.signbit(want))[finite].all()  # -0.0 stays -0.0


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("where", ["keys", "values"])
@pytest.mark.parametrize("scheme", [KVQuantization("float8_e4m3", scale=0.5),
                                    KVQuantization("float8_e5m2", scale=0.5)],
                         ids=["e4m3", "e5m2"])
def test_a_nan_code_makes_the_step_nan_as_attention_over_the_values_does(backend, scheme,
                                                                         where):
    """A NaN quantised with a given fp8 scale is a NaN code: the decoding step's output is
    NaN where attention over ``cache.keys`` / ``cache.values`` is, and equal elsewhere. A NaN
    value: its channel, in the two query heads of its kv head; a NaN key: those two heads'
    whole rows (its score is NaN)."""
    module, _, convert = BACKENDS[backend]
    rng = np.random.default_rng(5)
    keys = rng.standard_normal((2, 2, 12, 32)).astype(np.float32)
    values = rng.standard_normal((2, 2, 12, 32)).astype(np.float32)
    {"keys": keys, "values": values}[where][1, 0, 4, 3] = np.nan  # batch row 1, kv head 0
    cache = module.QuantizedKVCache.empty((2,), 2, 12, 32, scheme=scheme)
    cache = cache.append(convert(keys), convert(values))
    query = rng.standard_normal((2, 4, 1, 32)).astype(np.float32)
    got = np.asarray(cache.attend(convert(query)))
    want = reference_attention(query, np.asarray(cache.keys), np.asarray(cache.values))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    if where == "values":  # channel 3 only
        assert np.isnan(got[1, :2, :, 3]).all() and np.isnan(got).sum() == 2
    else:  # every channel of the two heads
        assert np.isnan(got[1, :2]).all() and np.isnan(got).sum() == 2 * 32
    finite = ~np.isnan(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_int8_keys_beside_fp8_values_with_a_nan_keep_their_own_reading(backend):
    """The NaN flag is the cache's, set by a NaN among the fp8 values: the int8 keys beside
    them are still read as int8 codes (never through the fp8 lookup), so the step equals
    attention over ``cache.keys`` / ``cache.values``, NaN in the NaN value's channel only."""
    module, _, convert = BACKENDS[backend]
    rng = np.random.default_rng(9)
    keys = rng.standard_normal((2, 2, 12, 32)).astype(np.float32)
    values = rng.standard_normal((2, 2, 12, 32)).astype(np.float32)
    values[0, 1, 7, 5] = np.nan
    cache = module.QuantizedKVCache.empty(
        (2,), 2, 12, 32, scheme=KVQuantization("int8", zero_point=True, group_size=16),
        value_scheme=KVQuantization("float8_e4m3", scale=0.5))
    cache = cache.append(convert(keys), convert(values))
    assert cache._nan_codes  # the flag this test is about
    query = rng.standard_normal((2, 4, 1, 32)).astype(np.float32)
    got = np.asarray(cache.attend(convert(query)))
    want = reference_attention(query, np.asarray(cache.keys), np.asarray(cache.values))
    assert np.isnan(got[0, 2:, :, 5]).all() and np.isnan(got).sum() == 2
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_caches_of_other_dtypes_read_the_dequantised_values(backend, dtype):
    """float16, bfloat16 and float64 caches attend ``dequantize_kv``'s values (float16 and
    bfloat16 rounded): the step equals float64 attention over ``cache.keys`` /
    ``cache.values`` to the rounding of the step's sums, not to the scales' fold."""
    module = BACKENDS[backend][0]
    rng = np.random.default_rng(8)
    keys = rng.standard_normal((1, 2, 40, 32))
    values = rng.standard_normal((1, 2, 40, 32))
    query = rng.standard_normal((1, 2, 1, 32))
    def cast(a):  # float64 → the cache's dtype, in the backend
        if backend == "torch_attn":
            return torch.from_numpy(a).to(getattr(torch, dtype))
        return a.astype(numpy_attn._arrays._cache_dtype("test", dtype))

    def as64(a):
        return (a.to(torch.float64) if backend == "torch_attn" else a.astype(np.float64))

    cache = module.QuantizedKVCache.empty((1,), 2, 40, 32, scheme=KVQuantization(
        "int8", group_size=16), dtype=dtype).append(cast(keys), cast(values))
    got = np.asarray(as64(cache.attend(cast(query))))
    want = reference_attention(*(np.asarray(as64(a))
                                 for a in (cast(query), cache.keys, cache.values)))
    tolerance = {"float16": 2e-3, "bfloat16": 1.6e-2, "float64": 1e-12}[dtype]
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("scheme", [KVQuantization("int8", zero_point=True),
                                    KVQuantization("float8_e4m3", granularity="head")],
                         ids=["int8-zp", "e4m3-head"])
def test_numpy_head_groups_give_the_same_bits_on_any_number_of_cores(scheme, monkeypatch):
    """Below ``min_kv_len`` the step is one chunk, so numpy_attn splits its kv heads into a
    task per core: the output is bit for bit the same with 1, 2, 3 and 8 cores (a head's sums
    do not depend on its group)."""
    from numpy_attn import _threads

    rng = np.random.default_rng(4)
    keys = rng.standard_normal((1, 6, 50, 32)).astype(np.float32)
    values = rng.standard_normal((1, 6, 50, 32)).astype(np.float32)
    query = rng.standard_normal((1, 12, 1, 32)).astype(np.float32)
    cache = numpy_attn.QuantizedKVCache.empty((1,), 6, 50, 32, scheme=KVQuantization(
        scheme.dtype, granularity=scheme.granularity, zero_point=scheme.zero_point,
        group_size=16)).append(keys, values)
    outputs = {}
    for cores in (1, 2, 3, 8):
        monkeypatch.setattr(_threads, "_cores", lambda cores=cores: cores)
        outputs[cores] = cache.attend(query)
    for cores, output in outputs.items():
        np.testing.assert_array_equal(output, outputs[1], err_msg=f"{cores} cores")
    np.testing.assert_allclose(outputs[1], reference_attention(query, cache.keys, cache.values),
                               rtol=2e-5, atol=2e-6)
