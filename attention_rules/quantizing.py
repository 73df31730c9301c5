"""The rules of quantised KV caches: the schemes (``KVQuantization``), their arguments and the
residual window's bookkeeping, written once for every backend (``conformance/spec/
quantized_cache.py`` is the spec).

* ``KVQuantization``: a frozen, hashable description of a scheme (int8 / int4, symmetric or
  with zero points, per token or per channel group; fp8 e4m3 / e5m2, per tensor or per head,
  a dynamic or a given scale; an unquantised residual window), validated when made;
* ``quantize_arguments``: the checks of ``quantize_kv`` on ``(shape, dtype name)``; returns
  the normalised facts (``QuantizePlan``);
* ``check_quantized``: ``dequantize_kv``'s argument; ``moves_to_store``: when tokens leave the
  residual window (transformers' ``QuantizedCache`` rule);
* ``bytes_per_token``: what one token costs in the quantised store, for the tables.

Stdlib only: the array work (the rounding itself) is each backend's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

from .checks import Shape, check_float_inputs, is_int

#: The code types of a scheme.
DTYPES = ("int8", "int4", "float8_e4m3", "float8_e5m2")
#: Which granularities each kind of code takes (the first is the default).
GRANULARITIES = {
    "int8": ("group", "token"),
    "int4": ("group", "token"),
    "float8_e4m3": ("tensor", "head"),
    "float8_e5m2": ("tensor", "head"),
}
#: Symmetric integer codes lie in [-QMAX, QMAX] (the most negative code, -128 / -8, unused).
QMAX = {"int8": 127, "int4": 7}
#: Integer codes with a zero point lie in [0, LEVELS].
LEVELS = {"int8": 255, "int4": 15}
#: The largest finite value of each fp8 format (e4m3 "fn": no inf; e5m2: IEEE-like, with inf).
FP8_MAX = {"float8_e4m3": 448.0, "float8_e5m2": 57344.0}
#: The bits a code takes (int4: the packed size; the backends store one code per byte).
CODE_BITS = {"int8": 8, "int4": 4, "float8_e4m3": 8, "float8_e5m2": 8}
#: The default group size along head_dim (mlx-lm's and transformers' q_group_size).
GROUP_SIZE = 64


def _positive_scale(fn: str, value: object) -> float:
    try:
        number = math.nan if isinstance(value, bool) else float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{fn}: scale must be None, a finite number > 0 or (per head) a tuple "
                         f"of them; got scale={value!r}")
    return number


@dataclasses.dataclass(frozen=True)
class KVQuantization:
    """A quantisation scheme of a KV cache (``spec.QUANTIZATION_SCHEMES``).

    dtype: "int8", "int4", "float8_e4m3" or "float8_e5m2". granularity: "group" (one scale,
    and zero point, per token per group of ``group_size`` channels along head_dim) or "token"
    (one per token per head) for integer codes; "tensor" (one scale) or "head" (one per kv
    head) for fp8; None: the first of these. zero_point: integer codes only, asymmetric codes
    in [0, 2^bits - 1] with a float zero point (the group's minimum, mlx-lm's bias). scale:
    fp8 only, None (the amax rule) or a given scale (a number; per head a tuple of numbers,
    vLLM's k_scale / v_scale). residual: the most recent tokens kept unquantised
    (transformers' residual_length; 0: none).
    """

    dtype: str = "int8"
    granularity: str | None = None
    group_size: int = GROUP_SIZE
    zero_point: bool = False
    scale: Any = None
    residual: int = 0

    def __post_init__(self) -> None:
        fn = "KVQuantization"
        if not (isinstance(self.dtype, str) and self.dtype in DTYPES):
            raise ValueError(f"{fn}: dtype must be one of {', '.join(map(repr, DTYPES))}; "
                             f"got dtype={self.dtype!r}")
        allowed = GRANULARITIES[self.dtype]
        granularity = allowed[0] if self.granularity is None else self.granularity
        if granularity not in allowed:
            raise ValueError(f"{fn}: granularity must be one of {', '.join(map(repr, allowed))} "
                             f"for dtype={self.dtype!r}; got granularity={self.granularity!r}")
        object.__setattr__(self, "granularity", granularity)
        if not (is_int(self.group_size) and int(self.group_size) >= 1):
            raise ValueError(f"{fn}: group_size must be an int >= 1; "
                             f"got group_size={self.group_size!r}")
        object.__setattr__(self, "group_size", int(self.group_size))
        if not isinstance(self.zero_point, bool):
            raise ValueError(f"{fn}: zero_point must be a bool; got zero_point={self.zero_point!r}")
        if self.zero_point and self.is_float8:
            raise ValueError(f"{fn}: zero_point is for integer codes only; "
                             f"got zero_point=True, dtype={self.dtype!r}")
        if self.scale is not None:
            if not self.is_float8:
                raise ValueError(f"{fn}: scale is for fp8 codes only (integer codes take each "
                                 f"group's amax); got scale={self.scale!r}, "
                                 f"dtype={self.dtype!r}")
            if granularity == "head":
                if not (isinstance(self.scale, (tuple, list)) and len(self.scale) > 0):
                    raise ValueError(f"{fn}: scale must be a tuple of one number per kv head "
                                     f"with granularity='head'; got scale={self.scale!r}")
                scale: Any = tuple(_positive_scale(fn, s) for s in self.scale)
            else:
                scale = _positive_scale(fn, self.scale)
            object.__setattr__(self, "scale", scale)
        if not (is_int(self.residual) and int(self.residual) >= 0):
            raise ValueError(f"{fn}: residual must be an int >= 0; got residual={self.residual!r}")
        object.__setattr__(self, "residual", int(self.residual))

    @property
    def is_float8(self) -> bool:
        """fp8 codes (True) or integer codes (False)."""
        return self.dtype.startswith("float8")

    @property
    def code_range(self) -> tuple[float, float]:
        """The smallest and largest code: ``(-QMAX, QMAX)``, ``(0, LEVELS)`` with zero points,
        ``(-FP8_MAX, FP8_MAX)`` for fp8."""
        if self.is_float8:
            return -FP8_MAX[self.dtype], FP8_MAX[self.dtype]
        if self.zero_point:
            return 0, LEVELS[self.dtype]
        return -QMAX[self.dtype], QMAX[self.dtype]

    @property
    def code_dtype(self) -> str:
        """The stored code's dtype name: int8 (int4 unpacked, one code per byte), uint8 (with
        zero points), float8_e4m3fn or float8_e5m2."""
        if self.is_float8:
            return {"float8_e4m3": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}[self.dtype]
        return "uint8" if self.zero_point else "int8"


class QuantizePlan(NamedTuple):
    """The validated facts of one ``quantize_kv`` call."""

    dtype: str  # x's dtype name
    head_dim: int
    group_size: int  # channels per scale (head_dim for "token")
    groups: int  # head_dim // group_size
    kv_heads: int


def check_scheme(fn: str, scheme: object, name: str = "scheme") -> KVQuantization:
    """A ``KVQuantization`` (TypeError otherwise)."""
    if not isinstance(scheme, KVQuantization):
        raise TypeError(f"{fn}: {name} must be a KVQuantization; "
                        f"got type({name})={type(scheme).__name__}")
    return scheme


def check_group_size(fn: str, scheme: KVQuantization, head_dim: int, name: str = "x") -> int:
    """The channels per scale: ``group_size`` (a divisor of head_dim, ValueError otherwise)
    for "group", head_dim for "token"; 0 for fp8 (no groups)."""
    if scheme.is_float8:
        return 0
    if scheme.granularity == "token":
        return head_dim
    if head_dim % scheme.group_size != 0:
        raise ValueError(f"{fn}: group_size must divide head_dim; got group_size="
                         f"{scheme.group_size}, {name} head_dim={head_dim}")
    return scheme.group_size


def check_head_scales(fn: str, scheme: KVQuantization, kv_heads: int) -> None:
    """A given per-head scale has one number per kv head (ValueError otherwise)."""
    if scheme.granularity == "head" and scheme.scale is not None and len(scheme.scale) != kv_heads:
        raise ValueError(f"{fn}: scale must give one number per kv head; got "
                         f"len(scale)={len(scheme.scale)}, kv_heads={kv_heads}")


def quantize_arguments(
    fn: str, x: tuple[Shape, str], scheme: object, name: str = "x"
) -> QuantizePlan:
    """The checks of ``quantize_kv`` in a fixed order: the scheme (TypeError), x's dtype
    (TypeError), x's rank (at least 3: ``(..., kv_heads, n, head_dim)``), the group size and a
    per-head scale (ValueError); returns the plan."""
    scheme = check_scheme(fn, scheme)
    shape, dtype = tuple(x[0]), x[1]
    check_float_inputs(fn, **{name: dtype})
    if len(shape) < 3:
        raise ValueError(f"{fn}: {name} must be (..., kv_heads, n, head_dim), at least 3 axes; "
                         f"got {name}.shape={shape}")
    head_dim, kv_heads = shape[-1], shape[-3]
    if head_dim < 1:
        raise ValueError(f"{fn}: {name} must have head_dim >= 1; got {name}.shape={shape}")
    size = check_group_size(fn, scheme, head_dim, name)
    check_head_scales(fn, scheme, kv_heads)
    groups = head_dim // size if size else 0
    return QuantizePlan(dtype, head_dim, size, groups, kv_heads)


def cache_schemes(
    fn: str, scheme: object, value_scheme: object, kv_heads: int, head_dim: int, v_dim: int
) -> tuple[KVQuantization, KVQuantization]:
    """``QuantizedKVCache.empty``'s schemes: both ``KVQuantization`` (TypeError), value_scheme
    None meaning scheme; the same residual (ValueError), group sizes dividing head_dim / v_dim
    and per-head scales of kv_heads numbers (ValueError); head_dim and v_dim at least 1."""
    scheme = check_scheme(fn, scheme)
    value_scheme = scheme if value_scheme is None else check_scheme(fn, value_scheme,
                                                                    "value_scheme")
    if value_scheme.residual != scheme.residual:
        raise ValueError(f"{fn}: scheme and value_scheme must keep the same residual window; "
                         f"got scheme.residual={scheme.residual}, "
                         f"value_scheme.residual={value_scheme.residual}")
    for name, dim in (("head_dim", head_dim), ("v_dim", v_dim)):
        if dim < 1:
            raise ValueError(f"{fn}: {name} must be >= 1 in a quantised cache; got {name}={dim}")
    check_group_size(fn, scheme, head_dim, "key")
    check_group_size(fn, value_scheme, v_dim, "value")
    check_head_scales(fn, scheme, kv_heads)
    check_head_scales(fn, value_scheme, kv_heads)
    return scheme, value_scheme


def check_quantized(fn: str, q: object, kind: type, name: str = "q") -> None:
    """``dequantize_kv``'s argument: the backend's ``QuantizedArray`` (TypeError otherwise)."""
    if not isinstance(q, kind):
        raise TypeError(f"{fn}: {name} must be a QuantizedArray (what quantize_kv returns); "
                        f"got type({name})={type(q).__name__}")


def moves_to_store(length: int, held: int, n: int, residual: int) -> bool:
    """Whether an append of ``n`` tokens quantises the residual window's ``held`` tokens and
    the new ones (True) or adds the new ones to the window (False): transformers'
    ``QuantizedLayer.update``. With no window (``residual == 0``), always; the first append
    (``length == 0``), always; otherwise when ``held + n >= residual``."""
    if n == 0:
        return False
    return residual == 0 or length == 0 or held + n >= residual


def bytes_per_token(scheme: KVQuantization, kv_heads: int, head_dim: int) -> float:
    """Bytes one token takes in the quantised store of keys (or values): its codes (int4 as
    packed 4-bit codes) and, for integer codes, a float32 scale (and zero point) per group;
    fp8's per-tensor / per-head scales are shared by every token (0 here). The residual
    window's tokens cost what a float cache's do."""
    codes = kv_heads * head_dim * CODE_BITS[scheme.dtype] / 8
    if scheme.is_float8:
        return codes
    groups = 1 if scheme.granularity == "token" else head_dim // scheme.group_size
    return codes + kv_heads * groups * 4 * (2 if scheme.zero_point else 1)
