"""jax_attn inside Flax NNX: a small causal language model whose ``nnx.MultiHeadAttention``
layers use ``jax_attn.integrations.flax.attention_fn`` gives the logits and parameter gradients
of the same model with Flax's own attention, inside ``nnx.jit``, on a padded batch.

The float64 reference is Flax's own weights path (its ``dot_product_attention_weights``, then
the weighted sum): ``nnx.dot_product_attention`` hands dropout-free calls to
``jax.nn.dot_product_attention``, whose softmax is float32 even for float64 inputs. float32
results pass the spec's tolerance rule, ``e`` being ``nnx.dot_product_attention``'s own float32
error. Padding follows Flax's usual ``make_attention_mask(tokens > 0, tokens > 0)``: a padding
query attends nothing (Flax: the mean of the values, jax_attn: 0), so only real tokens are
compared and the loss leaves padding out.

The model's layers pass neither ``bias``, ``is_causal``, ``dtype`` nor ``module``: direct calls
(``_direct_calls``, one ``jax.jit``) check them against Flax's ``dot_product_attention_weights``
in float64 (its bias, mask and causal path), the sown weights also against those Flax's own
attention sows from the same layer. Further direct calls (tests from mutation testing,
docs/mutation.md) check Flax's top-left causal rule with fewer queries than keys, a float32 bias
on half inputs, dropout's defaults and keep-masks, ``dtype``, the errors' messages, and the sinks
module's constructor arguments and ``param_dtype``.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from pathlib import Path

import numpy as np
import pytest
from subprocesses import imported_with

jax = pytest.importorskip("jax", reason="needs jax: pip install jax")
pytest.importorskip("flax", reason="needs flax: pip install -e .[flax]")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from flax.nnx.nn.attention import dot_product_attention_weights  # noqa: E402

from conformance import spec  # noqa: E402
from conformance.comparing import compare  # noqa: E402
from jax_attn.integrations import flax as fx  # noqa: E402

# The float64 reference needs JAX's x64 switch: on for each test of this file only (conftest's
# ``x64_on``), never for the whole run, whose other tests see JAX's default.
pytestmark = pytest.mark.usefixtures("x64_on")

ROOT = Path(__file__).resolve().parent.parent
HIGHEST = jax.lax.Precision.HIGHEST
VOCAB, DIM, HEADS, LAYERS = 96, 32, 4, 2


def _flax_weights_path(query, key, value, bias=None, mask=None, **kwargs):
    """Flax's own attention, float64-exact: its weights function, then the weighted sum."""
    weights = dot_product_attention_weights(query, key, bias, mask, precision=HIGHEST)
    return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=HIGHEST)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.attention = nnx.MultiHeadAttention(HEADS, DIM, decode=False, rngs=rngs)
        self.norm1, self.norm2 = nnx.LayerNorm(DIM, rngs=rngs), nnx.LayerNorm(DIM, rngs=rngs)
        self.mlp = nnx.Linear(DIM, DIM, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attention(self.norm1(x), mask=mask)
        return x + jax.nn.gelu(self.mlp(self.norm2(x)))


class TinyLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens):  # tokens (batch, seq), 0 = padding
        mask = nnx.make_attention_mask(tokens > 0, tokens > 0)  # (batch, 1, seq, seq)
        mask = nnx.combine_masks(mask, nnx.make_causal_mask(tokens))
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)  # (batch, seq, vocab)


def _tokens():
    tokens = np.random.default_rng(3).integers(1, VOCAB, (2, 12))
    tokens[1, :5] = 0  # left padding
    return jnp.asarray(tokens)


@functools.cache
def _seeded_model():
    return TinyLM(nnx.Rngs(0))


def _model(attention, dtype):
    """The seeded model in ``dtype`` with ``attention`` in every attention layer."""
    model = nnx.clone(_seeded_model())
    for _, layer in nnx.iter_modules(model):
        if isinstance(layer, nnx.MultiHeadAttention):
            layer.attention_fn = attention
    state = nnx.state(model)
    nnx.update(model, jax.tree.map(lambda p: p.astype(dtype), state))
    return model


