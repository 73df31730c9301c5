"""jax_attn's modules: weights round trips with numpy_attn, modules as pytrees in jit and grad
(no retrace, a weight gradient against central differences), dropout only with a key,
initialisation from a key, and the seed article's published numbers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="pip install jax")

import jax.numpy as jnp  # noqa: E402
from jax_inputs import X2, X, _f64  # noqa: E402

import jax_attn as ja  # noqa: E402
import numpy_attn as na  # noqa: E402
from conformance.spec import seed_example  # noqa: E402

# float64 inputs stay float64: x64 on for each test here (conftest.x64_on), never for the run
pytestmark = pytest.mark.usefixtures("x64_on")


# ------------------------------------------------------------------------------ modules


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


@pytest.mark.slow
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
