"""blockwise_attention (online softmax in tiles) and its VJP, on every backend.

Inputs are the harness's named, seeded cases (``conformance.cases``) that blockwise attention
expresses (``expected.blockwise_applies``: masks only as structure or ``kv_lengths``, no dropout),
plus ``all_features``, one more seeded case that combines every option at once. Expected values,
exact zeros and unspecified positions come from ``conformance.cases.expected`` (the float64
``conformance.cases.reference`` and its VJP), judged by the harness's one tolerance rule
(``conformance.comparing.compare``); never from the blockwise code or any backend's own plain path.

In bfloat16 the gradients are also held to the spec's precision rule (computed in float32,
rounded once to the input dtype: ``_assert_computed_in_float32``): the half dtype's tolerance
scales with the error of a pipeline that rounds every intermediate to the half dtype, so it
also admits a backward pass computed in bfloat16 (such a pass reaches about 0.6 of that bound
and 70 times the precision rule's).
"""

from __future__ import annotations

import functools
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

from conformance.cases import catalogue as cases
from conformance.cases import expected, mods
from conformance.comparing import compare
from conformance.running import backends

TILES = cases.BLOCKWISE_TILES  # block_q 2, block_kv 3: neither divides 5 or 7
BLOCKWISE_OPTIONS = ("bias", "kv_lengths", "sinks")


def _all_features(rng: np.random.Generator) -> cases.CaseData:
    """GQA (4 over 2 heads), v_dim 3, a bias broadcast over heads, kv_lengths, causal
    bottom-right, a window, a scale and a soft-cap, at the cases' shape (2, 4, 5, 7, 8)."""
    b, h, tq, tk, d = cases.B, cases.H, cases.TQ, cases.TK, cases.D
    kv_lengths = np.array([6, 2])
    arrays = {
        "query": rng.standard_normal((b, h, tq, d)),
        "key": rng.standard_normal((b, 2, tk, d)),
        "value": rng.standard_normal((b, 2, tk, 3)),
        "bias": rng.standard_normal((b, 1, tq, tk)),
        "kv_lengths": kv_lengths,
        "mask": (np.arange(tk) < kv_lengths[:, None])[:, None, None, :],  # (B, 1, 1, TK)
    }
    options = {"softcap": 1.5, "is_causal": True, "causal_alignment": "bottom_right",
               "window": (3, 0), "scale": 0.5}
    return cases.CaseData(arrays, options)


ALL_FEATURES = cases.Case("all_features", "every blockwise option at once", _all_features)
CASES = {c.name: c for c in cases.CASES  # chunks, ALiBi, ids, mods: test_masks_and_mods.py
         if c.kind == "sdpa" and expected.blockwise_applies(c.data())
         and not mods.uses_mods(c.data())}
CASES[ALL_FEATURES.name] = ALL_FEATURES
GRAD_CASES = ("causal_bottom_right_q_longer", "window_causal_bottom_right", "bias", "kv_lengths",
              "mqa", "softcap", "all_features")


@functools.cache
def _expected(name: str, dtype: str, gradients: bool = False) -> expected.Expected:
    """The float64 expected values of case ``name`` with its inputs cast to ``dtype`` (once
    for every backend)."""
    return expected.expected_for(cases.prepare_inputs(CASES[name], dtype), "sdpa", dtype, name,
                                 gradients=gradients)


def _kwargs(backend: backends.Backend, data: cases.CaseData) -> dict:
    """blockwise_attention's keyword arguments for ``data``: its options, bias, kv_lengths."""
    kw = cases.sdpa_options(data.options)
    kw.update({n: backend.asarray(data.arrays[n]) for n in BLOCKWISE_OPTIONS if n in data.arrays})
    return kw


def _blockwise(backend: backends.Backend, data: cases.CaseData, **tiles: int) -> np.ndarray:
    qkv = (backend.asarray(data.arrays[n]) for n in ("query", "key", "value"))
    return backend.to_numpy(backend.module.blockwise_attention(*qkv, **_kwargs(backend, data),
                                                               **tiles))


