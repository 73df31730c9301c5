"""Modules on every backend: the article's worked example, weights round trips, MultiHeadAttention.

The article's numbers are published values (``conformance.spec.seed_example.ARTICLE``); the other
expectations come from ``conformance.reference`` in float64.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance import reference
from conformance.spec import seed_example
from conformance.spec.seed_example import ARTICLE, ARTICLE_INCONSISTENT

EMBEDDING = np.array(seed_example.EMBEDDING, dtype=np.float32)


def _weights(d, dtype=np.float32):
    return {name: np.array(value, dtype=dtype) for name, value in d.items()}


def _run(backend, module, *inputs, **kwargs):
    out = module.forward(*(backend.asarray(x) for x in inputs), **kwargs)
    if isinstance(out, tuple):
        return tuple(backend.to_numpy(o) for o in out)
    return backend.to_numpy(out)


def _make(backend, name, *args, **kwargs):
    cls = getattr(backend.module, name)
    return cls(*args, rng=backend.rng(0), **kwargs)


def _assert_article(got, name):
    expected = np.array(ARTICLE[name])
    assert got.shape == expected.shape
    # printed to 4 decimals: the rounded result must equal the printed number
    np.testing.assert_allclose(np.round(got.astype(np.float64), 4), expected, atol=1.5e-4)


def test_embedding_matches_the_printed_matrix():
    np.testing.assert_allclose(np.round(EMBEDDING, 4), ARTICLE["embedding"], atol=1e-9)
    assert seed_example.TOKEN_IDS == [0, 4, 5, 2, 1, 3]


def test_article_self_attention(backend):
    sa = _make(backend, "SelfAttention", 3, 2, 4)
    sa = sa.load_weights(_weights(seed_example.self_attention_weights()))
    _assert_article(_run(backend, sa, EMBEDDING), "self_attention")


def test_article_multi_head_wrapper(backend):
    mha = _make(backend, "MultiHeadAttentionWrapper", 3, 2, 1, 4)
    mha = mha.load_weights(_weights(seed_example.wrapper_weights()))
    _assert_article(_run(backend, mha, EMBEDDING), "multi_head_wrapper")


def test_article_cross_attention(backend):
    ca = _make(backend, "CrossAttention", 3, 2, 4)
    ca = ca.load_weights(_weights(seed_example.self_attention_weights()))
    second = np.array(seed_example.cross_second_input(), dtype=np.float32)
    _assert_article(_run(backend, ca, EMBEDDING, second), "cross_attention")


def test_article_scores_weights_and_both_causal_methods(backend):
    w = _weights(seed_example.self_attention_weights())
    f = backend.module
    queries = backend.asarray(EMBEDDING @ w["W_query"])
    keys = backend.asarray(EMBEDDING @ w["W_key"])
    omega = f.attention_scores(queries, keys, scale=1.0)
    _assert_article(backend.to_numpy(omega), "attn_scores")
    weights = f.attention_weights(f.attention_scores(queries, keys))
    _assert_article(backend.to_numpy(weights), "attn_weights")
    by_renormalising = f.renormalized_causal_weights(weights)
    _assert_article(backend.to_numpy(by_renormalising), "causal_weights")
    by_masking = f.attention_weights(f.mask_scores(f.attention_scores(queries, keys),
                                                   is_causal=True))
    _assert_article(backend.to_numpy(by_masking), "causal_weights")
    causal = _make(backend, "CausalSelfAttention", 3, 2, 4).load_weights(w)
    expected = np.array(ARTICLE["causal_weights"]) @ (EMBEDDING @ w["W_value"])
    np.testing.assert_allclose(_run(backend, causal, EMBEDDING), expected, atol=2e-4)


def test_article_inconsistencies_are_real():
    """The numbers the docs call wrong are wrong, by the article's own data."""
    w = _weights(seed_example.self_attention_weights(), np.float64)
    x = EMBEDDING.astype(np.float64)
    steps = reference.attention(x @ w["W_query"], x @ w["W_key"], x @ w["W_value"])
    printed = ARTICLE_INCONSISTENT
    assert abs(sum(printed["attention_weights_3"]["printed"]) - 1) > 0.3
    assert not np.allclose(printed["omega_3"]["printed"], steps.scores[2] * 2**0.5, atol=1e-3)
    np.testing.assert_allclose(np.round(steps.scores[2] * 2**0.5, 4),
                               ARTICLE["attn_scores"][2], atol=1.5e-4)
    assert not np.allclose(printed["context_vector_3"]["printed"], steps.output[2], atol=1e-3)
    np.testing.assert_allclose(np.round(steps.output[2], 4), ARTICLE["self_attention"][2],
                               atol=1.5e-4)


MODULE_ARGS = {
    "SelfAttention": ((5, 3, 4), {}),
    "CrossAttention": ((5, 3, 4), {}),
    "CausalSelfAttention": ((5, 3, 4), {}),
    "MultiHeadAttentionWrapper": ((5, 3, 2, 3), {}),
    "MultiHeadAttention": ((8, 4), {"num_kv_heads": 2}),
}