@nnx.jit
def _logits_and_grads(model, tokens):
    real = (tokens > 0).astype(jnp.float32)

    def loss(model):
        logits = model(tokens)  # (batch, seq, vocab); position t predicts token t + 1
        nll = -jax.nn.log_softmax(logits[:, :-1]).astype(jnp.float64)
        nll = jnp.take_along_axis(nll, tokens[:, 1:, None], -1)[..., 0]
        weight = real[:, 1:] * real[:, :-1]
        return (nll * weight).sum() / weight.sum(), logits

    (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return logits, grads


@functools.cache
def _run(attention, dtype):
    logits, grads = _logits_and_grads(_model(attention, dtype), _tokens())
    flat = {jax.tree_util.keystr(path): np.asarray(g, np.float64)
            for path, g in jax.tree_util.tree_leaves_with_path(grads)}
    return np.asarray(logits, np.float64), flat


def _worst(actual, expected, baseline: float) -> float:
    bound = compare.bound(expected, baseline, "float32")
    return float(np.max(np.abs(actual - expected) / bound))


@pytest.mark.slow
def test_model_equals_flax_attention_forward_and_grad_under_jit():
    real = np.asarray(_tokens() > 0)
    ref_logits, ref_grads = _run(_flax_weights_path, jnp.float64)
    logits, grads = _run(fx.attention_fn, jnp.float64)
    assert np.abs(logits - ref_logits)[real].max() <= 1e-12
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for name, grad in grads.items():
        assert np.abs(grad - ref_grads[name]).max() <= 1e-12 * max(
            np.abs(ref_grads[name]).max(), 1.0), name
    flax_logits, flax_grads = _run(nnx.dot_product_attention, jnp.float32)
    logits, grads = _run(fx.attention_fn, jnp.float32)
    e = np.abs(flax_logits - ref_logits)[real].max()
    assert _worst(logits[real], ref_logits[real], e) <= 1.0
    for name, grad in grads.items():
        e = np.abs(flax_grads[name] - ref_grads[name]).max()
        assert _worst(grad, ref_grads[name], e) <= 1.0, name
    # the padding mask reaches the attention: a padding query attends nothing, where Flax
    # gives the mean of the values and jax_attn 0
    assert np.abs(logits - flax_logits)[~real].min() > 1e-3


@jax.jit
def _dropout_outputs(q, k, v, rng):
    """Per ``broadcast_dropout``: jax_attn's and Flax's output with dropout, and jax_attn's
    output without dropout and with ``deterministic=True``. The mask is float 0/1, as
    ``MultiHeadAttention(decode=True)`` builds it from its cache index."""
    mask = jnp.tril(jnp.ones((5, 5)))[None, None]  # (1, 1, q_len, kv_len), 1.0 = may attend
    results = []
    for broadcast in (True, False):
        kwargs = dict(mask=mask, dropout_rng=rng, dropout_rate=0.3,
                      broadcast_dropout=broadcast, deterministic=False)
        results.append((fx.attention_fn(q, k, v, **kwargs),
                        nnx.dot_product_attention(q, k, v, **kwargs),  # Flax's dropout path
                        fx.attention_fn(q, k, v, mask=mask),
                        fx.attention_fn(q, k, v, **{**kwargs, "deterministic": True})))
    return results


def test_dropout_draws_flax_keep_mask_from_dropout_rng():
    q, k, v = np.random.default_rng(4).standard_normal((3, 2, 5, 4, 8))  # (batch, seq, heads, dim)
    for ours, theirs, without, deterministic in _dropout_outputs(q, k, v, jax.random.key(4)):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)
        assert np.abs(np.asarray(ours - without)).max() > 0.1  # dropout did something
        np.testing.assert_array_equal(deterministic, without)


class _Sink(nnx.Module):
    """A module for ``attention_fn(module=...)`` to sow its weights into."""