def _blockwise_vjp(backend: backends.Backend, data: cases.CaseData, **tiles: int) -> list:
    args = (backend.asarray(data.arrays[n]) for n in ("query", "key", "value", "grad_output"))
    grads = backend.module.blockwise_attention_vjp(*args, **_kwargs(backend, data), **tiles)
    return [None if g is None else backend.to_numpy(g) for g in grads]


def _assert_conforms(exp: expected.Expected, step: str, actual: np.ndarray, backend: str,
                     what: str = "") -> None:
    """The harness's rule: ``compare_step`` against the float64 expected value of ``step``;
    the result must have the input dtype."""
    res = compare.compare_step(exp, step, actual, "input")
    assert res.passed, (
        f"{step}: {res.ratio:.3g} × tolerance at {res.index} (got {res.actual}, expected "
        f"{res.expected}, bound {res.bound}) {res.note} [{backend} vs float64 reference, "
        f"case={exp.case}, dtype={exp.dtype}{what}]")


# ------------------------------------------------------------------------------ forward


# inf - inf on inf_key is the spec's IEEE rule at work (numpy_attn warns from its threads)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", ["numpy", pytest.param("jax", marks=pytest.mark.slow),
                                     "torch"], indirect=True)  # jax: a compile per case
def test_matches_reference(backend, case):
    exp = _expected(case, "float64")
    got = _blockwise(backend, exp.data, **TILES)
    _assert_conforms(exp, "blockwise_output", got, backend.name)


@pytest.mark.parametrize(("block_q", "block_kv"), [(1, 1), (5, 7), (4, 2), (64, 64)])
def test_block_sizes(backend, block_q, block_kv):
    exp = _expected("all_features", "float64")
    got = _blockwise(backend, exp.data, block_q=block_q, block_kv=block_kv)
    _assert_conforms(exp, "blockwise_output", got, backend.name, f", tiles={block_q}x{block_kv}")


@pytest.mark.parametrize("dtype", backends.DTYPES)
def test_dtypes(backend, dtype):
    exp = _expected("all_features", dtype)
    got = _blockwise(backend, exp.data, **TILES)
    assert got.dtype == exp.data.arrays["query"].dtype, "returns the input dtype"
    _assert_conforms(exp, "blockwise_output", got, backend.name)


def test_fully_masked_rows_are_exactly_zero(backend):
    # bottom-right, 7 queries over 5 keys: queries 0 and 1 see no key; sequence 1 has no key
    data = cases.prepare_inputs(cases.get("causal_bottom_right_q_longer"), "float64")
    kv_lengths = np.array([5, 0])
    data.arrays["kv_lengths"] = kv_lengths
    data.arrays["mask"] = (np.arange(5) < kv_lengths[:, None])[:, None, None, :]  # (B, 1, 1, 5)
    exp = expected.expected_for(data, "sdpa", "float64", "causal_bottom_right_q_longer",
                                gradients=False)
    got = _blockwise(backend, exp.data, block_q=2, block_kv=2)
    _assert_conforms(exp, "blockwise_output", got, backend.name, ", kv_lengths=[5, 0]")
    assert not np.isnan(got).any()
    assert (got[:, :, :2] == 0).all() and (got[1] == 0).all()
    assert (got[0, :, 2:] != 0).any()


def test_empty_axes(backend):
    q = np.zeros((1, 2, 0, 4))
    k = np.ones((1, 2, 3, 4))
    fn = backend.module.blockwise_attention
    got = backend.to_numpy(fn(backend.asarray(q), backend.asarray(k), backend.asarray(k)))
    assert got.shape == (1, 2, 0, 4)
    one = backend.asarray(np.ones((1, 2, 3, 4)))
    got = backend.to_numpy(fn(one, backend.asarray(q), backend.asarray(q)))
    assert got.shape == (1, 2, 3, 4) and (got == 0).all()  # no key at all: fully masked rows


