"""Interoperation with ``torch.nn.MultiheadAttention``."""

from __future__ import annotations

import numpy as np
from torch import nn

from ._arrays import _to_numpy


def weights_from_torch_multihead(mha: nn.MultiheadAttention) -> dict[str, np.ndarray]:
    """Weights of a ``torch.nn.MultiheadAttention`` in this project's naming.

    The dict loads into any backend's ``MultiHeadAttention(embed_dim, num_heads,
    bias=mha.in_proj_bias is not None)`` by ``load_weights``: ``W_query``, ``W_key``,
    ``W_value``, ``W_out`` are ``(d_in, d_out)`` for ``x @ W`` (torch stores ``(out, in)``, so
    they are transposed), ``b_query``, ``b_key``, ``b_value``, ``b_out`` are ``(d_out,)`` (absent
    when the module has no bias). Heads split the projections the same way (head ``h`` owns
    features ``h·head_dim … (h+1)·head_dim - 1``), and the scale is ``head_dim ** -0.5`` in both.

    Two differences remain when the outputs are compared:

    * Mask polarity. ``MultiheadAttention``'s boolean ``key_padding_mask`` ``(batch, kv_len)``
      and ``attn_mask`` ``(q_len, kv_len)`` mean True = *masked out*; this project's ``mask``
      means True = *may attend*. Pass ``mask=~key_padding_mask[:, None, None, :]`` (and
      ``~attn_mask`` for an attention mask). Float (additive) masks are not converted.
    * Fully masked rows. ``MultiheadAttention`` returns NaN for a query that may attend no key
      (torch 2.13 on the CPU: with ``need_weights=True``, its default, and on its inference
      fast path; 0 only when it happens to reach SDPA); this project returns exactly 0 there.

    Args:
      mha: a ``torch.nn.MultiheadAttention`` with ``kdim == vdim == embed_dim`` and neither
        ``add_bias_kv`` nor ``add_zero_attn`` (either ``batch_first`` works: the weights are
        the same).

    Returns:
      dict name → NumPy array (copies, in the module's dtype).
    """
    fn = "weights_from_torch_multihead"
    if mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError(f"{fn}: add_bias_kv and add_zero_attn have no equivalent here")
    if not mha._qkv_same_embed_dim:
        raise ValueError(
            f"{fn}: kdim and vdim must equal embed_dim; "
            f"got embed_dim={mha.embed_dim}, kdim={mha.kdim}, vdim={mha.vdim}"
        )
    w_query, w_key, w_value = mha.in_proj_weight.chunk(3, dim=0)  # each (out, in)
    weights = {
        "W_query": _to_numpy(w_query.T),
        "W_key": _to_numpy(w_key.T),
        "W_value": _to_numpy(w_value.T),
        "W_out": _to_numpy(mha.out_proj.weight.T),
    }
    if mha.in_proj_bias is not None:
        b_query, b_key, b_value = mha.in_proj_bias.chunk(3)
        weights["b_query"] = _to_numpy(b_query)
        weights["b_key"] = _to_numpy(b_key)
        weights["b_value"] = _to_numpy(b_value)
        weights["b_out"] = _to_numpy(mha.out_proj.bias)
    return weights
