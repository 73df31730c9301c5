"""Multi-head latent attention (MLA, DeepSeek-V2/V3) in JAX: the naive and the absorbed form,
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
attention reads them as a slice of the keys.

jax: the module is an immutable pytree (its leaves: the weights dict), so ``jax.grad``,
``jax.jit`` and ``jax.vmap`` take it; ``load_weights`` returns a new module and ``decode`` a
new cache (``cache = ...``). ``parameter_gradients`` runs ``jax.vjp``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules
from attention_rules import latent_attention as latent_rules

from .backward import module_weight_grads
from .functional import scaled_dot_product_attention
from .kv_cache import KVCache
from .paged import PagedKVCache, paged_attention, split_kv_attention
from .rotary import RoPE, rope_frequencies, rotary_embedding


def _linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """``x @ weightᵀ + bias`` (``weight (out, in)``, ``bias (out,)`` or None: torch's
    ``nn.Linear``) in the inputs' dtype."""
    projected = jnp.matmul(x, weight.T)  # (..., out)
    if bias is not None:
        projected = projected + bias
    return projected.astype(jnp.result_type(x, weight))


def _heads(x: jax.Array, heads: int) -> jax.Array:
    """``(..., seq, heads * dim)`` → ``(..., heads, seq, dim)``."""
    split = x.reshape(x.shape[:-1] + (heads, -1))  # (..., seq, heads, dim)
    return jnp.swapaxes(split, -2, -3)


def _merge_heads(x: jax.Array) -> jax.Array:
    """``(..., heads, seq, dim)`` → ``(..., seq, heads * dim)``."""
    merged = jnp.swapaxes(x, -2, -3)  # (..., seq, heads, dim)
    return merged.reshape(merged.shape[:-2] + (-1,))


