"""Tests that kill the mutants the integration tests let live (docs/mutation.md):
``torch_attn/integrations/transformers.py`` and ``jax_attn/integrations/flax.py``.

Each test calls the integration function directly on tiny inputs (no model is built) and
compares with the framework's own attention: transformers' ``eager_attention_forward`` (Gemma
2's: scaling, soft-cap, grouped-query heads, an additive mask) on float64 inputs (its softmax
is float32: ``TOL``; each mutant moves the output by more than 0.05), transformers'
own ``sdpa_mask`` rules written out by hand for the mask builder, and Flax's
``dot_product_attention_weights`` in float64 for ``attention_fn``.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

HAS_TRANSFORMERS = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
HAS_FLAX = all(importlib.util.find_spec(m) for m in ("jax", "flax"))
needs_transformers = pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="needs torch and transformers: pip install -e .[transformers]")
needs_flax = pytest.mark.skipif(not HAS_FLAX, reason="needs jax and flax: pip install -e .[flax]")

if HAS_TRANSFORMERS:
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sliding_window_causal_mask_function
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from torch_attn.integrations import transformers as hf

    MIN64 = torch.finfo(torch.float64).min
TOL = 1e-6  # eager's softmax runs in float32 (dtype=torch.float32), even on float64 inputs


# --- torch_attn/integrations/transformers.py -----------------------------------------------


def _layer(heads: int, kv_heads: int, head_dim: int, **attributes) -> torch.nn.Module:
    """An attention layer as transformers' eager attention reads it (eval mode)."""
    layer = torch.nn.Module().eval()
    layer.head_dim, layer.num_key_value_groups = head_dim, heads // kv_heads
    for name, value in attributes.items():
        setattr(layer, name, value)
    return layer


def _qkv(heads: int = 4, kv_heads: int = 2, q_len: int = 3, kv_len: int = 5, seed: int = 7):
    """float64 query ``(2, heads, q_len, 8)``, key and value ``(2, kv_heads, kv_len, 8)``."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(2, h, n, 8, generator=generator, dtype=torch.float64)
            for h, n in ((heads, q_len), (kv_heads, kv_len), (kv_heads, kv_len)))


def _eager(layer, q, k, v, allowed=None, bias=None, **kwargs) -> torch.Tensor:
    """transformers' eager attention (Gemma 2's) in float64: ``(batch, q_len, heads, v_dim)``.
    ``allowed`` (boolean, True = may attend) becomes its additive mask, plus ``bias``."""
    additive = None
    if allowed is not None:
        additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, MIN64)
    if bias is not None:
        additive = bias if additive is None else additive + bias
    return eager_attention_forward(layer, q.double(), k.double(), v.double(), additive,
                                   **kwargs)[0]


def _bottom_right(q_len: int, kv_len: int) -> torch.Tensor:
    """Query ``i`` (position ``kv_len - q_len + i``) attends keys ``j <= kv_len - q_len + i``."""
    return torch.ones(q_len, kv_len).tril(kv_len - q_len).bool()


@needs_transformers
def test_register_sets_both_tables_under_the_name():
    """``register`` puts ``attention_forward`` and ``attention_mask`` under the name it returns
    (``"torch_attn"`` by default), in both of transformers' tables."""
    assert hf.register() == hf.NAME == "torch_attn"
    assert hf.register("torch_attn_mutation") == "torch_attn_mutation"
    for name in ("torch_attn", "torch_attn_mutation"):
        assert AttentionInterface._global_mapping[name] is hf.attention_forward
        assert AttentionMaskInterface._global_mapping[name] is hf.attention_mask


@needs_transformers
def test_the_module_flag_q_len_and_a_4d_mask_decide_the_causal_rule():
    """Without a mask, ``module.is_causal`` (default True) decides, bottom-right, also for 2
    queries and for one head; a 4-D mask holds the whole rule (no causal rule is added)."""
    q, k, v = _qkv()
    causal, everything = _bottom_right(3, 5), torch.ones(3, 5, dtype=torch.bool)
    for flag, allowed in ((True, causal), (False, everything)):
        layer = _layer(4, 2, 8, is_causal=flag)
        out, _ = hf.attention_forward(layer, q, k, v, None)
        torch.testing.assert_close(out, _eager(layer, q, k, v, allowed), rtol=0, atol=TOL)
    # a 4-D mask that allows every key: bidirectional, whatever the module's flag
    layer = _layer(4, 2, 8)
    out, _ = hf.attention_forward(layer, q, k, v, everything.expand(2, 1, 3, 5))
    torch.testing.assert_close(out, _eager(layer, q, k, v, everything), rtol=0, atol=TOL)
    # two queries (the causal rule still matters), and one head (heads != q_len)
    for shape in ((4, 2, 2, 5), (1, 1, 3, 5)):
        q, k, v = _qkv(*shape)
        layer = _layer(shape[0], shape[1], 8)
        out, _ = hf.attention_forward(layer, q, k, v, None)
        expected = _eager(layer, q, k, v, _bottom_right(shape[2], 5))
        torch.testing.assert_close(out, expected, rtol=0, atol=TOL)
        assert (expected - _eager(layer, q, k, v)).abs().max() > 0.05  # causal is not vacuous


@needs_transformers
def test_scaling_softcap_and_no_dropout_by_default():
    """``scaling`` and ``softcap`` reach the attention (each against eager with the same), and
    a training layer called without ``dropout`` drops nothing (the default is 0)."""
    q, k, v = _qkv()
    layer = _layer(4, 2, 8, is_causal=False)
    for kwargs in ({"scaling": 0.9}, {"softcap": 1.5}, {"scaling": 0.9, "softcap": 1.5}):
        out, _ = hf.attention_forward(layer, q, k, v, None, **kwargs)
        expected = _eager(layer, q, k, v, **kwargs)
        torch.testing.assert_close(out, expected, rtol=0, atol=TOL, msg=str(kwargs))
        assert (expected - _eager(layer, q, k, v)).abs().max() > 0.05, kwargs  # not vacuous
    layer.train()
    out, _ = hf.attention_forward(layer, q, k, v, None)
    torch.testing.assert_close(out, _eager(layer.eval(), q, k, v), rtol=0, atol=TOL)


@needs_transformers
def test_a_float32_mask_is_not_rounded_to_a_half_query():
    """A float32 additive mask on float16 inputs adds in float32, as transformers' eager
    (``float16 + float32`` scores are float32): a finite entry beyond float16's range (here
    ``-1e5`` on every key of one row, a shift the softmax ignores) stays finite, where rounding
    the mask to float16 first would make it ``-inf`` and the row empty (output 0)."""
    q, k, v = (x.half() for x in _qkv())
    layer = _layer(4, 2, 8)
    mask = torch.zeros(2, 1, 3, 5).masked_fill(~_bottom_right(3, 5), torch.finfo().min)
    mask[1, :, 0] -= 1e5  # float32: finite; as float16: -inf
    out, _ = hf.attention_forward(layer, q, k, v, mask)
    assert out.dtype == torch.float16
    expected = eager_attention_forward(layer, q.double(), k.double(), v.double(),
                                       mask.double())[0]
    assert expected[1, 0].abs().max() > 0.1  # eager: the shifted row's softmax, not 0
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-2)


@needs_transformers
def test_integer_and_fully_masked_additive_4d_masks():
    """An integer 4-D mask (nonzero = may attend) is the boolean one; an additive mask whose
    row is all ``finfo.min`` masks that whole row: output 0, as the spec says for a row with
    no key (eager gives the mean of the values there), the other rows as eager's."""
    q, k, v = _qkv()
    layer = _layer(4, 2, 8)
    allowed = _bottom_right(3, 5) & torch.tensor([True, False, True, True, True])
    allowed = allowed.expand(2, 1, 3, 5).clone()
    expected = _eager(layer, q, k, v, allowed)
    out, _ = hf.attention_forward(layer, q, k, v, allowed.int())
    torch.testing.assert_close(out, expected, rtol=0, atol=TOL)
    allowed[1, :, 0] = False  # query 0 of sequence 1: every key at the dtype's minimum
    additive = torch.zeros(2, 1, 3, 5, dtype=torch.float64).masked_fill(~allowed, MIN64)
    out, _ = hf.attention_forward(layer, q, k, v, additive)
    assert torch.all(out[1, 0] == 0)
    torch.testing.assert_close(out[1, 1:], expected[1, 1:], rtol=0, atol=TOL)
    torch.testing.assert_close(out[0], expected[0], rtol=0, atol=TOL)


@needs_transformers
def test_a_mask_of_another_type_raises_naming_the_argument():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"^attention_forward: attention_mask must be a "
                       r"torch\.Tensor or None .*got type\(attention_mask\)=list$"):
        hf.attention_forward(_layer(4, 2, 8), q, k, v, [[True] * 5] * 2)


