"""Attention modules in JAX, named as in the article; weights use ``x @ W``, ``W: (d_in, d_out)``.

Every module is an immutable pytree (registered with ``jax.tree_util``): its weights are the
leaves and its hyperparameters the static part, so a module can be passed through ``jax.jit``,
mapped with ``jax.tree_util.tree_map`` and trained with ``jax.grad``:
``jax.grad(lambda m: loss(m(x)))(module)`` is a module of the same kind holding the gradients.
``parameter_gradients(inputs..., grad_output)`` (``jax.vjp``, NumPy arrays under the weights'
names) is the harness's interface, the backward pass numpy_attn writes by hand. Modules are
built from an explicit ``jax.random`` key (``rng=``; None is a ValueError), drawing their
weights in numpy_attn's order. Weights export to a flat dict of NumPy arrays with the same keys
in every backend; ``load_weights`` returns a NEW module in the arrays' dtype.
``train()``/``eval()`` set the mode in place (the one attribute that changes) and return the
module; dropout needs an ``rng`` key. Projections use ``precision=Precision.HIGHEST``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules
from attention_rules import rotary as rotary_rules

from ._steps import HIGHEST
from .backward import module_weight_grads
from .functional import attention_scores, mask_scores, scaled_dot_product_attention
from .kv_cache import KVCache, decode_step
from .paged import PagedKVCache
from .rotary import RoPE, rope_frequencies, rotary_embedding


def _uniform(rng: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform on [0, 1), like ``torch.rand``: the article's initialisation."""
    return jax.random.uniform(rng, shape, dtype=jnp.float32)


def _xavier(rng: jax.Array, fan_in: int, fan_out: int) -> jax.Array:
    """Xavier/Glorot uniform ``(fan_in, fan_out)``: bound ``sqrt(6 / (fan_in + fan_out))``."""
    bound = (6.0 / (fan_in + fan_out)) ** 0.5
    return jax.random.uniform(rng, (fan_in, fan_out), jnp.float32, -bound, bound)


def _rng(fn: str, rng: Any, count: int) -> list[jax.Array]:
    # JAX has no global random state: one explicit key, split into one key per weight.
    if rng is None:
        raise ValueError(f"{fn}: rng must be a jax.random key (e.g. jax.random.key(0)) to draw "
                         "the initial weights; got rng=None")
    return list(jax.random.split(rng, count))


def _matmul(x: Any, w: jax.Array) -> jax.Array:
    """``x @ w`` at full precision (no TF32 on GPUs)."""
    return jnp.matmul(jnp.asarray(x), w, precision=HIGHEST)


class _Module:
    """Weights held as attributes named in ``_weight_names`` (the pytree leaves) and
    hyperparameters named in ``_static_names`` (the pytree's static part); immutable."""

    _weight_names: tuple[str, ...] = ()
    _static_names: tuple[str, ...] = ()
    training: bool = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"{type(self).__name__} is immutable; use load_weights(...) or "
            f"jax.tree_util.tree_map(...) to get a module with other weights"
        )

    def train(self, mode: bool = True) -> _Module:
        """Training mode (dropout on, with an ``rng`` key); returns the module."""
        self._set(training=bool(mode))
        return self

    def eval(self) -> _Module:
        """Inference mode (dropout off); returns the module."""
        return self.train(False)

    def _set(self, **attributes: Any) -> None:
        for name, value in attributes.items():
            object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        static = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._static_names)
        return f"{type(self).__name__}({static})"

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Leaves: the weights; static part: weight names and hyperparameters."""
        leaves = tuple(getattr(self, name) for name in self._weight_names)
        static = tuple((name, getattr(self, name)) for name in self._static_names)
        return leaves, (self._weight_names, static + (("training", self.training),))

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], leaves: Any) -> Any:
        """Rebuild a module from ``tree_flatten``'s output, without drawing weights."""
        weight_names, static = aux
        module = object.__new__(cls)
        module._set(_weight_names=weight_names, **dict(static))
        module._set(**dict(zip(weight_names, leaves, strict=True)))
        return module

    def export_weights(self) -> dict[str, np.ndarray]:
        """Flat dict name → NumPy array (copies)."""
        return {name: np.array(getattr(self, name)) for name in self._weight_names}

    def load_weights(self, weights: dict[str, Any]) -> _Module:
        """Load weights exported by any backend (same keys and shapes); returns a new module."""
        fn = f"{type(self).__name__}.load_weights"
        _check_weight_dict(fn, self.export_weights(), weights)
        leaves = tuple(jnp.asarray(weights[name]) for name in self._weight_names)
        return type(self).tree_unflatten(self.tree_flatten()[1], leaves)  # immutable: new module


