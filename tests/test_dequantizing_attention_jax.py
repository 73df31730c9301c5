"""jax_attn's decoding step over a quantised cache (``jax_attn/_dequantizing.py``): the codes
dequantised a part at a time inside one compiled program whose lengths are traced. Against
numpy_attn's step and attention over the cache's keys and values, eager ``dequantize_kv``'s
bits, every fp8 code, no float copy of the store, gradients and one compile per decoding loop.
One cache shape throughout, so each case compiles once."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from quantized_helpers import IDS, SCHEMES, SHAPE, seeded_keys

import jax_attn
import numpy_attn
from attention_rules.quantizing import KVQuantization

STEP_SHAPE = (2, 3, 29, 128)  # (batch, kv_heads, length, head_dim): 3 kv heads for the given
# per-head fp8 scales of SCHEMES; tolerances: float32 this file's, float64 and bfloat16
# tests/test_dequantizing_attention.py's
STEP_DTYPES = {"float32": (np.float32, jnp.float32, dict(rtol=2e-5, atol=2e-6)),
               "float64": (np.float64, jnp.float64, dict(rtol=1e-12, atol=1e-12)),
               "bfloat16": (ml_dtypes.bfloat16, jnp.bfloat16, dict(rtol=1.6e-2, atol=1.6e-2))}
# The decoding step's cases: an int8 and an fp8 scheme in the edit loop, the other schemes (a
# compile each) slow
STEP_SCHEMES = [scheme if name in ("int8-group-zp", "float8_e5m2-head-given")
                else pytest.param(scheme, marks=pytest.mark.slow)
                for scheme, name in zip(SCHEMES, IDS, strict=True)]


def _small_chunks(monkeypatch) -> None:
    """Chunks of 8 keys from 16 (``SPLIT_KV``) and parts of 3 positions (jax_attn's
    ``PART_BYTES``), so a step over 29 positions crosses a lax.map of full chunks, whole and
    shorter parts, a shorter last chunk and the residual window's boundary."""
    import attention_rules
    from jax_attn import _dequantizing

    for name, value in (("chunk", 8), ("min_kv_len", 16), ("max_q_len", 2)):
        monkeypatch.setitem(attention_rules.SPLIT_KV, name, value)
    batch, kv_heads, _, head_dim = STEP_SHAPE
    monkeypatch.setattr(_dequantizing, "PART_BYTES", 3 * batch * kv_heads * head_dim * 4)


def _step_caches(scheme: KVQuantization, dtype: str) -> tuple:
    """The same appends (a prompt, then one token at a time) into a numpy_attn and a
    jax_attn cache of ``dtype``: ``(numpy cache, jax cache, inputs)``; with ``residual`` 3
    the last two tokens stay in the window."""
    np_dtype, jnp_dtype, _ = STEP_DTYPES[dtype]
    rng = np.random.default_rng(12)
    keys = (rng.standard_normal(STEP_SHAPE) * 2).astype(np_dtype)
    values = rng.standard_normal(STEP_SHAPE).astype(np_dtype)
    batch, kv_heads, length, head_dim = STEP_SHAPE
    scheme = KVQuantization(scheme.dtype, granularity=scheme.granularity,
                            zero_point=scheme.zero_point, group_size=scheme.group_size,
                            scale=scheme.scale, residual=scheme.residual)
    caches = []
    for module, convert in ((numpy_attn, np.asarray), (jax_attn, jnp.asarray)):
        cache = module.QuantizedKVCache.empty((batch,), kv_heads, length, head_dim,
                                              scheme=scheme, dtype=dtype)
        cache = cache.append(convert(keys[..., :27, :]), convert(values[..., :27, :]))
        for t in (27, 28):
            cache = cache.append(convert(keys[..., t:t + 1, :]), convert(values[..., t:t + 1, :]))
        caches.append(cache)
    query = rng.standard_normal((batch, 2 * kv_heads, 2, head_dim)).astype(np_dtype)
    sinks = rng.standard_normal(2 * kv_heads).astype(np.float32)
    return caches[0], caches[1], query, sinks


