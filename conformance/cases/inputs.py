"""The inputs of a conformance case: ``CaseData``, the shared shapes and the input builders of
the sinks, merge and paged-decoding cases (``conformance.cases`` holds the catalogue).

A merge case (``kind="merge"``) is an attention problem whose keys are split into ``parts``
disjoint sets: the int array ``key_part`` ``(kv_len,)`` gives each key its part, so a part may
be empty and its keys need not be contiguous. ``key_parts`` cuts the case's ``key``, ``value``
and its score-shaped ``mask`` and ``bias`` into the parts, in key order within each part; the
structure of a merge case is always an explicit ``mask`` (a causal rule or a window would mean
something else on an arbitrary subset of the keys).

A paged case (``kind="paged"``) decodes a batch of sequences from a paged KV cache
(``spec.PAGED_CACHE``): ``query (batch, heads, q_len, head_dim)``, the pool ``key_pages`` and
``value_pages`` ``(num_blocks, block_size, kv_heads, ·)``, ``block_table (batch, max_blocks)``
(each sequence's pages drawn from the pool shuffled, so page ``i`` of a sequence is seldom pool
page ``i``; -1 past its last page) and ``seq_lens (batch,)``; unused slots hold 1e4.
``contiguous`` gives the same problem as one ``scaled_dot_product_attention`` call: the
expected values' input.

A varlen case (``kind="varlen"``, ``varlen``) is a packed batch: ``query (total_q, heads,
head_dim)``, ``key``/``value (total_k, kv_heads, ·)``, ``cu_seq_q``/``cu_seq_k (N + 1,)`` int32
offsets, optional ``seqused_k (N,)`` and ``sinks``; ``varlen_pieces`` cuts it into one
bottom-right attention problem per sequence (the expected values' input), ``varlen_padded``
pads it into a batch for the peers (``varlen_packed`` and ``varlen_packed_lse`` pack results
back).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

B, H, TQ, TK, D = 2, 4, 5, 7, 8

SDPA_ARRAYS = ("query", "key", "value", "mask", "bias", "dropout_mask", "sinks", "alibi_slopes")
BLOCKWISE_TILES = {"block_q": 2, "block_kv": 3}
SDPA_OPTIONS = ("is_causal", "causal_alignment", "window", "scale", "softcap", "dropout_p",
                "chunk_size")
#: The arrays cut along the keys for each part of a merge case (score-shaped: the last axis).
PART_ARRAYS = ("key", "value", "mask", "bias")


@dataclass
class CaseData:
    """The inputs of one case: arrays (float64, bool or int) and scalar options."""

    arrays: dict[str, np.ndarray]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def finite(self) -> bool:
        """True when every floating input is finite (no NaN, no ±Inf)."""
        return all(np.isfinite(np.asarray(a).astype(np.float64)).all()
                   for a in self.arrays.values() if np.asarray(a).dtype.kind not in "biu")


@dataclass(frozen=True)
class Case:
    """A named conformance case (``conformance.cases`` holds the catalogue)."""

    name: str
    description: str
    build: Callable[[np.random.Generator], CaseData]
    kind: str = "sdpa"

    @property
    def seed(self) -> int:
        """The seed of the case's generator, derived from its name."""
        return zlib.crc32(self.name.encode())

    def data(self) -> CaseData:
        """The float64/bool inputs, drawn from the case's own seeded generator."""
        return self.build(np.random.default_rng(self.seed))


def sdpa_options(options: dict[str, Any]) -> dict[str, Any]:
    """The scalar options of ``scaled_dot_product_attention`` among ``options``."""
    return {k: v for k, v in options.items() if k in SDPA_OPTIONS}


