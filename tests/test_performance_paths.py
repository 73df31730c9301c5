"""The blocked paths for large inputs equal the explicit step-by-step path.

numpy_attn (threads over query blocks) and jax_attn (``lax.map`` over query blocks) select a
blocked computation for large inputs (``_fast.use_fast_path`` returns ``"blocked"``). These
tests shrink the block size and the size threshold so small inputs exercise several blocks,
causal/window segments and skipped blocks, then compare the blocked output with the explicit
path (``return_weights=True`` always takes it) and with the float64 ``conformance.reference``,
for every feature the blocked paths handle, NaN and infinities included. They also check which
inputs stay on the explicit path, and that the selection rule's numbers are
``attention_rules.FAST_PATHS``.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

import attention_rules
from conformance import compare, expected, reference
from conformance.cases import CaseData

BACKENDS = ("numpy", "jax")

# (query, key, value) shapes: batch axes, heads (GQA), 2-D inputs, q_len != kv_len both ways
SHAPES = {
    "4d": ((2, 2, 40, 8), (2, 2, 40, 8), (2, 2, 40, 8)),
    "gqa_q_longer": ((1, 4, 45, 8), (1, 2, 37, 8), (1, 2, 37, 5)),
    "kv_longer": ((3, 29, 8), (3, 70, 8), (3, 70, 6)),
    "2d": ((50, 8), (33, 8), (33, 8)),
    "batch_axes": ((2, 1, 2, 34, 4), (2, 1, 1, 34, 4), (2, 1, 1, 34, 4)),
}

STRUCTURE = [
    {},
    {"is_causal": True},
    {"is_causal": True, "causal_alignment": "bottom_right"},
    {"window": (3, 2)},
    {"window": (5, 0), "causal_alignment": "bottom_right"},
    {"window": (None, 4)},
    {"window": (7, None), "causal_alignment": "bottom_right"},
    {"window": (0, 0)},
    {"is_causal": True, "window": (6, 3)},
]


def _module(name: str):
    if name == "jax":
        pytest.importorskip("jax")
        import jax_attn

        return jax_attn
    import numpy_attn

    return numpy_attn


@pytest.fixture(params=BACKENDS)
def small_blocks(request, monkeypatch):
    """The backend module, with its blocked path taken by every input of at least 2 blocks."""
    return _small_blocks(request.param, monkeypatch)


@pytest.fixture
def numpy_small_blocks(monkeypatch):
    """numpy_attn with small blocks (tests of its thread pool)."""
    return _small_blocks("numpy", monkeypatch)


@pytest.fixture
def jax_small_blocks(monkeypatch):
    """jax_attn with small blocks (tests of jit, vmap and grad)."""
    return _small_blocks("jax", monkeypatch)


def _small_blocks(name, monkeypatch):
    module = _module(name)
    fast = module._fast
    monkeypatch.setattr(fast, "BLOCK_Q", 8)
    monkeypatch.setattr(fast, "MIN_SCORES", 0)
    monkeypatch.setattr(fast, "MIN_Q_LEN", 8)
    calls = []
    real = fast.fast_attention

    def spy(path, *args, **kwargs):
        calls.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(fast, "fast_attention", spy)
    module.blocked_calls = calls
    return module


def _inputs(shape_name: str, dtype=np.float32, seed: int = 0):
    gen = np.random.default_rng(seed)
    return [gen.standard_normal(s).astype(dtype) for s in SHAPES[shape_name]]


def _target(q, k) -> tuple[int, ...]:
    return q.shape[:-1] + (k.shape[-2],)


def _compare(module, q, k, v, rtol=2e-5, atol=2e-6, with_reference=True, **options):
    """Blocked output vs the explicit path vs the float64 reference; returns the output."""
    module.blocked_calls.clear()
    fast = np.asarray(module.scaled_dot_product_attention(q, k, v, **options))
    assert module.blocked_calls, "the blocked path did not run"
    module.blocked_calls.clear()
    plain, _ = module.scaled_dot_product_attention(q, k, v, return_weights=True, **options)
    assert not module.blocked_calls, "return_weights must take the explicit path"
    plain = np.asarray(plain)
    assert fast.dtype == plain.dtype and fast.shape == plain.shape
    scale = np.abs(plain).max() + 1e-30
    np.testing.assert_allclose(fast, plain, rtol=rtol, atol=atol * scale)
    if with_reference:
        ref = reference.attention(q, k, v, **options).output
        np.testing.assert_allclose(fast.astype(np.float64), ref, rtol=rtol, atol=atol * scale)
    assert not np.isnan(fast).any()
    return fast


@pytest.mark.parametrize("shape_name", sorted(SHAPES))
@pytest.mark.parametrize("structure", STRUCTURE, ids=str)
def test_blocked_equals_plain_and_reference(small_blocks, shape_name, structure):
    q, k, v = _inputs(shape_name)
    out = _compare(small_blocks, q, k, v, **structure)
    allowed = reference.structural_mask(q.shape[-2], k.shape[-2], **structure)
    empty = ~allowed.any(axis=-1)  # fully masked rows (e.g. bottom-right with q_len > kv_len)
    assert np.all(out[..., empty, :] == 0.0)


MASK_SHAPES = {  # every way a mask or bias broadcasts to (batch, heads, q_len, kv_len)
    "full": (2, 4, 45, 37),
    "keys": (37,),
    "rows_keys": (45, 37),
    "padding": (2, 1, 1, 37),
    "per_query": (2, 4, 45, 1),
    "per_head": (4, 1, 37),
    "kv_head_row": (1, 4, 45, 37),
    "scalar_like": (1, 1),
}


@pytest.mark.parametrize("mask_shape", sorted(MASK_SHAPES))
@pytest.mark.parametrize("structure", [{}, {"is_causal": True}, {"window": (4, 4)}], ids=str)
def test_blocked_mask_and_bias_broadcasts(small_blocks, mask_shape, structure):
    gen = np.random.default_rng(1)
    q = gen.standard_normal((2, 4, 45, 8)).astype(np.float32)
    k = gen.standard_normal((2, 2, 37, 8)).astype(np.float32)
    v = gen.standard_normal((2, 2, 37, 6)).astype(np.float32)
    shape = MASK_SHAPES[mask_shape]
    mask = gen.random(shape) > 0.3
    bias = gen.standard_normal(shape).astype(np.float32)
    _compare(small_blocks, q, k, v, mask=mask, **structure)
    _compare(small_blocks, q, k, v, bias=bias, **structure)
    _compare(small_blocks, q, k, v, mask=mask, bias=bias, softcap=2.5, scale=0.3, **structure)


def test_blocked_fully_masked_rows_are_exactly_zero(small_blocks):
    q, k, v = _inputs("gqa_q_longer")
    mask = np.ones(_target(q, k), dtype=bool)
    mask[0, 1, 3] = False  # one row
    mask[0, :, 16:24] = False  # a whole block of rows in every head
    mask[0, 2, :, :] = False  # a whole head
    out = _compare(small_blocks, q, k, v, mask=mask)
    assert np.all(out[0, 1, 3] == 0.0)
    assert np.all(out[0, :, 16:24] == 0.0)
    assert np.all(out[0, 2] == 0.0)
    # a window that leaves the first queries nothing: whole blocks skipped, exactly 0
    out = _compare(small_blocks, q, k, v, window=(0, 0), causal_alignment="bottom_right")
    assert np.all(out[..., :8, :] == 0.0)


def test_blocked_bias_with_minus_inf_and_softcap(small_blocks):
    q, k, v = _inputs("4d")
    bias = np.zeros(_target(q, k), dtype=np.float32)
    bias[..., ::3] = -np.inf  # an additive mask
    bias[1, 0, 5, :] = -np.inf  # a fully masked row through the bias alone
    # (the float64 reference treats a row masked by the bias alone as NaN: explicit path only)
    out = _compare(small_blocks, q, k, v, bias=bias, softcap=1.5, is_causal=True,
                   with_reference=False)
    assert np.all(out[1, 0, 5] == 0.0)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NaN and inf - inf: IEEE
def test_blocked_paths_follow_the_ieee_rule_for_nan_and_inf(small_blocks):
    """``spec.NON_FINITE`` on the blocked path, which must give the explicit path's NaN rows."""
    q, k, v = _inputs("4d")  # (2, 2, 40, 8): q_len = kv_len = 40, blocks of 8 queries

    def both(q, k, v, **options):
        small_blocks.blocked_calls.clear()
        fast = np.asarray(small_blocks.scaled_dot_product_attention(q, k, v, **options))
        plain, _ = small_blocks.scaled_dot_product_attention(q, k, v, return_weights=True,
                                                             **options)
        assert small_blocks.blocked_calls == ["blocked"]
        return fast, np.asarray(plain)

    # a NaN in query row 5 of (batch 0, head 1): that output row only
    q_nan = q.copy()
    q_nan[0, 1, 5, 3] = np.nan
    fast, plain = both(q_nan, k, v, is_causal=True)
    expected = np.zeros(fast.shape[:-1], dtype=bool)
    expected[0, 1, 5] = True
    for out in (fast, plain):
        np.testing.assert_array_equal(np.isnan(out).any(-1), expected)
        np.testing.assert_array_equal(np.isnan(out).all(-1), expected)
    np.testing.assert_allclose(fast, plain, rtol=2e-5, atol=2e-6)  # NaN where NaN

    # NaN or +inf in key 20 of (batch 1, kv head 0): rows 0-19 do not attend it (causal)
    for bad in (np.nan, np.inf):
        k_bad = k.copy()
        k_bad[1, 0, 20, :] = bad
        fast, plain = both(q, k_bad, v, is_causal=True)
        for out in (fast, plain):
            assert not np.isnan(out[1, 0, :20]).any(), bad  # masked there: -inf replaces it
            assert np.isnan(out[1, 0, 20:]).all(), bad  # attended: NaN rows
            assert not np.isnan(out[0]).any() and not np.isnan(out[1, 1]).any()
        np.testing.assert_allclose(fast, plain, rtol=2e-5, atol=2e-6)
        mask = np.ones(_target(q, k), dtype=bool)
        mask[..., 20] = False  # masked for every query: nothing spreads
        fast, plain = both(q, k_bad, v, mask=mask)
        assert not np.isnan(fast).any() and not np.isnan(plain).any()
        np.testing.assert_allclose(fast, plain, rtol=2e-5, atol=2e-6)

    # -inf in query row 7 against positive key features: every score -inf, a fully masked row
    k_pos, q_minf = k.copy(), q.copy()
    k_pos[..., 0] = np.abs(k_pos[..., 0]) + 0.1
    q_minf[0, 0, 7, 0] = -np.inf
    fast, plain = both(q_minf, k_pos, v, is_causal=True)
    assert (fast[0, 0, 7] == 0).all() and (plain[0, 0, 7] == 0).all()
    np.testing.assert_allclose(fast, plain, rtol=2e-5, atol=2e-6)

    # a NaN in value row 20: every row with a non-zero weight on key 20 is NaN (rows with
    # weight 0 on it are unspecified: the matmul gives 0 · NaN, a skipped block never reads it)
    v_nan = v.copy()
    v_nan[1, 0, 20, 2] = np.nan
    fast, plain = both(q, k, v_nan, is_causal=True)
    for out in (fast, plain):
        assert np.isnan(out[1, 0, 20:, 2]).all()
        assert not np.isnan(out[0]).any()


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_blocked_dtypes(small_blocks, dtype):
    if small_blocks.__name__ == "jax_attn" and dtype == "float64":
        import jax

        jax.config.update("jax_enable_x64", True)  # float64 in JAX needs x64, as documented
    import ml_dtypes

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v = _inputs("gqa_q_longer", dtype=np_dtype)
    small_blocks.blocked_calls.clear()
    fast = small_blocks.scaled_dot_product_attention(q, k, v, is_causal=True)
    plain, _ = small_blocks.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                         return_weights=True)
    assert small_blocks.blocked_calls
    assert np.asarray(fast).dtype == np_dtype
    # both within the harness's one tolerance rule (spec.TOLERANCES) of the float64 reference
    data = CaseData({"query": q, "key": k, "value": v}, {"is_causal": True})
    exp = expected.expected_for(data, "sdpa", dtype, gradients=False)
    for name, out in (("blocked", fast), ("explicit", plain)):
        result = compare.compare_step(exp, "output", np.asarray(out), "input")
        assert result.passed, f"{name}: {result.ratio:.3g} × tolerance at {result.index}"


