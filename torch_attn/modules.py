"""Attention modules in PyTorch, named as in the article; weights ``x @ W``, ``W: (d_in, d_out)``.

Every module is an ordinary ``torch.nn.Module`` whose weights are ``nn.Parameter``s: call it,
and train it with ``loss.backward()`` and an optimiser like any ``nn.Module`` (autograd derives
the backward pass; there is none to write), ``state_dict`` and ``.to(device)`` work. It also
exports its weights to a flat dict of NumPy arrays and loads them back, with the same keys in
every backend; ``load_weights`` keeps the dtype of the arrays it is given, so a float64 dict
gives a float64 module.

``parameter_gradients(inputs..., grad_output)`` is the harness's cross-backend interface, not a
step of training: ``torch.autograd.grad`` of ``forward`` against ``grad_output``, as a dict of
NumPy arrays under the weights' names (the parameters' ``.grad`` are left untouched), where
numpy_attn, which has no autodiff, writes the backward pass by hand.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

import attention_rules as rules
from attention_rules import rotary as rotary_rules

from ._arrays import _as_tensor, _to_numpy
from .backward import module_weight_grads
from .functional import attention_scores, mask_scores, scaled_dot_product_attention
from .kv_cache import KVCache, decode_step
from .paged import PagedKVCache
from .rotary import RoPE, rope_frequencies, rotary_embedding


def _uniform(rng: torch.Generator | None, shape: tuple[int, ...]) -> torch.Tensor:
    """Uniform on [0, 1) by ``torch.rand``: the article's initialisation."""
    return torch.rand(shape, generator=rng)


def _xavier(rng: torch.Generator | None, fan_in: int, fan_out: int) -> torch.Tensor:
    """Xavier/Glorot uniform ``(fan_in, fan_out)``: bound ``sqrt(6 / (fan_in + fan_out))``."""
    bound = (6.0 / (fan_in + fan_out)) ** 0.5
    return torch.empty(fan_in, fan_out).uniform_(-bound, bound, generator=rng)


class _Module(nn.Module):
    """Weights held as parameters named in ``_weight_names``; export/load (train/eval, calls and
    ``state_dict`` come from ``nn.Module``)."""

    _weight_names: tuple[str, ...] = ()

    def export_weights(self) -> dict[str, np.ndarray]:
        """Flat dict name → NumPy array (copies)."""
        return {name: _to_numpy(getattr(self, name)) for name in self._weight_names}

    def load_weights(self, weights: dict[str, Any]) -> _Module:
        """Load weights exported by any backend (same keys and shapes); returns the module,
        updated in place (the same ``nn.Parameter`` objects, with the arrays' dtype)."""
        fn = f"{type(self).__name__}.load_weights"
        _check_weight_dict(fn, self.export_weights(), weights)
        with torch.no_grad():  # shapes checked above; autograd records no loading
            for name in self._weight_names:
                parameter = getattr(self, name)
                source = _as_tensor(weights[name])  # the arrays' dtype
                if source.dtype != parameter.dtype:
                    _convert(parameter, source.dtype)
                parameter.copy_(source)  # onto the parameter's device
        return self


