"""Trust at the seams: what a backend receives from another piece of code (a partial result, a
mod made in a loop, a fully masked input, a mod that is NaN where it is masked, another
thread's BLAS limit) keeps the spec's promise.

* ``merge_attention``: a part with lse ``-inf`` contributes nothing, even with a NaN output
  (``spec.MERGING``), forward and VJP, every backend.
* jax_attn's ``document_mod`` is keyed by the ids' contents: under ``jax.jit`` with the mod
  static, a mod made from other ids (a freed array's ``id`` reused) never runs the previous
  call's program.
* torch_attn's fast path on a fully masked input: the output is in the autograd graph,
  gradients exactly 0.
* A ``score_mod`` that is NaN only at masked positions: gradients finite, 0 where masked, equal
  to those of a mod that is finite there, every backend, small and fast-path sizes.
* A plugin computing float16 in float16 (sums accumulated in float16, not the compute dtype)
  fails ``combined_long_keys`` in float16; the common shape's cases cannot tell.
* The ready-made score mods' arrays are constants (``spec.SCORE_MOD``): a learned table or
  slopes get no gradient in torch_attn and jax_attn, explicit and fast-path sizes; the mods
  are equal by their arrays' contents.
* numpy_attn's threaded path under concurrent calls leaves the process's BLAS limit as it was;
  the planted bug (a fresh lock per call) fails the same check.

Expected values: numpy_attn in float64 (an independent implementation) or a mod equal to the
tested one wherever it is allowed.
"""

from __future__ import annotations

import contextlib
import gc
import threading

import numpy as np
import pytest

import numpy_attn
from conformance.running import backends

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
import jax.numpy as jnp  # noqa: E402

import jax_attn  # noqa: E402
import torch_attn  # noqa: E402
from numpy_attn import _threads  # noqa: E402

# ------------------------------------------------------------------------------------------
# merge_attention: a part with lse -inf and a NaN output contributes nothing
# ------------------------------------------------------------------------------------------

_R = np.random.default_rng(3)
OUTPUTS = [_R.standard_normal((2, 3, 4)), np.full((2, 3, 4), np.nan)]
LSES = [_R.standard_normal((2, 3)), np.full((2, 3), -np.inf)]
GRAD_OUT, GRAD_LSE, SINKS = _R.standard_normal((2, 3, 4)), _R.standard_normal((2, 3)), \
    _R.standard_normal(2)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
def test_merge_ignores_a_nan_output_whose_lse_is_minus_inf(backend, with_sinks, x64_on):
    """Merging ``[O, NaN]`` with lses ``[L, -inf]`` equals merging ``[O]`` alone; the VJP is
    finite: the NaN part's gradients 0, the other part's as merged alone."""
    sinks = backend.asarray(SINKS) if with_sinks else None
    both = [backend.asarray(x) for x in OUTPUTS], [backend.asarray(x) for x in LSES]
    alone = [backend.asarray(OUTPUTS[0])], [backend.asarray(LSES[0])]
    got, want = (backend.module.merge_attention(*parts, sinks=sinks) for parts in (both, alone))
    for name, g, w in zip(("output", "lse"), got, want, strict=True):
        np.testing.assert_allclose(backend.to_numpy(g), backend.to_numpy(w), rtol=1e-12,
                                   err_msg=f"merge_attention {name} [{backend.name}]")
    cotangents = backend.asarray(GRAD_OUT), backend.asarray(GRAD_LSE)
    got = backend.module.merge_attention_vjp(*both, cotangents[0], grad_lse=cotangents[1],
                                             sinks=sinks)
    want = backend.module.merge_attention_vjp(*alone, cotangents[0], grad_lse=cotangents[1],
                                              sinks=sinks)
    for i in range(2):  # grad_outputs, grad_lses
        nan_part = backend.to_numpy(got[i][1])
        assert np.all(nan_part == 0.0), f"merge_attention_vjp [{backend.name}]: {nan_part}"
        np.testing.assert_allclose(backend.to_numpy(got[i][0]), backend.to_numpy(want[i][0]),
                                   rtol=1e-12, atol=1e-15)
    if with_sinks:
        np.testing.assert_allclose(backend.to_numpy(got[2]), backend.to_numpy(want[2]),
                                   rtol=1e-12)


