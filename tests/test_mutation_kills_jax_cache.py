"""jax_attn's eager ``kv_cache.decode_step`` against the float64 reference (mutation testing,
docs/mutation.md): the JAX twin of ``test_kv_cache.test_decode_step_unbatched_split_and_sinks``
and ``test_decode_step_over_a_paged_cache_with_sinks``, which run on numpy and torch only.

Eager JAX compiles each operation for each new shape, so every step here uses the same few
shapes: unbatched ``(heads, n, dim)`` inputs whose sizes all differ (heads 4, kv_heads 2,
head_dim 5, v_dim 6), a prefill of 3 rows, then steps of one row; x64 on for the float64 caches.
"""

from __future__ import annotations

import numpy as np
import pytest

import attention_rules
from conformance.cases import reference

HEADS, KV_HEADS, N, HEAD_DIM, V_DIM, STEPS = 4, 2, 3, 5, 6, 3
SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
EXACT = {"rtol": 1e-12, "atol": 1e-12}


def _inputs(seed: int, batch: tuple = ()) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(batch + (h, N + STEPS, d)).astype(np.float32)
                 for h, d in ((HEADS, HEAD_DIM), (KV_HEADS, HEAD_DIM), (KV_HEADS, V_DIM)))


def test_jax_decode_step_new_cache_split_kv_sinks_and_dtypes(x64_on, monkeypatch):
    """A new cache holds ``n`` positions when ``max_len`` is None, in the keys' dtype, with the
    keys' and values' sizes; a prefill then steps of one row with sinks run split-KV (chunks of
    2 once the cache holds 4 keys) into a float64 cache from float32 inputs and equal the
    float64 reference (the last step without sinks); a float32 query over a new float16 cache
    of ``max_len`` 4 gives float16; the length is an int32 array with x64 on."""
    import jax.numpy as jnp

    from jax_attn import kv_cache

    for name, value in (("chunk", 2), ("min_kv_len", 4), ("max_q_len", 1), ("steps", 2)):
        monkeypatch.setitem(attention_rules.SPLIT_KV, name, value)
    split_calls = []
    split = kv_cache.split_kv_attention
    monkeypatch.setattr(kv_cache, "split_kv_attention",
                        lambda *a, **k: split_calls.append(1) or split(*a, **k))
    query, key, value = _inputs(5)

    def part(start, stop, dtype=np.float32):
        return [jnp.asarray(a[:, start:stop].astype(dtype)) for a in (query, key, value)]

    out, cache = kv_cache.decode_step(*part(0, N, np.float16), None, None)
    assert cache.max_len == N and int(cache.length) == N
    assert out.dtype == cache.key_buffer.dtype == cache.value_buffer.dtype == jnp.float16
    assert cache.key_buffer.shape == (KV_HEADS, N, HEAD_DIM)
    assert cache.value_buffer.shape == (KV_HEADS, N, V_DIM)
    expected = reference.attention(query[:, :N], key[:, :N], value[:, :N], is_causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected.output, rtol=1e-2,
                               atol=1e-2)
    # float32 steps into a float64 cache with room for every step
    cache = kv_cache.KVCache.empty((), KV_HEADS, N + STEPS, HEAD_DIM, V_DIM, dtype="float64")
    assert cache.length.dtype == jnp.int32, "an int32 length, even with x64 on"
    out, cache = kv_cache.decode_step(*part(0, N), cache, None, sinks=jnp.asarray(SINKS))
    assert out.dtype == jnp.float64 and not split_calls, "3 rows: more than max_q_len"
    expected = reference.attention(query[:, :N], key[:, :N], value[:, :N], is_causal=True,
                                   sinks=SINKS)
    np.testing.assert_allclose(np.asarray(out), expected.output, **EXACT)
    for t in range(N, N + STEPS):
        sinks = SINKS if t < N + STEPS - 1 else None  # the last step: split-KV without sinks
        out, cache = kv_cache.decode_step(*part(t, t + 1), cache, None, sinks=sinks)
        assert int(cache.length) == t + 1 and out.dtype == jnp.float64
        expected = reference.attention(query[:, t:t + 1], key[:, :t + 1], value[:, :t + 1],
                                       sinks=sinks)
        np.testing.assert_allclose(np.asarray(out), expected.output, **EXACT)
    assert split_calls, "one query row over a cache of 6 runs split-KV"
    # a float32 query over a new float16 cache (the keys' dtype) of max_len N + 1: float16
    step = [jnp.asarray(query[:, :N])] + part(0, N, np.float16)[1:]
    out, cache = kv_cache.decode_step(*step, None, N + 1)
    assert cache.max_len == N + 1 and int(cache.length) == N and out.dtype == jnp.float16
    expected = reference.attention(query[:, :N], key[:, :N], value[:, :N], is_causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected.output, rtol=1e-2,
                               atol=1e-2)


