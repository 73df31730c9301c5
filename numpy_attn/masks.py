"""Boolean mask builders. True means "may attend" everywhere in this project."""

from __future__ import annotations

import functools
import operator
from typing import Any

import numpy as np

import attention_rules as rules
from attention_rules import ready_mods

from ._arrays import _check_device
from ._masking import _in_band


def causal_mask(q_len: int, kv_len: int, *, offset: int = 0, device: Any = None) -> np.ndarray:
    """Boolean causal mask: query ``i`` may attend key ``j`` iff ``j <= i + offset``.

    Args:
      q_len: number of queries.
      kv_len: number of keys.
      offset: 0 for top-left alignment, ``kv_len - q_len`` for bottom-right.
      device: ``None`` or ``"cpu"``.

    Returns:
      ``(q_len, kv_len)`` bool, True = may attend.
    """
    fn = "causal_mask"
    q_len = rules.check_int(fn, "q_len", q_len)
    kv_len = rules.check_int(fn, "kv_len", kv_len)
    offset = rules.check_int(fn, "offset", offset, minimum=None)
    _check_device(fn, device)
    lo, hi = rules.band(q_len, kv_len, True, "top_left", None)  # j - i <= 0
    return _in_band(offset, q_len, 0, kv_len, lo, hi)  # queries from offset: (q_len, kv_len)


def sliding_window_mask(
    q_len: int, kv_len: int, window: tuple, *, offset: int = 0, device: Any = None
) -> np.ndarray:
    """Boolean local-attention mask: ``i + offset - left <= j <= i + offset + right``.

    Args:
      q_len: number of queries.
      kv_len: number of keys.
      window: ``(left, right)``, non-negative ints, ``None`` for unbounded.
      offset: alignment offset, as in ``causal_mask``.
      device: ``None`` or ``"cpu"``.

    Returns:
      ``(q_len, kv_len)`` bool, True = may attend.
    """
    fn = "sliding_window_mask"
    q_len = rules.check_int(fn, "q_len", q_len)
    kv_len = rules.check_int(fn, "kv_len", kv_len)
    offset = rules.check_int(fn, "offset", offset, minimum=None)
    left, right = rules.check_window(fn, window)
    _check_device(fn, device)
    lo, hi = rules.band(q_len, kv_len, False, "top_left", (left, right))  # -left <= j - i <= right
    return _in_band(offset, q_len, 0, kv_len, lo, hi)  # queries from offset: (q_len, kv_len)


def _lengths(fn: str, name: str, lengths: Any, max_len: int) -> np.ndarray:
    lengths = np.asarray(lengths)
    rules.check_lengths_1d(fn, name, (lengths.shape, lengths.dtype.name))
    rules.check_lengths(fn, name, lengths.tolist(), max_len)
    return lengths


def padding_mask(
    kv_lengths: Any,
    kv_len: int,
    *,
    q_lengths: Any = None,
    q_len: int | None = None,
    device: Any = None,
) -> np.ndarray:
    """Boolean padding mask from per-sequence lengths.

    Args:
      kv_lengths: ``(batch,)`` ints in ``[0, kv_len]``; key ``j`` of sequence ``b`` is allowed
        iff ``j < kv_lengths[b]``.
      kv_len: padded key length.
      q_lengths: optional ``(batch,)`` ints; query ``i`` of sequence ``b`` attends only if
        ``i < q_lengths[b]`` (a padded query's output is 0).
      q_len: padded query length, required with ``q_lengths``.
      device: ``None`` or ``"cpu"``.

    Returns:
      ``(batch, 1, 1, kv_len)`` bool, or ``(batch, 1, q_len, kv_len)`` with ``q_lengths``.
    """
    fn = "padding_mask"
    kv_len = rules.check_int(fn, "kv_len", kv_len)
    _check_device(fn, device)
    kv_lengths = _lengths(fn, "kv_lengths", kv_lengths, kv_len)
    key_ok = np.arange(kv_len) < kv_lengths[:, None]  # (batch, kv_len)
    mask = key_ok[:, None, None, :]  # (batch, 1, 1, kv_len)
    if q_lengths is None:
        return mask
    if q_len is None:
        raise ValueError(f"{fn}: q_lengths needs q_len; got q_len=None")
    q_len = rules.check_int(fn, "q_len", q_len)
    q_lengths = _lengths(fn, "q_lengths", q_lengths, q_len)
    if q_lengths.shape != kv_lengths.shape:
        raise ValueError(
            f"{fn}: q_lengths and kv_lengths must have the same batch; "
            f"got q_lengths.shape={q_lengths.shape}, kv_lengths.shape={kv_lengths.shape}"
        )
    query_ok = np.arange(q_len) < q_lengths[:, None]  # (batch, q_len)
    return mask & query_ok[:, None, :, None]  # (batch, 1, q_len, kv_len)


