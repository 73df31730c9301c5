"""numpy_attn's blocked VJP (FlashAttention-2's backward, on the thread pool) equals the steps.

``scaled_dot_product_attention_vjp`` takes ``_fast.fast_attention_vjp`` for large inputs (the
rule of ``_fast.use_fast_path``). These tests shrink its blocks and its size threshold so small
inputs run several key-block tasks, query chunks, causal/window strips and skipped tiles, then
compare every gradient in float64 with the explicit VJP of ``backward.py`` (the readable
reference, forced by raising the threshold) and with the independent float64
``conformance.cases.reference.attention_vjp``. One test runs the default block sizes at the real
threshold; ``blockwise_attention_vjp``, which runs on the same threads, is checked with
``kv_lengths`` and several workers.

The tests of the last section (from mutation testing, docs/mutation.md) check the blocked VJP
against the float64 reference alone, in blocks of 8 queries and 8 keys (``blocked``): biases
broadcast along any axis (with sinks too), half precision computed in float32, ALiBi and
score_mods, documents that skip whole query blocks, and which calls take the fast path at all.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from numerics import assert_matches_reference, assert_vjp_matches_reference

import numpy_attn
from conformance import spec
from conformance.cases import reference
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


def _check(calls, monkeypatch, q, k, v, grad_out, rtol=1e-10, reference_options=None,
           **options):
    """The blocked VJP vs the explicit VJP vs the float64 reference (given
    ``reference_options`` instead of ``options`` where the reference needs the same attention
    said another way); returns the blocked one."""
    calls.clear()
    fast = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out, **options)
    assert calls == ["blocked"], "the blocked VJP did not run"
    calls.clear()
    plain = _explicit_vjp(monkeypatch, q, k, v, grad_out, **options)
    assert not calls
    expected = reference.attention_vjp(q, k, v, grad_out, **(reference_options or options))
    for i, name in enumerate(NAMES):
        if plain[i] is None:
            assert fast[i] is None and getattr(expected, name) is None, name
            continue
        assert fast[i].shape == plain[i].shape and fast[i].dtype == plain[i].dtype, name
        want = getattr(expected, name)
        atol = rtol * max(1.0, np.abs(want).max())  # e.g. d(per-query bias) is 0 ± rounding
        np.testing.assert_allclose(fast[i], want, rtol=rtol, atol=atol,
                                   err_msg=f"d{name} vs the float64 reference, {options}")
        np.testing.assert_allclose(fast[i], plain[i], rtol=rtol, atol=atol,
                                   err_msg=f"d{name} vs the explicit VJP, {options}")
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
    # a row masked by a -inf bias alone (the float64 reference gives it NaN, 0 / 0): the
    # reference gets the -inf positions as a mask, the spec's meaning of both
    bias[0, 3, 7] = -np.inf
    allowed = np.isfinite(bias)
    grad_q = _check(small_blocks, monkeypatch, q, k, v, grad_out, bias=bias, is_causal=True,
                    reference_options={"mask": allowed, "bias": np.where(allowed, bias, 0.0),
                                       "is_causal": True})[0]
    assert np.all(grad_q[0, 3, 7] == 0.0)


def test_blocked_vjp_float32_is_within_float32_rounding(small_blocks, monkeypatch):
    q, k, v, grad_out = _inputs(SHAPES["gqa_q_longer"], dtype=np.float32)
    _check(small_blocks, monkeypatch, q, k, v, grad_out, rtol=2e-5, is_causal=True,
           softcap=4.0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_blocked_vjp_half_precision_is_within_its_tolerance(small_blocks, dtype):
    """Half-precision inputs: gradients in the input dtype, within the harness's tolerance of
    the float64 reference VJP (float32 compute: a half-precision one would not be)."""
    np_dtype = np.dtype(dtype) if dtype == "float16" else pytest.importorskip(
        "ml_dtypes", reason="pip install ml_dtypes").bfloat16
    q, k, v, grad_out = (x.astype(np_dtype) for x in _inputs(SHAPES["gqa_q_longer"]))
    bias = np.random.default_rng(3).standard_normal((45, 37)).astype(np_dtype)
    fast = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out, bias=bias,
                                                       is_causal=True)
    assert small_blocks == ["blocked"]
    for name, f in zip(NAMES, fast, strict=True):
        assert f.dtype == np_dtype, name
    assert_vjp_matches_reference(fast, {"query": q, "key": k, "value": v, "bias": bias,
                                        "grad_output": grad_out}, dtype, is_causal=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_large_scores_take_the_shifted_softmax(small_blocks, monkeypatch, dtype):
    """Scores beyond ±EXP_BOUND (exp would overflow unshifted): the row max is subtracted, in
    the forward pass and in the log-sum-exp the VJP recomputes from; small scores skip it."""
    q, k, v, grad_out = _inputs(SHAPES["gqa_q_longer"], dtype=dtype)
    q[0, 1] *= 40.0  # head 1 only: scores of several hundred
    groups = q.shape[-3] // k.shape[-3]
    bounded = _fast.forward._bounded_heads(q * q.shape[-1] ** -0.5, k, groups, None)
    assert bounded.tolist() == [[True, False, True, True]]
    assert _fast.forward._bounded_heads(q, k, groups, 10.0).all()  # soft-capped within ±10
    rtol = 1e-10 if dtype == np.float64 else 2e-5
    for options in ({"is_causal": True}, {"window": (3, 6)}):
        _check(small_blocks, monkeypatch, q, k, v, grad_out, rtol=rtol, **options)
        fast = numpy_attn.scaled_dot_product_attention(q, k, v, **options)
        assert np.isfinite(fast).all()
        assert_matches_reference(fast, {"query": q, "key": k, "value": v},
                                 np.dtype(dtype).name, **options)


@pytest.mark.parametrize("use_exp2", [True, False], ids=["exp2", "exp"])
def test_scores_beyond_the_bound_but_within_float64s_range_stay_finite_in_float32(
        small_blocks, monkeypatch, use_exp2):
    """A head whose scores reach 100 (beyond ``EXP_BOUND``: ``exp`` of them overflows float32,
    as does ``exp2`` of them in units of log2) takes the shifted softmax: every output finite
    and the float64 reference's, in float32 (the bound is compared in the scores' units)."""
    q, k, v, _ = _inputs(SHAPES["gqa_q_longer"], dtype=np.float32)
    direction = np.ones(8, np.float32) / np.sqrt(8.0)
    q[0, 0] = direction * 10.0 * 8.0 ** 0.25  # head 0's scores: 10 · 10 · (q·k / √8) = 100
    k[0, 0] = direction * 10.0 * 8.0 ** 0.25
    q[0, 0, ::3] *= 0.9  # not all equal: every third query row's scores 90
    monkeypatch.setattr(_fast.forward, "USE_EXP2", use_exp2)  # either unit, whatever this CPU has
    ran = []
    real = _fast.forward.blocked_attention
    monkeypatch.setattr(_fast.forward, "blocked_attention",
                        lambda *a, **kw: ran.append(1) or real(*a, **kw))
    fast = numpy_attn.scaled_dot_product_attention(q, k, v, return_lse=True)
    assert ran == [1]  # the blocked forward pass
    assert np.isfinite(fast[0]).all() and np.isfinite(fast[1]).all()
    assert_matches_reference(fast[0], {"query": q, "key": k, "value": v}, "float32")
    lse = np.log(np.exp(np.float64(100.0)) * 37)  # row 1: 37 keys, every score 100
    assert fast[1][0, 0, 1] == pytest.approx(lse, rel=1e-6)


def test_default_blocks_at_the_real_threshold(monkeypatch):
    """The shipped rule and blocks, unpatched: 2 query heads sharing 1 kv head, 1024 tokens,
    take the blocked path (at least ``min_scores`` entries); the forward pass runs blocks of
    ``block_q`` query rows, the VJP tasks of ``block_kv`` keys with tiles of at most
    ``block_q_backward`` queries (``spec.FAST_PATHS``, as docs/spec.md states them). The
    gradients are checked along random directions against central differences of the float64
    reference's forward pass (its VJP holds a ``kv_len²`` Jacobian per query: too big here)."""
    numbers = spec.FAST_PATHS["numpy_attn"]["blocked"]
    q, k, v, grad_out = _inputs(((1, 2, 1024, 8), (1, 1, 1024, 8), (1, 1, 1024, 8)))
    assert 2 * 1024 * 1024 >= numbers["min_scores"] and 1024 >= numbers["min_q_len"]
    lanes = []
    real = _threads.run_lanes

    def spy(tasks, block, scratch):
        lanes.append((list(tasks), scratch()))
        return real(tasks, block, scratch)

    monkeypatch.setattr(_threads, "run_lanes", spy)
    for options in ({"is_causal": True}, {"window": (100, 10)}):
        lanes.clear()
        fast = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out, **options)
        (forward, _), (backward, tiles) = lanes  # the forward pass (lse), then the VJP
        assert {i1 - i0 for _, i0, i1, _ in forward} == {numbers["block_q"]}
        assert {k1 - k0 for _, k0, k1, _ in backward} == {numbers["block_kv"]}
        assert tiles["scores"].size == numbers["block_kv"] * numbers["block_q_backward"]
        # one random direction in (query, key, value) at once: a wrong gradient of any of
        # them moves the directional derivative
        gen = np.random.default_rng(11)
        directions = [gen.standard_normal(x.shape) for x in (q, k, v)]

        def loss(t, options=options, directions=directions):
            moved = [x + t * d for x, d in zip((q, k, v), directions, strict=True)]
            return float((reference.attention(*moved, **options).output * grad_out).sum())

        eps = 1e-5
        along = (loss(eps) - loss(-eps)) / (2 * eps)
        got = sum(float((g * d).sum()) for g, d in zip(fast[:3], directions, strict=True))
        np.testing.assert_allclose(got, along, rtol=1e-7, err_msg=f"{options}")


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
    equals the float64 reference VJP with the matching padding mask."""
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
    ref = reference.attention_vjp(q, k, v, grad_out, mask=mask, **options)
    expected = [getattr(ref, name) for name in NAMES]
    for name, g, e in zip(NAMES, got, expected, strict=True):
        atol = 1e-10 * max(1.0, np.abs(e).max())  # d(per-query bias) is 0 ± rounding
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=atol, err_msg=name)
    assert np.all(got[1][1, :, 11:] == 0.0) and np.all(got[2][1, :, 11:] == 0.0)


def test_module_backward_takes_the_blocked_vjp(small_blocks, monkeypatch):
    module = numpy_attn.CausalSelfAttention(6, 4, 5, rng=np.random.default_rng(7))
    x = np.random.default_rng(8).standard_normal((2, 40, 6))
    grad_out = np.random.default_rng(9).standard_normal((2, 40, 5))
    fast = module.parameter_gradients(x, grad_out)
    assert small_blocks, "the module's parameter_gradients did not take the blocked VJP"
    # the float64 reference: projections, the reference VJP, and x^T · d(projection)
    weights = {name: getattr(module, name) for name in ("W_query", "W_key", "W_value")}
    q, k, v = (x @ weights[name] for name in ("W_query", "W_key", "W_value"))
    ref = reference.attention_vjp(q, k, v, grad_out, is_causal=True)
    for name, grad in zip(("W_query", "W_key", "W_value"), (ref.query, ref.key, ref.value),
                          strict=True):
        want = np.einsum("bsi,bso->io", x, grad)
        np.testing.assert_allclose(fast[name], want, rtol=1e-10, atol=1e-12, err_msg=name)


# ------------------------------------------------------------------------------------------
# The blocked VJP against the float64 reference alone, blocks of 8 queries and 8 keys:
# broadcast biases, half precision, ALiBi and score_mods, documents, biases with sinks
# ------------------------------------------------------------------------------------------


@pytest.fixture
def blocked(monkeypatch):
    """The blocked paths for every input, in blocks of 8 queries and 8 keys; ``calls`` lists
    the paths ``fast_attention_vjp`` ran, and ``calls.forward`` those ``fast_attention`` ran."""
    for name, value in (("BLOCK_Q", 8), ("BLOCK_KV", 8), ("BLOCK_Q_BACKWARD", 8),
                        ("MIN_SCORES", 0), ("MIN_Q_LEN", 1)):
        monkeypatch.setattr(_fast, name, value)
    calls = _Calls()
    for name, record in (("fast_attention", calls.forward), ("fast_attention_vjp", calls)):
        monkeypatch.setattr(_fast, name, _spy(getattr(_fast, name), record))
    return calls


class _Calls(list):
    """The paths the VJP ran; ``forward``: those the forward pass ran."""

    def __init__(self) -> None:
        super().__init__()
        self.forward: list[str] = []


def _spy(real, record):
    def spy(path, *args, **kwargs):
        record.append(path)
        return real(path, *args, **kwargs)

    return spy


def _arrays(q_shape, k_shape, v_dim, seed=0, dtype=np.float64):
    gen = np.random.default_rng(seed)
    q = gen.standard_normal(q_shape)
    k = gen.standard_normal(k_shape)
    v = gen.standard_normal(k_shape[:-1] + (v_dim,))
    grad_out = gen.standard_normal(q_shape[:-1] + (v_dim,))
    return tuple(x.astype(dtype) for x in (q, k, v, grad_out))


def _vjp_vs_reference(calls, arrays, rtol=1e-10, **options):
    """numpy_attn's VJP (which must take the blocked path) against the float64 reference."""
    calls.clear()
    got = numpy_attn.scaled_dot_product_attention_vjp(*arrays, **options)
    assert calls == ["blocked"], "the blocked VJP did not run"
    want = reference.attention_vjp(*arrays, **options)
    names = ("query", "key", "value", "bias", "sinks")
    for name, grad in zip(names, got, strict=False):
        expected = getattr(want, name)
        if expected is None:
            assert grad is None, name
            continue
        assert grad.shape == np.shape(expected), name
        atol = rtol * max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(grad, expected, rtol=rtol, atol=atol,
                                   err_msg=f"d{name}, {sorted(options)}")
    return got


