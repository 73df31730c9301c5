"""The ready-made mods (``spec.READY_MADE_MODS``), written once for the three backends.

FlexAttention's callables: a ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` says which
``(q, k)`` pairs may attend (True = may attend), a ``score_mod(score, batch, head, q_idx,
kv_idx) -> score`` changes a score. Each ready-made mod equals a dedicated argument of
``scaled_dot_product_attention`` (``causal_mod`` equals ``is_causal=True``, ``alibi_mod`` equals
``alibi_slopes=``…), so the two can be checked against each other.

The mask mods use only Python's operators on the index arrays they are called with, so they are
the same objects in every backend (each backend's ``masks`` module imports them from here). The
mods that hold an array (segment ids, slopes, a bias table) or call a function (``tanh``) take
it from the backend's ``masks`` module, already converted to that backend's arrays, with the
array functions they need; nothing here imports an array library.

Two mods made from equal arguments are equal and hash alike (arrays by their contents: shape,
dtype and bytes; functions by identity), so under a JIT a mod made again is not a new static
argument, and a mod made from other ids is never taken for an earlier one (a freed array's
``id`` is reused); ``repr`` shows how it was made.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from .checks import check_int, check_softcap, check_window
from .mods import check_chunk_size


class MaskMod:
    """A ready-made ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` (``spec.MASK_MOD``).

    Two made from equal arguments are equal and hash alike (arrays by contents), so under a
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
    ``derivative(score, batch, head, q_idx, kv_idx)`` = d score_mod / d score, which the
    hand-written VJPs (numpy_attn's, the blocked fast paths') need (``spec.SCORE_MOD``)."""

    def __init__(self, fn: Any, derivative: Any, name: str, key: tuple) -> None:
        super().__init__(fn, name, key)
        self._derivative = derivative

    def __call__(self, score: Any, batch: Any, head: Any, q_idx: Any,  # type: ignore[override]
                 kv_idx: Any) -> Any:
        return self._fn(score, batch, head, q_idx, kv_idx)

    def derivative(self, score: Any, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        """``d score_mod / d score`` at ``score``, broadcastable to it."""
        return self._derivative(score, batch, head, q_idx, kv_idx)


def _here(array: Any, like: Any) -> Any:
    """``array`` where ``like`` lives: NumPy and JAX index across devices themselves."""
    return array


def _contents_key(array: Any, to_bytes: Callable) -> tuple:
    """A mod's key for an array it holds: ``(shape, dtype, sha256 of its bytes)``, so equal
    contents key alike and other contents never do; ``to_bytes`` is the backend's (None for
    an array without values, a JAX tracer: keyed by the identity of the array the mod holds)."""
    data = to_bytes(array)
    if data is None:
        return ("id", id(array))
    return (tuple(array.shape), str(array.dtype), hashlib.sha256(data).hexdigest())


# ------------------------------------------------------------------------------------------
# Mask mods: operators only, the same objects in every backend
# ------------------------------------------------------------------------------------------


def causal_mod(offset: int = 0) -> MaskMod:
    """``q_idx + offset >= kv_idx``: equals ``is_causal=True`` with ``offset`` the causal
    alignment's (0 top-left, ``kv_len - q_len`` bottom-right)."""
    offset = check_int("causal_mod", "offset", offset, minimum=None)
    return MaskMod(lambda b, h, q, k: q + offset >= k, f"causal_mod(offset={offset})",
                   ("causal", offset))


def sliding_window_mod(window: tuple, offset: int = 0) -> MaskMod:
    """``q_idx + offset - left <= kv_idx <= q_idx + offset + right``: equals ``window``."""
    fn = "sliding_window_mod"
    left, right = check_window(fn, window)
    offset = check_int(fn, "offset", offset, minimum=None)

    def mod(b: Any, h: Any, q: Any, k: Any) -> Any:
        distance = k - q - offset  # j - (i + offset)
        lower = distance >= -left if left is not None else distance == distance
        return lower & (distance <= right) if right is not None else lower

    return MaskMod(mod, f"sliding_window_mod({(left, right)}, offset={offset})",
                   ("window", left, right, offset))


def chunked_mod(chunk_size: int, offset: int = 0) -> MaskMod:
    """``(q_idx + offset) // chunk_size == kv_idx // chunk_size``: equals ``chunk_size``."""
    fn = "chunked_mod"
    chunk = check_chunk_size(fn, chunk_size)
    if chunk is None:
        raise ValueError(f"{fn}: chunk_size must be a positive int; got chunk_size=None")
    offset = check_int(fn, "offset", offset, minimum=None)
    return MaskMod(lambda b, h, q, k: (q + offset) // chunk == k // chunk,
                   f"chunked_mod({chunk}, offset={offset})", ("chunked", chunk, offset))


def prefix_lm_mod(prefix_length: int, offset: int = 0) -> MaskMod:
    """``kv_idx < prefix_length or q_idx + offset >= kv_idx``: a prefix every query sees (the
    prompt), causal after it."""
    fn = "prefix_lm_mod"
    prefix = check_int(fn, "prefix_length", prefix_length)
    offset = check_int(fn, "offset", offset, minimum=None)
    return MaskMod(lambda b, h, q, k: (k < prefix) | (q + offset >= k),
                   f"prefix_lm_mod({prefix}, offset={offset})", ("prefix_lm", prefix, offset))


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


# ------------------------------------------------------------------------------------------
# Mods that hold a backend's arrays or call its functions (the backend's masks module passes
# them in)
# ------------------------------------------------------------------------------------------


def document_mod(segment_ids: Any, as_array: Callable, place: Callable = _here, *,
                 to_bytes: Callable) -> MaskMod:
    """Equal segment ids only: ``segment_ids`` one array ``(..., seq)`` or a pair ``((...,
    q_len), (..., kv_len))``; ``(seq,)`` ids serve every batch entry. ``as_array`` converts an
    id array to the backend's arrays, ``place(ids, index)`` moves ids to the index's device,
    ``to_bytes(ids)`` gives their bytes (the mod's key: contents, never the caller's ``id``)."""
    pair = segment_ids if isinstance(segment_ids, (list, tuple)) else (segment_ids, segment_ids)
    q_ids, kv_ids = (as_array(x) for x in pair)
    q_ids, kv_ids = (x.reshape(-1, x.shape[-1]) for x in (q_ids, kv_ids))  # (batch | 1, seq)

    def mod(b: Any, h: Any, q: Any, k: Any) -> Any:
        bq = b if q_ids.shape[0] > 1 else b * 0  # (seq,) ids: the same for every batch entry
        bk = b if kv_ids.shape[0] > 1 else b * 0
        return place(q_ids, q)[bq, q] == place(kv_ids, k)[bk, k]

    return MaskMod(mod, "document_mod(...)", ("document", _contents_key(q_ids, to_bytes),
                                              _contents_key(kv_ids, to_bytes)))


def alibi_mod(slopes: Any, offset: int, ones_like: Callable, place: Callable = _here, *,
              to_bytes: Callable) -> ScoreMod:
    """``score - slopes[head] · |q_idx + offset - kv_idx|`` (derivative 1): ``slopes`` already
    the backend's array, cut from autodiff (a constant, ``spec.SCORE_MOD``), ``ones_like`` and
    ``to_bytes`` the backend's."""
    offset = check_int("alibi_mod", "offset", offset, minimum=None)
    return ScoreMod(lambda s, b, h, q, k: s - place(slopes, s)[h] * abs(q + offset - k),
                    lambda s, *indices: ones_like(s), f"alibi_mod(..., offset={offset})",
                    ("alibi", _contents_key(slopes, to_bytes), offset))


def softcap_mod(softcap: float, tanh: Callable, square: Callable) -> ScoreMod:
    """``softcap · tanh(score / softcap)``, derivative ``1 - tanh²``, with the backend's
    ``tanh`` and ``square``."""
    cap = check_softcap("softcap_mod", softcap)
    return ScoreMod(lambda s, b, h, q, k: cap * tanh(s / cap),
                    lambda s, b, h, q, k: 1.0 - square(tanh(s / cap)),
                    f"softcap_mod({cap})", ("softcap", cap, tanh))


def relative_bias_mod(table: Any, offset: int, clip: Callable, ones_like: Callable,
                      place: Callable = _here, *, to_bytes: Callable) -> ScoreMod:
    """``score + table[head, clip(kv_idx - q_idx - offset, -m, m) + m]`` for a ``(heads,
    2m + 1)`` table (derivative 1): ``table`` already the backend's array, cut from autodiff
    (a constant, ``spec.SCORE_MOD``), with the backend's ``clip``, ``ones_like`` and
    ``to_bytes``."""
    offset = check_int("relative_bias_mod", "offset", offset, minimum=None)
    m = (table.shape[-1] - 1) // 2
    return ScoreMod(lambda s, b, h, q, k: s + place(table, s)[h, clip(k - q - offset, -m, m) + m],
                    lambda s, *indices: ones_like(s), f"relative_bias_mod(..., offset={offset})",
                    ("relative", _contents_key(table, to_bytes), offset))
