"""Attention modules in NumPy, named as in the article; weights use ``x @ W``, ``W: (d_in, d_out)``.

Every module exports its weights to a flat dict of NumPy arrays and loads them back, with the
same keys in every backend. ``load_weights`` keeps the dtype of the arrays it is given, so a
float64 dict gives a float64 module.

NumPy has no autodiff, so every module has ``parameter_gradients(inputs..., grad_output)``: the
backward pass by hand, the chain rule from ``grad_output`` (dL/d output) through the attention's
VJP and the projections, giving every weight's gradient under its name; ``backward.sgd_step`` or
``backward.Adam`` train on it (``examples/train_reverse.py``). jax_attn and torch_attn have the
method for the harness, by autodiff; their users train with ``jax.grad``, ``loss.backward()``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import attention_rules as rules
from attention_rules import rotary as rotary_rules

from .backward import projection_grads, scaled_dot_product_attention_vjp
from .functional import attention_scores, mask_scores, scaled_dot_product_attention
from .kv_cache import KVCache, decode_step
from .paged import PagedKVCache
from .rotary import RoPE, rope_frequencies, rotary_embedding, rotary_embedding_vjp


def _uniform(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Uniform on [0, 1), like ``torch.rand``: the article's initialisation."""
    return rng.random(shape, dtype=np.float32)


def _xavier(rng: np.random.Generator, fan_in: int, fan_out: int) -> np.ndarray:
    """Xavier/Glorot uniform ``(fan_in, fan_out)``: bound ``sqrt(6 / (fan_in + fan_out))``."""
    bound = (6.0 / (fan_in + fan_out)) ** 0.5
    return rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32)


def _matmul(x: Any, w: np.ndarray) -> np.ndarray:
    """``x @ w`` in the inputs' dtype (ml_dtypes' bfloat16 matmul returns float32)."""
    x = np.asarray(x)
    return np.matmul(x, w).astype(np.result_type(x, w), copy=False)


def _rng(rng: Any) -> np.random.Generator:
    return np.random.default_rng() if rng is None else rng


class _Module:
    """Weights held as attributes named in ``_weight_names``; export/load and train/eval."""

    _weight_names: tuple[str, ...] = ()
    training: bool = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def train(self, mode: bool = True) -> _Module:
        """Training mode (dropout on); returns the module."""
        self.training = mode
        return self

    def eval(self) -> _Module:
        """Inference mode (dropout off); returns the module."""
        return self.train(False)

    def export_weights(self) -> dict[str, np.ndarray]:
        """Flat dict name → NumPy array (copies)."""
        return {name: np.array(getattr(self, name)) for name in self._weight_names}

    def load_weights(self, weights: dict[str, Any]) -> _Module:
        """Load weights exported by any backend (same keys and shapes); returns the module."""
        fn = f"{type(self).__name__}.load_weights"
        _check_weight_dict(fn, self.export_weights(), weights)
        for name in self._weight_names:
            setattr(self, name, np.array(weights[name]))
        return self


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


