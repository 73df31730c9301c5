"""Tiny transformers models run with the project's RoPE and attention in place of theirs
(``torch_attn.integrations.transformers_rotary.use_rotary``): the logits and the greedy tokens of
transformers' own ``eager`` model.

The families (random, seeded weights from configs; nothing is downloaded): Llama (grouped-query
heads; default frequencies and Llama 3 scaling), StableLM (partial rotary, half layout), GLM
(partial rotary, interleaved pairs) and DeepSeek-V3 (multi-head latent attention: decoupled RoPE
on ``qk_rope_head_dim`` dims, ``rope_interleave=True``, YaRN scaling with its attention factor
and the ``mscale_all_dim`` softmax-scale adjustment; a variant with ``q_proj`` instead of the
low-rank query and ``rope_interleave=False``). Every batch is left-padded, with the positions
``generate`` gives (``cumsum(mask) - 1``), and logits are compared at the real tokens.

The float64 reference is the ``eager`` model with two changes, and only these:

* its rotary module computes the angles, cos and sin in float64 (``_float64_rotary``: the
  forward of transformers' ``LlamaRotaryEmbedding`` line for line, with float64 inverse
  frequencies ``_inv_freq64``, written out here from transformers' formulas). transformers
  computes them in float32 even in a float64 model (its ``inv_freq`` is float32 and it
  multiplies ``position_ids.float()``), so its float64 logits are float32-accurate: a known
  difference (``ROTARY_PRECISION`` in ``conformance/spec/rotary.py``);
* its attention runs the softmax in float64 (``_eager_float64``; ``eager`` runs it in float32).

float32 results pass the spec's tolerance rule against that reference: ``|x - ref| <= atol +
rtol·|ref| + k·e``, with ``e`` the error of the unchanged ``eager`` model in float32.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install torch==2.13.0")
transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install -e .[transformers]"
)

from transformers import (  # noqa: E402
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    BertConfig,
    DeepseekV3Config,
    GlmConfig,
    LlamaConfig,
    StableLmConfig,
)
from transformers.masking_utils import eager_mask  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from conformance.comparing import compare  # noqa: E402
from torch_attn.integrations import transformers_rotary as hf  # noqa: E402
from torch_attn.integrations.transformers import NAME  # noqa: E402

REFERENCE = "eager_float64_rotary_reference"
NEW_TOKENS = 10
LENGTHS = (12, 8)  # the second prompt is left-padded by 4


def _eager_float64(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                   **kwargs):
    """transformers' eager attention (repeat the key/value heads, scale, add the additive
    mask, softmax, weighted sum) with the softmax in the input dtype."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(2, 3) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1)
    return (weights @ value).transpose(1, 2).contiguous(), weights


AttentionInterface.register(REFERENCE, _eager_float64)
AttentionMaskInterface.register(REFERENCE, eager_mask)

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=64, initializer_range=0.2,
              pad_token_id=0)
#: DeepSeek-V3's YaRN, shrunk: its factor 40, beta_fast 32, beta_slow 1 and mscale 1, an
#: original context of 16 (the prompts and generations reach position 21) and mscale_all_dim
#: 0.8 (V3's own 1.0 with mscale 1.0 makes the attention factor exactly 1, so a test could not
#: see it forgotten; the softmax-scale adjustment is mscale(40, 0.8)² either way).
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
        "mscale_all_dim": 0.8}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
           moe_intermediate_size=32, first_k_dense_replace=1)  # layer 1: mixture of experts
MODELS = {
    "llama": lambda: LlamaConfig(**COMMON, num_key_value_heads=2),
    "llama_llama3": lambda: LlamaConfig(**COMMON, num_key_value_heads=2, rope_parameters=LLAMA3),
    # partial rotary: the first 4 of 16 dims, half layout
    "stablelm_partial": lambda: StableLmConfig(**COMMON, num_key_value_heads=2),
    # partial rotary: the first 8 of 16 dims, interleaved pairs
    "glm_partial": lambda: GlmConfig(**COMMON, num_key_value_heads=2, head_dim=16),
    "deepseek_v3": lambda: DeepseekV3Config(**{**COMMON, "max_position_embeddings": 640},
                                            **MLA, q_lora_rank=32, rope_parameters=YARN),
    "deepseek_v3_q_proj_half": lambda: DeepseekV3Config(
        **{**COMMON, "max_position_embeddings": 640}, **MLA, q_lora_rank=None,
        rope_interleave=False, rope_parameters=YARN),
}
ROTARY_DIMS = {"llama": 16, "llama_llama3": 16, "stablelm_partial": 4, "glm_partial": 8,
               "deepseek_v3": 8, "deepseek_v3_q_proj_half": 8}


