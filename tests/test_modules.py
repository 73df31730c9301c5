"""Modules on every backend: the article's worked example, weights round trips, MultiHeadAttention.

The article's numbers are published values (``conformance.spec.seed_example.ARTICLE``); the other
expectations come from ``conformance.cases.reference`` in float64 (the whole modules from
``conformance.cases.module_pipelines`` around it).
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.cases import reference
from conformance.cases.catalogue import CaseData
from conformance.cases.expected import reference_attention
from conformance.cases.module_pipelines import module_forward
from conformance.cases.naive import EXACT
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


def module_reference(name: str, init_args: tuple, init_kwargs: dict, weights: dict,
                     inputs: tuple, forward: dict | None = None) -> np.ndarray:
    """Module ``name`` (built with ``init_args``, ``init_kwargs``) in float64:
    ``conformance.cases.module_pipelines`` around the reference attention, reading ``weights``
    (weight name → array) as they are now. ``inputs``: ``(x,)`` or ``(x, context)``, each
    ``(batch, seq, d_in)``; ``forward``: MultiHeadAttention's options, ``mask`` included."""
    arrays = {f"w:{n}": w for n, w in weights.items()}
    if name == "CrossAttention":
        arrays.update(x_1=inputs[0], x_2=inputs[1])
    else:
        arrays["x"] = inputs[0]
    if name == "MultiHeadAttention" and len(inputs) == 2:
        arrays["context"] = inputs[1]
    forward = dict(forward or {})
    if "mask" in forward:
        arrays["mask"] = forward.pop("mask")
    init = {"num_heads": init_args[-1]}  # the wrapper's heads
    if name == "MultiHeadAttention":
        init = {"d_model": init_args[0], "num_heads": init_args[1], **init_kwargs}
    data = CaseData(arrays, {"module": name, "init": init, "forward": forward})
    return module_forward(data, EXACT, reference_attention)["output"]


@pytest.mark.parametrize("name", sorted(MODULE_ARGS))
def test_weights_round_trip_between_numpy_and_backend(backend, name):
    """Weights exported by numpy_attn load into every backend, export back unchanged, and give
    the float64 module pipeline's outputs."""
    from conformance.running import backends

    args, kwargs = MODULE_ARGS[name]
    numpy_module = getattr(backends.get("numpy").module, name)(
        *args, rng=np.random.default_rng(3), **kwargs
    )
    exported = {k: v.astype(np.float64) for k, v in numpy_module.export_weights().items()}
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
    expected = module_reference(name, args, kwargs, exported, inputs)
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
@pytest.mark.parametrize("backend", ["numpy", pytest.param("jax", marks=pytest.mark.slow),
                                     "torch"], indirect=True)  # jax: a compile per case
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


# --- MultiHeadAttention with learned attention sinks (GPT-OSS): sinks=True --------------------

SINK_MASK = np.ones((2, 1, 1, 7), bool)
SINK_MASK[1, ..., 3:] = False  # sequence 1 has 3 keys
SINK_MASK_EMPTY = SINK_MASK.copy()
SINK_MASK_EMPTY[1] = False  # sequence 1 attends no key: every row puts its weight on the sink


def _sink_module(backend, rng, dtype=np.float64):
    """A float64 MultiHeadAttention(16, 4 heads over 2 kv heads, sinks=True) with random
    weights, sinks included, and those weights (a dict of NumPy arrays)."""
    module = _make(backend, "MultiHeadAttention", 16, 4, num_kv_heads=2, sinks=True)
    weights = {k: (rng.standard_normal(v.shape) * 0.5).astype(dtype)
               for k, v in module.export_weights().items()}
    weights["sinks"] = np.array([1.5, -0.5, 0.0, 2.5], dtype)
    return module.load_weights(weights), weights


@pytest.mark.parametrize("mask", [SINK_MASK, SINK_MASK_EMPTY], ids=["padding", "no_key"])
def test_multi_head_attention_sinks_against_reference(backend, mask):
    """``sinks=True``: forward (output and weights, without the sink column) equals the float64
    reference with the module's sinks as the extra score column, for cross-attention over a
    padded context; a sequence with no key gives the output bias alone (attention output 0)."""
    rng = np.random.default_rng(6)
    module, weights = _sink_module(backend, rng)
    assert list(module.export_weights())[-1] == "sinks"
    x, context = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 7, 16))
    expected, expected_weights = _mha_reference(weights, x, context, 4, 2, mask=mask,
                                                sinks=weights["sinks"])
    out, attn = _run(backend, module, x, context, mask=backend.asarray(mask),
                     return_weights=True)
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(attn, expected_weights, rtol=1e-10, atol=1e-12)
    assert np.all(attn.sum(-1) < 1) and (1 - attn.sum(-1)).mean() > 0.05  # the sink's share
    without, _ = _mha_reference(weights, x, context, 4, 2, mask=mask)
    assert np.abs(expected[0] - without[0]).max() > 1e-2  # the sinks are not vacuous here
    if not mask[1].any():
        np.testing.assert_allclose(out[1], np.broadcast_to(weights["b_out"], out[1].shape),
                                   rtol=0, atol=1e-12)


