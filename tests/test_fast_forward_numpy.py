"""numpy_attn's blocked forward pass (``_fast/forward.py``) against the float64 reference.

``scaled_dot_product_attention`` takes ``_fast.fast_attention``'s ``"blocked"`` path for large
inputs; these tests force it on tiny inputs (blocks of 8 queries and 8 keys, ``blocked``) and
check: the output in the input dtype and the lse in the compute dtype; when a head may skip the
shift by the row max (the bound ``min(max |q| · max |k|, softcap)`` against ``EXP_BOUND``, in
units of log2 where NumPy vectorises ``exp2``, issue 28) and that a bias, ALiBi or a score_mod
never let it skip; sinks on query blocks without keys; chunks that cut a key block inside a
block's key range (``_narrowed``). Expected values: the float64 ``conformance.cases.reference``;
tiny shapes, NumPy only. The tests came from mutation testing (docs/mutation.md); the blocked
backward pass is ``tests/test_fast_backward_numpy.py``'s.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_fast_backward_numpy import _arrays

import attention_rules as rules
import numpy_attn
from conformance.cases import reference
from numpy_attn import _fast


@pytest.fixture
def blocked(monkeypatch):
    """The blocked path for every input, in blocks of 8 queries and 8 keys; ``forward`` lists
    the paths ``fast_attention`` ran."""
    for name, value in (("BLOCK_Q", 8), ("BLOCK_KV", 8), ("BLOCK_Q_BACKWARD", 8),
                        ("MIN_SCORES", 0), ("MIN_Q_LEN", 1)):
        monkeypatch.setattr(_fast, name, value)
    calls = _Calls()
    real = _fast.fast_attention

    def spy(path, *args, **kwargs):
        calls.forward.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(_fast, "fast_attention", spy)
    return calls


class _Calls(list):
    """``forward``: the paths the forward pass ran."""

    def __init__(self) -> None:
        super().__init__()
        self.forward: list[str] = []



@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_blocked_forward_returns_the_input_dtype_and_a_compute_dtype_lse(blocked, dtype):
    """The output in the input dtype, the lse in the compute dtype (float32 for both), ``-inf``
    on a row without a key, both within the dtype's rounding of the float64 reference."""
    q, k, v, _ = _arrays((2, 17, 8), (2, 19, 8), 5, seed=2, dtype=dtype)
    mask = np.random.default_rng(3).random((2, 17, 19)) > 0.4
    mask[1, 4] = False  # a row without a key
    output, lse = numpy_attn.scaled_dot_product_attention(q, k, v, mask=mask, return_lse=True)
    assert blocked.forward == ["blocked"]
    assert output.dtype == np.dtype(dtype) and lse.dtype == np.float32
    want = reference.attention(q, k, v, mask=mask)
    tol = 1e-5 if dtype == "float32" else 2e-3
    np.testing.assert_allclose(output, want.output, rtol=tol, atol=tol)
    assert lse[1, 4] == -np.inf and np.isfinite(np.delete(lse, 4, axis=1)).all()
    np.testing.assert_allclose(lse, want.lse, rtol=tol, atol=tol)



# ------------------------------------------------------------------------------------------
# The blocked forward pass (_fast/forward.py): when it may skip the shift by the row max
# ------------------------------------------------------------------------------------------


class _Plus95:
    """A score_mod that adds 95: ``exp`` of such a score overflows float32 unshifted."""

    def __call__(self, score, batch, head, q_idx, kv_idx):
        return score + 95.0

    def derivative(self, score, batch, head, q_idx, kv_idx):
        return np.ones_like(score)


SHIFT_CASES = {  # small q·k (the norms bound them), but a bias, ALiBi or score_mod do not
    "bias_95": lambda: {"bias": np.float32(95.0) + np.linspace(0, 1, 6, dtype=np.float32)},
    "alibi_far_keys": lambda: {"alibi_slopes": np.array([4.0, 8.0], np.float32)},
    "score_mod_plus_95": lambda: {"score_mod": _Plus95()},
}


