"""Multi-head latent attention: naive == absorbed, decoding from the latent cache (contiguous
and paged) == naive causal attention over the whole sequence, the three backends agree,
numpy_attn's hand-written gradients == finite differences, signatures and errors; each with
and without ``attention_bias`` (transformers' biases on ``q_a_proj``, ``kv_a_proj_with_mqa``
and ``o_proj``) where the biases enter.

Expected values come from an independent float64 MLA written here (``_reference``: the
naive form, straight from the spec's formulas) or from finite differences."""

from __future__ import annotations

import inspect
import re

import jax
import numpy as np
import pytest
import torch

import jax_attn
import numpy_attn
import torch_attn
from conformance import spec

#: float64 arrays stay float64 in jax_attn too (conftest's fixture, this file only).
pytestmark = pytest.mark.usefixtures("x64_on")

SIZES = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}
D_MODEL, HEADS, SEQ = 32, 4, 7


def _numpy(q_lora_rank=None, **kw):  # noqa: ANN001, ANN003, ANN202
    """A float64 module; the RMSNorm gains away from 1 and the biases (``attention_bias``)
    away from their initial zeros."""
    module = numpy_attn.MultiHeadLatentAttention(
        D_MODEL, HEADS, q_lora_rank=q_lora_rank, rng=np.random.default_rng(0), **SIZES, **kw)
    rng = np.random.default_rng(1)
    weights = {n: w.astype(np.float64) for n, w in module.export_weights().items()}
    for name in weights:
        if name.endswith("layernorm.weight"):
            weights[name] = 1.0 + 0.3 * rng.standard_normal(weights[name].shape)
        elif name.endswith(".bias"):
            weights[name] = 0.5 * rng.standard_normal(weights[name].shape)
    return module.load_weights(weights)


def _rotate_interleaved(x, positions, theta=10000.0):  # noqa: ANN001, ANN202
    """Interleaved RoPE, float64: pairs (2i, 2i+1) by angle p * theta^(-2i/d)."""
    d = x.shape[-1]
    angle = positions[:, None] * theta ** (-np.arange(0, d, 2) / d)  # (seq, d/2)
    cos, sin = np.cos(angle), np.sin(angle)
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 1::2] * cos + x[..., 0::2] * sin
    return out


def _reference(w, x, q_lora_rank):  # noqa: ANN001, ANN202
    """The naive MLA in float64 from the formulas, causal, positions 0..seq-1; a bias absent
    from ``w`` is 0."""
    r, dn, dr, dv = (SIZES[k] for k in ("kv_lora_rank", "qk_nope_head_dim",
                                        "qk_rope_head_dim", "v_head_dim"))
    rms = lambda v, g: g * v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-6)  # noqa: E731
    if q_lora_rank is None:
        q = x @ w["q_proj.weight"].T
    else:
        q_a = x @ w["q_a_proj.weight"].T + w.get("q_a_proj.bias", 0.0)
        q = rms(q_a, w["q_a_layernorm.weight"]) @ w["q_b_proj.weight"].T
    seq = x.shape[-2]
    q = q.reshape(x.shape[0], seq, HEADS, dn + dr).transpose(0, 2, 1, 3)
    pos = np.arange(seq)
    kv_a = x @ w["kv_a_proj_with_mqa.weight"].T + w.get("kv_a_proj_with_mqa.bias", 0.0)
    c = rms(kv_a[..., :r], w["kv_a_layernorm.weight"])
    k_pe = _rotate_interleaved(kv_a[..., r:], pos)[:, None]  # (b, 1, seq, dr)
    kv = (c @ w["kv_b_proj.weight"].T).reshape(x.shape[0], seq, HEADS, dn + dv)
    kv = kv.transpose(0, 2, 1, 3)
    query = np.concatenate([q[..., :dn], _rotate_interleaved(q[..., dn:], pos)], -1)
    key = np.concatenate([kv[..., :dn], np.broadcast_to(k_pe, kv.shape[:-1] + (dr,))], -1)
    scores = query @ key.swapaxes(-1, -2) * (dn + dr) ** -0.5
    scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    context = weights / weights.sum(-1, keepdims=True) @ kv[..., dn:]
    merged = context.transpose(0, 2, 1, 3).reshape(x.shape[0], seq, -1)
    return merged @ w["o_proj.weight"].T + w.get("o_proj.bias", 0.0)


