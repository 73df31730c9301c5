"""torch_attn inside a Llama 4 text model (chunked local attention) through ``register()``.

A tiny ``Llama4ForCausalLM`` from a seeded config (nothing is downloaded): 2 layers, the first
with RoPE and chunked attention (``attention_chunk_size=6``, shorter than the 20-token prompt:
a query attends only to the keys of its own chunk, causally), the second without RoPE (NoPE,
with Llama 4's attention-temperature tuning) and full causal attention; grouped-query heads
(4 query heads, 2 key/value heads), a dense MLP in the first layer and a mixture of experts
(4 experts, 1 per token, plus the shared expert) in the second.

What transformers passes (checked on the installed 5.24.0, ``transformers.masking_utils``):
``Llama4TextModel`` builds one mask per layer type, ``create_chunked_causal_mask`` for the
chunked layer; with ``register()``'s mask builder that is transformers' own boolean ``sdpa``
mask ``(batch, 1, q_len, kv_len)`` holding the chunk rule (its chunks start at each
sequence's first real token: left padding shifts them), causality and padding. So
``attention_forward`` needs nothing new: it takes the 4-D mask as ``mask``. The mask is left
out (None) only where transformers' ``_ignore_causal_mask_sdpa`` allows it, which for a
chunked layer requires ``kv_len < attention_chunk_size`` (every key in the first chunk: plain
causal, which ``attention_forward`` applies bottom-right). When decoding, the chunked layer's
cache (``DynamicSlidingWindowLayer``) keeps the last ``attention_chunk_size`` keys and the
mask covers those.

The reference is transformers' ``eager``: Llama 4's ``eager_attention_forward`` runs its
softmax in the input dtype, so in float64 it is float64-accurate and is compared directly
(unlike the Llama/Mistral/Gemma 2 tests, which need a float64-softmax copy of it). Padding
query rows attend no key: eager gives them the mean of the values, torch_attn 0, so logits
are compared at the real tokens and the loss leaves out the predictions made at padding
positions (as ``test_integration_transformers.py``). float32 passes the spec's tolerance rule
``|x - ref| <= atol + rtol·|ref| + k·e`` with ``e`` eager's own float32 error.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install torch==2.13.0")
pytest.importorskip("transformers", reason="needs transformers: pip install -e .[transformers]")

from transformers import (  # noqa: E402
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    Llama4TextConfig,
)

from conformance.comparing import compare  # noqa: E402
from torch_attn.integrations import transformers as hf  # noqa: E402

NAME = hf.register()
CHUNK = 6
LENGTHS = (20, 13)  # the second prompt is left-padded by 7: its chunks start at position 7
NEW_TOKENS = 20  # decoding runs to 40 positions: 7 chunks


def _config(**changes) -> Llama4TextConfig:
    settings = dict(
        vocab_size=96, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_local_experts=4, num_experts_per_tok=1, moe_layers=[1],
        attention_chunk_size=CHUNK, no_rope_layers=[1, 0],  # 1 = RoPE and chunked
        floor_scale=8, attn_scale=0.1,  # NoPE layer: temperature tuning grows every 8 tokens
        max_position_embeddings=64, initializer_range=0.2, pad_token_id=0,
    )
    return Llama4TextConfig(**{**settings, **changes})


def _build(attn: str, dtype=torch.float64, **changes):
    """The tiny model in ``dtype`` (seed 0, drawn in float64 then cast: the same weights for
    every implementation and dtype; drawing in float32 would give other numbers)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(**changes), attn_implementation=attn,
                                             dtype=torch.float64)
    return model.to(dtype)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(2, 20)`` and the padding mask (1 = token; the second prompt left-padded)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (len(LENGTHS), max(LENGTHS)), generator=generator)
    real = torch.arange(max(LENGTHS)) >= max(LENGTHS) - torch.tensor(LENGTHS)[:, None]
    return ids.masked_fill(~real, 0), real.long()


def _expected_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, chunk: int | None,
                   pad: tuple[int, ...] = (0, 7), shift: int = 0) -> torch.Tensor:
    """The mask a layer should see, written out: ``(batch, 1, q, kv)``, True = may attend.
    Positions count from the padded start; ``pad``: left-padding tokens per sequence (default:
    ``_batch``'s). Causal and no padding key; chunked (``chunk`` not None): ``(q - pad) //
    chunk == (k - pad) // chunk``, the chunks starting at each sequence's first real token.
    ``shift`` moves every chunk boundary (a planted bug)."""
    pad_ = torch.tensor(pad)[:, None, None, None]
    q, k = q_pos[:, None], k_pos[None, :]
    allowed = (k <= q) & (k >= pad_)
    if chunk is not None:
        allowed &= (q - pad_ + shift).div(chunk, rounding_mode="floor") == \
            (k - pad_ + shift).div(chunk, rounding_mode="floor")
    return allowed


