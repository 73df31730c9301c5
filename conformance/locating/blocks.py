"""What an attention block is to ``locate``, and the adapters that make two comparable.

An attention block is either

* anything with ``stages(x, positions=..., is_causal=...)`` returning a dict of the named
  intermediate tensors (``STAGES``; the spec's ``MultiHeadAttention`` in every backend, a
  plugin's module), or
* a transformers attention layer (``LlamaAttention`` and the families written like it: ``q_proj``,
  ``k_proj``, ``v_proj``, ``o_proj``, a ``config``), run with forward hooks on the four
  projections and, while it runs, its module's ``apply_rotary_pos_emb`` and
  ``eager_attention_forward`` wrapped to catch the rotated queries and keys, the scores and the
  weights.

Every stage comes back as float64 NumPy in one layout, ``(batch, heads, seq, dim)``: the output
``(batch, seq, d_model)`` gets a heads axis of 1. Weights copy between blocks under the spec's
names (``W_query (d_model, heads·head_dim)`` ...): a transformers layer's ``q_proj.weight`` is
``W_query.T``, its ``o_proj.weight`` ``W_out.T``.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import numpy as np

#: The stages compared, in the pipeline's order.
STAGES = ("q_proj", "k_proj", "v_proj", "rotated_q", "rotated_k", "scores", "weights",
          "context", "output")

#: The spec's weight names and the transformers layer's projection for each.
_LINEAR = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "out": "o_proj"}


class BadBlock(ValueError):
    """A block ``locate`` cannot run or compare: the message says which and why."""


def to_float64(value: Any) -> np.ndarray:
    """Any backend's array (NumPy, JAX, torch on any device, bfloat16 included) as float64
    NumPy, same shape."""
    if hasattr(value, "detach"):  # torch
        return value.detach().cpu().double().numpy()
    return np.asarray(value).astype(np.float64)


def _layout(block: str, stage: str, value: Any) -> np.ndarray:
    """A stage in the one layout ``(batch, heads, seq, dim)``: a 3-D ``(batch, seq, dim)``
    gets a heads axis of 1 (the output)."""
    array = to_float64(value)
    if array.ndim == 3:
        array = array[:, None]
    if array.ndim != 4:
        raise BadBlock(f"{block}: stage {stage!r} has shape {array.shape}; expected (batch, "
                       f"heads, seq, dim) or, for the output, (batch, seq, d_model)")
    return array


class Block:
    """The common face of an attention block: its stages, and its weights under the spec's
    names when it can give and take them."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def d_model(self) -> int | None:
        """The model width, when the block says it (None: learnt by running it)."""
        return None

    def stages(self, x: np.ndarray, positions: np.ndarray, is_causal: bool
               ) -> dict[str, np.ndarray]:
        """``x (batch, seq, d_model)``, ``positions (batch, seq)`` ints → stage name →
        float64 ``(batch, heads, seq, dim)``."""
        raise NotImplementedError

    def export(self) -> dict[str, np.ndarray] | None:
        """The weights under the spec's names, or None when the block cannot give them."""
        return None

    def with_weights(self, weights: dict[str, np.ndarray] | None, dtype: str) -> Block | None:
        """A copy holding ``weights`` (None: its own) in ``dtype``, or None when the block
        cannot take them; the block itself is left as it is."""
        return None


