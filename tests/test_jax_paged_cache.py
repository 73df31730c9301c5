"""jax_attn's ``PagedKVCache`` and ``paged_attention`` as a user calls them: every error of the
constructor, ``append``, ``tables``, ``free`` and the kernel names its method and argument (the
same messages as numpy_attn's and torch_attn's, ``paged_helpers``), the cache's defaults (float32,
``v_dim`` = ``head_dim``, sequences by batch row, int32 tables), and ``attend`` passing ``scale``,
``softcap`` and ``sinks`` to a kernel that merges two chunks, with rows that see no key.

The expected values come from the float64 ``conformance.cases.reference`` over each sequence's
contiguous keys, never from the module under test against itself. The error checks compile
nothing; the numerical test runs one tiny problem (sequences of 7, 1 and 0 positions, 2 query
heads over 1 kv head, head_dim 2, pages of 2 positions) so that few programs compile. The tests
came from mutation testing of ``jax_attn/paged.py`` (docs/mutation.md).
"""

from __future__ import annotations

import numpy as np
import pytest
from paged_helpers import check_paged_cache_errors, constructor_errors, paged_inputs

from conformance.cases import reference

pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
jax_attn = pytest.importorskip("jax_attn")

# ------------------------------------------------------------------------------------------
# the cache's constructor, appends, tables and frees: every message names its method and
# argument (nothing compiles)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error", "message"), constructor_errors((
    "no_such_platform", "device must be None, a jax.Device or a platform name such as 'cpu'; "
    "got device='no_such_platform'")))
def test_jax_paged_cache_constructor_names_each_bad_argument(kwargs, error, message):
    given = {"num_blocks": 1, "block_size": 1, "kv_heads": 1, "head_dim": 2, **kwargs}
    with pytest.raises(error) as raised:
        jax_attn.PagedKVCache(**given)
    assert str(raised.value) == f"PagedKVCache: {message}"


def test_jax_paged_cache_methods_name_themselves_in_errors():
    """``append``, ``tables`` and ``paged_attention`` (numpy_attn's and torch_attn's shared
    checks, ``paged_helpers``), ``free`` and a concrete table's check: each message starts
    with the method's name, and a refused append changes nothing."""
    check_paged_cache_errors("jax")
    cache = jax_attn.PagedKVCache(2, 2, 1, 2)
    with pytest.raises(ValueError, match=r"^PagedKVCache\.free: sequence 0 holds no positions"):
        cache.free(0)
    args = {name: x for name, x in paged_inputs().items() if name not in ("keys", "values")}
    with pytest.raises(ValueError, match=r"^paged_attention: block_table\[0, 0\]=5 is not a "
                                         r"page"):
        jax_attn.paged_attention(**{**args, "block_table": np.array([[5, 0]], np.int32)})


@pytest.mark.parametrize("name", ["query", "key_pages", "value_pages", "block_table",
                                  "seq_lens", "sinks"])
def test_jax_paged_attention_names_an_input_given_as_a_list(name):
    args = {"query": np.zeros((1, 2, 1, 2), np.float32),
            "key_pages": np.zeros((2, 2, 1, 2), np.float32),
            "value_pages": np.zeros((2, 2, 1, 3), np.float32),
            "block_table": np.zeros((1, 2), np.int32), "seq_lens": np.ones(1, np.int32),
            "sinks": np.zeros(2, np.float32)}
    args[name] = np.asarray(args[name]).tolist()
    with pytest.raises(TypeError, match=rf"^paged_attention: {name} must be an array .* got "
                                        rf"type\({name}\)=list$"):
        jax_attn.paged_attention(**args)


def test_jax_paged_cache_defaults_float32_and_appends_rows_to_sequences_by_batch():
    """A cache's default dtype is float32, ``"bfloat16"`` names its type, and ``v_dim``
    defaults to ``head_dim``; ``append`` without ``seqs`` gives row ``b`` of the batch (not
    of the kv heads) to sequence ``b``; ``seq_len`` of a sequence the cache does not hold is
    0; tables are int32."""
    cache = jax_attn.PagedKVCache(4, 2, 1, 2)
    assert cache.key_pages.dtype == cache.value_pages.dtype == jnp.float32
    half = jax_attn.PagedKVCache(1, 1, 1, 2, 3, dtype="bfloat16")
    assert half.key_pages.dtype == half.value_pages.dtype == jnp.bfloat16
    assert half.key_pages.shape == (1, 1, 1, 2) and half.value_pages.shape == (1, 1, 1, 3)
    assert cache.value_pages.shape == (4, 2, 1, 2)
    cache = cache.append(np.ones((2, 1, 3, 2), np.float32), np.ones((2, 1, 3, 2), np.float32))
    assert [cache.seq_len(s) for s in (0, 1, 2)] == [3, 3, 0]
    table, lens = cache.tables()
    assert table.dtype == lens.dtype == jnp.int32
    assert lens.tolist() == [3, 3] and table.shape == (2, 2)


