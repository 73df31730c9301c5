"""transformers' rotary embeddings as peers: the frequencies of ``ROPE_INIT_FUNCTIONS`` and each
model family's ``apply_rotary_pos_emb``, on the rotary cases (``cases.rotary``).

Each column builds its family's rotary module from a config (``rope_parameters``: the case's
theta and scaling dict; ``max_position_embeddings``), calls ``forward(x, position_ids)`` for
cos and sin as the model does (float32 angles, times the method's attention scaling, cast to
x's dtype), then the family's apply function:

======================================  ==========================================================
``transformers.rope[llama]``            ``LlamaRotaryEmbedding`` and Llama's
                                        ``apply_rotary_pos_emb`` (rotate_half: half pairs; every
                                        dim rotated)
``transformers.rope[deepseek_v3]``      ``DeepseekV3RotaryEmbedding`` (``qk_rope_head_dim`` =
                                        rotary_dim) and ``apply_rotary_pos_emb_interleave``
                                        (interleaved pairs); it returns the rotated dims
                                        de-interleaved (half order): the adapter re-interleaves
                                        them (``reinterleave``) and appends the pass-through
                                        dims after the rotated ones, as the spec orders them
``transformers.rope[gpt_neox]``         ``GPTNeoXRotaryEmbedding`` (``partial_rotary_factor`` =
                                        rotary_dim / head_dim) and GPT-NeoX's
                                        ``apply_rotary_pos_emb`` (half pairs on the first
                                        rotary_dim dims)
======================================  ==========================================================

Each returns ``rotary_output`` and the module's frequencies after the forward pass
(``rope_inv_freq``: its ``inv_freq`` buffer, float32, dynamic and LongRoPE updated for the
positions; ``rope_attention_factor``: its ``attention_scaling``). The gradient
(``rotary_grad_x``) is not a transformers function: not compared. A case of the other layout,
or (Llama) with partial rotary, is n/a. transformers computes the angles in float32 whatever
the model's dtype, and rounds cos and sin to x's dtype: ``spec.KNOWN_DIFFERENCES`` says where
that shows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..cases import rotary as rotary_cases
from ..cases.expected import Expected
from ..running import backends
from .inputs import need


def reinterleave(half: np.ndarray, rotary_dim: int) -> np.ndarray:
    """``(..., head_dim)`` with the first ``rotary_dim`` dims in half order (pair i at ``(i, i +
    r/2)``) → interleaved order (pair i at ``(2i, 2i+1)``); the other dims unchanged."""
    out = np.array(half)
    r = rotary_dim
    out[..., 0:r:2], out[..., 1:r:2] = half[..., : r // 2], half[..., r // 2: r]
    return out


def _rope_parameters(exp: Expected) -> dict[str, Any]:
    o = exp.data.options
    scaling = dict(o.get("scaling") or {})
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    return {"rope_type": kind, "rope_theta": float(o.get("theta", 10000.0)), **scaling}


def _max_positions(exp: Expected) -> int:
    o = exp.data.options
    scaling = o.get("scaling") or {}
    return int(o.get("max_position_embeddings") or
               scaling.get("original_max_position_embeddings") or 2048)


def _batched(exp: Expected) -> tuple[np.ndarray, np.ndarray]:
    """x as ``(batch, heads, seq, head_dim)`` and position_ids ``(batch, seq)``."""
    x = np.asarray(exp.data.arrays["x"])
    positions = np.asarray(exp.data.arrays["positions"], dtype=np.int64)
    need(x.ndim in (3, 4), "transformers' rotary modules take (batch, heads, seq, head_dim)")
    x4 = x if x.ndim == 4 else x[None]
    position_ids = np.broadcast_to(positions, (x4.shape[0], x4.shape[2]))
    return x4, np.ascontiguousarray(position_ids)


def _run(exp: Expected, peer: str, rotary: Any, apply: Any, rotary_dim: int,
         deinterleaved: bool = False) -> dict[str, np.ndarray]:
    """cos, sin of ``rotary.forward``, then ``apply(x, cos, sin)`` (every dim of x in, every dim
    out); the steps as NumPy."""
    import torch

    x4, position_ids = _batched(exp)
    t = backends.torch_asarray
    x = t(x4)
    with torch.no_grad():
        cos, sin = rotary(x, torch.as_tensor(position_ids))
        out = backends.torch_to_numpy(apply(x, cos, sin))
    if deinterleaved:
        out = reinterleave(out, rotary_dim)
    inv_freq = backends.torch_to_numpy(rotary.inv_freq).astype(np.float64)
    return {"rotary_output": out.reshape(exp.data.arrays["x"].shape),
            "rope_inv_freq": inv_freq,
            "rope_attention_factor": np.array(float(rotary.attention_scaling))}


def _rotated_first(apply: Any, x: Any, cos: Any, sin: Any, rotary_dim: int) -> Any:
    """DeepSeek's MLA rotates a tensor of its own (``q_rot``, ``k_rot``): the first rotary_dim
    dims through ``apply``, the rest appended as they are (the spec's order)."""
    import torch

    return torch.cat([apply(x[..., :rotary_dim], x[..., :rotary_dim], cos, sin)[0],
                      x[..., rotary_dim:]], dim=-1)


def _rotary_case(exp: Expected, peer: str, layout: str) -> int:
    need(exp.kind == "rotary", f"{peer} compares the rotary embedding: rotary cases only")
    need(exp.data.options.get("layout", "half") == layout,
         f"{peer} rotates {layout} pairs only")
    return rotary_cases.rotary_dim_of(exp.data)


def transformers_llama_rope(exp: Expected) -> dict[str, np.ndarray]:
    """``transformers.rope[llama]``: LlamaRotaryEmbedding + Llama's apply_rotary_pos_emb."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as apply

    peer = "transformers Llama apply_rotary_pos_emb"
    r = _rotary_case(exp, peer, "half")
    heads, head_dim = exp.data.arrays["x"].shape[-3], exp.data.arrays["x"].shape[-1]
    need(r == head_dim, f"{peer} rotates every dim (partial rotary: transformers.rope[gpt_neox])")
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                         head_dim=head_dim, max_position_embeddings=_max_positions(exp),
                         rope_parameters=_rope_parameters(exp))
    return _run(exp, peer, LlamaRotaryEmbedding(config),
                lambda x, cos, sin: apply(x, x, cos, sin)[0], r)


def transformers_deepseek_v3_rope(exp: Expected) -> dict[str, np.ndarray]:
    """``transformers.rope[deepseek_v3]``: DeepseekV3RotaryEmbedding +
    apply_rotary_pos_emb_interleave, re-interleaved."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        apply_rotary_pos_emb_interleave,
    )

    peer = "transformers DeepSeek-V3 apply_rotary_pos_emb_interleave"
    r = _rotary_case(exp, peer, "interleaved")
    heads, head_dim = exp.data.arrays["x"].shape[-3], exp.data.arrays["x"].shape[-1]
    config = DeepseekV3Config(hidden_size=heads * head_dim, num_attention_heads=heads,
                              num_key_value_heads=heads, qk_rope_head_dim=r,
                              qk_nope_head_dim=head_dim - r, v_head_dim=head_dim,
                              max_position_embeddings=_max_positions(exp), rope_interleave=True,
                              rope_parameters=_rope_parameters(exp))
    return _run(exp, peer, DeepseekV3RotaryEmbedding(config),
                lambda x, cos, sin: _rotated_first(apply_rotary_pos_emb_interleave, x, cos, sin,
                                                   r), r, deinterleaved=True)


def transformers_gpt_neox_rope(exp: Expected) -> dict[str, np.ndarray]:
    """``transformers.rope[gpt_neox]``: GPTNeoXRotaryEmbedding + GPT-NeoX's
    apply_rotary_pos_emb (partial rotary)."""
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as apply

    peer = "transformers GPT-NeoX apply_rotary_pos_emb"
    r = _rotary_case(exp, peer, "half")
    heads, head_dim = exp.data.arrays["x"].shape[-3], exp.data.arrays["x"].shape[-1]
    params = {**_rope_parameters(exp), "partial_rotary_factor": r / head_dim}
    config = GPTNeoXConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                           max_position_embeddings=_max_positions(exp), rope_parameters=params)
    return _run(exp, peer, GPTNeoXRotaryEmbedding(config),
                lambda x, cos, sin: apply(x, x, cos, sin)[0], r)


__all__ = ["reinterleave", "transformers_deepseek_v3_rope", "transformers_gpt_neox_rope",
           "transformers_llama_rope"]
