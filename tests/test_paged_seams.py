"""Trust at the seams: every traced index or length jax_attn reads poisons its rows with NaN
under ``jax.jit`` where eager raises ValueError (``spec.PAGED_CACHE``), and the paged caches'
argument errors (``spec.PAGED_CACHE``): bool flags, NumPy integer sequence ids, the argument
named, dtype names and complex keys refused alike in every backend."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

BACKENDS = ["numpy_attn", "jax_attn", "torch_attn"]


def _f32(shape: tuple, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------ traced indices under jit
# paged_attention: 2 sequences of 3 and 5 positions on a pool of 4 pages of 4 positions
PAGED = {"query": _f32((2, 2, 1, 4)), "key_pages": _f32((4, 4, 1, 4), 1),
         "value_pages": _f32((4, 4, 1, 3), 2), "block_table": np.array([[2, -1], [0, 1]],
                                                                        np.int32),
         "seq_lens": np.array([3, 5], np.int32)}
N_PAGES, MAX_BLOCKS, BS = 4, 2, 4


def _paged_cases() -> list[tuple[str, dict, int]]:
    """(label, changed inputs, the sequence whose rows must be NaN)."""
    cases = []
    for bad in (-1, N_PAGES, 10 * N_PAGES):
        cases.append((f"block_table[1, 1]={bad}", {"block_table": np.array(
            [[2, -1], [0, bad]], np.int32)}, 1))
    for bad in (-1, MAX_BLOCKS * BS + 1, 100):
        cases.append((f"seq_lens[0]={bad}", {"seq_lens": np.array([bad, 5], np.int32)}, 0))
    return cases


@pytest.mark.parametrize("label, change, seq", _paged_cases(),
                         ids=[c[0] for c in _paged_cases()])
def test_jitted_paged_attention_poisons_bad_traced_indices(label: str, change: dict,
                                                           seq: int) -> None:
    jax = pytest.importorskip("jax")
    import jax_attn

    inputs = {**PAGED, **change}
    with pytest.raises(ValueError, match="^paged_attention: "):
        jax_attn.paged_attention(**inputs)
    out, lse = jax.jit(lambda **kw: jax_attn.paged_attention(**kw, return_lse=True))(**inputs)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.isnan(out[seq]).all() and np.isnan(lse[seq]).all(), label
    assert np.isfinite(out[1 - seq]).all(), label  # the other sequence is untouched
    good = np.asarray(jax_attn.paged_attention(**PAGED))
    np.testing.assert_allclose(out[1 - seq], good[1 - seq], rtol=1e-5, atol=1e-6)


# varlen_attention: 2 sequences, queries 2 + 3 tokens, keys 3 + 4 tokens
VARLEN = {"query": _f32((5, 2, 4)), "key": _f32((7, 1, 4), 1), "value": _f32((7, 1, 3), 2),
          "cu_seq_q": np.array([0, 2, 5], np.int32), "cu_seq_k": np.array([0, 3, 7], np.int32),
          "max_q": 3, "max_k": 4, "enable_gqa": True}
# the paged form: a pool of 3 pages of 2 tokens; sequence 0 uses 3 keys, sequence 1 two
VARLEN_PAGED = {"query": _f32((5, 2, 4)), "key": _f32((3, 2, 1, 4), 1),
                "value": _f32((3, 2, 1, 3), 2), "cu_seq_q": np.array([0, 2, 5], np.int32),
                "cu_seq_k": None, "max_q": 3, "max_k": 4,
                "block_table": np.array([[0, 1], [2, 0]], np.int32),
                "seqused_k": np.array([3, 2], np.int32), "enable_gqa": True}
ALL = slice(None)


def _varlen_cases() -> list[tuple[str, dict, dict, Any]]:
    """(label, base inputs, changed inputs, the query rows that must be NaN)."""
    q, k = VARLEN["cu_seq_q"], VARLEN["cu_seq_k"]
    cases = [
        ("cu_seq_q starts at 1", VARLEN, {"cu_seq_q": np.array([1, 2, 5], np.int32)}, ALL),
        ("cu_seq_q starts at -1", VARLEN, {"cu_seq_q": np.array([-1, 2, 5], np.int32)}, ALL),
        ("cu_seq_q goes down", VARLEN, {"cu_seq_q": np.array([0, 6, 5], np.int32)}, ALL),
        ("cu_seq_q ends early", VARLEN, {"cu_seq_q": np.array([0, 2, 4], np.int32)}, ALL),
        ("cu_seq_q overlong", VARLEN, {"cu_seq_q": np.array([0, 2, 6], np.int32)}, ALL),
        ("cu_seq_k starts at -1", VARLEN, {"cu_seq_k": np.array([-1, 3, 7], np.int32)}, ALL),
        ("cu_seq_k goes down", VARLEN, {"cu_seq_k": np.array([0, 8, 7], np.int32)}, ALL),
        ("cu_seq_k ends early", VARLEN, {"cu_seq_k": np.array([0, 3, 6], np.int32)}, ALL),
        ("cu_seq_k overlong", VARLEN, {"cu_seq_k": np.array([0, 3, 8], np.int32)}, ALL),
    ]
    assert q.tolist() == [0, 2, 5] and k.tolist() == [0, 3, 7]
    for bad in (-1, 3, 30):
        cases.append((f"block_table[1, 0]={bad}", VARLEN_PAGED,
                      {"block_table": np.array([[0, 1], [bad, 0]], np.int32)}, slice(2, 5)))
    for bad in (-1, 5, 50):
        cases.append((f"seqused_k[0]={bad}", VARLEN_PAGED,
                      {"seqused_k": np.array([bad, 2], np.int32)},
                      ALL if bad > 4 else slice(0, 2)))
    return cases


@pytest.mark.parametrize("label, base, change, rows", _varlen_cases(),
                         ids=[c[0] for c in _varlen_cases()])
def test_jitted_varlen_attention_poisons_bad_traced_indices(label: str, base: dict,
                                                            change: dict, rows: Any) -> None:
    jax = pytest.importorskip("jax")
    import jax_attn

    inputs = {**base, **change}
    with pytest.raises(ValueError, match="^varlen_attention: "):
        jax_attn.varlen_attention(**inputs)
    traced = {name: x for name, x in inputs.items() if name in (
        "cu_seq_q", "cu_seq_k", "seqused_k", "block_table") and x is not None}
    static = {name: x for name, x in inputs.items() if name not in traced}
    out, lse = jax.jit(lambda **kw: jax_attn.varlen_attention(**static, **kw,
                                                              return_lse=True))(**traced)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.isnan(out[rows]).all() and np.isnan(lse[:, rows]).all(), label
    others = np.ones(out.shape[0], bool)
    others[rows] = False
    assert np.isfinite(out[others]).all(), label


def test_jitted_valid_indices_stay_finite() -> None:
    """The poison is only for bad indices: the valid inputs give the eager numbers under jit."""
    jax = pytest.importorskip("jax")
    import jax_attn

    for base in (VARLEN, VARLEN_PAGED):
        traced = {n: x for n, x in base.items()
                  if n in ("cu_seq_q", "cu_seq_k", "seqused_k", "block_table") and x is not None}
        static = {n: x for n, x in base.items() if n not in traced}
        out = jax.jit(lambda **kw: jax_attn.varlen_attention(**static, **kw))(**traced)  # noqa: B023
        np.testing.assert_allclose(np.asarray(out),
                                   np.asarray(jax_attn.varlen_attention(**base)),
                                   rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the caches' argument errors
def _cache(module: Any) -> Any:
    cache = module.PagedKVCache(4, 2, 1, 2)
    return cache.append(_f32((1, 1, 1, 2)), _f32((1, 1, 1, 2)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("flag", [1, 0, "yes", None])
def test_return_lse_must_be_a_bool(backend: str, flag: Any) -> None:
    module = pytest.importorskip(backend)
    cache = _cache(module)
    query = _f32((1, 1, 1, 2))
    with pytest.raises(TypeError, match=r"^PagedKVCache\.attend: return_lse must be a bool"):
        cache.attend(query, return_lse=flag)
    table, lens = cache.tables([0])
    with pytest.raises(TypeError, match=r"^paged_attention: return_lse must be a bool"):
        module.paged_attention(query, cache.key_pages, cache.value_pages, table, lens,
                               return_lse=flag)


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_integer_sequence_ids_are_ids(backend: str) -> None:
    module = pytest.importorskip(backend)
    cache = module.PagedKVCache(4, 2, 1, 2)
    cache = cache.append(_f32((2, 1, 1, 2)), _f32((2, 1, 1, 2)), seqs=[np.int64(1), np.int32(3)])
    assert cache.seq_len(np.int64(1)) == 1 and cache.seq_len(3) == 1
    table, lens = cache.tables(np.array([3, 1]))
    assert np.asarray(lens).tolist() == [1, 1]
    cache.attend(_f32((1, 1, 1, 2)), seqs=[np.int16(3)])
    cache = cache.free(np.int64(1))
    assert cache.seq_len(1) == 0 and cache.num_free_blocks == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_errors_name_the_argument(backend: str) -> None:
    module = pytest.importorskip(backend)
    cache = _cache(module)
    with pytest.raises(ValueError, match=r"^PagedKVCache\.free: sequence 5 holds no positions"):
        cache.free(5)
    with pytest.raises(ValueError, match=r"^PagedKVCache\.free: seq must be sequence ids"):
        cache.free(-1)
    with pytest.raises(ValueError, match=r"^PagedKVCache\.append: seqs must name one sequence "
                                         r"per row of keys and values; got len\(seqs\)=2"):
        cache.append(_f32((1, 1, 1, 2)), _f32((1, 1, 1, 2)), seqs=[0, 1])
    assert cache.seq_len(0) == 1 and cache.num_free_blocks == 3  # nothing changed


@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_dtype_names_are_type_errors(backend: str) -> None:
    module = pytest.importorskip(backend)
    with pytest.raises(TypeError, match=r"^PagedKVCache: dtype must be float16, bfloat16, "
                                        r"float32 or float64; got dtype.dtype=no_such_dtype"):
        module.PagedKVCache(4, 2, 1, 2, dtype="no_such_dtype")
    with pytest.raises(TypeError, match=r"^KVCache\.empty: dtype must be float16"):
        module.KVCache.empty((1,), 1, 4, 2, dtype="no_such_dtype")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.complex64, np.int32, np.bool_])
def test_caches_refuse_complex_and_integer_keys(backend: str, dtype: Any) -> None:
    module = pytest.importorskip(backend)
    bad, good = np.ones((1, 1, 1, 2), dtype), _f32((1, 1, 1, 2))
    cache = module.PagedKVCache(4, 2, 1, 2)
    with pytest.raises(TypeError, match=r"^PagedKVCache\.append: keys must be float16"):
        cache.append(bad, good)
    with pytest.raises(TypeError, match=r"^PagedKVCache\.append: values must be float16"):
        cache.append(good, bad)
    assert cache.num_free_blocks == 4
    kv = module.KVCache.empty((1,), 1, 4, 2)
    with pytest.raises(TypeError, match=r"^KVCache\.append: key must be float16"):
        kv.append(bad, good)
    with pytest.raises(TypeError, match=r"^KVCache\.append: value must be float16"):
        kv.append(good, bad)