def _convert(parameter: nn.Parameter, dtype: torch.dtype) -> None:
    """torch only: the same ``Parameter`` object in ``dtype``, the way ``nn.Module.to(dtype)``
    converts its parameters (swapped when ``torch.__future__`` asks for it, else its ``data``
    replaced: the only way to change a parameter's dtype in place)."""
    converted = parameter.detach().to(dtype)
    if torch.__future__.get_swap_module_params_on_conversion():
        torch.utils.swap_tensors(parameter, nn.Parameter(converted, parameter.requires_grad))
    else:
        parameter.data = converted


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
    drawn by ``torch.rand`` in that order, as in the article (``rng``: a ``torch.Generator``,
    ``None`` for torch's global one, so ``torch.manual_seed(123)`` gives the article's numbers).
    Train it with ``loss.backward()`` like any ``nn.Module``.
    """

    _weight_names = ("W_query", "W_key", "W_value")

    def __init__(self, d_in: int, d_out_kq: int, d_out_v: int, *, rng: Any = None) -> None:
        super().__init__()
        self.d_out_kq = d_out_kq
        self.W_query = nn.Parameter(_uniform(rng, (d_in, d_out_kq)))
        self.W_key = nn.Parameter(_uniform(rng, (d_in, d_out_kq)))
        self.W_value = nn.Parameter(_uniform(rng, (d_in, d_out_v)))

    def forward(self, x: Any) -> torch.Tensor:
        """``x: (..., seq, d_in)`` → context vectors ``(..., seq, d_out_v)``."""
        x = _as_tensor(x)
        queries = x @ self.W_query  # (..., seq, d_out_kq)
        keys = x @ self.W_key  # (..., seq, d_out_kq)
        values = x @ self.W_value  # (..., seq, d_out_v)
        return scaled_dot_product_attention(queries, keys, values)

    def parameter_gradients(self, x: Any, grad_output: Any) -> dict[str, np.ndarray]:
        """Weight gradients for ``x: (..., seq, d_in)``, ``grad_output: (..., seq, d_out_v)``."""
        with torch.enable_grad():
            return module_weight_grads(self, self.forward(x), grad_output)


class CrossAttention(_Module):
    """The article's cross-attention: queries from ``x_1``, keys and values from ``x_2``."""

    _weight_names = ("W_query", "W_key", "W_value")

    def __init__(self, d_in: int, d_out_kq: int, d_out_v: int, *, rng: Any = None) -> None:
        super().__init__()
        self.d_out_kq = d_out_kq
        self.W_query = nn.Parameter(_uniform(rng, (d_in, d_out_kq)))
        self.W_key = nn.Parameter(_uniform(rng, (d_in, d_out_kq)))
        self.W_value = nn.Parameter(_uniform(rng, (d_in, d_out_v)))

    def forward(self, x_1: Any, x_2: Any) -> torch.Tensor:
        """``x_1: (..., q_len, d_in)``, ``x_2: (..., kv_len, d_in)`` → ``(..., q_len, d_out_v)``."""
        x_1, x_2 = _as_tensor(x_1), _as_tensor(x_2)
        queries_1 = x_1 @ self.W_query  # (..., q_len, d_out_kq)
        keys_2 = x_2 @ self.W_key  # (..., kv_len, d_out_kq)
        values_2 = x_2 @ self.W_value  # (..., kv_len, d_out_v)
        return scaled_dot_product_attention(queries_1, keys_2, values_2)

    def parameter_gradients(self, x_1: Any, x_2: Any, grad_output: Any) -> dict[str, np.ndarray]:
        """Weight gradients; ``grad_output: (..., q_len, d_out_v)``."""
        with torch.enable_grad():
            return module_weight_grads(self, self.forward(x_1, x_2), grad_output)


class CausalSelfAttention(_Module):
    """The article's causal self-attention: token ``i`` sees tokens ``0..i`` only.

    Dropout on the weights (``dropout_p``) applies in training mode only (``eval()`` turns it off).
    """

    _weight_names = ("W_query", "W_key", "W_value")

    def __init__(
        self, d_in: int, d_out_kq: int, d_out_v: int, *, dropout_p: float = 0.0, rng: Any = None
    ) -> None:
        rules.check_dropout("CausalSelfAttention", dropout_p, False)
        super().__init__()
        self.d_out_kq = d_out_kq
        self.dropout_p = float(dropout_p)
        self.W_query = nn.Parameter(_uniform(rng, (d_in, d_out_kq)))
        self.W_key = nn.Parameter(_uniform(rng, (d_in, d_out_kq)))
        self.W_value = nn.Parameter(_uniform(rng, (d_in, d_out_v)))

    def forward(self, x: Any, *, rng: Any = None) -> torch.Tensor:
        """``x: (..., seq, d_in)`` → ``(..., seq, d_out_v)``; ``rng`` (``torch.Generator``) draws
        the dropout mask."""
        x = _as_tensor(x)
        queries = x @ self.W_query  # (..., seq, d_out_kq)
        keys = x @ self.W_key  # (..., seq, d_out_kq)
        values = x @ self.W_value  # (..., seq, d_out_v)
        dropout_p = self.dropout_p if self.training else 0.0
        return scaled_dot_product_attention(
            queries, keys, values, is_causal=True, dropout_p=dropout_p, rng=rng
        )

    def parameter_gradients(self, x: Any, grad_output: Any) -> dict[str, np.ndarray]:
        """Weight gradients, without dropout (``eval()`` or ``dropout_p=0``)."""
        _check_no_dropout(self)
        with torch.enable_grad():
            return module_weight_grads(self, self.forward(x), grad_output)

    def decode(
        self, x: Any, cache: KVCache | None = None, *, max_len: int | None = None
    ) -> tuple[torch.Tensor, KVCache]:
        """Incremental decoding: the next tokens ``x: (..., n, d_in)`` attend the cached ones.

        Args:
          x: ``(..., n, d_in)``.
          cache: a ``KVCache`` with one head (``(..., 1, max_len, d_out_kq | d_out_v)``) from an
            earlier call, or None for a new one.
          max_len: capacity of the new cache when ``cache`` is None (default ``n``).

        Returns:
          ``(output (..., n, d_out_v), cache)``; no dropout. The cache is updated in place.
          torch: no autograd history unless ``_decode_records_graph`` (training mode).
        """
        x = _as_tensor(x)
        with torch.set_grad_enabled(_decode_records_graph(self)):
            queries = (x @ self.W_query)[..., None, :, :]  # (..., 1, n, d_out_kq): one head
            keys = (x @ self.W_key)[..., None, :, :]  # (..., 1, n, d_out_kq)
            values = (x @ self.W_value)[..., None, :, :]  # (..., 1, n, d_out_v)
            context, cache = decode_step(queries, keys, values, cache, max_len)
        return context[..., 0, :, :], cache  # (..., n, d_out_v)