# ------------------------------------------------------------------------------------------
# jax_attn's document_mod under jax.jit with the mod static
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_jax_document_mod_made_again_from_other_ids_is_not_a_cached_program():
    """Two id arrays in turn, the previous freed each time (CPython reuses its ``id``): each
    jitted call with the mod static equals numpy_attn with those ids."""
    from jax_attn import masks

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 8, 4)).astype(np.float32) for _ in range(3))
    ids_a = np.array([0, 0, 0, 1, 1, 1, 1, 1])
    ids_b = np.array([0, 1, 1, 1, 1, 1, 2, 2])
    attend = jax.jit(jax_attn.scaled_dot_product_attention, static_argnames=("mask_mod",))
    for i in range(6):
        ids = (ids_a, ids_b)[i % 2]
        segment = jnp.asarray(ids)  # freed at the end of the iteration: its id is reused
        got = attend(*(jnp.asarray(x) for x in (q, k, v)), mask_mod=masks.document_mod(segment))
        want = numpy_attn.scaled_dot_product_attention(q, k, v, segment_ids=ids)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6,
                                   err_msg=f"call {i}: ids {ids}")
        del segment
        gc.collect()


def test_document_mods_are_equal_by_contents():
    """Equal ids (other arrays): equal mods, one hash; other ids: unequal, every backend."""
    for backend in (numpy_attn, jax_attn, torch_attn):
        masks, as_array = backend.masks, backends.get(backend.__name__.split("_")[0]).asarray
        a = masks.document_mod(as_array(np.array([0, 0, 1])))
        same = masks.document_mod(as_array(np.array([0, 0, 1])))
        other = masks.document_mod(as_array(np.array([0, 1, 1])))
        assert a == same and hash(a) == hash(same), backend.__name__
        assert a != other, backend.__name__


# ------------------------------------------------------------------------------------------
# torch_attn's fast path, fully masked: in the graph, gradient 0
# ------------------------------------------------------------------------------------------

_FULL = 1024  # 2 heads x 1024 x 1024 scores >= torch_attn._fast.MIN_SCORES, q_len >= MIN_Q_LEN


@pytest.mark.parametrize("masking", ["mask_mod", "segment_ids"])
def test_torch_fast_path_fully_masked_backward_gives_zero(masking):
    from torch_attn import _fast

    assert 2 * _FULL * _FULL >= _fast.MIN_SCORES and _FULL >= _fast.MIN_Q_LEN
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, _FULL, 8, generator=g, dtype=torch.float64,
                           requires_grad=True) for _ in range(3))
    options = {"mask_mod": lambda b, h, qi, ki: qi < 0} if masking == "mask_mod" else \
        {"segment_ids": (torch.zeros(1, _FULL, dtype=torch.long),
                         torch.ones(1, _FULL, dtype=torch.long))}
    output = torch_attn.scaled_dot_product_attention(q, k, v, **options)
    assert output.requires_grad and not output.any()
    output.sum().backward()
    for name, x in zip("qkv", (q, k, v), strict=True):
        assert x.grad is not None and not x.grad.any(), name


# ------------------------------------------------------------------------------------------
# A score_mod that is NaN only where masked: gradients 0 there, never NaN
# ------------------------------------------------------------------------------------------


class _Mod:
    """``s · sqrt(q_idx - kv_idx + 1)`` (NaN above the diagonal: masked by the causal rule) or,
    ``safe``, ``s · sqrt(max(q_idx - kv_idx, 0) + 1)``: the same wherever causal allows."""

    def __init__(self, xp, safe: bool) -> None:
        self.xp, self.safe = xp, safe

    def _factor(self, q, k):
        distance = q - k
        if self.safe:
            distance = self.xp.maximum(distance, 0 * distance)
        return self.xp.sqrt(distance * 1.0 + 1.0)

    def __call__(self, s, b, h, q, k):
        return s * self._factor(q, k)

    def derivative(self, s, b, h, q, k):  # numpy_attn differentiates by hand
        return self._factor(q, k) + 0 * s


