"""Tests that kill the mutants of the paged caches and context parallelism (docs/mutation.md).

mutmut 3.8.1 on ``numpy_attn/paged.py``, ``numpy_attn/context_parallel.py``,
``numpy_attn/context_blocks.py`` and ``jax_attn/kv_cache.py`` left these behaviours untested:
each test below fails under at least one surviving mutant. The expected values come from the
float64 ``conformance.cases.reference`` (the contiguous cache or the whole sequence on one device),
never from the module under test against itself. Tiny shapes, NumPy only but where noted.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np
import pytest
from paged_helpers import (
    check_paged_cache_errors,
    constructor_errors,
    far_apart_rows,
    paged_inputs,
)
from test_kv_cache import assert_bfloat16_before_ml_dtypes

import numpy_attn
from attention_rules import context_parallel as cp
from conformance.cases import reference
from numpy_attn import context_parallel as ncp
from numpy_attn import paged

# ------------------------------------------------------------------------------------------
# numpy_attn/paged.py: the paged cache's constructor, appends and tables
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error", "message"), constructor_errors(
    ("gpu", "numpy_attn creates arrays on the CPU only; got device='gpu'")))
def test_paged_cache_constructor_names_each_bad_argument(kwargs, error, message):
    given = {"num_blocks": 1, "block_size": 1, "kv_heads": 1, "head_dim": 2, **kwargs}
    with pytest.raises(error) as raised:
        numpy_attn.PagedKVCache(**given)
    assert str(raised.value) == f"PagedKVCache: {message}"


def test_the_smallest_paged_cache_and_its_dtypes():
    """One page of one position and one kv head is a cache; ``v_dim`` defaults to
    ``head_dim``; ``"bfloat16"`` names ml_dtypes' type; ``tables`` gives int32."""
    cache = numpy_attn.PagedKVCache(1, 1, 1, 2, 3)
    assert cache.key_pages.shape == (1, 1, 1, 2) and cache.value_pages.shape == (1, 1, 1, 3)
    assert cache.key_pages.dtype == np.float32 and not cache.key_pages.any()
    assert numpy_attn.PagedKVCache(2, 3, 1, 4).value_pages.shape == (2, 3, 1, 4)
    half = numpy_attn.PagedKVCache(1, 1, 1, 2, dtype="bfloat16")
    assert half.key_pages.dtype.name == half.value_pages.dtype.name == "bfloat16"
    cache.append(np.ones((1, 1, 1, 2)), np.ones((1, 1, 1, 3)))
    table, lens = cache.tables()
    assert (table.dtype, lens.dtype) == (np.int32, np.int32)
    assert table.tolist() == [[0]] and lens.tolist() == [1]
    query = np.ones((1, 2, 1, 2), np.float32)  # a pool of one page: its one key and value
    expected = reference.attention(query[0], np.ones((1, 1, 2)), np.ones((1, 1, 3))).output
    np.testing.assert_allclose(cache.attend(query)[0], expected, rtol=1e-6)


def test_paged_cache_names_bfloat16_before_ml_dtypes_is_imported():
    """``dtype="bfloat16"`` in a process where nothing imported ml_dtypes yet."""
    assert_bfloat16_before_ml_dtypes(
        "numpy_attn.PagedKVCache(1, 1, 1, 2, dtype='bfloat16').key_pages.dtype")


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_paged_cache_errors_name_the_method(backend):
    check_paged_cache_errors(backend)


def _sequences(cache: numpy_attn.PagedKVCache, lengths: list[int], seed: int) -> list:
    """Append ``lengths[s]`` random positions to sequence ``s``; each one's float64 keys and
    values ``(kv_heads, n, dim)``."""
    rng = np.random.default_rng(seed)
    kv_heads, head_dim, v_dim = (cache.key_pages.shape[2], cache.key_pages.shape[3],
                                 cache.value_pages.shape[3])
    truth = []
    for seq, n in enumerate(lengths):
        keys = rng.standard_normal((1, kv_heads, n, head_dim)).astype(cache.key_pages.dtype)
        values = rng.standard_normal((1, kv_heads, n, v_dim)).astype(cache.key_pages.dtype)
        cache.append(keys, values, [seq])
        truth.append((keys[0].astype(np.float64), values[0].astype(np.float64)))
    return truth


