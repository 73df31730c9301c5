"""The rules of the rotary position embedding (RoPE): arguments, the layouts and ``RoPE``.

Every backend's ``rotary.py`` (``rotary_embedding``, ``rotary_embedding_vjp``,
``rope_frequencies``, ``permute_for_rotary_layout``) validates here, so the three raise the
same exception type with the same message for the same bad input:

* ``rotary_arguments``: x, positions, theta, layout, rotary_dim, inv_freq, attention_factor
  (and grad_output for the VJP), seen as ``(shape, dtype name)`` and Python numbers; it
  returns the normalised facts (``RotaryArguments``);
* the frequencies of ``rope_frequencies`` (every scaling method of transformers'
  ``ROPE_INIT_FUNCTIONS``) are ``rope_scaling``'s;
* ``layout_rows``: the row order of ``permute_for_rotary_layout``;
* ``RoPE``: a frozen, hashable description of a model's rotary embedding, validated once.

The rotation itself (array work) is each backend's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

from .checks import (
    SUPPORTED_DTYPES,
    ArrayInfo,
    Shape,
    broadcast_shapes,
    check_float_inputs,
    check_grad_output,
    compute_dtype,
    is_int,
    traced_hint,
)
from .rope_scaling import check_length, check_theta, frequencies, positive_finite, rope_type

#: The two pairings of rotated dims: (i, i + r/2) and (2i, 2i + 1).
LAYOUTS = ("half", "interleaved")
class RotaryArguments(NamedTuple):
    """The validated, normalised facts of one ``rotary_embedding`` call."""

    dtype: str  # x's dtype
    compute: str  # float64 for float64 x, float32 otherwise
    head_dim: int
    rotary_dim: int  # even, 0 < rotary_dim <= head_dim
    layout: str  # "half" or "interleaved"
    heads_axis: bool  # x has >= 3 axes: positions get a heads axis (positions[..., None, :])
    theta: float
    attention_factor: float


# ------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------


def _is_int_dtype(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


def check_attention_factor(fn: str, attention_factor: object) -> float:
    """The factor of cos and sin (YaRN's / LongRoPE's attention scaling): finite, > 0."""
    return positive_finite(fn, "attention_factor", attention_factor)


def check_layout(fn: str, layout: object, name: str = "layout") -> str:
    """``"half"`` or ``"interleaved"`` (ValueError otherwise, naming both)."""
    if not (isinstance(layout, str) and layout in LAYOUTS):
        raise ValueError(f"{fn}: {name} must be 'half' (pairs (i, i + rotary_dim/2), "
                         f"transformers' rotate_half) or 'interleaved' (pairs (2i, 2i + 1), "
                         f"Meta's Llama code); got {name}={layout!r}")
    return layout


def check_rotary_dim(fn: str, rotary_dim: object, head_dim: int | None) -> int | None:
    """None (all of head_dim) or an even int with ``0 < rotary_dim <= head_dim``; returns the
    number of rotated dims (None only when both are None: ``RoPE`` without a head_dim)."""
    value = head_dim if rotary_dim is None else rotary_dim
    if value is None:
        return None
    ok = is_int(value) and int(value) > 0 and int(value) % 2 == 0  # type: ignore[arg-type]
    if ok and head_dim is not None:
        ok = int(value) <= head_dim  # type: ignore[arg-type]
    if not ok:
        limit = "" if head_dim is None else " <= head_dim"
        raise ValueError(
            f"{fn}: rotary_dim must be an even int with 0 < rotary_dim{limit} (None rotates "
            f"all of head_dim); got rotary_dim={rotary_dim!r}, head_dim={head_dim!r}"
            f"{traced_hint('rotary_dim', rotary_dim)}")
    return int(value)  # type: ignore[arg-type]


def check_positions(fn: str, positions: ArrayInfo, x_shape: Shape) -> bool:
    """Integer positions ``(..., seq)`` that broadcast to ``x.shape[:-1]`` once a heads axis is
    inserted (``positions[..., None, :]``) when x has >= 3 axes; for a 2-D x, ``(seq,)``.
    Returns whether the heads axis is inserted."""
    shape, dtype = positions
    if not _is_int_dtype(dtype):
        raise TypeError(f"{fn}: positions must be an integer array (token positions, negative "
                        f"allowed); got positions.dtype={dtype}")
    heads_axis = len(x_shape) >= 3
    target = tuple(x_shape[:-1])
    inserted = tuple(shape[:-1]) + (1,) + tuple(shape[-1:]) if heads_axis else tuple(shape)
    ok = len(shape) >= 1 and len(inserted) <= len(target)
    if ok:
        ok = broadcast_shapes(inserted, target) == target
    if not ok:
        rule = ("positions (..., seq) must broadcast to x.shape[:-1] once a heads axis is "
                "inserted (positions[..., None, :])" if heads_axis else
                "positions must be (seq,) for a 2-D x (seq, head_dim)")
        raise ValueError(f"{fn}: {rule}; got positions.shape={tuple(shape)}, "
                         f"x.shape={tuple(x_shape)}")
    return heads_axis


def check_inv_freq(fn: str, inv_freq: ArrayInfo | None, rotary_dim: int) -> None:
    """None, or a floating ``(rotary_dim // 2,)`` array."""
    if inv_freq is None:
        return
    shape, dtype = inv_freq
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: inv_freq must be float16, bfloat16, float32 or float64; got "
                        f"inv_freq.dtype={dtype}")
    if tuple(shape) != (rotary_dim // 2,):
        raise ValueError(f"{fn}: inv_freq must be (rotary_dim // 2,) = ({rotary_dim // 2},), "
                         f"one frequency per rotated pair; got inv_freq.shape={tuple(shape)}, "
                         f"rotary_dim={rotary_dim}")


def rotary_arguments(
    fn: str,
    x: ArrayInfo,
    positions: ArrayInfo,
    *,
    theta: object,
    layout: object,
    rotary_dim: object,
    inv_freq: ArrayInfo | None,
    attention_factor: object,
    grad_output: ArrayInfo | None = None,
) -> RotaryArguments:
    """The single validation of ``rotary_embedding`` and its VJP, in this order: x's dtype
    (TypeError) and rank (ValueError), positions' dtype (TypeError) and shape, layout,
    rotary_dim, inv_freq, theta, attention_factor (ValueError), then grad_output's dtype
    (TypeError) and shape (ValueError)."""
    x_shape, x_dtype = x
    check_float_inputs(fn, x=x_dtype)
    if len(x_shape) < 2:
        raise ValueError(f"{fn}: x must have at least 2 axes (..., seq, head_dim); got "
                         f"x.shape={tuple(x_shape)}")
    heads_axis = check_positions(fn, positions, x_shape)
    layout = check_layout(fn, layout)
    head_dim = int(x_shape[-1])
    rotary = check_rotary_dim(fn, rotary_dim, head_dim)
    assert rotary is not None
    check_inv_freq(fn, inv_freq, rotary)
    theta_value = check_theta(fn, theta)
    factor = check_attention_factor(fn, attention_factor)
    if grad_output is not None:
        check_float_inputs(fn, grad_output=grad_output[1])
        check_grad_output(fn, grad_output[0], x_shape)
    return RotaryArguments(x_dtype, compute_dtype(x_dtype), head_dim, rotary, layout,
                           heads_axis, theta_value, factor)


# ------------------------------------------------------------------------------------------
# The weight permutation between the layouts
# ------------------------------------------------------------------------------------------


def layout_rows(fn: str, shape: Shape, heads: object, to: object,
                rotary_dim: object) -> list[int]:
    """The rows of ``w`` (``(heads * head_dim, in_features)`` or ``(heads * head_dim,)``) in
    their new order: ``w_new = w[rows]``. to="half": row ``a · r/2 + i`` of a head takes row
    ``2 i + a`` (Meta interleaved → transformers half, ``w.view(heads, r/2, 2, in)
    .transpose(1, 2)``); to="interleaved": the inverse. Rows ``>= rotary_dim`` of each head stay."""
    to = check_layout(fn, to, "to")
    if not is_int(heads) or int(heads) <= 0:  # type: ignore[arg-type]
        raise ValueError(f"{fn}: heads must be an int > 0; got heads={heads!r}")
    heads = int(heads)  # type: ignore[arg-type]
    if len(shape) not in (1, 2) or shape[0] % heads:
        raise ValueError(f"{fn}: w must be (heads * head_dim, in_features) or a bias "
                         f"(heads * head_dim,), its first axis a multiple of heads; got "
                         f"w.shape={tuple(shape)}, heads={heads}")
    head_dim = shape[0] // heads
    rotary = check_rotary_dim(fn, rotary_dim, head_dim)
    assert rotary is not None
    half = rotary // 2
    within = list(range(head_dim))
    for a in range(2):
        for i in range(half):
            if to == "half":
                within[a * half + i] = 2 * i + a
            else:
                within[2 * i + a] = a * half + i
    return [h * head_dim + j for h in range(heads) for j in within]


# ------------------------------------------------------------------------------------------
# RoPE: a model's rotary embedding, as the modules take it
# ------------------------------------------------------------------------------------------


def _frozen(value: Any) -> Any:
    """A hashable copy of a scaling dict's value (lists → tuples, dicts → sorted items)."""
    if isinstance(value, Mapping):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class RoPE:
    """A model's rotary position embedding, for ``MultiHeadAttention(..., rope=RoPE(...))``.

    ``theta``: the base; ``layout``: "half" or "interleaved"; ``rotary_dim``: the rotated dims
    (None: all of head_dim; even); ``scaling``: None or a transformers rope_scaling /
    rope_parameters dict (copied; read ``rope.scaling`` as a dict); ``max_position_embeddings``:
    what dynamic / yarn / longrope read. Validated when made (the errors of
    ``rotary_embedding`` and ``rope_frequencies``, naming ``RoPE``); frozen and hashable (a
    static argument of ``jax.jit``).
    """

    theta: float = 10000.0
    layout: str = "half"
    rotary_dim: int | None = None
    scaling: dict | None = None
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        fn = "RoPE"
        object.__setattr__(self, "theta", check_theta(fn, self.theta))
        check_layout(fn, self.layout)
        object.__setattr__(self, "rotary_dim", check_rotary_dim(fn, self.rotary_dim, None))
        rope_type(fn, self.scaling)
        if self.scaling is not None:
            object.__setattr__(self, "scaling", dict(self.scaling))
        if self.max_position_embeddings is not None:
            object.__setattr__(self, "max_position_embeddings", check_length(
                fn, "max_position_embeddings", self.max_position_embeddings, 1))

    def __hash__(self) -> int:
        return hash((self.theta, self.layout, self.rotary_dim, _frozen(self.scaling),
                     self.max_position_embeddings))

    def frequencies(self, head_dim: int, seq_len: int | None = None) -> tuple[list[float], float]:
        """``(inv_freq, attention_factor)`` for heads of ``head_dim`` (the rotated dims are
        ``rotary_dim`` or all of head_dim), as Python floats: ``rope_frequencies``' values."""
        dim = check_rotary_dim("RoPE", self.rotary_dim, head_dim)
        return frequencies("RoPE", dim, theta=self.theta, scaling=self.scaling,
                           seq_len=seq_len, max_position_embeddings=self.max_position_embeddings)
