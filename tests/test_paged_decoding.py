"""Decoding at scale (``spec.SPLIT_DECODING``, ``spec.PAGED_CACHE``): split-KV decoding and the
paged KV cache equal the contiguous computation.

The invariant: after appends of different lengths per sequence, a free and the reuse of its
pages, decoding from the ``PagedKVCache`` equals the float64 reference over each sequence's
keys (``conformance.cases.reference``, never the code under test) and the backend's own attention
over a contiguous copy of them; a module decoding through a paged cache equals decoding through
a ``KVCache`` and the full causal pass. ``SPLIT_KV`` is made small here (``_small_chunks``) so
that a few keys make several chunks and the merge runs. Planted bugs (a page table off by one,
merging in log2, a chunk boundary dropping one key) must fail the same checks.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
from test_kv_cache import _weights, mha_reference

import attention_rules
from conformance import spec
from conformance.cases import reference

HEADS, KV_HEADS, HEAD_DIM, V_DIM, BLOCK, NUM_BLOCKS = 4, 2, 8, 6, 4, 12
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 8 keys (2 pages of ``BLOCK``), split from 12 cached keys: a sequence of about
    ten keys is two chunks, so every check below runs the merge."""
    for name, value in (("chunk", 8), ("min_kv_len", 12), ("steps", 2)):
        monkeypatch.setitem(attention_rules.SPLIT_KV, name, value)


def _history(backend):
    """A cache after appends of different lengths per sequence, a free and the reuse of the
    freed pages; the float64 keys and values of each sequence held (the truth)."""
    rng = np.random.default_rng(7)
    cache = backend.module.PagedKVCache(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, V_DIM)
    truth: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def append(cache, seqs, n):
        keys = rng.standard_normal((len(seqs), KV_HEADS, n, HEAD_DIM)).astype(np.float32)
        values = rng.standard_normal((len(seqs), KV_HEADS, n, V_DIM)).astype(np.float32)
        cache = cache.append(backend.asarray(keys), backend.asarray(values), seqs)
        for row, seq in enumerate(seqs):
            old_k, old_v = truth.get(seq, (np.zeros((KV_HEADS, 0, HEAD_DIM)),
                                           np.zeros((KV_HEADS, 0, V_DIM))))
            truth[seq] = (np.concatenate([old_k, keys[row]], 1),
                          np.concatenate([old_v, values[row]], 1))
        return cache

    cache = append(cache, [0, 1, 2], 5)
    cache = append(cache, [1], 7)
    cache = append(cache, [0, 2], 3)
    freed = set(backend.to_numpy(cache.tables([1])[0])[0].tolist())
    free_before = cache.num_free_blocks
    cache = cache.free(1)
    truth.pop(1)
    assert cache.num_free_blocks == free_before + 3 and cache.seq_len(1) == 0
    cache = append(cache, [3], 9)  # the lowest free pages: those sequence 1 gave back
    assert freed & set(backend.to_numpy(cache.tables([3])[0])[0].tolist())
    cache = append(cache, [0, 2, 3], 2)
    return cache, truth


def _check_paged(backend, cache, truth, seqs, q_len, **options):
    """``cache.attend`` of random queries equals, per sequence, the float64 reference and the
    backend's attention over the sequence's keys in one contiguous array (output and lse)."""
    rng = np.random.default_rng(q_len)
    query = rng.standard_normal((len(seqs), HEADS, q_len, HEAD_DIM)).astype(np.float32)
    sinks = options.pop("sinks", None)
    given = {} if sinks is None else {"sinks": backend.asarray(sinks)}
    output, lse = cache.attend(backend.asarray(query), seqs, return_lse=True, **given, **options)
    output, lse = backend.to_numpy(output), backend.to_numpy(lse)
    for row, seq in enumerate(seqs):
        keys, values = truth[seq]
        expected = reference.attention(query[row], keys, values, is_causal=True,
                                       causal_alignment="bottom_right", sinks=sinks, **options)
        np.testing.assert_allclose(output[row], expected.output, **TOL)
        np.testing.assert_allclose(lse[row], expected.lse, **TOL)
        contiguous = backend.module.scaled_dot_product_attention(
            *(backend.asarray(x.astype(np.float32)[None]) for x in (query[row], keys, values)),
            is_causal=True, causal_alignment="bottom_right", **given, **options)
        np.testing.assert_allclose(output[row], backend.to_numpy(contiguous)[0], **TOL)


