"""The rules of multi-head latent attention (MLA): sizes, the softmax scale, the weights' shapes
and the latent cache.

Every backend's ``latent_attention.py`` (``MultiHeadLatentAttention``) validates here, so the
three raise the same exception type with the same message for the same bad input, and compute
the same softmax scale (a Python float) and the same weight shapes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

from .checks import check_flag, check_int
from .rope_scaling import rope_type, yarn_mscale


class LatentSizes(NamedTuple):
    """The sizes of an MLA layer, validated (``latent_sizes``)."""

    d_model: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        """Query/key dims per head in the naive form: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Dims per token of the latent cache: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def latent_sizes(fn: str, d_model: object, num_heads: object, q_lora_rank: object,
                 kv_lora_rank: object, qk_nope_head_dim: object, qk_rope_head_dim: object,
                 v_head_dim: object) -> LatentSizes:
    """Every size an int >= 1 (``q_lora_rank``: None or an int >= 1; ``qk_rope_head_dim``
    even, the rotated pairs); ValueError naming the argument otherwise."""
    sizes = [check_int(fn, name, value, minimum=1) for name, value in (
        ("d_model", d_model), ("num_heads", num_heads), ("kv_lora_rank", kv_lora_rank),
        ("qk_nope_head_dim", qk_nope_head_dim), ("qk_rope_head_dim", qk_rope_head_dim),
        ("v_head_dim", v_head_dim))]
    q_rank = None if q_lora_rank is None else check_int(fn, "q_lora_rank", q_lora_rank, 1)
    if sizes[4] % 2:
        raise ValueError(f"{fn}: qk_rope_head_dim must be even (pairs are rotated); "
                         f"got qk_rope_head_dim={qk_rope_head_dim!r}")
    return LatentSizes(sizes[0], sizes[1], q_rank, *sizes[2:])


def check_rms_norm_eps(fn: str, eps: object) -> float:
    """``rms_norm_eps``: a finite number >= 0 (ValueError)."""
    try:
        value = float(eps)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(eps, bool) or not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{fn}: rms_norm_eps must be a finite number >= 0; "
                         f"got rms_norm_eps={eps!r}")
    return value


def check_rope_dims(fn: str, rotary_dim: int | None, qk_rope_head_dim: int) -> None:
    """The rope rotates all of ``q_pe`` and ``k_pe``: its ``rotary_dim`` is None or
    ``qk_rope_head_dim`` (ValueError naming both)."""
    if rotary_dim is not None and rotary_dim != qk_rope_head_dim:
        raise ValueError(f"{fn}: rope.rotary_dim must be None or qk_rope_head_dim (the rope "
                         f"dims are decoupled and rotated whole); got rotary_dim={rotary_dim}, "
                         f"qk_rope_head_dim={qk_rope_head_dim}")


def softmax_scale(sizes: LatentSizes, scaling: Mapping | None) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale ** 2`` with ``mscale = yarn_mscale(factor,
    mscale_all_dim)`` when the rope's scaling is not the default one and has a nonzero
    ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``, DeepSeek-V2/V3's reference)."""
    scale = sizes.qk_head_dim ** -0.5
    if scaling is None or rope_type("MultiHeadLatentAttention", scaling) == "default":
        return scale
    mscale_all_dim = float(scaling.get("mscale_all_dim", 0) or 0)
    if mscale_all_dim:
        mscale = yarn_mscale(float(scaling["factor"]), mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


def weight_shapes(sizes: LatentSizes,
                  attention_bias: bool = False) -> dict[str, tuple[int, ...]]:
    """Each weight's shape in transformers' DeepSeek-V3 names and ``state_dict`` order,
    ``(out_features, in_features)`` for the projections (``nn.Linear.weight``), ``(dim,)`` for
    the RMSNorm gains and, with ``attention_bias``, the biases ``(out_features,)`` of the
    projections transformers gives one (``config.attention_bias``): ``q_a_proj`` (with a
    ``q_lora_rank``), ``kv_a_proj_with_mqa`` and ``o_proj``; never ``q_proj``, ``q_b_proj`` or
    ``kv_b_proj``."""
    h, d = sizes.num_heads, sizes.d_model
    shapes: dict[str, tuple[int, ...]] = {}
    if sizes.q_lora_rank is None:
        shapes["q_proj.weight"] = (h * sizes.qk_head_dim, d)
    else:
        shapes["q_a_proj.weight"] = (sizes.q_lora_rank, d)
        if attention_bias:
            shapes["q_a_proj.bias"] = (sizes.q_lora_rank,)
        shapes["q_a_layernorm.weight"] = (sizes.q_lora_rank,)
        shapes["q_b_proj.weight"] = (h * sizes.qk_head_dim, sizes.q_lora_rank)
    shapes["kv_a_proj_with_mqa.weight"] = (sizes.latent_dim, d)
    if attention_bias:
        shapes["kv_a_proj_with_mqa.bias"] = (sizes.latent_dim,)
    shapes["kv_a_layernorm.weight"] = (sizes.kv_lora_rank,)
    shapes["kv_b_proj.weight"] = (h * (sizes.qk_nope_head_dim + sizes.v_head_dim),
                                  sizes.kv_lora_rank)
    shapes["o_proj.weight"] = (d, h * sizes.v_head_dim)
    if attention_bias:
        shapes["o_proj.bias"] = (d,)
    return shapes


def check_attention_bias(fn: str, attention_bias: object) -> bool:
    """``attention_bias``: a bool (TypeError naming it otherwise; ``check_flag``)."""
    return check_flag(fn, "attention_bias", attention_bias)


def check_input(fn: str, shape: tuple[int, ...], d_model: int) -> None:
    """``x (..., seq, d_model)`` (ValueError naming x's shape and d_model)."""
    if len(shape) < 2 or shape[-1] != d_model:
        raise ValueError(f"{fn}: x must be (..., seq, d_model) with d_model={d_model}; "
                         f"got x.shape={tuple(shape)}")


def check_latent_cache(fn: str, kv_heads: int, head_dim: int, v_dim: int,
                       sizes: LatentSizes) -> None:
    """A latent cache holds one kv head of ``kv_lora_rank + qk_rope_head_dim`` dims per token
    and no values (``v_dim`` 0): the values are the keys' first ``kv_lora_rank`` dims.
    ValueError naming the cache's sizes otherwise."""
    if (kv_heads, head_dim, v_dim) != (1, sizes.latent_dim, 0):
        raise ValueError(
            f"{fn}: cache must be a latent cache (kv_heads, head_dim, v_dim) = "
            f"(1, kv_lora_rank + qk_rope_head_dim, 0) = (1, {sizes.latent_dim}, 0); "
            f"got (kv_heads, head_dim, v_dim)=({kv_heads}, {head_dim}, {v_dim})")


def check_absorbed(fn: str, absorbed: object) -> bool:
    """``absorbed``: a bool (TypeError)."""
    if not isinstance(absorbed, bool):
        raise TypeError(f"{fn}: absorbed must be a bool; got absorbed={absorbed!r}")
    return absorbed