def _check_weight_dict(fn: str, expected: dict[str, Any], weights: dict[str, Any]) -> None:
    rules.check_weight_shapes(  # the shapes of any backend's arrays, as plain tuples
        fn, {n: tuple(np.shape(a)) for n, a in expected.items()},
        {n: tuple(np.shape(w)) for n, w in weights.items()},
    )


def _check_no_dropout(module: _Module) -> None:
    rules.check_backward_without_dropout(
        type(module).__name__, module.training and module.dropout_p > 0, module.dropout_p
    )


def _check_rope(fn: str, rope: Any, head_dim: int) -> None:
    """``rope``: None or a ``RoPE`` whose ``rotary_dim`` fits ``head_dim`` (TypeError;
    ValueError naming both)."""
    if rope is not None and not isinstance(rope, RoPE):
        raise TypeError(f"{fn}: rope must be a RoPE or None; got rope={rope!r}")
    if rope is not None:
        rotary_rules.check_rotary_dim(fn, rope.rotary_dim, head_dim)


def _check_key_positions(fn: str, context: Any, key_positions: Any) -> None:
    """``key_positions`` belongs to cross-attention: self-attention rotates its keys at
    ``positions`` (ValueError)."""
    if context is None and key_positions is not None:
        raise ValueError(f"{fn}: key_positions is for cross-attention (a context); "
                         "self-attention rotates its keys at positions; got key_positions "
                         "with context=None")


@jax.tree_util.register_pytree_node_class
class SelfAttention(_Module):
    """The article's self-attention: one head, ``softmax(q kᵀ / sqrt(d_out_kq)) v``.

    Weights: ``W_query (d_in, d_out_kq)``, ``W_key (d_in, d_out_kq)``, ``W_value (d_in, d_out_v)``,
    drawn uniformly from [0, 1) in that order (one ``jax.random.split`` key each).
    """

    _weight_names = ("W_query", "W_key", "W_value")
    _static_names = ("d_out_kq",)

    def __init__(self, d_in: int, d_out_kq: int, d_out_v: int, *, rng: Any = None) -> None:
        rng_q, rng_k, rng_v = _rng("SelfAttention", rng, 3)
        self._set(d_out_kq=d_out_kq)
        self._set(W_query=_uniform(rng_q, (d_in, d_out_kq)),
                  W_key=_uniform(rng_k, (d_in, d_out_kq)), W_value=_uniform(rng_v, (d_in, d_out_v)))

    def forward(self, x: Any) -> jax.Array:
        """``x: (..., seq, d_in)`` → context vectors ``(..., seq, d_out_v)``."""
        queries = _matmul(x, self.W_query)  # (..., seq, d_out_kq)
        keys = _matmul(x, self.W_key)  # (..., seq, d_out_kq)
        values = _matmul(x, self.W_value)  # (..., seq, d_out_v)
        return scaled_dot_product_attention(queries, keys, values)

    def parameter_gradients(self, x: Any, grad_output: Any) -> dict[str, np.ndarray]:
        """Weight gradients for ``x: (..., seq, d_in)``, ``grad_output: (..., seq, d_out_v)``."""
        return module_weight_grads(self, (x,), grad_output)