@pytest.mark.parametrize("bias_shape", [(3, 21, 19), (3, 1, 19), (3, 21, 1), (21, 19),
                                        (1, 1, 19)], ids=str)
def test_blocked_vjp_of_unbatched_inputs_with_a_broadcast_bias(blocked, bias_shape):
    """3-D ``(heads, q_len, head_dim)`` inputs: the bias's gradient is summed over the axes it
    was broadcast along, counted from the end (per head, per key, per query, shared)."""
    arrays = _arrays((3, 21, 8), (3, 19, 8), 5)
    bias = np.random.default_rng(1).standard_normal(bias_shape)
    _vjp_vs_reference(blocked, arrays, bias=bias, is_causal=True,
                      causal_alignment="bottom_right")


def test_the_fast_path_is_taken_unless_weights_or_dropout_are_asked_for(blocked):
    """``_fast.use_fast_path``: the blocks never hold the whole weights nor a keep-mask, so
    ``return_weights`` and dropout take the explicit steps; anything else (here at the shrunk
    threshold) the blocked path, forward and backward."""
    q, k, v, grad_out = _arrays((2, 9, 4), (2, 11, 4), 3, seed=4)
    keep = np.random.default_rng(5).random((2, 9, 11)) > 0.5
    numpy_attn.scaled_dot_product_attention(q, k, v)
    numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out)
    assert blocked.forward == ["blocked"] and blocked == ["blocked"]
    blocked.clear()
    blocked.forward.clear()
    output, weights = numpy_attn.scaled_dot_product_attention(q, k, v, return_weights=True)
    dropped = numpy_attn.scaled_dot_product_attention(q, k, v, dropout_p=0.5,
                                                      dropout_mask=keep)
    grads = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out, dropout_p=0.5,
                                                        dropout_mask=keep)
    assert blocked.forward == [] and blocked == []
    want = reference.attention(q, k, v)
    np.testing.assert_allclose(weights, want.weights, rtol=1e-12, atol=1e-12)
    want = reference.attention(q, k, v, dropout_p=0.5, dropout_mask=keep)
    np.testing.assert_allclose(dropped, want.output, rtol=1e-12, atol=1e-12)
    want = reference.attention_vjp(q, k, v, grad_out, dropout_p=0.5, dropout_mask=keep)
    np.testing.assert_allclose(grads[0], want.query, rtol=1e-10, atol=1e-12)