@pytest.fixture(params=[None, 12], ids=["q_proj", "q_lora"])
def q_lora_rank(request):  # noqa: ANN001, ANN201
    return request.param


@pytest.fixture(params=[False, True], ids=["no_bias", "bias"])
def attention_bias(request):  # noqa: ANN001, ANN201
    return request.param


@pytest.fixture
def x():  # noqa: ANN201
    return np.random.default_rng(2).standard_normal((2, SEQ, D_MODEL))


def test_naive_and_absorbed_equal_the_reference_in_float64(q_lora_rank, attention_bias, x):
    module = _numpy(q_lora_rank, attention_bias=attention_bias)
    expected = _reference(module.export_weights(), x, q_lora_rank)
    for absorbed in (False, True):
        out = module.forward(x, is_causal=True, absorbed=absorbed)
        np.testing.assert_allclose(out, expected, rtol=0, atol=1e-13, err_msg=f"{absorbed=}")


def test_absorbed_equals_naive_in_float32(x):
    module = _numpy(12)
    module.load_weights({n: w.astype(np.float32) for n, w in module.export_weights().items()})
    x32 = x.astype(np.float32)
    naive, absorbed = (module.forward(x32, is_causal=True, absorbed=a) for a in (False, True))
    assert naive.dtype == absorbed.dtype == np.float32
    np.testing.assert_allclose(absorbed, naive, rtol=0, atol=2e-6)


def test_mask_is_honoured_in_both_forms(x):
    module = _numpy()
    mask = np.random.default_rng(3).random((SEQ, SEQ)) < 0.6
    mask[:, 0] = True
    naive = module.forward(x, mask=mask)
    np.testing.assert_allclose(module.forward(x, mask=mask, absorbed=True), naive, atol=1e-13)
    assert np.abs(naive - module.forward(x)).max() > 1e-3  # the mask changes the output


def test_decode_token_by_token_equals_causal_forward(q_lora_rank, attention_bias, x):
    module = _numpy(q_lora_rank, attention_bias=attention_bias)
    expected = _reference(module.export_weights(), x, q_lora_rank)
    cache, steps = None, []
    for t in range(SEQ):
        out, cache = module.decode(x[:, t:t + 1], cache, max_len=SEQ)
        steps.append(out)
        np.testing.assert_allclose(out[:, 0], expected[:, t], atol=1e-13, err_msg=f"step {t}")
    assert cache.length == SEQ and cache.key_buffer.shape[-3:] == (1, SEQ, 20)
    assert cache.value_buffer.size == 0  # values are never stored


def test_decode_prompt_then_tokens_paged(attention_bias, x):
    module = _numpy(12, attention_bias=attention_bias)
    expected = _reference(module.export_weights(), x, 12)
    cache = numpy_attn.PagedKVCache(16, 2, 1, 20, 0, dtype="float64")
    out, cache = module.decode(x[:, :3], cache)
    np.testing.assert_allclose(out, expected[:, :3], atol=1e-13)
    for t in range(3, SEQ):
        out, cache = module.decode(x[:, t:t + 1], cache)
        np.testing.assert_allclose(out[:, 0], expected[:, t], atol=1e-13, err_msg=f"step {t}")
    assert [cache.seq_len(b) for b in range(2)] == [SEQ, SEQ]


@pytest.mark.slow
def test_decode_over_a_long_cache_runs_split_kv():
    """Past SPLIT_KV's threshold the contiguous cache is attended in chunks: still equal."""
    module = _numpy()
    long_len = numpy_attn.latent_attention.rules.SPLIT_KV["min_kv_len"] + 5
    xs = np.random.default_rng(4).standard_normal((1, long_len, D_MODEL))
    full = module.forward(xs, is_causal=True)
    out, cache = module.decode(xs[:, :-1], None, max_len=long_len)
    out, cache = module.decode(xs[:, -1:], cache)
    np.testing.assert_allclose(out[:, 0], full[:, -1], atol=1e-12)


