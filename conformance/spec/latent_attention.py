"""Multi-head latent attention (MLA).

DeepSeek-V2/V3's attention (also Kimi K2, GLM-4 MoE Lite, MiniCPM3), exactly as transformers'
``DeepseekV3Attention``, with or without the biases of its ``config.attention_bias``: keys and
values come from one compressed latent per token plus a decoupled rotary key shared by every
head. The naive form runs it as multi-head attention (prefill, training); the absorbed form
folds the up-projections into the query and the output and attends the latent directly
(decoding, over a latent cache). The two are equal within the tolerance rule
(``TOLERANCES``).
"""

from __future__ import annotations

from typing import Any

LATENT_ATTENTION = (
    "Sizes: d_model, num_heads (H), q_lora_rank (None or r_q), kv_lora_rank (r), "
    "qk_nope_head_dim (d_n), qk_rope_head_dim (d_r, even), v_head_dim (d_v); qk_head_dim = "
    "d_n + d_r. Weights, transformers' names and (out, in) orientation (y = x @ W^T): q path "
    "q_proj.weight (H*(d_n+d_r), d_model) when q_lora_rank is None, else q_a_proj.weight "
    "(r_q, d_model) -> RMSNorm q_a_layernorm.weight (r_q,) -> q_b_proj.weight (H*(d_n+d_r), "
    "r_q); kv path kv_a_proj_with_mqa.weight (r + d_r, d_model), kv_a_layernorm.weight (r,), "
    "kv_b_proj.weight (H*(d_n+d_v), r); o_proj.weight (d_model, H*d_v). "
    "attention_bias=True (transformers' config.attention_bias) adds q_a_proj.bias (r_q,) "
    "(only with q_lora_rank), kv_a_proj_with_mqa.bias (r + d_r,) and o_proj.bias (d_model,), "
    "each right after its weight (transformers' state_dict order); q_proj, q_b_proj and "
    "kv_b_proj never have a bias. A projection with a bias is y = x @ W^T + b: q_a and kv_a "
    "include theirs before the RMSNorm and the split, o_proj adds its after the merge; the "
    "absorbed form is otherwise unchanged (kv_b_proj, folded into W_UK and W_UV, has none). "
    "RMSNorm(x) = g * x / sqrt(mean(x^2) + rms_norm_eps), the mean and root in the compute "
    "dtype, rounded to x's dtype before the gain (transformers' DeepseekV3RMSNorm). "
    "Forward, x (..., seq, d_model) at integer positions (..., seq): q = q-path(x) split per "
    "head (..., H, seq, d_n + d_r) into q_nope (first d_n) and q_pe (last d_r); kv_a = x @ "
    "W_kv_a^T split into c = RMSNorm(kv_a[..., :r]) (the latent) and k_pe = kv_a[..., r:] "
    "(one head, shared by all H). RoPE (rotary_embedding with the rope's layout and "
    "rope_frequencies(d_r, ...)'s inverse frequencies and attention factor) rotates q_pe and "
    "k_pe only, all d_r dims; q_nope and the latent are never rotated (the decoupled rope). "
    "Naive: kv = c @ W_kv_b^T per head (..., H, seq, d_n + d_v) -> k_nope, v; query = [q_nope ; "
    "q_pe], key = [k_nope ; k_pe broadcast to H heads]; context = "
    "scaled_dot_product_attention(query, key, v, mask, is_causal, scale=softmax_scale) "
    "(..., H, seq, d_v); output = merge(context) @ W_o^T. "
    "softmax_scale = qk_head_dim^-0.5, times mscale^2 with mscale = 0.1 * mscale_all_dim * "
    "ln(factor) + 1 (1 for factor <= 1) when the rope's scaling is not 'default' and has a "
    "nonzero mscale_all_dim (transformers' yarn_apply_mscale; DeepSeek-V3's YaRN config)."
)

LATENT_ABSORBED = (
    "The absorbed form. kv_b_proj.weight reshaped (H, d_n + d_v, r) gives per head W_UK "
    "(d_n, r) (its first d_n rows) and W_UV (d_v, r) (the rest). Since q_nope . k_nope = "
    "(q_nope @ W_UK) . c, the query in latent space is q_lat = q_nope @ W_UK (..., H, seq, r); "
    "the absorbed query is [q_lat ; q_pe] (r + d_r dims) and every head attends one kv head "
    "(multi-query attention) whose keys are [c ; k_pe] (..., 1, seq, r + d_r) and whose values "
    "are the keys' first r dims, c: context_lat (..., H, seq, r). Then context = context_lat @ "
    "W_UV^T per head (..., H, seq, d_v), and o_proj as in the naive form. The scale is the "
    "same softmax_scale (a backend may fold softmax_scale * sqrt(r + d_r) into the absorbed "
    "query and attend at the default scale of r + d_r dims, as the project's backends do, so "
    "the split-KV and paged kernels apply unchanged). Equal to the naive form within the "
    "tolerance rule: the two differ only in the order of the sums."
)

