"""numpy_attn's blocked VJP (FlashAttention-2's backward, on the thread pool) equals the steps.

``scaled_dot_product_attention_vjp`` takes ``_fast.fast_attention_vjp`` for large inputs (the
rule of ``_fast.use_fast_path``). These tests shrink its blocks and its size threshold so small
inputs run several key-block tasks, query chunks, causal/window strips and skipped tiles, then
compare every gradient in float64 with the explicit VJP of ``backward.py`` (the readable
reference, forced by raising the threshold) and with the independent float64
``conformance.reference.attention_vjp``. One test runs the default block sizes at the real
threshold; ``blockwise_attention_vjp``, which runs on the same threads, is checked with
``kv_lengths`` and several workers.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import attention_rules
import numpy_attn
from conformance import reference
from numpy_attn import _fast, _threads

# (query, key, value) shapes: grouped-query heads with q_len > kv_len, kv_len > q_len, 2-D
SHAPES = {
    "gqa_q_longer": ((1, 4, 45, 8), (1, 2, 37, 8), (1, 2, 37, 5)),
    "kv_longer": ((3, 29, 8), (3, 70, 8), (3, 70, 6)),
    "2d": ((50, 8), (33, 8), (33, 8)),
}

STRUCTURE = [
    {},
    {"is_causal": True},
    {"is_causal": True, "causal_alignment": "bottom_right"},
    {"window": (3, 2)},
    {"window": (5, 0), "causal_alignment": "bottom_right"},
    {"window": (None, 4)},
    {"window": (7, None), "causal_alignment": "bottom_right"},
    {"is_causal": True, "window": (6, 3)},
]

NAMES = ("query", "key", "value", "bias")


@pytest.fixture
def small_blocks(monkeypatch):
    """numpy_attn's blocked VJP for every input, in blocks of 8 keys and chunks of 16 queries;
    ``calls`` lists the paths ``fast_attention_vjp`` ran."""
    monkeypatch.setattr(_fast, "BLOCK_Q", 8)
    monkeypatch.setattr(_fast, "BLOCK_KV", 8)
    monkeypatch.setattr(_fast, "BLOCK_Q_BACKWARD", 16)
    monkeypatch.setattr(_fast, "MIN_SCORES", 0)
    monkeypatch.setattr(_fast, "MIN_Q_LEN", 8)
    calls = []
    real = _fast.fast_attention_vjp

    def spy(path, *args, **kwargs):
        calls.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(_fast, "fast_attention_vjp", spy)
    return calls


@pytest.fixture
def four_workers(monkeypatch):
    """The pool with 4 workers whatever the machine (BLAS asked for 4 threads, 4 usable cores),
    so the workers' own dQ copies are added even on a 1-core machine."""
    threadpoolctl = pytest.importorskip("threadpoolctl", reason="pip install threadpoolctl")
    if hasattr(os, "sched_getaffinity"):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    with threadpoolctl.threadpool_limits(limits=4, user_api="blas"):
        yield


def _inputs(shapes, dtype=np.float64, seed=0):
    gen = np.random.default_rng(seed)
    q, k, v = (gen.standard_normal(s).astype(dtype) for s in shapes)
    grad_out = gen.standard_normal(q.shape[:-1] + v.shape[-1:]).astype(dtype)
    return q, k, v, grad_out


def _explicit_vjp(monkeypatch, *arrays, **options):
    """``backward.py``'s explicit VJP: the threshold raised above every input."""
    with monkeypatch.context() as patch:
        patch.setattr(_fast, "MIN_SCORES", float("inf"))
        return numpy_attn.scaled_dot_product_attention_vjp(*arrays, **options)