@pytest.mark.parametrize("case", sorted(SHIFT_CASES))
def test_blocked_forward_shifts_what_the_norms_do_not_bound(blocked, case):
    """float32, 40 queries over 6 keys (top-left: query 39 is 34 keys past the last one),
    queries and keys of norm about 0.2: only the shift by the row max keeps ``exp`` from
    overflowing (+95) or underflowing (ALiBi below -100) in float32."""
    q, k, v, _ = _arrays((2, 40, 4), (2, 6, 4), 3, seed=13, dtype=np.float32)
    q, k = q * 0.1, k * 0.1
    options = SHIFT_CASES[case]()
    output = numpy_attn.scaled_dot_product_attention(q, k, v, **options)
    assert blocked.forward == ["blocked"]
    want = reference.attention(q, k, v, **options).output
    assert np.isfinite(output).all()
    np.testing.assert_allclose(output, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(4, 11, 3), (11, 3)], ids=["unbatched_gqa", "2d"])
def test_blocked_forward_bounds_unbatched_and_2d_scores(blocked, shape):
    """No bias nor mods: each head's bound ``max |q| · max |k|`` decides whether its softmax
    skips the shift. Unbatched grouped-query heads (4 over 2) and 2-D inputs whose query norms
    are large and key norms small (scores up to a few hundred: the bound must be the
    product)."""
    gen = np.random.default_rng(14)
    q = gen.standard_normal(shape).astype(np.float32) * 60.0
    k_shape = (2,) + shape[1:] if len(shape) == 3 else shape
    k = gen.standard_normal(k_shape).astype(np.float32) * 3.0
    v = gen.standard_normal(k_shape).astype(np.float32)
    output = numpy_attn.scaled_dot_product_attention(q, k, v, scale=1.0)
    assert blocked.forward == ["blocked"]
    assert np.isfinite(output).all()
    want = reference.attention(q, k, v, scale=1.0).output
    np.testing.assert_allclose(output, want, rtol=1e-4, atol=1e-4)


def test_narrowed_masks_only_the_key_blocks_the_mods_cut():
    """``_fast.forward._narrowed`` (the forward pass's key range under chunks, segment ids and
    ``mask_mod``), by hand from its docstring: the range shrinks to the key blocks that are not
    ``NONE`` and ``[p0, p1)`` spans those that are not ``ALL``, so the blocks the mods leave
    whole are never masked (a wider span would give the same output at a higher cost)."""
    none, some, every = rules.NONE, rules.SOME, rules.ALL
    row = np.array([some, every, every, none, none], np.uint8)
    assert _fast.forward._narrowed((0, 40, 0, 40, 0, 0), row, 8) == (0, 24, 0, 24, 0, 8)
    row = np.array([every, some, every], np.uint8)
    assert _fast.forward._narrowed((0, 20, 5, 15, 0, 0), row, 8) == (0, 20, 5, 15, 8, 16)
    row = np.array([none, every, every, some], np.uint8)
    assert _fast.forward._narrowed((0, 32, 0, 32, 0, 0), row, 8) == (8, 32, 8, 32, 24, 32)
    assert _fast.forward._narrowed((0, 32, 0, 32, 0, 0), np.zeros(4, np.uint8), 8)[:2] == (0, 0)


@pytest.mark.parametrize("heads", [(), (3,)], ids=["2d", "3d"])
def test_blocked_forward_sinks_on_query_blocks_without_keys(blocked, heads):
    """Causal bottom-right, 24 queries over 8 keys: queries 0-15 (two whole blocks) see no key,
    so only their sink is left (output 0, lse the sink); 2-D inputs take ``(1,)`` sinks."""
    q, k, v, _ = _arrays(heads + (24, 4), heads + (8, 4), 3, seed=15)
    sinks = np.linspace(-0.5, 0.5, heads[0] if heads else 1)
    options = {"is_causal": True, "causal_alignment": "bottom_right", "sinks": sinks}
    output, lse = numpy_attn.scaled_dot_product_attention(q, k, v, return_lse=True, **options)
    assert blocked.forward == ["blocked"]
    want = reference.attention(q, k, v, **options)
    np.testing.assert_allclose(output, want.output, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want.lse, rtol=1e-12, atol=1e-12)
    assert not output[..., :16, :].any()
    np.testing.assert_allclose(lse[..., :16], np.broadcast_to(
        sinks[:, None] if heads else sinks, lse[..., :16].shape), rtol=1e-12)