def test_small_inputs_dropout_and_weights_take_the_explicit_path(small_blocks, monkeypatch):
    fast = small_blocks._fast
    q, k, v = _inputs("4d")

    def calls(**options):
        small_blocks.blocked_calls.clear()
        small_blocks.scaled_dot_product_attention(q, k, v, **options)
        return len(small_blocks.blocked_calls)

    assert calls() == 1
    assert calls(return_weights=True) == 0
    if small_blocks.__name__ == "jax_attn":
        import jax

        assert calls(dropout_p=0.5, rng=jax.random.key(0)) == 0
    else:
        assert calls(dropout_p=0.5, rng=np.random.default_rng(0)) == 0
    assert calls(dropout_p=0.5, dropout_mask=np.ones(_target(q, k), dtype=bool)) == 0
    monkeypatch.setattr(fast, "MIN_SCORES", q.size // q.shape[-1] * k.shape[-2] + 1)
    assert calls() == 0  # below the size threshold
    monkeypatch.setattr(fast, "MIN_SCORES", 0)
    empty = np.zeros((2, 2, 0, 8), dtype=np.float32)
    small_blocks.blocked_calls.clear()
    out = small_blocks.scaled_dot_product_attention(empty, k, v)
    assert np.asarray(out).shape == (2, 2, 0, 8) and not small_blocks.blocked_calls


def _selected(name, q_shape, k_shape, v_shape, dropout_p=0.0, return_weights=False, **extra):
    """What ``_fast.use_fast_path`` selects for these shapes (float32, no mask or bias)."""
    args = attention_rules.attention_arguments(
        "test", (q_shape, "float32"), (k_shape, "float32"), (v_shape, "float32"),
        dropout_p=dropout_p, return_weights=return_weights,
        dropout_mask=None if dropout_p == 0 else ((), "bool"),
    )
    if name == "jax":
        import jax

        arrays = [jax.ShapeDtypeStruct(s, np.float32) for s in (q_shape, k_shape, v_shape)]
    else:  # views of one zero: no memory
        arrays = [np.broadcast_to(np.float32(0.0), s) for s in (q_shape, k_shape, v_shape)]
    return _module(name)._fast.use_fast_path(*arrays, None, None, args, **extra)


@pytest.mark.parametrize("name", BACKENDS)
def test_default_rule(name):
    extra = {"backend": "cpu"} if name == "jax" else {}
    big = (1, 8, 2048, 64)
    assert _selected(name, big, big, big, **extra) == "blocked"
    assert _selected(name, big, big, big, return_weights=True, **extra) is None
    assert _selected(name, big, big, big, dropout_p=0.1, **extra) is None
    assert _selected(name, (1, 8, 64, 64), (1, 8, 64, 64), (1, 8, 64, 64), **extra) is None
    assert _selected(name, (1, 8, 1, 64), (1, 8, 65536, 64), (1, 8, 65536, 64), **extra) is None
    assert _selected(name, (1, 8, 2048, 0), (1, 8, 2048, 0), big, **extra) is None  # head_dim 0
    if name == "jax":
        assert _selected(name, big, big, big, backend="gpu") is None  # float32: not cuDNN


@pytest.mark.parametrize("name", BACKENDS)
def test_rule_numbers_are_the_fast_paths_of_the_rules(name):
    fast = _module(name)._fast
    numbers = attention_rules.FAST_PATHS[f"{name}_attn"]["blocked"]
    assert (fast.BLOCK_Q, fast.MIN_SCORES, fast.MIN_Q_LEN) == (
        numbers["block_q"], numbers["min_scores"], numbers["min_q_len"]
    )
    if name == "jax":
        assert fast.MIN_Q_LEN >= fast.BLOCK_Q  # lax.map needs at least one whole block


def test_numpy_large_default_blocks_match_plain():
    """Default block size and threshold, threads and all: 2 heads of 1024 tokens, causal."""
    import numpy_attn

    gen = np.random.default_rng(3)
    q, k, v = (gen.standard_normal((1, 2, 1024, 32)).astype(np.float32) for _ in range(3))
    for options in ({}, {"is_causal": True}, {"window": (100, 10)}):
        fast = numpy_attn.scaled_dot_product_attention(q, k, v, **options)
        plain, _ = numpy_attn.scaled_dot_product_attention(q, k, v, return_weights=True,
                                                           **options)
        np.testing.assert_allclose(fast, plain, rtol=1e-5, atol=1e-6)


def test_numpy_restores_blas_threads_and_is_thread_safe(numpy_small_blocks):
    small_blocks = numpy_small_blocks
    threadpoolctl = pytest.importorskip("threadpoolctl")
    before = [lib["num_threads"] for lib in threadpoolctl.threadpool_info()
              if lib["user_api"] == "blas"]
    q, k, v = _inputs("4d")
    expected = small_blocks.scaled_dot_product_attention(q, k, v, is_causal=True)
    after = [lib["num_threads"] for lib in threadpoolctl.threadpool_info()
             if lib["user_api"] == "blas"]
    assert after == before
    results = [None] * 4

    def run(i):
        results[i] = small_blocks.scaled_dot_product_attention(q, k, v, is_causal=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        np.testing.assert_array_equal(result, expected)


def test_numpy_without_threadpoolctl_runs_in_the_calling_thread(numpy_small_blocks, monkeypatch):
    small_blocks = numpy_small_blocks
    threads = small_blocks._threads
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # import fails
    monkeypatch.setattr(threads, "_state", {"lock": threading.Lock()})
    q, k, v = _inputs("gqa_q_longer")
    _compare(small_blocks, q, k, v, is_causal=True)
    assert threads._state["controller"] is None
    assert "pool" not in threads._state


def test_import_numpy_attn_imports_no_threadpoolctl_and_starts_no_thread():
    code = (
        "import sys, threading, numpy_attn; "
        "print('threadpoolctl' in sys.modules, threading.active_count())"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.split() == ["False", "1"]


def test_jax_blocked_path_under_jit_vmap_and_grad(jax_small_blocks):
    small_blocks = jax_small_blocks
    import jax
    import jax.numpy as jnp

    q, k, v = _inputs("gqa_q_longer")
    mask = np.random.default_rng(2).random(_target(q, k)) > 0.2
    options = {"is_causal": True, "causal_alignment": "bottom_right", "softcap": 3.0}

    def loss(q, k, v, blocked):
        if blocked:
            out = small_blocks.scaled_dot_product_attention(q, k, v, mask=mask, **options)
        else:
            out, _ = small_blocks.scaled_dot_product_attention(
                q, k, v, mask=mask, return_weights=True, **options)
        return jnp.sum(jnp.sin(out))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    small_blocks.blocked_calls.clear()
    fast = grads(q, k, v, True)
    assert small_blocks.blocked_calls
    plain = grads(q, k, v, False)
    for f, p in zip(fast, plain, strict=True):
        assert not np.isnan(np.asarray(f)).any()
        np.testing.assert_allclose(np.asarray(f), np.asarray(p), rtol=1e-4, atol=1e-5)
    batched = jax.vmap(lambda q: small_blocks.scaled_dot_product_attention(q, k[0], v[0]))(q)
    single = small_blocks.scaled_dot_product_attention(q[0], k[0], v[0])
    np.testing.assert_allclose(np.asarray(batched[0]), np.asarray(single), rtol=1e-5, atol=1e-6)