def _check(calls, monkeypatch, q, k, v, grad_out, rtol=1e-10, with_reference=True, **options):
    """The blocked VJP vs the explicit VJP vs the float64 reference; returns the blocked one."""
    calls.clear()
    fast = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out, **options)
    assert calls == ["blocked"], "the blocked VJP did not run"
    calls.clear()
    plain = _explicit_vjp(monkeypatch, q, k, v, grad_out, **options)
    assert not calls
    expected = reference.attention_vjp(q, k, v, grad_out, **options) if with_reference else None
    for i, name in enumerate(NAMES):
        if plain[i] is None:
            assert fast[i] is None, name
            continue
        assert fast[i].shape == plain[i].shape and fast[i].dtype == plain[i].dtype, name
        atol = rtol * max(1.0, np.abs(plain[i]).max())  # e.g. d(per-query bias) is 0 ± rounding
        np.testing.assert_allclose(fast[i], plain[i], rtol=rtol, atol=atol,
                                   err_msg=f"d{name} vs the explicit VJP, {options}")
        if expected is not None:
            np.testing.assert_allclose(fast[i], getattr(expected, name), rtol=rtol, atol=atol,
                                       err_msg=f"d{name} vs the float64 reference, {options}")
    return fast


@pytest.mark.parametrize("shape_name", sorted(SHAPES))
@pytest.mark.parametrize("structure", STRUCTURE, ids=str)
def test_blocked_vjp_equals_explicit_and_reference(small_blocks, monkeypatch, shape_name,
                                                   structure):
    q, k, v, grad_out = _inputs(SHAPES[shape_name])
    grad_q, grad_k, grad_v, _ = _check(small_blocks, monkeypatch, q, k, v, grad_out, **structure)
    allowed = reference.structural_mask(q.shape[-2], k.shape[-2], **structure)
    # rows that see no key (e.g. bottom-right with q_len > kv_len) and keys no row sees: 0
    assert np.all(grad_q[..., ~allowed.any(axis=-1), :] == 0.0)
    assert np.all(grad_k[..., ~allowed.any(axis=-2), :] == 0.0)
    assert np.all(grad_v[..., ~allowed.any(axis=-2), :] == 0.0)


MASK_SHAPES = {  # ways a mask or bias broadcasts to (batch, heads, q_len, kv_len)
    "full": (2, 4, 45, 37),
    "padding": (2, 1, 1, 37),
    "per_query": (2, 4, 45, 1),
    "per_head": (4, 1, 37),
    "rows_keys": (45, 37),
}


@pytest.mark.parametrize("mask_shape", sorted(MASK_SHAPES))
def test_blocked_vjp_mask_bias_and_softcap(small_blocks, monkeypatch, mask_shape):
    gen = np.random.default_rng(1)
    q, k, v, grad_out = _inputs(((2, 4, 45, 8), (2, 2, 37, 8), (2, 2, 37, 6)), seed=1)
    shape = MASK_SHAPES[mask_shape]
    mask = gen.random(shape) > 0.3
    bias = gen.standard_normal(shape)
    _check(small_blocks, monkeypatch, q, k, v, grad_out, mask=mask, bias=bias, softcap=2.5,
           scale=0.3, is_causal=True, causal_alignment="bottom_right")
    _check(small_blocks, monkeypatch, q, k, v, grad_out, bias=bias, window=(4, 4))
    _check(small_blocks, monkeypatch, q, k, v, grad_out, mask=mask, is_causal=True)  # no bias


def test_blocked_vjp_fully_masked_rows_and_keys_are_exactly_zero(small_blocks, monkeypatch):
    q, k, v, grad_out = _inputs(SHAPES["gqa_q_longer"])
    mask = np.ones((1, 4, 45, 37), dtype=bool)
    mask[0, 1, 3] = False  # one row
    mask[0, :, 16:24] = False  # a block of rows in every head
    mask[0, 2] = False  # a whole head
    mask[0, :, :, 9] = False  # one key for every query
    bias = np.zeros((1, 4, 45, 37))
    grads = _check(small_blocks, monkeypatch, q, k, v, grad_out, mask=mask, bias=bias,
                   softcap=3.0)
    grad_q, grad_k, grad_v, grad_bias = grads
    for empty in ((0, 1, 3), (0, slice(None), slice(16, 24)), (0, 2)):
        assert np.all(grad_q[empty] == 0.0) and np.all(grad_bias[empty] == 0.0)
    assert np.all(grad_k[0, :, 9] == 0.0) and np.all(grad_v[0, :, 9] == 0.0)
    assert np.all(grad_bias[..., 9] == 0.0)
    grad_q, grad_k, grad_v, _ = _check(small_blocks, monkeypatch, q, k, v, grad_out, mask=mask)
    for empty in ((0, 1, 3), (0, slice(None), slice(16, 24)), (0, 2)):  # unshifted softmax
        assert np.all(grad_q[empty] == 0.0)
    assert np.all(grad_k[0, :, 9] == 0.0) and np.all(grad_v[0, :, 9] == 0.0)
    # a row masked by a -inf bias alone (the float64 reference gives NaN there: explicit only)
    bias[0, 3, 7] = -np.inf
    grad_q = _check(small_blocks, monkeypatch, q, k, v, grad_out, bias=bias, is_causal=True,
                    with_reference=False)[0]
    assert np.all(grad_q[0, 3, 7] == 0.0)


