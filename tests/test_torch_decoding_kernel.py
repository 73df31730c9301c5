"""torch_attn's decoding kernels (``torch_attn/paged.py``, issues 23 and 26): a decoding step
of a few query rows runs torch_attn's own matrix products (not ``scaled_dot_product_attention``)
whatever the cache's length, as a fixed number of torch operations however many chunks the
cache is cut into, and pages that lie in order in the pool are read in place. Every result is
checked against the float64 ``conformance.cases.reference`` (outputs and, in grad mode, the VJP);
the operation counts come from a ``TorchDispatchMode`` that records every aten call. Tiny
shapes, torch only.

Those three tests run in chunks of 16 keys (``_chunks_of_16``); the others, from mutation testing
(docs/mutation.md), keep the default ``SPLIT_KV``: both kernels compute in the compute dtype (the
lse returned in it), the cache's constructor names each bad argument, its smallest size, dtypes
and tables, sequences without keys, each row shifted by its own largest score in and outside
autograd, rows without a key in a chunk, ``attend``'s default sequences, and which kernel a
decoding step takes either side of ``SPLIT_KV["max_q_len"]`` (zero query rows included).
``tests/test_numpy_decoding_kernel.py`` is numpy_attn's twin."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from conformance.cases import reference

torch = pytest.importorskip("torch", reason="pip install torch==2.13.0")

from paged_helpers import far_apart_rows, paged_inputs  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import attention_rules  # noqa: E402
import torch_attn  # noqa: E402
from torch_attn import kv_cache, paged  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


class _Ops(TorchDispatchMode):
    """Counts the aten operations run under it, by name (``aten.bmm``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _arrays(rng: np.random.Generator, n: int, kv_len: int) -> tuple[np.ndarray, ...]:
    return (rng.standard_normal((1, HEADS, n, HEAD_DIM)),
            rng.standard_normal((1, KV_HEADS, kv_len, HEAD_DIM)),
            rng.standard_normal((1, KV_HEADS, kv_len, HEAD_DIM)))


@pytest.fixture
def _chunks_of_16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 16 keys (4 pages of 4) for the paged kernel; at most 4 query rows split."""
    monkeypatch.setitem(attention_rules.SPLIT_KV, "chunk", 16)
    monkeypatch.setitem(attention_rules.SPLIT_KV, "max_q_len", 4)


@pytest.mark.usefixtures("_chunks_of_16")
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_short_cache_step_of_few_rows_runs_torch_attns_own_kernel(monkeypatch, grad):
    """Below ``SPLIT_KV["min_kv_len"]`` keys a step of at most ``max_q_len`` rows is the
    split-KV kernel in one piece (torch's SDPA and torch_attn's ``scaled_dot_product_attention``
    cost more for one query row): with sinks, 2 query rows (the causal rule reaches the last
    key) over a float64 cache of 7 positions, it equals the float64 reference; in grad mode the
    gradients of this step's query, key and value equal the reference's VJP. More rows than
    ``max_q_len`` keep ``scaled_dot_product_attention``."""
    calls = []
    split = kv_cache.split_kv_attention
    monkeypatch.setattr(kv_cache, "split_kv_attention",
                        lambda *a, **k: calls.append(a[0].shape[-2]) or split(*a, **k))
    rng = np.random.default_rng(3)
    query, key, value = _arrays(rng, 7, 7)
    sinks = np.array([0.5, -1.0, 2.0, 0.0])
    cache = torch_attn.KVCache.empty((1,), KV_HEADS, 7, HEAD_DIM, dtype="float64")
    with torch.no_grad():
        _, cache = kv_cache.decode_step(*(torch.from_numpy(a[:, :, :5]) for a in
                                          (query, key, value)), cache, None)
    assert calls == [], "5 query rows: more than max_q_len (monkeypatched to 4), one SDPA"
    leaves = [torch.from_numpy(a[:, :, 5:]).requires_grad_(grad) for a in (query, key, value)]
    out, cache = kv_cache.decode_step(*leaves, cache, None, sinks=torch.from_numpy(sinks))
    assert calls == [2], "2 query rows over 7 keys: torch_attn's kernel, one chunk"
    expected = reference.attention(query[:, :, 5:], key, value, is_causal=True,
                                   causal_alignment="bottom_right", sinks=sinks)
    np.testing.assert_allclose(out.detach().numpy(), expected.output, rtol=1e-12, atol=1e-12)
    if grad:
        cotangent = rng.standard_normal(out.shape)
        got = torch.autograd.grad(out, leaves, torch.from_numpy(cotangent))
        vjp = reference.attention_vjp(query[:, :, 5:], key, value, cotangent, is_causal=True,
                                      causal_alignment="bottom_right", sinks=sinks)
        np.testing.assert_allclose(got[0].numpy(), vjp.query, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got[1].numpy(), vjp.key[:, :, 5:], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got[2].numpy(), vjp.value[:, :, 5:], rtol=1e-10,
                                   atol=1e-12)


@pytest.mark.usefixtures("_chunks_of_16")
def test_a_split_step_runs_as_many_operations_for_16_chunks_as_for_2():
    """``split_kv_attention`` over 16 chunks of 8 keys and over 2 (one query row, no grad):
    the same aten operations, as many of each (one ``bmm`` for the scores, one per kv head for
    the values, one softmax, a vectorised merge; each operation costs a dispatch and a hand-off
    to torch's threads), and both equal the float64 reference (output and lse)."""
    counts = []
    for chunks in (2, 16):
        query, key, value = _arrays(np.random.default_rng(chunks), 1, 8 * chunks)
        with _Ops() as ops:
            output, lse = paged.split_kv_attention(
                *(torch.from_numpy(a.astype(np.float32)) for a in (query, key, value)), 8)
        counts.append(ops.calls)
        expected = reference.attention(query, key, value)
        np.testing.assert_allclose(output.numpy(), expected.output, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse.numpy(), expected.lse, rtol=1e-5, atol=1e-5)
    assert counts[0] == counts[1], counts
    assert counts[0]["aten.bmm"] == 1 + KV_HEADS, counts[0]


@pytest.mark.usefixtures("_chunks_of_16")
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_pages_in_order_of_one_kv_head_are_read_in_place_others_copied_once_per_chunk(
        kv_heads):
    """``paged_attention`` over one sequence of 3 chunks (pages of 4 positions, chunks of 16):
    with one kv head, pages that lie in order in the pool are read where they lie (no
    ``index_select``); with two (each head's rows every other row of the pool: slower read in
    place than copied) or scattered pages, they are copied once per chunk for the keys and once
    for the values; every case equals the float64 reference."""
    bs, length = 4, 40
    rng = np.random.default_rng(9)
    query = rng.standard_normal((1, HEADS, 1, HEAD_DIM))
    key, value = (rng.standard_normal((1, kv_heads, length, HEAD_DIM)) for _ in range(2))
    pages = length // bs
    for order in (np.arange(pages), np.array([5, 2, 9, 0, 7, 3, 8, 1, 6, 4])):  # no run
        pools = []
        for x in (key, value):
            pool = np.full((pages, bs, kv_heads, HEAD_DIM), np.nan, np.float32)
            pool[order] = x[0].reshape(kv_heads, pages, bs, HEAD_DIM).transpose(1, 2, 0, 3)
            pools.append(torch.from_numpy(pool))
        table = torch.from_numpy(order[None].astype(np.int32))
        with _Ops() as ops:
            output = torch_attn.paged_attention(
                torch.from_numpy(query.astype(np.float32)), *pools, table,
                torch.tensor([length], dtype=torch.int32))
        expected = reference.attention(query, key, value, is_causal=True,
                                       causal_alignment="bottom_right")
        np.testing.assert_allclose(output.numpy(), expected.output, rtol=1e-5, atol=1e-5)
        in_place = kv_heads == 1 and (order == np.arange(pages)).all()
        assert ops.calls["aten.index_select"] == (0 if in_place else 2 * 3), ops.calls


def _t(x: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x)).to(dtype)


# ------------------------------------------------------------------------------------------
# The kernels' dtypes, the cache's checks and tables, rows without a key, each row's own
# shift, attend's default sequences (no fixture: the default SPLIT_KV)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "lse_dtype", "tol"), [
    (torch.float16, torch.float32, 2e-3), (torch.bfloat16, torch.float32, 1.6e-2),
    (torch.float64, torch.float64, 1e-12),
])
def test_split_kv_computes_in_the_compute_dtype(dtype, lse_dtype, tol):
    """A half query over a half cache: the scores, softmax and lse in float32 (the lse
    returned in it), the output in the query's dtype; float64 stays float64 (exact to 1e-12)."""
    rng = np.random.default_rng(7)
    query = rng.standard_normal((2, 1, 2))
    key, value = rng.standard_normal((1, 7, 2)), rng.standard_normal((1, 7, 3))
    output, lse = paged.split_kv_attention(_t(query, dtype), _t(key, dtype), _t(value, dtype), 3)
    assert (output.dtype, lse.dtype) == (dtype, lse_dtype)
    rounded = [_t(x, dtype).double().numpy() for x in (query, key, value)]
    expected = reference.attention(*rounded, is_causal=True, causal_alignment="bottom_right")
    np.testing.assert_allclose(output.double().numpy(), expected.output, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse.numpy(), expected.lse, rtol=tol, atol=tol)