@jax.tree_util.register_pytree_node_class
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
        # jax: one key per weight of the module without biases, so the biases change no draw
        unbiased = latent_rules.weight_shapes(self.sizes)
        keys = dict(zip(unbiased, jax.random.split(
            jax.random.PRNGKey(0) if rng is None else rng, len(unbiased)), strict=True))
        self.weights: dict[str, jax.Array] = {}
        for name, shape in latent_rules.weight_shapes(self.sizes, attention_bias).items():
            if name.endswith(".bias"):  # zeros (torch's nn.Linear would draw them uniform)
                self.weights[name] = jnp.zeros(shape, jnp.float32)
            elif len(shape) == 1:  # an RMSNorm gain
                self.weights[name] = jnp.ones(shape, jnp.float32)
            else:  # Xavier uniform, (out, in)
                bound = (6.0 / (shape[0] + shape[1])) ** 0.5
                self.weights[name] = jax.random.uniform(keys[name], shape, jnp.float32,
                                                        -bound, bound)

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """jax: leaves, the weights dict; static part, the sizes, rope and mode."""
        return (self.weights,), (self.sizes, self.rope, self.rms_norm_eps, self.scale,
                                 self.training)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], leaves: Any) -> MultiHeadLatentAttention:
        """Rebuild a module from ``tree_flatten``'s output, without drawing weights."""
        module = object.__new__(cls)
        module.sizes, module.rope, module.rms_norm_eps, module.scale, module.training = aux
        module.weights = dict(leaves[0])
        return module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def train(self, mode: bool = True) -> MultiHeadLatentAttention:
        """Training mode (no dropout here: nothing changes); returns a new module."""
        module = self.tree_unflatten(self.tree_flatten()[1], self.tree_flatten()[0])
        module.training = mode
        return module

    def eval(self) -> MultiHeadLatentAttention:
        """Inference mode; returns the module."""
        return self.train(False)

    def export_weights(self) -> dict[str, jax.Array]:
        """Flat dict, transformers' names → NumPy array ``(out, in)`` (copies)."""
        return {name: np.array(w) for name, w in self.weights.items()}

    def load_weights(self, weights: dict[str, Any]) -> MultiHeadLatentAttention:
        """Load weights in transformers' DeepSeek-V3 names (any backend's export, or a
        transformers layer's ``self_attn.state_dict()`` as arrays); keeps their dtype; returns
        a new module (jax: immutable)."""
        rules.check_weight_shapes(
            "MultiHeadLatentAttention.load_weights",
            {n: tuple(w.shape) for n, w in self.weights.items()},
            {n: tuple(np.shape(w)) for n, w in weights.items()})
        loaded = {name: jnp.asarray(np.asarray(weights[name])) for name in self.weights}
        return self.tree_unflatten(self.tree_flatten()[1], (loaded,))

    def _rope_arguments(self) -> dict[str, Any]:
        """``rotary_embedding``'s keywords: the rope's layout and frequencies over
        ``qk_rope_head_dim`` dims."""
        inv_freq, attention_factor = rope_frequencies(
            self.sizes.qk_rope_head_dim, theta=self.rope.theta, scaling=self.rope.scaling,
            max_position_embeddings=self.rope.max_position_embeddings)
        return {"layout": self.rope.layout, "inv_freq": inv_freq,
                "attention_factor": attention_factor}

    def _rms_norm(self, x: jax.Array, name: str) -> jax.Array:
        """RMSNorm over the last axis in the compute dtype, rounded to x's dtype, times the
        gain ``name``: ``g · x / sqrt(mean(x²) + eps)`` (transformers' DeepseekV3RMSNorm)."""
        xc = x.astype(jnp.float64 if x.dtype == jnp.float64 else jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + self.rms_norm_eps)
        normed = (xc * inv_rms).astype(x.dtype)
        return (self.weights[name] * normed).astype(jnp.result_type(x, self.weights[name]))

    def _check(self, fn: str, x: Any) -> jax.Array:
        x = jnp.asarray(x)
        rules.check_float_inputs(fn, x=x.dtype.name)
        latent_rules.check_input(fn, tuple(x.shape), self.sizes.d_model)
        return x

    def _stages(self, x: jax.Array, positions: Any) -> dict[str, jax.Array]:
        """The projections: ``q (..., heads, seq, qk_head_dim)`` (before the rotation),
        ``q_nope (..., heads, seq, qk_nope_head_dim)``, ``q_pe (..., heads, seq,
        qk_rope_head_dim)`` (rotated), ``kv_a (..., seq, kv_lora_rank + qk_rope_head_dim)``,
        ``c (..., 1, seq, kv_lora_rank)`` (normalised), ``k_pe (..., 1, seq,
        qk_rope_head_dim)`` (rotated), and the q path's ``q_a`` with a ``q_lora_rank``."""
        s, w = self.sizes, self.weights
        stages: dict[str, jax.Array] = {}
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

    def _naive(self, stages: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
        """The naive form's query, key ``(..., heads, seq, qk_head_dim)`` and value
        ``(..., heads, seq, v_head_dim)``: the latent projected up per head (``kv_b_proj``),
        ``k_pe`` broadcast to every head."""
        s = self.sizes
        kv = _heads(_linear(stages["c"][..., 0, :, :], self.weights["kv_b_proj.weight"]),
                    s.num_heads)  # (..., heads, seq, qk_nope_head_dim + v_head_dim)
        k_nope, value = kv[..., : s.qk_nope_head_dim], kv[..., s.qk_nope_head_dim:]
        k_pe = jnp.broadcast_to(stages["k_pe"], k_nope.shape[:-1] + (s.qk_rope_head_dim,))
        query = jnp.concatenate([stages["q_nope"], stages["q_pe"]], axis=-1)
        key = jnp.concatenate([k_nope, k_pe], axis=-1)  # (..., heads, seq, qk_head_dim)
        return query, key, value

    def _absorb_weights(self) -> tuple[jax.Array, jax.Array]:
        """``kv_b_proj`` split per head: ``W_UK (heads, qk_nope_head_dim, kv_lora_rank)`` and
        ``W_UV (heads, v_head_dim, kv_lora_rank)``."""
        s = self.sizes
        w_b = self.weights["kv_b_proj.weight"].reshape(
            s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        return w_b[:, : s.qk_nope_head_dim], w_b[:, s.qk_nope_head_dim:]

    def _absorbed_query(self, stages: dict[str, jax.Array]) -> jax.Array:
        """``[q_nope @ W_UK ; q_pe]`` ``(..., heads, seq, kv_lora_rank + qk_rope_head_dim)``,
        times ``scale · sqrt(kv_lora_rank + qk_rope_head_dim)``: the module's softmax scale
        folded in, so the attention over the latent keys runs at its default scale."""
        w_uk, _ = self._absorb_weights()
        q_latent = jnp.matmul(stages["q_nope"], w_uk).astype(stages["q_nope"].dtype)  # (.., r)
        query = jnp.concatenate([q_latent, stages["q_pe"]], axis=-1)
        ratio = self.scale / rules.default_scale(self.sizes.latent_dim)
        return (query * ratio).astype(query.dtype)

    def _absorbed_output(self, context_latent: jax.Array) -> jax.Array:
        """``(..., heads, seq, kv_lora_rank)`` → ``(..., heads, seq, v_head_dim)``: each head's
        ``W_UV`` applied to its latent context."""
        _, w_uv = self._absorb_weights()
        return jnp.matmul(context_latent, jnp.swapaxes(w_uv, -1, -2)).astype(
            context_latent.dtype)

    def _out(self, context: jax.Array) -> jax.Array:
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
    ) -> jax.Array:
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
        positions = jnp.arange(x.shape[-2]) if positions is None else positions
        stages = self._stages(x, positions)
        if not absorbed:
            query, key, value = self._naive(stages)
            context = scaled_dot_product_attention(query, key, value, mask=mask,
                                                   is_causal=is_causal, scale=self.scale)
            return self._out(context)  # (..., seq, d_model)
        key = jnp.concatenate([stages["c"], stages["k_pe"]], axis=-1)  # (..., 1, seq, r + dr)
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
        """Every weight's gradient of the naive ``forward``, by ``jax.vjp`` (one compiled
        program per shapes and ``is_causal``: ``backward.module_weight_grads``).

        Args:
          x: ``(..., seq, d_model)``; grad_output: ``(..., seq, d_model)``, dL/d output.
          positions, mask, is_causal: as in ``forward``.

        Returns:
          weight name → gradient ``(out, in)`` / ``(dim,)`` as NumPy arrays, the keys of
          ``export_weights``.
        """
        x = jnp.asarray(x)
        dtype = jnp.result_type(x, self.weights["o_proj.weight"])  # the output's dtype
        return module_weight_grads(self, (x,), jnp.asarray(grad_output, dtype),
                                   {"positions": positions, "mask": mask},
                                   (("is_causal", is_causal),))

    def decode(
        self, x: Any, cache: KVCache | PagedKVCache | None = None, *, max_len: int | None = None
    ) -> tuple[jax.Array, KVCache | PagedKVCache]:
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
          ``forward(x_all, is_causal=True)``. A new cache (jax: immutable).
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
            lengths = jnp.array([cache.seq_len(b) for b in range(x.shape[0])])
            positions = lengths[:, None] + jnp.arange(n)  # (batch, n)
        else:
            positions = cache.length + jnp.arange(n)  # (n,): jax, length may be traced
        stages = self._stages(x, positions)
        key = jnp.concatenate([stages["c"], stages["k_pe"]], axis=-1)  # (..., 1, n, r + dr)
        no_values = jnp.zeros(key.shape[:-1] + (v_dim,), key.dtype)  # never read
        query = self._absorbed_query(stages).astype(buffer.dtype)
        r = s.kv_lora_rank
        if pages:
            cache = cache.append(key, no_values)
            table, lens = cache.tables(range(x.shape[0]))
            context_latent = paged_attention(query, cache.key_pages, cache.key_pages[..., :r],
                                             table, lens)
        else:
            start = cache.length  # jax: the whole buffer is attended with a mask
            cache = cache.append(key, no_values)
            keys = cache.key_buffer  # (..., 1, max_len, r + dr); jax: the slice is a copy
            chunk = rules.split_chunk(n, cache.max_len)
            if chunk is not None:  # few query rows over many keys: split-KV
                context_latent = split_kv_attention(query, keys, keys[..., :r], chunk,
                                                    length=cache.length)[0]
            else:  # bottom-right causal over the filled part
                allowed = jnp.arange(cache.max_len)[None, :] <= start + jnp.arange(n)[:, None]
                context_latent = scaled_dot_product_attention(query, keys, keys[..., :r],
                                                              mask=allowed)
        context = self._absorbed_output(context_latent.astype(x.dtype))
        return self._out(context), cache  # (..., n, d_model)