def _check_jax_step(scheme: KVQuantization, dtype: str, monkeypatch) -> None:
    """jax_attn's decoding step (grouped heads, 2 query rows, sinks) against numpy_attn's
    and against ``scaled_dot_product_attention`` over the jax cache's keys and values; the
    step never calls ``dequantize_kv`` (the whole cache's float copy)."""
    _small_chunks(monkeypatch)
    tolerance = STEP_DTYPES[dtype][2]
    numpy_cache, jax_cache, query, sinks = _step_caches(scheme, dtype)
    assert (jax_cache.stored_length, jax_cache.residual_length) == (
        numpy_cache.stored_length, numpy_cache.residual_length)
    assert jax_cache.residual_length == (2 if scheme.residual else 0)
    calls = []
    original = jax_attn.quantized_cache.dequantize_kv
    monkeypatch.setattr(jax_attn.quantized_cache, "dequantize_kv",
                        lambda q: calls.append(q.shape) or original(q))
    got = jax_cache.attend(jnp.asarray(query), sinks=jnp.asarray(sinks))
    assert calls == [] and got.dtype == STEP_DTYPES[dtype][1]
    got = np.asarray(got).astype(np.float64)
    want_numpy = numpy_cache.attend(query, sinks=sinks).astype(np.float64)
    np.testing.assert_allclose(got, want_numpy, **tolerance, err_msg="numpy_attn's attend")
    want = jax_attn.scaled_dot_product_attention(
        jnp.asarray(query), jax_cache.keys, jax_cache.values, is_causal=True,
        causal_alignment="bottom_right", sinks=jnp.asarray(sinks))
    np.testing.assert_allclose(got, np.asarray(want).astype(np.float64), **tolerance,
                               err_msg="attention over cache.keys / cache.values")


@pytest.mark.parametrize("residual", [0, 3], ids=["no-window", "window"])
@pytest.mark.parametrize("scheme", STEP_SCHEMES, ids=IDS)
def test_jax_decoding_step_equals_numpy_and_attention_over_the_cache(scheme, residual,
                                                                     monkeypatch):
    scheme = KVQuantization(scheme.dtype, granularity=scheme.granularity,
                            zero_point=scheme.zero_point, group_size=scheme.group_size,
                            scale=scheme.scale, residual=residual)
    _check_jax_step(scheme, "float32", monkeypatch)


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("scheme", STEP_SCHEMES, ids=IDS)
def test_jax_decoding_step_of_float64_and_bfloat16_caches(scheme, dtype, monkeypatch, x64_on):
    """float64 caches attend dequantize_kv's values in float64 (x64 on), bfloat16 caches the
    values rounded to bfloat16, as numpy_attn's step and cache.keys / cache.values do."""
    scheme = KVQuantization(scheme.dtype, granularity=scheme.granularity,
                            zero_point=scheme.zero_point, group_size=scheme.group_size,
                            scale=scheme.scale, residual=3)
    _check_jax_step(scheme, dtype, monkeypatch)


@pytest.mark.parametrize("dtype", list(STEP_DTYPES))
@pytest.mark.parametrize("scheme", [SCHEMES[i] for i in (2, 4, 5, 7, 9)],
                         ids=[IDS[i] for i in (2, 4, 5, 7, 9)])
def test_jax_step_dequantises_to_eager_dequantize_kv_bits(scheme, dtype, x64_on):
    """A chunk dequantised inside the jitted step is bit for bit an eager ``dequantize_kv``'s
    values: zero points added after the product is rounded (XLA's CPU backend would fuse them
    into one fused multiply-add without ``_rounded_apart``), fp8 widened by bits."""
    import jax

    from jax_attn._dequantizing import _Source

    x = seeded_keys(seed=3).astype(STEP_DTYPES[dtype][0])
    store = jax_attn.quantize_kv(jnp.asarray(x), scheme)
    store = jax_attn.quantized_cache.QuantizedArray(store.codes, store.scales,
                                                    store.zero_points, scheme, dtype)
    want = np.asarray(jax_attn.dequantize_kv(store))  # eager: two roundings

    @jax.jit
    def chunk(store, residual):
        source = _Source(store, residual, SHAPE[0], jnp.float32)
        return source._values(jnp.int32(1), SHAPE[2] - 1)  # a traced start

    got = np.asarray(chunk(store, jnp.zeros(SHAPE[:2] + (0, SHAPE[3]), dtype)))
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.view(np.uint8), want[..., 1:, :].view(np.uint8))


@pytest.mark.parametrize("scheme", [KVQuantization("float8_e4m3", scale=1.0),
                                    KVQuantization("float8_e5m2", scale=1.0)],
                         ids=["e4m3", "e5m2"])