def test_paged_cache_constructor_names_each_bad_argument():
    bad = [({"num_blocks": 0}, ValueError, "num_blocks must be an int >= 1; got num_blocks=0"),
           ({"block_size": 0}, ValueError, "block_size must be an int >= 1; got block_size=0"),
           ({"kv_heads": 0}, ValueError, "kv_heads must be an int >= 1; got kv_heads=0"),
           ({"head_dim": -1}, ValueError, "head_dim must be an int >= 0; got head_dim=-1"),
           ({"v_dim": -1}, ValueError, "v_dim must be an int >= 0; got v_dim=-1"),
           ({"dtype": torch.int32}, TypeError,
            "dtype must be float16, bfloat16, float32 or float64; got dtype.dtype=int32")]
    for kwargs, error, message in bad:
        given = {"num_blocks": 1, "block_size": 1, "kv_heads": 1, "head_dim": 2, **kwargs}
        with pytest.raises(error) as raised:
            torch_attn.PagedKVCache(**given)
        assert str(raised.value) == f"PagedKVCache: {message}"


def test_the_smallest_paged_cache_its_dtypes_and_tables():
    """One page of one position and one kv head is a cache; ``v_dim`` defaults to
    ``head_dim``; ``"bfloat16"`` and a ``torch.dtype`` name the dtype; ``tables`` gives int32
    on the pages' device, ``-1`` past a sequence's last page."""
    cache = torch_attn.PagedKVCache(1, 1, 1, 2, 3)
    assert cache.key_pages.shape == (1, 1, 1, 2) and cache.value_pages.shape == (1, 1, 1, 3)
    assert cache.key_pages.dtype == torch.float32 and not cache.key_pages.any()
    assert torch_attn.PagedKVCache(2, 3, 1, 4).value_pages.shape == (2, 3, 1, 4)
    for name in ("bfloat16", torch.bfloat16):
        half = torch_attn.PagedKVCache(1, 1, 1, 2, dtype=name)
        assert half.key_pages.dtype == half.value_pages.dtype == torch.bfloat16
    cache.append(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 3))
    table, lens = cache.tables()
    assert (table.dtype, lens.dtype) == (torch.int32, torch.int32)
    assert table.tolist() == [[0]] and lens.tolist() == [1]
    query = torch.ones(1, 2, 1, 2)  # a pool of one page: its one key and value
    expected = reference.attention(query[0].numpy(), np.ones((1, 1, 2)), np.ones((1, 1, 3)))
    np.testing.assert_allclose(cache.attend(query)[0].numpy(), expected.output, rtol=1e-6)
    wide = torch_attn.PagedKVCache(4, 2, 1, 2)
    wide.append(torch.ones(2, 1, 3, 2), torch.ones(2, 1, 3, 2))
    wide.append(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), seqs=[1])
    table, lens = wide.tables([1, 0])
    assert table.tolist() == [[2, 3], [0, 1]] and lens.tolist() == [4, 3]
    assert wide.free(0).num_free_blocks == 2 and wide.seq_len(0) == 0 and wide.seq_len(1) == 4


