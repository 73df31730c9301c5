"""Gradients: every backend's ``scaled_dot_product_attention_vjp`` against finite differences.

The finite differences are taken on ``conformance.cases.reference`` (float64), so each backend's
gradient — numpy_attn's hand-written backward, jax.vjp, torch.autograd — is checked against a
computation that shares no code with it, and therefore the three agree with each other. float32
gradients are held to the float64 reference VJP under the harness's tolerance rule (``numerics``);
the modules' weight gradients to central differences of the float64 module pipeline
(``conformance.cases.module_pipelines`` around the reference), not of any backend's forward.

numpy_attn's explicit VJP is also held to the float64 reference VJP where a ``score_mod``'s
derivative is taken after the bias and ALiBi, at the tile's own positions; its bad inputs name
the function and the argument; its optimisers follow torch's and their own formulas (``sgd_step``,
``Adam``'s defaults written out). Those tests came from mutation testing (docs/mutation.md).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from numerics import assert_vjp_matches_reference, finite_differences
from test_modules import module_reference

import numpy_attn
from conformance.cases import reference

FEATURES = {
    "plain": {},
    "mask_bias": {"mask": True, "bias": (1, 4, 1, 4)},
    "bias_full": {"bias": (2, 4, 3, 4)},
    "causal_top_left": {"is_causal": True},
    "causal_bottom_right": {"is_causal": True, "causal_alignment": "bottom_right"},
    "window": {"window": (1, 0)},
    "softcap": {"softcap": 0.8},
    "gqa": {"kv_heads": 2},
    "mqa": {"kv_heads": 1},
    "v_dim": {"v_dim": 3},
    "dropout_mask": {"dropout": 0.3},
    "scale": {"scale": 0.7},
    "fully_masked_rows": {"empty_rows": True},
    "two_d": {"two_d": True},
}


def _inputs(feature):
    spec = FEATURES[feature]
    rng = np.random.default_rng(sum(map(ord, feature)))
    kv_heads = spec.get("kv_heads", 4)
    q = rng.standard_normal((2, 4, 3, 5))
    k = rng.standard_normal((2, kv_heads, 4, 5))
    v = rng.standard_normal((2, kv_heads, 4, spec.get("v_dim", 5)))
    kw: dict = {n: spec[n] for n in ("is_causal", "causal_alignment", "window", "softcap",
                                      "scale") if n in spec}
    if "bias" in spec:
        kw["bias"] = rng.standard_normal(spec["bias"])
    if spec.get("mask"):
        kw["mask"] = rng.random((2, 1, 3, 4)) < 0.7
    if spec.get("empty_rows"):
        mask = rng.random((2, 4, 3, 4)) < 0.7
        mask[0, 1, 2] = False
        mask[1, :, 0] = False
        kw["mask"] = mask
        kw["bias"] = rng.standard_normal((2, 4, 3, 4))
    if "dropout" in spec:
        kw["dropout_p"] = spec["dropout"]
        kw["dropout_mask"] = rng.random((2, 4, 3, 4)) >= spec["dropout"]
    if spec.get("two_d"):
        q, k, v = q[0, 0], k[0, 0], v[0, 0]
    grad_out = rng.standard_normal(q.shape[:-1] + v.shape[-1:])
    return q, k, v, grad_out, kw


def _reference_grads(q, k, v, grad_out, kw):
    def loss():
        return float((reference.attention(q, k, v, **kw).output * grad_out).sum())

    arrays = {"query": q, "key": k, "value": v}
    if "bias" in kw:
        arrays["bias"] = kw["bias"]
    return {name: finite_differences(loss, x) for name, x in arrays.items()}


_FD_CACHE: dict = {}


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("backend", ["numpy", pytest.param("jax", marks=pytest.mark.slow),
                                     "torch"], indirect=True)  # jax: a compile per case
def test_vjp_matches_finite_differences(backend, feature):
    q, k, v, grad_out, kw = _inputs(feature)
    if feature not in _FD_CACHE:
        _FD_CACHE[feature] = _reference_grads(q, k, v, grad_out, kw)
    expected = _FD_CACHE[feature]
    call_kw = {n: backend.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    grads = backend.module.scaled_dot_product_attention_vjp(
        *(backend.asarray(x) for x in (q, k, v, grad_out)), **call_kw
    )
    names = ("query", "key", "value", "bias")
    for name, grad in zip(names, grads, strict=True):
        if name not in expected:
            assert grad is None, f"{name}: gradient without a bias"
            continue
        got = backend.to_numpy(grad)
        assert got.shape == expected[name].shape, name
        assert np.isfinite(got).all(), f"{backend.name} d{name}: not finite, feature={feature}"
        np.testing.assert_allclose(
            got, expected[name], rtol=1e-6, atol=1e-7,
            err_msg=f"{backend.name} d{name} vs finite differences, feature={feature}",
        )
    if feature == "fully_masked_rows":
        empty = ~kw["mask"].any(-1)  # (batch, heads, q_len)
        grad_query = backend.to_numpy(grads[0])
        assert (grad_query[empty] == 0).all(), "fully masked rows must get gradient exactly 0"
        assert (backend.to_numpy(grads[3])[empty] == 0).all()


def test_vjp_needs_the_keep_mask(backend):
    x = backend.asarray(np.ones((3, 4)))
    with pytest.raises(ValueError, match="dropout needs the forward pass's dropout_mask"):
        backend.module.scaled_dot_product_attention_vjp(x, x, x, x, dropout_p=0.5)
    with pytest.raises(ValueError, match=r"grad_output must have the output's shape \(3, 4\)"):
        backend.module.scaled_dot_product_attention_vjp(x, x, x, backend.asarray(np.ones((3, 2))))


def test_float32_vjp_matches_reference(backend):
    """float32 gradients against the float64 reference VJP under the harness's tolerance rule
    (``numerics.assert_vjp_matches_reference``), never against the backend's own float64."""
    q, k, v, grad_out, kw = _inputs("causal_bottom_right")
    arrays = {"query": q, "key": k, "value": v, "grad_output": grad_out}
    arrays = {n: x.astype(np.float32) for n, x in arrays.items()}
    grads = backend.module.scaled_dot_product_attention_vjp(
        *(backend.asarray(arrays[n]) for n in ("query", "key", "value", "grad_output")), **kw
    )
    got = [None if g is None else backend.to_numpy(g) for g in grads]
    assert all(g.dtype == np.float32 for g in got[:3])
    assert_vjp_matches_reference(got, arrays, "float32", what=backend.name, **kw)


