"""KVCache and the modules' decode(): incremental decoding equals the full causal pass.

Expected values are computed in float64 from the exported weights with
``conformance.reference`` (full causal attention, no cache), never by the decoding code.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance import reference

D_MODEL, HEADS, SEQ = 16, 4, 7


def _as_numpy(backend, x):
    return backend.to_numpy(x).astype(np.float64)


def _weights(rng, num_kv_heads):
    head_dim = D_MODEL // HEADS
    sizes = {"query": HEADS * head_dim, "key": num_kv_heads * head_dim,
             "value": num_kv_heads * head_dim}
    weights = {f"W_{n}": rng.standard_normal((D_MODEL, s)).astype(np.float32) * 0.4
               for n, s in sizes.items()}
    weights.update({f"b_{n}": rng.standard_normal(s).astype(np.float32) for n, s in sizes.items()})
    weights["W_out"] = rng.standard_normal((HEADS * head_dim, D_MODEL)).astype(np.float32) * 0.4
    weights["b_out"] = rng.standard_normal(D_MODEL).astype(np.float32)
    return weights


def mha_reference(weights: dict, x: np.ndarray, num_kv_heads: int,
                  num_heads: int = HEADS) -> np.ndarray:
    """Causal multi-head attention in float64 from the weight dict (any backend's
    ``export_weights``): ``x (batch, seq, d_model)`` → ``(batch, seq, d_model)``."""
    w = {n: np.asarray(a).astype(np.float64) for n, a in weights.items()}
    x = np.asarray(x).astype(np.float64)

    def split(name, heads):  # (batch, seq, heads·hd) → (batch, heads, seq, hd)
        y = x @ w[f"W_{name}"] + w[f"b_{name}"]
        return np.swapaxes(y.reshape(y.shape[:-1] + (heads, -1)), -2, -3)

    out = reference.attention(split("query", num_heads), split("key", num_kv_heads),
                              split("value", num_kv_heads), is_causal=True).output
    merged = np.swapaxes(out, -2, -3).reshape(x.shape[:-1] + (-1,))
    return merged @ w["W_out"] + w["b_out"]


def _mha(backend, num_kv_heads, weights):
    module = backend.module.MultiHeadAttention(D_MODEL, HEADS, num_kv_heads=num_kv_heads,
                                               rng=backend.rng(0))
    return module.load_weights(weights)


def _decode_in_chunks(backend, module, x, chunks, max_len):
    outputs, cache = [], None
    start = 0
    for size in chunks:
        out, cache = module.decode(backend.asarray(x[:, start:start + size]), cache,
                                   max_len=max_len)
        outputs.append(_as_numpy(backend, out))
        start += size
    return np.concatenate(outputs, axis=1), cache


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])  # multi-head, grouped-query, multi-query
@pytest.mark.parametrize("chunks", [(1,) * SEQ, (3, 1, 3)], ids=["token_by_token", "chunked"])
def test_mha_decode_equals_full_causal_pass(backend, num_kv_heads, chunks):
    rng = np.random.default_rng(num_kv_heads)
    weights = _weights(rng, num_kv_heads)
    x = rng.standard_normal((2, SEQ, D_MODEL)).astype(np.float32)
    module = _mha(backend, num_kv_heads, weights)
    got, cache = _decode_in_chunks(backend, module, x, chunks, max_len=SEQ + 2)
    np.testing.assert_allclose(got, mha_reference(weights, x, num_kv_heads), rtol=1e-5,
                               atol=1e-5)
    assert int(cache.length) == SEQ and cache.max_len == SEQ + 2
    assert tuple(cache.keys.shape) == (2, num_kv_heads, SEQ, D_MODEL // HEADS)


def test_causal_self_attention_decode(backend):
    rng = np.random.default_rng(5)
    weights = {n: rng.standard_normal((D_MODEL, d)).astype(np.float32) * 0.3
               for n, d in (("W_query", 5), ("W_key", 5), ("W_value", 3))}
    module = backend.module.CausalSelfAttention(D_MODEL, 5, 3, rng=backend.rng(0))
    module = module.load_weights(weights)
    x = rng.standard_normal((2, SEQ, D_MODEL)).astype(np.float32)
    got, cache = _decode_in_chunks(backend, module, x, (2, 1, 4), max_len=SEQ)
    w = {n: a.astype(np.float64) for n, a in weights.items()}
    x64 = x.astype(np.float64)
    expected = reference.attention(x64 @ w["W_query"], x64 @ w["W_key"], x64 @ w["W_value"],
                                   is_causal=True).output
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert tuple(cache.values.shape) == (2, 1, SEQ, 3)


def test_cache_append_and_views(backend):
    cache = backend.module.KVCache.empty((2,), 3, 5, 4, v_dim=6, dtype="float32")
    assert int(cache.length) == 0 and cache.max_len == 5
    key = np.arange(2 * 3 * 2 * 4, dtype=np.float32).reshape(2, 3, 2, 4)
    value = np.ones((2, 3, 2, 6), np.float32)
    new = cache.append(backend.asarray(key), backend.asarray(value))
    assert (new is cache) == (backend.name != "jax")  # JAX caches are immutable pytrees
    assert int(new.length) == 2
    np.testing.assert_array_equal(backend.to_numpy(new.keys), key)
    np.testing.assert_array_equal(backend.to_numpy(new.values), value)
    new = new.append(backend.asarray(key[:, :, :1] + 100), backend.asarray(value[:, :, :1]))
    assert tuple(new.keys.shape) == (2, 3, 3, 4)
    np.testing.assert_array_equal(backend.to_numpy(new.keys)[:, :, 2], key[:, :, 0] + 100)


def test_cache_overflow_names_max_len(backend):
    cache = backend.module.KVCache.empty((1,), 1, 3, 2)
    x = backend.asarray(np.ones((1, 1, 2, 2), np.float32))
    cache = cache.append(x, x)
    with pytest.raises(ValueError, match=r"KVCache.append: .* exceed max_len=3"):
        cache.append(x, x)
    module = backend.module.MultiHeadAttention(8, 2, rng=backend.rng(0))
    _, cache = module.decode(backend.asarray(np.ones((1, 2, 8), np.float32)))  # max_len = 2
    with pytest.raises(ValueError, match="max_len=2"):
        module.decode(backend.asarray(np.ones((1, 1, 8), np.float32)), cache)


def test_cache_shape_mismatch(backend):
    cache = backend.module.KVCache.empty((1,), 2, 4, 3)
    bad = backend.asarray(np.ones((1, 1, 1, 3), np.float32))  # one kv head, cache has two
    with pytest.raises(ValueError, match="KVCache.append: key and value must match the cache"):
        cache.append(bad, bad)


def test_jax_decode_step_compiles_once():
    jax = pytest.importorskip("jax")

    import jax_attn

    rng = np.random.default_rng(9)
    weights = _weights(rng, 2)
    x = rng.standard_normal((2, SEQ, D_MODEL)).astype(np.float32)
    module = jax_attn.MultiHeadAttention(D_MODEL, HEADS, num_kv_heads=2, rng=jax.random.key(0))
    module = module.load_weights(weights)
    traces = []

    @jax.jit
    def step(module, token, cache):
        traces.append(1)
        return module.decode(token, cache)

    cache = jax_attn.KVCache.empty((2,), 2, SEQ, D_MODEL // HEADS)
    outputs = []
    for i in range(SEQ):
        out, cache = step(module, x[:, i:i + 1], cache)
        outputs.append(np.asarray(out, np.float64))
    assert len(traces) == 1, "one compilation for every step of the same chunk size"
    np.testing.assert_allclose(np.concatenate(outputs, 1), mha_reference(weights, x, 2),
                               rtol=1e-5, atol=1e-5)
