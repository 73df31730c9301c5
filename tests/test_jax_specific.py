"""What a JAX user expects of jax_attn beyond the backend-generic tests.

jit, vmap and grad (against central finite differences of numpy_attn in float64), no retracing,
half precision under jit on CPU, modules as pytrees, weights round trips with numpy_attn, the
article's numbers, the jax.nn fast path's selection, and identical errors to numpy_attn.

Expected values come from ``conformance.reference`` (an independent float64 implementation),
numpy_attn in float64, finite differences or the article's published numbers; never from
jax_attn itself. Shapes are shared and small, since every new shape is a new XLA compilation.
"""

from __future__ import annotations

import ast
import functools
import math
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import attention_rules  # noqa: E402
import jax_attn as ja  # noqa: E402
import numpy_attn as na  # noqa: E402
from conformance import compare, expected, reference, seed_example, spec  # noqa: E402
from conformance.cases import CaseData  # noqa: E402
from jax_attn import _fast  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HALF = ("bfloat16", "float16")

# One set of shapes for most tests: batch 2, 4 query heads over 2 kv heads (GQA), 5 queries,
# 6 keys, head_dim 8, v_dim 3.
_R = np.random.default_rng(20261130)
Q = _R.standard_normal((2, 4, 5, 8))
K = _R.standard_normal((2, 2, 6, 8))
V = _R.standard_normal((2, 2, 6, 3))
BIAS = _R.standard_normal((4, 5, 6))
MASK = _R.random((2, 1, 5, 6)) > 0.3
MASK[0, 0, 2] = False  # a fully masked row: batch 0, query 2, every head
MASK[1, 0, :, 0] = True
KEEP = _R.random((2, 4, 5, 6)) > 0.25

CONFIGS = {
    "plain": {},
    "causal_top_left": {"is_causal": True},
    "causal_bottom_right": {"is_causal": True, "causal_alignment": "bottom_right"},
    "window": {"window": (1, 2)},
    "window_bottom_right_causal": {
        "is_causal": True, "causal_alignment": "bottom_right", "window": (2, None)
    },
    "mask_bias_softcap": {"mask": MASK, "bias": BIAS, "softcap": 2.5, "scale": 0.7},
    "dropout_mask": {"mask": MASK, "dropout_p": 0.25, "dropout_mask": KEEP},
}
ARRAY_KWARGS = ("mask", "bias", "dropout_mask")


def _split(config):
    """(array kwargs, static kwargs) of a config."""
    arrays = {k: v for k, v in config.items() if k in ARRAY_KWARGS}
    static = {k: v for k, v in config.items() if k not in ARRAY_KWARGS}
    return arrays, static


def _ref(query, key, value, **config):
    return reference.attention(query, key, value, **config)


def _f64(x):
    return np.asarray(x, dtype=np.float64)


@functools.cache
def _jitted(static_items):
    """One jitted SDPA per set of static options (cached: compiled once per shape)."""
    return jax.jit(functools.partial(ja.scaled_dot_product_attention, **dict(static_items)))


def _assert_matches_reference(actual, step, dtype, arrays, **options):
    """The harness's one tolerance rule (``conformance.compare``: ``spec.TOLERANCES`` scaled by
    a naive implementation's error in ``dtype``) against the float64 reference."""
    data = CaseData({n: np.asarray(a) for n, a in arrays.items()}, options)
    exp = expected.expected_for(data, "sdpa", dtype, gradients=False)
    result = compare.compare_step(exp, step, np.asarray(actual), "input")
    assert result.passed, (
        f"{step}: |diff| {result.ratio:.3g} × tolerance at {result.index} {result.note} "
        f"[dtype={dtype}, options={options}]"
    )


def _assert_no_nan(*arrays):
    for array in arrays:
        assert not np.isnan(_f64(array)).any()


# ------------------------------------------------------------------------------ jit / vmap