def _paged_inputs(dtype: torch.dtype = torch.float32) -> dict:
    """``paged_helpers.paged_inputs`` (one sequence of 3 positions on page 1
    of a pool of 2 pages of 4 positions; 2 query heads over 1 kv head) as torch tensors in
    ``dtype``, with its float64 keys and values. (``test_numpy_decoding_kernel``'s tests of
    the arguments given as lists and of the cache's errors cover torch_attn too.)"""
    args = paged_inputs(np.float64)
    out = {name: torch.from_numpy(args[name]) for name in ("block_table", "seq_lens")}
    out.update({name: _t(args[name], dtype) for name in ("query", "key_pages", "value_pages")})
    return {**out, "keys": args["keys"], "values": args["values"]}


@pytest.mark.parametrize(("dtype", "lse_dtype", "tol"), [
    (torch.float16, torch.float32, 2e-3), (torch.float64, torch.float64, 1e-12),
])
def test_paged_attention_computes_in_the_compute_dtype(dtype, lse_dtype, tol):
    """The paged kernel: output in the query's dtype, lse in the compute dtype, against the
    reference on the same (rounded) inputs; with sinks too."""
    args = _paged_inputs(dtype)
    keys, values = args.pop("keys"), args.pop("values")
    keys, values = (_t(x, dtype).double().numpy() for x in (keys, values))
    sinks = torch.tensor([0.5, -1.0], dtype=dtype)
    for given in (None, sinks):
        output, lse = torch_attn.paged_attention(**args, sinks=given, return_lse=True)
        assert (output.dtype, lse.dtype) == (dtype, lse_dtype)
        expected = reference.attention(
            args["query"][0].double().numpy(), keys, values, is_causal=True,
            causal_alignment="bottom_right", sinks=None if given is None else given.double())
        np.testing.assert_allclose(output[0].double().numpy(), expected.output, rtol=tol,
                                   atol=tol)
        np.testing.assert_allclose(lse[0].numpy(), expected.lse, rtol=tol, atol=tol)