@pytest.mark.slow
def test_three_backends_agree(q_lora_rank, attention_bias, x):
    module = _numpy(q_lora_rank, attention_bias=attention_bias)
    weights = module.export_weights()
    expected = module.forward(x, is_causal=True)
    grad = np.random.default_rng(5).standard_normal(expected.shape)
    expected_grads = module.parameter_gradients(x, grad, is_causal=True)
    assert sorted(expected_grads) == sorted(weights)
    kw = dict(q_lora_rank=q_lora_rank, attention_bias=attention_bias, **SIZES)
    tm = torch_attn.MultiHeadLatentAttention(D_MODEL, HEADS, **kw).load_weights(weights)
    jm = jax_attn.MultiHeadLatentAttention(D_MODEL, HEADS, **kw).load_weights(weights)
    assert sorted(tm.state_dict()) == sorted(weights)
    for name, m, to_np in (("torch", tm, lambda t: t.detach().numpy()),
                           ("jax", jm, np.asarray)):
        for absorbed in (False, True):
            out = to_np(m.forward(x, is_causal=True, absorbed=absorbed))
            np.testing.assert_allclose(out, expected, atol=1e-13, err_msg=f"{name} {absorbed=}")
        grads = m.parameter_gradients(x, grad, is_causal=True)
        for key in expected_grads:
            np.testing.assert_allclose(grads[key], expected_grads[key], atol=1e-12,
                                       err_msg=f"{name} {key}")
        cache, outs = None, []
        for t in range(SEQ):
            out, cache = m.decode(x[:, t:t + 1], cache, max_len=SEQ)
            outs.append(to_np(out))
        np.testing.assert_allclose(np.concatenate(outs, 1), expected, atol=1e-13,
                                   err_msg=f"{name} decode")


def test_numpy_gradients_match_finite_differences(q_lora_rank, attention_bias, x):
    module = _numpy(q_lora_rank, attention_bias=attention_bias)
    weights = module.export_weights()
    grad = np.random.default_rng(6).standard_normal((2, SEQ, D_MODEL))
    grads = module.parameter_gradients(x, grad, is_causal=True)
    rng, eps = np.random.default_rng(7), 1e-6
    for name, w in weights.items():
        for _ in range(3):
            idx = tuple(int(rng.integers(0, n)) for n in w.shape)
            loss = []
            for sign in (1, -1):
                moved = {k: v.copy() for k, v in weights.items()}
                moved[name][idx] += sign * eps
                loss.append((module.load_weights(moved).forward(x, is_causal=True) * grad).sum())
            fd = (loss[0] - loss[1]) / (2 * eps)
            assert abs(fd - grads[name][idx]) <= 1e-6 * max(1.0, abs(fd)), (name, idx)
    module.load_weights(weights)