@jax.tree_util.register_pytree_node_class
class CrossAttention(_Module):
    """The article's cross-attention: queries from ``x_1``, keys and values from ``x_2``."""

    _weight_names = ("W_query", "W_key", "W_value")
    _static_names = ("d_out_kq",)

    def __init__(self, d_in: int, d_out_kq: int, d_out_v: int, *, rng: Any = None) -> None:
        rng_q, rng_k, rng_v = _rng("CrossAttention", rng, 3)
        self._set(d_out_kq=d_out_kq)
        self._set(W_query=_uniform(rng_q, (d_in, d_out_kq)),
                  W_key=_uniform(rng_k, (d_in, d_out_kq)), W_value=_uniform(rng_v, (d_in, d_out_v)))

    def forward(self, x_1: Any, x_2: Any) -> jax.Array:
        """``x_1: (..., q_len, d_in)``, ``x_2: (..., kv_len, d_in)`` → ``(..., q_len, d_out_v)``."""
        queries_1 = _matmul(x_1, self.W_query)  # (..., q_len, d_out_kq)
        keys_2 = _matmul(x_2, self.W_key)  # (..., kv_len, d_out_kq)
        values_2 = _matmul(x_2, self.W_value)  # (..., kv_len, d_out_v)
        return scaled_dot_product_attention(queries_1, keys_2, values_2)

    def parameter_gradients(self, x_1: Any, x_2: Any, grad_output: Any) -> dict[str, np.ndarray]:
        """Weight gradients; ``grad_output: (..., q_len, d_out_v)``."""
        return module_weight_grads(self, (x_1, x_2), grad_output)


@jax.tree_util.register_pytree_node_class
class CausalSelfAttention(_Module):
    """The article's causal self-attention: token ``i`` sees tokens ``0..i`` only.

    Dropout on the weights (``dropout_p``) applies in training mode (``eval()`` turns it off)
    when ``forward`` gets an ``rng`` key.
    """

    _weight_names = ("W_query", "W_key", "W_value")
    _static_names = ("d_out_kq", "dropout_p")

    def __init__(
        self, d_in: int, d_out_kq: int, d_out_v: int, *, dropout_p: float = 0.0, rng: Any = None
    ) -> None:
        rules.check_dropout("CausalSelfAttention", dropout_p, False)
        rng_q, rng_k, rng_v = _rng("CausalSelfAttention", rng, 3)
        self._set(d_out_kq=d_out_kq, dropout_p=float(dropout_p))
        self._set(W_query=_uniform(rng_q, (d_in, d_out_kq)),
                  W_key=_uniform(rng_k, (d_in, d_out_kq)), W_value=_uniform(rng_v, (d_in, d_out_v)))

    def forward(self, x: Any, *, rng: Any = None) -> jax.Array:
        """``x: (..., seq, d_in)`` → ``(..., seq, d_out_v)``; an ``rng`` key turns dropout on."""
        queries = _matmul(x, self.W_query)  # (..., seq, d_out_kq)
        keys = _matmul(x, self.W_key)  # (..., seq, d_out_kq)
        values = _matmul(x, self.W_value)  # (..., seq, d_out_v)
        dropout_p = self.dropout_p if self.training and rng is not None else 0.0  # jax: a key
        return scaled_dot_product_attention(
            queries, keys, values, is_causal=True, dropout_p=dropout_p, rng=rng
        )

    def parameter_gradients(self, x: Any, grad_output: Any) -> dict[str, np.ndarray]:
        """Weight gradients, without dropout (``eval()`` or ``dropout_p=0``)."""
        _check_no_dropout(self)
        return module_weight_grads(self, (x,), grad_output)

    def decode(
        self, x: Any, cache: KVCache | None = None, *, max_len: int | None = None
    ) -> tuple[jax.Array, KVCache]:
        """Incremental decoding: the next tokens ``x: (..., n, d_in)`` attend the cached ones.

        Args:
          x: ``(..., n, d_in)``.
          cache: a ``KVCache`` with one head (``(..., 1, max_len, d_out_kq | d_out_v)``) from an
            earlier call, or None for a new one.
          max_len: capacity of the new cache when ``cache`` is None (default ``n``).

        Returns:
          ``(output (..., n, d_out_v), cache)``; no dropout. The cache is a new one (jax:
          immutable); jit-friendly, one compilation per chunk size.
        """
        queries = _matmul(x, self.W_query)[..., None, :, :]  # (..., 1, n, d_out_kq): one head
        keys = _matmul(x, self.W_key)[..., None, :, :]  # (..., 1, n, d_out_kq)
        values = _matmul(x, self.W_value)[..., None, :, :]  # (..., 1, n, d_out_v)
        context, cache = decode_step(queries, keys, values, cache, max_len)
        return context[..., 0, :, :], cache  # (..., n, d_out_v)


