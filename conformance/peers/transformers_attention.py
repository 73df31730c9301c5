"""Hugging Face transformers' attention functions as peers, called the way its models call them.

A transformers model (``LlamaAttention.forward``) projects its inputs to ``(batch, heads, seq,
head_dim)`` and calls ``attention_interface(self, query, key, value, attention_mask,
dropout=0.0, scaling=self.scaling)``: the module itself is passed, and the function reads
``num_key_value_groups``, ``training`` and ``is_causal`` from it. The mask arrives already built
by ``transformers.masking_utils``, with the causal rule, padding and any sliding window in it.

``transformers.eager``
  ``transformers.models.llama.modeling_llama.eager_attention_forward``: an additive float mask
  (0 where allowed, ``torch.finfo(dtype).min`` elsewhere, as ``masking_utils.eager_mask``
  builds it) plus the case's bias (as models with a position bias add it); it returns the
  weights too, compared as ``output_weights``.
``transformers.sdpa``
  ``transformers.integrations.sdpa_attention.sdpa_attention_forward``: a boolean mask (True =
  may attend) and the bias as ``position_bias``; a causal case with no other mask and
  ``q_len == kv_len`` (or one bottom-right query) gets no mask and ``module.is_causal``, as
  ``masking_utils.sdpa_mask`` skips the mask there.

Both take the causal rule in either alignment and the window (inside the mask), grouped-query
heads (``num_key_value_groups``) and ``scaling``; soft-capping (not in the Llama family) and a
given dropout keep-mask are n/a.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cases.expected import Expected
from ..running import backends
from .inputs import FourD, four_d, need, sdpa_case


@dataclass
class Caller:
    """What the attention functions read from the calling module (``LlamaAttention``)."""

    num_key_value_groups: int
    is_causal: bool = True
    training: bool = False
    attention_dropout: float = 0.0


def _inputs(exp: Expected, peer: str) -> tuple[FourD, dict[str, Any], Caller, Any]:
    import torch

    a, o = sdpa_case(exp, peer)
    x = four_d(exp, peer, join_structure=True)
    need(x.query.shape[1] % x.key.shape[1] == 0, f"{peer} needs heads divisible by kv heads")
    caller = Caller(x.query.shape[1] // x.key.shape[1], is_causal=bool(o.get("is_causal")))
    t = backends.torch_asarray
    tensors = {n: t(getattr(x, n)) for n in ("query", "key", "value")}
    scaling = x.query.shape[-1] ** -0.5 if o.get("scale") is None else float(o["scale"])
    return x, {"scaling": scaling, **tensors}, caller, torch


def _unlayout(out: Any, x: FourD) -> np.ndarray:
    """The functions' output ``(batch, seq, heads, v_dim)`` in the spec's shape."""
    return np.swapaxes(backends.torch_to_numpy(out), 1, 2).reshape(x.output_shape)


def transformers_eager(exp: Expected) -> dict[str, np.ndarray]:
    """The ``transformers.eager`` peer: output and weights of ``eager_attention_forward``."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    x, kw, caller, torch = _inputs(exp, "transformers eager_attention_forward")
    dtype = kw["query"].dtype
    attention_mask = None
    if x.mask is not None:
        allowed = backends.torch_asarray(np.ascontiguousarray(x.mask))
        attention_mask = torch.where(allowed, torch.tensor(0.0, dtype=dtype),
                                     torch.finfo(dtype).min)
    if x.bias is not None:
        bias = backends.torch_asarray(x.bias)
        attention_mask = bias if attention_mask is None else bias + attention_mask
    with torch.no_grad():
        out, weights = eager_attention_forward(
            caller, kw["query"], kw["key"], kw["value"], attention_mask,
            dropout=0.0, scaling=kw["scaling"])
    return {"output": _unlayout(out, x),
            "output_weights": backends.torch_to_numpy(weights).reshape(
                exp.values["output_weights"].shape)}


def transformers_sdpa(exp: Expected) -> dict[str, np.ndarray]:
    """The ``transformers.sdpa`` peer: the output of ``sdpa_attention_forward``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    x, kw, caller, torch = _inputs(exp, "transformers sdpa_attention_forward")
    o = exp.data.options
    q_len, kv_len = x.query.shape[2], x.key.shape[2]
    own_mask = exp.data.arrays.get("mask") is not None or o.get("window") is not None
    skip = (o.get("is_causal") and not own_mask and x.bias is None
            and (q_len == kv_len or (q_len == 1 and o.get("causal_alignment") == "bottom_right")))
    attention_mask = None
    if x.mask is not None and not skip:
        attention_mask = backends.torch_asarray(np.ascontiguousarray(x.mask))
    extra = {} if x.bias is None else {"position_bias": backends.torch_asarray(x.bias)}
    with torch.no_grad():
        out, _ = sdpa_attention_forward(caller, kw["query"], kw["key"], kw["value"],
                                        attention_mask, dropout=0.0, scaling=kw["scaling"],
                                        **extra)
    return {"output": _unlayout(out, x)}


__all__ = ["Caller", "transformers_eager", "transformers_sdpa"]
