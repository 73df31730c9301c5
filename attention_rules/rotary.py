"""The rules of the rotary position embedding (RoPE): arguments, frequencies and ``RoPE``.

Every backend's ``rotary.py`` (``rotary_embedding``, ``rotary_embedding_vjp``,
``rope_frequencies``, ``permute_for_rotary_layout``) validates here, so the three raise the
same exception type with the same message for the same bad input:

* ``rotary_arguments``: x, positions, theta, layout, rotary_dim, inv_freq, attention_factor
  (and grad_output for the VJP), seen as ``(shape, dtype name)`` and Python numbers; it
  returns the normalised facts (``RotaryArguments``);
* ``frequencies``: the inverse frequencies of ``rope_frequencies`` (and the default ones of
  ``rotary_embedding``) for every scaling method of transformers' ``ROPE_INIT_FUNCTIONS``,
  with transformers' parameter names and defaults;
* ``layout_rows``: the row order of ``permute_for_rotary_layout``;
* ``RoPE``: a frozen, hashable description of a model's rotary embedding, validated once.

The scaling formulas live here, not in the backends: they are scalar math on ``head_dim / 2``
numbers (one per rotated pair), written in Python floats (IEEE float64), and each backend only
turns the list into its array (float64 in numpy_attn and torch_attn, float64 or float32 in
jax_attn). So the three return the same frequencies to the last bit, no backend carries a
copy of a formula, and this package stays free of array code. The rotation itself (array
work) is each backend's.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
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

#: The two pairings of rotated dims: (i, i + r/2) and (2i, 2i + 1).
LAYOUTS = ("half", "interleaved")
#: The scaling methods of ``rope_frequencies`` (transformers' names; "default" is no scaling).
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
#: The keys each method needs in ``scaling`` (transformers' required keys, less those that
#: have a fallback here: original_max_position_embeddings falls back to the argument
#: max_position_embeddings, as transformers' standardize_rope_params does).
REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": (),
    "longrope": ("short_factor", "long_factor"),
}
#: YaRN's defaults (transformers: ``beta_fast or 32``, ``beta_slow or 1``, ``truncate=True``).
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0


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


def _positive_finite(fn: str, name: str, value: object) -> float:
    """A finite number > 0 (ValueError otherwise; a bool is not a number here)."""
    try:
        number = math.nan if isinstance(value, bool) else float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{fn}: {name} must be a finite number > 0; got {name}={value!r}"
                         f"{traced_hint(name, value)}")
    return number


def check_theta(fn: str, theta: object) -> float:
    """The base ``theta`` of the frequencies: a finite number > 0."""
    return _positive_finite(fn, "theta", theta)


def check_attention_factor(fn: str, attention_factor: object) -> float:
    """The factor of cos and sin (YaRN's / LongRoPE's attention scaling): finite, > 0."""
    return _positive_finite(fn, "attention_factor", attention_factor)


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
# Frequencies: the default and transformers' scaling methods, in Python floats
# ------------------------------------------------------------------------------------------


def default_inv_freq(dim: int, theta: float) -> list[float]:
    """``inv_freq[i] = 1 / theta ** (2 i / dim)``, ``i < dim / 2`` (transformers' default)."""
    return [1.0 / theta ** (2 * i / dim) for i in range(dim // 2)]


def _scaling_error(fn: str, message: str, scaling: object) -> ValueError:
    return ValueError(f"{fn}: scaling {message} (known rope_type values: "
                      f"{', '.join(ROPE_TYPES)}); got scaling={scaling!r}")


def rope_type(fn: str, scaling: object) -> str:
    """The method of ``scaling`` (None → "default"): its "rope_type" key, or the legacy "type",
    or "default" when neither is there (transformers' standardize_rope_params)."""
    if scaling is None:
        return "default"
    if not isinstance(scaling, Mapping):
        raise TypeError(f"{fn}: scaling must be None or a dict in transformers' rope_scaling / "
                        f"rope_parameters format; got type(scaling)={type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise _scaling_error(fn, f"has an unknown rope_type {kind!r}", scaling)
    missing = [k for k in REQUIRED_KEYS[kind] if scaling.get(k) is None]
    if missing:
        raise _scaling_error(fn, f"with rope_type {kind!r} needs the key(s) "
                             f"{', '.join(map(repr, missing))}", scaling)
    return kind


def _number(fn: str, scaling: Mapping, key: str, *, positive: bool = True) -> float:
    """``scaling[key]`` as a finite float (> 0 unless ``positive=False``)."""
    value = scaling[key]
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = ok and math.isfinite(float(value)) and (float(value) > 0 or not positive)
    if not ok:
        bound = " > 0" if positive else ""
        raise _scaling_error(fn, f"key {key!r} must be a finite number{bound}, got "
                             f"{value!r}", scaling)
    return float(value)


def _length(fn: str, name: str, value: object, minimum: int) -> int:
    if not is_int(value) or int(value) < minimum:  # type: ignore[arg-type]
        raise ValueError(f"{fn}: {name} must be an int >= {minimum}; got {name}={value!r}")
    return int(value)  # type: ignore[arg-type]


def _original_max(fn: str, scaling: Mapping, max_position_embeddings: int | None) -> int:
    """``original_max_position_embeddings`` of the dict, else ``max_position_embeddings``."""
    value = scaling.get("original_max_position_embeddings")
    if value is None:
        value = max_position_embeddings
    if value is None:
        raise _scaling_error(fn, f"with rope_type {scaling.get('rope_type', scaling.get('type'))!r}"
                             " needs 'original_max_position_embeddings' (or the argument "
                             "max_position_embeddings)", scaling)
    if not is_int(value) or int(value) <= 0:  # type: ignore[arg-type]
        raise _scaling_error(fn, "key 'original_max_position_embeddings' must be an int > 0, "
                             f"got {value!r}", scaling)
    return int(value)  # type: ignore[arg-type]


def _factor_or_ratio(fn: str, scaling: Mapping, original: int,
                     max_position_embeddings: int | None) -> float:
    """``factor``, or ``max_position_embeddings / original_max_position_embeddings``."""
    if scaling.get("factor") is not None:
        return _number(fn, scaling, "factor")
    if max_position_embeddings is None:
        raise _scaling_error(fn, "without 'factor' needs the argument max_position_embeddings "
                             "(factor = max_position_embeddings / "
                             "original_max_position_embeddings)", scaling)
    return max_position_embeddings / original


def _linear(dim: int, base: float, scaling: Mapping, fn: str) -> list[float]:
    factor = _number(fn, scaling, "factor")
    return [f / factor for f in default_inv_freq(dim, base)]


def _dynamic(dim: int, base: float, scaling: Mapping, fn: str, seq_len: int | None,
             max_position_embeddings: int | None) -> list[float]:
    factor = _number(fn, scaling, "factor")
    if max_position_embeddings is None:
        raise _scaling_error(fn, "with rope_type 'dynamic' needs the argument "
                             "max_position_embeddings", scaling)
    if dim <= 2:
        raise ValueError(f"{fn}: dynamic scaling needs head_dim > 2 (its exponent is head_dim / "
                         f"(head_dim - 2)); got head_dim={dim}")
    seq = max_position_embeddings if seq_len is None else max(seq_len, max_position_embeddings)
    base = base * ((factor * seq / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return default_inv_freq(dim, base)


def _llama3(dim: int, base: float, scaling: Mapping, fn: str,
            max_position_embeddings: int | None) -> list[float]:
    factor = _number(fn, scaling, "factor")
    low = _number(fn, scaling, "low_freq_factor")
    high = _number(fn, scaling, "high_freq_factor")
    if high <= low:
        raise _scaling_error(fn, f"needs high_freq_factor > low_freq_factor, got {high!r} <= "
                             f"{low!r}", scaling)
    old_context = _original_max(fn, scaling, max_position_embeddings)
    low_wavelen, high_wavelen = old_context / low, old_context / high
    result = []
    for inv in default_inv_freq(dim, base):
        wavelen = 2 * math.pi / inv
        if wavelen < high_wavelen:  # high frequency: kept
            result.append(inv)
        elif wavelen > low_wavelen:  # low frequency: divided by factor
            result.append(inv / factor)
        else:  # in between: interpolated
            smooth = (old_context / wavelen - low) / (high - low)
            result.append((1 - smooth) * inv / factor + smooth * inv)
    return result


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 · mscale · ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, scaling: Mapping, fn: str,
          max_position_embeddings: int | None) -> tuple[list[float], float]:
    original = _original_max(fn, scaling, max_position_embeddings)
    factor = _factor_or_ratio(fn, scaling, original, max_position_embeddings)
    if scaling.get("attention_factor") is not None:
        attention = _number(fn, scaling, "attention_factor")
    elif scaling.get("mscale") and scaling.get("mscale_all_dim"):
        attention = (yarn_mscale(factor, _number(fn, scaling, "mscale"))
                     / yarn_mscale(factor, _number(fn, scaling, "mscale_all_dim")))
    else:
        attention = yarn_mscale(factor)
    beta_fast = _number(fn, scaling, "beta_fast") if scaling.get("beta_fast") else YARN_BETA_FAST
    beta_slow = _number(fn, scaling, "beta_slow") if scaling.get("beta_slow") else YARN_BETA_SLOW
    truncate = scaling.get("truncate", True)

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: prevents a division by zero
    result = []
    for i, inv in enumerate(default_inv_freq(dim, base)):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrapolation = 1 - ramp  # 1: the frequency kept; 0: divided by factor
        result.append(inv / factor * (1 - extrapolation) + inv * extrapolation)
    return result, attention


def _longrope(dim: int, base: float, scaling: Mapping, fn: str, seq_len: int | None,
              max_position_embeddings: int | None) -> tuple[list[float], float]:
    original = _original_max(fn, scaling, max_position_embeddings)
    factor = _factor_or_ratio(fn, scaling, original, max_position_embeddings)
    if scaling.get("attention_factor") is not None:
        attention = _number(fn, scaling, "attention_factor")
    elif factor <= 1.0:
        attention = 1.0
    else:
        attention = math.sqrt(1 + math.log(factor) / math.log(original))
    key = "long_factor" if seq_len and seq_len > original else "short_factor"
    ext = scaling[key]
    ok = isinstance(ext, (list, tuple)) and len(ext) == dim // 2 and all(
        isinstance(e, numbers.Real) and not isinstance(e, bool) and math.isfinite(float(e))
        and float(e) > 0 for e in ext)
    if not ok:
        raise _scaling_error(fn, f"key {key!r} must be a list of head_dim // 2 = {dim // 2} "
                             f"finite numbers > 0, got {ext!r}", scaling)
    return [1.0 / (float(e) * base ** (2 * i / dim)) for i, e in enumerate(ext)], attention


def frequencies(
    fn: str,
    head_dim: object,
    *,
    theta: object,
    scaling: object,
    seq_len: object,
    max_position_embeddings: object,
) -> tuple[list[float], float]:
    """``rope_frequencies``' values: ``(inv_freq as head_dim // 2 Python floats,
    attention_factor)``. ``head_dim`` is the number of rotated dims; ``scaling``'s
    "rope_theta", when present, is the base (transformers' rope_parameters carry it), else
    ``theta``; its "partial_rotary_factor" is not applied (pass the rotated dims)."""
    if not (is_int(head_dim) and int(head_dim) > 0 and int(head_dim) % 2 == 0):  # type: ignore
        raise ValueError(f"{fn}: head_dim must be an even int > 0 (the rotated dims: head_dim "
                         f"x partial_rotary_factor); got head_dim={head_dim!r}")
    dim = int(head_dim)  # type: ignore[arg-type]
    kind = rope_type(fn, scaling)
    if seq_len is not None:
        seq_len = _length(fn, "seq_len", seq_len, 0)
    if max_position_embeddings is not None:
        max_position_embeddings = _length(fn, "max_position_embeddings",
                                          max_position_embeddings, 1)
    if scaling is not None and scaling.get("rope_theta") is not None:  # type: ignore[union-attr]
        base = _number(fn, scaling, "rope_theta")  # type: ignore[arg-type]
    else:
        base = check_theta(fn, theta)
    if kind == "default":
        return default_inv_freq(dim, base), 1.0
    if kind == "linear":
        return _linear(dim, base, scaling, fn), 1.0  # type: ignore[arg-type]
    if kind == "dynamic":
        return _dynamic(dim, base, scaling, fn, seq_len,  # type: ignore[arg-type]
                        max_position_embeddings), 1.0  # type: ignore[arg-type]
    if kind == "llama3":
        return _llama3(dim, base, scaling, fn, max_position_embeddings), 1.0  # type: ignore
    if kind == "yarn":
        return _yarn(dim, base, scaling, fn, max_position_embeddings)  # type: ignore[arg-type]
    return _longrope(dim, base, scaling, fn, seq_len,  # type: ignore[arg-type]
                     max_position_embeddings)  # type: ignore[arg-type]


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
            object.__setattr__(self, "max_position_embeddings", _length(
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