def test_paged_attention_over_sequences_without_keys():
    """``seq_lens`` 0: no chunk at all; rows give 0 and lse -inf, or the sink's logit."""
    args = _paged_inputs()
    del args["keys"], args["values"]
    args["seq_lens"] = torch.tensor([0], dtype=torch.int32)
    for given in (None, np.array([0.5, -1.0])):
        sinks = None if given is None else _t(given)
        output, lse = torch_attn.paged_attention(**args, sinks=sinks, return_lse=True)
        expected = reference.attention(args["query"][0].numpy(), np.zeros((1, 0, 2)),
                                       np.zeros((1, 0, 3)), sinks=given)
        np.testing.assert_array_equal(output[0].numpy(), expected.output)
        np.testing.assert_array_equal(lse[0].numpy(), expected.lse)


def test_each_row_is_shifted_by_its_own_largest_score():
    """Two query heads of one kv head whose largest scores are hundreds apart: each row
    subtracts its own largest score, on both kernels, outside autograd and inside it (one
    shift for the chunk would underflow the small row's exponentials to 0 in float32)."""
    query, key, value, expected = far_apart_rows()
    f32 = [_t(x) for x in (query, key, value)]
    cache = torch_attn.PagedKVCache(2, 4, 1, 4, 2)
    cache.append(f32[1][None], f32[2][None])
    for grad in (False, True):  # torch.softmax, and (autograd recording) the shifted exp
        q = f32[0].clone().requires_grad_(grad)
        output, lse = paged.split_kv_attention(q, *f32[1:], 4)
        np.testing.assert_allclose(output.detach().numpy(), expected.output, rtol=1e-4,
                                   atol=1e-5)
        np.testing.assert_allclose(lse.detach().numpy(), expected.lse, rtol=1e-5, atol=1e-4)
        output, lse = cache.attend(q[None], return_lse=True)
        np.testing.assert_allclose(output[0].detach().numpy(), expected.output, rtol=1e-4,
                                   atol=1e-5)
        np.testing.assert_allclose(lse[0].detach().numpy(), expected.lse, rtol=1e-5, atol=1e-4)