@pytest.mark.slow
def test_paged_decoding_equals_the_contiguous_cache(backend):
    cache, truth = _history(backend)
    assert [cache.seq_len(s) for s in (0, 2, 3)] == [10, 10, 11]
    _check_paged(backend, cache, truth, [3, 0, 2], q_len=1)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    _check_paged(backend, cache, truth, [0, 3], q_len=3, sinks=sinks, softcap=5.0)
    # the kernel itself, on the cache's table: entries past a sequence's pages are never read
    table, lens = (backend.to_numpy(x) for x in cache.tables([0, 3]))
    assert table.dtype == np.int32 and (table[0, 3:] == -1).all()


def _decode(backend, module, x, cache, max_len=None):
    outputs = []
    for i in range(x.shape[1]):
        out, cache = module.decode(backend.asarray(x[:, i:i + 1]), cache, max_len=max_len)
        outputs.append(backend.to_numpy(out))
    return np.concatenate(outputs, 1)


@pytest.mark.slow
def test_module_decoding_split_and_paged_equals_the_full_causal_pass(backend, monkeypatch):
    rng = np.random.default_rng(11)
    weights = _weights(rng, KV_HEADS)
    x = rng.standard_normal((2, 14, 16)).astype(np.float32)
    module = backend.module.MultiHeadAttention(16, HEADS, num_kv_heads=KV_HEADS,
                                               rng=backend.rng(0)).load_weights(weights)
    paged_file = __import__(f"{backend.module.__name__}.paged", fromlist=["paged"])
    kv_cache_file = __import__(f"{backend.module.__name__}.kv_cache", fromlist=["kv_cache"])
    calls = []
    split = paged_file.split_kv_attention
    monkeypatch.setattr(kv_cache_file, "split_kv_attention",
                        lambda *a, **k: calls.append(1) or split(*a, **k))
    expected = mha_reference(weights, x, KV_HEADS)
    contiguous = _decode(backend, module, x, None, max_len=14)
    np.testing.assert_allclose(contiguous, expected, **TOL)
    assert calls, "a step over 12 keys or more runs split-KV"
    paged = _decode(backend, module, x, backend.module.PagedKVCache(8, 4, KV_HEADS, 4))
    np.testing.assert_allclose(paged, expected, **TOL)


@pytest.mark.parametrize("n", [1, 3])
def test_split_kv_attention_equals_the_reference(backend, n):
    """The contiguous split (keys 0..21 in chunks of 8: 8, 8, 5), with sinks, both ways to
    call it: the backend's own function, and (jax) a buffer with unfilled positions."""
    rng = np.random.default_rng(n)
    query = rng.standard_normal((2, HEADS, n, HEAD_DIM)).astype(np.float32)
    keys = rng.standard_normal((2, KV_HEADS, 21, HEAD_DIM)).astype(np.float32)
    values = rng.standard_normal((2, KV_HEADS, 21, V_DIM)).astype(np.float32)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    paged_file = __import__(f"{backend.module.__name__}.paged", fromlist=["paged"])
    output, lse = paged_file.split_kv_attention(
        *(backend.asarray(a) for a in (query, keys, values)), 8, sinks=backend.asarray(sinks))
    expected = reference.attention(query, keys, values, is_causal=True,
                                   causal_alignment="bottom_right", sinks=sinks)
    np.testing.assert_allclose(backend.to_numpy(output), expected.output, **TOL)
    np.testing.assert_allclose(backend.to_numpy(lse), expected.lse, **TOL)


def _paged_call(backend, cache, seqs):
    query = np.random.default_rng(5).standard_normal((len(seqs), HEADS, 1, HEAD_DIM))
    table, lens = cache.tables(seqs)
    return backend.asarray(query.astype(np.float32)), table, lens


