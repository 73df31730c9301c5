"""KVCache and the modules' decode(): incremental decoding equals the full causal pass.

Expected values are computed in float64 from the exported weights with
``conformance.cases.reference`` (full causal attention, no cache), never by the decoding code.
``kv_cache.decode_step`` (split-KV, sinks, a paged cache, the cache's dtypes) is checked the same
way in every backend; jax_attn's eager one on its own small shapes.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

import numpy as np
import pytest
from subprocesses import timeout

import attention_rules
from conformance.cases import reference

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
@pytest.mark.parametrize("backend", ["numpy", pytest.param("jax", marks=pytest.mark.slow),
                                     "torch"], indirect=True)  # jax: a compile per case
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


# ------------------------------------------------- KVCache.empty and kv_cache.decode_step itself
# (found by mutation testing, docs/mutation.md: the module tests above decode batched inputs of
# one dtype without sinks, so an argument name, a default dtype, an axis counted from the front
# or a dropped ``sinks`` went unnoticed)

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _dtype_name(array) -> str:
    return str(array.dtype).removeprefix("torch.")


def _kv_cache_file(backend):
    return __import__(f"{backend.module.__name__}.kv_cache", fromlist=["kv_cache"])


def test_cache_empty_names_the_bad_argument(backend):
    good = {"batch_shape": (1,), "kv_heads": 2, "max_len": 3, "head_dim": 4}
    bad = [({"kv_heads": 0}, ValueError, r"kv_heads must be an int >= 1; got kv_heads=0"),
           ({"max_len": -1}, ValueError, r"max_len must be an int >= 0; got max_len=-1"),
           ({"head_dim": 2.5}, ValueError, r"head_dim must be an int >= 0; got head_dim=2\.5"),
           ({"v_dim": -1}, ValueError, r"v_dim must be an int >= 0; got v_dim=-1"),
           ({"dtype": "int32"}, TypeError, r"dtype must be float16, bfloat16, float32 or")]
    if backend.name != "torch":  # torch_attn hands a device to torch, which names it
        bad.append(({"device": "tpu:9"}, ValueError, r".*; got device='tpu:9'$"))
    for change, error, words in bad:
        with pytest.raises(error, match=r"^KVCache\.empty: " + words):
            backend.module.KVCache.empty(**{**good, **change})


def test_cache_empty_dtypes_and_shapes(backend):
    cache = backend.module.KVCache.empty((2, 3), 2, 5, 4)
    assert tuple(cache.key_buffer.shape) == tuple(cache.value_buffer.shape) == (2, 3, 2, 5, 4)
    assert _dtype_name(cache.key_buffer) == _dtype_name(cache.value_buffer) == "float32"
    framework = {"numpy": "numpy", "torch": "torch", "jax": "jax.numpy"}[backend.name]
    float16 = __import__(framework, fromlist=["float16"]).float16
    for dtype, name in (("bfloat16", "bfloat16"), ("float16", "float16"), (float16, "float16")):
        cache = backend.module.KVCache.empty((), 1, 2, 3, v_dim=5, dtype=dtype)
        assert _dtype_name(cache.key_buffer) == _dtype_name(cache.value_buffer) == name
        assert tuple(cache.value_buffer.shape) == (1, 2, 5)


def assert_bfloat16_before_ml_dtypes(expression: str) -> None:
    """``expression`` (numpy_attn imported, ml_dtypes not yet: NumPy knows the name
    "bfloat16" only after that import) prints ``bfloat16`` in a fresh interpreter."""
    code = ("import sys, numpy_attn; assert 'ml_dtypes' not in sys.modules; "
            f"print({expression})")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout(120))
    assert (run.returncode, run.stdout.strip()) == (0, "bfloat16"), run.stderr[-2000:]


@pytest.mark.slow
def test_numpy_cache_names_bfloat16_before_ml_dtypes_is_imported():
    """``dtype="bfloat16"`` in a process where nothing imported ml_dtypes yet."""
    assert_bfloat16_before_ml_dtypes(
        "numpy_attn.KVCache.empty((1,), 1, 2, 3, dtype='bfloat16').key_buffer.dtype")


# numpy and torch: jax_attn's eager decode_step compiles each of its operations for these
# shapes (about 10 s for the two tests); its jitted step is tested above and in
# test_decoding_state.py
EAGER = pytest.mark.parametrize("backend", ["numpy", "torch"], indirect=True)


@EAGER
def test_decode_step_unbatched_split_and_sinks(backend, monkeypatch):
    """Unbatched ``(heads, n, head_dim)`` inputs (heads, kv_heads, n, head_dim and v_dim all
    different): a new cache holds ``n`` positions when ``max_len`` is None, in the keys' dtype;
    then decoding token by token with sinks over a cache of 7, split-KV (chunks of 2) once it
    holds 6 keys (``rules.split_chunk``), float32 steps into a float64 cache, equals the
    float64 reference."""
    for name, value in (("chunk", 2), ("min_kv_len", 6), ("max_q_len", 2), ("steps", 2)):
        monkeypatch.setitem(attention_rules.SPLIT_KV, name, value)
    file = _kv_cache_file(backend)
    split_calls = []
    split = file.split_kv_attention
    monkeypatch.setattr(file, "split_kv_attention",
                        lambda *a, **k: split_calls.append(1) or split(*a, **k))
    rng = np.random.default_rng(5)
    heads, kv_heads, n, head_dim, v_dim, steps = 4, 2, 3, 5, 6, 4
    query = rng.standard_normal((heads, n + steps, head_dim)).astype(np.float32)
    key = rng.standard_normal((kv_heads, n + steps, head_dim)).astype(np.float32)
    value = rng.standard_normal((kv_heads, n + steps, v_dim)).astype(np.float32)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)

    def part(start, stop, dtype=np.float32):
        return [backend.asarray(a[:, start:stop].astype(dtype)) for a in (query, key, value)]

    out, cache = file.decode_step(*part(0, n, np.float16), None, None)
    assert cache.max_len == n and int(cache.length) == n
    assert _dtype_name(out) == _dtype_name(cache.key_buffer) == "float16"
    out, cache = file.decode_step(*part(0, n), None, n + steps)
    assert cache.max_len == n + steps and _dtype_name(out) == "float32"
    expected = reference.attention(query[:, :n], key[:, :n], value[:, :n], is_causal=True)
    np.testing.assert_allclose(backend.to_numpy(out), expected.output, **TOL)
    assert not split_calls, "3 query rows: more than max_q_len, one piece"
    # float32 steps into a float64 cache: cast to the cache's dtype (torch: with grad mode on,
    # this step's keys are cast on their own)
    cache = backend.module.KVCache.empty((), kv_heads, n + steps, head_dim, v_dim,
                                         dtype="float64")
    out, cache = file.decode_step(*part(0, n), cache, None)
    for t in range(n, n + steps):
        out, cache = file.decode_step(*part(t, t + 1), cache, None, sinks=backend.asarray(sinks))
        assert int(cache.length) == t + 1 and _dtype_name(out) == "float64"
        expected = reference.attention(query[:, t:t + 1], key[:, :t + 1], value[:, :t + 1],
                                       sinks=sinks)
        np.testing.assert_allclose(backend.to_numpy(out), expected.output, rtol=1e-12,
                                   atol=1e-12)
    assert split_calls, "one query row over 6 keys or more runs split-KV"
    # and into a narrower float16 cache: float16 out (torch: a float32 key concatenated with
    # the float16 cache would promote it to float32)
    cache = backend.module.KVCache.empty((), kv_heads, n, head_dim, v_dim, dtype="float16")
    out, cache = file.decode_step(*part(0, n), cache, None)
    assert _dtype_name(out) == "float16"
    expected = reference.attention(query[:, :n], key[:, :n], value[:, :n], is_causal=True)
    np.testing.assert_allclose(backend.to_numpy(out).astype(np.float64), expected.output,
                               rtol=1e-2, atol=1e-2)


@EAGER
def test_decode_step_over_a_paged_cache_with_sinks(backend):
    """Two sequences (one kv head: the batch axis is not the heads axis) decoded through a
    float64 ``PagedKVCache`` from float32 inputs (cast to the cache's dtype) with sinks equal
    the float64 reference; torch: with and without grad mode, which attend the new keys two
    ways."""
    rng = np.random.default_rng(6)
    heads, kv_heads, head_dim, steps = 4, 1, 3, 3
    query = rng.standard_normal((2, heads, 2 + steps, head_dim)).astype(np.float32)
    key = rng.standard_normal((2, kv_heads, 2 + steps, head_dim)).astype(np.float32)
    value = rng.standard_normal((2, kv_heads, 2 + steps, head_dim)).astype(np.float32)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    modes = [contextlib.nullcontext]
    if backend.name == "torch":
        import torch

        modes.append(torch.no_grad)
    file = _kv_cache_file(backend)
    for mode in modes:
        cache = backend.module.PagedKVCache(8, 2, kv_heads, head_dim, dtype="float64")
        with mode():
            for start, stop in ((0, 2), (2, 3), (3, 4), (4, 5)):
                out, cache = file.decode_step(
                    *(backend.asarray(a[:, :, start:stop]) for a in (query, key, value)),
                    cache, None, sinks=backend.asarray(sinks))
                assert _dtype_name(out) == "float64"
                expected = reference.attention(
                    query[:, :, start:stop], key[:, :, :stop], value[:, :, :stop],
                    is_causal=True, causal_alignment="bottom_right", sinks=sinks)
                np.testing.assert_allclose(backend.to_numpy(out), expected.output, rtol=1e-12,
                                           atol=1e-12)


# jax_attn's eager decode_step, the JAX twin of the two tests above (from mutation testing,
# docs/mutation.md): every step uses the same few shapes, unbatched (heads, n, dim) inputs
# whose sizes all differ, a prefill of N rows then steps of one row; x64 on for the float64
# caches

Q_HEADS, KV_HEADS, N, HEAD_DIM, V_DIM, STEPS = 4, 2, 3, 5, 6, 3
SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
EXACT = {"rtol": 1e-12, "atol": 1e-12}


def _step_inputs(seed: int, batch: tuple = ()) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(batch + (h, N + STEPS, d)).astype(np.float32)
                 for h, d in ((Q_HEADS, HEAD_DIM), (KV_HEADS, HEAD_DIM), (KV_HEADS, V_DIM)))


@pytest.mark.slow
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
    query, key, value = _step_inputs(5)

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


@pytest.mark.slow
def test_jax_decode_step_chunked_prefill_and_paged_cache_with_sinks(x64_on):
    """Batched inputs: a prefill of 2 rows then a chunk of 2 rows over the cache (bottom-right
    causal from the cache's length) and a float64 ``PagedKVCache`` fed float32 steps with
    sinks equal the float64 reference; a float32 query over a float16 paged cache gives
    float16."""
    import jax.numpy as jnp

    from jax_attn import kv_cache

    query, key, value = _step_inputs(6, batch=(2,))
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
    _, key, value = (a[..., :2, :] for a in _step_inputs(7, batch))
    cache = cache.append(key, value)
    assert int(cache.length) == 2 and not bool(cache.overflowed)
    assert cache.keys.dtype == cache.values.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(cache.keys), key.astype(np.float16))
    np.testing.assert_array_equal(np.asarray(cache.values), value.astype(np.float16))
    np.testing.assert_array_equal(np.asarray(cache.key_buffer)[..., 2:, :], 0)
    with pytest.raises(ValueError, match=r"^KVCache\.append: .*max_len=3"):
        cache.append(key, value)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_torch_training_decode_step_gradients_reach_this_steps_keys(paged):
    """torch, grad mode on: the gradients of a decoding step's output with respect to its own
    query, key and value (float32 inputs into a float64 cache) equal the float64 reference's
    VJP over every cached position (``reference.attention_vjp``; the cached positions are
    constants, so only this step's rows of ``dK``/``dV`` are compared), for a contiguous and
    a paged cache."""
    torch = pytest.importorskip("torch", reason="pip install torch==2.13.0")
    import torch_attn
    from torch_attn import kv_cache

    rng = np.random.default_rng(8)
    heads, kv_heads, head_dim, n = 4, 2, 3, 2
    query, key, value, grad = (rng.standard_normal((2, h, 5, head_dim)).astype(np.float32)
                               for h in (heads, kv_heads, kv_heads, heads))
    cache = (torch_attn.PagedKVCache(8, 2, kv_heads, head_dim, dtype="float64") if paged
             else torch_attn.KVCache.empty((2,), kv_heads, 5, head_dim, dtype="float64"))
    with torch.no_grad():
        first = (torch.from_numpy(a[:, :, :3]) for a in (query, key, value))
        _, cache = kv_cache.decode_step(*first, cache, None)
    leaves = [torch.from_numpy(a[:, :, 3:]).requires_grad_() for a in (query, key, value)]
    out, cache = kv_cache.decode_step(*leaves, cache, None)
    got = torch.autograd.grad(out, leaves, torch.from_numpy(grad[:, :, 3:]).double())
    expected = reference.attention_vjp(query[:, :, 3:], key, value, grad[:, :, 3:],
                                       is_causal=True, causal_alignment="bottom_right")
    for name, g in zip(("query", "key", "value"), got, strict=True):
        e = getattr(expected, name)
        np.testing.assert_allclose(g.numpy(), e if name == "query" else e[:, :, -n:],
                                   rtol=1e-5, atol=1e-6, err_msg=name)
