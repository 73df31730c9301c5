"""torch_attn's rotary embedding inside Hugging Face transformers models: ``use_rotary(model)``.

After ``use_rotary(model)`` each attention layer of a Llama, GLM, StableLM or DeepSeek-V3
model rotates its queries and keys with ``torch_attn.rotary_embedding`` (the frequencies of
``torch_attn.rope_frequencies`` from the model's ``rope_parameters``) and calls the project's
attention (``transformers.attention_forward``, under ``register()``'s name); transformers'
cos/sin tables are no longer computed. Known difference: transformers computes the rotary
angles, cos and sin in float32 even in a float64 model (its ``inv_freq`` is float32 and it
multiplies ``position_ids.float()``), ``rotary_embedding`` in float64 for float64 inputs, so a
float64 model agrees with its ``eager`` self only to float32 rounding of the angles
(``conformance/spec/rotary.py``'s ``ROTARY_PRECISION``).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from attention_rules.rope_scaling import yarn_mscale

from ..rotary import rope_frequencies, rotary_embedding
from .transformers import attention_forward, register

__all__ = ["use_rotary"]


def use_rotary(model: torch.nn.Module, *, layout: str | None = None) -> torch.nn.Module:
    """Run the model's rotary embedding through ``torch_attn.rotary_embedding`` and its attention
    through ``attention_forward``, in place.

    Every attention layer's ``forward`` is replaced by this module's line-for-line copy of
    transformers' own (``_llama_attention_forward`` or ``_deepseek_v3_attention_forward``): the
    same projections, with the layer's own ``nn.Linear`` weights and norms, the same cache
    update and output projection; only the rotation and the attention are the project's. The
    rotation takes the tokens' ``position_ids`` (the model passes them to every layer: left
    padding and decoding with a cache at an offset included), the frequencies come from
    ``torch_attn.rope_frequencies`` with the config's ``rope_parameters`` (default, linear,
    dynamic, llama3, yarn with its attention factor, longrope; ``partial_rotary_factor``
    honoured). The model's rotary module (``rotary_emb``) is replaced by one that computes no
    cos/sin, so transformers' tables take no part, and the model's attention implementation is
    set to ``register()``'s, which builds the masks ``attention_forward`` reads. The change
    cannot be undone: build the model again to get transformers' own.

    Families (``config.model_type``) and their layout:

    * ``llama``: ``"half"`` (``rotate_half``) on all of head_dim;
    * ``stablelm``: ``"half"`` on the first ``int(head_dim · partial_rotary_factor)`` dims
      (its per-head ``qk_layernorm`` before the rotation, as transformers);
    * ``glm``: ``"interleaved"`` (GLM's ``rotate_half`` pairs dims ``(2i, 2i+1)``) on the first
      ``int(head_dim · partial_rotary_factor)`` dims (0.5 by default), output interleaved;
    * ``deepseek_v3`` (multi-head latent attention): only the last ``qk_rope_head_dim`` dims of
      each query head and the single shared rotary key head are rotated, ``"interleaved"``
      when ``config.rope_interleave`` else ``"half"``; an interleaved rotation is returned in
      transformers' de-interleaved order (the even dims' results, then the odd dims': what
      ``apply_rotary_pos_emb_interleave`` returns, so the cache holds the same tensors as
      transformers'); the softmax scale is ``qk_head_dim ** -0.5 · mscale(factor,
      mscale_all_dim)²`` for a scaled (YaRN) rope, as ``DeepseekV3Attention.__init__``.

    Dynamic and longrope frequencies are computed at every call from ``seq_len =
    max(position_ids) + 1``; transformers keeps the frequencies of the longest sequence seen
    (until a sequence shorter than the original context resets them), so the two differ when a
    call is shorter than an earlier one but longer than ``max_position_embeddings``.

    Precision: transformers computes the angles, cos and sin in float32 whatever the model's
    dtype; ``rotary_embedding`` computes them in float64 for a float64 model, so a float64
    model agrees with its ``eager`` self only to float32 rounding of the angles (about 1e-7
    relative, growing with the position; ``ROTARY_PRECISION`` in ``conformance/spec/rotary.py``).

    Args:
      model: a transformers model (``...ForCausalLM`` or its base model) of a family above.
      layout: the rotation's layout, "half" or "interleaved"; None: the family's. The other one
        is right for a checkpoint whose query/key weights were not permuted by transformers'
        converter (``torch_attn.permute_for_rotary_layout`` moves them).

    Returns:
      the same model, changed in place.

    Raises:
      ValueError: a model_type not listed above, or a layout that is neither.
    """
    config = model.config
    family = getattr(config, "model_type", None)
    if family not in _ROTARY_FAMILIES:
        raise ValueError(f"use_rotary: model_type must be one of {sorted(_ROTARY_FAMILIES)}; "
                         f"got model_type={family!r}")
    if layout not in (None, "half", "interleaved"):
        raise ValueError(f"use_rotary: layout must be None, 'half' or 'interleaved'; "
                         f"got layout={layout!r}")
    family_layout, forward = _ROTARY_FAMILIES[family]
    if family == "deepseek_v3":
        family_layout = "interleaved" if config.rope_interleave else "half"
    model.set_attn_implementation(register())
    for name, module in list(model.named_modules()):
        if name.split(".")[-1] == "rotary_emb":
            parent = model.get_submodule(name.rpartition(".")[0])
            parent.rotary_emb = _NoCosSin()
        elif hasattr(module, "layer_idx") and type(module).__name__.endswith("Attention"):
            module.rotary_layout = layout or family_layout
            module.forward = types.MethodType(forward, module)
    return model


class _NoCosSin(torch.nn.Module):
    """In place of the model's rotary module: the layers rotate by themselves, so the
    ``position_embeddings`` the model hands them are ``(None, None)``."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None,
                layer_type: str | None = None) -> tuple[None, None]:
        return None, None