def test_half_precision_runs_the_blocks_in_float32(blocked, monkeypatch):
    """float16 inputs: ``_fast.forward`` and ``_fast.backward`` get every array in the compute
    dtype, float32 (``rules.compute_dtype``), the sinks and the VJP's extra columns included, and
    the results come back in float16 within its tolerance of the float64 reference."""
    seen: dict[str, list[str]] = {"forward": [], "vjp": [], "grads": []}

    def record(real, where, count):
        def spy(*args, **kwargs):
            seen[where].append([a.dtype.name for a in args[:count]] + [
                kwargs["sinks"].dtype.name if kwargs.get("sinks") is not None else
                args[7].dtype.name if len(args) > 7 and args[7] is not None else "-"])
            result = real(*args, **kwargs)
            if where == "vjp":  # the gradients of query, key, value and bias
                seen["grads"].append([g.dtype.name for g in result])
            return result
        return spy

    monkeypatch.setattr(_fast.forward, "blocked_attention",
                        record(_fast.forward.blocked_attention, "forward", 3))
    monkeypatch.setattr(_fast.backward, "blocked_attention_vjp",
                        record(_fast.backward.blocked_attention_vjp, "vjp", 4))
    q, k, v, grad_out = _arrays((2, 17, 8), (2, 19, 8), 5, seed=6, dtype=np.float16)
    sinks = np.array([0.5, -1.0], np.float16)
    bias = np.linspace(-1, 1, 19).astype(np.float16)
    output = numpy_attn.scaled_dot_product_attention(q, k, v, sinks=sinks, bias=bias)
    grads = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out, sinks=sinks,
                                                        bias=bias)
    assert blocked.forward == ["blocked"] and blocked == ["blocked"]
    assert seen["forward"] == [["float32"] * 4] * 2  # sdpa's and the VJP's forward pass
    assert seen["vjp"] == [["float32"] * 4 + ["-"]]
    assert seen["grads"] == [["float32"] * 4]
    assert output.dtype == np.float16 and all(g.dtype == np.float16 for g in grads)
    want = reference.attention_vjp(q, k, v, grad_out, sinks=sinks, bias=bias)
    np.testing.assert_allclose(output, reference.attention(q, k, v, sinks=sinks,
                                                           bias=bias).output,
                               rtol=2e-3, atol=2e-3)
    for got, name in zip(grads, ("query", "key", "value", "bias", "sinks"), strict=True):
        expected = getattr(want, name)
        np.testing.assert_allclose(got, expected, rtol=5e-3, atol=5e-3 * np.abs(expected).max(),
                                   err_msg=name)