# ------------------------------------------------------------------------------------------
# the kernel against the float64 reference: one tiny problem, every sequence length case
# ------------------------------------------------------------------------------------------

HEADS, KV_HEADS, HEAD_DIM, V_DIM, BLOCK, NUM_BLOCKS, Q_LEN = 2, 1, 2, 3, 2, 8, 2
SINKS = np.array([0.5, -1.0], np.float32)
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 2 pages (4 positions) in 2 steps of one page: 7 positions are two chunks,
    merged; pages of ``BLOCK`` positions count as large (``TAKE_POSITIONS``): copied one page
    at a time, which is the step's one page here (the same program as the small pages')."""
    import attention_rules
    from jax_attn import paged

    for name, value in (("chunk", 4), ("min_kv_len", 4), ("steps", 2)):
        monkeypatch.setitem(attention_rules.SPLIT_KV, name, value)
    monkeypatch.setattr(paged, "TAKE_POSITIONS", BLOCK)


def _problem() -> tuple[object, dict[int, tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """A cache holding sequence 0 (7 positions, appended 4 + 3) and sequence 1 (1 position:
    its first query row sees no key); sequence 2 is not held (0 positions). Returns the cache,
    each sequence's float32 keys and values, and a query ``(3, HEADS, Q_LEN, HEAD_DIM)``."""
    rng = np.random.default_rng(31)
    truth = {s: (rng.standard_normal((KV_HEADS, n, HEAD_DIM)).astype(np.float32),
                 rng.standard_normal((KV_HEADS, n, V_DIM)).astype(np.float32))
             for s, n in ((0, 7), (1, 1), (2, 0))}
    cache = jax_attn.PagedKVCache(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, V_DIM)
    for seqs, span in (([0, 1], slice(0, 1)), ([0], slice(1, 4)), ([0], slice(4, 7))):
        keys = np.stack([truth[s][0][:, span] for s in seqs])
        values = np.stack([truth[s][1][:, span] for s in seqs])
        cache = cache.append(keys, values, seqs)
    query = rng.standard_normal((3, HEADS, Q_LEN, HEAD_DIM)).astype(np.float32)
    return cache, truth, query


def _expected(truth, query, seqs, **options):
    """Per sequence, the float64 reference's output and lse (causal, bottom-right)."""
    steps = [reference.attention(query[row], *truth[seq], is_causal=True,
                                 causal_alignment="bottom_right", **options)
             for row, seq in enumerate(seqs)]
    return np.stack([s.output for s in steps]), np.stack([s.lse for s in steps])


def test_jax_paged_attend_with_scale_softcap_sinks_and_rows_without_keys(small_chunks):
    """``attend`` passes ``scale``, ``softcap`` and ``sinks`` to the kernel, which merges two
    chunks; a row that sees no key (sequence 1's first, every row of the unheld sequence 2)
    gives output 0 and lse -inf, or the sink's logit; ``return_lse=False`` gives the output
    alone. Against the float64 reference."""
    cache, truth, query = _problem()
    seqs = [0, 1, 2]
    assert cache.seq_len(2) == 0
    options = {"scale": 0.7, "softcap": 2.5}
    output, lse = cache.attend(query, seqs, return_lse=True, **options)
    want_output, want_lse = _expected(truth, query, seqs, **options)
    assert output.dtype == lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(output), want_output, **TOL)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(want_lse))
    np.testing.assert_allclose(np.asarray(lse), want_lse, **TOL)
    alone = cache.attend(query, **options)  # default sequences 0, 1, 2; the output alone
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(output))
    output, lse = cache.attend(query, seqs, return_lse=True, sinks=SINKS, **options)
    want_output, want_lse = _expected(truth, query, seqs, sinks=SINKS, **options)
    np.testing.assert_allclose(np.asarray(output), want_output, **TOL)
    np.testing.assert_allclose(np.asarray(lse), want_lse, **TOL)
