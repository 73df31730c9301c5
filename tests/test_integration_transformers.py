"""torch_attn inside Hugging Face transformers: real model classes from tiny configs (random,
seeded weights; nothing is downloaded) give the logits, greedy generations and gradients of
transformers' own ``eager`` attention.

Each family exercises a part of the spec: Llama grouped-query heads, Mistral a sliding window
shorter than the prompt and the generation, Gemma 2 logit soft-capping with alternating
sliding/full layers, BERT bidirectional attention over a padded batch, GPT-OSS learned attention
sinks (``s_aux``) with alternating sliding/full layers and a mixture-of-experts MLP.

The float64 reference is transformers' ``eager`` attention with its softmax in float64
(``_eager_float64``): ``eager`` itself runs the softmax of these decoders in float32, so its
float64 logits are float32-accurate, and NaN for a left-padded sequence (docs/integrations.md).
GPT-OSS's own ``eager`` (transformers has no ``sdpa`` path for it) runs its softmax, sink column
included, in the input dtype and gives 0 where a row attends no key, as the spec: it is the
reference itself, compared at every position, padding included.
float32 results pass the spec's tolerance rule: ``|x - ref| <= atol + k·e`` with ``e`` the error
of ``eager`` in float32 against the same reference.

Direct calls of ``attention_forward`` check what the models do not exercise against an explicit
float64 computation (``_explicit``): the mask formats, bottom-right decoding, a float mask with
finite entries (a bias, besides the dtype minimum that masks) and ``position_bias``. Other
direct calls compare with transformers' own eager attention (Gemma 2's, ``_eager``) in float64:
the module's causal flag and a 4-D mask, scaling, soft-cap and no dropout by default, a float32
mask on half inputs, integer and fully masked additive masks; ``register`` fills both of
transformers' tables, and ``attention_mask`` builds transformers' mask, skipping it only where
the bottom-right rule gives the same (tests from mutation testing, docs/mutation.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from subprocesses import imported_with

torch = pytest.importorskip("torch", reason="needs torch: pip install torch==2.13.0")
transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install -e .[transformers]"
)

from transformers import (  # noqa: E402
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    BertConfig,
    Gemma2Config,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
)
from transformers.masking_utils import (  # noqa: E402
    eager_mask,
    sliding_window_causal_mask_function,
)
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward  # noqa: E402

from conformance import spec  # noqa: E402
from conformance.comparing import compare  # noqa: E402
from torch_attn.integrations import transformers as hf  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = "eager_float64"
NEW_TOKENS = 20
LENGTHS = (10, 6)  # the second sequence is padded by 4


def _eager_float64(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                   softcap=None, **kwargs):
    """transformers' eager attention (repeat the key/value heads, scale, soft-cap, add the
    additive mask, softmax, weighted sum) with the softmax in the input dtype."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(2, 3) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1)
    return (weights @ value).transpose(1, 2).contiguous(), weights


AttentionInterface.register(REFERENCE, _eager_float64)
AttentionMaskInterface.register(REFERENCE, eager_mask)
NAME = hf.register()

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=64, initializer_range=0.2,
              pad_token_id=0)
FAMILIES = {
    "llama": lambda: LlamaConfig(**COMMON, num_key_value_heads=2),
    "mistral": lambda: MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=4),
    "gemma2": lambda: Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=8,
                                   sliding_window=4, query_pre_attn_scalar=8,
                                   attn_logit_softcapping=2.0, final_logit_softcapping=None),
    "bert": lambda: BertConfig(**COMMON, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0),
    # the smallest GPT-OSS: 2 layers (sliding, full), 4 experts of 2 per token, sinks per head;
    # plain RoPE instead of its YaRN scaling (the attention is what is checked here)
    "gpt_oss": lambda: GptOssConfig(**{**COMMON, "intermediate_size": 32}, num_key_value_heads=2,
                                    head_dim=8, sliding_window=4, num_local_experts=4,
                                    num_experts_per_tok=2,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
}
#: Families whose own ``eager`` is float64-exact and gives 0 on rows without a key (as the spec).
OWN_EAGER = {"gpt_oss"}


def _reference(family: str) -> str:
    return "eager" if family in OWN_EAGER else REFERENCE