@needs_transformers
def test_attention_mask_builds_transformers_mask_and_skips_only_where_bottom_right_agrees():
    """The mask builder returns transformers' boolean mask ``(batch, 1, q_len, kv_len)``
    (True = may attend: query position ``q_offset + i`` attends key position ``kv_offset + j``
    when ``j + kv_offset <= i + q_offset``, and the padding), or None only with no padding and
    one query or as many queries as keys, where ``attention_forward``'s bottom-right rule gives
    the same; never for a static cache longer than the prompt (transformers' ``sdpa`` builder
    skips it there, relying on a top-left causal rule)."""
    assert hf.attention_mask(2, 5, 5) is None
    assert hf.attention_mask(2, 1, 5, q_offset=4) is None

    def rule(q_len, kv_len, q_offset=0, kv_offset=0, keys=None):
        i = torch.arange(q_len)[:, None] + q_offset
        j = torch.arange(kv_len)[None, :] + kv_offset
        allowed = (j <= i).expand(2, 1, q_len, kv_len)
        return allowed if keys is None else allowed & keys.bool()[:, None, None, :]

    static = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0]] * 2).bool()  # a prompt of 3 in a cache of 8
    padded = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]).bool()  # left padding
    for args, kwargs, expected in (
        ((2, 3, 5), {"q_offset": 2}, rule(3, 5, 2)),
        ((2, 3, 4), {"q_offset": 2, "kv_offset": 1}, rule(3, 4, 2, 1)),
        ((2, 3, 3), {"allow_is_causal_skip": False}, rule(3, 3)),
        ((2, 3, 8), {"attention_mask": static}, rule(3, 8, keys=static)),
        ((2, 5, 5), {"attention_mask": padded}, rule(5, 5, keys=padded)),
    ):
        got = hf.attention_mask(*args, **kwargs)
        assert got is not None and got.dtype == torch.bool, (args, kwargs)
        assert torch.equal(got, expected), (args, kwargs)
    window = hf.attention_mask(2, 4, 4, mask_function=sliding_window_causal_mask_function(2),
                               allow_is_causal_skip=False)
    expected = rule(4, 4) & ~rule(4, 4, kv_offset=2)  # j in (i - 2, i]
    assert torch.equal(window, expected)
    # the remaining keywords reach sdpa_mask
    assert hf.attention_mask(2, 3, 3, allow_is_causal_skip=False, device="meta").is_meta


# --- jax_attn/integrations/flax.py -----------------------------------------------------------

if HAS_FLAX:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from flax.nnx.nn.attention import dot_product_attention_weights

    from jax_attn.integrations import flax as fx


def _flax_qkv(seed: int, dtype=None):
    """Query ``(2, 3, 4, 8)``, key and value ``(2, 5, 2, 8)`` ("BTNH", grouped-query heads),
    float64 under x64 (every Flax test here shares these shapes: one compile per operation)."""
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(shape), dtype) for shape in
            ((2, 3, 4, 8), (2, 5, 2, 8), (2, 5, 2, 8)))


def _flax_attention(q, k, v, **kwargs):
    """Flax's own attention in float64 (its weights function at HIGHEST precision, then the
    weighted sum, grouped-query value heads repeated): ``(batch, q_len, heads, v_dim)``."""
    weights = dot_product_attention_weights(q, k, precision=jax.lax.Precision.HIGHEST,
                                            **kwargs)  # (batch, heads, q_len, kv_len)
    v = jnp.repeat(v, q.shape[-2] // v.shape[-2], axis=-2)
    return jnp.einsum("...hqk,...khd->...qhd", weights, v, precision=jax.lax.Precision.HIGHEST)


@needs_flax
@pytest.mark.usefixtures("x64_on")
def test_flax_causal_rule_is_top_left_with_fewer_queries_than_keys():
    """Flax's ``is_causal`` is top-left (query ``i`` attends keys ``j <= i``, also with 3
    queries and 5 keys, grouped-query heads): ``attention_fn`` gives Flax's own result."""
    q, k, v = _flax_qkv(8)
    expected = _flax_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(fx.attention_fn(q, k, v, is_causal=True), expected, rtol=0,
                               atol=1e-12)
    bottom_right = _flax_attention(q, k, v, mask=jnp.tril(jnp.ones((3, 5)), 2) > 0)
    assert np.abs(np.asarray(expected - bottom_right)).max() > 0.05  # the alignment matters


@needs_flax
def test_flax_errors_name_the_argument():
    """Dropout without ``dropout_rng``, and any other ``attention_fn`` for the sinks module,
    raise one line naming the argument."""
    q = jnp.zeros((1, 2, 1, 4))
    with pytest.raises(ValueError, match=r"^attention_fn: dropout_rate > 0 and not "
                       r"deterministic needs dropout_rng \(a jax\.random key\)$"):
        fx.attention_fn(q, q, q, dropout_rate=0.5)
    fixed = (r"^MultiHeadAttentionWithSinks: attention_fn is jax_attn's with the module's sinks "
             r"and cannot be replaced; got attention_fn=<function dot_product_attention")
    with pytest.raises(TypeError, match=fixed):
        fx.MultiHeadAttentionWithSinks(2, 4, attention_fn=nnx.dot_product_attention,
                                       rngs=nnx.Rngs(0))
    layer = fx.MultiHeadAttentionWithSinks(2, 4, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=fixed):
        layer.attention_fn = nnx.dot_product_attention


@needs_flax
@pytest.mark.usefixtures("x64_on")
def test_flax_float32_bias_is_not_rounded_to_a_half_query():
    """A float32 ``bias`` on float16 inputs adds in float32, as Flax's own attention (``float16
    + float32`` scores are float32): a finite entry beyond float16's range (``-1e5`` on every
    key of one row, a shift the softmax ignores) stays finite, where rounding the bias to
    float16 first would make it ``-inf`` and the row empty (output 0)."""
    q, k, v = _flax_qkv(9, jnp.float16)
    bias = np.asarray(np.random.default_rng(9).standard_normal((2, 4, 3, 5)), np.float32)
    bias[1, :, 0] -= 1e5  # float32: finite; as float16: -inf
    out = fx.attention_fn(q, k, v, bias=jnp.asarray(bias))
    assert out.dtype == jnp.float16
    expected = _flax_attention(*(x.astype(jnp.float64) for x in (q, k, v)), bias=bias)
    assert np.abs(np.asarray(expected[1, 0])).max() > 0.1  # Flax: the shifted row's softmax
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=0, atol=1e-2)


