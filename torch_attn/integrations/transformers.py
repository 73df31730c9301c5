"""torch_attn as an attention implementation of Hugging Face transformers.

One call registers it, and every attention layer of a model built with its name runs
``torch_attn.scaled_dot_product_attention``::

    from torch_attn.integrations import transformers as hf

    model = AutoModelForCausalLM.from_config(config, attn_implementation=hf.register())
    model.set_attn_implementation(hf.register())  # or switch a model already built

``register`` sets two of transformers' tables under one name: ``AttentionInterface`` (the
attention function, ``attention_forward``) and ``AttentionMaskInterface`` (how the model builds
the mask it passes, ``attention_mask``). Without the second, transformers builds no mask at all
for an unknown name: a padded batch reaches the attention function with ``attention_mask=None``
and padding is silently attended.

How transformers' arguments map onto the spec (``conformance/spec/functions.py``):

* layout: transformers passes ``(batch, heads, seq, head_dim)`` as the spec and expects the
  output back as ``(batch, seq, heads, head_dim)``;
* mask: the boolean 4-D mask ``(batch, 1, q_len, kv_len)`` of ``attention_mask`` (True = may
  attend, as the spec) holds padding, the causal rule at the cache's positions and the sliding
  window or the chunks of Llama 4's chunked layers (``tests/test_integration_llama4.py``); a
  float (additive) 4-D mask given by the caller becomes ``mask`` (entries above the
  dtype's most negative value) plus ``bias`` (its other entries, added in the compute dtype as
  transformers' ``eager`` adds them: a float32 mask on float16 inputs is not rounded to
  float16 first); a 2-D ``(batch, kv_len)`` padding mask becomes ``(batch, 1, 1, kv_len)``;
* no mask, or a 2-D padding mask (which holds no causal rule; the queries are the last
  ``q_len`` of the keys): the module's causal flag as ``is_causal`` with
  ``causal_alignment="bottom_right"`` (decoding with a cache), and ``sliding_window`` as
  ``window=(sliding_window - 1, None)``;
* ``scaling`` → ``scale``, ``softcap`` → ``softcap`` (Gemma 2's logit soft-capping),
  ``position_bias`` → ``bias``, grouped-query key/value heads as they come (no repeat);
* ``dropout`` → ``dropout_p`` while ``module.training`` (torch's global generator);
* ``s_aux`` (the learned attention sinks of GPT-OSS and the other families that pass
  ``s_aux=self.sinks``: one logit per query head) → ``sinks``, as transformers' gpt_oss
  ``eager_attention_forward`` uses them (an extra softmax column without a value, dropped after
  the softmax); autograd reaches them, so training updates the sinks;
* weights are returned (before dropout, without the sink column) only when
  ``output_attentions=True`` is passed.

A row that may attend no key (a left-padding position of a causal model) gives output 0, as the
spec says; transformers' ``eager`` gives the mean of every value there (``docs/integrations.md``).
With sinks such a row puts all its weight on the sink, and GPT-OSS's ``eager`` gives 0 as well.

``use_rotary(model)`` goes one step further: each attention layer of a Llama, GLM, StableLM or
DeepSeek-V3 model then rotates its queries and keys with ``torch_attn.rotary_embedding`` (the
frequencies of ``torch_attn.rope_frequencies`` from the model's ``rope_parameters``) and calls
``attention_forward``; transformers' cos/sin tables are no longer computed. Known difference:
transformers computes the rotary angles, cos and sin in float32 even in a float64 model (its
``inv_freq`` is float32 and it multiplies ``position_ids.float()``), ``rotary_embedding`` in
float64 for float64 inputs, so a float64 model agrees with its ``eager`` self only to float32
rounding of the angles (``conformance/spec/rotary.py``'s ``ROTARY_PRECISION``).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import causal_mask_function, sdpa_mask

from attention_rules.rope_scaling import yarn_mscale

from .. import functional
from ..rotary import rope_frequencies, rotary_embedding

NAME = "torch_attn"

__all__ = ["NAME", "attention_forward", "attention_mask", "register", "use_rotary"]


def register(name: str = NAME) -> str:
    """Register ``attention_forward`` and its mask builder with transformers under ``name``.

    Returns:
      ``name``, for ``from_pretrained``/``from_config(..., attn_implementation=name)`` or
      ``model.set_attn_implementation(name)``. Registering again is harmless.
    """
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention-function signature on ``torch_attn.scaled_dot_product_attention``.

    Args:
      module: the calling attention layer; its ``is_causal`` (default True) and ``training``
        are read.
      query: ``(batch, heads, q_len, head_dim)``.
      key: ``(batch, kv_heads, kv_len, head_dim)``; ``heads`` a multiple of ``kv_heads``.
      value: ``(batch, kv_heads, kv_len, v_dim)``.
      attention_mask: None, boolean ``(batch, 1 or heads, q_len, kv_len)`` (True = may attend),
        float additive of that shape, or boolean/integer ``(batch, kv_len)`` padding (1 = token).
      dropout: dropout probability, applied only while ``module.training``.
      scaling: score scale (default ``head_dim ** -0.5``).
      softcap: logit soft-cap, ``softcap · tanh(scores / softcap)``, or None.
      sliding_window: keys ``sliding_window - 1`` or fewer positions back; used only when
        ``attention_mask`` is None or 2-D (a 4-D mask already holds the window).
      kwargs: ``is_causal`` overrides the module's flag; ``position_bias`` (float,
        broadcastable to ``(batch, heads, q_len, kv_len)``) is added to the scores;
        ``output_attentions=True`` returns the weights; ``s_aux`` (attention sinks, a
        floating-point ``(heads,)`` tensor, e.g. GPT-OSS's ``module.sinks``) becomes ``sinks``
        (a wrong shape or dtype raises as ``scaled_dot_product_attention`` says); other
        keywords are ignored.

    Returns:
      ``(output, weights)``: output ``(batch, q_len, heads, v_dim)`` (contiguous), weights
      ``(batch, heads, q_len, kv_len)`` or None.
    """
    q_len, kv_len = query.shape[-2], key.shape[-2]
    mask, bias = _mask_and_bias(attention_mask)
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    is_causal, window = False, None
    if attention_mask is None or attention_mask.ndim == 2:  # the structure a 4-D mask holds
        is_causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
        if sliding_window is not None and kv_len > sliding_window:
            window = (sliding_window - 1, None)
        is_causal = is_causal and q_len > 1  # one query at the end sees every key anyway
    output_attentions = bool(kwargs.get("output_attentions", False))
    result = functional.scaled_dot_product_attention(
        query, key, value, mask=mask, bias=bias, is_causal=is_causal,
        causal_alignment="bottom_right", window=window, scale=scaling, softcap=softcap,
        dropout_p=float(dropout) if module.training else 0.0, return_weights=output_attentions,
        sinks=kwargs.get("s_aux"),
    )  # (batch, heads, q_len, v_dim)
    output, weights = result if output_attentions else (result, None)
    return output.transpose(1, 2).contiguous(), weights  # (batch, q_len, heads, v_dim)


def attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask builder registered with ``AttentionMaskInterface``: transformers' own boolean
    ``sdpa`` mask ``(batch_size, 1, q_length, kv_length)``, True = may attend (padding, the
    causal rule at the cache's positions, the sliding window).

    It returns None (no mask) only where ``attention_forward``'s bottom-right causal rule gives
    the same: no padding and either one query or as many queries as keys. (transformers' ``sdpa``
    builder also skips the mask when a static cache is longer than the prompt, relying on a
    top-left causal rule.)

    Args:
      batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask:
        as transformers' ``sdpa_mask`` (``attention_mask``: the ``(batch, kv)`` padding mask).
      allow_is_causal_skip: transformers allows the mask to be left out.
      kwargs: passed on to ``sdpa_mask``.

    Returns:
      boolean ``(batch_size, 1, q_length, kv_length)``, or None.
    """
    allow = allow_is_causal_skip and (q_length == 1 or q_length == kv_length)
    return sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
        allow_is_causal_skip=allow, **kwargs,
    )


def _mask_and_bias(
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The spec's boolean ``mask`` and float ``bias`` for a transformers attention mask."""
    if attention_mask is None:
        return None, None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            "attention_forward: attention_mask must be a torch.Tensor or None (flex_attention's "
            f"BlockMask is not supported); got type(attention_mask)={type(attention_mask).__name__}"
        )
    if attention_mask.ndim == 2:  # (batch, kv_len) padding, 1 = token
        return attention_mask.bool()[:, None, None, :], None  # (batch, 1, 1, kv_len)
    if attention_mask.dtype == torch.bool:
        return attention_mask, None
    if not attention_mask.is_floating_point():  # integer 4-D: nonzero = may attend
        return attention_mask != 0, None
    allowed = attention_mask > torch.finfo(attention_mask.dtype).min  # min and -inf: masked
    return allowed, attention_mask.masked_fill(~allowed, 0.0)


# The rotary embedding: transformers' attention layers rotating with ``rotary_embedding``.


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