def test_half_precision_query_is_scaled_in_float32(blocked):
    """float16 queries of 1.2e-7 (subnormal) with ``scale=0.1``: ``Q · scale`` underflows to 0
    in float16 but not in the compute dtype, float32, and ``dK = dSᵀ (Q · scale)`` is about
    1e-4 (``dO`` and ``V`` in the hundreds), which float16 holds."""
    gen = np.random.default_rng(7)
    q = (np.sign(gen.standard_normal((2, 9, 4))) * 1.2e-7).astype(np.float16)
    k = gen.standard_normal((2, 11, 4)).astype(np.float16)
    v, grad_out = ((gen.standard_normal(s) * 200).astype(np.float16)
                   for s in ((2, 11, 4), (2, 9, 4)))
    grad_key = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out, scale=0.1)[1]
    assert blocked == ["blocked"]
    want = reference.attention_vjp(q, k, v, grad_out, scale=0.1).key
    assert np.abs(want).max() > 1e-4
    np.testing.assert_allclose(grad_key, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


_SLOPES = 2.0 ** -np.arange(1, 5)  # ALiBi's slopes for 4 heads


class _PerHeadSlope:
    """A score_mod whose derivative depends on the head: ``score · (1 + head / 4)``."""

    def __call__(self, score, batch, head, q_idx, kv_idx):
        return score * (1.0 + 0.25 * head)

    def derivative(self, score, batch, head, q_idx, kv_idx):
        return np.broadcast_to(1.0 + 0.25 * head, np.broadcast_shapes(
            np.shape(score), np.shape(head))).astype(score.dtype)
MOD_CASES = {  # the tile adds ALiBi / applies score_mod between the product and `- lse`
    "alibi": lambda: {"alibi_slopes": _SLOPES},
    "score_mod": lambda: {"score_mod": numpy_attn.masks.softcap_mod(1.5)},
    "alibi_score_mod_bias": lambda: {"alibi_slopes": _SLOPES, "bias": np.linspace(-1, 1, 19),
                                     "score_mod": numpy_attn.masks.softcap_mod(1.5)},
    "per_head_score_mod": lambda: {"score_mod": _PerHeadSlope(), "is_causal": True},
    "softcap_alibi_chunks": lambda: {"softcap": 2.0, "alibi_slopes": _SLOPES, "chunk_size": 5,
                                     "is_causal": True},
}


@pytest.mark.parametrize("case", sorted(MOD_CASES))
def test_blocked_vjp_with_alibi_or_a_score_mod_alone(blocked, case):
    """ALiBi without a score_mod, a score_mod (not additive: a soft-cap) without ALiBi, both
    with a bias, and the soft-cap argument with ALiBi and chunks: against the float64
    reference VJP (ALiBi's slopes are constants, the score_mod's derivative is its own)."""
    arrays = _arrays((1, 4, 21, 8), (1, 2, 19, 8), 5, seed=8)
    arrays = (arrays[0] * 2,) + arrays[1:]  # scores of a few units: the soft-caps bend them
    _vjp_vs_reference(blocked, arrays, **MOD_CASES[case]())


@pytest.mark.parametrize("batch", [(), (2,)], ids=["unbatched", "batched"])
def test_blocked_vjp_with_documents_that_skip_query_blocks(blocked, batch):
    """Segment ids, no causality, 4 query blocks and 5 key blocks of 8: key block 0 is seen by
    query blocks 0 and 2 (not 1), key block 2 by query blocks 1 and 3 (not 0), key blocks 1,
    3 and 4 by no query; with and without a batch axis (the tile statuses lose one)."""
    arrays = _arrays(batch + (2, 32, 4), batch + (2, 40, 4), 3, seed=9)
    q_ids = np.broadcast_to(np.repeat([0, 2, 0, 2], 8), batch + (32,))
    kv_ids = np.broadcast_to(np.repeat(np.arange(5), 8), batch + (40,))
    grads = _vjp_vs_reference(blocked, arrays, segment_ids=(q_ids, kv_ids))
    for unseen in (slice(8, 16), slice(24, 40)):
        assert not grads[1][..., unseen, :].any() and not grads[2][..., unseen, :].any()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_blocked_vjp_where_no_query_sees_any_key(blocked, monkeypatch, dtype):
    """Segment ids that never match: no key block has a query, so no tile runs at all; every
    gradient is 0, shaped like its input, computed in float32 and returned in ``dtype``."""
    returned = []
    real = _fast.backward.blocked_attention_vjp

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        returned.append([(g.shape, g.dtype.name) for g in result[:3]])
        return result

    monkeypatch.setattr(_fast.backward, "blocked_attention_vjp", spy)
    q, k, v, grad_out = _arrays((2, 3, 9, 4), (2, 3, 11, 4), 5, seed=10, dtype=dtype)
    ids = (np.zeros((2, 9), np.int32), np.ones((2, 11), np.int32))
    grads = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out, segment_ids=ids)
    assert blocked == ["blocked"]
    assert returned == [[(x.shape, "float32") for x in (q, k, v)]]
    want = reference.attention_vjp(q, k, v, grad_out, segment_ids=ids)
    for got, x, name in zip(grads[:3], (q, k, v), ("query", "key", "value"), strict=True):
        assert got.shape == x.shape and got.dtype == x.dtype, name
        assert not got.any() and not getattr(want, name).any(), name


@pytest.mark.parametrize("bias_shape", [(2, 4, 21, 1), (21, 1), (4, 1, 19)], ids=str)
def test_blocked_vjp_of_a_bias_with_sinks(blocked, bias_shape):
    """With sinks a row's weights sum to less than 1, so a bias broadcast over the keys has a
    gradient (``p_sink · rowsum(dO ⊙ O)`` per row; 0 without sinks), summed from each lane's
    own copy."""
    arrays = _arrays((2, 4, 21, 8), (2, 2, 19, 8), 5, seed=11)
    gen = np.random.default_rng(12)
    bias, sinks = gen.standard_normal(bias_shape), gen.standard_normal(4)
    grads = _vjp_vs_reference(blocked, arrays, bias=bias, sinks=sinks, window=(9, 2))
    assert np.abs(grads[3]).max() > 1e-3
