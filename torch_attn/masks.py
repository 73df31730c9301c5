"""Boolean mask builders. True means "may attend" everywhere in this project."""

from __future__ import annotations

from typing import Any

import torch

import attention_rules as rules

from ._core import _as_tensor, _dtype_name, _in_band


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
    lo, hi = rules.band(q_len, kv_len, True, "top_left", None)  # j - i <= 0
    return _in_band(offset, q_len, 0, kv_len, lo, hi, device)  # (q_len, kv_len), i from offset


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
    lo, hi = rules.band(q_len, kv_len, False, "top_left", (left, right))  # -left <= j - i <= right
    return _in_band(offset, q_len, 0, kv_len, lo, hi, device)  # (q_len, kv_len), i from offset


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