def test_attend_defaults_to_the_first_batch_sequences_and_takes_a_scale():
    """``attend(query)`` with batch 2 over a cache of three sequences reads sequences 0 and 1
    (not every sequence the cache holds), with the scale given."""
    cache = numpy_attn.PagedKVCache(8, 2, 1, 3, 2)
    truth = _sequences(cache, [3, 5, 4], seed=1)
    query = np.random.default_rng(2).standard_normal((2, 2, 1, 3)).astype(np.float32)
    output, lse = cache.attend(query, scale=0.3, return_lse=True)
    for seq in (0, 1):
        expected = reference.attention(query[seq], *truth[seq], is_causal=True,
                                       causal_alignment="bottom_right", scale=0.3)
        np.testing.assert_allclose(output[seq], expected.output, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[seq], expected.lse, rtol=1e-5, atol=1e-6)


def test_pages_are_copied_one_page_a_part_when_part_bytes_is_one(monkeypatch):
    """``PART_BYTES`` smaller than a page: one page per part, so one score product per page
    (three pages of one chunk: three products), and the reference's output."""
    cache = numpy_attn.PagedKVCache(4, 2, 1, 2)
    (keys, values), = _sequences(cache, [6], seed=5)
    query = np.random.default_rng(6).standard_normal((1, 1, 1, 2)).astype(np.float32)
    monkeypatch.setattr(paged, "PART_BYTES", 1)
    calls = []
    matmul = np.matmul
    monkeypatch.setattr(np, "matmul", lambda *a, **k: calls.append(1) or matmul(*a, **k))
    output = cache.attend(query)
    monkeypatch.undo()
    assert len(calls) == 3
    expected = reference.attention(query[0], keys, values, is_causal=True,
                                   causal_alignment="bottom_right").output
    np.testing.assert_allclose(output[0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("part_bytes", [1, 40, 1 << 20])
def test_a_contiguous_chunk_read_in_parts_equals_the_reference(monkeypatch, part_bytes):
    """``split_kv_attention`` reads each chunk's keys and values in parts of ``PART_BYTES``
    (``_parts``): one position a part, five positions (40 bytes: 1 kv head × 2 dims × 4
    bytes), a whole chunk. Chunks of 7 over 17 positions with 3 query rows (the last chunk
    partly masked): every part is read once, in order, and the result is the reference's."""
    rng = np.random.default_rng(11)
    query = rng.standard_normal((2, 2, 3, 2)).astype(np.float32)
    key = rng.standard_normal((2, 1, 17, 2)).astype(np.float32)
    value = rng.standard_normal((2, 1, 17, 3)).astype(np.float32)
    monkeypatch.setattr(paged, "PART_BYTES", part_bytes)
    output, lse = paged.split_kv_attention(query, key, value, 7)
    for b in range(2):
        expected = reference.attention(query[b].astype(np.float64), key[b], value[b],
                                       is_causal=True, causal_alignment="bottom_right")
        np.testing.assert_allclose(output[b], expected.output, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[b], expected.lse, rtol=1e-5, atol=1e-6)
    widths = [part.shape[1] for part in paged._parts(key[0], 3, 17)]
    assert sum(widths) == 14 and all(w == widths[0] for w in widths[:-1])
    assert widths[0] == {1: 1, 40: 5, 1 << 20: 14}[part_bytes]


def test_the_threads_page_buffer_is_reused_not_reallocated():
    """``_buffer`` in a new thread (its own buffer, none yet): a request no larger than the
    buffer (the same size included, in another dtype) returns a view of the same memory; a
    larger one grows it."""
    seen = {}

    def run() -> None:
        first = paged._buffer((64,), np.dtype(np.float32))
        same = paged._buffer((64,), np.dtype(np.float32))
        other = paged._buffer((2, 16), np.dtype(np.float64))
        grown = paged._buffer((1 << 12,), np.dtype(np.float64))
        seen.update(first=first, same=same, other=other, grown=grown)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    first, other, grown = seen["first"], seen["other"], seen["grown"]
    assert first.nbytes == 256 and np.shares_memory(first, seen["same"])
    assert np.shares_memory(first, other) and (other.shape, other.dtype) == ((2, 16), np.float64)
    assert grown.nbytes == 1 << 15 and not np.shares_memory(grown, first)


@pytest.mark.parametrize(("dtype", "lse_dtype", "tol"), [
    (np.float16, np.float32, 2e-3), (np.float32, np.float32, 1e-5), (np.float64, np.float64, 1e-12),
])
def test_both_kernels_compute_in_the_compute_dtype(dtype, lse_dtype, tol):
    """Split-KV and paged: the output in the query's dtype, the lse in the compute dtype
    (float32 for float16 and float32, float64 for float64: exact to 1e-12 there)."""
    rng = np.random.default_rng(7)
    query = rng.standard_normal((2, 1, 2)).astype(dtype)
    key = rng.standard_normal((1, 7, 2)).astype(dtype)
    value = rng.standard_normal((1, 7, 3)).astype(dtype)
    output, lse = paged.split_kv_attention(query, key, value, 3)
    assert (output.dtype, lse.dtype) == (dtype, lse_dtype)
    expected = reference.attention(query, key, value, is_causal=True,
                                   causal_alignment="bottom_right")
    np.testing.assert_allclose(output, expected.output, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, expected.lse, rtol=tol, atol=tol)
    args = paged_inputs(dtype)
    keys, values = args.pop("keys"), args.pop("values")
    output, lse = numpy_attn.paged_attention(**args, return_lse=True)
    assert (output.dtype, lse.dtype) == (dtype, lse_dtype)
    expected = reference.attention(args["query"][0], keys, values, is_causal=True,
                                   causal_alignment="bottom_right")
    np.testing.assert_allclose(output[0], expected.output, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse[0], expected.lse, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("name", ["query", "key_pages", "value_pages", "block_table",
                                  "seq_lens", "sinks"])
def test_paged_attention_names_an_argument_given_as_a_list(backend, name):
    """The same one-line TypeError from numpy_attn and torch_attn."""
    args = paged_inputs()
    del args["keys"], args["values"]
    attend = numpy_attn.paged_attention
    if backend == "torch":
        torch = pytest.importorskip("torch", reason="pip install torch")
        args = {n: torch.from_numpy(a) for n, a in args.items()}
        attend = pytest.importorskip("torch_attn").paged_attention
    args[name] = [0.0, 0.0] if name == "sinks" else args[name].tolist()
    with pytest.raises(TypeError, match=rf"^paged_attention: {name} must be an array "
                                        rf".*got type\({name}\)=list$"):
        attend(**args)


def test_paged_attention_checks_its_dtypes_sinks_and_table_by_name():
    args = paged_inputs()
    del args["keys"], args["values"]
    with pytest.raises(TypeError, match=r"^paged_attention: inputs must share one dtype"):
        numpy_attn.paged_attention(**{**args, "query": args["query"].astype(np.float16)})
    with pytest.raises(ValueError, match=r"^paged_attention: sinks"):
        numpy_attn.paged_attention(**args, sinks=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"^paged_attention: block_table\[0, 0\]=2 is not a page"):
        numpy_attn.paged_attention(**{**args, "block_table": np.array([[2, 0]], np.int32)})


def test_paged_attention_over_sequences_without_keys():
    """Every ``seq_lens`` 0: no chunk at all; rows give 0 and lse -inf, or the sink's logit
    (the reference over no key)."""
    args = paged_inputs()
    del args["keys"], args["values"]
    args["seq_lens"] = np.array([0], np.int32)
    sinks = np.array([0.5, -1.0], np.float32)
    for given in (None, sinks):
        output, lse = numpy_attn.paged_attention(**args, sinks=given, return_lse=True)
        expected = reference.attention(args["query"][0], np.zeros((1, 0, 2)),
                                       np.zeros((1, 0, 3)), sinks=given)
        np.testing.assert_array_equal(output[0], expected.output)
        np.testing.assert_array_equal(lse[0], expected.lse)


def test_each_row_is_shifted_by_its_own_largest_score():
    """Each row subtracts its own largest score (one for the whole chunk would underflow the
    small row's exponentials, below ``exp(-104)``, to 0 in float32), on both kernels."""
    query, key, value, expected = far_apart_rows()
    f32 = [x.astype(np.float32) for x in (query, key, value)]
    output, lse = paged.split_kv_attention(*f32, 4)
    np.testing.assert_allclose(output, expected.output, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse, expected.lse, rtol=1e-5, atol=1e-4)
    cache = numpy_attn.PagedKVCache(2, 4, 1, 4, 2)
    cache.append(f32[1][None], f32[2][None])
    output, lse = cache.attend(f32[0][None], return_lse=True)
    np.testing.assert_allclose(output[0], expected.output, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse[0], expected.lse, rtol=1e-5, atol=1e-4)


def test_a_chunk_with_rows_without_a_key_warns_nothing():
    """Three query rows over 9 keys in chunks of 4: rows 0 and 1 may not see key 8, so the
    last chunk has rows without a key (log(0) = -inf there, no RuntimeWarning), and the
    merged result is the reference's."""
    rng = np.random.default_rng(12)
    query = rng.standard_normal((1, 3, 2)).astype(np.float32)
    key = rng.standard_normal((1, 9, 2)).astype(np.float32)
    value = rng.standard_normal((1, 9, 2)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        output, lse = paged.split_kv_attention(query, key, value, 4)
    expected = reference.attention(query, key, value, is_causal=True,
                                   causal_alignment="bottom_right")
    np.testing.assert_allclose(output, expected.output, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, expected.lse, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# numpy_attn/context_parallel.py and context_blocks.py: the messages each strategy sends
# ------------------------------------------------------------------------------------------

#: 3 ranks, 6 positions, 3 heads of 2 dims, float32: a rank's shard is 1·3·2·2·4 = 48 bytes
CP_WORLD, CP_SHARD = 3, 48


def _cp_inputs(dtype=np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(13)
    return [rng.standard_normal((1, 3, 6, 2)).astype(dtype) for _ in range(4)]


def _sends(step: int, what: str, to: Any, nbytes: int) -> list[dict]:
    """Every rank's send of ``what`` at ``step`` (``to``: a rank's receiver, or "all")."""
    return [{"step": step, "rank": r, "event": "send", "what": what,
             "to": to(r) if callable(to) else to, "bytes": nbytes} for r in range(CP_WORLD)]


def _ring_events(sched: cp.Schedule, backward: bool) -> list[dict]:
    """The ring as the module docstring tells it: at step ``s`` rank ``r`` computes block
    ``r - s``, then passes its blocks (and gradients) to ``r + 1``; gradients go home."""
    n, events = CP_WORLD, []
    for s in range(sched.steps):
        events += [{"step": s, "rank": r, "event": "compute", "block": (r - s) % n,
                    "pairs": cp.block_needed(sched, r, (r - s) % n)} for r in range(n)]
        if s + 1 < sched.steps:
            for what in ("key", "value") + (("grad_key", "grad_value") if backward else ()):
                events += _sends(s, what, lambda r: (r + 1) % n, CP_SHARD)
    home = (1 - sched.steps) % n  # rank r holds the gradients of rank r - (steps - 1)
    if backward and home:
        for what in ("grad_key", "grad_value"):
            events += _sends(sched.steps, what, lambda r: (r + home) % n, CP_SHARD)
    return events


@pytest.mark.parametrize("window", [None, (2, 0)])
def test_the_ring_sends_each_block_to_the_next_rank_and_the_gradients_home(window):
    q, k, v, g = _cp_inputs()
    options = {"world_size": CP_WORLD, "strategy": "ring", "window": window}
    sched = cp.schedule("ring", CP_WORLD, 6, 6, False, "top_left", window, False)
    assert sched.steps == (3 if window is None else 2)  # home: 1 rank on, or 2
    forward, both = [], []
    ncp.context_parallel_attention(q, k, v, trace=forward, **options)
    ncp.context_parallel_attention_vjp(q, k, v, g, trace=both, **options)
    assert forward == _ring_events(sched, False)
    assert both == _ring_events(sched, False) + _ring_events(sched, True)
    assert all(type(e["bytes"]) is int for e in both if e["event"] == "send")


def test_all_gather_and_ulysses_send_what_their_collectives_send():
    """all-gather: each rank sends its shard to the N - 1 others (keys, values; again in the
    backward pass), then the reduce-scatter sends (N - 1)/N of its whole-sequence gradient;
    Ulysses' all-to-alls send (N - 1)/N of each shard. Every ``step`` 0, bytes ints."""
    q, k, v, g = _cp_inputs()
    n, gather = CP_WORLD, (CP_WORLD - 1) * CP_SHARD
    scatter = (n - 1) * (n * CP_SHARD) // n  # of the whole sequence's gradient
    pieces = (n - 1) * CP_SHARD // n
    gathers = _sends(0, "key", "all", gather) + _sends(0, "value", "all", gather)
    expected = {
        "all_gather": (gathers, gathers + gathers + _sends(0, "grad_key", "all", scatter)
                       + _sends(0, "grad_value", "all", scatter)),
        "ulysses": ([e for w in ("query", "key", "value", "output")
                     for e in _sends(0, w, "all", pieces)],
                    [e for w in ("query", "key", "value", "output", "grad_output", "grad_query",
                                 "grad_key", "grad_value") for e in _sends(0, w, "all", pieces)]),
    }
    for strategy, (want_forward, want_both) in expected.items():
        forward, both = [], []
        ncp.context_parallel_attention(q, k, v, world_size=n, strategy=strategy, trace=forward)
        ncp.context_parallel_attention_vjp(q, k, v, g, world_size=n, strategy=strategy,
                                           trace=both)
        assert forward == want_forward, strategy
        assert both == want_both, strategy
        assert all(type(e["bytes"]) is int for e in both), strategy


# ------------------------------------------------------------------------------------------
# numpy_attn/context_parallel.py: dtypes, padding and the vjp's errors
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", cp.STRATEGIES)
def test_context_parallel_in_float64_equals_the_reference_to_1e_12(strategy):
    """float64 in, float64 out (computed in float64: 1e-12 of the reference), on the zig-zag
    layout, causal, with ``kv_lengths`` (sequence 1 has no key: its rows and gradients are
    0); the reference reads ``kv_lengths`` as a mask of the keys."""
    rng = np.random.default_rng(14)
    world, lengths = 2, np.array([5, 0])
    q, k, v, g = (rng.standard_normal((2, 2, 8, 2)) for _ in range(4))
    order = cp.positions(8, world, True)  # layout order → natural order: x[..., back, :]
    back = np.argsort(order)
    options = {"world_size": world, "strategy": strategy, "is_causal": True,
               "kv_lengths": lengths, "load_balance": True}
    output = ncp.context_parallel_attention(q, k, v, **options)
    grads = ncp.context_parallel_attention_vjp(q, k, v, g, **options)
    mask = (np.arange(8)[None, :] < lengths[:, None])[:, None, None, :]
    natural = [x[..., back, :] for x in (q, k, v, g)]
    expected = reference.attention(*natural[:3], mask=mask, is_causal=True).output
    expected_grads = reference.attention_vjp(*natural, mask=mask, is_causal=True)
    assert output.dtype == np.float64 and all(x.dtype == np.float64 for x in grads)
    np.testing.assert_allclose(output[..., back, :], expected, rtol=0, atol=1e-12)
    for got, want in zip(grads, (expected_grads.query, expected_grads.key,
                                 expected_grads.value), strict=True):
        np.testing.assert_allclose(got[..., back, :], want, rtol=0, atol=1e-12)
    assert not output[1].any() and not grads[0][1].any()


@pytest.mark.parametrize(("change", "message"), [
    ({"strategy": "tree"}, "strategy must be one of"),
    ({"world_size": 3}, ""),
    ({"kv_lengths": np.array([7, 2])}, r"kv_lengths must lie in \[0, 4\]"),
])
def test_context_parallel_errors_name_the_function_called(change, message):
    """The forward and the vjp name themselves (the vjp's name is not the forward's)."""
    q, k, v, g = (np.zeros((2, 2, 4, 2), np.float32) for _ in range(4))
    options = {"world_size": 2, **change}
    with pytest.raises(ValueError, match=rf"^context_parallel_attention: .*{message}"):
        ncp.context_parallel_attention(q, k, v, **options)
    with pytest.raises(ValueError, match=rf"^context_parallel_attention_vjp: .*{message}"):
        ncp.context_parallel_attention_vjp(q, k, v, g, **options)


def test_context_parallel_defaults_scale_and_dtype():
    """The defaults (the ring, the natural layout, no causal rule) and a given scale: the
    reference's output and gradients; float32 in, float32 out; a ``grad_output`` of the wrong
    shape is named."""
    q, k, v, g = (x.astype(np.float64) for x in _cp_inputs())
    output = ncp.context_parallel_attention(q, k, v, world_size=2, scale=0.7)
    grads = ncp.context_parallel_attention_vjp(q, k, v, g, world_size=2, scale=0.7)
    np.testing.assert_allclose(output, reference.attention(q, k, v, scale=0.7).output,
                               rtol=0, atol=1e-12)
    expected = reference.attention_vjp(q, k, v, g, scale=0.7)
    for got, want in zip(grads, (expected.query, expected.key, expected.value), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    single = [x.astype(np.float32) for x in (q, k, v, g)]
    assert ncp.context_parallel_attention(*single[:3], world_size=2).dtype == np.float32
    grads = ncp.context_parallel_attention_vjp(*single, world_size=2)
    assert [x.dtype for x in grads] == [np.float32] * 3
    with pytest.raises(ValueError, match=r"^context_parallel_attention_vjp: .*grad_output"):
        ncp.context_parallel_attention_vjp(q, k, v, g[..., :1], world_size=2)


def test_context_parallel_checks_every_input_by_name():
    q = np.zeros((2, 2, 4, 2), np.float32)
    calls = [
        ({"query": q.tolist()}, TypeError, r"query must be an array"),
        ({"key": q.tolist()}, TypeError, r"key must be an array"),
        ({"value": q.tolist()}, TypeError, r"value must be an array"),
        ({"key": q.astype(np.float64)}, TypeError, r"inputs must share one dtype"),
        ({"kv_lengths": np.array([1.5, 2.0])}, ValueError, r"kv_lengths must be ints"),
        ({"kv_lengths": np.array([1, 2, 3])}, ValueError, r"kv_lengths must be ints"),
        ({"query": np.zeros((2, 2, 6, 2), np.float32), "world_size": 4}, ValueError,
         r"q_len and kv_len must split into 4 equal chunks .* q_len=6, kv_len=4"),
    ]
    for change, error, message in calls:
        args = {"query": q, "key": q, "value": q, "world_size": 2, **change}
        with pytest.raises(error, match=rf"^context_parallel_attention: {message}"):
            ncp.context_parallel_attention(**args)
    with pytest.raises(TypeError, match=r"^context_parallel_attention_vjp: grad_output must be"):
        ncp.context_parallel_attention_vjp(q, q, q, q.tolist(), world_size=2)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("strategy", cp.STRATEGIES)
def test_context_parallel_cross_attention_aligns_the_causal_rule(strategy, alignment):
    """4 queries over 8 keys, causal from the top left (query i sees keys j <= i) or the
    bottom right (j <= i + 4), at 2 ranks: the reference's output (the schedule's band
    follows the alignment)."""
    rng = np.random.default_rng(15)
    q = rng.standard_normal((1, 2, 4, 2))
    k, v = rng.standard_normal((1, 2, 8, 2)), rng.standard_normal((1, 2, 8, 2))
    options = {"is_causal": True, "causal_alignment": alignment}
    output = ncp.context_parallel_attention(q, k, v, world_size=2, strategy=strategy, **options)
    np.testing.assert_allclose(output, reference.attention(q, k, v, **options).output,
                               rtol=0, atol=1e-12)