def combine_masks(*masks: Any) -> np.ndarray | None:
    """AND of boolean masks, broadcast together; ``None`` entries are skipped.

    Args:
      masks: boolean arrays, mutually broadcastable, e.g. ``(q_len, kv_len)`` and
        ``(batch, 1, 1, kv_len)``.

    Returns:
      the broadcast AND, e.g. ``(batch, 1, q_len, kv_len)``; ``None`` when every entry is None.
    """
    fn = "combine_masks"
    present = [np.asarray(m) for m in masks if m is not None]
    for index, m in enumerate(present):
        rules.check_bool(fn, f"masks[{index}]", m.dtype.name)
    if not present:
        return None
    rules.check_masks_broadcast(fn, [tuple(m.shape) for m in present])
    return functools.reduce(operator.and_, present)  # the broadcast AND


# ------------------------------------------------------------------------------------------
# Ready-made mods (spec.READY_MADE_MODS), written once in attention_rules.ready_mods: the mask
# mods are imported as they are (operators only); the ones that hold an array or call a
# function get NumPy's here (the score mods carry the derivative numpy_attn's VJPs need)
# ------------------------------------------------------------------------------------------


def _to_bytes(ids: np.ndarray) -> bytes:
    """The bytes of ``ids`` (or slopes, a table), a ready-made mod's key (its contents)."""
    return np.ascontiguousarray(ids).tobytes()


def document_mod(segment_ids: Any) -> MaskMod:
    """Equal segment ids only: ``segment_ids`` one array ``(..., seq)`` or a pair ``((...,
    q_len), (..., kv_len))`` as ``scaled_dot_product_attention``'s; ``(seq,)`` ids serve every
    batch entry. Equals ``segment_ids=``."""
    return ready_mods.document_mod(segment_ids, np.asarray, to_bytes=_to_bytes)


def alibi_mod(slopes: Any, offset: int = 0) -> ScoreMod:
    """``score - slopes[head] · |q_idx + offset - kv_idx|``: equals ``alibi_slopes=slopes``
    with ``offset`` the causal alignment's (derivative 1)."""
    return ready_mods.alibi_mod(np.asarray(slopes), offset, np.ones_like, to_bytes=_to_bytes)


def softcap_mod(softcap: float) -> ScoreMod:
    """``softcap · tanh(score / softcap)``: equals ``softcap=`` when there is no bias nor ALiBi
    (the dedicated soft-cap comes before them); derivative ``1 - tanh²``."""
    return ready_mods.softcap_mod(softcap, np.tanh, np.square)


def relative_bias_mod(table: Any, offset: int = 0) -> ScoreMod:
    """``score + table[head, clip(kv_idx - q_idx - offset, -m, m) + m]`` for a ``(heads,
    2m + 1)`` table (T5-like relative position bias, distances clipped at ``m``): equals
    ``bias=`` its tabulation (derivative 1)."""
    return ready_mods.relative_bias_mod(np.asarray(table), offset, np.clip, np.ones_like,
                                        to_bytes=_to_bytes)


# The mask mods use Python's operators only: the same objects in every backend
MaskMod, ScoreMod = ready_mods.MaskMod, ready_mods.ScoreMod
causal_mod, sliding_window_mod = ready_mods.causal_mod, ready_mods.sliding_window_mod
chunked_mod, prefix_lm_mod = ready_mods.chunked_mod, ready_mods.prefix_lm_mod
and_masks, or_masks = ready_mods.and_masks, ready_mods.or_masks