def _grads(name: str, q, k, v, g, safe: bool):
    if name == "numpy":
        with np.errstate(invalid="ignore"):
            return numpy_attn.scaled_dot_product_attention_vjp(
                q, k, v, g, is_causal=True, score_mod=_Mod(np, safe))[:3]
    if name == "jax":
        def loss(q, k, v):
            out = jax_attn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                        score_mod=_Mod(jnp, safe))
            return (out * g).sum()

        return [np.asarray(x) for x in jax.grad(loss, argnums=(0, 1, 2))(
            *(jnp.asarray(x) for x in (q, k, v)))]
    tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    out = torch_attn.scaled_dot_product_attention(*tensors, is_causal=True,
                                                  score_mod=_Mod(torch, safe))
    (out * torch.tensor(g)).sum().backward()
    return [x.grad.numpy() for x in tensors]


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("q_len", [8, 1024], ids=["small", "fast_path"])
@pytest.mark.parametrize("name", ["numpy", "jax", "torch"])
def test_score_mod_nan_only_where_masked_gives_finite_gradients(name, q_len, x64_on):
    rng = np.random.default_rng(q_len)
    q, k, v, g = (rng.standard_normal((1, 2, q_len, 8)) for _ in range(4))
    got = _grads(name, q, k, v, g, safe=False)
    want = _grads(name, q, k, v, g, safe=True)
    for axis, grad, expected in zip(("query", "key", "value"), got, want, strict=True):
        assert np.isfinite(grad).all(), f"grad_{axis} [{name}, q_len={q_len}] has NaN"
        np.testing.assert_allclose(grad, expected, rtol=1e-10, atol=1e-12,
                                   err_msg=f"grad_{axis} [{name}, q_len={q_len}]")


# ------------------------------------------------------------------------------------------
# numpy_attn's threads: concurrent calls leave the BLAS limit as it was
# ------------------------------------------------------------------------------------------


class _ProcessWideLib:
    """A BLAS library whose thread limit is process-wide (OpenBLAS with pthreads, as in
    NumPy's wheels), as threadpoolctl's controller shows it."""

    internal_api, threading_layer = "openblas", "pthreads"

    def __init__(self, threads: int) -> None:
        self.num_threads = threads


class _ProcessWideController:
    """threadpoolctl's controller, in miniature: ``limit`` saves the limit, sets it, and
    restores what it saved (so overlapping limits restored out of order leave the last
    saved value, as the real one does)."""

    def __init__(self, threads: int) -> None:
        self.lib_controllers = [_ProcessWideLib(threads)]

    @contextlib.contextmanager
    def limit(self, limits: int):
        saved = [lib.num_threads for lib in self.lib_controllers]
        for lib in self.lib_controllers:
            lib.num_threads = limits
        try:
            yield
        finally:
            for lib, threads in zip(self.lib_controllers, saved, strict=True):
                lib.num_threads = threads


class _FreshLock:
    """The planted bug: a fresh lock per call, so no call ever waits for another."""

    def __enter__(self):
        return threading.Lock().__enter__()

    def __exit__(self, *exc):
        return False