@needs_flax
def test_flax_sinks_module_passes_flax_arguments_and_param_dtype():
    """``MultiHeadAttentionWithSinks`` hands its positional arguments to Flax's constructor
    (``qkv_features`` here: the kernels of ``nnx.MultiHeadAttention(2, 4, 6)``), and its sinks
    ``(num_heads,)`` are zeros in ``param_dtype``, as Flax's own parameters."""
    layer = fx.MultiHeadAttentionWithSinks(2, 4, 6, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    flax_layer = nnx.MultiHeadAttention(2, 4, 6, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert layer.query.kernel[...].shape == flax_layer.query.kernel[...].shape == (4, 2, 3)
    sinks = layer.sinks[...]
    assert sinks.shape == (2,) and sinks.dtype == flax_layer.query.kernel[...].dtype
    assert sinks.dtype == jnp.bfloat16 and not np.any(np.asarray(sinks, np.float32))


@needs_flax
@pytest.mark.usefixtures("x64_on")
def test_flax_dropout_defaults_are_flax_defaults():
    """Called with only ``dropout_rng`` and ``dropout_rate``, ``attention_fn`` drops what
    Flax's own ``nnx.dot_product_attention`` drops with its defaults (``deterministic=False``,
    ``broadcast_dropout=True``: one keep-mask for every batch and head); with two batch axes,
    either ``broadcast_dropout``, Flax's keep-mask."""
    q, k, v = _flax_qkv(10)
    key = jax.random.key(10)
    ours = fx.attention_fn(q, k, v, dropout_rng=key, dropout_rate=0.4)
    np.testing.assert_allclose(ours, nnx.dot_product_attention(
        q, k, v, dropout_rng=key, dropout_rate=0.4), rtol=0, atol=1e-12)
    for other in ({"deterministic": True}, {"broadcast_dropout": False}):  # not vacuous
        theirs = nnx.dot_product_attention(q, k, v, dropout_rng=key, dropout_rate=0.4, **other)
        assert np.abs(np.asarray(ours - theirs)).max() > 0.05, other
    # two batch axes: one keep-mask, or one of the weights' shape, as Flax draws them
    q, k, v = (x[None] for x in (q, k, v))  # (1, 2, seq, heads, dim)
    for broadcast in (True, False):
        kwargs = dict(dropout_rng=key, dropout_rate=0.4, broadcast_dropout=broadcast)
        np.testing.assert_allclose(fx.attention_fn(q, k, v, **kwargs), nnx.dot_product_attention(
            q, k, v, **kwargs), rtol=0, atol=1e-12, err_msg=str(broadcast))


@needs_flax
@pytest.mark.usefixtures("x64_on")
def test_flax_dtype_promotes_the_inputs():
    """``dtype=float32`` on float64 inputs computes and returns float32, as Flax's own
    ``nnx.dot_product_attention`` with the same ``dtype`` (within float32's error of it)."""
    q, k, v = _flax_qkv(11)
    ours = fx.attention_fn(q, k, v, dtype=jnp.float32)
    theirs = nnx.dot_product_attention(q, k, v, dtype=jnp.float32)
    assert ours.dtype == theirs.dtype == jnp.float32
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