# ------------------------------------------------------------------ numpy_attn module backward

MODULES = {
    "SelfAttention": ((4, 3, 2), {}),
    "CrossAttention": ((4, 3, 2), {}),
    "CausalSelfAttention": ((4, 3, 2), {}),
    "MultiHeadAttentionWrapper": ((4, 2, 2, 2), {}),
    "MultiHeadAttention": ((8, 4), {"num_kv_heads": 2}),
}


MODULE_CASES = [(name, {}) for name in sorted(MODULES)] + [
    ("MultiHeadAttention", {"is_causal": True, "cross": True}),
    ("MultiHeadAttention", {"window": (1, 0), "mask": True}),
]


_MODULE_FD: dict = {}


def _module_problem(name, forward_kwargs):
    """Weights, inputs, forward options, grad_output and the weight gradients by central
    differences of the float64 module pipeline (``test_modules.module_reference``; computed
    once per case). numpy_attn's module gives only the weights' names and shapes."""
    key = (name, tuple(sorted(forward_kwargs)))
    if key in _MODULE_FD:
        return _MODULE_FD[key]
    forward_kwargs = dict(forward_kwargs)
    args, kwargs = MODULES[name]
    module = getattr(numpy_attn, name)(*args, rng=np.random.default_rng(0), **kwargs)
    weights = {k: np.random.default_rng(1).standard_normal(w.shape) * 0.7
               for k, w in module.export_weights().items()}
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 5, args[0]))
    context = rng.standard_normal((2, 6, args[0]))
    cross = name == "CrossAttention" or forward_kwargs.pop("cross", False)
    inputs = (x, context) if cross else (x,)
    if forward_kwargs.pop("mask", False):
        forward_kwargs["mask"] = rng.random((2, 1, 5, 5)) < 0.8
    def forward():
        return module_reference(name, args, kwargs, weights, inputs, forward_kwargs)

    grad_out = rng.standard_normal(forward().shape)

    def loss():
        return float((forward() * grad_out).sum())

    expected = {n: finite_differences(loss, w) for n, w in weights.items()}
    _MODULE_FD[key] = (weights, inputs, forward_kwargs, grad_out, expected)
    return _MODULE_FD[key]


