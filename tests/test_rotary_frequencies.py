"""``rope_frequencies``: every scaling method against a formula written here (NumPy, float64)
and against transformers' ``ROPE_INIT_FUNCTIONS`` (float32 there: equal within its rounding)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import numpy_attn as na

D, THETA = 16, 10000.0
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + i / 10 for i in range(D // 2)],
            "long_factor": [2.0 + i for i in range(D // 2)], "original_max_position_embeddings": 64}
METHODS = {
    "default": ({"rope_type": "default"}, {}),
    "linear": ({"rope_type": "linear", "factor": 4.0}, {}),
    "dynamic": ({"type": "dynamic", "factor": 2.0}, {"seq_len": 300,
                                                     "max_position_embeddings": 128}),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, {}),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, {}),
    "yarn_mscale": ({"rope_type": "yarn", "factor": 40.0, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "beta_fast": 16, "truncate": False,
                     "original_max_position_embeddings": 64}, {"max_position_embeddings": 2560}),
    "longrope_short": (LONGROPE, {"seq_len": 10, "max_position_embeddings": 256}),
    "longrope_long": (LONGROPE, {"seq_len": 100, "max_position_embeddings": 256}),
}


def formula(scaling, seq_len=None, max_position_embeddings=None):
    """Each method written out with NumPy in float64 (the papers' and transformers' formulas)."""
    i = np.arange(D // 2)
    inv0 = THETA ** (-2.0 * i / D)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return inv0, 1.0
    if kind == "linear":
        return inv0 / scaling["factor"], 1.0
    if kind == "dynamic":
        f, m = scaling["factor"], max_position_embeddings
        base = THETA * (f * max(seq_len, m) / m - (f - 1)) ** (D / (D - 2))
        return base ** (-2.0 * i / D), 1.0
    old = scaling["original_max_position_embeddings"]
    if kind == "llama3":
        f, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * np.pi / inv0
        smooth = np.clip((old / wavelen - lo) / (hi - lo), 0, 1)  # 0 below, 1 above the band
        return (1 - smooth) * inv0 / f + smooth * inv0, 1.0
    f = scaling.get("factor") or max_position_embeddings / old
    if kind == "yarn":
        def mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1

        if scaling.get("mscale"):
            attention = mscale(f, scaling["mscale"]) / mscale(f, scaling["mscale_all_dim"])
        else:
            attention = mscale(f)

        def dim_of(n):
            return D * math.log(old / (n * 2 * math.pi)) / (2 * math.log(THETA))

        low, high = dim_of(scaling.get("beta_fast", 32)), dim_of(scaling.get("beta_slow", 1))
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, D - 1)
        ramp = np.clip((i - low) / (high - low), 0, 1)
        return inv0 * (1 - ramp) + inv0 / f * ramp, attention
    ext = np.array(scaling["long_factor"] if seq_len > old else scaling["short_factor"])
    attention = 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(old))
    return inv0 / ext, attention


@pytest.mark.parametrize("method", METHODS)
def test_every_method_matches_its_formula(method):
    scaling, kwargs = METHODS[method]
    inv_freq, attention = na.rope_frequencies(D, theta=THETA, scaling=dict(scaling), **kwargs)
    expected, expected_attention = formula(scaling, **kwargs)
    assert inv_freq.dtype == np.float64 and inv_freq.shape == (D // 2,)
    np.testing.assert_allclose(inv_freq, expected, rtol=1e-13, atol=0)
    assert attention == pytest.approx(expected_attention, rel=1e-13)
    assert isinstance(attention, float)


def test_the_backends_return_the_same_frequencies():
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    import jax_attn as ja
    import torch_attn as ta

    for scaling, kwargs in METHODS.values():
        inv, factor = na.rope_frequencies(D, scaling=dict(scaling), **kwargs)
        inv_t, factor_t = ta.rope_frequencies(D, scaling=dict(scaling), **kwargs)
        assert inv_t.dtype == torch.float64 and np.array_equal(inv_t.numpy(), inv)
        with jax.enable_x64(True):
            inv_j, factor_j = ja.rope_frequencies(D, scaling=dict(scaling), **kwargs)
            assert np.array_equal(np.asarray(inv_j), inv)
        assert factor == factor_t == factor_j
    with jax.enable_x64(False):
        assert ja.rope_frequencies(D)[0].dtype == np.float32  # x64 off: rounded once


@pytest.mark.parametrize("scaling, kwargs, words", [
    ({"rope_type": "ntk"}, {}, "unknown rope_type 'ntk'"),
    ({"rope_type": "linear"}, {}, "needs the key(s) 'factor'"),
    ({"rope_type": "llama3", "factor": 8.0}, {}, "'low_freq_factor', 'high_freq_factor'"),
    ({"rope_type": "dynamic", "factor": 2.0}, {}, "needs the argument max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 2.0}, {}, "original_max_position_embeddings"),
    ({"rope_type": "linear", "factor": -1.0}, {}, "'factor' must be a finite number > 0"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0], "factor": 2.0,
      "original_max_position_embeddings": 8}, {}, "head_dim // 2 = 8"),
])
def test_bad_scaling_is_a_value_error_naming_scaling_and_the_known_types(scaling, kwargs, words):
    with pytest.raises(ValueError) as info:
        na.rope_frequencies(D, scaling=scaling, **kwargs)
    message = str(info.value)
    assert message.startswith("rope_frequencies: scaling ") and words in message, message
    assert "default, linear, dynamic, llama3, yarn, longrope" in message


def test_bad_arguments():
    for kwargs, kind in [({"head_dim": 7}, ValueError), ({"head_dim": 8, "seq_len": -1},
                         ValueError), ({"head_dim": 8, "scaling": [("rope_type", "linear")]},
                         TypeError), ({"head_dim": 8, "theta": float("inf")}, ValueError)]:
        with pytest.raises(kind, match="^rope_frequencies: "):
            na.rope_frequencies(**kwargs)


@pytest.mark.slow  # importing transformers takes seconds
@pytest.mark.parametrize("method", METHODS)
def test_matches_transformers(method):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers", reason="pip install transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling, kwargs = METHODS[method]
    max_pos = kwargs.get("max_position_embeddings", 256)
    config = transformers.LlamaConfig(
        hidden_size=4 * D, num_attention_heads=4, head_dim=D, max_position_embeddings=max_pos,
        rope_parameters={**scaling, "rope_theta": THETA})
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        theirs, their_attention = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        theirs, their_attention = ROPE_INIT_FUNCTIONS[kind](
            config, "cpu", seq_len=kwargs.get("seq_len"))
    ours, attention = na.rope_frequencies(D, theta=THETA, scaling=dict(scaling),
                                          max_position_embeddings=max_pos,
                                          seq_len=kwargs.get("seq_len"))
    assert str(theirs.dtype) == "torch.float32"
    # transformers computes in float32: a few roundings, amplified by llama3's / yarn's mixing
    np.testing.assert_allclose(theirs.double().numpy(), ours, rtol=4e-6, atol=0)
    assert float(their_attention) == pytest.approx(attention, rel=1e-12)
