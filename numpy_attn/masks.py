"""Boolean mask builders. True means "may attend" everywhere in this project."""

from __future__ import annotations

from typing import Any

import numpy as np

import attention_rules as rules

from ._core import _check_device, _in_band


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
    if rules.broadcast_shapes(*(tuple(m.shape) for m in present)) is None:
        shapes = ", ".join(str(tuple(m.shape)) for m in present)
        raise ValueError(f"{fn}: masks must broadcast together; got shapes {shapes}")
    combined = present[0]
    for m in present[1:]:
        combined = combined & m
    return combined


# ------------------------------------------------------------------------------------------
# Ready-made mods (spec.READY_MADE_MODS): FlexAttention's mask_mod / score_mod callables, each
# equal to a dedicated argument, on NumPy arrays (the score mods carry the derivative that
# numpy_attn's VJPs need)
# ------------------------------------------------------------------------------------------


class MaskMod:
    """A ready-made ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` (``spec.MASK_MOD``).

    Two made from equal arguments are equal and hash alike (arrays by identity), so under a
    JIT a mod made again is not a new static argument. ``repr`` shows how it was made."""

    def __init__(self, fn: Any, name: str, key: tuple) -> None:
        self._fn, self._name, self._key = fn, name, key

    def __call__(self, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self._fn(batch, head, q_idx, kv_idx)

    def __repr__(self) -> str:
        return self._name

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._key == other._key  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key))


