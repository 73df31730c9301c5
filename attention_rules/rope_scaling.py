"""The frequencies of the rotary position embedding: the default ``theta ** (-2 i / dim)``
and transformers' scaling methods (``ROPE_INIT_FUNCTIONS``: linear, dynamic NTK, llama3, YaRN
with its attention factor, LongRoPE), with transformers' parameter names and defaults.

``frequencies`` gives ``rope_frequencies``' values in every backend (``rotary.py``) and the
modules' ``RoPE.frequencies``. The formulas live here, not in the backends: they are scalar
math on ``dim / 2`` numbers (one per rotated pair), written in Python floats (IEEE float64),
and each backend only turns the list into its array (float64 in numpy_attn and torch_attn,
float64 or float32 in jax_attn). So the three return the same frequencies to the last bit, no
backend carries a copy of a formula, and this package stays free of array code.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

from .checks import is_int, traced_hint

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


def positive_finite(fn: str, name: str, value: object) -> float:
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
    return positive_finite(fn, "theta", theta)


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


def check_length(fn: str, name: str, value: object, minimum: int) -> int:
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
        seq_len = check_length(fn, "seq_len", seq_len, 0)
    if max_position_embeddings is not None:
        max_position_embeddings = check_length(fn, "max_position_embeddings",
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