def test_yarn_scale_folds_mscale_all_dim():
    """transformers' yarn_apply_mscale: qk_head_dim^-0.5 * (0.1 * mscale_all_dim * ln(f) + 1)^2."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8,
               "original_max_position_embeddings": 16}
    for backend in (numpy_attn, torch_attn, jax_attn):
        module = backend.MultiHeadLatentAttention(
            D_MODEL, HEADS, rope=backend.RoPE(layout="interleaved", scaling=scaling), **SIZES)
        assert module.scale == pytest.approx(12 ** -0.5 * (0.08 * np.log(4.0) + 1) ** 2)


def _params(obj):  # noqa: ANN001, ANN202
    return [(p.name, p.kind, p.default) for p in inspect.signature(obj).parameters.values()
            if p.name != "self"]


@pytest.mark.parametrize("backend", [numpy_attn, torch_attn, jax_attn],
                         ids=["numpy", "torch", "jax"])
def test_signatures_follow_the_spec(backend):
    stub, cls = spec.MultiHeadLatentAttention, backend.MultiHeadLatentAttention
    assert _params(cls.__init__) == _params(stub.__init__)
    for method in ("forward", "parameter_gradients", "decode", "export_weights",
                   "load_weights", "train", "eval"):
        assert _params(getattr(cls, method)) == _params(getattr(stub, method)), method


@pytest.mark.parametrize("backend", [numpy_attn, torch_attn, jax_attn],
                         ids=["numpy", "torch", "jax"])
def test_errors_are_the_same_in_every_backend(backend):
    make = backend.MultiHeadLatentAttention
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        make(D_MODEL, HEADS, **{**SIZES, "qk_rope_head_dim": 3})
    with pytest.raises(ValueError, match="kv_lora_rank must be an int >= 1"):
        make(D_MODEL, HEADS, **{**SIZES, "kv_lora_rank": 0})
    with pytest.raises(TypeError, match="rope must be a RoPE or None"):
        make(D_MODEL, HEADS, rope="interleaved", **SIZES)
    with pytest.raises(ValueError, match="rope.rotary_dim must be None or qk_rope_head_dim"):
        make(D_MODEL, HEADS, rope=backend.RoPE(rotary_dim=2), **SIZES)
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match=re.escape(
                f"MultiHeadLatentAttention: attention_bias must be a bool (True or False); "
                f"got attention_bias={bad!r}")):
            make(D_MODEL, HEADS, attention_bias=bad, **SIZES)
    module = make(D_MODEL, HEADS, **SIZES)
    with pytest.raises(ValueError, match=r"x must be \(..., seq, d_model\) with d_model=32; "
                       r"got x.shape=\(2, 3, 31\)"):
        module.forward(np.zeros((2, 3, 31), np.float32))
    with pytest.raises(TypeError, match="absorbed must be a bool"):
        module.forward(np.zeros((2, 3, 32), np.float32), absorbed=1)
    with pytest.raises(ValueError, match="weight names differ"):
        module.load_weights({"q_proj.weight": np.zeros((80, 32))})
    biased = make(D_MODEL, HEADS, attention_bias=True, **SIZES).export_weights()
    with pytest.raises(ValueError, match=re.escape(
            "weight names differ; missing [], unexpected ['kv_a_proj_with_mqa.bias', "
            "'o_proj.bias']")):
        module.load_weights(biased)
    wrong = backend.KVCache.empty((2,), 1, 4, 20, 20)  # values stored: not a latent cache
    with pytest.raises(ValueError, match=r"cache must be a latent cache .* got \(kv_heads, "
                       r"head_dim, v_dim\)=\(1, 20, 20\)"):
        module.decode(np.zeros((2, 1, 32), np.float32), wrong)


#: Each backend's seeded random source for the initial weights.
SEEDS = {"numpy": lambda: np.random.default_rng(0),
         "torch": lambda: torch.Generator().manual_seed(0),
         "jax": lambda: jax.random.PRNGKey(0)}


@pytest.mark.parametrize("backend", [numpy_attn, torch_attn, jax_attn],
                         ids=["numpy", "torch", "jax"])
def test_biases_are_zeros_in_transformers_order_and_change_no_draw(backend):
    """``attention_bias=True``: transformers' bias names in its ``state_dict`` order, zeros,
    and every other weight the same as the seeded module's without biases."""
    seed = SEEDS[backend.__name__.removesuffix("_attn")]
    for q_lora_rank, names in (
        (12, ["q_a_proj.weight", "q_a_proj.bias", "q_a_layernorm.weight", "q_b_proj.weight",
              "kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias", "kv_a_layernorm.weight",
              "kv_b_proj.weight", "o_proj.weight", "o_proj.bias"]),
        (None, ["q_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias",
                "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight", "o_proj.bias"]),
    ):
        plain, biased = (backend.MultiHeadLatentAttention(
            D_MODEL, HEADS, q_lora_rank=q_lora_rank, attention_bias=flag, rng=seed(), **SIZES)
            for flag in (False, True))
        exported = biased.export_weights()
        assert list(exported) == names
        if backend is torch_attn:
            assert list(biased.state_dict()) == names
        plain_weights = plain.export_weights()
        assert set(plain_weights) == {n for n in names if not n.endswith(".bias")}
        for name, weight in exported.items():
            if name.endswith(".bias"):
                assert weight.dtype == np.float32
                np.testing.assert_array_equal(weight, np.zeros(weight.shape, np.float32))
            else:
                np.testing.assert_array_equal(weight, plain_weights[name], err_msg=name)
        assert exported["o_proj.bias"].shape == (D_MODEL,)
        assert exported["kv_a_proj_with_mqa.bias"].shape == (20,)  # kv_lora_rank + rope dims
        if q_lora_rank is not None:
            assert exported["q_a_proj.bias"].shape == (q_lora_rank,)