def _concurrent_calls_keep_the_limit(controller) -> None:
    """4 threads × 3 calls of the threaded path, 20 rounds; the limit after each round."""
    before = [lib.num_threads for lib in controller.lib_controllers]
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 1024, 16)).astype(np.float32) for _ in range(3))

    def calls() -> None:
        for _ in range(3):
            numpy_attn.scaled_dot_product_attention(q, k, v, is_causal=True)

    for round_ in range(20):
        threads = [threading.Thread(target=calls) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = [lib.num_threads for lib in controller.lib_controllers]
        assert after == before, f"round {round_}: BLAS limit {after}, was {before}"


@pytest.mark.slow
def test_concurrent_calls_leave_the_blas_limit(monkeypatch):
    """A process-wide limit of 4 (the controller in miniature, with 2 cores or more) and, when
    threadpoolctl finds a BLAS library, the real one."""
    from numpy_attn import _fast

    assert 1024 * 1024 >= _fast.MIN_SCORES and 1024 >= _fast.MIN_Q_LEN
    if _threads._cores() < 2:
        pytest.skip("one core: run_lanes never uses the pool")
    real = _threads._controller()
    if real is not None:
        _concurrent_calls_keep_the_limit(real)
    monkeypatch.setitem(_threads._state, "controller", _ProcessWideController(4))
    _concurrent_calls_keep_the_limit(_threads._state["controller"])


def test_a_fresh_lock_per_call_fails_the_same_check(monkeypatch):
    if _threads._cores() < 2:
        pytest.skip("one core: run_lanes never uses the pool")
    monkeypatch.setitem(_threads._state, "controller", _ProcessWideController(4))
    monkeypatch.setitem(_threads._state, "lock", _FreshLock())
    with pytest.raises(AssertionError, match="BLAS limit"):
        _concurrent_calls_keep_the_limit(_threads._state["controller"])


@pytest.mark.parametrize("sink", [np.nan, np.inf])
def test_a_nan_or_inf_sink_makes_every_row_of_its_head_nan_in_every_backend(sink: float) -> None:
    """spec.SINKS: a NaN or +inf sink gives NaN output and lse on every row of its head (a fully
    masked row too), in every backend; the other head is untouched."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float32)
               for s in ((1, 2, 2, 4), (1, 2, 3, 4), (1, 2, 3, 4)))
    mask = np.ones((1, 2, 2, 3), bool)
    mask[:, :, 1] = False  # row 1 fully masked in both heads
    sinks = np.array([sink, 0.5], np.float32)
    results = [numpy_attn.scaled_dot_product_attention(q, k, v, mask=mask, sinks=sinks,
                                                        return_lse=True),
               jax_attn.scaled_dot_product_attention(q, k, v, mask=mask,
                                                      sinks=jnp.asarray(sinks), return_lse=True),
               torch_attn.scaled_dot_product_attention(
                   *(torch.tensor(x) for x in (q, k, v)), mask=torch.tensor(mask),
                   sinks=torch.tensor(sinks), return_lse=True)]
    for out, lse in results:
        out, lse = np.asarray(out), np.asarray(lse)
        assert np.isnan(out[0, 0]).all() and np.isnan(lse[0, 0]).all()
        assert np.isfinite(out[0, 1]).all() and np.isfinite(lse[0, 1, 0])
        assert (out[0, 1, 1] == 0).all() and lse[0, 1, 1] == 0.5  # the sink's row: 0, lse sink


# ------------------------------------------------------------------------------------------
# A plugin that computes float16 in float16 (not in the compute dtype) fails a case
# ------------------------------------------------------------------------------------------


def _half_sum(terms: np.ndarray) -> np.ndarray:
    """The sum over the last axis, one float16 addition at a time (NumPy's own float16 sums and
    products accumulate in float32)."""
    total = np.zeros(terms.shape[:-1], np.float16)
    for j in range(terms.shape[-1]):
        total = (total + terms[..., j]).astype(np.float16)
    return total


def _all_half_sdpa(query, key, value, mask=None, bias=None, *, is_causal=False,  # noqa: ANN001, ANN202
                   causal_alignment="top_left", scale=None, return_lse=False,
                   return_weights=False, **options):
    """The planted bug: every step in float16 (scores, exp, the row sum, the weighted sum),
    where spec.COMPUTE_DTYPE says float32; the lse cast to float32 at the end, as the spec's
    dtypes ask, so only the values can tell."""
    half = np.float16
    q, k, v = (np.asarray(x).astype(half) for x in (query, key, value))
    if q.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        k, v = (np.repeat(x, q.shape[-3] // x.shape[-3], axis=-3) for x in (k, v))
    scale = half(1.0 / np.sqrt(q.shape[-1]) if scale is None else scale)
    scores = (_half_sum(q[..., :, None, :] * k[..., None, :, :]) * scale).astype(half)
    if bias is not None:
        scores = (scores + np.asarray(bias).astype(half)).astype(half)
    allowed = np.ones(scores.shape[-2:], bool)
    if is_causal:
        q_len, kv_len = scores.shape[-2:]
        allowed = np.tril(allowed, k=kv_len - q_len if causal_alignment == "bottom_right" else 0)
    if mask is not None:
        allowed = allowed & np.asarray(mask)
    scores = np.where(allowed, scores, half(-np.inf))
    row_max = scores.max(axis=-1, keepdims=True)
    shift = np.where(np.isfinite(row_max), row_max, half(0))
    exp = np.exp((scores - shift).astype(half)).astype(half)
    total = _half_sum(exp)[..., None]
    weights = (exp / np.where(total > 0, total, half(1))).astype(half)
    out = _half_sum(np.swapaxes(weights[..., :, :, None] * v[..., None, :, :], -1, -2))
    extra = [weights.astype(query.dtype)] if return_weights else []
    if return_lse:
        with np.errstate(divide="ignore"):
            extra.append((np.log(total[..., 0]) + shift[..., 0]).astype(np.float32))
    out = out.astype(query.dtype)
    return (out, *extra) if extra else out


def test_a_plugin_computing_float16_in_float16_fails_the_long_keys_case():
    """No case of the common shape (7 keys) tells a float16 accumulation from the float32 one
    (the naive baseline rounds every intermediate to float16 too); combined_long_keys' 384 keys
    do, by a clear margin (3.5x the bound when written), in float16 only."""
    import types

    from conformance.running import runner

    module = types.ModuleType("fake_all_half")
    module.scaled_dot_product_attention = _all_half_sdpa
    backends.register(backends.from_module(module, name="fake_all_half"))
    try:
        result = runner.run(["fake_all_half"], ["combined_long_keys"], ["float16"],
                            check_errors=False, hypothesis=0)
        [cell] = result.cells
        assert cell.status == "FAIL", cell
        self_case = runner.run(["fake_all_half"], ["self", "bias"], ["float16"],
                               check_errors=False, hypothesis=0)
        assert all(c.status == "ok" for c in self_case.cells)  # the common shape cannot tell
    finally:
        backends.unregister("fake_all_half")


# ------------------------------------------------------------------------------------------
# The ready-made score mods' arrays are constants (spec.SCORE_MOD), on every path
# ------------------------------------------------------------------------------------------


def _mod_inputs(tokens: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(tokens)
    q, k, v, g = (rng.standard_normal((1, 2, tokens, 16)) for _ in range(4))
    return q, k, v, g, rng.standard_normal((2, 9)), rng.uniform(0.1, 1.0, 2)


@pytest.mark.parametrize("tokens", [8, 512], ids=["explicit", "fast_path"])
def test_torch_ready_made_mods_give_their_arrays_no_gradient(tokens):
    """A table (slopes) requiring grad given to relative_bias_mod (alibi_mod): no gradient, at
    the explicit steps' size and the fast path's, the output that of the plain tensor."""
    q, k, v, g, table, slopes = (torch.tensor(x, dtype=torch.float32)
                                 for x in _mod_inputs(tokens))
    masks = torch_attn.masks
    for make, array in ((masks.relative_bias_mod, table), (masks.alibi_mod, slopes)):
        learned = array.clone().requires_grad_(True)
        value = v.clone().requires_grad_(True)
        out = torch_attn.scaled_dot_product_attention(q, k, value, score_mod=make(learned))
        (out * g).sum().backward()
        assert learned.grad is None or not learned.grad.any(), (make, tokens, learned.grad)
        assert value.grad is not None  # the inputs still get theirs
        plain = torch_attn.scaled_dot_product_attention(q, k, v, score_mod=make(array))
        torch.testing.assert_close(out.detach(), plain, rtol=0, atol=0)


@pytest.mark.parametrize("tokens", [8, 512], ids=["explicit", "fast_path"])
def test_jax_ready_made_mods_give_their_arrays_no_gradient(tokens):
    """jax.grad with respect to the table (slopes) of relative_bias_mod (alibi_mod): zeros, at
    both sizes, the output that of the constant array."""
    q, k, v, g, table, slopes = (jnp.asarray(x, jnp.float32) for x in _mod_inputs(tokens))
    masks = jax_attn.masks
    for make, array in ((masks.relative_bias_mod, table), (masks.alibi_mod, slopes)):
        def loss(learned, make=make):  # noqa: ANN001, ANN202
            out = jax_attn.scaled_dot_product_attention(q, k, v, score_mod=make(learned))
            return jnp.sum(out * g)

        grad = np.asarray(jax.grad(loss)(array))
        assert grad.shape == array.shape and not grad.any(), (make, tokens, grad)
        np.testing.assert_array_equal(float(loss(array)), float(jnp.sum(
            jax_attn.scaled_dot_product_attention(q, k, v, score_mod=make(array)) * g)))


def test_ready_made_score_mods_are_equal_by_contents():
    """Like document_mod: a mod made again from an equal array is equal (the same static
    argument under a JIT), one made from other values is not."""
    for masks, asarray in ((numpy_attn.masks, np.asarray), (jax_attn.masks, jnp.asarray),
                           (torch_attn.masks, torch.tensor)):
        table = np.arange(18.0).reshape(2, 9)
        first, again = (masks.relative_bias_mod(asarray(table)) for _ in range(2))
        assert first == again and hash(first) == hash(again)
        assert masks.relative_bias_mod(asarray(table + 1)) != first
        assert masks.alibi_mod(asarray([0.5, 0.25])) == masks.alibi_mod(asarray([0.5, 0.25]))
        assert masks.alibi_mod(asarray([0.5, 0.25])) != masks.alibi_mod(asarray([0.5, 0.5]))
