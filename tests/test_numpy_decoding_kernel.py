"""numpy_attn's decoding kernels (``numpy_attn/paged.py``): the paged cache and split-KV decoding.

The paged cache's constructor, dtypes (``"bfloat16"`` named before ml_dtypes is imported) and
int32 tables; every error naming its method and argument, and ``paged_attention``'s checks of
its inputs, with the same messages in torch_attn (those tests run both); ``attend``'s default
sequences and scale; a chunk's keys and values read in parts of ``PART_BYTES`` (one score
product per part), into a per-thread page buffer that is reused; the output in the query's dtype
and the lse in the compute dtype; sequences without keys; each row shifted by its own largest
score; rows without a key in a chunk, without a warning. The expected values come from the
float64 ``conformance.cases.reference`` (over the contiguous keys), never from the module under
test against itself. Tiny shapes; ``tests/test_torch_decoding_kernel.py`` is torch_attn's twin.
The tests came from mutation testing (docs/mutation.md).
"""

from __future__ import annotations

import threading
import warnings

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
from conformance.cases import reference
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


@pytest.mark.slow
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
