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

``transformers_rotary.use_rotary(model)`` runs the models' rotary embedding through
``torch_attn.rotary_embedding`` as well.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import causal_mask_function, sdpa_mask

from .. import functional

NAME = "torch_attn"

__all__ = ["NAME", "attention_forward", "attention_mask", "register"]


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
