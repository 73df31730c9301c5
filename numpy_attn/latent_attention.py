"""Multi-head latent attention (MLA, DeepSeek-V2/V3) in NumPy: the naive and the absorbed form,
and decoding over a latent key cache.

Keys and values come from one compressed latent ``c`` per token (``kv_lora_rank`` dims) plus a
decoupled rotary key ``k_pe`` (``qk_rope_head_dim`` dims) shared by every head. The **naive**
form (prefill, training) projects the latent up to per-head keys and values and runs ordinary
multi-head attention. The **absorbed** form (decoding) folds the key up-projection ``W_UK`` into
the query and the value up-projection ``W_UV`` into the output, so the attention runs directly
over the cached ``[c ; k_pe]``: multi-query attention with one kv head whose values are the
keys' first ``kv_lora_rank`` dims (``spec.LATENT_ATTENTION``).

Weights are held in transformers' DeepSeek-V3 names and orientation, ``(out_features,
in_features)`` (``y = x @ Wᵀ``), so a transformers layer's ``self_attn.state_dict()`` loads
directly. The latent cache is a ``KVCache`` or ``PagedKVCache`` of one kv head of
``kv_lora_rank + qk_rope_head_dim`` dims and ``v_dim=0``: the values are never stored, the
attention reads them as a view of the keys.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import attention_rules as rules
from attention_rules import latent_attention as latent_rules

from .backward import projection_grads, scaled_dot_product_attention_vjp
from .functional import scaled_dot_product_attention
from .kv_cache import KVCache
from .paged import PagedKVCache, paged_attention, split_kv_attention
from .rotary import RoPE, rope_frequencies, rotary_embedding, rotary_embedding_vjp


def _linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``x @ weightᵀ + bias`` (``weight (out, in)``, ``bias (out,)`` or None: torch's
    ``nn.Linear``) in the inputs' dtype."""
    projected = np.matmul(x, weight.T)  # (..., out)
    if bias is not None:
        projected = projected + bias
    return projected.astype(np.result_type(x, weight), copy=False)


def _heads(x: np.ndarray, heads: int) -> np.ndarray:
    """``(..., seq, heads * dim)`` → ``(..., heads, seq, dim)``."""
    split = x.reshape(x.shape[:-1] + (heads, -1))  # (..., seq, heads, dim)
    return np.swapaxes(split, -2, -3)


def _merge_heads(x: np.ndarray) -> np.ndarray:
    """``(..., heads, seq, dim)`` → ``(..., seq, heads * dim)``."""
    merged = np.swapaxes(x, -2, -3)  # (..., seq, heads, dim)
    return merged.reshape(merged.shape[:-2] + (-1,))


def _bias_grads(grad_projected: np.ndarray) -> np.ndarray:
    """Gradient of ``b`` in ``y = x @ Wᵀ + b``: ``(..., out)`` → ``(out,)``, ``dy`` summed over
    every axis but the last."""
    return grad_projected.reshape(-1, grad_projected.shape[-1]).sum(axis=0)


