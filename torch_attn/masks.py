"""Boolean mask builders. True means "may attend" everywhere in this project."""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch

import attention_rules as rules
from attention_rules import ready_mods

from ._arrays import _as_tensor, _dtype_name
from ._masking import _in_band


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
    rules.check_masks_broadcast(fn, [tuple(m.shape) for m in present])
    return functools.reduce(operator.and_, present)  # the broadcast AND


# ------------------------------------------------------------------------------------------
# Ready-made mods (spec.READY_MADE_MODS), written once in attention_rules.ready_mods: the mask
# mods are imported as they are (operators only); the ones that hold an array or call a
# function get torch's here, on tensors (autograd runs through them)
# ------------------------------------------------------------------------------------------


def _place(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """torch only: ``x`` (ids, slopes, a table) on the device of ``like`` (an index or a
    score), where the mod uses it."""
    return x.to(like.device)


def _to_bytes(ids: torch.Tensor) -> bytes:
    """The bytes of ``ids`` (or slopes, a table), a ready-made mod's key (its contents), read
    on the CPU."""
    return ids.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _constant(x: Any) -> torch.Tensor:
    """A ready-made score mod's array (slopes, a table) as a tensor cut from autograd: a
    constant by design (``spec.SCORE_MOD``), on every path (a learned table: a callable of
    your own, or ``bias=``)."""
    return _as_tensor(x).detach()


def document_mod(segment_ids: Any) -> MaskMod:
    """Equal segment ids only: ``segment_ids`` one array ``(..., seq)`` or a pair ``((...,
    q_len), (..., kv_len))`` as ``scaled_dot_product_attention``'s; ``(seq,)`` ids serve every
    batch entry. Equals ``segment_ids=``."""
    return ready_mods.document_mod(segment_ids, _as_tensor, _place, to_bytes=_to_bytes)


def alibi_mod(slopes: Any, offset: int = 0) -> ScoreMod:
    """``score - slopes[head] · |q_idx + offset - kv_idx|``: equals ``alibi_slopes=slopes``
    with ``offset`` the causal alignment's (derivative 1)."""
    return ready_mods.alibi_mod(_constant(slopes), offset, torch.ones_like, _place,
                                to_bytes=_to_bytes)


def softcap_mod(softcap: float) -> ScoreMod:
    """``softcap · tanh(score / softcap)``: equals ``softcap=`` when there is no bias nor ALiBi
    (the dedicated soft-cap comes before them); derivative ``1 - tanh²``."""
    return ready_mods.softcap_mod(softcap, torch.tanh, torch.square)


def relative_bias_mod(table: Any, offset: int = 0) -> ScoreMod:
    """``score + table[head, clip(kv_idx - q_idx - offset, -m, m) + m]`` for a ``(heads,
    2m + 1)`` table (T5-like relative position bias, distances clipped at ``m``): equals
    ``bias=`` its tabulation (derivative 1)."""
    return ready_mods.relative_bias_mod(_constant(table), offset, torch.clamp, torch.ones_like,
                                        _place, to_bytes=_to_bytes)


# The mask mods use Python's operators only: the same objects in every backend
MaskMod, ScoreMod = ready_mods.MaskMod, ready_mods.ScoreMod
causal_mod, sliding_window_mod = ready_mods.causal_mod, ready_mods.sliding_window_mod
chunked_mod, prefix_lm_mod = ready_mods.chunked_mod, ready_mods.prefix_lm_mod
and_masks, or_masks = ready_mods.and_masks, ready_mods.or_masks