@pytest.mark.parametrize(
    "name, forward_kwargs", MODULE_CASES,
    ids=[f"{n}-{'-'.join(kw) or 'plain'}" for n, kw in MODULE_CASES],
)
def test_module_backward_matches_finite_differences(backend, name, forward_kwargs):
    """numpy_attn's hand-written module backward, jax.vjp and torch.autograd, each against
    finite differences of the float64 module pipeline (no backend's forward pass)."""
    weights, inputs, forward_kwargs, grad_out, expected = _module_problem(name, forward_kwargs)
    args, kwargs = MODULES[name]
    module = getattr(backend.module, name)(*args, rng=backend.rng(0), **kwargs)
    module = module.load_weights(weights)
    inputs = [backend.asarray(x) for x in inputs]
    options = {k: backend.asarray(v) if isinstance(v, np.ndarray) else v
               for k, v in forward_kwargs.items()}
    if name == "MultiHeadAttention":
        context = inputs[1] if len(inputs) == 2 else None
        grads = module.parameter_gradients(inputs[0], backend.asarray(grad_out), context, **options)
    else:
        grads = module.parameter_gradients(*inputs, backend.asarray(grad_out))
    assert sorted(grads) == sorted(weights)
    for n in weights:
        assert isinstance(grads[n], np.ndarray), f"{n}: parameter_gradients returns NumPy arrays"
        np.testing.assert_allclose(grads[n], expected[n], rtol=1e-6, atol=1e-7,
                                   err_msg=f"{backend.name} {name} d{n}")


def test_module_backward_never_uses_dropout(backend):
    module = backend.module.CausalSelfAttention(4, 3, 2, dropout_p=0.1, rng=backend.rng(0))
    x = backend.asarray(np.ones((5, 4), np.float32))
    grad_out = backend.asarray(np.ones((5, 2), np.float32))
    with pytest.raises(ValueError, match="dropout is active"):  # refused in training mode
        module.parameter_gradients(x, grad_out)
    module = module.eval()
    assert module.parameter_gradients(x, grad_out)["W_query"].shape == (4, 3)


def test_numpy_optimisers_match_torch():
    torch = pytest.importorskip("torch")
    module = numpy_attn.SelfAttention(4, 3, 2, rng=np.random.default_rng(0))
    module = module.load_weights({k: w.astype(np.float64) for k, w in
                                  module.export_weights().items()})
    params = {k: torch.tensor(w, requires_grad=True) for k, w in module.export_weights().items()}
    adam = numpy_attn.Adam(learning_rate=0.05)
    torch_adam = torch.optim.Adam(params.values(), lr=0.05)
    rng = np.random.default_rng(3)
    for _ in range(5):
        grads = {k: rng.standard_normal(w.shape) for k, w in params.items()}
        module = adam.step(module, grads)
        for k, p in params.items():
            p.grad = torch.tensor(grads[k])
        torch_adam.step()
    for k, w in module.export_weights().items():
        np.testing.assert_allclose(w, params[k].detach().numpy(), rtol=1e-12, atol=1e-14)
    before = module.export_weights()
    grads = {k: np.ones_like(w) for k, w in before.items()}
    after = numpy_attn.sgd_step(module, grads, 0.1).export_weights()
    for k in before:
        np.testing.assert_allclose(after[k], before[k] - 0.1)