def test_jax_step_widens_every_fp8_code_as_ml_dtypes(scheme):
    """Every one of the 256 fp8 codes, sliced as bytes and widened inside the jitted step
    (scale 1), equals ml_dtypes' cast: zeros of both signs, subnormals, NaN codes and e5m2's
    infinities included."""
    import jax

    from jax_attn._dequantizing import _Source

    code_dtype = {"float8_e4m3": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}[scheme.dtype]
    codes = np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, code_dtype))
    want = codes.astype(np.float32).reshape(1, 1, 4, 64)
    store = jax_attn.quantized_cache.QuantizedArray(
        jnp.asarray(codes.reshape(1, 1, 4, 64)), jnp.float32(1.0), None, scheme, "float32")

    @jax.jit
    def chunk(store, residual):
        return _Source(store, residual, 1, jnp.float32)._values(jnp.int32(0), 4)

    got = np.asarray(chunk(store, jnp.zeros((1, 1, 0, 64), jnp.float32)))
    nan = np.isnan(want)
    assert nan.sum() == {"float8_e4m3fn": 2, "float8_e5m2": 6}[code_dtype]
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("scheme", [SCHEMES[0], SCHEMES[8]], ids=[IDS[0], IDS[8]])
def test_jax_step_program_holds_no_float_copy_of_the_store(scheme, monkeypatch):
    """The compiled step holds no float array of the whole store (XLA's CPU backend would
    widen fp8 codes to float16 before slicing them: the codes enter as bytes), only parts."""
    import re

    from jax_attn._dequantizing import _step

    _small_chunks(monkeypatch)
    _, cache, query, _ = _step_caches(scheme, "float32")
    text = _step.lower(jnp.asarray(query), cache.key_store, cache.value_store,
                       cache.key_residual, cache.value_residual, None,
                       jnp.int32(cache.stored_length), jnp.int32(cache.residual_length),
                       chunk=8, part=3).compile().as_text()
    whole = re.findall(r"(?:f16|bf16|f32|f64)\[[0-9,]*\b(?:29|8),128\]", text)
    assert not whole, whole  # neither the store's 29 positions nor a chunk's 8
    assert re.search(r"f32\[[0-9,]*\b3,128\]", text)  # a part's dequantised keys


@pytest.mark.slow
def test_jax_decoding_step_differentiates_as_attention_over_the_cache(monkeypatch, x64_on):
    """jax_attn differentiates through the chunks, the parts and the merge by autodiff
    (``spec.SPLIT_DECODING``): the gradients of the float32 step with respect to the query and
    the sinks equal float64 gradients of attention over ``cache.keys`` / ``cache.values``
    (x64 on for the reference; the step's gradients were closer to them than float32
    ``scaled_dot_product_attention``'s, 1e-5 against 6e-5 of gradients up to 25)."""
    import jax

    _small_chunks(monkeypatch)
    scheme = KVQuantization("int8", zero_point=True, group_size=32, residual=3)
    _, cache, query, sinks = _step_caches(scheme, "float32")

    def step(q, s):
        return (cache.attend(q, sinks=s) ** 2).sum()

    def reference(q, s, keys, values):
        return (jax_attn.scaled_dot_product_attention(
            q, keys, values, is_causal=True, causal_alignment="bottom_right", sinks=s) ** 2).sum()

    got = jax.grad(step, argnums=(0, 1))(jnp.asarray(query), jnp.asarray(sinks))
    assert got[0].dtype == jnp.float32
    as64 = [jnp.asarray(np.asarray(a, np.float64))
            for a in (query, sinks, cache.keys, cache.values)]
    want = jax.grad(reference, argnums=(0, 1))(*as64)
    for name, g, w in zip(("query", "sinks"), got, want, strict=True):
        w = np.asarray(w)
        assert np.abs(w).max() > 0.1, name  # a gradient that says something
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=4e-6 * np.abs(w).max(),
                                   err_msg=name)


@pytest.mark.slow
def test_jax_decoding_loop_compiles_once_over_a_cache_with_room(monkeypatch):
    """The step's lengths are traced: decoding token by token into a cache with room to spare
    (max_len 40 in chunks of 8, so the chunks past the filled positions are skipped, and a
    residual window of 3) compiles one program for the whole loop, and every step equals
    numpy_attn's step over the same appends."""
    from jax_attn._dequantizing import _step

    _small_chunks(monkeypatch)
    scheme = KVQuantization("int8", zero_point=True, group_size=32, residual=3)
    batch, kv_heads, _, head_dim = STEP_SHAPE
    rng = np.random.default_rng(21)
    keys = rng.standard_normal((batch, kv_heads, 22, head_dim)).astype(np.float32)
    values = rng.standard_normal((batch, kv_heads, 22, head_dim)).astype(np.float32)
    caches = {name: module.QuantizedKVCache.empty((batch,), kv_heads, 40, head_dim,
                                                  scheme=scheme).append(
        convert(keys[..., :9, :]), convert(values[..., :9, :]))
        for name, module, convert in (("numpy", numpy_attn, np.asarray),
                                      ("jax", jax_attn, jnp.asarray))}
    compiled = []
    for t in range(9, 22):
        query = rng.standard_normal((batch, kv_heads, 1, head_dim)).astype(np.float32)
        for name, convert in (("numpy", np.asarray), ("jax", jnp.asarray)):
            caches[name] = caches[name].append(convert(keys[..., t:t + 1, :]),
                                               convert(values[..., t:t + 1, :]))
        got = np.asarray(caches["jax"].attend(jnp.asarray(query)))
        np.testing.assert_allclose(got, caches["numpy"].attend(query), rtol=2e-5, atol=2e-6,
                                   err_msg=f"length {t + 1}")
        compiled.append(_step._cache_size())
    assert caches["jax"].residual_length > 0 and caches["jax"].stored_length >= 16
    assert compiled[-1] == compiled[0], compiled  # no compile after the first step