def _directional(fn, weights, direction, step=1e-6):
    """Central difference of ``fn(weights)`` along ``direction`` (float64)."""
    plus = {k: w + step * direction[k] for k, w in weights.items()}
    minus = {k: w - step * direction[k] for k, w in weights.items()}
    return (fn(plus) - fn(minus)) / (2 * step)


def test_multi_head_attention_sinks_backward_against_finite_differences(backend):
    """``parameter_gradients`` returns every weight's gradient, the sinks' under ``sinks``: each
    sink logit's gradient and the whole gradient along a random direction equal central finite
    differences of the float64 reference module (causal, one fully masked row)."""
    rng = np.random.default_rng(7)
    module, weights = _sink_module(backend, rng)
    x, grad_output = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 5, 16))
    mask = np.ones((2, 1, 5, 5), bool)
    mask[0, 0, 1] = False  # batch 0, query 1: no key
    options = {"mask": mask, "is_causal": True}
    grads = module.parameter_gradients(backend.asarray(x), backend.asarray(grad_output),
                            mask=backend.asarray(mask), is_causal=True)
    grads = {k: np.asarray(v, dtype=np.float64) for k, v in grads.items()}
    assert sorted(grads) == sorted(weights) and grads["sinks"].shape == (4,)

    def loss(w):
        return float(np.sum(_mha_reference(w, x, x, 4, 2, sinks=w["sinks"], **options)[0]
                            * grad_output))

    for h in range(4):
        direction = {k: np.zeros_like(w) for k, w in weights.items()}
        direction["sinks"][h] = 1.0
        np.testing.assert_allclose(grads["sinks"][h], _directional(loss, weights, direction),
                                   rtol=1e-6, atol=1e-8)
    assert np.abs(grads["sinks"]).min() > 1e-3
    direction = {k: rng.standard_normal(w.shape) for k, w in weights.items()}
    along = sum(float(np.sum(grads[k] * direction[k])) for k in weights)
    np.testing.assert_allclose(along, _directional(loss, weights, direction), rtol=1e-6)


@pytest.mark.slow
def test_multi_head_attention_sinks_decode_equals_forward(backend):
    """``decode`` with sinks (a prompt of 4, then two single tokens) equals the causal forward
    over the whole sequence at those positions: the cache's decoding step takes the sinks."""
    rng = np.random.default_rng(8)
    module, _ = _sink_module(backend, rng)
    module = module.eval()
    x = rng.standard_normal((2, 6, 16))
    full = _run(backend, module, x, is_causal=True)
    out, cache = module.decode(backend.asarray(x[:, :4]), max_len=6)
    steps = [backend.to_numpy(out)]
    for t in (4, 5):
        out, cache = module.decode(backend.asarray(x[:, t:t + 1]), cache)
        steps.append(backend.to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-10, atol=1e-12)


def test_multi_head_attention_sinks_initialisation(backend):
    """``sinks=True`` adds ``sinks (num_heads,)`` set to 0, drawing nothing: the other weights
    equal those of the same module built without sinks from the same random source."""
    plain = _make(backend, "MultiHeadAttention", 16, 4, num_kv_heads=2).export_weights()
    with_sinks = _make(backend, "MultiHeadAttention", 16, 4, num_kv_heads=2,
                       sinks=True).export_weights()
    assert list(with_sinks) == [*plain, "sinks"]
    np.testing.assert_array_equal(with_sinks["sinks"], np.zeros(4, np.float32))
    assert with_sinks["sinks"].dtype == np.float32
    for name, array in plain.items():
        np.testing.assert_array_equal(with_sinks[name], array)


def test_the_harness_module_pipeline_takes_the_sinks(backend):
    """``conformance.cases.module_pipelines`` (the harness's float64 modules) reads a
    ``MultiHeadAttention(sinks=True)``'s ``w:sinks``: its forward equals the independent
    reference above, and its weight gradients, ``sinks`` included, equal the backend's
    ``parameter_gradients``."""
    from conformance.cases.expected import reference_attention_vjp
    from conformance.cases.module_pipelines import module_backward

    rng = np.random.default_rng(9)
    module, weights = _sink_module(backend, rng)
    x, grad_output = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 5, 16))
    init = ((16, 4), {"num_kv_heads": 2, "sinks": True})
    got = module_reference("MultiHeadAttention", *init, weights, (x,), {"is_causal": True})
    expected, _ = _mha_reference(weights, x, x, 4, 2, is_causal=True, sinks=weights["sinks"])
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    arrays = {**{f"w:{n}": w for n, w in weights.items()}, "x": x, "grad_output": grad_output}
    data = CaseData(arrays, {"module": "MultiHeadAttention",
                             "init": {"d_model": 16, "num_heads": 4, **init[1]},
                             "forward": {"is_causal": True}})
    pipeline = module_backward(data, EXACT, reference_attention, reference_attention_vjp)
    grads = module.parameter_gradients(backend.asarray(x), backend.asarray(grad_output),
                                       is_causal=True)
    assert sorted(pipeline) == sorted(grads)
    for name, grad in grads.items():
        np.testing.assert_allclose(np.asarray(grad, np.float64), pipeline[name], rtol=1e-9,
                                   atol=1e-10, err_msg=name)