class MultiHeadLatentAttention:
    """Multi-head latent attention, DeepSeek-V3's ``DeepseekV3Attention``.

    Weights (``export_weights`` keys, transformers' names, ``(out, in)``): ``q_proj.weight``
    (``q_lora_rank=None``) or ``q_a_proj.weight``, ``q_a_layernorm.weight``,
    ``q_b_proj.weight``; ``kv_a_proj_with_mqa.weight``, ``kv_a_layernorm.weight``,
    ``kv_b_proj.weight``, ``o_proj.weight``. Projections Xavier uniform, RMSNorm gains ones.
    With ``attention_bias=True`` (transformers' ``config.attention_bias``) also
    ``q_a_proj.bias`` (with a ``q_lora_rank``), ``kv_a_proj_with_mqa.bias`` and
    ``o_proj.bias``, zeros, drawn after nothing (the other weights are those of the same
    module without biases); ``q_proj``, ``q_b_proj`` and ``kv_b_proj`` never have one.
    """

    training: bool = True

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
        rope: RoPE | None = None,
        rms_norm_eps: float = 1e-6,
        attention_bias: bool = False,
        rng: Any = None,
    ) -> None:
        fn = "MultiHeadLatentAttention"
        self.sizes = latent_rules.latent_sizes(fn, d_model, num_heads, q_lora_rank,
                                               kv_lora_rank, qk_nope_head_dim,
                                               qk_rope_head_dim, v_head_dim)
        rope = RoPE(layout="interleaved") if rope is None else rope
        if not isinstance(rope, RoPE):
            raise TypeError(f"{fn}: rope must be a RoPE or None; got rope={rope!r}")
        latent_rules.check_rope_dims(fn, rope.rotary_dim, qk_rope_head_dim)
        self.rope = rope
        self.rms_norm_eps = latent_rules.check_rms_norm_eps(fn, rms_norm_eps)
        self.scale = latent_rules.softmax_scale(self.sizes, rope.scaling)
        attention_bias = latent_rules.check_attention_bias(fn, attention_bias)
        rng = np.random.default_rng() if rng is None else rng
        self.weights: dict[str, np.ndarray] = {}
        for name, shape in latent_rules.weight_shapes(self.sizes, attention_bias).items():
            if name.endswith(".bias"):  # zeros (torch's nn.Linear would draw them uniform)
                self.weights[name] = np.zeros(shape, np.float32)
            elif len(shape) == 1:  # an RMSNorm gain
                self.weights[name] = np.ones(shape, np.float32)
            else:  # Xavier uniform, (out, in)
                bound = (6.0 / (shape[0] + shape[1])) ** 0.5
                self.weights[name] = rng.uniform(-bound, bound, shape).astype(np.float32)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def train(self, mode: bool = True) -> MultiHeadLatentAttention:
        """Training mode (no dropout here: nothing changes); returns the module."""
        self.training = mode
        return self

    def eval(self) -> MultiHeadLatentAttention:
        """Inference mode; returns the module."""
        return self.train(False)

    def export_weights(self) -> dict[str, np.ndarray]:
        """Flat dict, transformers' names → NumPy array ``(out, in)`` (copies)."""
        return {name: np.array(w) for name, w in self.weights.items()}

    def load_weights(self, weights: dict[str, Any]) -> MultiHeadLatentAttention:
        """Load weights in transformers' DeepSeek-V3 names (any backend's export, or a
        transformers layer's ``self_attn.state_dict()`` as arrays); keeps their dtype; returns
        the module, updated in place."""
        rules.check_weight_shapes(
            "MultiHeadLatentAttention.load_weights",
            {n: tuple(w.shape) for n, w in self.weights.items()},
            {n: tuple(np.shape(w)) for n, w in weights.items()})
        for name in self.weights:
            self.weights[name] = np.array(weights[name])
        return self

    def _rope_arguments(self) -> dict[str, Any]:
        """``rotary_embedding``'s keywords: the rope's layout and frequencies over
        ``qk_rope_head_dim`` dims."""
        inv_freq, attention_factor = rope_frequencies(
            self.sizes.qk_rope_head_dim, theta=self.rope.theta, scaling=self.rope.scaling,
            max_position_embeddings=self.rope.max_position_embeddings)
        return {"layout": self.rope.layout, "inv_freq": inv_freq,
                "attention_factor": attention_factor}

    def _rms_norm(self, x: np.ndarray, name: str) -> np.ndarray:
        """RMSNorm over the last axis in the compute dtype, rounded to x's dtype, times the
        gain ``name``: ``g · x / sqrt(mean(x²) + eps)`` (transformers' DeepseekV3RMSNorm)."""
        compute = np.dtype(rules.compute_dtype(x.dtype.name))
        xc = x.astype(compute, copy=False)
        inv_rms = 1.0 / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + compute.type(
            self.rms_norm_eps))
        normed = (xc * inv_rms).astype(x.dtype, copy=False)
        return (self.weights[name] * normed).astype(np.result_type(x, self.weights[name]))

    def _check(self, fn: str, x: Any) -> np.ndarray:
        x = np.asarray(x)
        rules.check_float_inputs(fn, x=x.dtype.name)
        latent_rules.check_input(fn, tuple(x.shape), self.sizes.d_model)
        return x

    def _stages(self, x: np.ndarray, positions: Any) -> dict[str, np.ndarray]:
        """The projections: ``q (..., heads, seq, qk_head_dim)`` (before the rotation),
        ``q_nope (..., heads, seq, qk_nope_head_dim)``, ``q_pe (..., heads, seq,
        qk_rope_head_dim)`` (rotated), ``kv_a (..., seq, kv_lora_rank + qk_rope_head_dim)``,
        ``c (..., 1, seq, kv_lora_rank)`` (normalised), ``k_pe (..., 1, seq,
        qk_rope_head_dim)`` (rotated), and the q path's ``q_a`` with a ``q_lora_rank``."""
        s, w = self.sizes, self.weights
        stages: dict[str, np.ndarray] = {}
        if s.q_lora_rank is None:
            q = _linear(x, w["q_proj.weight"])  # (..., seq, heads * qk_head_dim)
        else:  # (..., seq, q_lora_rank)
            stages["q_a"] = _linear(x, w["q_a_proj.weight"], w.get("q_a_proj.bias"))
            q = _linear(self._rms_norm(stages["q_a"], "q_a_layernorm.weight"),
                        w["q_b_proj.weight"])
        stages["q"] = q = _heads(q, s.num_heads)  # (..., heads, seq, qk_head_dim)
        rope = self._rope_arguments()
        stages["q_nope"] = q[..., : s.qk_nope_head_dim]
        stages["q_pe"] = rotary_embedding(q[..., s.qk_nope_head_dim:], positions, **rope)
        kv_a = _linear(x, w["kv_a_proj_with_mqa.weight"], w.get("kv_a_proj_with_mqa.bias"))
        stages["kv_a"] = kv_a  # (..., seq, r + dr)
        c = self._rms_norm(kv_a[..., : s.kv_lora_rank], "kv_a_layernorm.weight")
        stages["c"] = c[..., None, :, :]  # (..., 1, seq, kv_lora_rank)
        k_pe = kv_a[..., None, :, s.kv_lora_rank:]  # (..., 1, seq, qk_rope_head_dim)
        stages["k_pe"] = rotary_embedding(k_pe, positions, **rope)
        return stages

    def _naive(self, stages: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        """The naive form's query, key ``(..., heads, seq, qk_head_dim)`` and value
        ``(..., heads, seq, v_head_dim)``: the latent projected up per head (``kv_b_proj``),
        ``k_pe`` broadcast to every head."""
        s = self.sizes
        kv = _heads(_linear(stages["c"][..., 0, :, :], self.weights["kv_b_proj.weight"]),
                    s.num_heads)  # (..., heads, seq, qk_nope_head_dim + v_head_dim)
        k_nope, value = kv[..., : s.qk_nope_head_dim], kv[..., s.qk_nope_head_dim:]
        k_pe = np.broadcast_to(stages["k_pe"], k_nope.shape[:-1] + (s.qk_rope_head_dim,))
        query = np.concatenate([stages["q_nope"], stages["q_pe"]], axis=-1)
        key = np.concatenate([k_nope, k_pe], axis=-1)  # (..., heads, seq, qk_head_dim)
        return query, key, value

    def _absorb_weights(self) -> tuple[np.ndarray, np.ndarray]:
        """``kv_b_proj`` split per head: ``W_UK (heads, qk_nope_head_dim, kv_lora_rank)`` and
        ``W_UV (heads, v_head_dim, kv_lora_rank)``."""
        s = self.sizes
        w_b = self.weights["kv_b_proj.weight"].reshape(
            s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        return w_b[:, : s.qk_nope_head_dim], w_b[:, s.qk_nope_head_dim:]

    def _absorbed_query(self, stages: dict[str, np.ndarray]) -> np.ndarray:
        """``[q_nope @ W_UK ; q_pe]`` ``(..., heads, seq, kv_lora_rank + qk_rope_head_dim)``,
        times ``scale · sqrt(kv_lora_rank + qk_rope_head_dim)``: the module's softmax scale
        folded in, so the attention over the latent keys runs at its default scale."""
        w_uk, _ = self._absorb_weights()
        q_latent = np.matmul(stages["q_nope"], w_uk).astype(stages["q_nope"].dtype)  # (.., r)
        query = np.concatenate([q_latent, stages["q_pe"]], axis=-1)
        ratio = self.scale / rules.default_scale(self.sizes.latent_dim)
        return (query * query.dtype.type(ratio)).astype(query.dtype, copy=False)

    def _absorbed_output(self, context_latent: np.ndarray) -> np.ndarray:
        """``(..., heads, seq, kv_lora_rank)`` → ``(..., heads, seq, v_head_dim)``: each head's
        ``W_UV`` applied to its latent context."""
        _, w_uv = self._absorb_weights()
        return np.matmul(context_latent, np.swapaxes(w_uv, -1, -2)).astype(
            context_latent.dtype, copy=False)

    def _out(self, context: np.ndarray) -> np.ndarray:
        """``(..., heads, seq, v_head_dim)`` → ``o_proj`` ``(..., seq, d_model)``."""
        w = self.weights
        return _linear(_merge_heads(context), w["o_proj.weight"], w.get("o_proj.bias"))

    def forward(
        self,
        x: Any,
        *,
        positions: Any = None,
        mask: Any = None,
        is_causal: bool = False,
        absorbed: bool = False,
    ) -> np.ndarray:
        """Self-attention of ``x``, naive (default) or absorbed; the two are equal.

        Args:
          x: ``(..., seq, d_model)``.
          positions: integer ``(..., seq)``, the tokens' rope positions (default
            ``0..seq-1``).
          mask: boolean, broadcastable to ``(..., num_heads, seq, seq)``; True = may attend.
          is_causal: top-left causal rule.
          absorbed: run the absorbed form (``W_UK`` in the query, ``W_UV`` in the output,
            attention over ``[c ; k_pe]`` with one kv head).

        Returns:
          ``(..., seq, d_model)``.
        """
        fn = "MultiHeadLatentAttention.forward"
        x = self._check(fn, x)
        latent_rules.check_absorbed(fn, absorbed)
        positions = np.arange(x.shape[-2]) if positions is None else positions
        stages = self._stages(x, positions)
        if not absorbed:
            query, key, value = self._naive(stages)
            context = scaled_dot_product_attention(query, key, value, mask=mask,
                                                   is_causal=is_causal, scale=self.scale)
            return self._out(context)  # (..., seq, d_model)
        key = np.concatenate([stages["c"], stages["k_pe"]], axis=-1)  # (..., 1, seq, r + dr)
        context_latent = scaled_dot_product_attention(
            self._absorbed_query(stages), key, key[..., : self.sizes.kv_lora_rank], mask=mask,
            is_causal=is_causal)  # (..., heads, seq, kv_lora_rank)
        return self._out(self._absorbed_output(context_latent))

    def parameter_gradients(
        self,
        x: Any,
        grad_output: Any,
        *,
        positions: Any = None,
        mask: Any = None,
        is_causal: bool = False,
    ) -> dict[str, np.ndarray]:
        """Every weight's gradient of the naive ``forward`` (the backward pass by hand).

        Args:
          x: ``(..., seq, d_model)``; grad_output: ``(..., seq, d_model)``, dL/d output.
          positions, mask, is_causal: as in ``forward``.

        Returns:
          weight name → gradient ``(out, in)`` / ``(dim,)``, the keys of ``export_weights``.
          Back through ``o_proj``, the attention's VJP, the split into heads, the rotations
          (``rotary_embedding_vjp``; ``k_pe``'s gradient summed over the heads that share it),
          ``kv_b_proj``, the RMSNorms and the down-projections; a bias's gradient is its
          projection's output gradient summed over every axis but the last.
        """
        fn = "MultiHeadLatentAttention.parameter_gradients"
        x = self._check(fn, x)
        grad_output = np.asarray(grad_output)
        s, w = self.sizes, self.weights
        positions = np.arange(x.shape[-2]) if positions is None else positions
        stages = self._stages(x, positions)
        query, key, value = self._naive(stages)
        context = scaled_dot_product_attention(query, key, value, mask=mask,
                                               is_causal=is_causal, scale=self.scale)
        # Every bias's gradient is computed; the return keeps those the module has.
        grads = {"o_proj.weight": projection_grads(_merge_heads(context), grad_output).T,
                 "o_proj.bias": _bias_grads(grad_output)}
        grad_context = _heads(_linear(grad_output, w["o_proj.weight"].T), s.num_heads)
        grad_q, grad_k, grad_v, *_ = scaled_dot_product_attention_vjp(
            query, key, value, grad_context, mask=mask, is_causal=is_causal, scale=self.scale)
        rope = self._rope_arguments()
        dn, r = s.qk_nope_head_dim, s.kv_lora_rank
        grad_q_pe = rotary_embedding_vjp(stages["q"][..., dn:], positions, grad_q[..., dn:],
                                         **rope)
        grad_q_heads = np.concatenate([grad_q[..., :dn], grad_q_pe], axis=-1)
        grad_k_pe = rotary_embedding_vjp(stages["kv_a"][..., None, :, r:], positions,
                                         grad_k[..., dn:].sum(axis=-3, keepdims=True), **rope)
        grad_kv = _merge_heads(np.concatenate([grad_k[..., :dn], grad_v], axis=-1))
        c = stages["c"][..., 0, :, :]  # (..., seq, kv_lora_rank)
        grads["kv_b_proj.weight"] = projection_grads(c, grad_kv).T
        grad_c, grads["kv_a_layernorm.weight"] = self._rms_norm_vjp(
            stages["kv_a"][..., :r], _linear(grad_kv, w["kv_b_proj.weight"].T),
            "kv_a_layernorm.weight")
        grad_kv_a = np.concatenate([grad_c, grad_k_pe[..., 0, :, :]], axis=-1)
        grads["kv_a_proj_with_mqa.weight"] = projection_grads(x, grad_kv_a).T
        grads["kv_a_proj_with_mqa.bias"] = _bias_grads(grad_kv_a)
        grad_q_flat = _merge_heads(grad_q_heads)  # (..., seq, heads * qk_head_dim)
        if s.q_lora_rank is None:
            grads["q_proj.weight"] = projection_grads(x, grad_q_flat).T
        else:
            q_a = stages["q_a"]
            normed = self._rms_norm(q_a, "q_a_layernorm.weight")
            grads["q_b_proj.weight"] = projection_grads(normed, grad_q_flat).T
            grad_q_a, grads["q_a_layernorm.weight"] = self._rms_norm_vjp(
                q_a, _linear(grad_q_flat, w["q_b_proj.weight"].T), "q_a_layernorm.weight")
            grads["q_a_proj.weight"] = projection_grads(x, grad_q_a).T
            grads["q_a_proj.bias"] = _bias_grads(grad_q_a)
        return {name: grads[name] for name in self.weights}

    def _rms_norm_vjp(self, x: np.ndarray, grad: np.ndarray,
                      name: str) -> tuple[np.ndarray, np.ndarray]:
        """The VJP of ``_rms_norm(x, name)``: ``(dL/dx (..., dim), dL/dgain (dim,))``. With
        ``n = x · s``, ``s = (mean(x²) + eps)^-½``: ``dgain = Σ dy · n``, ``dx = s · (dn - n ·
        mean(dn · n))`` where ``dn = dy · gain``."""
        inv_rms = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.rms_norm_eps)
        normed = x * inv_rms
        grad_gain = (grad * normed).reshape(-1, x.shape[-1]).sum(axis=0)
        grad_normed = grad * self.weights[name]
        grad_x = inv_rms * (grad_normed - normed * np.mean(grad_normed * normed, axis=-1,
                                                           keepdims=True))
        return grad_x.astype(x.dtype, copy=False), grad_gain.astype(x.dtype, copy=False)

    def decode(
        self, x: Any, cache: KVCache | PagedKVCache | None = None, *, max_len: int | None = None
    ) -> tuple[np.ndarray, KVCache | PagedKVCache]:
        """Incremental decoding in the absorbed form over a latent cache.

        Args:
          x: ``(..., n, d_model)`` (a ``PagedKVCache``: ``(batch, n, d_model)``, row ``b`` is
            sequence ``b``).
          cache: a latent cache from an earlier call, or None for a new ``KVCache``:
            ``KVCache.empty(batch_shape, 1, max_len, kv_lora_rank + qk_rope_head_dim, 0)`` or
            ``PagedKVCache(num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim, 0)``:
            one kv head of ``[c ; k_pe]`` per token, no values.
          max_len: capacity of the new cache when ``cache`` is None (default ``n``).

        Returns:
          ``(output (..., n, d_model), cache)``: the new tokens sit at positions ``length ..
          length + n - 1`` (a paged cache: each sequence's own length) and attend every cached
          token with the bottom-right causal rule, so decoding token by token equals
          ``forward(x_all, is_causal=True)``. The cache is updated in place.
        """
        fn = "MultiHeadLatentAttention.decode"
        x = self._check(fn, x)
        s, n = self.sizes, x.shape[-2]
        if cache is None:
            cache = KVCache.empty(x.shape[:-2], 1, n if max_len is None else max_len,
                                  s.latent_dim, 0, dtype=x.dtype)
        pages = isinstance(cache, PagedKVCache)
        buffer = cache.key_pages if pages else cache.key_buffer
        v_dim = (cache.value_pages if pages else cache.value_buffer).shape[-1]
        heads_axis = 2 if pages else -3
        latent_rules.check_latent_cache(fn, buffer.shape[heads_axis], buffer.shape[-1], v_dim, s)
        if pages:
            lengths = np.array([cache.seq_len(b) for b in range(x.shape[0])])
            positions = lengths[:, None] + np.arange(n)  # (batch, n)
        else:
            positions = cache.length + np.arange(n)  # (n,)
        stages = self._stages(x, positions)
        key = np.concatenate([stages["c"], stages["k_pe"]], axis=-1)  # (..., 1, n, r + dr)
        no_values = np.zeros(key.shape[:-1] + (v_dim,), key.dtype)  # never read
        query = self._absorbed_query(stages).astype(buffer.dtype, copy=False)
        r = s.kv_lora_rank
        if pages:
            cache = cache.append(key, no_values)
            table, lens = cache.tables(range(x.shape[0]))
            context_latent = paged_attention(query, cache.key_pages, cache.key_pages[..., :r],
                                             table, lens)
        else:
            cache = cache.append(key, no_values)
            keys = cache.keys  # (..., 1, length, r + dr): a view of the buffer
            chunk = rules.split_chunk(n, cache.length)
            if chunk is not None:  # few query rows over many keys: split-KV
                context_latent = split_kv_attention(query, keys, keys[..., :r], chunk)[0]
            else:
                context_latent = scaled_dot_product_attention(
                    query, keys, keys[..., :r], is_causal=True, causal_alignment="bottom_right")
        context = self._absorbed_output(context_latent.astype(x.dtype, copy=False))
        return self._out(context), cache  # (..., n, d_model)