def test_blocked_vjp_float32_is_within_float32_rounding(small_blocks, monkeypatch):
    q, k, v, grad_out = _inputs(SHAPES["gqa_q_longer"], dtype=np.float32)
    _check(small_blocks, monkeypatch, q, k, v, grad_out, rtol=2e-5, is_causal=True,
           softcap=4.0)


@pytest.mark.parametrize(("dtype", "eps"), [("float16", 2.0**-10), ("bfloat16", 2.0**-7)])
def test_blocked_vjp_half_precision_computes_in_float32(small_blocks, monkeypatch, dtype, eps):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes", reason="pip install ml_dtypes").bfloat16
    q, k, v, grad_out = (x.astype(dtype) for x in _inputs(SHAPES["gqa_q_longer"]))
    bias = np.random.default_rng(3).standard_normal((45, 37)).astype(dtype)
    fast = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out, bias=bias,
                                                       is_causal=True)
    assert small_blocks == ["blocked"]
    plain = _explicit_vjp(monkeypatch, q, k, v, grad_out, bias=bias, is_causal=True)
    for name, f, p in zip(NAMES, fast, plain, strict=True):
        assert f.dtype == p.dtype == np.dtype(dtype), name
        # both round the same float32 gradients to the half dtype: at most one unit apart
        spacing = np.abs(p.astype(np.float32)) * eps + 1e-6
        assert np.all(np.abs(f.astype(np.float32) - p.astype(np.float32)) <= spacing), name


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_large_scores_take_the_shifted_softmax(small_blocks, monkeypatch, dtype):
    """Scores beyond ±EXP_BOUND (exp would overflow unshifted): the row max is subtracted, in
    the forward pass and in the log-sum-exp the VJP recomputes from; small scores skip it."""
    q, k, v, grad_out = _inputs(SHAPES["gqa_q_longer"], dtype=dtype)
    q[0, 1] *= 40.0  # head 1 only: scores of several hundred
    groups = q.shape[-3] // k.shape[-3]
    bounded = _fast._bounded_heads(q * q.shape[-1] ** -0.5, k, groups, None)
    assert bounded.tolist() == [[True, False, True, True]]
    assert _fast._bounded_heads(q, k, groups, 10.0).all()  # soft-capped within ±10
    rtol = 1e-10 if dtype == np.float64 else 2e-5
    for options in ({"is_causal": True}, {"window": (3, 6)}):
        _check(small_blocks, monkeypatch, q, k, v, grad_out, rtol=rtol, **options)
        fast = numpy_attn.scaled_dot_product_attention(q, k, v, **options)
        plain, _ = numpy_attn.scaled_dot_product_attention(q, k, v, return_weights=True,
                                                           **options)
        assert np.isfinite(fast).all()
        np.testing.assert_allclose(fast, plain, rtol=rtol, atol=rtol)