@functools.cache
def _direct_calls() -> dict:
    """``attention_fn`` called directly, next to Flax's own functions on the same float64
    inputs ``(batch, batch, seq, heads, dim) = (3, 2, 5, 4, 8)``, under one ``jax.jit``:

    * ``out``, ``sown``: with a bias ``(1, 1, heads, 5, 5)``, a float 0/1 mask and
      ``is_causal``, sowing into a module; ``weights``: Flax's ``dot_product_attention_weights``
      of the same (its bias, mask and causal path), and ``without_*`` each without one of them;
    * ``ours32``, ``flax32``: ``dtype=float32`` (jax_attn, ``nnx.dot_product_attention``);
      ``exact``: Flax's weights path in float64 without ``dtype``."""
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((3, 3, 2, 5, 4, 8))
    bias = rng.standard_normal((1, 1, 4, 5, 5))  # broadcast over the batch axes
    mask = (rng.random((3, 2, 1, 5, 5)) < 0.8).astype(np.float64)  # 1.0 = may attend
    mask[..., 0] = 1.0  # every query keeps a key under the causal rule

    @jax.jit
    def run(q, k, v, bias, mask):
        def flax_weights(bias, mask, is_causal):
            return dot_product_attention_weights(q, k, bias, mask, is_causal=is_causal,
                                                 precision=HIGHEST)

        def call(sink):
            return fx.attention_fn(q, k, v, bias=bias, mask=mask, is_causal=True, module=sink)

        out, sown = nnx.capture(call, nnx.Intermediate)(_Sink())
        return {"out": out, "sown": sown["attention_weights"][0],
                "weights": flax_weights(bias, mask, True),
                "without_bias": flax_weights(None, mask, True),
                "without_mask": flax_weights(bias, None, True),
                "without_causal": flax_weights(bias, mask, False),
                "ours32": fx.attention_fn(q, k, v, dtype=jnp.float32),
                "flax32": nnx.dot_product_attention(q, k, v, dtype=jnp.float32),
                "exact": _flax_weights_path(q, k, v)}

    result = run(q, k, v, bias, mask)
    return {"v": v, **result}


def test_bias_mask_causal_and_sown_weights_equal_flax():
    """The output and the sown weights of a call with a bias, a float 0/1 mask and
    ``is_causal`` equal Flax's own weights in float64; each of the three changes those weights
    (none is vacuous here)."""
    got = _direct_calls()
    weights = np.asarray(got["weights"])  # (3, 2, heads, q_len, kv_len)
    np.testing.assert_allclose(got["sown"], weights, rtol=0, atol=1e-12)
    expected = np.einsum("...hqk,...khd->...qhd", weights, got["v"])
    np.testing.assert_allclose(got["out"], expected, rtol=0, atol=1e-12)
    for name in ("without_bias", "without_mask", "without_causal"):
        assert np.abs(np.asarray(got[name]) - weights).max() > 0.05, name


def test_dtype_promotes_as_flax():
    """``dtype=float32`` on float64 inputs gives float32, as Flax's, within the spec's float32
    bound of the float64 result (``e``: Flax's own float32 error)."""
    got = _direct_calls()
    assert got["ours32"].dtype == got["flax32"].dtype == jnp.float32
    exact = np.asarray(got["exact"])
    e = float(np.abs(np.asarray(got["flax32"], np.float64) - exact).max())
    assert _worst(np.asarray(got["ours32"], np.float64), exact, e) <= 1.0


@nnx.jit
def _sown_weights(ours, theirs, x):
    """The weights each layer sows with ``sow_weights=True``: ``(batch, heads, seq, seq)``."""
    return [nnx.capture(layer, nnx.Intermediate)(x, sow_weights=True)[1]["attention_weights"][0]
            for layer in (ours, theirs)]


def test_sown_weights():
    """With ``sow_weights=True`` Flax passes ``module``: jax_attn sows the weights that Flax's
    own attention sows from the same layer (a layer of the seeded model, float32)."""
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 4, DIM)), jnp.float32)
    layer = _seeded_model().blocks[0].attention
    ours, theirs = nnx.clone(layer), nnx.clone(layer)
    ours.attention_fn, theirs.attention_fn = fx.attention_fn, nnx.dot_product_attention
    got, expected = _sown_weights(ours, theirs, x)
    assert got.shape == (2, HEADS, 4, 4)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_one_call_and_declared_signature():
    model = nnx.clone(_seeded_model())
    assert fx.use_jax_attn(model) == LAYERS
    assert all(layer.attention_fn is fx.attention_fn for _, layer in nnx.iter_modules(model)
               if isinstance(layer, nnx.MultiHeadAttention))
    ours = inspect.signature(fx.attention_fn).parameters
    theirs = inspect.signature(nnx.dot_product_attention).parameters
    assert list(ours) == [*theirs, "sinks"]  # Flax's, and the sinks Flax has not
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()] + [None]
    declared = spec.BACKEND_INTEGRATIONS["jax_attn"]["flax"]
    assert sorted(fx.__all__) == sorted(declared)
    assert all(getattr(fx, name).__doc__ for name in declared)
    result = imported_with("jax_attn", "flax", cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def _explicit_mha(params, x, mask, sinks):
    """An explicit float64 ``nnx.MultiHeadAttention`` with attention sinks (GPT-OSS's eager:
    a column of sink logits joined to the scores before the softmax, dropped after it), from
    the layer's parameters ``params`` (``nnx.state(layer, nnx.Param)`` as a pure dict):
    ``x (batch, seq, features)``, ``mask (batch, 1, seq, seq)`` bool, ``sinks (heads,)``."""
    def project(name):  # (batch, seq, heads, head_dim)
        return (jnp.einsum("bsi,ihd->bshd", x, params[name]["kernel"], precision=HIGHEST)
                + params[name]["bias"])

    q, k, v = project("query"), project("key"), project("value")
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) / np.sqrt(q.shape[-1])
    scores = jnp.where(mask, scores, -jnp.inf)  # (batch, heads, q_len, kv_len)
    column = jnp.broadcast_to(sinks[None, :, None, None], scores.shape[:-1] + (1,))
    weights = jax.nn.softmax(jnp.concatenate([scores, column], -1), -1)[..., :-1]
    heads = jnp.einsum("bhqk,bkhd->bqhd", weights, v, precision=HIGHEST)
    return (jnp.einsum("bqhd,hdo->bqo", heads, params["out"]["kernel"], precision=HIGHEST)
            + params["out"]["bias"])


