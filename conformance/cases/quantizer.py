"""The float64 quantiser of the quantised KV caches' cases (``cases.quantized``), written from
the spec's text (``spec.QUANTIZATION_SCHEMES``, ``spec.QUANTIZED_ROUNDING``), never from a
backend: the spec's float32 arithmetic emulated in float64 (``f32``: every operation of two
float32 numbers computed in float64 and rounded once to float32 is the IEEE float32 result),
rounding half to even written out (``round_half_even``) and clipping; fp8's cast takes
ml_dtypes as the truth of the rounding of one float32 to fp8, after this file's own
saturation. ``fp8_ordinals`` numbers the fp8 grid, so codes compare exactly.

``quantize`` takes the mistakes the diagnoses replay as arguments: another granularity for the
scales, no saturation, rounding half away from zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

#: Symmetric integer codes lie in [-QMAX, QMAX]; with zero points in [0, LEVELS].
QMAX = {"int8": 127, "int4": 7}
LEVELS = {"int8": 255, "int4": 15}
#: The largest finite fp8 values (e4m3fn, e5m2).
FP8_MAX = {"float8_e4m3": 448.0, "float8_e5m2": 57344.0}


def is_float8(q_dtype: str) -> bool:
    """fp8 codes."""
    return q_dtype.startswith("float8")


# ------------------------------------------------------------------------------ arithmetic


def f32(x: Any) -> np.ndarray:
    """Float64 values rounded once to float32 and back."""
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def round_half_even(r: np.ndarray) -> np.ndarray:
    """Round to the nearest integer, a tie to the even one (NaN stays NaN)."""
    low = np.floor(r)
    frac = r - low
    even = np.mod(low, 2) == 0
    return np.where(frac > 0.5, low + 1, np.where(frac < 0.5, low, np.where(even, low,
                                                                            low + 1)))


def round_half_away(r: np.ndarray) -> np.ndarray:
    """Round to the nearest integer, a tie away from zero (a mistake the diagnoses replay)."""
    return np.sign(r) * np.floor(np.abs(r) + 0.5)


def _ml_dtype(q_dtype: str) -> Any:
    import ml_dtypes

    return {"float8_e4m3": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}[q_dtype]


def fp8_grid(q_dtype: str) -> np.ndarray:
    """The non-negative finite values of the fp8 format, ascending (bits 0x00 upward)."""
    values = np.arange(128, dtype=np.uint8).view(_ml_dtype(q_dtype)).astype(np.float64)
    return values[np.isfinite(values)]


def fp8_cast(r: np.ndarray, q_dtype: str, ties_away: bool = False) -> np.ndarray:
    """float32 ratios cast to fp8 (round to nearest even: ml_dtypes; ``ties_away``: a tie to
    the neighbour farther from zero, replayed on the grid), as float64."""
    r = f32(r)
    if not ties_away:
        return r.astype(np.float32).astype(_ml_dtype(q_dtype)).astype(np.float64)
    grid = fp8_grid(q_dtype)
    mag = np.abs(r)
    i = np.clip(np.searchsorted(grid, mag, side="right") - 1, 0, len(grid) - 1)
    low, high = grid[i], grid[np.minimum(i + 1, len(grid) - 1)]
    pick = np.where(mag - low >= high - mag, high, low)
    nearest = r.astype(np.float32).astype(_ml_dtype(q_dtype)).astype(np.float64)
    out = np.sign(r) * pick
    return np.where(np.isfinite(r) & (mag <= grid[-1]), out, nearest)


def fp8_ordinals(values: Any, q_dtype: str) -> np.ndarray:
    """fp8 values as signed positions on the fp8 grid: ``±index`` of the magnitude, so
    neighbours differ by 1 (a value between two grid points gets a fraction; ±inf and NaN stay;
    ±0 is 0)."""
    v = np.asarray(values, dtype=np.float64)
    grid = fp8_grid(q_dtype)
    index = np.arange(len(grid), dtype=np.float64)
    mag = np.abs(v)
    top = grid[-1]
    beyond = (len(grid) - 1) + (mag - top) / (top - grid[-2])
    inside = np.interp(np.minimum(mag, top), grid, index)
    with np.errstate(invalid="ignore"):
        out = np.sign(v) * np.where(mag > top, beyond, inside)
    return np.where(np.isinf(v), v, out)


# ------------------------------------------------------------------------------ quantiser


def grouped(x32: np.ndarray, size: int) -> np.ndarray:
    """``(..., kv_heads, n, d)`` → ``(..., kv_heads, n, d // size, size)``."""
    return x32.reshape(x32.shape[:-1] + (x32.shape[-1] // size, size))


def _reduce(g: np.ndarray, over: str, fn: Callable[..., np.ndarray]) -> np.ndarray:
    """``fn`` over the elements sharing a scale, kept broadcastable to ``g (..., kv_heads, n,
    groups, size)``: ``group`` (the last axis), ``token`` (groups and size), ``head`` (every
    axis but kv_heads) or ``tensor`` (every axis)."""
    if g.size == 0:
        shape = list(g.shape)
        return np.zeros([1] * len(shape))
    nd = g.ndim
    axes = {"group": (nd - 1,), "token": (nd - 2, nd - 1),
            "head": tuple(a for a in range(nd) if a != nd - 4),
            "tensor": tuple(range(nd))}[over]
    return fn(g, axis=axes, keepdims=True)


def quantize(x: Any, scheme: dict[str, Any], *, granularity: str | None = None,
             saturate: bool = True, ties_away: bool = False,
             fp8_scale: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The spec's quantiser in float64: ``{"codes", "scales", "zero_points" (with zero points),
    "values"}``; codes float64 (fp8 codes as their values), scales (and zero points) float32
    values in the spec's shapes, values the dequantised float32 values (not yet rounded to the
    input dtype).

    Args:
      x: ``(..., kv_heads, n, head_dim)``.
      scheme: ``scheme_options``' dict.
      granularity: the scales computed over another granularity (``group``, ``token``, ``head``
        or ``tensor``), broadcast to the scheme's shapes: a mistake replayed.
      saturate: False: fp8 ratios cast without clipping (a mistake replayed).
      ties_away: round half away from zero (a mistake replayed).
      fp8_scale: a cache's calibrated fp8 scale (``()`` or ``(kv_heads,)``).
    """
    x32 = f32(x)
    q = scheme["dtype"]
    if is_float8(q):
        return _quantize_fp8(x32, scheme, granularity, saturate, ties_away, fp8_scale)
    size = x32.shape[-1] if scheme["granularity"] == "token" else scheme["group_size"]
    g = grouped(x32, size)  # (..., kv_heads, n, groups, size)
    over = granularity or "group"
    if scheme["zero_point"]:
        low = _reduce(g, over, np.min)
        spread = f32(_reduce(g, over, np.max) - low)
        scale = f32(spread / LEVELS[q])
        shifted = f32(g - low)
        lo_code, hi_code = 0, LEVELS[q]
    else:
        low = None
        scale = f32(_reduce(g, over, lambda a, **k: np.max(np.abs(a), **k)) / QMAX[q])
        shifted = g
        lo_code, hi_code = -QMAX[q], QMAX[q]
    scale = np.where(np.isfinite(scale), scale, np.nan)
    scale = np.broadcast_to(scale, g.shape[:-1] + (1,))
    usable = scale > 0
    with np.errstate(all="ignore"):
        ratio = np.where(usable, f32(shifted / np.where(usable, scale, 1.0)), 0.0)
    rounding = round_half_away if ties_away else round_half_even
    codes = np.clip(rounding(ratio), lo_code, hi_code)
    values = f32(codes * scale)
    out = {"codes": codes.reshape(x32.shape), "scales": scale[..., 0]}
    if low is not None:
        low = np.broadcast_to(low, scale.shape)
        values = f32(values + low)
        out["zero_points"] = low[..., 0]
    out["values"] = values.reshape(x32.shape)
    return out


def _quantize_fp8(x32: np.ndarray, scheme: dict[str, Any], granularity: str | None,
                  saturate: bool, ties_away: bool,
                  fp8_scale: np.ndarray | None) -> dict[str, np.ndarray]:
    q, fmax = scheme["dtype"], FP8_MAX[scheme["dtype"]]
    g = x32[..., None, :]  # (..., kv_heads, n, 1, head_dim)
    per_head = scheme["granularity"] == "head"
    if fp8_scale is not None:
        scale = np.asarray(fp8_scale, np.float64)
    elif scheme["scale"] is not None:
        scale = f32(np.asarray(scheme["scale"], np.float64))
    else:
        amax = _reduce(g, granularity or scheme["granularity"],
                       lambda a, **k: np.max(np.abs(a), **k))
        scale = f32(amax / fmax)
        scale = np.where(np.isfinite(scale), scale, np.nan)
        if granularity is None:  # the scheme's own shape: () or (kv_heads,)
            scale = scale.reshape(-1) if per_head else scale.reshape(())
    if scale.ndim == 1:  # (kv_heads,) against (..., kv_heads, n, 1, head_dim)
        full = scale.reshape(scale.shape + (1, 1, 1))
    else:
        full = scale
    usable = full > 0
    with np.errstate(all="ignore"):
        ratio = np.where(usable, f32(g / np.where(usable, full, 1.0)), 0.0)
    if saturate:
        ratio = np.clip(ratio, -fmax, fmax)
    codes = fp8_cast(ratio, q, ties_away)
    values = f32(codes * full)
    if granularity is not None and fp8_scale is None and scheme["scale"] is None:
        scale = np.broadcast_to(scale, g.shape[:-1] + (1,))  # another shape: shown per token
    return {"codes": codes.reshape(x32.shape), "scales": np.asarray(scale),
            "values": values.reshape(x32.shape)}


def code_values(codes: np.ndarray, q_dtype: str) -> np.ndarray:
    """The compared form of codes: integer codes as they are, fp8 codes as ``fp8_ordinals``."""
    codes = np.asarray(codes, dtype=np.float64)
    return fp8_ordinals(codes, q_dtype) if is_float8(q_dtype) else codes


__all__ = ["FP8_MAX", "LEVELS", "QMAX", "code_values", "f32", "fp8_cast", "fp8_grid",
           "fp8_ordinals", "grouped", "is_float8", "quantize", "round_half_away", "round_half_even"]