def _llama_attention_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: Any = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``LlamaAttention.forward`` (GLM's and StableLM's are the same up to the rotation) with
    ``rotary_embedding`` and ``attention_forward``.

    Args:
      self: the attention layer: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``head_dim``,
        ``layer_idx``, ``scaling``, ``rotary_layout`` (set by ``use_rotary``).
      hidden_states: ``(batch, seq, hidden)``.
      position_embeddings: transformers' cos/sin, unused (``(None, None)``).
      attention_mask: the model's mask for ``attention_forward``.
      cache: transformers' ``Cache`` or None; the rotated keys and the values are appended.
      kwargs: ``position_ids`` ``(batch or 1, seq)``; the rest goes to ``attention_forward``.

    Returns:
      ``(output (batch, seq, hidden), weights or None)``.
    """
    input_shape = hidden_states.shape[:-1]  # (batch, seq)
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (b, h, s, d)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (b, kv, s, d)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    if getattr(self, "qk_layernorm", False):  # StableLM: a LayerNorm per head, before RoPE
        query_states, key_states = self.q_layernorm(query_states), self.k_layernorm(key_states)

    rotary_dim = int(self.head_dim * self.config.rope_parameters.get("partial_rotary_factor", 1.0))
    positions = _positions(self, kwargs, cache, hidden_states)  # (batch or 1, seq)
    query_states, key_states = _rotate(self, query_states, key_states, positions, rotary_dim)

    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx,
                                                kwargs=kwargs)

    attn_output, attn_weights = attention_forward(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
        **kwargs,
    )  # (batch, seq, heads, head_dim)

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)  # (batch, seq, hidden)
    return attn_output, attn_weights


def _deepseek_v3_attention_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: Any = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``DeepseekV3Attention.forward`` (multi-head latent attention) with ``rotary_embedding``
    and ``attention_forward``: the queries' last ``qk_rope_head_dim`` dims and the one shared
    rotary key head ``k_rot`` are rotated (decoupled RoPE); the compressed latent ``kv_nope``
    and the rotated ``k_rot`` go to the cache, and ``expand_kv`` (the layer's ``kv_b_proj``)
    makes the keys ``(k_nope, k_rot)`` and the values of every head.

    Args:
      self: the attention layer (``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``,
        ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``, the head dims,
        ``rotary_layout``).
      hidden_states: ``(batch, seq, hidden)``.
      position_embeddings: transformers' cos/sin, unused (``(None, None)``).
      attention_mask: the model's mask for ``attention_forward``.
      cache: transformers' ``Cache`` or None.
      kwargs: ``position_ids`` ``(batch or 1, seq)``; the rest goes to ``attention_forward``.

    Returns:
      ``(output (batch, seq, hidden), weights or None)``.
    """
    batch_size, seq_length = hidden_states.shape[:-1]
    query_shape = (batch_size, seq_length, -1, self.qk_head_dim)

    if self.q_lora_rank is None:
        q_states = self.q_proj(hidden_states)
    else:
        q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q_states = q_states.view(query_shape).transpose(1, 2)  # (batch, heads, seq, qk_head_dim)
    q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

    compressed_kv = self.kv_a_proj_with_mqa(hidden_states)  # (batch, seq, kv_lora + rope)
    kv_nope, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    kv_nope = self.kv_a_layernorm(kv_nope)
    kv_nope = kv_nope.view(batch_size, 1, seq_length, self.kv_lora_rank)  # (batch, 1, seq, lora)
    k_rot = k_rot.view(batch_size, 1, seq_length, self.qk_rope_head_dim)  # (batch, 1, seq, rope)

    positions = _positions(self, kwargs, cache, hidden_states)  # (batch or 1, seq)
    q_rot, k_rot = _rotate(self, q_rot, k_rot, positions, self.qk_rope_head_dim)
    if self.rotary_layout == "interleaved":  # transformers' order: even dims' results, then odd
        q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)

    if cache is not None:  # the cache holds the compressed latents
        kv_nope, k_rot = cache.update(kv_nope, k_rot, self.layer_idx, kwargs=kwargs)

    query_states = torch.cat((q_pass, q_rot), dim=-1)  # (batch, heads, seq, qk_head_dim)
    key_states, value_states = self.expand_kv(kv_nope, k_rot)  # (batch, heads, kv_len, ...)

    attn_output, attn_weights = attention_forward(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=_mla_softmax_scale(self.config), **kwargs,
    )  # (batch, seq, heads, v_head_dim)

    attn_output = attn_output.reshape(batch_size, seq_length, -1).contiguous()
    attn_output = self.o_proj(attn_output)  # (batch, seq, hidden)
    return attn_output, attn_weights