def test_bad_tables_and_a_full_pool_are_clear_errors(backend):
    cache, _ = _history(backend)
    query, table, lens = _paged_call(backend, cache, [0, 2])
    pages = (cache.key_pages, cache.value_pages)
    fn = backend.module.paged_attention
    table_np, lens_np = backend.to_numpy(table), backend.to_numpy(lens)

    def call(table=table_np, lens=lens_np):
        return fn(query, *pages, backend.asarray(table), backend.asarray(lens))

    bad = table_np.copy()
    bad[1, 2] = NUM_BLOCKS + 3
    with pytest.raises(ValueError, match=rf"block_table\[1, 2\]={NUM_BLOCKS + 3} is not a page "
                                         rf".*\[0, {NUM_BLOCKS}\)"):
        call(bad)
    bad = table_np.copy()
    bad[1, 0] = table_np[0, 1]
    with pytest.raises(ValueError, match=r"block_table\[1, 0\]=\d+ points into another "
                                         r"sequence's page: block_table\[0, 1\]"):
        call(bad)
    bad = table_np.copy()
    bad[0, 2] = table_np[0, 0]
    with pytest.raises(ValueError, match=r"block_table\[0, 2\]=\d+ points into a page this "
                                         r"sequence uses"):
        call(bad)
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=13 must lie in \[0, max_blocks · "
                                         r"block_size\] = \[0, 12\]"):
        call(lens=np.array([10, 13], np.int32))
    keys = backend.asarray(np.zeros((1, KV_HEADS, 4 * NUM_BLOCKS, HEAD_DIM), np.float32))
    values = backend.asarray(np.zeros((1, KV_HEADS, 4 * NUM_BLOCKS, V_DIM), np.float32))
    free = cache.num_free_blocks
    with pytest.raises(ValueError, match=rf"the pool is full; 12 more pages are needed, {free} "
                                         rf"of num_blocks={NUM_BLOCKS} are free"):
        cache.append(keys, values, [5])
    assert cache.num_free_blocks == free and cache.seq_len(5) == 0  # nothing changed
    with pytest.raises(ValueError, match="PagedKVCache.free: sequence 1 holds no positions"):
        cache.free(1)