def sdpa_arrays(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The array arguments of ``scaled_dot_product_attention`` among ``arrays``."""
    return {k: v for k, v in arrays.items() if k in SDPA_ARRAYS}


def normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Standard normal float64 of ``shape``."""
    return rng.standard_normal(shape)


def qkv(rng: np.random.Generator, q_len: int = TQ, kv_len: int = TK, kv_heads: int = H,
        v_dim: int = D) -> dict[str, np.ndarray]:
    """``query (B, H, q_len, D)``, ``key (B, kv_heads, kv_len, D)``, ``value (B, kv_heads,
    kv_len, v_dim)``."""
    return {
        "query": normal(rng, B, H, q_len, D),
        "key": normal(rng, B, kv_heads, kv_len, D),
        "value": normal(rng, B, kv_heads, kv_len, v_dim),
    }


def sink_logits(rng: np.random.Generator, heads: int = H) -> np.ndarray:
    """``(heads,)`` sink logits in [-2, 4): some heads put little weight on their sink, some
    most of it (the scores of these cases are about ±1)."""
    return rng.uniform(-2.0, 4.0, heads)


def fully_masked_mask(rng: np.random.Generator) -> np.ndarray:
    """``(B, H, TQ, TK)`` random mask with one fully masked row, the first query of sequence 1
    masked in every head and a whole head (1, 3) masked."""
    mask = rng.random((B, H, TQ, TK)) < 0.6
    mask[0, 1, 2] = False
    mask[1, :, 0] = False
    mask[1, 3] = False
    return mask


def with_sinks(arrays_fn: Callable[[np.random.Generator], dict[str, np.ndarray]]
               ) -> Callable[[np.random.Generator], dict[str, np.ndarray]]:
    """``arrays_fn``'s arrays and ``sinks`` ``(heads,)`` (``(1,)`` for 2-D inputs)."""
    def arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
        base = arrays_fn(rng)
        q = base["query"]
        return {**base, "sinks": sink_logits(rng, q.shape[-3] if q.ndim >= 3 else 1)}

    return arrays


# ------------------------------------------------------------------------------ merge


def random_split(rng: np.random.Generator, kv_len: int, parts: int, empty: bool
                 ) -> np.ndarray:
    """``(kv_len,)`` ints in ``[0, parts)``: the keys shuffled and cut into ``parts`` sets; with
    ``empty`` one of them (a random one) gets no key, every other at least one."""
    filled = parts - 1 if empty else parts
    order = rng.permutation(kv_len)
    cuts = np.sort(rng.choice(np.arange(1, kv_len), filled - 1, replace=False))
    labels = rng.permutation(parts)[:filled]  # which part each cut-off run of keys goes to
    key_part = np.empty(kv_len, np.int64)
    for label, keys in zip(labels, np.split(order, cuts), strict=True):
        key_part[keys] = label
    return key_part


def key_parts(arrays: dict[str, np.ndarray], parts: int) -> list[dict[str, np.ndarray]]:
    """The arrays of each part of a merge case: ``key``/``value`` ``(..., kv_heads, n_i, ·)``
    and ``mask``/``bias`` cut on their last axis (left whole where it is broadcast, size 1)."""
    key_part = np.asarray(arrays["key_part"])
    out = []
    for part in range(parts):
        keys = np.flatnonzero(key_part == part)
        piece = {}
        for name in PART_ARRAYS:
            if name not in arrays:
                continue
            x = np.asarray(arrays[name])
            if name in ("key", "value"):
                piece[name] = np.ascontiguousarray(x[..., keys, :])
            elif x.shape[-1] == 1:
                piece[name] = x
            else:
                piece[name] = np.ascontiguousarray(x[..., keys])
        out.append(piece)
    return out


def huge_causal(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """q_len 7 > kv_len 5, inputs x30 (logits ~1e4 at scale 1), bottom-right causal as a mask."""
    base = qkv(rng, q_len=TK, kv_len=TQ)
    base["query"], base["key"] = base["query"] * 30.0, base["key"] * 30.0
    return {**base, "mask": np.tril(np.ones((TK, TQ), bool), k=TQ - TK)}  # rows 0-1 empty


# ------------------------------------------------------------------------------ paged


def paged_layout(seq_lens: np.ndarray, block_size: int, num_blocks: int,
                 rng: np.random.Generator) -> np.ndarray:
    """``(batch, max_blocks)`` int64 block table: each sequence's pages, drawn without
    repetition from a pool of ``num_blocks`` pages (shuffled), unused entries -1."""
    need = [-(-int(n) // block_size) for n in seq_lens]
    pool = rng.permutation(num_blocks)
    table = np.full((len(seq_lens), max(max(need), 1)), -1, np.int64)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = pool[start:start + n]
        start += n
    return table


def pages_of(x: np.ndarray, table: np.ndarray, seq_lens: np.ndarray, num_blocks: int,
             block_size: int) -> np.ndarray:
    """Contiguous keys or values ``(batch, kv_heads, kv_len, dim)`` scattered into a page pool
    ``(num_blocks, block_size, kv_heads, dim)`` by ``table``; slots no sequence uses hold 1e4,
    which a correct kernel never lets count."""
    pool = np.full((num_blocks, block_size, x.shape[1], x.shape[-1]), 1e4)
    for b, n in enumerate(seq_lens):
        for j in range(int(n)):
            pool[table[b, j // block_size], j % block_size] = x[b, :, j, :]
    return pool


def paged(seq_lens: tuple[int, ...], q_len: int, block_size: int, num_blocks: int,
          kv_heads: int = 2) -> Callable[[np.random.Generator], dict[str, np.ndarray]]:
    """A paged case's arrays: ``query (batch, H, q_len, D)``, ``key_pages``/``value_pages``
    ``(num_blocks, block_size, kv_heads, D)``, ``block_table`` and ``seq_lens``."""
    def arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
        lens = np.array(seq_lens, np.int64)
        batch, kv_len = len(lens), max(int(lens.max()), 1)
        query = normal(rng, batch, H, q_len, D)
        key = normal(rng, batch, kv_heads, kv_len, D)
        value = normal(rng, batch, kv_heads, kv_len, D)
        table = paged_layout(lens, block_size, num_blocks, rng)
        return {"query": query, "key_pages": pages_of(key, table, lens, num_blocks, block_size),
                "value_pages": pages_of(value, table, lens, num_blocks, block_size),
                "block_table": table, "seq_lens": lens}

    return arrays


def contiguous(arrays: dict[str, np.ndarray], page_shift: int = 0) -> dict[str, np.ndarray]:
    """A paged case as one attention call: each sequence's keys and values gathered from its
    pages ``(batch, kv_heads, kv_len, ·)`` (kv_len: the longest sequence), and the mask
    ``(batch, 1, q_len, kv_len)`` of ``paged_attention``'s rule, query ``i`` of sequence ``b``
    attending ``j <= seq_lens[b] - q_len + i``; ``query`` and ``sinks`` as they are.
    ``page_shift``: read page ``(block_table + page_shift) % num_blocks`` (a mistake)."""
    kp, vp = np.asarray(arrays["key_pages"]), np.asarray(arrays["value_pages"])
    table, lens = np.asarray(arrays["block_table"]), np.asarray(arrays["seq_lens"])
    query = arrays["query"]
    num_blocks, block_size = kp.shape[:2]
    batch, q_len, kv_len = len(lens), query.shape[-2], max(int(lens.max(initial=0)), 1)
    out = {n: np.zeros((batch, p.shape[2], kv_len, p.shape[3]), p.dtype)
           for n, p in (("key", kp), ("value", vp))}
    for b, n in enumerate(lens):
        for j in range(int(n)):
            page = (table[b, j // block_size] + page_shift) % num_blocks
            out["key"][b, :, j] = kp[page, j % block_size]
            out["value"][b, :, j] = vp[page, j % block_size]
    i, j = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    mask = j[None] <= lens[:, None, None] - q_len + i[None]  # (batch, q_len, kv_len)
    result = {"query": query, **out, "mask": mask[:, None]}
    if "sinks" in arrays:
        result["sinks"] = arrays["sinks"]
    return result


# ------------------------------------------------------------------------------ varlen


def offsets(lengths: tuple[int, ...]) -> np.ndarray:
    """``(N + 1,)`` int32 cumulative offsets of sequences of ``lengths``."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def varlen(q_lens: tuple[int, ...], k_lens: tuple[int, ...], kv_heads: int = H,
           seqused_k: tuple[int, ...] | None = None, sinks: bool = False
           ) -> Callable[[np.random.Generator], dict[str, np.ndarray]]:
    """A varlen case's arrays: ``query (total_q, H, D)``, ``key``/``value (total_k, kv_heads,
    D)``, ``cu_seq_q``/``cu_seq_k`` (int32), and ``seqused_k (N,)`` (int32), ``sinks (H,)``."""
    def arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
        out = {"query": normal(rng, sum(q_lens), H, D),
               "key": normal(rng, sum(k_lens), kv_heads, D),
               "value": normal(rng, sum(k_lens), kv_heads, D),
               "cu_seq_q": offsets(q_lens), "cu_seq_k": offsets(k_lens)}
        if seqused_k is not None:
            out["seqused_k"] = np.array(seqused_k, np.int32)
        if sinks:
            out["sinks"] = sink_logits(rng)
        return out

    return arrays


def window_of(window_size: tuple[int, int]) -> tuple | None:
    """``varlen_attention``'s ``window_size`` (-1 unbounded) as the spec's ``window``."""
    left, right = (None if int(w) < 0 else int(w) for w in window_size)
    return None if left is None and right is None else (left, right)


@dataclass
class Piece:
    """One sequence of a packed batch: its query and key tokens and its sdpa problem, arrays
    ``(heads, n, dim)`` (``grad_output`` too, when the batch has one)."""

    q: slice
    k: slice  # the keys in use (seqused_k)
    arrays: dict[str, np.ndarray]
    options: dict[str, Any]


def varlen_pieces(arrays: dict[str, np.ndarray], options: dict[str, Any],
                  cu_seq_q: np.ndarray | None = None, cu_seq_k: np.ndarray | None = None
                  ) -> list[Piece]:
    """A varlen case as one attention problem per sequence (``spec.VARLEN``): bottom-right
    aligned, ``window_size`` as the window, ``scale``, ``softcap`` and ``sinks`` as given;
    other offsets than the case's may be given (a mistake replayed)."""
    cu_q = np.asarray(arrays["cu_seq_q"] if cu_seq_q is None else cu_seq_q)
    cu_k = np.asarray(arrays["cu_seq_k"] if cu_seq_k is None else cu_seq_k)
    used = arrays.get("seqused_k")
    sdpa = {"causal_alignment": "bottom_right", "window": window_of(
        options.get("window_size", (-1, -1))), **{k: options[k] for k in ("scale", "softcap")
                                                  if options.get(k) is not None}}
    pieces = []
    for i in range(len(cu_q) - 1):
        q = slice(int(cu_q[i]), int(cu_q[i + 1]))
        stop = int(cu_k[i + 1]) if used is None else int(cu_k[i]) + int(used[i])
        k = slice(int(cu_k[i]), stop)
        piece = {n: np.swapaxes(arrays[n][q if n in ("query", "grad_output") else k], 0, 1)
                 for n in ("query", "key", "value", "grad_output") if n in arrays}
        if "sinks" in arrays:
            piece["sinks"] = arrays["sinks"]
        pieces.append(Piece(q, k, piece, dict(sdpa)))
    return pieces


def varlen_padded(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A varlen case as a padded batch: ``query (N, heads, max_q, head_dim)``, ``key``/``value
    (N, kv_heads, max_k, ·)`` (zeros after each sequence), ``q_lengths``/``kv_lengths (N,)``
    (the keys in use) and ``sinks``; each sequence is bottom-right aligned to its lengths."""
    pieces = varlen_pieces(arrays, {})
    q_len = np.array([p.q.stop - p.q.start for p in pieces], np.int64)
    k_len = np.array([p.k.stop - p.k.start for p in pieces], np.int64)
    out: dict[str, np.ndarray] = {"q_lengths": q_len, "kv_lengths": k_len}
    for name, longest in (("query", q_len), ("key", k_len), ("value", k_len)):
        x = arrays[name]
        padded = np.zeros((len(pieces), x.shape[1], max(int(longest.max(initial=0)), 1),
                           x.shape[2]), x.dtype)
        for b, piece in enumerate(pieces):
            padded[b, :, :longest[b]] = piece.arrays[name]
        out[name] = padded
    if "sinks" in arrays:
        out["sinks"] = arrays["sinks"]
    return out


def varlen_packed(padded: np.ndarray, q_lengths: np.ndarray) -> np.ndarray:
    """``(N, heads, max_q, ·)`` back to tokens first, ``(total_q, heads, ·)``."""
    parts = [np.swapaxes(padded[b, :, :int(n)], 0, 1) for b, n in enumerate(q_lengths)]
    return np.concatenate(parts, axis=0)


def varlen_packed_lse(lse: np.ndarray, q_lengths: np.ndarray) -> np.ndarray:
    """An lse ``(N, heads, max_q)`` as ``varlen_attention``'s ``(heads, total_q)``."""
    return np.concatenate([lse[b, :, :int(n)] for b, n in enumerate(q_lengths)], axis=-1)


__all__ = ["BLOCKWISE_TILES", "PART_ARRAYS", "SDPA_ARRAYS", "SDPA_OPTIONS", "CaseData",
           "Case", "Piece", "contiguous", "fully_masked_mask", "key_parts", "normal", "offsets",
           "paged", "pages_of", "paged_layout", "qkv", "varlen", "varlen_packed",
           "varlen_packed_lse", "varlen_padded", "varlen_pieces", "window_of",
           "huge_causal", "random_split", "sdpa_arrays", "sdpa_options", "sink_logits",
           "with_sinks"]
