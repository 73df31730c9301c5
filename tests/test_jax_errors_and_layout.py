"""jax_attn's errors are numpy_attn's (type and message; JAX arrays too, x64 off and on; at
trace time under jit; the modules' too), and jax_attn imports no other backend, exports the
spec's public names and mirrors numpy_attn's private helpers.
"""

from __future__ import annotations

import ast
import importlib
import math
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="pip install jax")

import jax.numpy as jnp  # noqa: E402

import jax_attn as ja  # noqa: E402
import numpy_attn as na  # noqa: E402
from conformance import spec  # noqa: E402

# float64 inputs stay float64: x64 on for each test here (conftest.x64_on), never for the run
pytestmark = pytest.mark.usefixtures("x64_on")


ROOT = Path(__file__).resolve().parents[1]



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
def test_errors_match_numpy_attn(call, x64):
    """The same type and message, x64 off (JAX's default) and on, for NumPy arrays and for
    JAX arrays. An array becomes a JAX array only where JAX holds its dtype (with x64 off,
    int64 and float64 stay NumPy arrays: ``jnp.asarray`` would make them 32-bit)."""
    name, args, kwargs = call
    expected = _error(getattr(na, name), *args, **kwargs)
    assert _error(getattr(ja, name), *args, **kwargs) == expected

    def to_jax(a):
        if not isinstance(a, np.ndarray) or jax.dtypes.canonicalize_dtype(a.dtype) != a.dtype:
            return a
        converted = jnp.asarray(a)
        assert converted.dtype == a.dtype
        return converted

    jax_args = [to_jax(a) for a in args]
    jax_kwargs = {k: to_jax(v) for k, v in kwargs.items()}
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


#: numpy_attn's hand-written VJPs need a score_mod's derivative (jax_attn differentiates it),
#: and its blocked fast path's forward and backward share a statuses lookup and a cache of band
#: strips (jax_attn's share block reshapes instead: the fast paths differ by nature).
NUMPY_ONLY_HELPERS = {"_mods_slope", "_entry", "_outside_band"}


def test_jax_attn_imports_no_other_backend_and_mirrors_numpy_attn():
    for path in sorted((ROOT / "jax_attn").rglob("*.py")):  # _fast/ and integrations/ too
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
    for module in ("_arrays", "_masking", "_steps", "_tiles", "functional", "masks"):  # rooms too
        np_mod = importlib.import_module(f"numpy_attn.{module}")
        np_funcs = [n for n, f in vars(np_mod).items()  # defined there, not imported
                    if callable(f) and getattr(f, "__module__", None) == np_mod.__name__]
        jax_mod = importlib.import_module(f"jax_attn.{module}")
        missing = [n for n in np_funcs if n.startswith("_") and not n.startswith("__")
                   and not hasattr(jax_mod, n) and n not in NUMPY_ONLY_HELPERS]
        assert missing == [], f"jax_attn.{module} lacks numpy_attn's helpers {missing}"


@pytest.mark.parametrize("name, value", [("scale", 0.5), ("softcap", 5.0), ("dropout_p", 0.1)])
def test_a_traced_structural_number_is_refused_naming_static_argnames(name, value):
    """A number that must be known when the program is built, passed as a jit argument, is a
    ValueError that says how to mark it static; the same number given statically runs."""
    q = jnp.ones((1, 2, 4, 8), jnp.float32)
    extra = {"rng": jax.random.key(0)} if name == "dropout_p" else {}

    def call(q, v):
        return ja.scaled_dot_product_attention(q, q, q, **{name: v}, **extra)

    with pytest.raises(ValueError, match=rf"static_argnames=\('{name}',\)"):
        jax.jit(call)(q, value)
    assert jax.jit(call, static_argnames="v")(q, v=value).shape == (1, 2, 4, 8)
    with pytest.raises(ValueError) as plain:  # a bad Python number: no hint about tracing
        call(q, float("nan"))
    assert "static_argnames" not in str(plain.value)
