"""DeepSeek-V3 from transformers with torch_attn's ``MultiHeadLatentAttention`` in place of
each layer's attention: logits equal eager's (naive form), and greedy decoding from the latent
cache (absorbed form) picks the same tokens.

The reference is transformers' own eager DeepSeek-V3 built from a seeded config (2 layers,
hidden 64, small ranks; both layers dense: transformers' MoE runs torch._grouped_mm, which
has no float64). Each layer's ``self_attn`` is replaced by a thin adapter that loads that
layer's ``self_attn.state_dict()`` into the project's module as is.

float64: transformers computes three things in float32 whatever the model's dtype: the rotary
inverse frequencies and angles (``DeepseekV3RotaryEmbedding``), every RMSNorm
(``DeepseekV3RMSNorm``: the attention's ``q_a_layernorm`` and ``kv_a_layernorm`` among
them) and the eager softmax (``softmax(..., dtype=torch.float32)``). In the float64 test
those three run in float64 (the reference's only changes, patched for the test's
duration), and the logits agree to 1e-12. The float32 test runs transformers unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds  # noqa: E402

from torch_attn import KVCache, RoPE  # noqa: E402
from torch_attn.latent_attention import MultiHeadLatentAttention  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT_LEN, NEW_TOKENS = 7, 6


def _config(q_lora_rank: int | None, rope_parameters: dict) -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=2, q_lora_rank=q_lora_rank, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, max_position_embeddings=64,
        rope_parameters=rope_parameters, rope_interleave=True, attention_bias=False,
        attn_implementation="eager", tie_word_embeddings=False)


def _model(config: transformers.DeepseekV3Config, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # the RMSNorm gains away from their initial 1
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.2 * torch.randn_like(parameter))
    return model.to(dtype)


def _rope(config: transformers.DeepseekV3Config) -> RoPE:
    params = dict(config.rope_parameters)
    theta = params.pop("rope_theta")
    scaling = None if params.get("rope_type", "default") == "default" else params
    return RoPE(theta=theta, layout="interleaved", scaling=scaling,
                max_position_embeddings=config.max_position_embeddings)


class _ProjectAttention(torch.nn.Module):
    """A DeepSeek-V3 layer's ``self_attn`` computed by the project's MLA: naive over the whole
    sequence (``mode="naive"``, positions ``0..seq-1``, causal) or absorbed over the layer's
    latent cache (``mode="decode"``: the new tokens after the cached ones)."""

    def __init__(self, reference: torch.nn.Module, config: transformers.DeepseekV3Config):
        super().__init__()
        self.mla = MultiHeadLatentAttention(
            config.hidden_size, config.num_attention_heads, q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
            rope=_rope(config), rms_norm_eps=config.rms_norm_eps)
        self.mla.load_weights(reference.state_dict())  # transformers' keys, as they are
        self.mode, self.cache, self.max_len = "naive", None, PROMPT_LEN + NEW_TOKENS

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                **kwargs):  # noqa: ANN001, ANN003, ANN201
        if self.mode == "naive":
            return self.mla(hidden_states, is_causal=True), None
        output, self.cache = self.mla.decode(hidden_states, self.cache, max_len=self.max_len)
        return output, None


def _float64_angles(self, x, position_ids):  # noqa: ANN001, ANN202
    """DeepseekV3RotaryEmbedding.forward (default rope) with the inverse frequencies and the
    angles in float64 (transformers: float32), by transformers' formula."""
    dim = 2 * self.inv_freq.shape[0]
    theta = self.config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = position_ids[..., None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return ((emb.cos() * self.attention_scaling).to(x.dtype),
            (emb.sin() * self.attention_scaling).to(x.dtype))


def _rms_norm_in_dtype(self, hidden_states):  # noqa: ANN001, ANN202
    """DeepseekV3RMSNorm.forward in the input's dtype (transformers: float32)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _eager_in_dtype(module, query, key, value, attention_mask, scaling, dropout=0.0,
                    **kwargs):  # noqa: ANN001, ANN003, ANN202
    """eager_attention_forward with the softmax in the inputs' dtype (transformers: float32)."""
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


@pytest.fixture
def float64_reference(monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.setattr(ds.DeepseekV3RotaryEmbedding, "forward", _float64_angles)
    monkeypatch.setattr(ds.DeepseekV3RMSNorm, "forward", _rms_norm_in_dtype)
    monkeypatch.setattr(ds, "eager_attention_forward", _eager_in_dtype)


def _greedy(model: torch.nn.Module, prompt: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """Eager greedy decoding, the whole sequence recomputed each step: the tokens and each
    step's last logits ``(NEW_TOKENS, vocab)``."""
    ids, tokens, logits = prompt, [], []
    for _ in range(NEW_TOKENS):
        last = model(ids, use_cache=False).logits[:, -1]
        tokens.append(int(last.argmax(-1)))
        logits.append(last[0])
        ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=-1)
    return tokens, torch.stack(logits)


def _greedy_from_latent_cache(model: torch.nn.Module,
                              prompt: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding through the project's absorbed MLA: the prompt fills each layer's latent
    cache, then one token per step attends the cache."""
    for layer in model.model.layers:
        layer.self_attn.mode, layer.self_attn.cache = "decode", None
    ids, tokens, logits = prompt, [], []
    for _ in range(NEW_TOKENS):
        last = model(ids, use_cache=False).logits[:, -1]
        tokens.append(int(last.argmax(-1)))
        logits.append(last[0])
        ids = last.argmax(-1, keepdim=True)  # only the new token: the rest is in the caches
    return tokens, torch.stack(logits)


def _with_project_attention(model: torch.nn.Module, config) -> torch.nn.Module:  # noqa: ANN001
    for layer in model.model.layers:
        layer.self_attn = _ProjectAttention(layer.self_attn, config)
    return model


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
             "mscale": 0.707, "mscale_all_dim": 0.707},
}


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_deepseek_v3_float64_logits_and_greedy_tokens(float64_reference, q_lora_rank):
    config = _config(q_lora_rank, ROPES["default"])
    prompt = torch.randint(0, config.vocab_size, (1, PROMPT_LEN),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = _model(config, torch.float64)
        expected_logits = reference(prompt, use_cache=False).logits
        expected_tokens, expected_steps = _greedy(reference, prompt)
        project = _with_project_attention(_model(config, torch.float64), config)
        logits = project(prompt, use_cache=False).logits
        tokens, steps = _greedy_from_latent_cache(project, prompt)
    diff = float((logits - expected_logits).abs().max())
    assert diff <= 1e-12, f"naive MLA vs eager DeepSeek-V3 float64: max |diff| {diff:.3g}"
    step_diff = float((steps - expected_steps).abs().max())
    assert step_diff <= 1e-12, f"absorbed, latent cache vs eager: max |diff| {step_diff:.3g}"
    assert tokens == expected_tokens


@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_deepseek_v3_float32_unchanged_reference(rope):
    """transformers as it is (float32 angles, RMSNorm and softmax): float32 logits within
    1e-5 of the logits' size, and the same greedy tokens; with YaRN, the rotated dims' attention
    factor and the softmax scale's mscale_all_dim adjustment (a wrong scale moves the logits by
    far more)."""
    config = _config(24, ROPES[rope])
    prompt = torch.randint(0, config.vocab_size, (1, PROMPT_LEN),
                           generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = _model(config, torch.float32)
        expected_logits = reference(prompt, use_cache=False).logits
        expected_tokens, _ = _greedy(reference, prompt)
        project = _with_project_attention(_model(config, torch.float32), config)
        logits = project(prompt, use_cache=False).logits
        tokens, _ = _greedy_from_latent_cache(project, prompt)
    diff = float((logits - expected_logits).abs().max())
    assert diff <= 1e-5 * float(expected_logits.abs().max()), f"max |diff| {diff:.3g}"
    assert tokens == expected_tokens


def test_latent_cache_holds_one_latent_per_token():
    """After decoding, each layer's cache holds ``kv_lora_rank + qk_rope_head_dim`` numbers
    per token and no values."""
    config = _config(24, ROPES["default"])
    project = _with_project_attention(_model(config, torch.float64), config)
    prompt = torch.randint(0, config.vocab_size, (1, PROMPT_LEN),
                           generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _greedy_from_latent_cache(project, prompt)
    cache = project.model.layers[0].self_attn.cache
    assert isinstance(cache, KVCache)
    assert tuple(cache.keys.shape) == (1, 1, PROMPT_LEN + NEW_TOKENS - 1,
                                       config.kv_lora_rank + config.qk_rope_head_dim)
    assert cache.value_buffer.numel() == 0
    np.testing.assert_array_equal(cache.value_buffer.shape[-1], 0)