@pytest.mark.parametrize("name", list(CONFIGS))
def test_jit_equals_eager_and_reference(name):
    arrays, static = _split(CONFIGS[name])
    eager_out, eager_w = ja.scaled_dot_product_attention(
        Q, K, V, return_weights=True, **arrays, **static
    )
    fn = _jitted(tuple(sorted({**static, "return_weights": True}.items())))
    jit_out, jit_w = fn(jnp.asarray(Q), jnp.asarray(K), jnp.asarray(V), **arrays)
    np.testing.assert_allclose(jit_out, eager_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(jit_w, eager_w, rtol=1e-12, atol=1e-12)
    expected = _ref(Q, K, V, **CONFIGS[name])
    np.testing.assert_allclose(jit_out, expected.output, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(jit_w, expected.weights, rtol=1e-10, atol=1e-10)


def test_fully_masked_row_is_exactly_zero_under_jit():
    out, weights = _jitted((("return_weights", True),))(Q, K, V, mask=MASK)
    assert np.all(np.asarray(out)[0, :, 2] == 0.0)
    assert np.all(np.asarray(weights)[0, :, 2] == 0.0)
    # jax.nn.dot_product_attention gives mean(value) there: the reason for the explicit path.
    v_wide = np.concatenate([V] * 3, -1)[..., :8]  # jax.nn needs v_dim == head_dim
    bthd = [jnp.swapaxes(jnp.asarray(x), 1, 2) for x in (Q, K, v_wide)]
    theirs = jax.nn.dot_product_attention(*bthd, mask=jnp.asarray(MASK), implementation="xla")
    assert np.abs(np.asarray(theirs)[0, 2]).max() > 0.0


def test_vmap_over_batch_equals_batched_call():
    mapped = jax.vmap(functools.partial(ja.scaled_dot_product_attention, is_causal=True))
    np.testing.assert_allclose(
        mapped(Q, K, V), ja.scaled_dot_product_attention(Q, K, V, is_causal=True), rtol=1e-12
    )
    # mask mapped along the batch, bias shared (in_axes None), weights returned
    mapped = jax.vmap(
        lambda q, k, v, m, b: ja.scaled_dot_product_attention(
            q, k, v, mask=m, bias=b, return_weights=True
        ),
        in_axes=(0, 0, 0, 0, None),
    )
    out, weights = mapped(Q, K, V, MASK, BIAS)
    expected = _ref(Q, K, V, mask=MASK, bias=BIAS)
    np.testing.assert_allclose(out, expected.output, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(weights, expected.weights, rtol=1e-10, atol=1e-10)


def test_vmap_of_step_functions_and_masks():
    scores = jax.vmap(ja.attention_scores)(Q[:, 0], K[:, 0])  # per-example (q_len, head_dim)
    np.testing.assert_allclose(scores, _ref(Q[:, 0], K[:, 0], V[:, 0]).scores, rtol=1e-12)
    lengths = jnp.asarray([3, 6], dtype=jnp.int32)
    masks = jax.vmap(lambda n: ja.padding_mask(n[None], 6))(lengths)  # traced lengths
    np.testing.assert_array_equal(masks[:, 0, 0, 0], np.arange(6)[None, :] < np.array([[3], [6]]))


def test_no_retracing_for_same_shapes():
    traces = []

    @functools.partial(jax.jit, static_argnames=("is_causal",))
    def attend(q, k, v, mask, is_causal=False):
        traces.append(q.shape)  # runs at trace time only
        return ja.scaled_dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)

    attend(Q, K, V, MASK)
    attend(Q + 1.0, K * 2.0, V, ~MASK)
    assert len(traces) == 1
    attend(Q, K, V, MASK, is_causal=True)  # a new static option: one new trace
    attend(Q - 1.0, K, V, MASK, is_causal=True)
    assert len(traces) == 2
    attend(Q[:1], K[:1], V[:1], MASK[:1])  # a new shape: one new trace
    assert len(traces) == 3


def test_mask_builders_under_jit():
    causal = jax.jit(ja.causal_mask, static_argnums=(0, 1), static_argnames=("offset",))
    np.testing.assert_array_equal(causal(2, 4, offset=2), [[1, 1, 1, 0], [1, 1, 1, 1]])
    window = jax.jit(ja.sliding_window_mask, static_argnums=(0, 1, 2))
    np.testing.assert_array_equal(window(3, 3, (1, 0)), [[1, 0, 0], [1, 1, 0], [0, 1, 1]])
    padding = jax.jit(ja.padding_mask, static_argnames=("kv_len", "q_len"))
    got = padding(np.array([2, 0]), kv_len=3, q_lengths=np.array([1, 2]), q_len=2)
    np.testing.assert_array_equal(got[0, 0], [[1, 1, 0], [0, 0, 0]])
    np.testing.assert_array_equal(got[1, 0], [[0, 0, 0], [0, 0, 0]])
    assert ja.causal_mask(2, 2, device="cpu").devices() == {jax.devices("cpu")[0]}
    with pytest.raises(ValueError, match="device"):
        ja.causal_mask(2, 2, device="no-such-platform")


# ------------------------------------------------------------------------------ gradients

GQ = _R.standard_normal((1, 2, 3, 4))
GK = _R.standard_normal((1, 1, 4, 4))
GV = _R.standard_normal((1, 1, 4, 3))
GBIAS = _R.standard_normal((1, 2, 3, 4))
GMASK = np.ones((1, 1, 3, 4), dtype=bool)
GMASK[0, 0, 1] = False  # query 1 sees no key
GMASK[0, 0, 2, 3] = False
GCOT = _R.standard_normal((1, 2, 3, 3))  # cotangent of the output

GRAD_CONFIGS = {
    "causal_bottom_right": {"is_causal": True, "causal_alignment": "bottom_right"},
    "window": {"window": (1, 1)},
    "softcap": {"softcap": 1.5, "scale": 1.3},
    "fully_masked_row": {"mask": GMASK},
    "causal_top_left_dropout_mask": {
        "is_causal": True, "dropout_p": 0.5, "dropout_mask": GMASK[..., ::-1, :]
    },
}


def _loss(sdpa, config):
    def loss(q, k, v, bias):
        return (sdpa(q, k, v, bias=bias, **config) * GCOT).sum()

    return loss


@pytest.mark.parametrize("name", list(GRAD_CONFIGS))
def test_grad_matches_central_differences_of_numpy_attn(name):
    config = GRAD_CONFIGS[name]
    grads = jax.grad(_loss(ja.scaled_dot_product_attention, config), argnums=(0, 1, 2, 3))(
        GQ, GK, GV, GBIAS
    )
    loss_np = _loss(na.scaled_dot_product_attention, config)
    args = [GQ, GK, GV, GBIAS]
    directions = np.random.default_rng(7)
    eps = 1e-6
    for index, grad in enumerate(grads):
        grad = np.asarray(grad)
        assert grad.shape == args[index].shape and np.isfinite(grad).all()
        for _ in range(3):  # directional derivatives along random directions
            d = directions.standard_normal(args[index].shape)
            plus, minus = list(args), list(args)
            plus[index], minus[index] = args[index] + eps * d, args[index] - eps * d
            fd = (loss_np(*plus) - loss_np(*minus)) / (2 * eps)
            np.testing.assert_allclose((grad * d).sum(), fd, rtol=1e-6, atol=1e-8, err_msg=name)


def test_fully_masked_row_gradient_is_exactly_zero():
    loss = _loss(ja.scaled_dot_product_attention, {"mask": GMASK})
    gq, gk, gv, gbias = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(GQ, GK, GV, GBIAS)
    assert np.all(np.asarray(gq)[0, :, 1] == 0.0)
    assert np.all(np.asarray(gbias)[0, :, 1] == 0.0)
    assert np.all(np.asarray(gbias)[0, :, 2, 3] == 0.0)  # a single masked position
    for g in (gq, gk, gv, gbias):
        assert np.isfinite(np.asarray(g)).all()
    # every key masked for every query: all gradients exactly 0, no NaN
    nothing = np.zeros_like(GMASK)
    grads = jax.grad(_loss(ja.scaled_dot_product_attention, {"mask": nothing}), (0, 1, 2, 3))(
        GQ, GK, GV, GBIAS
    )
    assert all(np.all(np.asarray(g) == 0.0) for g in grads)


def test_step_function_gradients_are_finite_on_empty_rows():
    scores = jnp.asarray(GBIAS)

    def loss(s):
        masked = ja.mask_scores(s, mask=GMASK, is_causal=True)
        weights = ja.attention_weights(masked)
        renorm = ja.renormalized_causal_weights(weights, causal_alignment="bottom_right")
        return (weights * renorm).sum()

    grad = np.asarray(jax.grad(loss)(scores))
    assert np.isfinite(grad).all()
    assert np.all(grad[0, :, 1] == 0.0)


@pytest.mark.parametrize("dtype", HALF)
def test_half_gradients_are_finite_under_jit(dtype):
    loss = _loss(ja.scaled_dot_product_attention, {"mask": GMASK})
    args = [jnp.asarray(a, dtype) for a in (GQ, GK, GV, GBIAS)]
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    for g, a in zip(grads, args, strict=True):
        assert g.dtype == a.dtype and np.isfinite(_f64(g)).all()


# ------------------------------------------------------------------------------ dtypes, precision


@pytest.mark.parametrize("dtype", HALF + ("float32",))
def test_dtypes_under_jit(dtype):
    arrays = [jnp.asarray(x, dtype) for x in (Q, K, V)]
    bias = jnp.asarray(BIAS, dtype)
    out, weights = _jitted((("is_causal", True), ("return_weights", True)))(
        *arrays, mask=MASK, bias=bias
    )
    assert out.dtype == jnp.dtype(dtype) and weights.dtype == jnp.dtype(dtype)
    inputs = {"query": arrays[0], "key": arrays[1], "value": arrays[2], "mask": MASK, "bias": bias}
    _assert_matches_reference(out, "output", dtype, inputs, is_causal=True)
    _assert_matches_reference(weights, "output_weights", dtype, inputs, is_causal=True)
    assert np.all(_f64(out)[0, :, 2] == 0.0)
    scores = jax.jit(ja.attention_scores)(arrays[0], arrays[1])
    assert scores.dtype == jnp.dtype("float32" if dtype in HALF else dtype)


def _dot_precisions(jaxpr):
    """Precision of every dot_general in a jaxpr, nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None:
                found += _dot_precisions(getattr(inner, "jaxpr", inner))
    return found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_explicit_path_pins_highest_precision(dtype):
    q, k, v = (jnp.asarray(x, dtype) for x in (Q, K, V))
    module = ja.SelfAttention(8, 4, 3, rng=jax.random.key(0))
    for fn, args in [
        (lambda q, k, v: ja.scaled_dot_product_attention(q, k, v, mask=MASK), (q, k, v)),
        (module, (q[0, 0],)),
    ]:
        with jax.default_matmul_precision("bfloat16"):
            precisions = _dot_precisions(jax.make_jaxpr(fn)(*args).jaxpr)
        highest = jax.lax.Precision.HIGHEST
        assert precisions and all(p == (highest, highest) for p in precisions), precisions


# ------------------------------------------------------------------------------ dropout


def test_dropout_needs_a_key_and_is_deterministic_per_key():
    with pytest.raises(ValueError, match="rng"):
        ja.scaled_dot_product_attention(Q, K, V, dropout_p=0.5)
    with pytest.raises(ValueError, match="rng"):
        ja.apply_dropout(jnp.ones((2, 3)), 0.5)
    weights = jnp.full((64, 64), 0.5)
    fn = jax.jit(ja.apply_dropout, static_argnums=(1,))
    a = np.asarray(fn(weights, 0.25, rng=jax.random.key(1)))
    b = np.asarray(fn(weights, 0.25, rng=jax.random.key(1)))
    c = np.asarray(fn(weights, 0.25, rng=jax.random.PRNGKey(2)))  # legacy uint32 keys work too
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert set(np.unique(a)) <= {0.0, 0.5 / 0.75}
    assert abs((a == 0).mean() - 0.25) < 0.05  # 4096 draws: 6 standard deviations
    # an explicit keep-mask gives exactly the reference's result
    out = ja.scaled_dot_product_attention(Q, K, V, dropout_p=0.25, dropout_mask=KEEP)
    expected = _ref(Q, K, V, dropout_p=0.25, dropout_mask=KEEP)
    np.testing.assert_allclose(out, expected.output, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------ fast path

FAST_CASES = [
    # (dtype, q_shape, k_shape, v_shape, options, backend, expected)
    ("bfloat16", (2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8), {}, "gpu", True),
    ("float16", (4, 6, 8), (4, 6, 8), (4, 6, 8), {"is_causal": True}, "gpu", True),
    ("float16", (6, 8), (6, 8), (6, 8), {"window": (2, 0)}, "gpu", True),
    ("bfloat16", (6, 8), (6, 8), (6, 8), {"window": (None, 0)}, "gpu", True),
    ("bfloat16", (3, 2, 6, 8), (3, 1, 6, 8), (3, 1, 6, 8),
     {"is_causal": True, "window": (2, 3)}, "gpu", True),
    ("bfloat16", (2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8), {}, "cpu", False),
    ("float32", (2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8), {}, "gpu", False),
    ("float64", (2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8), {}, "gpu", False),
    ("bfloat16", (2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 6, 3), {}, "gpu", False),  # v_dim
    ("bfloat16", (2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8), {"is_causal": True}, "gpu", False),
    ("bfloat16", (6, 8), (6, 8), (6, 8), {"window": (2, 1)}, "gpu", False),
    ("bfloat16", (5, 8), (6, 8), (6, 8), {"window": (2, 0)}, "gpu", False),
    ("bfloat16", (6, 8), (6, 8), (6, 8), {"has_mask": True}, "gpu", False),
    ("bfloat16", (6, 8), (6, 8), (6, 8), {"has_bias": True}, "gpu", False),
    ("bfloat16", (6, 8), (6, 8), (6, 8), {"softcap": 5.0}, "gpu", False),
    ("bfloat16", (6, 8), (6, 8), (6, 8), {"dropout_p": 0.1}, "gpu", False),
    ("bfloat16", (6, 8), (6, 8), (6, 8), {"return_weights": True}, "gpu", False),
    ("bfloat16", (0, 8), (6, 8), (6, 8), {}, "gpu", False),
]


def _selected(dtype, q_shape, k_shape, v_shape, options, **backend):
    """What ``_fast.use_fast_path`` selects: shapes and options only (``ShapeDtypeStruct``)."""
    options = dict(options)
    has_mask, has_bias = options.pop("has_mask", False), options.pop("has_bias", False)
    dropout_p = options.get("dropout_p", 0.0)
    args = attention_rules.attention_arguments(
        "test", (q_shape, dtype), (k_shape, dtype), (v_shape, dtype),
        dropout_mask=((), "bool") if dropout_p > 0 else None, **options,
    )
    arrays = [jax.ShapeDtypeStruct(s, jnp.dtype(dtype)) for s in (q_shape, k_shape, v_shape)]
    mask = jnp.ones((), bool) if has_mask else None
    bias = jnp.zeros((), dtype) if has_bias else None
    return _fast.use_fast_path(*arrays, mask, bias, args, **backend)


@pytest.mark.parametrize("case", FAST_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[4]}-{c[5]}")
def test_fast_path_selection(case):
    dtype, q_shape, k_shape, v_shape, options, backend, expected = case
    got = _selected(dtype, q_shape, k_shape, v_shape, options, backend=backend)
    assert (got == "cudnn") is expected
    here = _selected(dtype, q_shape, k_shape, v_shape, options)
    assert (here == "cudnn") is (expected and jax.default_backend() in _fast.CUDNN_PLATFORMS)


def test_fast_path_numbers_are_the_rules():
    numbers = attention_rules.FAST_PATHS["jax_attn"]
    assert _fast.CUDNN_PLATFORMS == numbers["cudnn"]["platforms"]
    assert _fast.CUDNN_DTYPES == numbers["cudnn"]["dtypes"]
    assert _fast.BLOCKED_PLATFORMS == numbers["blocked"]["platforms"]
    assert _fast.SEGMENTS == numbers["blocked"]["segments"]


@pytest.fixture
def forced_fast_path(monkeypatch):
    """Select the fast path on this backend, with jax.nn's XLA implementation; record calls."""
    calls = []
    real = _fast._cudnn_attention

    def spy(*args):
        calls.append(args[3:])
        return real(*args)

    monkeypatch.setattr(_fast, "CUDNN_PLATFORMS", (jax.default_backend(),))
    monkeypatch.setattr(_fast, "CUDNN_IMPLEMENTATION", "xla")
    monkeypatch.setattr(_fast, "_cudnn_attention", spy)
    return calls


@pytest.mark.parametrize("case", [c for c in FAST_CASES if c[-1]], ids=lambda c: str(c[4]))
def test_forced_fast_path_matches_reference_where_selected(case, forced_fast_path):
    dtype, q_shape, k_shape, v_shape, options, _, _ = case
    gen = np.random.default_rng(3)
    q, k, v = (jnp.asarray(gen.standard_normal(s), dtype) for s in (q_shape, k_shape, v_shape))
    out = ja.scaled_dot_product_attention(q, k, v, **options)
    assert len(forced_fast_path) == 1, "the fast path was not taken"
    assert out.dtype == jnp.dtype(dtype) and out.shape == q_shape[:-1] + v_shape[-1:]
    _assert_matches_reference(out, "output", dtype, {"query": q, "key": k, "value": v},
                              **options)
    # the weights (not available from jax.nn) force the explicit path, within the same rule
    explicit, _ = ja.scaled_dot_product_attention(q, k, v, return_weights=True, **options)
    assert len(forced_fast_path) == 1
    _assert_matches_reference(explicit, "output", dtype, {"query": q, "key": k, "value": v},
                              **options)


def test_forced_fast_path_is_skipped_where_a_row_may_be_empty(forced_fast_path):
    q, k, v = (jnp.asarray(x, "bfloat16") for x in (Q, K, np.concatenate([V] * 3, -1)[..., :8]))
    out = ja.scaled_dot_product_attention(q, k, v, mask=MASK)
    assert forced_fast_path == []
    assert np.all(_f64(out)[0, :, 2] == 0.0)


# ------------------------------------------------------------------------------ modules

X = _R.standard_normal((2, 5, 8)).astype(np.float32)
X2 = _R.standard_normal((2, 7, 8)).astype(np.float32)


def _module_pairs():
    """(numpy module, jax module, forward arguments) for every module class."""
    key, gen = jax.random.key(0), np.random.default_rng(0)
    return {
        "SelfAttention": (na.SelfAttention(8, 4, 3, rng=gen),
                          ja.SelfAttention(8, 4, 3, rng=key), (X,)),
        "CrossAttention": (na.CrossAttention(8, 4, 3, rng=gen),
                           ja.CrossAttention(8, 4, 3, rng=key), (X, X2)),
        "CausalSelfAttention": (na.CausalSelfAttention(8, 4, 3, rng=gen).eval(),
                                ja.CausalSelfAttention(8, 4, 3, dropout_p=0.3, rng=key), (X,)),
        "MultiHeadAttentionWrapper": (na.MultiHeadAttentionWrapper(8, 4, 2, 3, rng=gen),
                                      ja.MultiHeadAttentionWrapper(8, 4, 2, 3, rng=key), (X,)),
        "MultiHeadAttention": (na.MultiHeadAttention(8, 4, num_kv_heads=2, rng=gen),
                               ja.MultiHeadAttention(8, 4, num_kv_heads=2, rng=key), (X, X2)),
    }


MODULES = _module_pairs()


@pytest.mark.parametrize("name", list(MODULES))
def test_weights_round_trip_with_numpy_attn(name):
    np_module, jax_module, args = MODULES[name]
    loaded = jax_module.load_weights(np_module.export_weights())
    assert loaded is not jax_module and type(loaded) is type(jax_module)
    assert loaded.export_weights().keys() == jax_module.export_weights().keys()
    np.testing.assert_allclose(loaded(*args), np_module(*args), rtol=2e-5, atol=2e-6)
    # the original module is untouched (immutable), and JAX weights load into NumPy
    exported = jax_module.export_weights()
    assert all(isinstance(a, np.ndarray) for a in exported.values())
    back = np_module.__class__.__new__(np_module.__class__)
    back.__dict__.update(np_module.__dict__)
    if name == "MultiHeadAttentionWrapper":
        back.heads = [na.SelfAttention(8, 4, 2, rng=np.random.default_rng(1)) for _ in range(3)]
    back = back.load_weights(exported)
    np.testing.assert_allclose(jax_module(*args), back(*args), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", list(MODULES))
def test_modules_are_pytrees_in_jit_and_grad(name):
    _, module, args = MODULES[name]
    eager = module(*args)
    traces = []

    @jax.jit
    def run(m, *xs):
        traces.append(1)
        return m(*xs)

    np.testing.assert_allclose(run(module, *args), eager, rtol=1e-6, atol=1e-6)
    doubled = jax.tree_util.tree_map(lambda w: w * 2.0, module)
    run(doubled, *args)
    assert len(traces) == 1  # same structure and static part: no retrace
    grads = jax.grad(lambda m: run(m, *args).sum())(module)
    assert type(grads) is type(module)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(module)
    flat = jax.tree_util.tree_leaves(grads)
    assert flat and all(np.isfinite(np.asarray(g)).all() for g in flat)
    # the gradient of one weight against central differences (float64 module, float64 input)
    module64 = jax.tree_util.tree_map(lambda w: w.astype(jnp.float64), module)
    args64 = [a.astype(np.float64) for a in args]
    path, leaf = jax.tree_util.tree_leaves_with_path(module64)[0]
    g64 = jax.grad(lambda m: m(*args64).sum())(module64)
    analytic = np.asarray(jax.tree_util.tree_leaves(g64)[0])[0, 0]
    eps = 1e-6

    def at(delta):
        bumped = jax.tree_util.tree_map_with_path(
            lambda p, w: w.at[0, 0].add(delta) if p == path else w, module64
        )
        return float(bumped(*args64).sum())

    np.testing.assert_allclose(analytic, (at(eps) - at(-eps)) / (2 * eps), rtol=1e-6, atol=1e-8)
    with pytest.raises(AttributeError, match="immutable"):
        module.some_weight = 1


def test_module_dropout_only_with_a_key():
    _, module, args = MODULES["CausalSelfAttention"]
    no_key = module(*args)
    reference_module = ja.CausalSelfAttention(8, 4, 3, rng=jax.random.key(0))
    np.testing.assert_array_equal(no_key, reference_module(*args))  # same key: same weights
    fn = jax.jit(lambda m, x, key: m(x, rng=key))
    a, b = fn(module, args[0], jax.random.key(5)), fn(module, args[0], jax.random.key(5))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, no_key)
    mha = ja.MultiHeadAttention(8, 4, dropout_p=0.5, rng=jax.random.key(0))
    assert not np.allclose(mha(X, rng=jax.random.key(1)), mha(X))


def test_module_initialisation():
    for cls, args in [(ja.SelfAttention, (8, 4, 3)), (ja.CrossAttention, (8, 4, 3)),
                      (ja.CausalSelfAttention, (8, 4, 3)),
                      (ja.MultiHeadAttentionWrapper, (8, 4, 3, 2)),
                      (ja.MultiHeadAttention, (8, 4))]:
        with pytest.raises(ValueError, match="rng"):
            cls(*args)
        weights = cls(*args, rng=jax.random.key(3)).export_weights()
        again = cls(*args, rng=jax.random.key(3)).export_weights()
        assert all(np.array_equal(weights[n], again[n]) for n in weights)
        matrices = [w for n, w in weights.items() if ".b_" not in n and not n.startswith("b_")]
        assert len({w.tobytes() for w in matrices}) == len(matrices)  # one key per weight
        for name, w in weights.items():
            assert w.dtype == np.float32
            if cls is not ja.MultiHeadAttention:
                assert 0.0 <= w.min() and w.max() < 1.0
            elif name.startswith("b_"):
                assert np.all(w == 0.0)
            else:
                bound = math.sqrt(6.0 / sum(w.shape))
                assert -bound <= w.min() and w.max() <= bound and w.min() < 0.0 < w.max()


def test_article_numbers():
    article = seed_example.ARTICLE
    embedding = np.asarray(seed_example.EMBEDDING, dtype=np.float32)

    def f32(d):
        return {k: np.asarray(v, dtype=np.float32) for k, v in d.items()}

    def check(got, name):
        np.testing.assert_allclose(np.round(_f64(got), 4), article[name], atol=1e-4, err_msg=name)

    key = jax.random.key(0)
    weights = f32(seed_example.self_attention_weights())
    check(ja.SelfAttention(3, 2, 4, rng=key).load_weights(weights)(embedding), "self_attention")
    wrapper = ja.MultiHeadAttentionWrapper(3, 2, 1, 4, rng=key)
    check(wrapper.load_weights(f32(seed_example.wrapper_weights()))(embedding),
          "multi_head_wrapper")
    cross = ja.CrossAttention(3, 2, 4, rng=key).load_weights(weights)
    x_2 = np.asarray(seed_example.cross_second_input(), dtype=np.float32)
    check(jax.jit(lambda m, a, b: m(a, b))(cross, embedding, x_2), "cross_attention")
    queries, keys = embedding @ weights["W_query"], embedding @ weights["W_key"]
    check(ja.attention_scores(queries, keys, scale=1.0), "attn_scores")
    weights_ = ja.attention_weights(ja.attention_scores(queries, keys))
    check(weights_, "attn_weights")
    check(ja.renormalized_causal_weights(weights_), "causal_weights")
    masked = ja.mask_scores(ja.attention_scores(queries, keys), is_causal=True)
    check(ja.attention_weights(masked), "causal_weights")


# ------------------------------------------------------------------------------ errors

F32 = np.zeros((2, 3, 4), np.float32)
F32_K = np.zeros((2, 5, 4), np.float32)
F32_V = np.zeros((2, 5, 6), np.float32)
S = np.zeros((2, 3, 5), np.float32)

BAD_CALLS = [
    ("scaled_dot_product_attention", (np.zeros(4, np.float32), F32_K, F32_V), {}),
    ("scaled_dot_product_attention", (F32[0], F32_K, F32_V), {}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V[:, :4]), {}),
    ("scaled_dot_product_attention", (F32, F32_K[..., :3], F32_V), {}),
    ("scaled_dot_product_attention", (F32[None], F32_K[None].repeat(2, 0), F32_V[None]), {}),
    ("scaled_dot_product_attention", (np.zeros((3, 3, 4), np.float32), F32_K, F32_V), {}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V), {"mask": np.ones((3, 3, 5), bool)}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V), {"mask": np.ones((3, 5), np.int64)}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V), {"bias": np.ones((3, 5), np.int32)}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V), {"bias": np.ones((4, 5), np.float32)}),
    ("scaled_dot_product_attention", (F32.astype(np.int64), F32_K, F32_V), {}),
    ("scaled_dot_product_attention", (F32.astype(np.complex64), F32_K, F32_V), {}),
    ("scaled_dot_product_attention", (F32, F32_K.astype(np.float64), F32_V), {}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V), {"window": (-1, 2)}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V), {"window": (1,)}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V), {"window": "ab"}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V), {"causal_alignment": "bottom"}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V), {"dropout_p": 1.0}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V), {"dropout_p": -0.1}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V),
     {"dropout_mask": np.ones((2, 3, 5), bool)}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V),
     {"dropout_p": 0.1, "dropout_mask": np.ones((2, 3, 5), np.float32)}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V),
     {"dropout_p": 0.1, "dropout_mask": np.ones((4, 3, 5), bool)}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V), {"softcap": 0.0}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V), {"softcap": math.inf}),
    ("scaled_dot_product_attention", (F32, F32_K, F32_V), {"scale": math.nan}),
    ("attention_scores", (F32, np.zeros(4, np.float32)), {}),
    ("attention_scores", (F32, F32_K.astype(np.float16)), {}),
    ("mask_scores", (S,), {"mask": np.ones((3, 3, 5), bool)}),
    ("mask_scores", (S,), {"bias": np.ones(5, bool)}),
    ("mask_scores", (S.astype(np.int32),), {}),
    ("mask_scores", (S,), {"window": (1, 2, 3)}),
    ("attention_weights", (np.zeros(5, np.float32),), {}),
    ("apply_dropout", (S, 2.0), {}),
    ("apply_dropout", (S, 0.0), {"dropout_mask": np.ones((2, 3, 5), bool)}),
    ("attention_output", (S, F32_V[:, :4]), {}),
    ("attention_output", (S, F32_V.astype(np.int16)), {}),
    ("renormalized_causal_weights", (S,), {"causal_alignment": "left"}),
    ("causal_mask", (-1, 3), {}),
    ("causal_mask", (2, 3.0), {}),
    ("sliding_window_mask", (2, 3, (1, -1)), {}),
    ("padding_mask", (np.array([1, 5]), 4), {}),
    ("padding_mask", (np.array([1.0, 2.0]), 4), {}),
    ("padding_mask", (np.array([[1, 2]]), 4), {}),
    ("padding_mask", (np.array([1, 2]), 4), {"q_lengths": np.array([1, 2])}),
    ("padding_mask", (np.array([1, 2]), 4), {"q_lengths": np.array([1, 2, 3]), "q_len": 3}),
    ("combine_masks", (np.ones(3, bool), np.ones(3, np.int8)), {}),
    ("combine_masks", (np.ones(3, bool), np.ones(4, bool)), {}),
]