class SelfAttention(_Module):
    """The article's self-attention: one head, ``softmax(q kᵀ / sqrt(d_out_kq)) v``.

    Weights: ``W_query (d_in, d_out_kq)``, ``W_key (d_in, d_out_kq)``, ``W_value (d_in, d_out_v)``,
    drawn uniformly from [0, 1) in that order, as in the article.
    """

    _weight_names = ("W_query", "W_key", "W_value")

    def __init__(self, d_in: int, d_out_kq: int, d_out_v: int, *, rng: Any = None) -> None:
        rng = _rng(rng)
        self.d_out_kq = d_out_kq
        self.W_query = _uniform(rng, (d_in, d_out_kq))
        self.W_key = _uniform(rng, (d_in, d_out_kq))
        self.W_value = _uniform(rng, (d_in, d_out_v))

    def forward(self, x: Any) -> np.ndarray:
        """``x: (..., seq, d_in)`` → context vectors ``(..., seq, d_out_v)``."""
        queries = _matmul(x, self.W_query)  # (..., seq, d_out_kq)
        keys = _matmul(x, self.W_key)  # (..., seq, d_out_kq)
        values = _matmul(x, self.W_value)  # (..., seq, d_out_v)
        return scaled_dot_product_attention(queries, keys, values)

    def parameter_gradients(self, x: Any, grad_output: Any) -> dict[str, np.ndarray]:
        """The backward pass by hand: every weight's gradient for ``x: (..., seq, d_in)`` and
        ``grad_output: (..., seq, d_out_v)``, the loss's gradient dL/d output.

        The projections are recomputed, the attention's VJP gives ``dL/dq``, ``dL/dk``,
        ``dL/dv`` ``(..., seq, d)``, and ``q = x @ W_query`` gives ``dL/dW_query = xᵀ @ dL/dq``
        summed over the leading axes (``projection_grads``); the same for keys and values.
        """
        x = np.asarray(x)
        queries, keys, values = (_matmul(x, w) for w in (self.W_query, self.W_key, self.W_value))
        grad_q, grad_k, grad_v, _ = scaled_dot_product_attention_vjp(
            queries, keys, values, grad_output
        )
        return {"W_query": projection_grads(x, grad_q), "W_key": projection_grads(x, grad_k),
                "W_value": projection_grads(x, grad_v)}


class CrossAttention(_Module):
    """The article's cross-attention: queries from ``x_1``, keys and values from ``x_2``."""

    _weight_names = ("W_query", "W_key", "W_value")

    def __init__(self, d_in: int, d_out_kq: int, d_out_v: int, *, rng: Any = None) -> None:
        rng = _rng(rng)
        self.d_out_kq = d_out_kq
        self.W_query = _uniform(rng, (d_in, d_out_kq))
        self.W_key = _uniform(rng, (d_in, d_out_kq))
        self.W_value = _uniform(rng, (d_in, d_out_v))

    def forward(self, x_1: Any, x_2: Any) -> np.ndarray:
        """``x_1: (..., q_len, d_in)``, ``x_2: (..., kv_len, d_in)`` → ``(..., q_len, d_out_v)``."""
        queries_1 = _matmul(x_1, self.W_query)  # (..., q_len, d_out_kq)
        keys_2 = _matmul(x_2, self.W_key)  # (..., kv_len, d_out_kq)
        values_2 = _matmul(x_2, self.W_value)  # (..., kv_len, d_out_v)
        return scaled_dot_product_attention(queries_1, keys_2, values_2)

    def parameter_gradients(self, x_1: Any, x_2: Any, grad_output: Any) -> dict[str, np.ndarray]:
        """Weight gradients; ``grad_output: (..., q_len, d_out_v)``."""
        x_1, x_2 = np.asarray(x_1), np.asarray(x_2)
        grad_q, grad_k, grad_v, _ = scaled_dot_product_attention_vjp(
            _matmul(x_1, self.W_query), _matmul(x_2, self.W_key), _matmul(x_2, self.W_value),
            grad_output,
        )
        return {"W_query": projection_grads(x_1, grad_q), "W_key": projection_grads(x_2, grad_k),
                "W_value": projection_grads(x_2, grad_v)}