@pytest.mark.slow
def test_gradients_through_the_gather_equal_the_contiguous_ones(backend):
    """jax_attn and torch_attn differentiate paged_attention by autodiff: the query's gradient
    and the pages' (the contiguous keys' gradient, scattered to their pages)."""
    if backend.name == "numpy":
        pytest.skip("numpy_attn: paged_attention is forward only (spec.PAGED_CACHE)")
    cache, truth = _history(backend)
    query, table, lens = _paged_call(backend, cache, [3])
    keys, values = truth[3]
    contiguous = [backend.asarray(a.astype(np.float32)[None]) for a in (keys, values)]
    sdpa, paged = backend.module.scaled_dot_product_attention, backend.module.paged_attention

    def paged_loss(q, key_pages):
        return (paged(q, key_pages, cache.value_pages, table, lens) ** 2).sum()

    def contiguous_loss(q, k):
        return (sdpa(q, k, contiguous[1], is_causal=True, causal_alignment="bottom_right")
                ** 2).sum()

    if backend.name == "jax":
        import jax

        grads = jax.grad(paged_loss, argnums=(0, 1))(query, cache.key_pages)
        expected = jax.grad(contiguous_loss, argnums=(0, 1))(query, contiguous[0])
    else:
        import torch

        q, key_pages = query.clone().requires_grad_(), cache.key_pages.clone().requires_grad_()
        grads = torch.autograd.grad(paged_loss(q, key_pages), (q, key_pages))
        q, k = query.clone().requires_grad_(), contiguous[0].clone().requires_grad_()
        expected = torch.autograd.grad(contiguous_loss(q, k), (q, k))
    np.testing.assert_allclose(backend.to_numpy(grads[0]), backend.to_numpy(expected[0]), **TOL)
    page_grads = backend.to_numpy(grads[1])
    rows = backend.to_numpy(table)[0]
    for position in range(keys.shape[1]):  # position t: row t % BLOCK of page table[t // BLOCK]
        np.testing.assert_allclose(page_grads[rows[position // BLOCK], position % BLOCK],
                                   backend.to_numpy(expected[1])[0, :, position], **TOL)
    other = backend.to_numpy(cache.tables([0])[0])[0, 0]
    assert not page_grads[other].any(), "another sequence's page gets no gradient"


def test_jax_traced_table_compiles_and_an_out_of_range_page_reads_nan():
    jax = pytest.importorskip("jax")

    import jax_attn
    from conformance.running import backends

    backend = backends.get("jax")
    cache, truth = _history(backend)
    query, table, lens = _paged_call(backend, cache, [0, 2])
    step = jax.jit(jax_attn.paged_attention)
    good = np.asarray(step(query, cache.key_pages, cache.value_pages, table, lens))
    np.testing.assert_allclose(good, np.asarray(cache.attend(query, [0, 2])), **TOL)
    bad = np.asarray(step(query, cache.key_pages, cache.value_pages,
                          table.at[1, 0].set(NUM_BLOCKS + 1), lens))
    assert np.isnan(bad[1]).all() and np.allclose(bad[0], good[0]), "NaN, never a wrong number"


def test_paged_cache_methods_follow_the_spec(backend):
    cls, stub = backend.module.PagedKVCache, spec.PagedKVCache

    def params(obj):
        return [(p.name, p.kind, p.default) for p in inspect.signature(obj).parameters.values()
                if p.name != "self"]

    keyword, empty = inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert params(cls.__init__) == [  # as the stub's docstring writes the constructor
        ("num_blocks", positional, empty), ("block_size", positional, empty),
        ("kv_heads", positional, empty), ("head_dim", positional, empty),
        ("v_dim", positional, None), ("dtype", keyword, "float32"), ("device", keyword, None)]
    for name in [m for m in vars(stub) if not m.startswith("_")]:
        assert params(getattr(cls, name)) == params(getattr(stub, name)), name


def test_a_pool_without_values_takes_appends(backend):
    """``v_dim=0``: a pool of keys only (a latent cache reads its values from the keys). Its
    appends land where the tables say; a ``reshape(-1, ...)`` of the empty values raised."""
    rng = np.random.default_rng(3)
    cache = backend.module.PagedKVCache(NUM_BLOCKS, BLOCK, 1, HEAD_DIM, 0)
    keys = rng.standard_normal((2, 1, 5, HEAD_DIM)).astype(np.float32)
    cache = cache.append(backend.asarray(keys), backend.asarray(np.zeros((2, 1, 5, 0),
                                                                         np.float32)))
    table, lens = (backend.to_numpy(t) for t in cache.tables([0, 1]))
    assert lens.tolist() == [5, 5]
    pages = backend.to_numpy(cache.key_pages)
    for seq in (0, 1):
        held = np.concatenate([pages[p] for p in table[seq] if p >= 0])[:5]  # (5, 1, dim)
        np.testing.assert_array_equal(held[:, 0], keys[seq, 0])
    assert backend.to_numpy(cache.value_pages).shape == (NUM_BLOCKS, BLOCK, 1, 0)


# ------------------------------------------------------------------ planted bugs: must fail


def _off_by_one(backend, cache):
    """The cache's tables with each sequence's pages rotated by one entry."""
    original = cache.tables

    def tables(seqs=None):
        table, lens = (np.array(backend.to_numpy(x)) for x in original(seqs))
        for row, length in enumerate(lens):
            used = math.ceil(length / BLOCK)
            table[row, :used] = np.roll(table[row, :used], 1)
        return backend.asarray(table), backend.asarray(lens)

    return tables


def _log2_merge(merge):
    def merge_in_log2(outputs, lses, sinks):
        return merge(outputs, lses / math.log(2.0), sinks)  # an lse in log2 units

    return merge_in_log2


def _drops_a_key(kv_chunks):
    def chunks(kv_len, chunk):
        return [(start, stop - 1 if stop < kv_len else stop)
                for start, stop in kv_chunks(kv_len, chunk)]

    return chunks


@pytest.mark.parametrize("bug", ["table_off_by_one", "merge_in_log2", "chunk_drops_a_key"])
def test_planted_bugs_fail_the_checks(backend, bug, monkeypatch):
    cache, truth = _history(backend)
    paged_file = __import__(f"{backend.module.__name__}.paged", fromlist=["paged"])
    if bug == "table_off_by_one":
        monkeypatch.setattr(cache, "tables", _off_by_one(backend, cache))
    elif bug == "merge_in_log2":
        monkeypatch.setattr(paged_file, "_merge_chunks", _log2_merge(paged_file._merge_chunks))
    else:
        monkeypatch.setattr(attention_rules, "kv_chunks", _drops_a_key(attention_rules.kv_chunks))
    with pytest.raises(AssertionError):
        _check_paged(backend, cache, truth, [3, 0, 2], q_len=1)
    if bug != "table_off_by_one":  # the contiguous split shares the merge and the chunks
        with pytest.raises(AssertionError):
            test_split_kv_attention_equals_the_reference(backend, 1)


def test_the_docs_example_prints_what_it_says():
    """docs/paged_decoding.md's example (numpy_attn) prints its documented output."""
    import contextlib
    import io
    from pathlib import Path

    from test_docs import blocks

    (code, documented), = blocks(Path(__file__).resolve().parent.parent / "docs"
                                 / "paged_decoding.md")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "paged_decoding.md", "exec"), {"__name__": "__snippet__"})
    assert printed.getvalue() == documented


# ------------------------------------------- how the kernels read scattered pages (issue 23)


def _scattered(backend, dtype=np.float32):
    """One sequence of 23 positions on pages 5, 2, 9, 0, 7, 3 of a pool of ``NUM_BLOCKS`` (the
    last one partly filled, the pool around it NaN: never read): three chunks of two pages
    each, no two pages of a chunk next to each other in the pool. Returns the call's arguments
    and the float64 reference output."""
    rng = np.random.default_rng(23)
    pages, length = [5, 2, 9, 0, 7, 3], 23
    keys = rng.standard_normal((KV_HEADS, length, HEAD_DIM))
    values = rng.standard_normal((KV_HEADS, length, V_DIM))
    query = rng.standard_normal((1, HEADS, 1, HEAD_DIM))
    pools = []
    for x in (keys, values):
        pool = np.full((NUM_BLOCKS, BLOCK, KV_HEADS, x.shape[-1]), np.nan)
        for t in range(length):
            pool[pages[t // BLOCK], t % BLOCK] = x[:, t]
        pools.append(pool.astype(dtype))
    table = np.array([pages], np.int32)
    args = [backend.asarray(a) for a in (query.astype(dtype), *pools, table,
                                         np.array([length], np.int32))]
    expected = reference.attention(query.astype(dtype)[0], keys.astype(dtype),
                                   values.astype(dtype), is_causal=True,
                                   causal_alignment="bottom_right").output
    return args, expected


def test_a_scattered_chunk_costs_one_product_per_part_not_per_page(backend, monkeypatch):
    """numpy_attn and torch_attn copy a chunk's scattered pages into one buffer and run one
    product for its scores and one for its values (``PART_BYTES`` holds the whole chunk here),
    not a product per page (each a BLAS call or a dispatch as long as the page's arithmetic):
    three chunks of two pages each are three score products, not six."""
    if backend.name == "jax":
        pytest.skip("jax_attn: XLA compiles the gather and the products (a lax.scan step per "
                    "chunk); there is no call to count")
    args, expected = _scattered(backend)
    calls = []
    if backend.name == "numpy":  # the score products (the value products are ``@``)
        matmul = np.matmul
        monkeypatch.setattr(np, "matmul", lambda *a, **k: calls.append(1) or matmul(*a, **k))
    else:
        import torch

        bmm = torch.bmm
        monkeypatch.setattr(torch, "bmm", lambda *a, **k: calls.append(1) or bmm(*a, **k))
    output = backend.to_numpy(backend.module.paged_attention(*args))
    np.testing.assert_allclose(output[0], expected, **TOL)
    assert len(calls) == (3 if backend.name == "numpy" else 6), calls


@pytest.mark.slow
def test_pages_copied_a_page_at_a_time_and_in_any_dtype_equal_the_reference(backend,
                                                                            monkeypatch):
    """The copies of numpy_attn and torch_attn in parts of one page each (``PART_BYTES`` = 1:
    two parts per chunk, the last one a partly filled page) give the reference, and the
    thread's buffer, reused, holds float64 pages after float32 ones (jax_attn: the products
    per kv head, ``FLAT_KV_HEADS`` = 0, instead of every head against every head)."""
    paged_file = __import__(f"{backend.module.__name__}.paged", fromlist=["paged"])
    if backend.name == "jax":
        monkeypatch.setattr(paged_file, "FLAT_KV_HEADS", 0)
        paged_file._paged.clear_cache()  # traced again, with the per-head products
    else:
        monkeypatch.setattr(paged_file, "PART_BYTES", 1)
    try:
        cache, truth = _history(backend)
        _check_paged(backend, cache, truth, [3, 0, 2], q_len=1)
        _check_paged(backend, cache, truth, [0, 3], q_len=3, softcap=5.0)
        if backend.name != "jax":  # jax: float64 needs x64; its buffers are XLA's
            for dtype in (np.float32, np.float64):
                args, expected = _scattered(backend, dtype)
                output = backend.to_numpy(backend.module.paged_attention(*args))
                assert output.dtype == dtype
                np.testing.assert_allclose(output[0], expected, **TOL)
    finally:
        if backend.name == "jax":
            paged_file._paged.clear_cache()