LATENT_CACHE = (
    "The latent cache holds per token one kv head of r + d_r numbers, [c ; k_pe] (k_pe rotated "
    "at its position), and no values: a KVCache (..., 1, max_len, r + d_r) with v_dim 0 "
    "(KVCache.empty(batch_shape, 1, max_len, r + d_r, 0)), or a PagedKVCache(num_blocks, "
    "block_size, 1, r + d_r, 0) (a pool of keys only). "
    "The attention reads the values as the keys' first r dims (numpy_attn and torch_attn: a "
    "view, no copy; jax_attn: a slice). decode(x, cache) places its n new tokens at positions "
    "length .. length + n - 1 (a paged cache: each sequence's own length), appends their "
    "[c ; k_pe], and attends in the absorbed form with the bottom-right causal rule, through "
    "the split-KV path of a long contiguous cache (SPLIT_DECODING) or paged_attention; so "
    "decoding token by token equals forward(x_all, is_causal=True). Per token and layer the "
    "cache holds r + d_r numbers where materialised K/V hold H * (d_n + d_r + d_v): DeepSeek-V3 "
    "(H=128, r=512, d_r=64, d_n=128, d_v=128) 576 vs 40,960 (71x less)."
)

LATENT_ERRORS = {
    "ValueError": [
        "a size not an int >= 1 (q_lora_rank: None or an int >= 1), or qk_rope_head_dim odd",
        "rope.rotary_dim neither None nor qk_rope_head_dim",
        "rms_norm_eps not a finite number >= 0",
        "x not (..., seq, d_model)",
        "load_weights: names or shapes differ from export_weights'",
        "decode: a cache that is not a latent cache (kv_heads 1, head_dim r + d_r, v_dim 0 or 1)",
    ],
    "TypeError": ["rope not a RoPE or None", "attention_bias not a bool", "absorbed not a bool",
                  "x not floating"],
}


class MultiHeadLatentAttention:
    """Multi-head latent attention (``LATENT_ATTENTION``), weights in transformers' DeepSeek-V3
    names: a transformers layer's ``self_attn.state_dict()`` loads as is (torch_attn's
    ``state_dict()`` has the same keys). Projections drawn Xavier uniform, RMSNorm gains 1.
    ``attention_bias=True`` adds the biases of ``q_a_proj`` (with ``q_lora_rank``),
    ``kv_a_proj_with_mqa`` and ``o_proj``, initialised to zeros (torch's ``nn.Linear`` draws
    them uniform; zeros are this spec's choice, so a module with biases computes at first what
    the module without them does) and drawn after nothing: the other weights are those of the
    same module without biases.
    ``rope`` None means ``RoPE(layout="interleaved")`` (DeepSeek-V3's ``rope_interleave``;
    transformers' interleaved rotation returns the pairs de-interleaved, the same scores). No
    dropout; ``train``/``eval`` set the mode (jax_attn returns a new module)."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        q_lora_rank: int | None = None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rope: Any = None,
        rms_norm_eps: float = 1e-6,
        attention_bias: bool = False,
        rng: Any = None,
    ) -> None:
        """``attention_bias``: a bool, the biases of transformers' ``config.attention_bias``
        (``LATENT_ATTENTION``); ``rng``: the backend's random source for the initial
        weights."""

    def forward(
        self,
        x: Any,
        *,
        positions: Any = None,
        mask: Any = None,
        is_causal: bool = False,
        absorbed: bool = False,
    ) -> Any:
        """``x (..., seq, d_model)`` at ``positions (..., seq)`` (default ``0..seq-1``) →
        ``(..., seq, d_model)``; ``mask`` broadcastable to ``(..., num_heads, seq, seq)``
        (True = may attend); ``absorbed=True`` runs the absorbed form (``LATENT_ABSORBED``)."""

    def parameter_gradients(
        self,
        x: Any,
        grad_output: Any,
        *,
        positions: Any = None,
        mask: Any = None,
        is_causal: bool = False,
    ) -> dict[str, Any]:
        """Every weight's gradient of the naive forward, NumPy arrays under the weights' names
        (numpy_attn by hand: rotary_embedding_vjp, the RMSNorm's VJP; the others autodiff); a
        bias's gradient is its projection's output gradient summed over every axis but the
        last."""

    def decode(self, x: Any, cache: Any = None, *, max_len: int | None = None) -> tuple:
        """``x (..., n, d_model)`` → ``(output (..., n, d_model), cache)``: the absorbed form
        over a latent cache (``LATENT_CACHE``); None starts a ``KVCache`` of ``max_len``."""

    def export_weights(self) -> dict[str, Any]:
        """Flat dict, transformers' names → NumPy array (``(out, in)``, ``(dim,)``, a bias
        ``(out,)``)."""

    def load_weights(self, weights: dict[str, Any]) -> Any:
        """Load weights of the same names and shapes; keeps their dtype; returns the module."""

    def train(self, mode: bool = True) -> Any:
        """Set the mode; returns the module."""

    def eval(self) -> Any:
        """``train(False)``."""