def _build(family: str, attn: str):
    """The family's tiny model in float64 (seed 0: the same weights for every implementation)."""
    torch.manual_seed(0)
    config = FAMILIES[family]()
    cls = AutoModelForMaskedLM if family == "bert" else AutoModelForCausalLM
    # GPT-OSS: the experts' loop (the default grouped matmul has no float64 kernel)
    experts = {"experts_implementation": "eager"} if family == "gpt_oss" else {}
    model = cls.from_config(config, attn_implementation=attn, dtype=torch.float64, **experts)
    return model


def _batch(family: str):
    """Token ids ``(2, 10)`` and the padding mask (left padding; right padding for BERT)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (len(LENGTHS), max(LENGTHS)), generator=generator)
    positions = torch.arange(max(LENGTHS))
    lengths = torch.tensor(LENGTHS)[:, None]
    if family == "bert":
        mask = positions < lengths
    else:
        mask = positions >= max(LENGTHS) - lengths
    return ids.masked_fill(~mask, 0), mask.long()


_RUNS: dict = {}


def _run(family: str, attn: str, dtype):
    """Logits ``(2, 10, vocab)`` and every parameter's gradient of one training step's loss,
    cached per (family, attn, dtype). The loss leaves out every prediction made at a padding
    position: a causal model's last padding position attends no key (eager: the mean of the
    values, torch_attn: 0), and the shifted labels would ask it for the first real token."""
    if (family, attn, dtype) not in _RUNS:
        model = _build(family, attn).to(dtype).train()
        ids, mask = _batch(family)
        labelled = mask.bool()
        if family != "bert":  # position t predicts label t: only where t - 1 is a real token
            labelled[:, 1:] &= labelled[:, :-1].clone()
            labelled[:, 0] = False
        labels = ids.masked_fill(~labelled, -100)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads = {n: p.grad.detach().double() for n, p in model.named_parameters()
                 if p.grad is not None}
        compared = torch.ones_like(labelled) if family in OWN_EAGER else mask.bool()
        _RUNS[family, attn, dtype] = (out.logits.detach().double(), grads, compared)
    return _RUNS[family, attn, dtype]


def _worst(actual, expected, baseline: float, dtype: str) -> float:
    """The spec's tolerance rule: worst ``|actual - expected| / bound`` (pass: at most 1)."""
    expected_np = expected.numpy()
    bound = compare.bound(expected_np, baseline, dtype)
    return float(np.max(np.abs(actual.numpy() - expected_np) / bound))


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_gradients_equal_eager(family):
    ref_logits, ref_grads, valid = _run(family, _reference(family), torch.float64)
    # float64: torch_attn against eager with a float64 softmax, at every real token
    logits, grads, _ = _run(family, NAME, torch.float64)
    assert torch.isfinite(logits).all()
    assert (logits - ref_logits)[valid].abs().max() <= 1e-12
    assert ref_grads.keys() == grads.keys() and len(grads) > 10
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max()
        assert (grad - ref_grads[name]).abs().max() <= 1e-12 * max(scale, 1.0), name
    # float32: within atol + k·e of the float64 reference, e = eager's own float32 error
    eager_logits, eager_grads, _ = _run(family, "eager", torch.float32)
    logits, grads, _ = _run(family, NAME, torch.float32)
    e = (eager_logits - ref_logits)[valid].abs().max().item()
    assert _worst(logits[valid], ref_logits[valid], e, "float32") <= 1.0
    for name, grad in grads.items():
        e = (eager_grads[name] - ref_grads[name]).abs().max().item()
        assert _worst(grad, ref_grads[name], e, "float32") <= 1.0, name


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_greedy_generation_with_cache_equals_eager(family):
    ids, mask = _batch(family)
    tokens = {}
    for attn in (NAME, "eager"):
        model = _build(family, attn).float().eval()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        tokens[attn] = out[:, ids.shape[1]:]
    assert tokens[NAME].shape == (len(LENGTHS), NEW_TOKENS)
    assert torch.equal(tokens[NAME], tokens["eager"])