_ROTARY_FAMILIES: dict[str, tuple[str, Callable[..., Any]]] = {
    "llama": ("half", _llama_attention_forward),
    "stablelm": ("half", _llama_attention_forward),
    "glm": ("interleaved", _llama_attention_forward),
    "deepseek_v3": ("interleaved", _deepseek_v3_attention_forward),  # config.rope_interleave
}


def _positions(layer: torch.nn.Module, kwargs: dict, cache: Any,
               hidden_states: torch.Tensor) -> torch.Tensor:
    """The tokens' positions ``(batch or 1, seq)``: the model's ``position_ids``, else the
    cache's length plus ``arange(seq)``, as transformers' models make them."""
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        return position_ids
    past = cache.get_seq_length(layer.layer_idx) if cache is not None else 0
    return torch.arange(past, past + hidden_states.shape[1], device=hidden_states.device)[None]


def _rotate(layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
            positions: torch.Tensor, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_embedding`` of query ``(batch, heads, seq, d)`` and key ``(batch, kv_heads, seq,
    d)`` at ``positions`` ``(batch or 1, seq)``: the first ``rotary_dim`` dims, in the layer's
    ``rotary_layout``, with the config's frequencies and attention factor."""
    inv_freq, attention_factor = _frequencies(layer.config, rotary_dim, positions)
    rotate = functools.partial(rotary_embedding, positions=positions, layout=layer.rotary_layout,
                               rotary_dim=rotary_dim, inv_freq=inv_freq,
                               attention_factor=attention_factor)
    return rotate(query), rotate(key)


def _frequencies(config: Any, rotary_dim: int, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, float]:
    """``rope_frequencies`` of ``config.rope_parameters`` (transformers' format: rope_type,
    rope_theta and the method's keys): ``(inv_freq (rotary_dim // 2,) float64, factor)``."""
    scaling = dict(config.rope_parameters)
    seq_len = None
    if scaling.get("rope_type", scaling.get("type")) in ("dynamic", "longrope"):
        seq_len = int(positions.max()) + 1  # as transformers' dynamic_rope_update
    return rope_frequencies(rotary_dim, theta=scaling.get("rope_theta", 10000.0),
                            scaling=scaling, seq_len=seq_len,
                            max_position_embeddings=config.max_position_embeddings)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``(..., r)`` interleaved pairs → the even dims, then the odd dims (half order)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def _mla_softmax_scale(config: Any) -> float:
    """DeepSeek-V3's softmax scale: ``qk_head_dim ** -0.5``, times ``mscale(factor,
    mscale_all_dim) ** 2`` for a scaled rope with ``mscale_all_dim`` (transformers'
    ``yarn_apply_mscale``, the reference implementation's ``softmax_scale``)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    parameters = config.rope_parameters
    if parameters.get("rope_type", "default") != "default" and parameters.get("mscale_all_dim"):
        mscale = yarn_mscale(parameters["factor"], parameters["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale
