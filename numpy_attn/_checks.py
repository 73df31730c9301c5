"""Input validation shared by the public entry points: pure Python on shapes and dtype names.

This file is identical in numpy_attn, jax_attn and torch_attn (a test keeps it so): every
backend passes plain shape tuples and dtype names (``"float32"``, ``"bfloat16"``, ``"bool"``…),
so every backend raises the same exception type with the same message for the same bad input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")
HALF_DTYPES = ("float16", "bfloat16")
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")

Shape = tuple[int, ...]


def compute_dtype(dtype: str) -> str:
    """The dtype scores and softmax are computed in: float32 for the half types."""
    return "float32" if dtype in HALF_DTYPES else dtype


def broadcast_shapes(*shapes: Shape) -> Shape | None:
    """NumPy broadcasting of shapes, or None when they do not broadcast."""
    ndim = max([len(s) for s in shapes] + [0])  # a list: torch.compile traces it
    result = []
    for axis in range(-ndim, 0):
        sizes = {s[axis] for s in shapes if len(s) >= -axis} - {1}
        if len(sizes) > 1:
            return None
        result.append(sizes.pop() if sizes else 1)
    return tuple(result)


def check_float_inputs(fn: str, **dtypes: str) -> str:
    """All named inputs share one supported floating dtype; returns it (TypeError otherwise)."""
    described = ", ".join(f"{name}.dtype={dtype}" for name, dtype in dtypes.items())
    for name, dtype in dtypes.items():
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{fn}: {name} must be float16, bfloat16, float32 or float64; got {described}"
            )
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"{fn}: inputs must share one dtype; got {described}")
    return next(iter(dtypes.values()))


def check_rank(fn: str, **shapes: Shape) -> None:
    """Every named array has rank >= 2 and all have the same rank (ValueError otherwise)."""
    described = ", ".join(f"{name}.shape={tuple(shape)}" for name, shape in shapes.items())
    for name, shape in shapes.items():
        if len(shape) < 2:
            raise ValueError(f"{fn}: {name} must have at least 2 axes (seq, dim); got {described}")
    if len({len(shape) for shape in shapes.values()}) > 1:
        raise ValueError(f"{fn}: inputs must have the same number of axes; got {described}")


def check_heads(fn: str, q_shape: Shape, kv_shape: Shape, q_name: str, kv_name: str) -> None:
    """Leading batch axes equal and query heads divisible by key/value heads."""
    described = f"{q_name}.shape={tuple(q_shape)}, {kv_name}.shape={tuple(kv_shape)}"
    if tuple(q_shape[:-3]) != tuple(kv_shape[:-3]):
        raise ValueError(
            f"{fn}: {q_name} and {kv_name} must have the same batch axes; got {described}"
        )
    if len(q_shape) >= 3:
        heads, kv_heads = q_shape[-3], kv_shape[-3]
        if kv_heads == 0 or heads % kv_heads != 0:
            raise ValueError(
                f"{fn}: the heads of {q_name} must be a multiple of the heads of {kv_name}; "
                f"got {described}"
            )


def check_query_key(fn: str, q_shape: Shape, k_shape: Shape) -> None:
    """Shapes of query and key: rank, batch axes, heads, head_dim."""
    check_rank(fn, query=q_shape, key=k_shape)
    if q_shape[-1] != k_shape[-1]:
        raise ValueError(
            f"{fn}: query and key must have the same head_dim; "
            f"got query.shape={tuple(q_shape)}, key.shape={tuple(k_shape)}"
        )
    check_heads(fn, q_shape, k_shape, "query", "key")


def check_key_value(fn: str, k_shape: Shape, v_shape: Shape) -> None:
    """Key and value share rank, batch axes, kv_heads and kv_len."""
    check_rank(fn, key=k_shape, value=v_shape)
    described = f"key.shape={tuple(k_shape)}, value.shape={tuple(v_shape)}"
    if k_shape[-2] != v_shape[-2]:
        raise ValueError(f"{fn}: key and value must have the same kv_len; got {described}")
    if tuple(k_shape[:-2]) != tuple(v_shape[:-2]):
        raise ValueError(
            f"{fn}: key and value must have the same batch axes and kv_heads; got {described}"
        )


def check_weights_value(fn: str, w_shape: Shape, v_shape: Shape) -> None:
    """Weights ``(..., heads, q_len, kv_len)`` against value ``(..., kv_heads, kv_len, v_dim)``."""
    check_rank(fn, weights=w_shape, value=v_shape)
    if w_shape[-1] != v_shape[-2]:
        raise ValueError(
            f"{fn}: weights and value must have the same kv_len; "
            f"got weights.shape={tuple(w_shape)}, value.shape={tuple(v_shape)}"
        )
    check_heads(fn, w_shape, v_shape, "weights", "value")


def scores_shape(q_shape: Shape, k_shape: Shape) -> Shape:
    """``(..., heads, q_len, kv_len)`` from query and key shapes."""
    return tuple(q_shape[:-1]) + (k_shape[-2],)


def check_broadcast(fn: str, name: str, shape: Shape, target: Shape, target_name: str) -> None:
    """``shape`` broadcasts to ``target`` without enlarging it (ValueError otherwise)."""
    if len(shape) > len(target) or broadcast_shapes(tuple(shape), tuple(target)) != tuple(target):
        raise ValueError(
            f"{fn}: {name} must be broadcastable to the {target_name} shape {tuple(target)}; "
            f"got {name}.shape={tuple(shape)}"
        )


def check_bool(fn: str, name: str, dtype: str) -> None:
    """A boolean array (TypeError otherwise)."""
    if dtype != "bool":
        meaning = "keep" if name == "dropout_mask" else "may attend"
        raise TypeError(
            f"{fn}: {name} must be boolean (True = {meaning}); got {name}.dtype={dtype}"
        )


def check_bias_dtype(fn: str, dtype: str) -> None:
    """A floating-point bias (TypeError otherwise)."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: bias must be floating point; got bias.dtype={dtype}")


