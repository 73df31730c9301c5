"""Which query/key positions the causal rule and the window allow, and which tiles keep one.

Pure index arithmetic on Python ints, shared by every backend's ``blockwise_attention`` and
blocked fast path: the band ``lo <= j - i <= hi`` of allowed key ``j`` minus query ``i``, the
tiles that keep at least one position, the key range a block of queries can see (forward
passes) and the query range a block of keys is seen by (backward passes).
"""

from __future__ import annotations

import math

from .checks import causal_offset

Window = tuple[int | None, int | None] | None
Band = tuple[float, float]  # (lo, hi): ints, or -inf / +inf where unbounded


def band(
    q_len: int, kv_len: int, is_causal: bool, causal_alignment: str, window: Window
) -> Band:
    """Allowed range ``lo <= j - i <= hi`` of key ``j`` minus query ``i`` (causal and window).

    ``(-inf, inf)`` without the causal rule and the window; the causal rule gives
    ``hi = offset`` and the window ``(left, right)`` gives ``offset - left <= j - i <=
    offset + right``, with the offset of ``causal_alignment``.
    """
    offset = causal_offset(causal_alignment, q_len, kv_len)
    lo, hi = -math.inf, math.inf
    if is_causal:
        hi = offset
    if window is not None:
        left, right = window
        if left is not None:
            lo = offset - left
        if right is not None:
            hi = min(hi, offset + right)
    return lo, hi


def plan(
    q_len: int, kv_len: int, block_q: int, block_kv: int, lo: float, hi: float
) -> list[tuple[int, int, list[tuple[int, int, bool]]]]:
    """Per query block ``(q_start, q_stop)``, the key blocks ``(kv_start, kv_stop, partial)``
    that keep at least one position of the band; ``partial``: the band cuts the tile (it needs
    a mask). Tiles outside the band are left out: they are never computed."""
    tiles = []
    for q_start in range(0, q_len, block_q):
        q_stop = min(q_start + block_q, q_len)
        blocks = []
        for kv_start in range(0, kv_len, block_kv):
            kv_stop = min(kv_start + block_kv, kv_len)
            d_min, d_max = kv_start - (q_stop - 1), (kv_stop - 1) - q_start  # j - i in the tile
            if max(lo, d_min) > min(hi, d_max):
                continue  # fully masked by the causal rule or the window: never computed
            blocks.append((kv_start, kv_stop, d_min < lo or d_max > hi))
        tiles.append((q_start, q_stop, blocks))
    return tiles


def key_range(i0: int, i1: int, kv_len: int, lo: float, hi: float) -> tuple[int, int, int, int]:
    """The keys that query rows ``[i0, i1)`` see in the band ``lo <= j - i <= hi``:
    ``(k0, k1, a, b)`` with every allowed key in ``[k0, k1)`` and the columns ``[a, b)``
    allowed for every row of the block (``a == b``: none is; ``k0 == k1``: no key at all)."""
    k0 = 0 if lo == -math.inf else min(max(0, i0 + int(lo)), kv_len)
    k1 = kv_len if hi == math.inf else max(min(kv_len, i1 + int(hi)), 0)
    k1 = max(k1, k0)
    a = k0 if lo == -math.inf else min(max(k0, i1 - 1 + int(lo)), k1)
    b = k1 if hi == math.inf else max(min(k1, i0 + int(hi) + 1), a)
    return k0, k1, a, b


def query_range(
    k0: int, k1: int, q_len: int, lo: float, hi: float
) -> tuple[int, int, int, int]:
    """The queries that see key rows ``[k0, k1)`` in the band ``lo <= j - i <= hi``:
    ``(q0, q1, a, b)`` with every query that sees one of the keys in ``[q0, q1)`` and the
    queries ``[a, b)`` allowed to see every key of the block (``a == b``: none is; ``q0 == q1``:
    no query sees them). ``key_range`` with the roles swapped: ``-hi <= i - j <= -lo``."""
    return key_range(k0, k1, q_len, -hi, -lo)