def test_blocked_forward_chunks_cut_a_key_block_inside_the_range(blocked):
    """Chunks of 12 over 48 queries and keys: query block 2 (rows 16-23) sees keys 12-23, so
    its key range starts at key block 1 (cut by the chunk) and ends after block 2 (whole):
    only the first is masked."""
    q, k, v, _ = _arrays((2, 48, 4), (2, 48, 4), 3, seed=16)
    output = numpy_attn.scaled_dot_product_attention(q, k, v, chunk_size=12)
    assert blocked.forward == ["blocked"]
    want = reference.attention(q, k, v, chunk_size=12).output
    np.testing.assert_allclose(output, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------
# Scores in units of log2 (exp2) and the bound that lets a head skip the shift (issue 28)
# ------------------------------------------------------------------------------------------


def _rows_of_norm(gen, shape, norm):
    """Random rows, each of Euclidean norm ``norm`` (so the largest row norm is ``norm``)."""
    x = gen.standard_normal(shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True) * norm


BOUND_CASES = {  # (query norm, key norm, softcap, whether the head must take the shift)
    "bound_50": (10.0, 5.0, None, False),  # 50 <= 64, though 50 · log2 e = 72 > 64
    "bound_70": (10.0, 7.0, None, True),  # 70 > 64
    "softcap_30_norms_200": (20.0, 10.0, 30.0, False),  # the soft cap bounds the scores
    "softcap_64_at_the_bound": (20.0, 10.0, 64.0, False),  # bound == limit: still bounded
    "small_query_norm": (0.01, 1000.0, None, False),  # 10: the product, not the key norm alone
    "small_key_norm": (1000.0, 0.01, None, False),  # 10: the product, not the query norm alone
}


@pytest.mark.parametrize("use_exp2", [True, False], ids=["exp2", "exp"])
@pytest.mark.parametrize("case", sorted(BOUND_CASES))
def test_blocked_forward_skips_the_shift_exactly_where_the_bound_allows(blocked, monkeypatch,
                                                                       case, use_exp2):
    """float64, 2-D (8 queries, 8 keys: one block), ``scale=1``, no bias nor mods: with
    ``exp2`` (``USE_EXP2``, as on a CPU where NumPy vectorises it) the scores are in units of
    log2 (the bound passed to ``_bounded_heads`` is ``EXP_BOUND · log2 e``, the soft cap scaled
    alike), with ``exp`` in natural units; the shifted softmax (``_unnormalised_softmax``) runs
    only for a head whose bound ``min(max |q| · max |k|, softcap)`` exceeds ``EXP_BOUND`` (the
    module docstring's fast path). Output and lse against the float64 reference either way."""
    monkeypatch.setattr(_fast.forward, "USE_EXP2", use_exp2)
    q_norm, k_norm, softcap, shifted = BOUND_CASES[case]
    gen = np.random.default_rng(17)
    q, k = _rows_of_norm(gen, (8, 4), q_norm), _rows_of_norm(gen, (8, 4), k_norm)
    v = gen.standard_normal((8, 3))
    softmax_calls, limits = [], []
    real_softmax, real_bound = _fast.forward._unnormalised_softmax, _fast.forward._bounded_heads

    def softmax(scores):
        softmax_calls.append(scores.shape)
        return real_softmax(scores)

    def bound(query, key, groups, cap, limit=_fast.forward.EXP_BOUND):
        limits.append(limit)
        return real_bound(query, key, groups, cap, limit)

    monkeypatch.setattr(_fast.forward, "_unnormalised_softmax", softmax)
    monkeypatch.setattr(_fast.forward, "_bounded_heads", bound)
    options = {"scale": 1.0, "softcap": softcap}
    output, lse = numpy_attn.scaled_dot_product_attention(q, k, v, return_lse=True, **options)
    assert blocked.forward == ["blocked"]
    assert limits == [_fast.forward.EXP_BOUND * (_fast.forward.LOG2E if use_exp2 else 1.0)]
    assert len(softmax_calls) == (1 if shifted else 0)
    want = reference.attention(q, k, v, **options)
    np.testing.assert_allclose(output, want.output, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(lse, want.lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("features, vectorised", [
    ({"AVX512_SKX": True, "X86_V4": True}, True), ({"X86_V4": True}, True),
    ({"AVX512_SKX": True}, True), ({"AVX2": True, "X86_V3": True}, False), ({}, False)])
def test_exp2_only_where_numpy_dispatches_its_avx512_loops(monkeypatch, features, vectorised):
    """``_fast.forward._exp2_is_vectorised`` reads NumPy's CPU dispatch: exp2 (units of log2) only
    with AVX-512 (NumPy's vectorised float32 exp2); exp otherwise (``USE_EXP2``)."""
    from numpy._core import _multiarray_umath
    monkeypatch.setattr(_multiarray_umath, "__cpu_features__", features)
    assert _fast.forward._exp2_is_vectorised() is vectorised
