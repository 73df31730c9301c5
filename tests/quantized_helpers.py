"""What the quantised-cache tests share (``test_quantize_kv.py``, ``test_quantized_cache.py``,
``test_quantized_cache_transformers.py``, ``test_dequantizing_attention.py``,
``test_dequantizing_attention_jax.py``): the schemes, the seeded keys with their edge cases, the
independent float64 quantiser, and the float64 attention the decoding steps are checked
against."""

from __future__ import annotations

import numpy as np
import torch

from attention_rules.quantizing import KVQuantization

SHAPE = (2, 3, 5, 128)  # (batch, kv_heads, n, head_dim): one shape, few jax compiles

SCHEMES = [
    KVQuantization("int8"),
    KVQuantization("int8", granularity="token"),
    KVQuantization("int8", zero_point=True, group_size=32),
    KVQuantization("int4"),
    KVQuantization("int4", zero_point=True),
    KVQuantization("int4", granularity="token", zero_point=True),
    KVQuantization("float8_e4m3"),
    KVQuantization("float8_e4m3", granularity="head"),
    KVQuantization("float8_e5m2"),
    KVQuantization("float8_e5m2", granularity="head", scale=(0.01, 0.5, 2.0)),
    KVQuantization("float8_e4m3", scale=0.005),
]
IDS = [f"{s.dtype}-{s.granularity}{'-zp' if s.zero_point else ''}"
       f"{'-given' if s.scale is not None else ''}" for s in SCHEMES]


def seeded_keys(seed: int = 0, shape: tuple = SHAPE) -> np.ndarray:
    """Seeded float32 keys with edge cases: an all-zero group, a constant group, a tie."""
    x = (np.random.default_rng(seed).standard_normal(shape) * 3).astype(np.float32)
    x[0, 0, 0, :64] = 0.0  # an all-zero group (of 64, of 32)
    x[0, 0, 1, 64:] = -1.25  # a constant group
    x[1, 2, 3, :] = np.linspace(-127, 127, shape[-1]).astype(np.float32)  # ties at qmax = 127
    return x


def reference_attention(query, keys, values, sinks=None) -> np.ndarray:
    """float64 softmax attention of the last query rows: bottom-right causal, grouped heads,
    optional ``(heads,)`` sinks."""
    q, k, v = (np.asarray(a, np.float64) for a in (query, keys, values))
    groups = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, groups, axis=-3), np.repeat(v, groups, axis=-3)
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    q_len, kv_len = scores.shape[-2:]
    allowed = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + kv_len - q_len
    scores = np.where(allowed, scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, np.asarray(sinks, np.float64)[:, None, None])
    weights = np.exp(scores - top)
    total = weights.sum(-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(np.asarray(sinks, np.float64)[:, None, None] - top)
    return (weights / total) @ v


# ------------------------------------------------------------------------------------------
# The independent float64 quantiser (each float32 operation: float64 then one rounding to
# float32, which equals float32's correctly rounded +, -, *, /)
# ------------------------------------------------------------------------------------------

f32 = np.float32


def round_half_even(y: np.ndarray) -> np.ndarray:
    """Round to the nearest integer, ties to the even one, written out (not np.rint)."""
    low = np.floor(y)
    frac = y - low
    odd = np.mod(low, 2) == 1
    return np.where(frac > 0.5, low + 1, np.where(frac < 0.5, low, np.where(odd, low + 1, low)))


def ref_integer(x: np.ndarray, scheme: KVQuantization) -> tuple[np.ndarray, np.ndarray]:
    """Codes and dequantised values (float32) of integer schemes."""
    bits = {"int8": 8, "int4": 4}[scheme.dtype]
    size = x.shape[-1] if scheme.granularity == "token" else scheme.group_size
    g = x.astype(np.float64).reshape(x.shape[:-1] + (-1, size))
    if scheme.zero_point:
        top, bottom = 2.0**bits - 1, 0.0
        lo = g.min(-1, keepdims=True)
        scale = f32(f32(g.max(-1, keepdims=True) - lo).astype(np.float64) / top).astype(float)
        shifted = f32(g - lo).astype(np.float64)
    else:
        top = 2.0 ** (bits - 1) - 1
        bottom, lo = -top, 0.0
        scale = f32(np.abs(g).max(-1, keepdims=True) / top).astype(np.float64)
        shifted = g
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(scale > 0, f32(shifted / scale).astype(np.float64), 0.0)
    codes = np.clip(round_half_even(y), bottom, top)
    values = f32(codes * scale).astype(np.float64)
    if scheme.zero_point:
        values = f32(values + lo)
    return codes.reshape(x.shape), f32(values).reshape(x.shape)


def fp8_grid(dtype: str) -> np.ndarray:
    """Every non-negative finite value of the format, in code order (written from the format:
    e4m3fn bias 7, 3 mantissa bits, no inf, top code NaN; e5m2 bias 15, 2 bits, IEEE)."""
    man, bias, top_exp = (3, 7, 15) if dtype == "float8_e4m3" else (2, 15, 30)
    values = [m / 2**man * 2.0 ** (1 - bias) for m in range(2**man)]  # 0 and subnormals
    for e in range(1, top_exp + 1):
        values += [(1 + m / 2**man) * 2.0 ** (e - bias) for m in range(2**man)]
    if dtype == "float8_e4m3":
        values = values[:-1]  # S.1111.111 is NaN
    return np.array(values)


def ref_fp8_round(y: np.ndarray, dtype: str) -> np.ndarray:
    """Round to nearest, ties to even code, on the grid; |y| <= max (NaN stays NaN)."""
    grid = fp8_grid(dtype)
    mag = np.abs(y)
    hi = np.clip(np.searchsorted(grid, mag), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    out = np.copysign(grid[pick], y)
    return np.where(np.isnan(y), np.nan, out)


def ref_fp8(x: np.ndarray, scheme: KVQuantization) -> tuple[np.ndarray, np.ndarray]:
    """Codes (as float64 values) and dequantised values (float32) of fp8 schemes."""
    top = {"float8_e4m3": 448.0, "float8_e5m2": 57344.0}[scheme.dtype]
    x = x.astype(np.float64)
    if scheme.scale is not None:  # a given scale, rounded to float32
        scale = f32(np.asarray(scheme.scale)).astype(np.float64)
    elif scheme.granularity == "head":
        scale = f32(np.abs(x).max(axis=(0, 2, 3)) / top).astype(np.float64)
    else:
        scale = f32(np.abs(x).max() / top).astype(np.float64)
    scale = scale.reshape(scale.shape + (1, 1)) if scale.ndim == 1 else scale
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(scale > 0, f32(x / scale).astype(np.float64), 0.0)
    codes = ref_fp8_round(np.clip(y, -top, top), scheme.dtype)
    return codes, f32(codes * scale)


def reference(x: np.ndarray, scheme: KVQuantization) -> tuple[np.ndarray, np.ndarray]:
    return ref_fp8(x, scheme) if scheme.is_float8 else ref_integer(x, scheme)


def as_numpy(x: object) -> np.ndarray:
    """A backend's array as a NumPy array."""
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def codes_float64(q: object) -> np.ndarray:
    """The codes as float64 numbers (fp8 through float32: exact)."""
    codes = q.codes
    if isinstance(codes, torch.Tensor):
        codes = codes.to(torch.float32) if codes.dtype.is_floating_point else codes
    return as_numpy(codes).astype(np.float64)