def test_the_features_change_the_logits():
    """The soft-cap, the sliding window and the padding mask are not vacuous here: without each
    one, the float64 reference's logits move by far more than the 1e-12 the tests allow."""
    ref, _, valid = _run("gemma2", REFERENCE, torch.float64)
    ids, mask = _batch("gemma2")
    for change in ({"attn_logit_softcapping": None}, {"sliding_window": 64}):
        model = _build("gemma2", REFERENCE).train()
        for key, value in change.items():  # the layers read the soft-cap, the masks the window
            setattr(model.config, key, value)
            for layer in model.model.layers:
                setattr(layer.self_attn, key, value)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        assert (logits - ref)[valid].abs().max() > 1e-4, change
    with torch.no_grad():
        unpadded = _build("llama", NAME)(input_ids=ids).logits
    ref, _, valid = _run("llama", REFERENCE, torch.float64)
    assert (unpadded - ref)[valid].abs().max() > 1e-4


def test_gpt_oss_sinks_and_sliding_layer_matter():
    """GPT-OSS alternates a sliding layer (window 4, shorter than the prompt) and a full one,
    each with its own sinks: without the sinks (``-inf``: no sink) or without the window,
    torch_attn's logits move from the reference by far more than the 1e-12 the tests allow, so
    the tests above would see either one dropped."""
    ref, _, _ = _run("gpt_oss", "eager", torch.float64)
    ids, mask = _batch("gpt_oss")
    model = _build("gpt_oss", NAME)
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [4, None]
    for change in ("sinks", "window"):
        model = _build("gpt_oss", NAME).train()
        with torch.no_grad():
            for layer in model.model.layers:
                if change == "sinks":
                    layer.self_attn.sinks.fill_(float("-inf"))
                elif layer.self_attn.sliding_window is not None:
                    layer.self_attn.sliding_window = model.config.sliding_window = 64
            logits = model(input_ids=ids, attention_mask=mask).logits
        assert torch.isfinite(logits).all()
        assert (logits - ref).abs().max() > 1e-4, change


def test_register_makes_the_model_pass_the_padding_mask():
    """A plain ``AttentionInterface.register`` gets ``attention_mask=None`` for a padded batch;
    ``register()`` also sets the mask builder, so the function sees the padding."""
    seen = {}

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.setdefault(name, attention_mask)
        return hf.attention_forward(module, query, key, value, attention_mask, **kwargs)

    ids, mask = _batch("llama")
    for name in ("spy_plain", "spy_registered"):
        AttentionInterface.register(name, spy)
        if name == "spy_registered":
            AttentionMaskInterface.register(name, hf.attention_mask)
        with torch.no_grad():
            _build("llama", name)(input_ids=ids, attention_mask=mask)
    assert seen["spy_plain"] is None
    got = seen["spy_registered"]
    assert got.dtype == torch.bool and got.shape == (2, 1, 10, 10)
    causal = torch.ones(10, 10).tril().bool()
    assert torch.equal(got, causal & mask.bool()[:, None, None, :])
    assert hf.register("torch_attn_again") == "torch_attn_again"


def _direct_inputs():
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 3, 8, generator=generator, dtype=torch.float64)
    k = torch.randn(2, 2, 5, 8, generator=generator, dtype=torch.float64)
    v = torch.randn(2, 2, 5, 8, generator=generator, dtype=torch.float64)
    return q, k, v


def _explicit(q, k, v, allowed, scale=8 ** -0.5, bias=None, sinks=None, weights=False):
    """float64 softmax(q kᵀ·scale + bias) @ v over allowed keys, heads repeated:
    ``(b, q, h, d)`` (and the weights ``(b, h, q, kv)``). ``sinks (h,)``: GPT-OSS's eager, a
    column of sink logits joined to the scores before the softmax and dropped after it."""
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (b, h, q, 1)
        p = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    else:
        p = torch.softmax(scores, -1)
    out = (p @ v).transpose(1, 2)
    return (out, p) if weights else out


