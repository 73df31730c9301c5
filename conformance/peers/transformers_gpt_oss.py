"""transformers' GPT-OSS attention as a peer (column ``transformers.gpt_oss``): attention sinks.

``transformers.models.gpt_oss.modeling_gpt_oss.eager_attention_forward(module, query, key,
value, attention_mask, scaling, dropout)``, called as ``GptOssAttention.forward`` calls it: the
module itself is passed, and the function reads ``num_key_value_groups``, ``training`` and the
learned sinks ``module.sinks`` ``(heads,)`` from it; the mask arrives as
``masking_utils.eager_mask`` builds it, an additive float mask (0 where allowed,
``torch.finfo(dtype).min`` elsewhere) holding padding, the causal rule (either alignment) and
the window, plus the case's bias. It joins the sink logit to the scores as an extra column,
subtracts the row maximum, takes the softmax in the input dtype and drops the column: the
reference semantics of the spec's sinks (``SINKS``). It returns the weights too, compared as
``output_weights``.

transformers has no ``sdpa`` path for GPT-OSS (``_supports_sdpa = False``): this is the kernel
GPT-OSS runs on the CPU. Its cases are those with sinks; without sinks (every other case) the
column is n/a (``transformers.eager`` covers them), and so are soft-capping (GPT-OSS has none)
and a given dropout keep-mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cases.expected import Expected
from ..running import backends
from .inputs import four_d, need, sdpa_case


@dataclass
class GptOssCaller:
    """What ``eager_attention_forward`` reads from the calling ``GptOssAttention``."""

    num_key_value_groups: int
    sinks: Any  # (heads,) torch tensor
    training: bool = False


def transformers_gpt_oss(exp: Expected) -> dict[str, np.ndarray]:
    """The ``transformers.gpt_oss`` peer: output ``(..., heads, q_len, v_dim)`` and weights
    ``(..., heads, q_len, kv_len)`` of GPT-OSS's ``eager_attention_forward``."""
    import torch
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    peer = "transformers gpt_oss eager_attention_forward"
    a, o = sdpa_case(exp, peer, sinks=True)
    need(a.get("sinks") is not None, f"{peer}: the column checks attention sinks, and the case "
         "has none (transformers.eager covers it)")
    x = four_d(exp, peer, join_structure=True)
    need(x.query.shape[1] % x.key.shape[1] == 0, f"{peer} needs heads divisible by kv heads")
    t = backends.torch_asarray
    q, k, v = t(x.query), t(x.key), t(x.value)
    dtype = q.dtype
    attention_mask = None
    if x.mask is not None:
        allowed = t(np.ascontiguousarray(x.mask))
        attention_mask = torch.where(allowed, torch.tensor(0.0, dtype=dtype),
                                     torch.finfo(dtype).min)
    if x.bias is not None:
        bias = t(x.bias)
        attention_mask = bias if attention_mask is None else bias + attention_mask
    caller = GptOssCaller(x.query.shape[1] // x.key.shape[1], t(np.asarray(a["sinks"])))
    scaling = x.query.shape[-1] ** -0.5 if o.get("scale") is None else float(o["scale"])
    with torch.no_grad():
        out, weights = eager_attention_forward(caller, q, k, v, attention_mask,
                                               scaling=scaling, dropout=0.0)
    output = np.swapaxes(backends.torch_to_numpy(out), 1, 2).reshape(x.output_shape)
    return {"output": output, "output_weights": backends.torch_to_numpy(weights).reshape(
        exp.values["output_weights"].shape)}


__all__ = ["GptOssCaller", "transformers_gpt_oss"]