def _decode_records_graph(module: _Module) -> bool:
    """torch only: whether ``decode`` records autograd history: a gradient is requested, i.e.
    grad mode is on AND the module is in training mode. ``eval()`` decoding is inference and
    runs as under ``torch.no_grad()``, so a long decoding loop keeps no graph alive."""
    return torch.is_grad_enabled() and module.training


class MultiHeadAttentionWrapper(_Module):
    """The article's multi-head wrapper: ``num_heads`` ``SelfAttention`` heads, concatenated.

    Weights: ``heads.{h}.W_query``, ``heads.{h}.W_key``, ``heads.{h}.W_value``.
    """

    def __init__(
        self, d_in: int, d_out_kq: int, d_out_v: int, num_heads: int, *, rng: Any = None
    ) -> None:
        super().__init__()
        self.heads = nn.ModuleList(
            [SelfAttention(d_in, d_out_kq, d_out_v, rng=rng) for _ in range(num_heads)]
        )

    def forward(self, x: Any) -> torch.Tensor:
        """``x: (..., seq, d_in)`` → ``(..., seq, num_heads * d_out_v)``."""
        return torch.cat([head(x) for head in self.heads], dim=-1)

    def parameter_gradients(self, x: Any, grad_output: Any) -> dict[str, np.ndarray]:
        """Weight gradients ``heads.{h}.W_*``; ``grad_output: (..., seq, num_heads * d_out_v)``."""
        with torch.enable_grad():
            return module_weight_grads(self, self.forward(x), grad_output)

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
    ``weights_from_torch_multihead`` converts ``nn.MultiheadAttention``'s.

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
        super().__init__()
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.head_dim = d_model // num_heads
        self.dropout_p = float(dropout_p)
        self.rope = rope
        q_size, kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        self.W_query = nn.Parameter(_xavier(rng, d_model, q_size))
        self.W_key = nn.Parameter(_xavier(rng, d_model, kv_size))
        self.W_value = nn.Parameter(_xavier(rng, d_model, kv_size))
        self.W_out = nn.Parameter(_xavier(rng, q_size, d_model))
        names = ["W_query", "W_key", "W_value", "W_out"]
        if bias:
            self.b_query = nn.Parameter(torch.zeros(q_size))
            self.b_key = nn.Parameter(torch.zeros(kv_size))
            self.b_value = nn.Parameter(torch.zeros(kv_size))
            self.b_out = nn.Parameter(torch.zeros(d_model))
            names += ["b_query", "b_key", "b_value", "b_out"]
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads))  # (num_heads,) sink logits
            names.append("sinks")
        self._weight_names = tuple(names)

    def _sinks(self) -> torch.Tensor | None:
        """The ``(num_heads,)`` sink logits, or None for a module without sinks."""
        return self.sinks if "sinks" in self._weight_names else None

    def _out(self, context_vec: torch.Tensor) -> torch.Tensor:
        """``(..., heads, seq, head_dim)`` → the output projection ``(..., seq, d_model)``."""
        merged = context_vec.transpose(-2, -3)  # (..., seq, heads, head_dim)
        merged = merged.reshape(merged.shape[:-2] + (-1,))  # (..., seq, heads * head_dim)
        output = merged @ self.W_out  # (..., seq, d_model)
        if "b_out" in self._weight_names:
            output = output + self.b_out
        return output

    def _project(self, x: torch.Tensor, name: str, heads: int) -> torch.Tensor:
        """``(..., seq, d_model)`` → ``(..., heads, seq, head_dim)``."""
        projected = x @ getattr(self, f"W_{name}")  # (..., seq, heads * head_dim)
        if f"b_{name}" in self._weight_names:
            projected = projected + getattr(self, f"b_{name}")
        split = projected.reshape(projected.shape[:-1] + (heads, self.head_dim))
        return split.transpose(-2, -3)  # (..., heads, seq, head_dim)

    def _rope_arguments(self) -> dict[str, Any]:
        """``rotary_embedding``'s keywords for this module's rope: layout, rotary_dim, and the
        inverse frequencies and attention factor of ``rope_frequencies``."""
        rotary_dim = self.head_dim if self.rope.rotary_dim is None else self.rope.rotary_dim
        inv_freq, attention_factor = rope_frequencies(
            rotary_dim, theta=self.rope.theta, scaling=self.rope.scaling,
            max_position_embeddings=self.rope.max_position_embeddings)
        return {"layout": self.rope.layout, "rotary_dim": rotary_dim, "inv_freq": inv_freq,
                "attention_factor": attention_factor}

    def _rotate(self, x: torch.Tensor, positions: Any) -> torch.Tensor:
        """``x: (..., heads, seq, head_dim)`` rotated at ``positions (..., seq)`` (unchanged
        without a rope)."""
        if self.rope is None:
            return x
        return rotary_embedding(x, positions, **self._rope_arguments())

    def _positions(self, fn: str, x: torch.Tensor, context: Any, positions: Any,
                   key_positions: Any) -> tuple[Any, Any]:
        """The queries' positions ``(..., q_len)`` (default ``0..q_len-1``) and the keys':
        the same in self-attention, ``key_positions`` (default ``0..kv_len-1``) over a
        ``context``."""
        _check_key_positions(fn, context, key_positions)
        arange = torch.arange  # torch: on x's device
        q_pos = arange(x.shape[-2], device=x.device) if positions is None else positions
        if context is None:
            return q_pos, q_pos
        kv_len = _as_tensor(context).shape[-2]
        return q_pos, arange(kv_len, device=x.device) if key_positions is None else key_positions

    def _projections(
        self, x: torch.Tensor, context: Any, q_pos: Any, k_pos: Any
    ) -> dict[str, torch.Tensor]:
        """The stages up to the rotation: ``q_proj``, ``k_proj``, ``v_proj`` (``(..., heads |
        kv_heads, seq, head_dim)``), ``rotated_q`` and ``rotated_k`` (at ``q_pos``,
        ``k_pos``)."""
        source = x if context is None else _as_tensor(context)  # (..., kv_len, d_model)
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
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``x`` over ``context`` (self-attention when ``context`` is None).

        Args:
          x: ``(..., q_len, d_model)``.
          context: ``(..., kv_len, d_model)`` or ``None``.
          mask: boolean, broadcastable to ``(..., num_heads, q_len, kv_len)``; True = may attend.
          is_causal, causal_alignment, window: as in ``scaled_dot_product_attention``.
          return_weights: also return weights ``(..., num_heads, q_len, kv_len)``.
          rng: ``torch.Generator`` for dropout (``None``: torch's global generator).
          positions: integer ``(..., q_len)``, the queries' positions for the rope (default
            ``0..q_len-1``; the keys' too in self-attention); no effect without a rope.
          key_positions: integer ``(..., kv_len)``, the context's positions (default
            ``0..kv_len-1``); only with a ``context``.

        Returns:
          ``(..., q_len, d_model)``, and the weights with ``return_weights``.
        """
        x = _as_tensor(x)
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
          weight name → gradient, for every weight.
        """
        _check_no_dropout(self)
        with torch.enable_grad():
            output = self.forward(x, context, mask=mask, is_causal=is_causal,
                                  causal_alignment=causal_alignment, window=window,
                                  positions=positions, key_positions=key_positions)
            return module_weight_grads(self, output, grad_output)

    def decode(
        self, x: Any, cache: KVCache | None = None, *, max_len: int | None = None
    ) -> tuple[torch.Tensor, KVCache]:
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
          torch: no autograd history unless ``_decode_records_graph`` (training mode).
        """
        x = _as_tensor(x)
        positions = _decode_positions(cache, x.shape[:-2], x.shape[-2], x.device)  # (..., n)
        with torch.set_grad_enabled(_decode_records_graph(self)):
            query = self._project(x, "query", self.num_heads)  # (..., heads, n, head_dim)
            key = self._project(x, "key", self.num_kv_heads)  # (..., kv_heads, n, head_dim)
            value = self._project(x, "value", self.num_kv_heads)
            query, key = self._rotate(query, positions), self._rotate(key, positions)
            context_vec, cache = decode_step(query, key, value, cache, max_len,
                                             sinks=self._sinks())
            output = self._out(context_vec)  # (..., n, d_model)
        return output, cache

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
    ) -> dict[str, torch.Tensor]:
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
        x = _as_tensor(x)
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


def _decode_positions(cache: Any, batch_shape: tuple[int, ...], n: int,
                      device: torch.device) -> torch.Tensor:
    """The positions ``(..., n)`` of ``n`` new tokens after the cached ones: ``length + 0..n-1``
    (a ``PagedKVCache``: sequence ``b``'s own length, ``(batch, n)``)."""
    steps = torch.arange(n, device=device)  # torch: on x's device
    if cache is None:
        return steps
    if isinstance(cache, PagedKVCache):
        lengths = torch.tensor([cache.seq_len(b) for b in range(batch_shape[0])], device=device)
        return lengths[:, None] + steps  # (batch, n)
    return cache.length + steps