class CausalSelfAttention(_Module):
    """The article's causal self-attention: token ``i`` sees tokens ``0..i`` only.

    Dropout on the weights (``dropout_p``) applies in training mode only (``eval()`` turns it off).
    """

    _weight_names = ("W_query", "W_key", "W_value")

    def __init__(
        self, d_in: int, d_out_kq: int, d_out_v: int, *, dropout_p: float = 0.0, rng: Any = None
    ) -> None:
        rules.check_dropout("CausalSelfAttention", dropout_p, False)
        rng = _rng(rng)
        self.d_out_kq = d_out_kq
        self.dropout_p = float(dropout_p)
        self.W_query = _uniform(rng, (d_in, d_out_kq))
        self.W_key = _uniform(rng, (d_in, d_out_kq))
        self.W_value = _uniform(rng, (d_in, d_out_v))

    def forward(self, x: Any, *, rng: Any = None) -> np.ndarray:
        """``x: (..., seq, d_in)`` → ``(..., seq, d_out_v)``; ``rng`` draws the dropout mask."""
        queries = _matmul(x, self.W_query)  # (..., seq, d_out_kq)
        keys = _matmul(x, self.W_key)  # (..., seq, d_out_kq)
        values = _matmul(x, self.W_value)  # (..., seq, d_out_v)
        dropout_p = self.dropout_p if self.training else 0.0
        return scaled_dot_product_attention(
            queries, keys, values, is_causal=True, dropout_p=dropout_p, rng=rng
        )

    def parameter_gradients(self, x: Any, grad_output: Any) -> dict[str, np.ndarray]:
        """Weight gradients, without dropout (``eval()`` or ``dropout_p=0``)."""
        _check_no_dropout(self)
        x = np.asarray(x)
        queries, keys, values = (_matmul(x, w) for w in (self.W_query, self.W_key, self.W_value))
        grad_q, grad_k, grad_v, _ = scaled_dot_product_attention_vjp(
            queries, keys, values, grad_output, is_causal=True
        )
        return {"W_query": projection_grads(x, grad_q), "W_key": projection_grads(x, grad_k),
                "W_value": projection_grads(x, grad_v)}

    def decode(
        self, x: Any, cache: KVCache | None = None, *, max_len: int | None = None
    ) -> tuple[np.ndarray, KVCache]:
        """Incremental decoding: the next tokens ``x: (..., n, d_in)`` attend the cached ones.

        Args:
          x: ``(..., n, d_in)``.
          cache: a ``KVCache`` with one head (``(..., 1, max_len, d_out_kq | d_out_v)``) from an
            earlier call, or None for a new one.
          max_len: capacity of the new cache when ``cache`` is None (default ``n``).

        Returns:
          ``(output (..., n, d_out_v), cache)``; no dropout. The cache is updated in place.
        """
        x = np.asarray(x)
        queries = _matmul(x, self.W_query)[..., None, :, :]  # (..., 1, n, d_out_kq): one head
        keys = _matmul(x, self.W_key)[..., None, :, :]  # (..., 1, n, d_out_kq)
        values = _matmul(x, self.W_value)[..., None, :, :]  # (..., 1, n, d_out_v)
        context, cache = decode_step(queries, keys, values, cache, max_len)
        return context[..., 0, :, :], cache  # (..., n, d_out_v)


class MultiHeadAttentionWrapper(_Module):
    """The article's multi-head wrapper: ``num_heads`` ``SelfAttention`` heads, concatenated.

    Weights: ``heads.{h}.W_query``, ``heads.{h}.W_key``, ``heads.{h}.W_value``.
    """

    def __init__(
        self, d_in: int, d_out_kq: int, d_out_v: int, num_heads: int, *, rng: Any = None
    ) -> None:
        rng = _rng(rng)
        self.heads = [SelfAttention(d_in, d_out_kq, d_out_v, rng=rng) for _ in range(num_heads)]

    def forward(self, x: Any) -> np.ndarray:
        """``x: (..., seq, d_in)`` → ``(..., seq, num_heads * d_out_v)``."""
        return np.concatenate([head(x) for head in self.heads], axis=-1)

    def parameter_gradients(self, x: Any, grad_output: Any) -> dict[str, np.ndarray]:
        """Weight gradients ``heads.{h}.W_*``; ``grad_output: (..., seq, num_heads * d_out_v)``."""
        per_head = np.split(np.asarray(grad_output), len(self.heads), axis=-1)
        return {
            f"heads.{h}.{name}": grad
            for h, (head, grad_head) in enumerate(zip(self.heads, per_head, strict=True))
            for name, grad in head.parameter_gradients(x, grad_head).items()
        }

    def export_weights(self) -> dict[str, np.ndarray]:
        """Flat dict ``heads.{h}.W_*`` → NumPy array."""
        return {
            f"heads.{h}.{name}": array
            for h, head in enumerate(self.heads)
            for name, array in head.export_weights().items()
        }

    def load_weights(self, weights: dict[str, Any]) -> MultiHeadAttentionWrapper:
        """Load weights exported by any backend; returns the module."""
        _check_weight_dict("MultiHeadAttentionWrapper.load_weights", self.export_weights(), weights)
        for h, head in enumerate(self.heads):
            head.load_weights({name: weights[f"heads.{h}.{name}"] for name in head._weight_names})
        return self


