"""The arrays of numpy_attn: what the rules see of an input (``_describe`` and its siblings:
``(shape, dtype name)``, for the checks of ``attention_rules``), inputs as NumPy arrays, the
compute dtype (half types up to float32), the grouped-query head bookkeeping (query head ``h``
meets kv head ``h // groups``) and the device (the CPU only). The lowest of numpy_attn's rooms:
it imports none of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import attention_rules as rules

# ------------------------------------------------------------------------------------------
# Descriptions of the inputs, as the rules see them
# ------------------------------------------------------------------------------------------


def _describe(fn: str, name: str, x: Any) -> rules.ArrayInfo | None:
    """What the rules see of an input: ``(shape, dtype name)``; None for None. A Python list,
    tuple or scalar is refused (TypeError): it has no dtype of its own."""
    if x is None:
        return None
    rules.check_array(fn, name, x)
    x = np.asarray(x)
    return tuple(x.shape), x.dtype.name


def _describe_lengths(kv_lengths: Any) -> rules.ArrayInfo | None:
    """``(shape, dtype name)`` of ``kv_lengths`` (a list of ints is welcome)."""
    if kv_lengths is None:
        return None
    kv_lengths = np.asarray(kv_lengths)
    return tuple(kv_lengths.shape), kv_lengths.dtype.name


def _describe_parts(fn: str, name: str, parts: Any) -> list[rules.ArrayInfo]:
    """``merge_attention``'s partial results as the rules see them: a list or tuple of arrays,
    ``name[i]`` each."""
    rules.check_parts(fn, name, parts)
    return [_describe(fn, f"{name}[{i}]", x) for i, x in enumerate(parts)]


def _array(x: Any) -> np.ndarray | None:
    """A validated input as a NumPy array (no copy); None stays None."""
    return None if x is None else np.asarray(x)


def _check_scores(fn: str, name: str, x: Any) -> rules.ArrayInfo:
    """A floating array of rank >= 2 (scores or weights); its ``(shape, dtype name)``."""
    return rules.check_score_array(fn, name, _describe(fn, name, x))


# ------------------------------------------------------------------------------------------
# Dtypes, heads and devices
# ------------------------------------------------------------------------------------------


def _to_compute(x: np.ndarray) -> np.ndarray:
    """Half types up to float32; float32 and float64 unchanged (no copy)."""
    return x.astype(rules.compute_dtype(x.dtype.name), copy=False)


def _group_heads(x: np.ndarray, groups: int) -> np.ndarray:
    """``(..., heads, T, D)`` → ``(..., kv_heads, groups, T, D)``: query head ``h`` is
    ``(h // groups, h % groups)``, so it meets kv head ``h // groups``."""
    return x.reshape(x.shape[:-3] + (x.shape[-3] // groups, groups) + x.shape[-2:])


def _groups(x_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> int:
    """Query heads per kv head: ``heads // kv_heads`` of ``(..., heads, T, D)`` and
    ``(..., kv_heads, S, D)``; 1 for inputs without a head axis."""
    return x_shape[-3] // kv_shape[-3] if len(x_shape) >= 3 else 1


def _merged(shape: tuple[int, ...], groups: int) -> tuple[int, ...]:
    """Undo ``_group_heads``: ``(..., kv_heads, groups, T, S)`` → ``(..., heads, T, S)``."""
    return rules.merged_heads(shape, groups)


def _check_device(fn: str, device: Any) -> None:
    """``device`` of a function that creates arrays: None or ``"cpu"`` (NumPy arrays live on
    the CPU only, the Array API's ``device="cpu"``); ValueError otherwise."""
    if device not in (None, "cpu"):
        raise ValueError(f"{fn}: numpy_attn creates arrays on the CPU only; got device={device!r}")


def _cache_dtype(fn: str, dtype: Any) -> np.dtype:
    """A cache's ``dtype`` argument (``KVCache.empty``, ``PagedKVCache``): a dtype name
    (``"bfloat16"`` via ml_dtypes) or a NumPy dtype; the spec's TypeError naming ``dtype``
    for a name NumPy does not know."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(dtype)
    except TypeError:
        rules.check_float_inputs(fn, dtype=str(dtype))  # raises: not a supported dtype
        raise