_RUNS: dict = {}


def _run(attn: str, dtype) -> tuple[torch.Tensor, dict]:
    """Logits ``(2, 20, vocab)`` and every parameter's gradient of one training step's loss,
    cached per (attn, dtype). The loss leaves out every prediction made at a padding position
    (label -100 where the previous token is padding: that row attends no key)."""
    if (attn, dtype) not in _RUNS:
        model = _build(attn, dtype).train()
        ids, mask = _batch()
        labelled = mask.bool()
        labelled[:, 1:] &= labelled[:, :-1].clone()
        labelled[:, 0] = False
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(~labelled, -100))
        out.loss.backward()
        grads = {n: p.grad.detach().double() for n, p in model.named_parameters()
                 if p.grad is not None}
        assert len(grads) == len(list(model.parameters())) == 24  # every parameter has one
        _RUNS[attn, dtype] = (out.logits.detach().double(), grads)
    return _RUNS[attn, dtype]


def _worst(actual: torch.Tensor, expected: torch.Tensor, baseline: float) -> float:
    """The spec's float32 tolerance rule: worst ``|actual - expected| / bound`` (pass: ≤ 1)."""
    expected_np = expected.numpy()
    bound = compare.bound(expected_np, baseline, "float32")
    return float(np.max(np.abs(actual.numpy() - expected_np) / bound))


def test_the_model_has_a_chunked_and_a_full_layer():
    model = _build(NAME)
    assert model.config.layer_types == ["chunked_attention", "full_attention"]
    assert [layer.self_attn.use_rope for layer in model.model.layers] == [1, 0]
    assert [type(layer.feed_forward).__name__ for layer in model.model.layers] == \
        ["Llama4TextMLP", "Llama4TextMoe"]


def test_logits_and_gradients_equal_eager():
    """float64: within 1e-12 of eager at every real token, every gradient within 1e-12 of
    eager's (relative to its largest entry); float32: the spec's tolerance rule."""
    real = _batch()[1].bool()
    ref_logits, ref_grads = _run("eager", torch.float64)
    logits, grads = _run(NAME, torch.float64)
    assert torch.isfinite(logits).all()
    assert (logits - ref_logits)[real].abs().max() <= 1e-12
    assert ref_grads.keys() == grads.keys()
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max()
        assert scale > 0, name  # every parameter takes part in the loss
        assert (grad - ref_grads[name]).abs().max() <= 1e-12 * max(scale, 1.0), name
    eager_logits, eager_grads = _run("eager", torch.float32)
    logits, grads = _run(NAME, torch.float32)
    e = (eager_logits - ref_logits)[real].abs().max().item()
    assert e < 1e-4  # the same weights in both dtypes (else k·e would allow anything)
    assert _worst(logits[real], ref_logits[real], e) <= 1.0
    for name, grad in grads.items():
        e = (eager_grads[name] - ref_grads[name]).abs().max().item()
        assert _worst(grad, ref_grads[name], e) <= 1.0, name


def _spy(name: str) -> list:
    """Registers ``name``: ``attention_forward`` behind a spy that records ``(layer, mask)``."""
    seen: list = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((module.layer_idx, attention_mask))
        return hf.attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, spy)
    AttentionMaskInterface.register(name, hf.attention_mask)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["padded", "short", "short_static"])
def test_greedy_generation_with_cache_equals_eager(prompt):
    """20 greedy tokens with the KV cache, in float32, past several chunk boundaries (the
    chunked layer's cache holds only the last ``CHUNK`` keys): from ``_batch`` (20 tokens, one
    prompt left-padded) and from one unpadded 4-token prompt (shorter than a chunk: with the
    dynamic cache its prefill and first decoding step get no mask, the later steps a 4-D one;
    with a static cache, longer than the prompt, ``register()``'s builder passes the mask
    where transformers' ``sdpa`` builder would leave it out for a top-left causal rule)."""
    ids, mask = _batch()
    if prompt.startswith("short"):
        ids, mask = ids[:1, -4:], mask[:1, -4:]
    cache = {"cache_implementation": "static"} if prompt.endswith("static") else {}
    tokens = {}
    for attn in (NAME, "eager"):
        model = _build(attn, torch.float32).eval()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             **cache)
        tokens[attn] = out[:, ids.shape[1]:]
    assert tokens[NAME].shape == (ids.shape[0], NEW_TOKENS)
    assert torch.equal(tokens[NAME], tokens["eager"])
    assert len(set(tokens[NAME].flatten().tolist())) > 3  # not one token repeated