def test_validation(backend):
    fn = backend.module.blockwise_attention
    x = backend.asarray(np.ones((2, 1, 3, 4)))
    with pytest.raises(ValueError, match=r"blockwise_attention: kv_lengths must be ints shaped"):
        fn(x, x, x, kv_lengths=backend.asarray(np.array([1, 2, 3])))
    with pytest.raises(ValueError, match=r"kv_lengths must lie in \[0, 3\]"):
        fn(x, x, x, kv_lengths=backend.asarray(np.array([1, 4])))
    with pytest.raises(ValueError, match=r"block_q must be an int >= 1; got block_q=0"):
        fn(x, x, x, block_q=0)
    with pytest.raises(ValueError, match=r"blockwise_attention: bias must be broadcastable"):
        fn(x, x, x, bias=backend.asarray(np.ones((5, 3))))
    with pytest.raises(ValueError, match="causal_alignment must be"):
        fn(x, x, x, causal_alignment="left")
    with pytest.raises(TypeError, match="blockwise_attention: inputs must share one dtype"):
        fn(x, x, backend.asarray(np.ones((2, 1, 3, 4), np.float32)))


def test_plan_skips_masked_tiles():
    from attention_rules import band as _band
    from attention_rules import plan as _plan

    lo, hi = _band(1024, 1024, True, "top_left", None)
    tiles = sum(len(blocks) for *_, blocks in _plan(1024, 1024, 128, 128, lo, hi))
    assert tiles == 8 * 9 // 2  # the causal lower triangle of 8 × 8 tiles, diagonal included
    lo, hi = _band(1024, 1024, False, "top_left", (128, 0))
    plan = _plan(1024, 1024, 128, 128, lo, hi)
    assert sum(len(blocks) for *_, blocks in plan) == 8 + 7  # a band two tiles wide
    assert all(partial for *_, blocks in plan for _, _, partial in blocks)


def test_numpy_extra_memory_is_a_few_tiles():
    import numpy_attn

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 4096, 16), dtype=np.float32) for _ in range(3))
    tracemalloc.start()
    try:
        numpy_attn.blockwise_attention(q, k, v, is_causal=True, block_q=256, block_kv=256)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the plain scores would be 4096² × 4 B = 64 MiB; a tile is 256 KiB, the output 256 KiB
    assert peak < 4 * 2**20, f"peak {peak / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------ gradients


def _assert_grads_conform(backend, exp, grads, step_prefix):
    for name, grad in zip(("query", "key", "value", "bias"), grads, strict=True):
        step = f"grad_{name}"
        if step not in exp.values:
            assert grad is None, f"{name}: gradient without a bias"
            continue
        assert grad.dtype == exp.data.arrays["query"].dtype, f"d{name}: not the input dtype"
        _assert_conforms(exp, step_prefix + step, grad, backend.name)


@pytest.mark.parametrize("case", GRAD_CASES)
def test_vjp_matches_reference_vjp(backend, case):
    exp = _expected(case, "float64", gradients=True)
    grads = _blockwise_vjp(backend, exp.data, **TILES)
    _assert_grads_conform(backend, exp, grads, "blockwise_")


@pytest.mark.parametrize("dtype", ["float32"])  # float64: above, every gradient case
def test_vjp_in_float32_matches_reference_vjp(backend, dtype):
    exp = _expected("all_features", dtype, gradients=True)
    grads = _blockwise_vjp(backend, exp.data, block_q=2, block_kv=4)
    _assert_grads_conform(backend, exp, grads, "blockwise_")