def _error(fn, *args, **kwargs):
    with pytest.raises((ValueError, TypeError)) as info:
        fn(*args, **kwargs)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("call", BAD_CALLS, ids=lambda c: f"{c[0]}-{sorted(c[2])}")
def test_errors_match_numpy_attn(call):
    name, args, kwargs = call
    expected = _error(getattr(na, name), *args, **kwargs)
    assert _error(getattr(ja, name), *args, **kwargs) == expected
    # converted to JAX arrays first (dtype kept: x64 is on) the message is the same
    jax_args = [jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    jax_kwargs = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    assert _error(getattr(ja, name), *jax_args, **jax_kwargs) == expected


def test_errors_are_raised_at_trace_time_under_jit():
    name, args, kwargs = BAD_CALLS[2]  # key and value with different kv_len
    expected = _error(getattr(na, name), *args, **kwargs)
    assert _error(jax.jit(getattr(ja, name)), *args, **kwargs) == expected


@pytest.mark.parametrize(
    "build",
    [
        lambda m, rng: m.MultiHeadAttention(10, 3, rng=rng),
        lambda m, rng: m.MultiHeadAttention(8, 4, num_kv_heads=3, rng=rng),
        lambda m, rng: m.CausalSelfAttention(3, 2, 2, dropout_p=1.5, rng=rng),
        lambda m, rng: m.SelfAttention(3, 2, 4, rng=rng).load_weights({"W_query": np.ones((3, 2))}),
        lambda m, rng: m.SelfAttention(3, 2, 4, rng=rng).load_weights(
            {"W_query": np.ones((3, 2)), "W_key": np.ones((3, 2)), "W_value": np.ones((3, 3))}
        ),
        lambda m, rng: m.MultiHeadAttentionWrapper(3, 2, 1, 2, rng=rng).load_weights({}),
    ],
)
def test_module_errors_match_numpy_attn(build):
    expected = _error(build, na, np.random.default_rng(0))
    assert _error(build, ja, jax.random.key(0)) == expected


# ------------------------------------------------------------------------------ structure


def test_jax_attn_imports_no_other_backend_and_mirrors_numpy_attn():
    for path in sorted((ROOT / "jax_attn").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] not in {"numpy_attn", "torch", "conformance"}, path
    public = (spec.FUNCTIONS + spec.MODULES + spec.CLASSES + spec.BACKEND_EXTRAS["jax_attn"]
              + spec.CONTEXT_PARALLEL_FUNCTIONS)
    assert sorted(ja.__all__) == sorted(public)
    for module in ("functional", "masks"):
        np_mod = getattr(na, module)
        np_funcs = [n for n in vars(np_mod) if callable(getattr(np_mod, n))]
        jax_mod = getattr(ja, module)
        missing = [n for n in np_funcs if n.startswith("_") and not n.startswith("__")
                   and not hasattr(jax_mod, n)]
        assert missing == [], f"jax_attn.{module} lacks numpy_attn's helpers {missing}"


@settings(max_examples=8, deadline=None)
@given(
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
    q_len=st.integers(1, 4),
    kv_len=st.integers(1, 4),
    is_causal=st.booleans(),
    alignment=st.sampled_from(["top_left", "bottom_right"]),
    window=st.sampled_from([None, (0, 0), (1, None), (None, 1)]),
    seed=st.integers(0, 2**16),
)
def test_random_configurations_match_reference(
    heads, q_len, kv_len, is_causal, alignment, window, seed
):
    gen = np.random.default_rng(seed)
    h, kvh = heads
    q = gen.standard_normal((h, q_len, 3))
    k = gen.standard_normal((kvh, kv_len, 3))
    v = gen.standard_normal((kvh, kv_len, 2))
    mask = gen.random((1, q_len, kv_len)) > 0.3
    options = dict(mask=mask, is_causal=is_causal, causal_alignment=alignment, window=window)
    out, weights = ja.scaled_dot_product_attention(q, k, v, return_weights=True, **options)
    expected = _ref(q, k, v, **options)
    np.testing.assert_allclose(out, expected.output, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(weights, expected.weights, rtol=1e-10, atol=1e-12)
    _assert_no_nan(out, weights)