def test_unpadded_prompts_get_the_chunk_mask_once_longer_than_a_chunk():
    """Without padding, transformers leaves the mask out (None: ``attention_forward``'s
    bottom-right causal rule) only while every key is in the first chunk: a 4-token prompt
    gets None in both layers, a 20-token prompt the 4-D chunked mask in the chunked layer
    (None in the full one). The float64 logits equal eager's at every position in both."""
    seen = _spy("llama4_unpadded")
    ids = _batch()[0][:1]
    for length in (4, 20):
        with torch.no_grad():
            logits = _build("llama4_unpadded")(input_ids=ids[:, -length:]).logits
            ref = _build("eager")(input_ids=ids[:, -length:]).logits
        assert (logits - ref).abs().max() <= 1e-12, length
    assert [layer for layer, _ in seen] == [0, 1, 0, 1]
    assert seen[0][1] is None and seen[1][1] is None and seen[3][1] is None
    positions = torch.arange(20)
    assert torch.equal(seen[2][1], _expected_mask(positions, positions, CHUNK, pad=(0,)))


def test_transformers_passes_the_chunked_rule_as_a_4d_boolean_mask():
    """What reaches ``attention_forward``, prefill and decoding: for the chunked layer the
    boolean ``(batch, 1, q_len, kv_len)`` mask holds the chunk rule (chunks from each
    sequence's first real token), causality and padding, equal to ``_expected_mask``; the
    full layer's holds causality and padding. When decoding, the chunked layer's keys are
    the last ``CHUNK`` positions and the full layer's all of them."""
    seen = _spy("llama4_spy")
    ids, mask = _batch()
    model = _build("llama4_spy", torch.float32).eval()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3,
                   do_sample=False, pad_token_id=0)
    assert len(seen) == 2 * 3
    prompt = torch.arange(max(LENGTHS))
    for step, (layer, got) in enumerate(seen):
        q_pos = prompt if step < 2 else prompt[-1:] + step // 2
        k_pos = torch.arange(q_pos[-1] + 1)
        if layer == 0 and step >= 2:
            k_pos = k_pos[-CHUNK:]  # the chunked layer's cache
        assert got.dtype == torch.bool and got.shape == (2, 1, len(q_pos), len(k_pos)), step
        expected = _expected_mask(q_pos, k_pos, CHUNK if layer == 0 else None)
        assert torch.equal(got, expected), step
    assert not torch.equal(seen[0][1], seen[1][1])  # the chunk rule is not vacuous


def test_the_chunk_rule_matters_and_a_shifted_boundary_is_caught():
    """Controls: the same weights without chunking (``attention_chunk_size=64``), or with
    every chunk boundary shifted by one position (a planted bug: the mask rebuilt with
    ``shift=1`` before ``attention_forward``), give logits that move from eager's by far more
    than the 1e-12 the tests allow."""
    ref, _ = _run("eager", torch.float64)
    ids, mask = _batch()
    real = mask.bool()
    with torch.no_grad():
        unchunked = _build(NAME, attention_chunk_size=64)(input_ids=ids, attention_mask=mask)
    assert (unchunked.logits - ref)[real].abs().max() > 1e-3

    def shifted(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx == 0:
            positions = torch.arange(max(LENGTHS))
            attention_mask = _expected_mask(positions, positions, CHUNK, shift=1)
        return hf.attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("llama4_shifted", shifted)
    AttentionMaskInterface.register("llama4_shifted", hf.attention_mask)
    with torch.no_grad():
        planted = _build("llama4_shifted")(input_ids=ids, attention_mask=mask)
    assert (planted.logits - ref)[real].abs().max() > 1e-3


def test_the_documented_snippet_prints_what_the_docs_say():
    """The Llama 4 snippet of docs/integrations.md, run here, prints its documented text."""
    from pathlib import Path

    from test_docs import check_snippets_in_process

    docs = Path(__file__).resolve().parent.parent / "docs" / "integrations.md"
    check_snippets_in_process(docs, "Llama4TextConfig")
