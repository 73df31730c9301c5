"""Boolean mask builders. True means "may attend" everywhere in this project."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import attention_rules as rules


def _dtype_name(x: torch.Tensor) -> str:
    # torch's dtype names without the prefix: "float32", "bool", "int64"…
    return str(x.dtype).removeprefix("torch.")


def _as_tensor(x: Any, device: Any = None) -> torch.Tensor:
    """A tensor as is (moved to ``device`` if given); anything else through NumPy, so Python
    lists get NumPy's dtypes (float64, int64) and messages match numpy_attn's."""
    if isinstance(x, torch.Tensor):
        return x if device is None else x.to(device)
    array = np.asarray(x)
    if array.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: torch reads it through float32
        return torch.from_numpy(array.astype(np.float32)).to(device, torch.bfloat16)
    return torch.as_tensor(array, device=device)


def _positions(q_len: int, kv_len: int, offset: int, device: Any = None) -> torch.Tensor:
    """``j - (i + offset)`` for every query ``i`` and key ``j``: ``(q_len, kv_len)``."""
    query_pos = torch.arange(q_len, device=device)[:, None] + offset  # (q_len, 1)
    key_pos = torch.arange(kv_len, device=device)[None, :]  # (1, kv_len)
    return key_pos - query_pos  # (q_len, kv_len)


def causal_mask(q_len: int, kv_len: int, *, offset: int = 0, device: Any = None) -> torch.Tensor:
    """Boolean causal mask: query ``i`` may attend key ``j`` iff ``j <= i + offset``.

    Args:
      q_len: number of queries.
      kv_len: number of keys.
      offset: 0 for top-left alignment, ``kv_len - q_len`` for bottom-right.
      device: a ``torch.device`` (or its name); ``None`` is torch's default device.

    Returns:
      ``(q_len, kv_len)`` bool, True = may attend.
    """
    fn = "causal_mask"
    q_len = rules.check_int(fn, "q_len", q_len)
    kv_len = rules.check_int(fn, "kv_len", kv_len)
    offset = rules.check_int(fn, "offset", offset, minimum=None)
    return _positions(q_len, kv_len, offset, device) <= 0


def sliding_window_mask(
    q_len: int, kv_len: int, window: tuple, *, offset: int = 0, device: Any = None
) -> torch.Tensor:
    """Boolean local-attention mask: ``i + offset - left <= j <= i + offset + right``.

    Args:
      q_len: number of queries.
      kv_len: number of keys.
      window: ``(left, right)``, non-negative ints, ``None`` for unbounded.
      offset: alignment offset, as in ``causal_mask``.
      device: a ``torch.device`` (or its name); ``None`` is torch's default device.

    Returns:
      ``(q_len, kv_len)`` bool, True = may attend.
    """
    fn = "sliding_window_mask"
    q_len = rules.check_int(fn, "q_len", q_len)
    kv_len = rules.check_int(fn, "kv_len", kv_len)
    offset = rules.check_int(fn, "offset", offset, minimum=None)
    left, right = rules.check_window(fn, window)
    distance = _positions(q_len, kv_len, offset, device)  # (q_len, kv_len): j - (i + offset)
    allowed = torch.ones((q_len, kv_len), dtype=torch.bool, device=distance.device)
    if left is not None:
        allowed &= distance >= -left
    if right is not None:
        allowed &= distance <= right
    return allowed


def _lengths(fn: str, name: str, lengths: Any, max_len: int, device: Any) -> torch.Tensor:
    lengths = _as_tensor(lengths, device)  # a tensor keeps its device when device is None
    rules.check_lengths_1d(fn, name, (tuple(lengths.shape), _dtype_name(lengths)))
    rules.check_lengths(fn, name, lengths.tolist(), max_len)
    return lengths


def padding_mask(
    kv_lengths: Any,
    kv_len: int,
    *,
    q_lengths: Any = None,
    q_len: int | None = None,
    device: Any = None,
) -> torch.Tensor:
    """Boolean padding mask from per-sequence lengths.

    Args:
      kv_lengths: ``(batch,)`` ints in ``[0, kv_len]``; key ``j`` of sequence ``b`` is allowed
        iff ``j < kv_lengths[b]``.
      kv_len: padded key length.
      q_lengths: optional ``(batch,)`` ints; query ``i`` of sequence ``b`` attends only if
        ``i < q_lengths[b]`` (a padded query's output is 0).
      q_len: padded query length, required with ``q_lengths``.
      device: a ``torch.device``; ``None``: the device of ``kv_lengths`` if it is a tensor,
        else torch's default device.

    Returns:
      ``(batch, 1, 1, kv_len)`` bool, or ``(batch, 1, q_len, kv_len)`` with ``q_lengths``.
    """
    fn = "padding_mask"
    kv_len = rules.check_int(fn, "kv_len", kv_len)
    kv_lengths = _lengths(fn, "kv_lengths", kv_lengths, kv_len, device)
    device = kv_lengths.device  # every later tensor lives with the lengths
    key_ok = torch.arange(kv_len, device=device) < kv_lengths[:, None]  # (batch, kv_len)
    mask = key_ok[:, None, None, :]  # (batch, 1, 1, kv_len)
    if q_lengths is None:
        return mask
    if q_len is None:
        raise ValueError(f"{fn}: q_lengths needs q_len; got q_len=None")
    q_len = rules.check_int(fn, "q_len", q_len)
    q_lengths = _lengths(fn, "q_lengths", q_lengths, q_len, device)
    if q_lengths.shape != kv_lengths.shape:
        raise ValueError(
            f"{fn}: q_lengths and kv_lengths must have the same batch; "
            f"got q_lengths.shape={tuple(q_lengths.shape)}, "
            f"kv_lengths.shape={tuple(kv_lengths.shape)}"
        )
    query_ok = torch.arange(q_len, device=device) < q_lengths[:, None]  # (batch, q_len)
    return mask & query_ok[:, None, :, None]  # (batch, 1, q_len, kv_len)


def combine_masks(*masks: Any) -> torch.Tensor | None:
    """AND of boolean masks, broadcast together; ``None`` entries are skipped.

    Args:
      masks: boolean tensors, mutually broadcastable (on one device).

    Returns:
      the broadcast AND, or ``None`` when every entry is ``None``.
    """
    fn = "combine_masks"
    present = [_as_tensor(m) for m in masks if m is not None]
    for index, m in enumerate(present):
        rules.check_bool(fn, f"masks[{index}]", _dtype_name(m))
    if not present:
        return None
    if rules.broadcast_shapes(*(tuple(m.shape) for m in present)) is None:
        shapes = ", ".join(str(tuple(m.shape)) for m in present)
        raise ValueError(f"{fn}: masks must broadcast together; got shapes {shapes}")
    combined = present[0]
    for m in present[1:]:
        combined = combined & m
    return combined