@pytest.mark.parametrize("name", sorted(MODULE_ARGS))
def test_weights_round_trip_between_numpy_and_backend(backend, name):
    """Weights exported by numpy_attn load into every backend and give the same outputs."""
    from conformance import backends

    args, kwargs = MODULE_ARGS[name]
    numpy_module = getattr(backends.get("numpy").module, name)(
        *args, rng=np.random.default_rng(3), **kwargs
    )
    exported = {k: v.astype(np.float64) for k, v in numpy_module.export_weights().items()}
    numpy_module = numpy_module.load_weights(exported)
    module = _make(backend, name, *args, **kwargs)
    assert sorted(module.export_weights()) == sorted(exported)
    for key, array in module.export_weights().items():
        assert array.shape == exported[key].shape, key
    module = module.load_weights(exported)
    back = module.export_weights()
    for key in exported:
        np.testing.assert_array_equal(back[key], exported[key])
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 6, args[0]))
    inputs = (x, rng.standard_normal((2, 3, args[0]))) if name == "CrossAttention" else (x,)
    expected = numpy_module.forward(*inputs)
    np.testing.assert_allclose(_run(backend, module, *inputs), expected, rtol=1e-10, atol=1e-12)


def test_load_weights_rejects_wrong_names_and_shapes(backend):
    module = _make(backend, "SelfAttention", 3, 2, 4)
    good = {k: np.asarray(v) for k, v in module.export_weights().items()}
    with pytest.raises(ValueError, match="weight names differ"):
        module.load_weights({**good, "W_extra": good["W_key"]})
    with pytest.raises(ValueError, match="W_key must have shape"):
        module.load_weights({**good, "W_key": np.zeros((2, 2))})


def _mha_reference(weights, x, context, num_heads, num_kv_heads, **kwargs):
    """MultiHeadAttention from the float64 reference: project, split heads, attend, merge."""
    head_dim = weights["W_query"].shape[1] // num_heads

    def split(t, w, b, heads):
        y = t @ weights[w] + weights[b]
        return y.reshape(y.shape[:-1] + (heads, head_dim)).swapaxes(-2, -3)

    q = split(x, "W_query", "b_query", num_heads)
    k = split(context, "W_key", "b_key", num_kv_heads)
    v = split(context, "W_value", "b_value", num_kv_heads)
    steps = reference.attention(q, k, v, **kwargs)
    merged = steps.output.swapaxes(-2, -3).reshape(x.shape[:-1] + (-1,))
    return merged @ weights["W_out"] + weights["b_out"], steps.weights


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"is_causal": True},
        {"is_causal": True, "causal_alignment": "bottom_right", "cross": True},
        {"window": (1, 1)},
        {"mask": True, "cross": True},
    ],
    ids=["self", "causal", "cross_causal_bottom_right", "window", "cross_padding"],
)
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_multi_head_attention_against_reference(backend, kwargs, num_kv_heads):
    kwargs = dict(kwargs)
    rng = np.random.default_rng(5)
    module = _make(backend, "MultiHeadAttention", 16, 4, num_kv_heads=num_kv_heads)
    weights = {k: rng.standard_normal(v.shape) * 0.5 for k, v in module.export_weights().items()}
    module = module.load_weights(weights)
    x = rng.standard_normal((2, 5, 16))
    context = rng.standard_normal((2, 7, 16)) if kwargs.pop("cross", False) else None
    if kwargs.pop("mask", False):
        lengths = np.array([7, 3])
        kwargs["mask"] = (np.arange(7) < lengths[:, None])[:, None, None, :]
    expected, expected_weights = _mha_reference(
        weights, x, x if context is None else context, 4, num_kv_heads, **kwargs
    )
    call_kwargs = {k: backend.asarray(v) if isinstance(v, np.ndarray) else v
                   for k, v in kwargs.items()}
    inputs = (x,) if context is None else (x, context)
    out, attn = _run(backend, module, *inputs, return_weights=True, **call_kwargs)
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(attn, expected_weights, rtol=1e-10, atol=1e-12)


def test_multi_head_attention_initialisation(backend):
    module = _make(backend, "MultiHeadAttention", 64, 8)
    weights = module.export_weights()
    bound = (6 / (64 + 64)) ** 0.5
    for name in ("W_query", "W_key", "W_value", "W_out"):
        w = weights[name]
        assert w.shape == (64, 64)
        assert np.abs(w).max() <= bound
        assert np.abs(w).max() > 0.9 * bound  # spread over the whole Xavier range
    for name in ("b_query", "b_key", "b_value", "b_out"):
        np.testing.assert_array_equal(weights[name], 0)
    seed_module = _make(backend, "SelfAttention", 3, 2, 4)
    for w in seed_module.export_weights().values():
        assert (w >= 0).all() and (w < 1).all()  # uniform on [0, 1), as the article draws


def test_multi_head_attention_rejects_bad_heads(backend):
    cls = backend.module.MultiHeadAttention
    with pytest.raises(ValueError, match="d_model must be a multiple of num_heads"):
        cls(10, 4, rng=backend.rng(0))
    with pytest.raises(ValueError, match="num_heads must be a multiple of num_kv_heads"):
        cls(12, 4, num_kv_heads=3, rng=backend.rng(0))
