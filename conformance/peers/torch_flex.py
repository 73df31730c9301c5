"""torch's FlexAttention as a peer (column ``torch.flex``), with the row log-sum-exp.

``torch.nn.attention.flex_attention.flex_attention(query, key, value, score_mod, block_mask,
scale, enable_gqa, return_aux=AuxRequest(lse=True))``, called eagerly on the CPU (torch 2.13:
without ``torch.compile`` it runs its unfused reference implementation, and warns so; compiling
needs Inductor and a C++ toolchain). It gives the ``output`` and the ``lse`` steps
(``return_lse=True`` is deprecated in favour of ``return_aux``).

The case maps onto FlexAttention's two hooks, as users write them: the boolean mask, the causal
rule in the case's alignment and the window become one ``mask_mod`` that reads the joined mask
(``create_block_mask``); soft-capping and the bias become one ``score_mod``
(``softcap · tanh(score / softcap) + bias``, after the scale FlexAttention applies itself, as the
spec orders them); grouped-query heads take ``enable_gqa=True``. 2-D and 3-D inputs get leading
axes of 1. Not expressible (n/a): attention sinks (FlexAttention has none: a ``score_mod`` sees
one key's score at a time and cannot add a column to the softmax), a given dropout keep-mask
and more than one batch axis.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from .. import backends
from ..expected import Expected
from .inputs import four_d, need, sdpa_case


def _full(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``x`` broadcast to ``shape``, as a contiguous array (FlexAttention's hooks index it)."""
    return np.ascontiguousarray(np.broadcast_to(x, shape))


def torch_flex(exp: Expected) -> dict[str, np.ndarray]:
    """The ``torch.flex`` peer: ``output (..., heads, q_len, v_dim)`` and ``lse (..., heads,
    q_len)`` from ``flex_attention(..., return_aux=AuxRequest(lse=True))``, eagerly."""
    import torch
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    a, o = sdpa_case(exp, "FlexAttention", softcap=True)
    x = four_d(exp, "FlexAttention", join_structure=True)  # mask: boolean mask, causal, window
    t = backends.torch_asarray
    q, k, v = t(x.query), t(x.key), t(x.value)
    batch, heads, q_len = x.query.shape[:3]
    kv_len = x.key.shape[2]
    target = (batch, heads, q_len, kv_len)
    block_mask = None
    if x.mask is not None:
        allowed = t(_full(x.mask, target))  # (B, H, Tq, Tk) bool

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return allowed[b, h, q_idx, kv_idx]

        block_mask = create_block_mask(mask_mod, batch, heads, q_len, kv_len, device="cpu")
    softcap = o.get("softcap")
    bias = None if x.bias is None else t(_full(x.bias, target))  # (B, H, Tq, Tk)
    score_mod = None
    if softcap is not None or bias is not None:

        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            if softcap is not None:
                score = softcap * torch.tanh(score / softcap)
            return score if bias is None else score + bias[b, h, q_idx, kv_idx]

    kwargs: dict[str, Any] = {"block_mask": block_mask, "score_mod": score_mod,
                              "enable_gqa": x.grouped, "return_aux": AuxRequest(lse=True)}
    if o.get("scale") is not None:
        kwargs["scale"] = float(o["scale"])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        out, aux = flex_attention(q, k, v, **kwargs)
    need(aux.lse is not None, "FlexAttention returned no lse")
    lse_shape = x.output_shape[:-1]  # the spec's (..., heads, q_len)
    return {"output": backends.torch_to_numpy(out).reshape(x.output_shape),
            "lse": backends.torch_to_numpy(aux.lse).reshape(lse_shape)}


__all__ = ["torch_flex"]