def test_jax_decode_step_chunked_prefill_and_paged_cache_with_sinks(x64_on):
    """Batched inputs: a prefill of 2 rows then a chunk of 2 rows over the cache (bottom-right
    causal from the cache's length) and a float64 ``PagedKVCache`` fed float32 steps with
    sinks equal the float64 reference; a float32 query over a float16 paged cache gives
    float16."""
    import jax.numpy as jnp

    from jax_attn import kv_cache

    query, key, value = _inputs(6, batch=(2,))
    cache = kv_cache.KVCache.empty((2,), KV_HEADS, N + STEPS, HEAD_DIM, V_DIM,
                                   dtype="float64")
    paged = kv_cache.PagedKVCache(8, 2, KV_HEADS, HEAD_DIM, V_DIM, dtype="float64")
    for start, stop in ((0, 2), (2, 4)):
        step = [jnp.asarray(a[:, :, start:stop]) for a in (query, key, value)]
        expected = reference.attention(query[:, :, start:stop], key[:, :, :stop],
                                       value[:, :, :stop], is_causal=True,
                                       causal_alignment="bottom_right", sinks=SINKS)
        out, cache = kv_cache.decode_step(*step, cache, None, sinks=SINKS)
        assert out.dtype == jnp.float64 and int(cache.length) == stop
        np.testing.assert_allclose(np.asarray(out), expected.output, **EXACT)
        out, paged = kv_cache.decode_step(*step, paged, None, sinks=jnp.asarray(SINKS))
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(out), expected.output, **EXACT)
    # a float32 query over a float16 paged cache: attended in float16
    paged = kv_cache.PagedKVCache(8, 2, KV_HEADS, HEAD_DIM, V_DIM, dtype="float16")
    out, paged = kv_cache.decode_step(*step, paged, None)
    assert out.dtype == jnp.float16


@pytest.mark.parametrize("batch", [(), (2,)], ids=["unbatched", "batched"])
def test_jax_cache_append_writes_the_positions_axis(batch):
    """``append`` writes along the positions axis (``ndim - 2``) of unbatched and batched
    buffers, in the cache's dtype; past ``max_len`` it raises naming ``KVCache.append``."""
    import jax.numpy as jnp

    from jax_attn import kv_cache

    cache = kv_cache.KVCache.empty(batch, KV_HEADS, N, HEAD_DIM, V_DIM, dtype="float16")
    _, key, value = (a[..., :2, :] for a in _inputs(7, batch))
    cache = cache.append(key, value)
    assert int(cache.length) == 2 and not bool(cache.overflowed)
    assert cache.keys.dtype == cache.values.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(cache.keys), key.astype(np.float16))
    np.testing.assert_array_equal(np.asarray(cache.values), value.astype(np.float16))
    np.testing.assert_array_equal(np.asarray(cache.key_buffer)[..., 2:, :], 0)
    with pytest.raises(ValueError, match=r"^KVCache\.append: .*max_len=3"):
        cache.append(key, value)