@nnx.jit
def _sinks_layer_and_explicit(layer, x, mask, cotangent):
    """Under one ``nnx.jit``: the layer's output and parameter gradients of
    ``sum(output · cotangent)``, the explicit computation's (``jax.grad``), the explicit output
    without sinks, and ``attention_fn(..., sinks=...)`` called directly on the projections."""
    def loss(layer):
        out = layer(x, mask=mask)
        return jnp.sum(out * cotangent), out

    (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(layer)
    params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    sinks = params.pop("sinks")

    def explicit_loss(params, sinks):
        return jnp.sum(_explicit_mha(params, x, mask, sinks) * cotangent)

    q, k, v = (jnp.einsum("bsi,ihd->bshd", x, params[n]["kernel"], precision=HIGHEST)
               + params[n]["bias"] for n in ("query", "key", "value"))
    return {"out": out, "grads": nnx.to_pure_dict(grads), "params": params,
            "expected": _explicit_mha(params, x, mask, sinks),
            "expected_grads": jax.grad(explicit_loss, argnums=(0, 1))(params, sinks),
            "no_sinks": _explicit_mha(params, x, mask, sinks - jnp.inf),
            "direct": fx.attention_fn(q, k, v, mask=mask, sinks=sinks)}


def test_sinks_module_forward_and_grad_equal_explicit_float64():
    """``MultiHeadAttentionWithSinks`` (learned sinks, an ``nnx.Param``) gives, inside
    ``nnx.jit``, the output and every parameter's gradient (the sinks' included) of an explicit
    float64 computation with a sink column, on a padded causal batch whose padding queries
    attend nothing (output: the output bias alone); ``attention_fn(..., sinks=...)`` called
    directly gives the same attention, and ``decode=True`` (Flax's cache, token by token) the
    causal one. The sinks start at 0, are not vacuous here, and ``attention_fn`` cannot be
    replaced."""
    layer = fx.MultiHeadAttentionWithSinks(HEADS, 16, decode=False, param_dtype=jnp.float64,
                                           rngs=nnx.Rngs(1))
    np.testing.assert_array_equal(layer.sinks[...], np.zeros(HEADS))
    layer.sinks[...] = jnp.array([1.5, -0.5, 0.0, 2.5])
    rng = np.random.default_rng(6)
    x, cotangent = (jnp.asarray(rng.standard_normal((2, 5, 16))) for _ in range(2))
    real = np.array([[True] * 5, [False, False, True, True, True]])  # left padding
    mask = jnp.asarray(real[:, None, :, None] & real[:, None, None, :] & np.tri(5, dtype=bool))
    got = _sinks_layer_and_explicit(layer, x, mask, cotangent)
    expected, params = got["expected"], got["params"]
    np.testing.assert_allclose(got["out"], expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got["out"][1, :2], np.broadcast_to(params["out"]["bias"], (2, 16)),
                               rtol=0, atol=1e-12)  # padding queries: all weight on the sink
    assert np.abs(expected - got["no_sinks"])[0].max() > 1e-2  # the sinks matter here
    expected_grads, expected_dsinks = got["expected_grads"]
    grads = dict(got["grads"])
    np.testing.assert_allclose(grads.pop("sinks"), expected_dsinks, rtol=0, atol=1e-12)
    assert np.abs(expected_dsinks).min() > 1e-3
    leaves = jax.tree_util.tree_leaves_with_path(expected_grads)
    assert len(leaves) == 8  # query, key, value, out: kernel and bias
    for path, grad in leaves:
        actual = grads
        for key in path:
            actual = actual[key.key]
        np.testing.assert_allclose(actual, grad, rtol=0, atol=1e-11,
                                   err_msg=jax.tree_util.keystr(path))
    direct = np.einsum("bqhd,hdo->bqo", got["direct"], params["out"]["kernel"])
    np.testing.assert_allclose(direct + params["out"]["bias"], expected, rtol=0, atol=1e-12)
    # decode=True: Flax's cache, one token at a time (one program), gives the causal forward
    layer.init_cache((2, 5, 16), dtype=jnp.float64)
    step = nnx.jit(lambda layer, token: layer(token, decode=True))
    decoded = np.concatenate([step(layer, x[:, t:t + 1]) for t in range(5)], axis=1)
    causal = jnp.asarray(np.broadcast_to(np.tri(5, dtype=bool), (2, 1, 5, 5)))
    expected = jax.jit(_explicit_mha)(params, x, causal, layer.sinks[...])
    np.testing.assert_allclose(decoded, expected, rtol=0, atol=1e-12)
    with pytest.raises(TypeError, match="attention_fn is jax_attn's"):
        layer.attention_fn = nnx.dot_product_attention
    with pytest.raises(TypeError, match="attention_fn is jax_attn's"):
        fx.MultiHeadAttentionWithSinks(HEADS, 16, attention_fn=fx.attention_fn, rngs=nnx.Rngs(1))
    assert fx.use_jax_attn(layer) == 1  # setting jax_attn's own is accepted


# ------------------------------------------------------------------------------------------
# attention_fn and the sinks module called directly against Flax's own attention in float64:
# the causal rule's alignment, errors, a float32 bias on half inputs, dropout's defaults,
# dtype promotion (tests from mutation testing, docs/mutation.md)
# ------------------------------------------------------------------------------------------


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


def test_flax_causal_rule_is_top_left_with_fewer_queries_than_keys():
    """Flax's ``is_causal`` is top-left (query ``i`` attends keys ``j <= i``, also with 3
    queries and 5 keys, grouped-query heads): ``attention_fn`` gives Flax's own result."""
    q, k, v = _flax_qkv(8)
    expected = _flax_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(fx.attention_fn(q, k, v, is_causal=True), expected, rtol=0,
                               atol=1e-12)
    bottom_right = _flax_attention(q, k, v, mask=jnp.tril(jnp.ones((3, 5)), 2) > 0)
    assert np.abs(np.asarray(expected - bottom_right)).max() > 0.05  # the alignment matters


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


@pytest.mark.slow
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


def test_flax_dtype_promotes_the_inputs():
    """``dtype=float32`` on float64 inputs computes and returns float32, as Flax's own
    ``nnx.dot_product_attention`` with the same ``dtype`` (within float32's error of it)."""
    q, k, v = _flax_qkv(11)
    ours = fx.attention_fn(q, k, v, dtype=jnp.float32)
    theirs = nnx.dot_product_attention(q, k, v, dtype=jnp.float32)
    assert ours.dtype == theirs.dtype == jnp.float32
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_the_documented_snippets_print_what_the_docs_say():
    """The flax snippets of docs/integrations.md, run here, print their documented text."""
    from test_docs import check_snippets_in_process

    check_snippets_in_process(ROOT / "docs" / "integrations.md", "from flax")


def test_the_example_runs_and_agrees():
    path = ROOT / "examples" / "flax_nnx.py"
    spec_ = importlib.util.spec_from_file_location("flax_nnx", path)
    example = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(example)
    result = example.run(new_tokens=3, rounds=1)
    assert result["tokens"]["jax_attn"] == result["tokens"]["flax"]
    assert len(result["tokens"]["flax"]) == 2 and all(len(r) == 3 for r in result["tokens"]["flax"])
    assert result["max_logit_diff"] < 1e-4
    assert all(rate > 0 for rate in result["tokens_per_s"].values())