def _build(name: str, attn: str, dtype, *, rotary: bool = False, layout: str | None = None,
           float64_angles: bool = False):
    """The tiny model (seed 0, drawn in float64: the same weights every time, rounded to
    ``dtype``), eval mode: ``use_rotary`` applied, or transformers' own, optionally with
    float64 angles."""
    torch.manual_seed(0)
    config = MODELS[name]()
    experts = {"experts_implementation": "eager"} if name.startswith("deepseek") else {}
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                             dtype=torch.float64, **experts).to(dtype).eval()
    if rotary:
        hf.use_rotary(model, layout=layout)
    if float64_angles:
        _float64_rotary(model.model.rotary_emb, _inv_freq64(config, ROTARY_DIMS[name]))
    return model


def _inv_freq64(config, dim: int) -> torch.Tensor:
    """transformers' inverse frequencies (default, llama3, yarn: modeling_rope_utils) in
    float64, written out: ``(dim // 2,)``."""
    rope = config.rope_parameters
    base, kind = rope["rope_theta"], rope.get("rope_type", "default")
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if kind == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        factor, old = rope["factor"], rope["original_max_position_embeddings"]

        def correction(rotations):  # the dim at which `rotations` turns fit in the context
            return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction(rope["beta_fast"])), 0)
        high = min(math.ceil(correction(rope["beta_slow"])), dim - 1)
        high = high + 0.001 if low == high else high
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        inv = inv / factor * ramp + inv * (1 - ramp)
    else:
        assert kind == "default", kind
    return inv


def _float64_rotary(rotary: torch.nn.Module, inv_freq: torch.Tensor) -> None:
    """The reference's only change to transformers' rotary module: its forward, line for line
    (``LlamaRotaryEmbedding.forward``, the same in every family here), with float64 angles."""

    def forward(x, position_ids, layer_type=None):
        freqs = position_ids[..., None].double() * inv_freq  # (batch, seq, dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * rotary.attention_scaling
        sin = emb.sin() * rotary.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    rotary.forward = forward