def test_a_chunk_with_rows_without_a_key():
    """Three query rows over 9 keys in chunks of 4: rows 0 and 1 may not see key 8, so the
    last chunk has rows without a key (weights 0 and lse -inf there, not NaN), and the merged
    result is the reference's; outside autograd (the in-place branch) and inside it."""
    rng = np.random.default_rng(12)
    query, key, value = (rng.standard_normal((1, n, 2)) for n in (3, 9, 9))
    expected = reference.attention(query, key, value, is_causal=True,
                                   causal_alignment="bottom_right")
    for grad in (False, True):
        inputs = [_t(x).requires_grad_(grad) for x in (query, key, value)]
        output, lse = paged.split_kv_attention(*inputs, 4)
        np.testing.assert_allclose(output.detach().numpy(), expected.output, rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(lse.detach().numpy(), expected.lse, rtol=1e-5, atol=1e-6)


def test_attend_defaults_to_the_first_batch_sequences_and_differentiates_rows():
    """``attend(query)`` with batch 1 over a cache of two sequences reads sequence 0 only;
    three query rows (the causal rule masks part of the chunk) with autograd recording:
    the reference's output and the query's gradient."""
    rng = np.random.default_rng(4)
    keys, values = rng.standard_normal((2, 1, 7, 2)), rng.standard_normal((2, 1, 7, 3))
    cache = torch_attn.PagedKVCache(6, 4, 1, 2, 3)
    cache.append(_t(keys), _t(values))
    query, grad = rng.standard_normal((1, 2, 3, 2)), rng.standard_normal((1, 2, 3, 3))
    q = _t(query).requires_grad_()
    output = cache.attend(q)
    output.backward(_t(grad))
    options = {"is_causal": True, "causal_alignment": "bottom_right"}
    want = reference.attention(query[0], keys[0], values[0], **options).output
    np.testing.assert_allclose(output[0].detach().numpy(), want, rtol=1e-5, atol=1e-6)
    grads = reference.attention_vjp(query[0], keys[0], values[0], grad[0], **options)
    np.testing.assert_allclose(q.grad[0].numpy(), grads.query, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------
# torch_attn/kv_cache.py: which kernel a decoding step takes
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [16, 17])
def test_a_decoding_step_over_a_cache_with_sinks_either_side_of_max_q_len(monkeypatch, rows):
    """Five cached positions, then a step of ``rows`` query rows with sinks: up to
    ``SPLIT_KV["max_q_len"]`` (16) rows torch_attn's split kernel runs (the module docstring),
    beyond it ``scaled_dot_product_attention``; both causal bottom-right with the sinks, as
    the float64 reference."""
    rng = np.random.default_rng(17)
    q = rng.standard_normal((1, 4, rows, 8))
    k, v = rng.standard_normal((1, 2, 5 + rows, 8)), rng.standard_normal((1, 2, 5 + rows, 3))
    sinks = np.array([0.5, -1.0, 2.0, 0.0])
    calls = []
    split = kv_cache.split_kv_attention
    monkeypatch.setattr(kv_cache, "split_kv_attention",
                        lambda *a, **o: calls.append(a[0].shape[-2]) or split(*a, **o))
    _, cache = kv_cache.decode_step(_t(q[..., :5, :]), _t(k[..., :5, :]), _t(v[..., :5, :]),
                                    None, 5 + rows)
    calls.clear()
    with torch.no_grad():
        out, _ = kv_cache.decode_step(_t(q), _t(k[..., 5:, :]), _t(v[..., 5:, :]), cache, None,
                                      sinks=_t(sinks))
    assert calls == ([rows] if rows <= 16 else [])
    expected = reference.attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                   sinks=sinks)
    np.testing.assert_allclose(out.numpy(), expected.output, rtol=1e-5, atol=1e-5)


def test_a_decoding_step_of_no_query_rows_gives_an_empty_output():
    """Zero query rows (the split kernel cannot take them): an empty output, no error."""
    out, cache = kv_cache.decode_step(torch.zeros(1, 4, 0, 8), torch.ones(1, 2, 3, 8),
                                      torch.ones(1, 2, 3, 3), None, 3)
    assert out.shape == (1, 4, 0, 3) and cache.length == 3