class StagesBlock(Block):
    """A block with its own ``stages`` method (the spec's modules, a plugin's)."""

    def __init__(self, obj: Any, name: str) -> None:
        super().__init__(name)
        self.obj = obj

    @property
    def d_model(self) -> int | None:
        value = getattr(self.obj, "d_model", None)
        return value if isinstance(value, int) else None

    def stages(self, x: np.ndarray, positions: np.ndarray, is_causal: bool
               ) -> dict[str, np.ndarray]:
        with _no_grad():
            found = self.obj.stages(x, positions=positions, is_causal=is_causal)
        if not isinstance(found, dict):
            raise BadBlock(f"{self.name}: stages() returned {type(found).__name__}, not a dict "
                           f"of stage name → array")
        return {name: _layout(self.name, name, found[name]) for name in STAGES if name in found}

    def export(self) -> dict[str, np.ndarray] | None:
        export = getattr(self.obj, "export_weights", None)
        return None if export is None else {k: np.asarray(v) for k, v in export().items()}

    def with_weights(self, weights: dict[str, np.ndarray] | None, dtype: str) -> Block | None:
        if not callable(getattr(self.obj, "load_weights", None)):
            return None
        weights = self.export() if weights is None else weights
        if weights is None:
            return None
        try:
            twin = copy.deepcopy(self.obj)
        except Exception:  # noqa: BLE001 - a block that cannot be copied is not loaded
            return None
        cast = {name: np.asarray(w).astype(dtype) for name, w in weights.items()}
        try:
            own = twin.export_weights() if callable(getattr(twin, "export_weights", None)) else {}
            for name, w in own.items():  # biases and sinks the giver has none of: zeros
                if name not in cast and (name.startswith("b_") or name == "sinks"):
                    cast[name] = np.zeros(np.shape(w), dtype)
            loaded = twin.load_weights(cast)
        except (ValueError, TypeError, KeyError) as exc:
            raise BadBlock(f"{self.name}: cannot take the other block's weights: {exc}") from None
        return StagesBlock(twin if loaded is None else loaded, self.name)


@contextmanager
def _no_grad() -> Any:
    """torch's ``no_grad`` when torch is loaded (nothing to record), else nothing."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    with torch.no_grad():
        yield


class TransformersBlock(Block):
    """A transformers attention layer, run with hooks: ``layer(hidden_states,
    position_embeddings=(cos, sin), attention_mask=...)`` with the eager attention, the
    positions turned into ``(cos, sin)`` by the family's own rotary embedding class."""

    def __init__(self, layer: Any, name: str, rotary: Any = None) -> None:
        super().__init__(name)
        self.layer = layer
        self.family = sys.modules[type(layer).__module__]
        for needed in ("apply_rotary_pos_emb", "eager_attention_forward"):
            if not hasattr(self.family, needed):
                raise BadBlock(f"{name}: {type(layer).__name__}'s module "
                               f"{self.family.__name__} has no {needed} to watch")
        self.rotary = rotary if rotary is not None else self._rotary()

    def _rotary(self) -> Any:
        classes = [v for k, v in vars(self.family).items()
                   if k.endswith("RotaryEmbedding") and isinstance(v, type)]
        if not classes:
            raise BadBlock(f"{self.name}: {self.family.__name__} has no RotaryEmbedding class")
        return classes[0](self.layer.config)

    @property
    def d_model(self) -> int | None:
        return int(self.layer.config.hidden_size)

    def stages(self, x: np.ndarray, positions: np.ndarray, is_causal: bool
               ) -> dict[str, np.ndarray]:
        import torch

        layer, family = self.layer, self.family
        dtype = next(layer.parameters()).dtype
        hidden = torch.as_tensor(np.asarray(x, np.float64)).to(dtype)  # (batch, seq, d_model)
        batch, seq = hidden.shape[:2]
        caught: dict[str, Any] = {}

        def split(t: Any) -> Any:  # (batch, seq, heads·head_dim) → (batch, heads, seq, head_dim)
            return t.reshape(batch, seq, -1, layer.head_dim).transpose(1, 2)

        def hook(name: str) -> Callable:
            def record(module: Any, inputs: Any, output: Any) -> None:
                if name == "o_proj":  # its input is the merged context
                    caught["context"], caught["output"] = split(inputs[0]), output
                else:
                    caught[name] = split(output)
            return record

        original_rope, original_eager = family.apply_rotary_pos_emb, family.eager_attention_forward

        def rope(q: Any, k: Any, *args: Any, **kwargs: Any) -> Any:
            q_embed, k_embed = original_rope(q, k, *args, **kwargs)
            caught["rotated_q"], caught["rotated_k"] = q_embed, k_embed
            return q_embed, k_embed

        def eager(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                  scaling: float, *args: Any, **kwargs: Any) -> Any:
            keys = family.repeat_kv(key, module.num_key_value_groups)
            scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
            if attention_mask is not None:  # the additive mask's minimum means "masked": -inf
                masked = attention_mask <= torch.finfo(attention_mask.dtype).min / 2
                scores = torch.where(masked, float("-inf"), scores + attention_mask)
            caught["scores"] = scores
            output, weights = original_eager(module, query, key, value, attention_mask,
                                             scaling, *args, **kwargs)
            caught["weights"] = weights
            return output, weights

        ids = torch.as_tensor(np.broadcast_to(positions, (batch, seq)).astype(np.int64))
        mask = None
        if is_causal:
            allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
            mask = torch.zeros(batch, 1, seq, seq, dtype=dtype)
            mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
        handles = [getattr(layer, n).register_forward_hook(hook(n)) for n in _LINEAR.values()]
        implementation = layer.config._attn_implementation
        family.apply_rotary_pos_emb, family.eager_attention_forward = rope, eager
        try:
            layer.config._attn_implementation = "eager"
            with torch.no_grad():
                cos, sin = self.rotary(hidden, ids)
                layer(hidden, position_embeddings=(cos, sin), attention_mask=mask)
        finally:
            family.apply_rotary_pos_emb, family.eager_attention_forward = (original_rope,
                                                                             original_eager)
            layer.config._attn_implementation = implementation
            for handle in handles:
                handle.remove()
        return {name: _layout(self.name, name, caught[name]) for name in STAGES if name in caught}

    def export(self) -> dict[str, np.ndarray]:
        weights = {}
        for name, proj in _LINEAR.items():
            linear = getattr(self.layer, proj)
            weights[f"W_{name}"] = linear.weight.detach().cpu().numpy().T.copy()
            if linear.bias is not None:
                weights[f"b_{name}"] = linear.bias.detach().cpu().numpy().copy()
        return weights

    def with_weights(self, weights: dict[str, np.ndarray] | None, dtype: str) -> Block:
        import torch

        twin = copy.deepcopy(self.layer).to(getattr(torch, dtype))
        rotary = copy.deepcopy(self.rotary)
        if weights is not None:
            self._load(twin, weights, dtype)
        return TransformersBlock(twin, self.name, rotary)

    def _load(self, twin: Any, weights: dict[str, np.ndarray], dtype: str) -> None:
        import torch

        expected = {f"W_{n}" for n in _LINEAR}
        extra = set(weights) - expected - {f"b_{n}" for n in _LINEAR}
        if not expected <= set(weights) or any(np.any(weights[n] != 0) for n in extra):
            raise BadBlock(f"{self.name}: cannot take weights named {sorted(weights)}; a "
                           f"transformers layer takes {sorted(expected)} and biases")
        with torch.no_grad():
            for name, proj in _LINEAR.items():
                linear = getattr(twin, proj)
                w = np.asarray(weights[f"W_{name}"]).T
                if tuple(w.shape) != tuple(linear.weight.shape):
                    raise BadBlock(f"{self.name}: W_{name}.T has shape {w.shape}, {proj}.weight "
                                   f"{tuple(linear.weight.shape)}")
                linear.weight.copy_(torch.as_tensor(w.astype(dtype)))
                bias = weights.get(f"b_{name}")
                if linear.bias is not None:
                    linear.bias.copy_(torch.zeros_like(linear.bias) if bias is None
                                      else torch.as_tensor(np.asarray(bias).astype(dtype)))
                elif bias is not None and np.any(np.asarray(bias) != 0):
                    raise BadBlock(f"{self.name}: {proj} has no bias; cannot take a nonzero "
                                   f"b_{name}")


def _is_transformers_layer(obj: Any) -> bool:
    return (type(obj).__module__.startswith("transformers.")
            and all(hasattr(obj, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "config")))


def as_block(obj: Any, name: str) -> Block:
    """``obj`` as a ``Block`` (an adapter is returned as it is); ``BadBlock`` naming what is
    missing when it is no attention block."""
    if isinstance(obj, Block):
        return obj
    if _is_transformers_layer(obj):
        return TransformersBlock(obj, name)
    if callable(getattr(obj, "stages", None)):
        return StagesBlock(obj, name)
    raise BadBlock(f"{name} ({type(obj).__name__}) is not an attention block: it has no "
                   f"stages(x, positions=..., is_causal=...) method and is not a transformers "
                   f"attention layer (q_proj, k_proj, v_proj, o_proj)")


__all__ = ["STAGES", "BadBlock", "Block", "StagesBlock", "TransformersBlock", "as_block",
           "to_float64"]
