"""When the blocked paths are taken, at what sizes, and numpy_attn's thread pool.

The selection rule (``_fast.use_fast_path``) on each side of every threshold the spec documents
(``spec.FAST_PATHS``), at the real numbers, from shapes alone (no compute); jax_attn's unpatched
blocked path traced at the documented block and segment sizes (no compile); numpy_attn's
default blocks at full size against the float64 reference; and its thread pool: BLAS threads
restored after a call, the same bits from four threads at once, the calling thread when
threadpoolctl is missing, and no thread nor threadpoolctl at import. The blocked results
themselves are ``tests/test_performance_paths.py``'s, whose inputs and checks these reuse.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest
from numerics import assert_conforms, expected_values
from subprocesses import timeout
from test_performance_paths import BACKENDS, _check, _inputs, _module, _small_blocks

from conformance import spec


@pytest.fixture
def numpy_small_blocks(monkeypatch):
    """numpy_attn with small blocks (tests of its thread pool)."""
    return _small_blocks("numpy", monkeypatch)


def _selected(name, q_shape, k_shape, v_shape, dtype="float32", dropout_p=0.0,
              return_weights=False, **extra):
    """What ``_fast.use_fast_path`` selects for these shapes (no mask or bias)."""
    import attention_rules

    args = attention_rules.attention_arguments(
        "test", (q_shape, dtype), (k_shape, dtype), (v_shape, dtype),
        dropout_p=dropout_p, return_weights=return_weights,
        dropout_mask=None if dropout_p == 0 else ((), "bool"),
    )
    if name == "jax":
        import jax

        arrays = [jax.ShapeDtypeStruct(s, dtype) for s in (q_shape, k_shape, v_shape)]
    else:  # views of one zero: no memory
        arrays = [np.broadcast_to(np.zeros((), dtype), s) for s in (q_shape, k_shape, v_shape)]
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
def test_blocked_path_on_each_side_of_the_documented_thresholds(name):
    """The unpatched rule at ``spec.FAST_PATHS``' numbers (what docs/spec.md states): at
    least ``min_q_len`` queries and ``min_scores`` score entries (all heads counted) select
    the blocked path, one query or one score fewer does not; in jax_attn only on the
    documented platforms."""
    numbers = spec.FAST_PATHS[f"{name}_attn"]["blocked"]
    min_q, min_scores = numbers["min_q_len"], numbers["min_scores"]
    kv = min_scores // min_q
    assert kv * min_q == min_scores  # the shapes below sit exactly on the threshold
    extra = {"backend": numbers["platforms"][0]} if name == "jax" else {}

    def selected(q_len, kv_len, heads=1):
        q, k = (1, heads, q_len, 8), (1, heads, kv_len, 8)
        return _selected(name, q, k, k, **extra)

    assert selected(min_q, kv) == "blocked"
    assert selected(min_q, kv - 1) is None  # one key fewer: min_scores - min_q_len entries
    assert selected(min_q - 1, kv + kv) is None  # enough entries, one query too few
    assert selected(min_q, kv // 2, heads=2) == "blocked"  # the heads count
    assert selected(min_q, kv // 2 - 1, heads=2) is None
    if name == "jax":
        for platform in ("tpu", "gpu"):
            assert platform not in numbers["platforms"]
            assert _selected(name, (1, 1, min_q, 8), (1, 1, kv, 8), (1, 1, kv, 8),
                             backend=platform) is None


def test_jax_blocks_and_segments_are_the_documented_sizes():
    """The unpatched blocked path, traced at ``spec.FAST_PATHS``' sizes (no compile): the
    forward ``lax.map`` runs ``q_len / rows`` blocks (``block_q`` grown), the VJP's ``lax.scan``
    ``kv_len / block_kv`` steps, and a window cuts the queries into ``segments`` pieces."""
    jax = pytest.importorskip("jax", reason="pip install jax")
    import jax_attn

    numbers = spec.FAST_PATHS["jax_attn"]["blocked"]
    n = 8 * numbers["block_q"]  # q_len = kv_len: 8 query blocks, at least min_scores entries
    assert n * n >= numbers["min_scores"] and n >= numbers["min_q_len"]
    s = jax.ShapeDtypeStruct((1, 1, n, 8), "float32")

    def scan_lengths(fn, *args):
        found = []

        def walk(jaxpr):
            for eqn in jaxpr.eqns:
                if eqn.primitive.name == "scan":
                    found.append(eqn.params["length"])
                for param in eqn.params.values():
                    inner = getattr(param, "jaxpr", param)
                    if hasattr(inner, "eqns"):
                        walk(inner)

        walk(jax.make_jaxpr(fn)(*args).jaxpr)
        return found

    with jax.enable_x64(False):
        forward = scan_lengths(jax_attn.scaled_dot_product_attention, s, s, s)
        vjp = scan_lengths(jax_attn.scaled_dot_product_attention_vjp, s, s, s, s)
        window = scan_lengths(lambda q, k, v: jax_attn.scaled_dot_product_attention(
            q, k, v, window=(64, 0)), s, s, s)
    # without a window, a forward block of one head grows to 2x, then 4x block_q rows while
    # rows × n scores stay within block_scores (FAST_PATH_RULES)
    block = numbers["block_q"]
    rows = max(r for r in (block, 2 * block, 4 * block)
               if r == block or r * n <= numbers["block_scores"])
    assert rows == 4 * block  # n = 1024 keys: 512 rows, 2 MiB of float32 scores
    assert forward == [n // rows]
    assert vjp == [n // rows, n // numbers["block_kv"]]
    assert len(window) == numbers["segments"] and sum(window) == n // block  # not grown


@pytest.mark.slow
def test_numpy_large_default_blocks_match_reference():
    """Default block size and threshold, threads and all: 2 heads of 1024 tokens. (``v_dim``
    4: the tolerance rule's estimate of rounding holds a ``(q_len, kv_len, v_dim)`` array; the
    expected values are computed a head at a time, which halves this test's memory peak, the
    largest of the suite: 380 MB above its worker's.)"""
    import numpy_attn

    gen = np.random.default_rng(3)
    q, k = (gen.standard_normal((1, 2, 1024, 32)).astype(np.float32) for _ in range(2))
    v = gen.standard_normal((1, 2, 1024, 4)).astype(np.float32)
    for options in ({}, {"is_causal": True}, {"window": (100, 10)}):
        output = numpy_attn.scaled_dot_product_attention(q, k, v, **options)  # both heads
        for head in (slice(0, 1), slice(1, 2)):
            arrays = {"query": q[:, head], "key": k[:, head], "value": v[:, head]}
            exp = expected_values(arrays, "float32", **options)
            assert_conforms(exp, "output", output[:, head])


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
    _check(small_blocks, q, k, v, is_causal=True)
    assert threads._state["controller"] is None
    assert "pool" not in threads._state


def test_import_numpy_attn_imports_no_threadpoolctl_and_starts_no_thread():
    code = (
        "import sys, threading, numpy_attn; "
        "print('threadpoolctl' in sys.modules, threading.active_count())"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=timeout(60))
    assert result.stdout.split() == ["False", "1"]
