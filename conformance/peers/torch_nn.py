"""torch.nn's attention as peers: ``torch.sdpa``, ``torch.MHA`` and ``torch.MHA[sdpa]``.

``torch.sdpa``
  ``torch.nn.functional.scaled_dot_product_attention``: same layout and mask polarity; a bias
  becomes a float ``attn_mask`` (bias, ``-inf`` where the boolean mask is False);
  ``enable_gqa=True`` for grouped-query cases; ``is_causal`` as given (torch is top-left only).
``torch.MHA`` and ``torch.MHA[sdpa]``
  ``torch.nn.MultiheadAttention`` with identity projections, so it attends over the case's own
  query/key/value: heads merged into ``embed_dim``, the boolean mask inverted (its True means
  "masked out"), a causal case as the usual ``triu`` mask (top-left, no ``is_causal`` hint), a
  bias as a float ``attn_mask``, key/value heads repeated for grouped-query cases. Users call it
  two ways, and the two take different code paths, so each is a column:

  * ``torch.MHA``: ``need_weights=True``, the default argument (what ``mha(q, k, v)`` does),
    with ``average_attn_weights=False``: the per-head weights are compared too. It computes
    ``softmax(baddbmm(mask, q, kᵀ))`` itself: a fully masked row is NaN.
  * ``torch.MHA[sdpa]``: ``need_weights=False``, as ``nn.TransformerEncoderLayer`` and the
    documentation's advice for speed call it: the output only, through
    ``scaled_dot_product_attention`` (a fully masked row is 0 on CPU). The fused
    ``torch._native_multi_head_attention`` path needs query, key and value to be one tensor,
    which identity projections of three different arrays cannot be, so no column reaches it.

Not expressible (n/a): a window (all), soft-capping and a given dropout keep-mask (all), a
scale, ``v_dim != head_dim`` and more than one batch axis (the MHA columns).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..cases.expected import Expected
from ..running import backends
from .inputs import need, sdpa_case

# ------------------------------------------------------------------------------ torch SDPA


def torch_sdpa(exp: Expected) -> dict[str, np.ndarray]:
    """The ``torch.sdpa`` peer: ``output (..., heads, q_len, v_dim)`` from torch's SDPA."""
    import torch

    a, o = sdpa_case(exp, "torch SDPA")
    need(o.get("window") is None, "torch SDPA has no sliding window")
    t = backends.torch_asarray
    q, k, v = (t(a[n]) for n in ("query", "key", "value"))
    attn_mask = None
    if a.get("bias") is not None:
        bias = np.asarray(a["bias"])
        if a.get("mask") is not None:
            bias = np.where(np.asarray(a["mask"], bool), bias.astype(np.float64), -np.inf)
        attn_mask = t(np.asarray(bias).astype(a["query"].dtype))
    elif a.get("mask") is not None:
        attn_mask = t(np.asarray(a["mask"], bool))
    kwargs: dict[str, Any] = {"attn_mask": attn_mask, "is_causal": bool(o.get("is_causal"))}
    if o.get("scale") is not None:
        kwargs["scale"] = float(o["scale"])
    if q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        kwargs["enable_gqa"] = True
    with torch.no_grad():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    return {"output": backends.torch_to_numpy(out)}


# ------------------------------------------------------------------------------ torch MHA


def torch_mha(exp: Expected) -> dict[str, np.ndarray]:
    """The ``torch.MHA`` peer: ``output (..., heads, q_len, head_dim)`` and per-head
    ``output_weights (..., heads, q_len, kv_len)`` from ``torch.nn.MultiheadAttention`` called
    with ``need_weights=True`` (its default)."""
    return multihead_attention(exp, need_weights=True)


def torch_mha_sdpa(exp: Expected) -> dict[str, np.ndarray]:
    """The ``torch.MHA[sdpa]`` peer: ``output (..., heads, q_len, head_dim)`` from
    ``torch.nn.MultiheadAttention`` called with ``need_weights=False`` (through SDPA)."""
    return multihead_attention(exp, need_weights=False)


def multihead_attention(exp: Expected, *, need_weights: bool) -> dict[str, np.ndarray]:
    """``torch.nn.MultiheadAttention`` with identity projections on the case; ``output`` and,
    with ``need_weights``, per-head ``output_weights``."""
    import torch

    a, o = sdpa_case(exp, "torch.nn.MultiheadAttention")
    need(o.get("window") is None, "torch.nn.MultiheadAttention has no sliding window")
    need(o.get("scale") is None, "torch.nn.MultiheadAttention always scales by head_dim ** -0.5")
    q, k, v = (np.asarray(a[n]) for n in ("query", "key", "value"))
    need(v.shape[-1] == q.shape[-1], "torch.nn.MultiheadAttention needs v_dim == head_dim")
    if q.ndim == 2:
        q, k, v = q[None], k[None], v[None]  # one head
    need(q.ndim in (3, 4), "torch.nn.MultiheadAttention takes at most one batch axis")
    heads, q_len, head_dim = q.shape[-3:]
    kv_len = k.shape[-2]
    if k.shape[-3] != heads:  # grouped-query: repeat each key/value head
        k, v = (np.repeat(x, heads // k.shape[-3], axis=-3) for x in (k, v))
    embed = heads * head_dim

    def merge(x: np.ndarray) -> np.ndarray:  # (..., heads, T, D) → (..., T, heads·D)
        x = np.swapaxes(x, -2, -3)
        return x.reshape(x.shape[:-2] + (embed,))

    allowed = np.ones(q.shape[:-3] + (heads, q_len, kv_len), bool)
    if a.get("mask") is not None:
        mask = np.asarray(a["mask"], bool)
        allowed = allowed & (mask if mask.ndim >= 2 else mask[None])
    if o.get("is_causal"):  # the usual triu "subsequent" mask: top-left
        allowed = allowed & ~np.triu(np.ones((q_len, kv_len), bool), 1)
    attn_mask: Any = None
    if a.get("bias") is not None or not allowed.all():
        flat = allowed.reshape((-1, q_len, kv_len))  # (batch·heads, q_len, kv_len)
        if a.get("bias") is not None:
            bias = np.broadcast_to(np.asarray(a["bias"], np.float64), allowed.shape)
            float_mask = np.where(allowed, bias, -np.inf).reshape(flat.shape)
            attn_mask = backends.torch_asarray(float_mask.astype(a["query"].dtype))
        else:
            attn_mask = torch.from_numpy(~flat)  # MultiheadAttention: True = masked out
        if q.ndim == 3:
            attn_mask = attn_mask if attn_mask.shape[0] == heads else attn_mask[0]
    dtype = backends.torch_asarray(a["query"][..., :1]).dtype
    mha = torch.nn.MultiheadAttention(embed, heads, bias=False, batch_first=True, dtype=dtype)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.eye(embed, dtype=dtype).repeat(3, 1))
        mha.out_proj.weight.copy_(torch.eye(embed, dtype=dtype))
        mha.eval()
        t = backends.torch_asarray
        qm, km, vm = t(merge(q)), t(merge(k)), t(merge(v))
        out, weights = mha(qm, km, vm, attn_mask=attn_mask, need_weights=need_weights,
                           average_attn_weights=False)
    out_np = backends.torch_to_numpy(out)  # (..., q_len, heads·D)
    out_np = np.swapaxes(out_np.reshape(out_np.shape[:-1] + (heads, head_dim)), -2, -3)
    result = {"output": out_np.reshape(exp.values["output"].shape)}
    if need_weights:
        result["output_weights"] = backends.torch_to_numpy(weights).reshape(
            exp.values["output_weights"].shape)
    return result