def test_mask_formats_and_bottom_right_decoding():
    """The 4-D boolean and additive masks, a 2-D padding mask (with the module's causal rule
    and window, which a 2-D mask does not hold), and no mask with a cache (3 queries at the
    end of 5 keys: bottom-right causal) all give the explicit result."""
    q, k, v = _direct_inputs()
    module = torch.nn.Module().eval()
    keys = torch.tensor([[True] * 5, [False, True, True, True, True]])  # (2, 5)
    causal = torch.ones(3, 5).tril(2).bool()  # bottom-right
    allowed = causal & keys[:, None, None, :]
    expected = _explicit(q, k, v, allowed)
    additive = torch.zeros(2, 1, 3, 5, dtype=torch.float64).masked_fill(
        ~allowed, torch.finfo(torch.float64).min)
    for mask in (allowed, additive):
        out, weights = hf.attention_forward(module, q, k, v, mask)
        assert weights is None and out.shape == (2, 3, 4, 8) and out.is_contiguous()
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out, _ = hf.attention_forward(module, q, k, v, None)  # bottom-right, as a KV cache needs
    torch.testing.assert_close(out, _explicit(q, k, v, causal), rtol=0, atol=1e-12)
    out, _ = hf.attention_forward(module, q, k, v, keys, is_causal=False)
    torch.testing.assert_close(out, _explicit(q, k, v, keys[:, None, None, :]), rtol=0,
                               atol=1e-12)
    out, _ = hf.attention_forward(module, q, k, v, keys)  # 2-D padding: still causal
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out, _ = hf.attention_forward(module, q, k, v, keys.int(), sliding_window=2)
    window_keys = causal & ~torch.ones(3, 5).tril(0).bool() & keys[:, None, None, :]
    torch.testing.assert_close(out, _explicit(q, k, v, window_keys), rtol=0, atol=1e-12)
    out, weights = hf.attention_forward(module, q, k, v, None, sliding_window=2,
                                        output_attentions=True)
    window = causal & ~torch.ones(3, 5).tril(0).bool()  # j in (i + 2 - 2, i + 2]
    torch.testing.assert_close(out, _explicit(q, k, v, window), rtol=0, atol=1e-12)
    assert weights.shape == (2, 4, 3, 5) and torch.all(weights[..., ~window] == 0)
    empty = allowed.clone()
    empty[1, :, 0] = False  # query 0 of sequence 1 may attend no key: output 0 (eager: mean)
    out, _ = hf.attention_forward(module, q, k, v, empty)
    assert torch.all(out[1, 0] == 0)
    torch.testing.assert_close(out[1, 1:], expected[1, 1:], rtol=0, atol=1e-12)


def test_finite_float_mask_and_position_bias_are_added():
    """A float (additive) mask's finite entries are a bias, its dtype minimum masks; a
    ``position_bias`` adds to the scores, with or without a mask: each against the explicit
    float64 computation (a mask of 0 and the minimum alone could not tell a dropped bias)."""
    q, k, v = _direct_inputs()
    module = torch.nn.Module().eval()
    generator = torch.Generator().manual_seed(3)
    allowed = torch.ones(3, 5).tril(2).bool() & torch.tensor([True, True, False, True, True])
    allowed = allowed.expand(2, 1, 3, 5)  # (batch, 1, q_len, kv_len), as transformers' masks
    finite = torch.randn(2, 1, 3, 5, generator=generator, dtype=torch.float64)
    additive = finite.masked_fill(~allowed, torch.finfo(torch.float64).min)  # (2, 1, 3, 5)
    position_bias = torch.randn(1, 4, 3, 5, generator=generator, dtype=torch.float64)
    for mask, kwargs, bias in (
        (additive, {}, finite),
        (additive, {"position_bias": position_bias}, finite + position_bias),
        (allowed, {"position_bias": position_bias}, position_bias),
    ):
        out, _ = hf.attention_forward(module, q, k, v, mask, **kwargs)
        expected = _explicit(q, k, v, allowed, bias=bias)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12, msg=str(kwargs))
        without = _explicit(q, k, v, allowed)
        assert (expected - without).abs().max() > 0.05  # the bias is not vacuous here
    out, _ = hf.attention_forward(module, q, k, v, None, position_bias=position_bias,
                                  is_causal=False)
    expected = _explicit(q, k, v, torch.ones(3, 5, dtype=torch.bool), bias=position_bias)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_dropout_only_while_training():
    q, k, v = _direct_inputs()
    module = torch.nn.Module()
    module.eval()
    out, _ = hf.attention_forward(module, q, k, v, None, dropout=0.5, is_causal=False)
    expected = _explicit(q, k, v, torch.ones(3, 5, dtype=torch.bool))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    module.train()
    torch.manual_seed(0)  # dropout draws from torch's global generator
    draws = torch.stack([hf.attention_forward(module, q, k, v, None, dropout=0.5,
                                              is_causal=False)[0] for _ in range(100)])
    assert not torch.allclose(draws[0], expected)
    # unbiased: the mean over 100 draws approaches the output without dropout
    spread = draws.std(0) / 100 ** 0.5
    assert torch.all((draws.mean(0) - expected).abs() <= 5 * spread + 1e-12)