def _assert_computed_in_float32(exp: expected.Expected, step: str, actual: np.ndarray,
                                backend: str) -> None:
    """The spec's precision rule (``spec.PRECISION``) for a half dtype: computed in float32,
    rounded once to the input dtype. Against the float64 reference of the same inputs, the error
    stays within the float32 bound (``compare.bound``: float32's ``atol`` and ``k``, ``e`` the
    naive float32 error on these very inputs) plus the one rounding, ``eps·|ref|`` (at least one
    unit in the last place of the dtype, twice the worst rounding). The half dtype's own bound
    (``k·e``, ``e`` the error of rounding every intermediate to the dtype) would also admit a
    pipeline computed in the half dtype."""
    arrays = {n: a if a.dtype.kind in "biu" else a.astype(np.float32)
              for n, a in exp.data.arrays.items()}  # the same values, exactly
    in_float32 = expected.expected_for(cases.CaseData(arrays, exp.data.options), "sdpa",
                                       "float32", exp.case)
    ref = exp.values[step]
    eps = float(ml_dtypes.finfo(backends.numpy_dtype(exp.dtype)).eps)
    bound = compare.bound(ref, in_float32.baseline[step], "float32") + eps * np.abs(ref)
    ratio = np.abs(actual.astype(np.float64) - ref) / bound
    worst = np.unravel_index(np.argmax(ratio), ratio.shape)
    assert ratio[worst] <= 1.0, (
        f"{step}: {ratio[worst]:.3g} × (float32 bound + one rounding to {exp.dtype}) at {worst} "
        f"(got {actual[worst]}, expected {ref[worst]}) [{backend} vs float64 reference, "
        f"case={exp.case}]: not computed in float32")


def test_vjp_half_precision(backend):
    """bfloat16 is not among ``expected.BLOCKWISE_GRAD_DTYPES`` (the harness does not compile
    it): its blockwise gradients are held here to the float64 reference, under the harness's
    rule and under the precision rule (computed in float32, rounded once)."""
    exp = _expected("causal_bottom_right", "bfloat16", gradients=True)
    grads = _blockwise_vjp(backend, exp.data, **TILES)
    _assert_grads_conform(backend, exp, grads, "")
    for name, grad in zip(("query", "key", "value"), grads, strict=False):
        _assert_computed_in_float32(exp, f"grad_{name}", grad, backend.name)


# ------------------------------------------------------------------------------ JAX


def test_jax_jits_once_and_differentiates():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import jax_attn

    traces = []

    @jax.jit
    def loss(q, k, v, lengths):
        traces.append(1)
        out = jax_attn.blockwise_attention(q, k, v, kv_lengths=lengths, is_causal=True,
                                           block_q=2, block_kv=3)
        return (out**2).sum(), out

    data = cases.prepare_inputs(cases.get("kv_lengths"), "float32")  # kv_lengths [4, 0]
    data.options["is_causal"] = True
    exp = expected.expected_for(data, "sdpa", "float32", "kv_lengths", gradients=False)
    q, k, v = (data.arrays[n] for n in ("query", "key", "value"))
    first, out = loss(q, k, v, jnp.asarray(data.arrays["kv_lengths"]))
    loss(q + 1, k, v, jnp.asarray(np.array([2, 5])))  # other values, same shapes
    assert len(traces) == 1, "compiled once for one set of shapes"
    _assert_conforms(exp, "blockwise_output", np.asarray(out), "jax", ", under jax.jit")
    np.testing.assert_allclose(float(first), float((np.asarray(out, np.float64) ** 2).sum()),
                               rtol=1e-5)
    grad = jax.jit(jax.grad(lambda *a: loss(*a)[0], argnums=(0, 1, 2)))
    grads = grad(q, k, v, jnp.asarray(data.arrays["kv_lengths"]))
    # d(Σ out²) is the VJP against 2·out: the float64 reference's, with 2·out in float32
    cotangent = (2 * exp.values["output"]).astype(np.float32)
    with_grad = cases.CaseData({**data.arrays, "grad_output": cotangent}, data.options)
    exp = expected.expected_for(with_grad, "sdpa", "float32", "kv_lengths")
    for name, g in zip(("query", "key", "value"), grads, strict=True):
        _assert_conforms(exp, f"blockwise_grad_{name}", np.asarray(g), "jax", ", jax.grad")