def test_sgd_step_and_adams_defaults_follow_their_formulas():
    """``sgd_step``: ``W - lr · dW`` in the weights' dtype; ``Adam()``: Kingma & Ba's update with
    torch's and optax's defaults (lr 1e-3, betas 0.9 and 0.999, eps 1e-8), two steps written
    out."""
    module = numpy_attn.SelfAttention(4, 3, 2, rng=np.random.default_rng(0))
    before = module.export_weights()
    gen = np.random.default_rng(20)
    grads = {k: gen.standard_normal(w.shape) for k, w in before.items()}
    after = numpy_attn.sgd_step(module, grads, 0.1).export_weights()
    for k, w in before.items():
        assert after[k].dtype == w.dtype, k
        np.testing.assert_allclose(after[k], w - 0.1 * grads[k], rtol=1e-5, atol=1e-6)
    module = module.load_weights({k: w.astype(np.float64) for k, w in before.items()})
    adam, steps = numpy_attn.Adam(), [grads, {k: g[::-1] * 0.5 for k, g in grads.items()}]
    for g in steps:
        module = adam.step(module, g)
    for k, w in before.items():
        g1, g2 = steps[0][k], steps[1][k]
        m = (0.9 * 0.1 * g1 + 0.1 * g2) / (1 - 0.9**2)
        s = (0.999 * 0.001 * g1**2 + 0.001 * g2**2) / (1 - 0.999**2)
        first = w - 1e-3 * g1 / (np.abs(g1) + 1e-8)
        want = first - 1e-3 * m / (np.sqrt(s) + 1e-8)
        np.testing.assert_allclose(module.export_weights()[k], want, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("feature", ["mask_bias", "softcap", "gqa", "dropout_mask",
                                     "fully_masked_rows", "causal_bottom_right", "two_d"])
def test_reference_vjp_matches_finite_differences(feature):
    """The harness's float64 gradient reference is itself right."""
    q, k, v, grad_out, kw = _inputs(feature)
    if feature not in _FD_CACHE:
        _FD_CACHE[feature] = _reference_grads(q, k, v, grad_out, kw)
    expected = _FD_CACHE[feature]
    grads = reference.attention_vjp(q, k, v, grad_out, **kw)
    for name in expected:
        np.testing.assert_allclose(getattr(grads, name), expected[name], rtol=1e-6, atol=1e-7,
                                   err_msg=f"reference d{name}, feature={feature}")


# ------------------------------------------------------------------ numpy_attn's explicit VJP
# the score_mod's derivative after the bias and ALiBi, at the tile's positions


def _arrays(q_shape, k_shape, v_dim, seed=0):
    gen = np.random.default_rng(seed)
    q, k = gen.standard_normal(q_shape), gen.standard_normal(k_shape)
    v = gen.standard_normal(k_shape[:-1] + (v_dim,))
    return q, k, v, gen.standard_normal(q_shape[:-1] + (v_dim,))


def test_explicit_vjp_evaluates_the_score_mod_derivative_after_the_bias():
    """The explicit steps (small inputs): a soft-capping score_mod after a bias; its
    derivative is taken at ``S1 + bias``, as the float64 reference takes it."""
    q, k, v, grad_out = _arrays((1, 2, 5, 4), (1, 2, 6, 4), 3, seed=17)
    bias = np.random.default_rng(18).standard_normal((5, 6)) * 2.0
    mod = numpy_attn.masks.softcap_mod(1.5)
    got = numpy_attn.scaled_dot_product_attention_vjp(q * 2, k, v, grad_out, bias=bias,
                                                      score_mod=mod)
    want = reference.attention_vjp(q * 2, k, v, grad_out, bias=bias, score_mod=mod)
    for grad, name in zip(got, ("query", "key", "value", "bias"), strict=True):
        np.testing.assert_allclose(grad, getattr(want, name), rtol=1e-10, atol=1e-12,
                                   err_msg=name)


class _PerPosition:
    """A score_mod whose derivative depends on the positions: ``score · (1 + q/10 + k/20)``."""

    def __call__(self, score, batch, head, q_idx, kv_idx):
        return score * (1.0 + 0.1 * q_idx + 0.05 * kv_idx)

    def derivative(self, score, batch, head, q_idx, kv_idx):
        return np.broadcast_to(1.0 + 0.1 * q_idx + 0.05 * kv_idx, np.broadcast_shapes(
            np.shape(score), np.shape(q_idx), np.shape(kv_idx))).astype(score.dtype)


@pytest.mark.parametrize("mod", ["softcap", "per_position"])
def test_explicit_vjp_evaluates_the_score_mod_derivative_after_alibi(mod):
    """The explicit steps: ALiBi then a score_mod that is not additive; its derivative is
    taken at ``S1 + bias + ALiBi`` at the tile's own positions."""
    q, k, v, grad_out = _arrays((1, 2, 5, 4), (1, 2, 6, 4), 3, seed=19)
    score_mod = numpy_attn.masks.softcap_mod(1.5) if mod == "softcap" else _PerPosition()
    options = {"alibi_slopes": np.array([0.5, 1.0]), "bias": np.linspace(-1, 1, 6),
               "score_mod": score_mod}
    got = numpy_attn.scaled_dot_product_attention_vjp(q * 2, k, v, grad_out, **options)
    want = reference.attention_vjp(q * 2, k, v, grad_out, **options)
    for grad, name in zip(got, ("query", "key", "value", "bias"), strict=True):
        np.testing.assert_allclose(grad, getattr(want, name), rtol=1e-10, atol=1e-12,
                                   err_msg=name)


# ------------------------------------------------------------------------------------------
# numpy_attn's scaled_dot_product_attention_vjp: bad input names the function and the argument
# ------------------------------------------------------------------------------------------

_Q = np.zeros((1, 2, 3, 4), np.float32)
_BAD_ARRAYS = {  # argument: a wrong shape (a Python list is refused as well)
    "mask": np.ones(5, bool), "bias": np.zeros(5, np.float32),
    "dropout_mask": np.ones(5, bool), "sinks": np.zeros(3, np.float32),
    "alibi_slopes": np.zeros(3, np.float32), "segment_ids": np.zeros(7, np.int32),
}
_BAD_OPTIONS = {  # argument: a value the rules refuse
    "is_causal": 1, "causal_alignment": "middle", "window": (1,), "scale": "x",
    "softcap": -1.0, "dropout_p": 1.5, "chunk_size": 0, "score_mod": 3, "mask_mod": 3,
}
BAD_VJP = {f"{name}_shape": ({name: bad}, ValueError, name) for name, bad in _BAD_ARRAYS.items()}
BAD_VJP.update({f"{name}_list": ({name: [1.0]}, TypeError, name)
                for name in ("mask", "bias", "dropout_mask", "sinks", "alibi_slopes")})
BAD_VJP.update({name: ({name: bad}, (TypeError, ValueError), name)
                for name, bad in _BAD_OPTIONS.items()})


class _WrongShape:
    """A score_mod whose result does not broadcast to the scores."""

    def __call__(self, score, batch, head, q_idx, kv_idx):
        return np.zeros(5, score.dtype)

    def derivative(self, score, batch, head, q_idx, kv_idx):
        return np.ones_like(score)


BAD_VJP.update({
    "segment_ids_list_of_one": ({"segment_ids": [np.zeros(3, np.int32)]}, ValueError,
                                "segment_ids"),
    "score_mod_without_derivative": ({"score_mod": lambda s, b, h, q, k: s},
                                     NotImplementedError, "score_mod"),
    "score_mod_wrong_shape": ({"score_mod": _WrongShape()}, ValueError, "score_mod"),
})



def _names(message: str, name: str) -> bool:
    """Whether ``message`` names the argument ``name`` as a whole word (not ``XXnameXX``)."""
    return re.search(rf"(?<![A-Za-z_]){re.escape(name)}(?![A-Za-z_])", message) is not None


@pytest.mark.parametrize("name", sorted(BAD_VJP))
def test_vjp_bad_option_names_the_function_and_argument(name):
    kwargs, exception, word = BAD_VJP[name]
    if "dropout_mask" in kwargs:
        kwargs = {**kwargs, "dropout_p": 0.5}
    with pytest.raises(exception) as info:
        numpy_attn.scaled_dot_product_attention_vjp(_Q, _Q, _Q, _Q, **kwargs)
    message = str(info.value)
    assert message.startswith("scaled_dot_product_attention_vjp: ") and _names(message, word), \
        message


@pytest.mark.parametrize("position", range(4))
def test_vjp_bad_array_names_the_function_and_argument(position):
    """query, key, value, grad_output: a Python list (TypeError), and a grad_output shaped
    unlike the output (ValueError)."""
    name = ("query", "key", "value", "grad_output")[position]
    arrays = [_Q] * 4
    arrays[position] = [[1.0]]
    with pytest.raises(TypeError) as info:
        numpy_attn.scaled_dot_product_attention_vjp(*arrays)
    assert str(info.value).startswith(f"scaled_dot_product_attention_vjp: {name} must"), info.value
    if name == "grad_output":
        with pytest.raises(ValueError, match=r"^scaled_dot_product_attention_vjp: grad_output"):
            numpy_attn.scaled_dot_product_attention_vjp(_Q, _Q, _Q, _Q[..., :3])