class ScoreMod(MaskMod):
    """A ready-made ``score_mod(score, batch, head, q_idx, kv_idx) -> score`` with its
    ``derivative(score, batch, head, q_idx, kv_idx)`` = d score_mod / d score, which numpy_attn's
    hand-written VJPs need (``spec.SCORE_MOD``)."""

    def __init__(self, fn: Any, derivative: Any, name: str, key: tuple) -> None:
        super().__init__(fn, name, key)
        self._derivative = derivative

    def __call__(self, score: Any, batch: Any, head: Any, q_idx: Any,  # type: ignore[override]
                 kv_idx: Any) -> Any:
        return self._fn(score, batch, head, q_idx, kv_idx)

    def derivative(self, score: Any, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        """``d score_mod / d score`` at ``score``, broadcastable to it."""
        return self._derivative(score, batch, head, q_idx, kv_idx)


def _ones(score: Any, *indices: Any) -> Any:
    return np.ones_like(score)


def causal_mod(offset: int = 0) -> MaskMod:
    """``q_idx + offset >= kv_idx``: equals ``is_causal=True`` with ``offset`` the causal
    alignment's (0 top-left, ``kv_len - q_len`` bottom-right)."""
    offset = rules.check_int("causal_mod", "offset", offset, minimum=None)
    return MaskMod(lambda b, h, q, k: q + offset >= k, f"causal_mod(offset={offset})",
                   ("causal", offset))


def sliding_window_mod(window: tuple, offset: int = 0) -> MaskMod:
    """``q_idx + offset - left <= kv_idx <= q_idx + offset + right``: equals ``window``."""
    fn = "sliding_window_mod"
    left, right = rules.check_window(fn, window)
    offset = rules.check_int(fn, "offset", offset, minimum=None)

    def mod(b: Any, h: Any, q: Any, k: Any) -> Any:
        distance = k - q - offset  # j - (i + offset)
        lower = distance >= -left if left is not None else distance == distance
        return lower & (distance <= right) if right is not None else lower

    return MaskMod(mod, f"sliding_window_mod({(left, right)}, offset={offset})",
                   ("window", left, right, offset))


def chunked_mod(chunk_size: int, offset: int = 0) -> MaskMod:
    """``(q_idx + offset) // chunk_size == kv_idx // chunk_size``: equals ``chunk_size``."""
    fn = "chunked_mod"
    chunk = rules.check_chunk_size(fn, chunk_size)
    if chunk is None:
        raise ValueError(f"{fn}: chunk_size must be a positive int; got chunk_size=None")
    offset = rules.check_int(fn, "offset", offset, minimum=None)
    return MaskMod(lambda b, h, q, k: (q + offset) // chunk == k // chunk,
                   f"chunked_mod({chunk}, offset={offset})", ("chunked", chunk, offset))


def prefix_lm_mod(prefix_length: int, offset: int = 0) -> MaskMod:
    """``kv_idx < prefix_length or q_idx + offset >= kv_idx``: a prefix every query sees (the
    prompt), causal after it."""
    fn = "prefix_lm_mod"
    prefix = rules.check_int(fn, "prefix_length", prefix_length)
    offset = rules.check_int(fn, "offset", offset, minimum=None)
    return MaskMod(lambda b, h, q, k: (k < prefix) | (q + offset >= k),
                   f"prefix_lm_mod({prefix}, offset={offset})", ("prefix_lm", prefix, offset))


def document_mod(segment_ids: Any) -> MaskMod:
    """Equal segment ids only: ``segment_ids`` one array ``(..., seq)`` or a pair ``((...,
    q_len), (..., kv_len))`` as ``scaled_dot_product_attention``'s; ``(seq,)`` ids serve every
    batch entry. Equals ``segment_ids=``."""
    pair = segment_ids if isinstance(segment_ids, (list, tuple)) else (segment_ids, segment_ids)
    q_ids, kv_ids = (np.asarray(x) for x in pair)
    q_ids, kv_ids = (x.reshape(-1, x.shape[-1]) for x in (q_ids, kv_ids))  # (batch | 1, seq)

    def mod(b: Any, h: Any, q: Any, k: Any) -> Any:
        bq = b if q_ids.shape[0] > 1 else b * 0  # (seq,) ids: the same for every batch entry
        bk = b if kv_ids.shape[0] > 1 else b * 0
        return q_ids[bq, q] == kv_ids[bk, k]

    return MaskMod(mod, "document_mod(...)", ("document", id(pair[0]), id(pair[-1])))


def and_masks(*mask_mods: Any) -> MaskMod:
    """The AND of ``mask_mods``."""
    def mod(b: Any, h: Any, q: Any, k: Any) -> Any:
        result = mask_mods[0](b, h, q, k)
        for other in mask_mods[1:]:
            result = result & other(b, h, q, k)
        return result

    return MaskMod(mod, f"and_masks{mask_mods}", ("and",) + mask_mods)


def or_masks(*mask_mods: Any) -> MaskMod:
    """The OR of ``mask_mods``."""
    def mod(b: Any, h: Any, q: Any, k: Any) -> Any:
        result = mask_mods[0](b, h, q, k)
        for other in mask_mods[1:]:
            result = result | other(b, h, q, k)
        return result

    return MaskMod(mod, f"or_masks{mask_mods}", ("or",) + mask_mods)


def alibi_mod(slopes: Any, offset: int = 0) -> ScoreMod:
    """``score - slopes[head] · |q_idx + offset - kv_idx|``: equals ``alibi_slopes=slopes``
    with ``offset`` the causal alignment's (derivative 1)."""
    offset = rules.check_int("alibi_mod", "offset", offset, minimum=None)
    slopes = np.asarray(slopes)
    return ScoreMod(lambda s, b, h, q, k: s - slopes[h] * abs(q + offset - k), _ones,
                    f"alibi_mod(..., offset={offset})", ("alibi", id(slopes), offset))


def softcap_mod(softcap: float) -> ScoreMod:
    """``softcap · tanh(score / softcap)``: equals ``softcap=`` when there is no bias nor ALiBi
    (the dedicated soft-cap comes before them); derivative ``1 - tanh²``."""
    cap = rules.check_softcap("softcap_mod", softcap)
    return ScoreMod(lambda s, b, h, q, k: cap * np.tanh(s / cap),
                    lambda s, b, h, q, k: 1.0 - np.square(np.tanh(s / cap)),
                    f"softcap_mod({cap})", ("softcap", cap))


def relative_bias_mod(table: Any, offset: int = 0) -> ScoreMod:
    """``score + table[head, clip(kv_idx - q_idx - offset, -m, m) + m]`` for a ``(heads,
    2m + 1)`` table (T5-like relative position bias, distances clipped at ``m``): equals
    ``bias=`` its tabulation (derivative 1)."""
    offset = rules.check_int("relative_bias_mod", "offset", offset, minimum=None)
    table = np.asarray(table)
    m = (table.shape[-1] - 1) // 2
    return ScoreMod(lambda s, b, h, q, k: s + table[h, np.clip(k - q - offset, -m, m) + m],
                    _ones, f"relative_bias_mod(..., offset={offset})",
                    ("relative", id(table), offset))