def test_attention_sinks_arrive_as_s_aux():
    """``s_aux`` (GPT-OSS's ``module.sinks``, one logit per query head) becomes ``sinks``:
    output, weights (without the sink column) and the sinks' gradient equal the explicit
    float64 computation with a sink column (GPT-OSS's eager); a row with no allowed key gives
    0 (all its weight on the sink); a sink per kv head instead of per query head raises."""
    q, k, v = _direct_inputs()
    module = torch.nn.Module().eval()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    allowed = torch.ones(3, 5).tril(2).bool().expand(2, 1, 3, 5).clone()
    allowed[1, :, 0] = False  # query 0 of sequence 1 attends no key
    out, weights = hf.attention_forward(module, q, k, v, allowed, s_aux=sinks,
                                        output_attentions=True)
    expected, expected_weights = _explicit(q, k, v, allowed, sinks=sinks, weights=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=1e-12)
    assert torch.all(out[1, 0] == 0) and torch.all(weights[1, :, 0] == 0)
    assert (expected - _explicit(q, k, v, allowed))[0].abs().max() > 0.05  # the sinks matter
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(4),
                            dtype=torch.float64)
    (grad,) = torch.autograd.grad(out, sinks, cotangent)
    (expected_grad,) = torch.autograd.grad(expected, sinks, cotangent)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)
    assert grad.abs().min() > 1e-3
    with pytest.raises(ValueError, match=r"sinks must have shape \(heads,\) = \(4,\)"):
        hf.attention_forward(module, q, k, v, None, s_aux=torch.zeros(2, dtype=torch.float64))


# --- direct calls against transformers' own eager attention (Gemma 2's: scaling, soft-cap,
# grouped-query heads, an additive mask) in float64, and its sdpa_mask rules written out
# for the mask builder (tests from mutation testing, docs/mutation.md) -------------------

MIN64 = torch.finfo(torch.float64).min
TOL = 1e-6  # eager's softmax runs in float32 (dtype=torch.float32), even on float64 inputs


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


def test_register_sets_both_tables_under_the_name():
    """``register`` puts ``attention_forward`` and ``attention_mask`` under the name it returns
    (``"torch_attn"`` by default), in both of transformers' tables."""
    assert hf.register() == hf.NAME == "torch_attn"
    assert hf.register("torch_attn_mutation") == "torch_attn_mutation"
    for name in ("torch_attn", "torch_attn_mutation"):
        assert AttentionInterface._global_mapping[name] is hf.attention_forward
        assert AttentionMaskInterface._global_mapping[name] is hf.attention_mask


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


def test_a_mask_of_another_type_raises_naming_the_argument():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"^attention_forward: attention_mask must be a "
                       r"torch\.Tensor or None .*got type\(attention_mask\)=list$"):
        hf.attention_forward(_layer(4, 2, 8), q, k, v, [[True] * 5] * 2)


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


@pytest.mark.slow
def test_declared_in_the_spec_and_not_imported_by_the_backend():
    declared = spec.BACKEND_INTEGRATIONS["torch_attn"]["transformers"]
    assert sorted(hf.__all__) == sorted(declared)
    for name in declared:
        obj = getattr(hf, name)
        assert not callable(obj) or (obj.__doc__ and "(" in obj.__doc__), name
    result = imported_with("torch_attn", "transformers", cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_documented_snippets_print_what_the_docs_say():
    """The transformers snippets of docs/integrations.md, run here, print their documented text."""
    from test_docs import check_snippets_in_process

    check_snippets_in_process(ROOT / "docs" / "integrations.md", "from transformers")


@pytest.mark.slow
def test_the_example_runs_and_agrees():
    path = ROOT / "examples" / "transformers_llama.py"
    spec_ = importlib.util.spec_from_file_location("transformers_llama", path)
    example = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(example)
    result = example.run(new_tokens=4, rounds=1)
    tokens = result["tokens"]
    assert tokens[NAME] == tokens["eager"] == tokens["sdpa"]
    assert len(tokens[NAME]) == 2 and all(len(row) == 4 for row in tokens[NAME])
    assert result["max_logit_diff"][NAME] < 1e-4 and result["max_logit_diff"]["eager"] == 0
    assert all(rate > 0 for rate in result["tokens_per_s"].values())