def _batch():
    """Token ids ``(2, 12)``, the padding mask (the second prompt left-padded by 4) and the
    positions ``generate`` gives a left-padded batch: ``cumsum(mask) - 1`` (1 on padding)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (len(LENGTHS), max(LENGTHS)), generator=generator)
    mask = torch.arange(max(LENGTHS)) >= max(LENGTHS) - torch.tensor(LENGTHS)[:, None]
    positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)
    return ids.masked_fill(~mask, 0), mask.long(), positions


_LOGITS: dict = {}


def _logits(name: str, kind: str) -> torch.Tensor:
    """float64 logits ``(2, 12, vocab)`` of the left-padded batch, cached. kind: "reference"
    (float64 angles and softmax), "rotary64"/"rotary32" (``use_rotary``, float64/float32),
    "eager32" (transformers' own, float32)."""
    if (name, kind) not in _LOGITS:
        dtype = torch.float32 if kind.endswith("32") else torch.float64
        attn = REFERENCE if kind == "reference" else "eager"
        model = _build(name, attn, dtype, rotary=kind.startswith("rotary"),
                       float64_angles=kind == "reference")
        ids, mask, positions = _batch()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        _LOGITS[name, kind] = logits.double()
    return _LOGITS[name, kind]


def _worst(actual, expected, baseline: float, dtype: str) -> float:
    """The spec's tolerance rule: worst ``|actual - expected| / bound`` (pass: at most 1)."""
    expected_np = expected.numpy()
    bound = compare.bound(expected_np, baseline, dtype)
    return float(np.max(np.abs(actual.numpy() - expected_np) / bound))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_equal_eager(name):
    """float64: within 1e-12 of the reference, relative to the logits' scale; float32: within
    the tolerance rule, ``e`` being the unchanged float32 ``eager`` model's error."""
    real = _batch()[1].bool()
    ref = _logits(name, "reference")[real]
    scale = ref.abs().max().item()
    assert scale > 1.0
    assert (_logits(name, "rotary64")[real] - ref).abs().max().item() <= 1e-12 * scale
    e = (_logits(name, "eager32")[real] - ref).abs().max().item()
    assert _worst(_logits(name, "rotary32")[real], ref, e, "float32") <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_llama3", "glm_partial", "deepseek_v3"])
def test_decoding_with_a_cache_at_an_offset_equals_eager(name):
    """float64: the prompt's first 7 tokens at once, then one token at a time through the
    cache (positions 7, 8, ... of the second row: 3, 4, ..., left padding), each step's logits
    within 1e-12 of the reference doing the same, and the cache's tensors too. (The rotation
    is relative: positions shifted by a constant leave the logits unchanged, so the cached
    keys are what pins the absolute positions.)"""
    ids, mask, positions = _batch()
    models = {"rotary": _build(name, "eager", torch.float64, rotary=True),
              "reference": _build(name, REFERENCE, torch.float64, float64_angles=True)}
    logits, caches = {}, {}
    for kind, model in models.items():
        steps, cache = [], None
        with torch.no_grad():
            for start, stop in [(0, 7)] + [(t, t + 1) for t in range(7, max(LENGTHS))]:
                out = model(input_ids=ids[:, start:stop], attention_mask=mask[:, :stop],
                            position_ids=positions[:, start:stop], cache=cache, use_cache=True)
                cache = out.cache
                steps.append(out.logits[:, -1])
        assert cache.get_seq_length() == max(LENGTHS)
        logits[kind] = torch.stack(steps, 1)  # (batch, steps, vocab)
        caches[kind] = [(layer.keys, layer.values) for layer in cache.layers]
    scale = logits["reference"].abs().max().item()
    assert (logits["rotary"] - logits["reference"]).abs().max().item() <= 1e-12 * scale
    # the cache holds transformers' tensors at the real tokens: the rotated keys in its order
    # (DeepSeek-V3: the latents and the de-interleaved rotary key head, which q·k alone would
    # not pin). Past layer 0, padding positions differ: a row that attends no key gives 0 here
    # and the mean of the values in eager.
    real = mask.bool()
    for ours, theirs in zip(caches["rotary"], caches["reference"], strict=True):
        for a, b in zip(ours, theirs, strict=True):  # (batch, heads, seq, dim)
            a, b = a.transpose(1, 2)[real], b.transpose(1, 2)[real]  # (tokens, heads, dim)
            assert a.shape == b.shape and (a - b).abs().max() <= 1e-12 * b.abs().max()
    # the steps' logits are the whole prompt's at the same positions (DeepSeek-V3's router
    # runs in float32 whatever the model's dtype, and a float32 product over 2 tokens is not
    # rounded as over 24: float32's level there)
    full = _logits(name, "reference")[:, [6, *range(7, max(LENGTHS))]]
    tol = 1e-6 if name.startswith("deepseek") else 1e-12
    assert (logits["reference"] - full).abs().max().item() <= tol * scale


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_generation_equals_eager(name):
    """float32, KV cache, left-padded batch: the same 10 tokens as transformers' unchanged
    ``eager`` model."""
    ids, mask, _ = _batch()
    tokens = {}
    for rotary in (True, False):
        model = _build(name, "eager", torch.float32, rotary=rotary)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        tokens[rotary] = out[:, ids.shape[1]:]
    assert tokens[True].shape == (len(LENGTHS), NEW_TOKENS)
    assert torch.equal(tokens[True], tokens[False])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_swapped_layout_differs(name):
    """Negative control: the same model rotated in the other layout moves the logits by far
    more than the 1e-12 the tests allow (the first position alone would not show it)."""
    ids, mask, positions = _batch()
    model = _build(name, "eager", torch.float64, rotary=True)
    family = model.model.layers[0].self_attn.rotary_layout
    swapped = {"half": "interleaved", "interleaved": "half"}[family]
    model = _build(name, "eager", torch.float64, rotary=True, layout=swapped)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    assert (logits - _logits(name, "reference"))[real].abs().max() > 1e-3


@pytest.mark.slow
def test_the_reference_is_transformers_own_up_to_float32_angles():
    """The reference's port is faithful: its float64 frequencies round to transformers'
    float32 ones, its scaling is the attention layers' (DeepSeek-V3's softmax scale too), and
    the unchanged float64 ``eager`` model differs from it at float32's level only (the known
    difference), while the scaling methods are not vacuous (default rope moves the logits)."""
    for name, config in ((name, make()) for name, make in MODELS.items()):
        kind = config.rope_parameters.get("rope_type", "default")
        if kind == "default":
            continue  # the default formula is the others' first line
        theirs, factor = ROPE_INIT_FUNCTIONS[kind](config)
        ours = _inv_freq64(config, ROTARY_DIMS[name])
        assert theirs.dtype == torch.float32
        torch.testing.assert_close(ours, theirs.double(), rtol=1e-6, atol=0, msg=name)
        if name.startswith("deepseek"):
            assert factor == pytest.approx(1.0569662567531275, rel=1e-15)  # mscale ratio
            layer = _build(name, "eager", torch.float64).model.layers[0].self_attn
            assert hf._mla_softmax_scale(config) == layer.scaling != 16 ** -0.5
    real = _batch()[1].bool()
    for name in ("llama_llama3", "deepseek_v3"):
        ref = _logits(name, "reference")[real]
        model = _build(name, REFERENCE, torch.float64)  # transformers' float32 angles
        ids, mask, positions = _batch()
        with torch.no_grad():
            own = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert 1e-9 < (own[real] - ref).abs().max() < 1e-5, name
        default = MODELS[name]()
        default.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        experts = {"experts_implementation": "eager"} if name.startswith("deepseek") else {}
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(default, attn_implementation=REFERENCE,
                                                 dtype=torch.float64, **experts).eval()
        with torch.no_grad():
            plain = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert (plain[real] - ref).abs().max() > 1e-3, name


def test_an_unsupported_family_or_layout_raises_naming_it():
    model = AutoModelForCausalLM.from_config(MODELS["llama"]())
    with pytest.raises(ValueError, match=r"^use_rotary: layout must be None, 'half' or "
                       r"'interleaved'; got layout='complex'$"):
        hf.use_rotary(model, layout="complex")
    bert = transformers.AutoModelForMaskedLM.from_config(
        BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=16))
    with pytest.raises(ValueError, match=r"^use_rotary: model_type must be one of "
                       r"\['deepseek_v3', 'glm', 'llama', 'stablelm'\]; got model_type='bert'$"):
        hf.use_rotary(bert)


def test_the_layers_rotate_by_themselves():
    """After ``use_rotary`` the model computes no cos/sin (its rotary module returns None) and
    runs the project's attention; the layers' layout is the family's or the one asked for."""
    model = hf.use_rotary(_build("glm_partial", "eager", torch.float32))
    assert model.config._attn_implementation == NAME
    assert model.model.rotary_emb(torch.zeros(1), torch.zeros(1, 1)) == (None, None)
    assert [layer.self_attn.rotary_layout for layer in model.model.layers] == ["interleaved"] * 2
    model = _build("deepseek_v3_q_proj_half", "eager", torch.float32, rotary=True)
    assert [layer.self_attn.rotary_layout for layer in model.model.layers] == ["half"] * 2
    model = _build("llama", "eager", torch.float32, rotary=True, layout="interleaved")
    assert [layer.self_attn.rotary_layout for layer in model.model.layers] == ["interleaved"] * 2


def test_declared_in_the_spec():
    """``use_rotary`` is the integration's one public name (``spec.BACKEND_INTEGRATIONS``)."""
    from conformance import spec

    assert sorted(hf.__all__) == sorted(spec.BACKEND_INTEGRATIONS["torch_attn"][
        "transformers_rotary"])