def check_alignment(fn: str, causal_alignment: object) -> None:
    """``'top_left'`` or ``'bottom_right'`` (ValueError otherwise)."""
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(
            f"{fn}: causal_alignment must be 'top_left' or 'bottom_right'; "
            f"got causal_alignment={causal_alignment!r}"
        )


def causal_offset(causal_alignment: str, q_len: int, kv_len: int) -> int:
    """The offset of ``j <= i + offset``: 0 top-left, ``kv_len - q_len`` bottom-right."""
    return 0 if causal_alignment == "top_left" else kv_len - q_len


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) or type(x).__name__.startswith("int")


def check_window(fn: str, window: object) -> tuple[int | None, int | None]:
    """A pair ``(left, right)`` of non-negative ints or None (ValueError otherwise)."""
    ok = isinstance(window, Sequence) and not isinstance(window, str) and len(window) == 2
    if ok:
        ok = all(w is None or (_is_int(w) and int(w) >= 0) for w in window)
    if not ok:
        raise ValueError(
            f"{fn}: window must be a pair (left, right) of non-negative ints or None; "
            f"got window={window!r}"
        )
    left, right = window  # type: ignore[misc]
    return (None if left is None else int(left), None if right is None else int(right))


def check_int(fn: str, name: str, value: object, minimum: int | None = 0) -> int:
    """A Python or NumPy integer, at least ``minimum`` (ValueError otherwise)."""
    if not _is_int(value) or (minimum is not None and int(value) < minimum):  # type: ignore[arg-type]
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{fn}: {name} must be an int{bound}; got {name}={value!r}")
    return int(value)  # type: ignore[arg-type]


def check_dropout(fn: str, dropout_p: object, has_mask: bool) -> float:
    """``dropout_p`` in [0, 1); a keep-mask only with ``dropout_p > 0`` (ValueError otherwise)."""
    try:
        p = float(dropout_p)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        p = math.nan
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{fn}: dropout_p must be in [0, 1); got dropout_p={dropout_p!r}")
    if has_mask and p == 0.0:
        raise ValueError(
            f"{fn}: dropout_mask needs dropout_p > 0 (survivors are scaled by "
            f"1 / (1 - dropout_p)); got dropout_p={dropout_p!r}"
        )
    return p


def check_softcap(fn: str, softcap: object) -> float | None:
    """None or a positive finite number (ValueError otherwise)."""
    if softcap is None:
        return None
    try:
        c = float(softcap)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        c = math.nan
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"{fn}: softcap must be a positive finite number; got softcap={softcap!r}")
    return c


def check_scale(fn: str, scale: object, head_dim: int) -> float:
    """A finite number, or ``head_dim ** -0.5`` for None (ValueError otherwise)."""
    if scale is None:
        return head_dim**-0.5 if head_dim > 0 else 1.0
    try:
        s = float(scale)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        s = math.nan
    if not math.isfinite(s):
        raise ValueError(f"{fn}: scale must be a finite number; got scale={scale!r}")
    return s
