"""``QuantizedKVCache.attend``'s decoding step dequantises the codes a part at a time inside the
split-KV chunks (numpy_attn and torch_attn ``_dequantizing.py``): the chunks, the parts and the
residual window's boundaries are made small here, so a step crosses all of them, and the result
must equal float64 attention over the cache's dequantised keys and values (``cache.keys`` /
``cache.values``, which test_quantized_cache.py checks against a float64 quantiser)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attention_rules
import numpy_attn
import numpy_attn.paged
import torch_attn
import torch_attn.paged
from attention_rules.quantizing import KVQuantization

BACKENDS = {"numpy_attn": (numpy_attn, numpy_attn.paged, np.asarray),
            "torch_attn": (torch_attn, torch_attn.paged, torch.from_numpy)}
SCHEMES = [
    KVQuantization("int8", residual=3),
    KVQuantization("int4", zero_point=True, granularity="token"),
    KVQuantization("float8_e4m3", granularity="head", residual=2),
    KVQuantization("float8_e5m2"),
]


def _reference(query, keys, values, sinks=None):
    """float64 softmax attention, bottom-right causal, grouped heads, optional sinks."""
    q, k, v = (np.asarray(a, np.float64) for a in (query, keys, values))
    groups = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, groups, axis=-3), np.repeat(v, groups, axis=-3)
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    q_len, kv_len = scores.shape[-2:]
    allowed = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + kv_len - q_len
    scores = np.where(allowed, scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, np.asarray(sinks, np.float64)[:, None, None])
    weights = np.exp(scores - top)
    total = weights.sum(-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(np.asarray(sinks, np.float64)[:, None, None] - top)
    return (weights / total) @ v


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.dtype}-{s.granularity}")
def test_chunks_parts_and_window_equal_float64_attention(backend, scheme, monkeypatch):
    """Chunks of 8 keys from 16 (``SPLIT_KV``), parts of 3 positions (``PART_BYTES``), a
    window of ``residual`` tokens after the store, q_len 2 with grouped heads and sinks; and
    one step in one chunk below ``min_kv_len``."""
    module, paged, convert = BACKENDS[backend]
    for name, value in (("chunk", 8), ("min_kv_len", 16), ("max_q_len", 2)):
        monkeypatch.setitem(attention_rules.SPLIT_KV, name, value)
    monkeypatch.setattr(paged, "PART_BYTES", 3 * 2 * 32 * 4)  # 3 positions of 2 kv heads
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
        want = _reference(query, np.asarray(cache.keys), np.asarray(cache.values), sinks)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6,
                                   err_msg=f"{backend}, length {length}")
    assert (max(held) > 0) == (scheme.residual > 0)  # the window is in use where it exists
    short = module.QuantizedKVCache.empty((2,), 2, 9, 32,
                                          scheme=KVQuantization("int8", group_size=16))
    short = short.append(convert(keys[..., :9, :]), convert(values[..., :9, :]))
    query = rng.standard_normal((2, 4, 1, 32)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(short.attend(convert(query))),
                               _reference(query, np.asarray(short.keys),
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