@jax.tree_util.register_pytree_node_class
class MultiHeadAttentionWrapper(_Module):
    """The article's multi-head wrapper: ``num_heads`` ``SelfAttention`` heads, concatenated.

    Weights: ``heads.{h}.W_query``, ``heads.{h}.W_key``, ``heads.{h}.W_value``.
    """

    def __init__(
        self, d_in: int, d_out_kq: int, d_out_v: int, num_heads: int, *, rng: Any = None
    ) -> None:
        rngs = _rng("MultiHeadAttentionWrapper", rng, num_heads)
        self._set(heads=tuple(SelfAttention(d_in, d_out_kq, d_out_v, rng=r) for r in rngs))

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Children: the heads (themselves pytrees)."""
        return self.heads, ()

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], heads: Any) -> MultiHeadAttentionWrapper:
        """Rebuild the wrapper from its heads."""
        module = object.__new__(cls)
        module._set(heads=tuple(heads))
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_heads={len(self.heads)})"

    def train(self, mode: bool = True) -> MultiHeadAttentionWrapper:
        """Training mode, for the wrapper and its heads; returns the module."""
        for head in self.heads:
            head.train(mode)
        return super().train(mode)

    def forward(self, x: Any) -> jax.Array:
        """``x: (..., seq, d_in)`` → ``(..., seq, num_heads * d_out_v)``."""
        return jnp.concatenate([head(x) for head in self.heads], axis=-1)

    def parameter_gradients(self, x: Any, grad_output: Any) -> dict[str, np.ndarray]:
        """Weight gradients ``heads.{h}.W_*``; ``grad_output: (..., seq, num_heads * d_out_v)``."""
        return module_weight_grads(self, (x,), grad_output)

    def export_weights(self) -> dict[str, np.ndarray]:
        """Flat dict ``heads.{h}.W_*`` → NumPy array."""
        return {
            f"heads.{h}.{name}": array
            for h, head in enumerate(self.heads)
            for name, array in head.export_weights().items()
        }

    def load_weights(self, weights: dict[str, Any]) -> MultiHeadAttentionWrapper:
        """Load weights exported by any backend; returns a new module."""
        _check_weight_dict("MultiHeadAttentionWrapper.load_weights", self.export_weights(), weights)
        heads = [
            head.load_weights({name: weights[f"heads.{h}.{name}"] for name in head._weight_names})
            for h, head in enumerate(self.heads)
        ]
        return type(self).tree_unflatten((), heads)  # immutable: a new module


@jax.tree_util.register_pytree_node_class
class MultiHeadAttention(_Module):
    """Multi-head attention with fused projections, grouped-query heads and masks.

    ``head_dim = d_model // num_heads``. Weights: ``W_query (d_model, num_heads·head_dim)``,
    ``W_key``, ``W_value (d_model, num_kv_heads·head_dim)``, ``W_out (num_heads·head_dim,
    d_model)`` (Xavier uniform), with ``bias=True`` ``b_query``, ``b_key``, ``b_value``,
    ``b_out`` (zeros), and with ``sinks=True`` ``sinks (num_heads,)``: GPT-OSS's learned
    attention sinks, one logit per query head joining every softmax denominator (zeros; no key
    is split for them, so the other weights are those of the same module without sinks).

    With ``rope`` (a ``RoPE``) the projected queries and keys are rotated (``rotary_embedding``
    with the rope's layout and rotary_dim, and ``rope_frequencies``' inverse frequencies and
    attention factor) at their positions before the attention; the rope is no weight (jax:
    part of the static half of the pytree).
    """

    _static_names = ("d_model", "num_heads", "num_kv_heads", "head_dim", "dropout_p", "rope")

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        bias: bool = True,
        sinks: bool = False,
        dropout_p: float = 0.0,
        rng: Any = None,
        rope: RoPE | None = None,
    ) -> None:
        fn = "MultiHeadAttention"
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        rules.check_module_heads(fn, d_model, num_heads, num_kv_heads)
        rules.check_dropout(fn, dropout_p, False)
        _check_rope(fn, rope, d_model // num_heads)
        rng_q, rng_k, rng_v, rng_o = _rng(fn, rng, 4)
        self._set(d_model=d_model, num_heads=num_heads, num_kv_heads=num_kv_heads)
        self._set(head_dim=d_model // num_heads, dropout_p=float(dropout_p), rope=rope)
        q_size, kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        self._set(W_query=_xavier(rng_q, d_model, q_size), W_key=_xavier(rng_k, d_model, kv_size),
                  W_value=_xavier(rng_v, d_model, kv_size), W_out=_xavier(rng_o, q_size, d_model))
        names = ["W_query", "W_key", "W_value", "W_out"]
        if bias:
            sizes = {"b_query": q_size, "b_key": kv_size, "b_value": kv_size, "b_out": d_model}
            self._set(**{name: jnp.zeros(size, jnp.float32) for name, size in sizes.items()})
            names += list(sizes)
        if sinks:
            self._set(sinks=jnp.zeros(num_heads, jnp.float32))  # (num_heads,) sink logits
            names.append("sinks")
        self._set(_weight_names=tuple(names))

    def _sinks(self) -> jax.Array | None:
        """The ``(num_heads,)`` sink logits, or None for a module without sinks."""
        return self.sinks if "sinks" in self._weight_names else None

    def _out(self, context_vec: jax.Array) -> jax.Array:
        """``(..., heads, seq, head_dim)`` → the output projection ``(..., seq, d_model)``."""
        merged = jnp.swapaxes(context_vec, -2, -3)  # (..., seq, heads, head_dim)
        output = _matmul(merged.reshape(merged.shape[:-2] + (-1,)), self.W_out)  # (..., seq, d)
        return output + self.b_out if "b_out" in self._weight_names else output

    def _project(self, x: Any, name: str, heads: int) -> jax.Array:
        """``(..., seq, d_model)`` → ``(..., heads, seq, head_dim)``."""
        projected = _matmul(x, getattr(self, f"W_{name}"))  # (..., seq, heads * head_dim)
        if f"b_{name}" in self._weight_names:
            projected = projected + getattr(self, f"b_{name}")
        split = projected.reshape(projected.shape[:-1] + (heads, self.head_dim))
        return jnp.swapaxes(split, -2, -3)  # (..., heads, seq, head_dim)

    def _rope_arguments(self) -> dict[str, Any]:
        """``rotary_embedding``'s keywords for this module's rope: layout, rotary_dim, and the
        inverse frequencies and attention factor of ``rope_frequencies``."""
        rotary_dim = self.head_dim if self.rope.rotary_dim is None else self.rope.rotary_dim
        inv_freq, attention_factor = rope_frequencies(
            rotary_dim, theta=self.rope.theta, scaling=self.rope.scaling,
            max_position_embeddings=self.rope.max_position_embeddings)
        return {"layout": self.rope.layout, "rotary_dim": rotary_dim, "inv_freq": inv_freq,
                "attention_factor": attention_factor}

    def _rotate(self, x: jax.Array, positions: Any) -> jax.Array:
        """``x: (..., heads, seq, head_dim)`` rotated at ``positions (..., seq)`` (unchanged
        without a rope)."""
        if self.rope is None:
            return x
        return rotary_embedding(x, positions, **self._rope_arguments())

    def _positions(self, fn: str, x: jax.Array, context: Any, positions: Any,
                   key_positions: Any) -> tuple[Any, Any]:
        """The queries' positions ``(..., q_len)`` (default ``0..q_len-1``) and the keys':
        the same in self-attention, ``key_positions`` (default ``0..kv_len-1``) over a
        ``context``."""
        _check_key_positions(fn, context, key_positions)
        q_pos = jnp.arange(x.shape[-2]) if positions is None else positions  # (..., q_len)
        if context is None:
            return q_pos, q_pos
        kv_len = jnp.shape(context)[-2]
        return q_pos, jnp.arange(kv_len) if key_positions is None else key_positions

    def _projections(
        self, x: jax.Array, context: Any, q_pos: Any, k_pos: Any
    ) -> dict[str, jax.Array]:
        """The stages up to the rotation: ``q_proj``, ``k_proj``, ``v_proj`` (``(..., heads |
        kv_heads, seq, head_dim)``), ``rotated_q`` and ``rotated_k`` (at ``q_pos``,
        ``k_pos``)."""
        source = x if context is None else jnp.asarray(context)  # (..., kv_len, d_model)
        q_proj = self._project(x, "query", self.num_heads)  # (..., heads, q_len, head_dim)
        k_proj = self._project(source, "key", self.num_kv_heads)  # (..., kv_heads, kv_len, hd)
        v_proj = self._project(source, "value", self.num_kv_heads)
        return {"q_proj": q_proj, "k_proj": k_proj, "v_proj": v_proj,
                "rotated_q": self._rotate(q_proj, q_pos), "rotated_k": self._rotate(k_proj, k_pos)}

    def forward(
        self,
        x: Any,
        context: Any = None,
        *,
        mask: Any = None,
        is_causal: bool = False,
        causal_alignment: str = "top_left",
        window: tuple | None = None,
        return_weights: bool = False,
        rng: Any = None,
        positions: Any = None,
        key_positions: Any = None,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Attention of ``x`` over ``context`` (self-attention when ``context`` is None).

        Args:
          x: ``(..., q_len, d_model)``.
          context: ``(..., kv_len, d_model)`` or ``None``.
          mask: boolean, broadcastable to ``(..., num_heads, q_len, kv_len)``; True = may attend.
          is_causal, causal_alignment, window: as in ``scaled_dot_product_attention``.
          return_weights: also return weights ``(..., num_heads, q_len, kv_len)``.
          rng: a ``jax.random`` key; dropout (``dropout_p > 0``, training mode) needs one.
          positions: integer ``(..., q_len)``, the queries' positions for the rope (default
            ``0..q_len-1``; the keys' too in self-attention); no effect without a rope.
          key_positions: integer ``(..., kv_len)``, the context's positions (default
            ``0..kv_len-1``); only with a ``context``.

        Returns:
          ``(..., q_len, d_model)``, and the weights with ``return_weights``.
        """
        x = jnp.asarray(x)
        q_pos, k_pos = self._positions("MultiHeadAttention.forward", x, context, positions,
                                       key_positions)
        stages = self._projections(x, context, q_pos, k_pos)
        result = scaled_dot_product_attention(
            stages["rotated_q"], stages["rotated_k"], stages["v_proj"], mask=mask,
            is_causal=is_causal, causal_alignment=causal_alignment, window=window,
            dropout_p=self.dropout_p if self.training and rng is not None else 0.0,
            rng=rng, return_weights=return_weights, sinks=self._sinks(),
        )
        context_vec, weights = result if return_weights else (result, None)
        output = self._out(context_vec)  # (..., q_len, d_model)
        return (output, weights) if return_weights else output

    def parameter_gradients(
        self,
        x: Any,
        grad_output: Any,
        context: Any = None,
        *,
        mask: Any = None,
        is_causal: bool = False,
        causal_alignment: str = "top_left",
        window: tuple | None = None,
        positions: Any = None,
        key_positions: Any = None,
    ) -> dict[str, np.ndarray]:
        """Weight gradients of ``forward(x, context, ...)`` (without dropout).

        Args:
          x: ``(..., q_len, d_model)``.
          grad_output: ``(..., q_len, d_model)``.
          context, mask, is_causal, causal_alignment, window, positions, key_positions: as in
            ``forward``.

        Returns: weight name → gradient, for every weight.
        """
        _check_no_dropout(self)
        static = tuple(zip(("is_causal", "causal_alignment", "window"),
                           (is_causal, causal_alignment, window), strict=True))
        arrays = {"mask": mask, "positions": positions, "key_positions": key_positions}
        return module_weight_grads(self, (x, context), grad_output, arrays, static)

    def decode(
        self, x: Any, cache: KVCache | None = None, *, max_len: int | None = None
    ) -> tuple[jax.Array, KVCache]:
        """Incremental decoding: the next tokens ``x: (..., n, d_model)`` attend the cached ones.

        Args:
          x: ``(..., n, d_model)``.
          cache: a ``KVCache`` of ``num_kv_heads`` heads from an earlier call, or None.
          max_len: capacity of the new cache when ``cache`` is None (default ``n``).

        Returns:
          ``(output (..., n, d_model), cache)``; equals ``forward(x_all, is_causal=True)`` at
          these positions (the sinks included). No dropout. The cache is a new one (jax:
          immutable); jit-friendly. With a rope the new tokens sit at positions ``length ..
          length + n - 1`` after the cached ones (a ``PagedKVCache``: each sequence's own
          length), and the cache holds rotated keys.
        """
        x = jnp.asarray(x)
        positions = _decode_positions(cache, x.shape[:-2], x.shape[-2])  # (..., n)
        query = self._project(x, "query", self.num_heads)  # (..., heads, n, head_dim)
        key = self._project(x, "key", self.num_kv_heads)  # (..., kv_heads, n, head_dim)
        value = self._project(x, "value", self.num_kv_heads)
        query, key = self._rotate(query, positions), self._rotate(key, positions)
        context_vec, cache = decode_step(query, key, value, cache, max_len, sinks=self._sinks())
        return self._out(context_vec), cache  # (..., n, d_model)

    def stages(
        self,
        x: Any,
        context: Any = None,
        *,
        mask: Any = None,
        is_causal: bool = False,
        causal_alignment: str = "top_left",
        window: tuple | None = None,
        positions: Any = None,
        key_positions: Any = None,
    ) -> dict[str, jax.Array]:
        """Every intermediate tensor of ``forward`` (no dropout), named, in the pipeline's order.

        Args:
          x, context, mask, is_causal, causal_alignment, window, positions, key_positions: as
            in ``forward``.

        Returns:
          ``q_proj (..., heads, q_len, head_dim)``, ``k_proj``, ``v_proj (..., kv_heads,
          kv_len, head_dim)``, ``rotated_q``, ``rotated_k`` (the projections without a rope),
          ``scores (..., heads, q_len, kv_len)`` (``mask_scores(attention_scores(...))``:
          scaled, masked with ``-inf``), ``weights (..., heads, q_len, kv_len)``, ``context
          (..., heads, q_len, head_dim)`` and ``output (..., q_len, d_model)``, which equals
          ``forward``'s result.
        """
        x = jnp.asarray(x)
        q_pos, k_pos = self._positions("MultiHeadAttention.stages", x, context, positions,
                                       key_positions)
        stages = self._projections(x, context, q_pos, k_pos)
        query, key, value = stages["rotated_q"], stages["rotated_k"], stages["v_proj"]
        stages["scores"] = mask_scores(attention_scores(query, key), mask=mask,
                                       is_causal=is_causal, causal_alignment=causal_alignment,
                                       window=window)  # (..., heads, q_len, kv_len)
        context_vec, stages["weights"] = scaled_dot_product_attention(
            query, key, value, mask=mask, is_causal=is_causal, causal_alignment=causal_alignment,
            window=window, return_weights=True, sinks=self._sinks(),
        )
        stages["context"] = context_vec  # (..., heads, q_len, head_dim)
        stages["output"] = self._out(context_vec)  # (..., q_len, d_model)
        return stages


def _decode_positions(cache: Any, batch_shape: tuple[int, ...], n: int) -> jax.Array:
    """The positions ``(..., n)`` of ``n`` new tokens after the cached ones: ``length + 0..n-1``
    (a ``PagedKVCache``: sequence ``b``'s own length, ``(batch, n)``)."""
    steps = jnp.arange(n)
    if cache is None:
        return steps
    if isinstance(cache, PagedKVCache):
        lengths = jnp.array([cache.seq_len(b) for b in range(batch_shape[0])])  # (batch,)
        return lengths[:, None] + steps  # (batch, n)
    return cache.length + steps  # jax: length may be traced
