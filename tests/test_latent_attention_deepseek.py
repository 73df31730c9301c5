"""DeepSeek-V3 from transformers with torch_attn's ``MultiHeadLatentAttention`` in place of
each layer's attention: logits equal eager's (naive form), and greedy decoding from the latent
cache (absorbed form) picks the same tokens; one layer's ``self_attn`` loaded into each
backend's module: forward (naive and absorbed) equals the eager attention's output and
``parameter_gradients`` equal torch autograd through transformers' layer. Each with and
without ``config.attention_bias`` (biases on ``q_a_proj``, ``kv_a_proj_with_mqa``,
``o_proj``), the biases drawn away from transformers' initial zeros.

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

import jax_attn  # noqa: E402
import numpy_attn  # noqa: E402
import torch_attn  # noqa: E402
from torch_attn import KVCache  # noqa: E402
from torch_attn.latent_attention import MultiHeadLatentAttention  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT_LEN, NEW_TOKENS = 7, 6


def _config(q_lora_rank: int | None, rope_parameters: dict,
            attention_bias: bool = False) -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=2, q_lora_rank=q_lora_rank, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, max_position_embeddings=64,
        rope_parameters=rope_parameters, rope_interleave=True,
        attention_bias=attention_bias,
        attn_implementation="eager", tie_word_embeddings=False)


def _model(config: transformers.DeepseekV3Config, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # the RMSNorm gains away from their initial 1, the biases from 0
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.2 * torch.randn_like(parameter))
            elif name.endswith(".bias"):  # the attention's; at the weights' scale (0.02)
                parameter.copy_(config.initializer_range * torch.randn_like(parameter))
    return model.to(dtype)


def _rope(config: transformers.DeepseekV3Config, backend=torch_attn):  # noqa: ANN001, ANN202
    """The config's rope as ``backend.RoPE`` (interleaved: ``rope_interleave``)."""
    params = dict(config.rope_parameters)
    theta = params.pop("rope_theta")
    scaling = None if params.get("rope_type", "default") == "default" else params
    return backend.RoPE(theta=theta, layout="interleaved", scaling=scaling,
                        max_position_embeddings=config.max_position_embeddings)


def _mla(config: transformers.DeepseekV3Config, backend=torch_attn):  # noqa: ANN001, ANN202
    """``backend.MultiHeadLatentAttention`` with the config's sizes, rope and biases."""
    return backend.MultiHeadLatentAttention(
        config.hidden_size, config.num_attention_heads, q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
        rope=_rope(config, backend), rms_norm_eps=config.rms_norm_eps,
        attention_bias=config.attention_bias)


class _ProjectAttention(torch.nn.Module):
    """A DeepSeek-V3 layer's ``self_attn`` computed by the project's MLA: naive over the whole
    sequence (``mode="naive"``, positions ``0..seq-1``, causal) or absorbed over the layer's
    latent cache (``mode="decode"``: the new tokens after the cached ones)."""

    def __init__(self, reference: torch.nn.Module, config: transformers.DeepseekV3Config):
        super().__init__()
        self.mla: MultiHeadLatentAttention = _mla(config)
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


@pytest.fixture(params=[False, True], ids=["no_bias", "bias"])
def attention_bias(request):  # noqa: ANN001, ANN201
    return request.param


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_deepseek_v3_float64_logits_and_greedy_tokens(float64_reference, q_lora_rank,
                                                      attention_bias):
    config = _config(q_lora_rank, ROPES["default"], attention_bias)
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
def test_deepseek_v3_float32_unchanged_reference(rope, attention_bias):
    """transformers as it is (float32 angles, RMSNorm and softmax): float32 logits within
    1e-5 of the logits' size, and the same greedy tokens; with YaRN, the rotated dims' attention
    factor and the softmax scale's mscale_all_dim adjustment (a wrong scale moves the logits by
    far more)."""
    config = _config(24, ROPES[rope], attention_bias)
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


BACKENDS = {"numpy": numpy_attn, "torch": torch_attn, "jax": jax_attn}
BATCH = 2


def _eager_self_attn(config: transformers.DeepseekV3Config,
                     dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """Layer 0's ``self_attn`` of the seeded model, a seeded ``hidden (BATCH, PROMPT_LEN,
    hidden_size)`` and the eager attention's causal output on it (positions ``0..seq-1``), the
    graph recorded when grad mode is on."""
    model = _model(config, dtype)
    hidden = torch.randn(BATCH, PROMPT_LEN, config.hidden_size, dtype=dtype,
                         generator=torch.Generator().manual_seed(4))
    positions = torch.arange(PROMPT_LEN)[None].expand(BATCH, -1)
    causal = torch.full((PROMPT_LEN, PROMPT_LEN), -torch.inf, dtype=dtype).triu(1)  # additive
    attn = model.model.layers[0].self_attn
    output, _ = attn(hidden, position_embeddings=model.model.rotary_emb(hidden, positions),
                     attention_mask=causal[None, None])
    return attn, hidden, output


def _loaded(config: transformers.DeepseekV3Config, backend_name: str,
            attn: torch.nn.Module):  # noqa: ANN202
    """The backend's module holding ``attn.state_dict()`` (NumPy arrays: any backend takes
    them)."""
    weights = {name: value.detach().numpy() for name, value in attn.state_dict().items()}
    return _mla(config, BACKENDS[backend_name]).load_weights(weights)


def _numpy_of(array) -> np.ndarray:  # noqa: ANN001
    return array.detach().numpy() if isinstance(array, torch.Tensor) else np.asarray(array)


@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_each_backend_equals_eager_self_attn_in_float32(backend_name, attention_bias):
    """transformers as it is (float32): one layer's ``self_attn.state_dict()`` loaded into each
    backend; naive and absorbed within 2e-6 of the output's size."""
    config = _config(24, ROPES["default"], attention_bias)
    with torch.no_grad():
        attn, hidden, expected = _eager_self_attn(config, torch.float32)
    module = _loaded(config, backend_name, attn)
    assert list(module.export_weights()) == list(attn.state_dict())
    size = float(expected.abs().max())
    for absorbed in (False, True):
        output = _numpy_of(module.forward(hidden.numpy(), is_causal=True, absorbed=absorbed))
        assert output.dtype == np.float32
        diff = float(np.abs(output - expected.numpy()).max())
        assert diff <= 2e-6 * size, f"{absorbed=}: max |diff| {diff:.3g} (size {size:.3g})"


@pytest.mark.usefixtures("x64_on")
@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_parameter_gradients_equal_autograd_of_eager_self_attn(float64_reference, backend_name,
                                                               attention_bias):
    """float64 (the reference's float32 steps in float64, as above): every weight's gradient,
    the biases' included, equals ``torch.autograd.grad`` through transformers' layer."""
    config = _config(24, ROPES["default"], attention_bias)
    attn, hidden, output = _eager_self_attn(config, torch.float64)
    grad_output = torch.randn(output.shape, dtype=torch.float64,
                              generator=torch.Generator().manual_seed(5))
    names = list(attn.state_dict())
    expected = torch.autograd.grad(output, [attn.get_parameter(n) for n in names], grad_output)
    module = _loaded(config, backend_name, attn)
    grads = module.parameter_gradients(hidden.detach().numpy(), grad_output.numpy(),
                                       is_causal=True)
    assert sorted(grads) == sorted(names)
    assert attention_bias == ("o_proj.bias" in grads)
    for name, reference in zip(names, expected, strict=True):
        size = max(1.0, float(reference.abs().max()))
        np.testing.assert_allclose(grads[name], reference.numpy(), rtol=0, atol=1e-12 * size,
                                   err_msg=name)
