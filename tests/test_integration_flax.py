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
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="needs jax: pip install jax")
pytest.importorskip("flax", reason="needs flax: pip install -e .[flax]")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from flax.nnx.nn.attention import dot_product_attention_weights  # noqa: E402

from conformance import compare, spec  # noqa: E402
from jax_attn.integrations import flax as fx  # noqa: E402

jax.config.update("jax_enable_x64", True)  # float64 reference (as tests/jax_inputs.py)

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


def test_sown_weights():
    """With ``sow_weights=True`` Flax passes ``module``: jax_attn's weights are sown."""
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 4, DIM)), jnp.float32)
    layer = nnx.MultiHeadAttention(HEADS, DIM, attention_fn=fx.attention_fn, decode=False,
                                   rngs=nnx.Rngs(6))
    _, intermediates = nnx.capture(layer, nnx.Intermediate)(x, sow_weights=True)
    weights = intermediates["attention_weights"][0]
    assert weights.shape == (2, HEADS, 4, 4)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=0, atol=1e-6)


def test_one_call_and_declared_signature():
    model = nnx.clone(_seeded_model())
    assert fx.use_jax_attn(model) == LAYERS
    assert all(layer.attention_fn is fx.attention_fn for _, layer in nnx.iter_modules(model)
               if isinstance(layer, nnx.MultiHeadAttention))
    ours = inspect.signature(fx.attention_fn).parameters
    theirs = inspect.signature(nnx.dot_product_attention).parameters
    assert list(ours) == list(theirs)
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]
    declared = spec.BACKEND_INTEGRATIONS["jax_attn"]["flax"]
    assert sorted(fx.__all__) == sorted(declared)
    assert all(getattr(fx, name).__doc__ for name in declared)
    code = "import sys, jax_attn; print('flax' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


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