class MultiHeadAttention(_Module):
    """Multi-head attention with fused projections, grouped-query heads and masks.

    ``head_dim = d_model // num_heads``. Weights: ``W_query (d_model, num_heads·head_dim)``,
    ``W_key``, ``W_value (d_model, num_kv_heads·head_dim)``, ``W_out (num_heads·head_dim,
    d_model)`` (Xavier uniform), with ``bias=True`` ``b_query``, ``b_key``, ``b_value``,
    ``b_out`` (zeros), and with ``sinks=True`` ``sinks (num_heads,)``: GPT-OSS's learned
    attention sinks, one logit per query head joining every softmax denominator (zeros; drawn
    after nothing, so the other weights are those of the same module without sinks).

    With ``rope`` (a ``RoPE``) the projected queries and keys are rotated (``rotary_embedding``
    with the rope's layout and rotary_dim, and ``rope_frequencies``' inverse frequencies and
    attention factor) at their positions before the attention; the rope is no weight.
    """

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
        rng = _rng(rng)
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.head_dim = d_model // num_heads
        self.dropout_p = float(dropout_p)
        self.rope = rope
        q_size, kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        self.W_query = _xavier(rng, d_model, q_size)
        self.W_key = _xavier(rng, d_model, kv_size)
        self.W_value = _xavier(rng, d_model, kv_size)
        self.W_out = _xavier(rng, q_size, d_model)
        names = ["W_query", "W_key", "W_value", "W_out"]
        if bias:
            self.b_query = np.zeros(q_size, np.float32)
            self.b_key = np.zeros(kv_size, np.float32)
            self.b_value = np.zeros(kv_size, np.float32)
            self.b_out = np.zeros(d_model, np.float32)
            names += ["b_query", "b_key", "b_value", "b_out"]
        if sinks:
            self.sinks = np.zeros(num_heads, np.float32)  # (num_heads,) sink logits
            names.append("sinks")
        self._weight_names = tuple(names)

    def _sinks(self) -> np.ndarray | None:
        """The ``(num_heads,)`` sink logits, or None for a module without sinks."""
        return self.sinks if "sinks" in self._weight_names else None

    def _out(self, context_vec: np.ndarray) -> np.ndarray:
        """``(..., heads, seq, head_dim)`` → the output projection ``(..., seq, d_model)``."""
        merged = np.swapaxes(context_vec, -2, -3)  # (..., seq, heads, head_dim)
        merged = merged.reshape(merged.shape[:-2] + (-1,))  # (..., seq, heads * head_dim)
        output = _matmul(merged, self.W_out)  # (..., seq, d_model)
        if "b_out" in self._weight_names:
            output = output + self.b_out
        return output

    def _project(self, x: Any, name: str, heads: int) -> np.ndarray:
        """``(..., seq, d_model)`` → ``(..., heads, seq, head_dim)``."""
        projected = _matmul(x, getattr(self, f"W_{name}"))  # (..., seq, heads * head_dim)
        if f"b_{name}" in self._weight_names:
            projected = projected + getattr(self, f"b_{name}")
        split = projected.reshape(projected.shape[:-1] + (heads, self.head_dim))
        return np.swapaxes(split, -2, -3)  # (..., heads, seq, head_dim)

    def _rope_arguments(self) -> dict[str, Any]:
        """``rotary_embedding``'s keywords for this module's rope: layout, rotary_dim, and the
        inverse frequencies and attention factor of ``rope_frequencies``."""
        rotary_dim = self.head_dim if self.rope.rotary_dim is None else self.rope.rotary_dim
        inv_freq, attention_factor = rope_frequencies(
            rotary_dim, theta=self.rope.theta, scaling=self.rope.scaling,
            max_position_embeddings=self.rope.max_position_embeddings)
        return {"layout": self.rope.layout, "rotary_dim": rotary_dim, "inv_freq": inv_freq,
                "attention_factor": attention_factor}

    def _rotate(self, x: np.ndarray, positions: Any) -> np.ndarray:
        """``x: (..., heads, seq, head_dim)`` rotated at ``positions (..., seq)`` (unchanged
        without a rope)."""
        if self.rope is None:
            return x
        return rotary_embedding(x, positions, **self._rope_arguments())

    def _positions(self, fn: str, x: np.ndarray, context: Any, positions: Any,
                   key_positions: Any) -> tuple[Any, Any]:
        """The queries' positions ``(..., q_len)`` (default ``0..q_len-1``) and the keys':
        the same in self-attention, ``key_positions`` (default ``0..kv_len-1``) over a
        ``context``."""
        _check_key_positions(fn, context, key_positions)
        q_pos = np.arange(x.shape[-2]) if positions is None else positions  # (..., q_len)
        if context is None:
            return q_pos, q_pos
        kv_len = np.shape(context)[-2]
        return q_pos, np.arange(kv_len) if key_positions is None else key_positions

    def _projections(
        self, x: np.ndarray, context: Any, q_pos: Any, k_pos: Any
    ) -> dict[str, np.ndarray]:
        """The stages up to the rotation: ``q_proj``, ``k_proj``, ``v_proj`` (``(..., heads |
        kv_heads, seq, head_dim)``), ``rotated_q`` and ``rotated_k`` (at ``q_pos``,
        ``k_pos``)."""
        source = x if context is None else np.asarray(context)  # (..., kv_len, d_model)
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
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Attention of ``x`` over ``context`` (self-attention when ``context`` is None).

        Args:
          x: ``(..., q_len, d_model)``.
          context: ``(..., kv_len, d_model)`` or ``None``.
          mask: boolean, broadcastable to ``(..., num_heads, q_len, kv_len)``; True = may attend.
          is_causal, causal_alignment, window: as in ``scaled_dot_product_attention``.
          return_weights: also return weights ``(..., num_heads, q_len, kv_len)``.
          rng: ``numpy.random.Generator`` for dropout.
          positions: integer ``(..., q_len)``, the queries' positions for the rope (default
            ``0..q_len-1``; the keys' too in self-attention); no effect without a rope.
          key_positions: integer ``(..., kv_len)``, the context's positions (default
            ``0..kv_len-1``); only with a ``context``.

        Returns:
          ``(..., q_len, d_model)``, and the weights with ``return_weights``.
        """
        x = np.asarray(x)
        q_pos, k_pos = self._positions("MultiHeadAttention.forward", x, context, positions,
                                       key_positions)
        stages = self._projections(x, context, q_pos, k_pos)
        result = scaled_dot_product_attention(
            stages["rotated_q"], stages["rotated_k"], stages["v_proj"], mask=mask,
            is_causal=is_causal, causal_alignment=causal_alignment, window=window,
            dropout_p=self.dropout_p if self.training else 0.0, rng=rng,
            return_weights=return_weights, sinks=self._sinks(),
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

        Returns:
          weight name → gradient, for every weight (``sinks``: the attention's own sinks
          gradient, ``scaled_dot_product_attention_vjp``'s fifth result). With a rope, the
          gradients of the rotated queries and keys go back through ``rotary_embedding_vjp``.
        """
        _check_no_dropout(self)
        x = np.asarray(x)
        q_pos, k_pos = self._positions("MultiHeadAttention.parameter_gradients", x, context,
                                       positions, key_positions)
        stages = self._projections(x, context, q_pos, k_pos)
        context = x if context is None else np.asarray(context)
        grad_output = np.asarray(grad_output)
        query, key, value = stages["rotated_q"], stages["rotated_k"], stages["v_proj"]
        context_vec = scaled_dot_product_attention(
            query, key, value, mask=mask, is_causal=is_causal,
            causal_alignment=causal_alignment, window=window, sinks=self._sinks(),
        )
        merged = np.swapaxes(context_vec, -2, -3)  # (..., q_len, heads, head_dim)
        merged = merged.reshape(merged.shape[:-2] + (-1,))  # (..., q_len, heads * head_dim)
        grads = {"W_out": projection_grads(merged, grad_output)}
        grad_merged = _matmul(grad_output, self.W_out.T)  # (..., q_len, heads * head_dim)
        grad_split = grad_merged.reshape(grad_merged.shape[:-1] + (self.num_heads, -1))
        grad_q, grad_k, grad_v, _, *grad_sinks = scaled_dot_product_attention_vjp(
            query, key, value, np.swapaxes(grad_split, -2, -3), mask=mask, is_causal=is_causal,
            causal_alignment=causal_alignment, window=window, sinks=self._sinks(),
        )  # grad_sinks: [(num_heads,)] with sinks, else []
        if self.rope is not None:  # back through the rotation: the transpose of each rotation
            rope = self._rope_arguments()
            grad_q = rotary_embedding_vjp(stages["q_proj"], q_pos, grad_q, **rope)
            grad_k = rotary_embedding_vjp(stages["k_proj"], k_pos, grad_k, **rope)
        for name, source, grad in (("query", x, grad_q), ("key", context, grad_k),
                                   ("value", context, grad_v)):
            joined = np.swapaxes(grad, -2, -3)  # (..., seq, heads, head_dim)
            joined = joined.reshape(joined.shape[:-2] + (-1,))  # (..., seq, heads * head_dim)
            grads[f"W_{name}"] = projection_grads(source, joined)
            if f"b_{name}" in self._weight_names:
                grads[f"b_{name}"] = joined.reshape(-1, joined.shape[-1]).sum(axis=0)
        if "b_out" in self._weight_names:
            grads["b_out"] = grad_output.reshape(-1, grad_output.shape[-1]).sum(axis=0)
        if grad_sinks:
            grads["sinks"] = grad_sinks[0]
        return grads

    def decode(
        self, x: Any, cache: KVCache | None = None, *, max_len: int | None = None
    ) -> tuple[np.ndarray, KVCache]:
        """Incremental decoding: the next tokens ``x: (..., n, d_model)`` attend the cached ones.

        Args:
          x: ``(..., n, d_model)``.
          cache: a ``KVCache`` of ``num_kv_heads`` heads from an earlier call, or None.
          max_len: capacity of the new cache when ``cache`` is None (default ``n``).

        Returns:
          ``(output (..., n, d_model), cache)``; equals ``forward(x_all, is_causal=True)`` at
          these positions (the sinks included). No dropout. The cache is updated in place.
          With a rope the new tokens sit at positions ``length .. length + n - 1`` after the
          cached ones (a ``PagedKVCache``: each sequence's own length), and the cache holds
          rotated keys.
        """
        x = np.asarray(x)
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
    ) -> dict[str, np.ndarray]:
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
        x = np.asarray(x)
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


def _decode_positions(cache: Any, batch_shape: tuple[int, ...], n: int) -> np.ndarray:
    """The positions ``(..., n)`` of ``n`` new tokens after the cached ones: ``length + 0..n-1``
    (a ``PagedKVCache``: sequence ``b``'s own length, ``(batch, n)``)."""
    steps = np.arange(n)
    if cache is None:
        return steps
    if isinstance(cache, PagedKVCache):
        lengths = np.array([cache.seq_len(b) for b in range(batch_shape[0])])  # (batch,)
        return lengths[:, None] + steps  # (batch, n)
    return cache.length + steps
