"""Arrays in torch_attn: what the rules see of an input (``_describe``, ``_describe_lengths``,
``_describe_parts``: its shape and dtype name), tensors from what a caller gives
(``_as_tensor``, ``_array``) and back to NumPy (``_to_numpy``), dtypes and the compute dtype
(``_dtype_name``, ``_to_compute``), and the bookkeeping of grouped-query heads (``_groups``,
``_group_heads``, ``_merged``).

The lowest of torch_attn's private rooms, which import one another one way only: ``_arrays <
_masking < _steps < _tiles < _fast`` (``docs/read_the_code.md`` draws the whole ladder, the
public files above every room). Nothing here validates beyond what ``attention_rules`` asks to
see: the public functions check their inputs once, then call the rooms.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import attention_rules as rules

# ------------------------------------------------------------------------------------------
# Arrays, dtypes, heads and devices
# ------------------------------------------------------------------------------------------


def _describe(fn: str, name: str, x: Any) -> rules.ArrayInfo | None:
    """What the rules see of an input: ``(shape, dtype name)``; None for None. A Python list,
    tuple or scalar is refused (TypeError): it has no dtype of its own."""
    if x is None:
        return None
    rules.check_array(fn, name, x)
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), _dtype_name(x)
    x = np.asarray(x)  # torch: NumPy arrays are welcome too, named as NumPy names them
    return tuple(x.shape), x.dtype.name


def _describe_lengths(kv_lengths: Any) -> rules.ArrayInfo | None:
    """``(shape, dtype name)`` of ``kv_lengths`` (a list of ints is welcome)."""
    if kv_lengths is None:
        return None
    if isinstance(kv_lengths, torch.Tensor):
        return tuple(kv_lengths.shape), _dtype_name(kv_lengths)
    kv_lengths = np.asarray(kv_lengths)  # torch: named as NumPy names them
    return tuple(kv_lengths.shape), kv_lengths.dtype.name


def _describe_parts(fn: str, name: str, parts: Any) -> list[rules.ArrayInfo]:
    """``merge_attention``'s partial results as the rules see them: a list or tuple of arrays,
    ``name[i]`` each."""
    rules.check_parts(fn, name, parts)
    return [_describe(fn, f"{name}[{i}]", x) for i, x in enumerate(parts)]


def _array(x: Any) -> torch.Tensor | None:
    """A validated input as a tensor (a tensor as is); None stays None."""
    return None if x is None else _as_tensor(x)


def _check_scores(fn: str, name: str, x: Any) -> rules.ArrayInfo:
    """A floating array of rank >= 2 (scores or weights); its ``(shape, dtype name)``."""
    return rules.check_score_array(fn, name, _describe(fn, name, x))


def _to_compute(x: torch.Tensor) -> torch.Tensor:
    """Half types up to float32; float32 and float64 unchanged (no copy)."""
    return x.to(getattr(torch, rules.compute_dtype(_dtype_name(x))))


def _group_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
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


def _dtype_name(x: torch.Tensor) -> str:
    """torch's dtype name without the prefix: ``"float32"``, ``"bool"``, ``"int64"``…"""
    return str(x.dtype).removeprefix("torch.")


def _as_tensor(x: Any, device: Any = None) -> torch.Tensor:
    """torch only: a tensor as is (moved to ``device`` if given); anything else through NumPy,
    so Python lists get NumPy's dtypes (float64, int64) and messages match numpy_attn's."""
    if isinstance(x, torch.Tensor):
        return x if device is None else x.to(device)
    array = np.asarray(x)
    if array.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: torch reads it through float32
        return torch.from_numpy(array.astype(np.float32)).to(device, torch.bfloat16)
    return torch.as_tensor(array, device=device)


def _to_numpy(x: Any) -> np.ndarray:
    """torch only: a copy as a NumPy array (any shape); bfloat16 becomes ml_dtypes' bfloat16,
    as in the other backends."""
    if not isinstance(x, torch.Tensor):
        return np.array(x)
    x = x.detach().cpu()
    if x.dtype == torch.bfloat16:  # NumPy has no bfloat16 of its own
        import ml_dtypes

        return x.float().numpy().astype(ml_dtypes.bfloat16)
    return x.numpy().copy()


def _cache_dtype(fn: str, dtype: Any) -> torch.dtype:
    """A cache's ``dtype`` argument (``KVCache.empty``, ``PagedKVCache``): a dtype name
    (``"float32"``) or a ``torch.dtype``; the spec's TypeError naming ``dtype`` for anything
    else (torch: ``getattr`` alone would raise AttributeError)."""
    found = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(found, torch.dtype):
        rules.check_float_inputs(fn, dtype=str(dtype))  # raises: not a supported dtype
    return found

