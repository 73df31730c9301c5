"""torch_attn's decoding kernels (``torch_attn/paged.py``, issues 23 and 26): a decoding step
of a few query rows runs torch_attn's own matrix products (not ``scaled_dot_product_attention``)
whatever the cache's length, as a fixed number of torch operations however many chunks the
cache is cut into, and pages that lie in order in the pool are read in place. Every result is
checked against the float64 ``conformance.cases.reference`` (outputs and, in grad mode, the VJP);
the operation counts come from a ``TorchDispatchMode`` that records every aten call. Tiny
shapes, torch only."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from conformance.cases import reference

torch = pytest.importorskip("torch", reason="pip install torch==2.13.0")

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


@pytest.fixture(autouse=True)
def _chunks_of_16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 16 keys (4 pages of 4) for the paged kernel; at most 4 query rows split."""
    monkeypatch.setitem(attention_rules.SPLIT_KV, "chunk", 16)
    monkeypatch.setitem(attention_rules.SPLIT_KV, "max_q_len", 4)


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