def test_default_blocks_at_the_real_threshold(monkeypatch):
    """The shipped block sizes and threshold: 2 query heads sharing 1 kv head, 1024 tokens."""
    q, k, v, grad_out = _inputs(((1, 2, 1024, 8), (1, 1, 1024, 8), (1, 1, 1024, 8)))
    numbers = attention_rules.FAST_PATHS["numpy_attn"]["blocked"]
    assert (_fast.BLOCK_KV, _fast.BLOCK_Q_BACKWARD) == (numbers["block_kv"],
                                                         numbers["block_q_backward"])
    assert q.shape[-2] > _fast.BLOCK_Q_BACKWARD and k.shape[-2] > _fast.BLOCK_KV
    args = attention_rules.attention_arguments(
        "test", (q.shape, "float64"), (k.shape, "float64"), (v.shape, "float64"),
        grad_output=(grad_out.shape, "float64"))
    assert _fast.use_fast_path(q, k, v, None, None, args) == "blocked"
    for options in ({"is_causal": True}, {"window": (100, 10)}):
        fast = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out, **options)
        plain = _explicit_vjp(monkeypatch, q, k, v, grad_out, **options)
        for name, f, p in zip(NAMES[:3], fast, plain, strict=False):
            np.testing.assert_allclose(f, p, rtol=1e-10, atol=1e-10 * np.abs(p).max(),
                                       err_msg=f"d{name}, {options}")


def test_dropout_and_small_inputs_take_the_explicit_vjp(small_blocks, monkeypatch):
    q, k, v, grad_out = _inputs(SHAPES["gqa_q_longer"])
    keep = np.random.default_rng(2).random((1, 4, 45, 37)) > 0.2
    numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out, dropout_p=0.2,
                                                dropout_mask=keep)
    assert small_blocks == []
    monkeypatch.setattr(_fast, "MIN_SCORES", 4 * 45 * 37 + 1)
    numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out)
    assert small_blocks == []


def test_several_workers_add_their_own_grad_query(small_blocks, monkeypatch, four_workers):
    workers = []
    real = _threads.run_lanes

    def counting(tasks, block, scratch):
        scratches = real(tasks, block, scratch)
        workers.append(len(scratches))
        return scratches

    monkeypatch.setattr(_threads, "run_lanes", counting)
    q, k, v, grad_out = _inputs(SHAPES["gqa_q_longer"])
    _check(small_blocks, monkeypatch, q, k, v, grad_out, is_causal=True,
           bias=np.random.default_rng(4).standard_normal((45, 1)))
    assert max(workers) == 4


def test_blockwise_vjp_on_the_threads_with_kv_lengths(monkeypatch, four_workers):
    """``blockwise_attention_vjp`` (query blocks forward, key blocks backward, on the pool)
    equals the explicit VJP with the matching padding mask."""
    q, k, v, grad_out = _inputs(((2, 4, 30, 8), (2, 2, 26, 8), (2, 2, 26, 5)), seed=5)
    bias = np.random.default_rng(6).standard_normal((4, 30, 1))
    lengths = np.array([26, 11])
    runs = []
    real = _threads.run_lanes
    monkeypatch.setattr(_threads, "run_lanes", lambda *a: runs.append(len(a[0])) or real(*a))
    options = {"bias": bias, "is_causal": True, "causal_alignment": "bottom_right",
               "softcap": 3.0}
    got = numpy_attn.blockwise_attention_vjp(q, k, v, grad_out, kv_lengths=lengths, block_q=4,
                                             block_kv=3, **options)
    assert len(runs) == 2 and min(runs) > 1  # forward and backward, several tasks each
    mask = numpy_attn.padding_mask(lengths, k.shape[-2])
    expected = _explicit_vjp(monkeypatch, q, k, v, grad_out, mask=mask, **options)
    for name, g, e in zip(NAMES, got, expected, strict=True):
        atol = 1e-10 * max(1.0, np.abs(e).max())  # d(per-query bias) is 0 ± rounding
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=atol, err_msg=name)
    assert np.all(got[1][1, :, 11:] == 0.0) and np.all(got[2][1, :, 11:] == 0.0)


def test_module_backward_takes_the_blocked_vjp(small_blocks, monkeypatch):
    module = numpy_attn.CausalSelfAttention(6, 4, 5, rng=np.random.default_rng(7))
    x = np.random.default_rng(8).standard_normal((2, 40, 6))
    grad_out = np.random.default_rng(9).standard_normal((2, 40, 5))
    fast = module.backward(x, grad_out)
    assert small_blocks, "the module's backward did not take the blocked VJP"
    monkeypatch.setattr(_fast, "MIN_SCORES", float("inf"))
    plain = module.backward(x, grad_out)
    for name in plain:
        np.testing.assert_allclose(fast[name], plain[name], rtol=1e-10, atol=1e-12, err_msg=name)
