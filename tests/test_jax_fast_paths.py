"""jax_attn's fast path (jax.nn.dot_product_attention, cuDNN on a GPU): which inputs select
it (shapes and options only), on the platforms and in the dtypes ``spec.FAST_PATHS`` states
and no others, the device of the input decides, and, forced on this machine with jax.nn's XLA
implementation (x64 off and on), it matches the float64 reference under the harness's
tolerance rule where it is selected and is skipped where a row may be empty; forced in float64
on 4-D, 3-D and 2-D inputs, what ``_cudnn_attention`` returns is the output (a test from mutation
testing, docs/mutation.md).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="pip install jax")

import jax.numpy as jnp  # noqa: E402
from jax_inputs import MASK, K, Q, V, _assert_matches_reference, _f64  # noqa: E402

import attention_rules  # noqa: E402
import jax_attn as ja  # noqa: E402
from conformance import spec  # noqa: E402
from conformance.cases import reference  # noqa: E402
from jax_attn import _fast  # noqa: E402

# float64 inputs stay float64: x64 on for each test here (conftest.x64_on), never for the run
pytestmark = pytest.mark.usefixtures("x64_on")


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


def test_cudnn_is_selected_on_the_documented_platforms_and_dtypes_only():
    """The unpatched rule against what ``spec.FAST_PATHS`` (docs/spec.md) states: cuDNN on
    its platforms in its dtypes, nowhere else and in no other dtype (shapes cuDNN takes)."""
    numbers = spec.FAST_PATHS["jax_attn"]["cudnn"]
    shapes = ((2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8))
    for platform in (*numbers["platforms"], "cpu", "tpu"):
        for dtype in ("float16", "bfloat16", "float32", "float64"):
            want = platform in numbers["platforms"] and dtype in numbers["dtypes"]
            got = _selected(dtype, *shapes, {}, backend=platform)
            assert (got == "cudnn") is want, (platform, dtype, got)


def test_fast_path_follows_the_device_of_the_input(monkeypatch):
    # jax.default_backend() says "gpu", the arrays live on the CPU: a concrete array takes its
    # device's path; a tracer under jit has no device and falls back to jax.default_backend()
    monkeypatch.setattr(_fast, "CUDNN_PLATFORMS", ("gpu",))
    monkeypatch.setattr(_fast, "BLOCKED_PLATFORMS", ("cpu",))
    monkeypatch.setattr(_fast, "MIN_SCORES", 0)
    monkeypatch.setattr(_fast, "MIN_Q_LEN", 1)
    cpu = jax.devices("cpu")[0]
    q, k, v = (jax.device_put(jnp.ones((2, 6, 8), jnp.bfloat16), cpu) for _ in range(3))
    args = attention_rules.attention_arguments(
        "test", (q.shape, "bfloat16"), (k.shape, "bfloat16"), (v.shape, "bfloat16"))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert _fast.use_fast_path(q, k, v, None, None, args) == "blocked"  # not "cudnn"
    traced = []
    jax.make_jaxpr(lambda q: traced.append(_fast.use_fast_path(q, k, v, None, None, args)))(q)
    assert traced == ["cudnn"]  # the tracer: jax.default_backend()


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


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in FAST_CASES if c[-1]], ids=lambda c: str(c[4]))
def test_forced_fast_path_matches_reference_where_selected(case, forced_fast_path, x64):
    """x64 off (JAX's default) and on: the fast path's output within the harness's tolerance
    of the float64 reference, and the explicit path's (the weights force it) too."""
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


def test_forced_fast_path_is_skipped_with_dropout_which_is_applied(forced_fast_path):
    """An input the fast path takes, with dropout: jax.nn cannot apply our keep-mask, so the
    explicit steps run and drop exactly the given positions (the float64 reference's
    output with the same keep-mask, under the harness's rule)."""
    dtype, q_shape, k_shape, v_shape, options, _, _ = FAST_CASES[0]  # selected without dropout
    gen = np.random.default_rng(5)
    q, k, v = (jnp.asarray(gen.standard_normal(s), dtype) for s in (q_shape, k_shape, v_shape))
    keep = gen.random(q_shape[:-1] + k_shape[-2:-1]) > 0.5
    out = ja.scaled_dot_product_attention(q, k, v, dropout_p=0.5, dropout_mask=keep, **options)
    assert forced_fast_path == []
    _assert_matches_reference(out, "output", dtype, {"query": q, "key": k, "value": v,
                                                     "dropout_mask": keep}, dropout_p=0.5)


@pytest.mark.parametrize(("shapes", "options"), [
    (((1, 2, 5, 4), (1, 1, 6, 4), (1, 1, 6, 4)), {}),
    (((2, 6, 4), (2, 6, 4), (2, 6, 4)), {"is_causal": True, "window": (2, 3)}),
    (((6, 4), (6, 4), (6, 4)), {"window": (1, 0)}),
], ids=["gqa_4d", "causal_window_3d", "left_window_2d"])
def test_the_cudnn_path_runs_and_equals_the_reference(monkeypatch, x64_on, shapes, options):
    """The cuDNN path forced on this machine in float64 (jax.nn's XLA implementation): its
    ``_cudnn_attention`` returns (an error there would fall back to the explicit steps
    unseen), and that result is the output, equal to the float64 reference (within 1e-5:
    jax.nn's products run at XLA's default precision)."""
    monkeypatch.setattr(_fast, "CUDNN_PLATFORMS", (jax.default_backend(),))
    monkeypatch.setattr(_fast, "CUDNN_DTYPES", ("float64",))
    monkeypatch.setattr(_fast, "CUDNN_IMPLEMENTATION", "xla")
    results = []
    real = _fast._cudnn_attention
    monkeypatch.setattr(_fast, "_cudnn_attention", lambda *a: results.append(real(*a)) or
                        results[-1])
    gen = np.random.default_rng(3)
    q, k, v = (gen.standard_normal(s) for s in shapes)
    out = ja.scaled_dot_product_attention(q, k, v, **options)
    assert len(results) == 1 and np.array_equal(np.asarray(results[0]), np.asarray(out))
    # jax.nn's products run at the default (not the highest) precision, even in float64
    np.testing.assert_allclose(np.asarray(out), reference.attention(q, k, v, **options).output,
                               err_msg="output", atol=1e-5)
