"""The rules of packed variable-length batches: ``varlen_attention``, its VJP and the converters.

A packed batch stores ``N`` sequences one after another along the token axis, without padding:
query ``(total_q, heads, head_dim)``, key ``(total_k, kv_heads, head_dim)`` and value
``(total_k, kv_heads, v_dim)``, with the cumulative offsets ``cu_seq_q`` and ``cu_seq_k``
(``(N + 1,)`` ints: sequence ``i`` holds tokens ``cu_seq[i]:cu_seq[i + 1]``), as
``torch.nn.attention.varlen.varlen_attn`` and flash-attn's ``flash_attn_varlen_func`` take them.
With ``block_table`` (paged keys), key and value are a pool of pages ``(total_pages, page_size,
kv_heads, dim)`` and sequence ``i``'s key ``t`` is ``key[block_table[i, t // page_size], t %
page_size]`` for ``t < seqused_k[i]``.

Two steps, like every rule here: ``varlen_arguments`` checks shapes, dtypes and options
(it sees ``(shape, dtype name)`` only, so it also runs under ``jax.jit`` with traced offsets);
``sequences`` checks the offsets' values (read to the host with ``.tolist()``) and returns each
sequence's token ranges. ``groups`` then gathers the sequences with the same (query length,
key length) so that each backend runs its own ``scaled_dot_product_attention`` once per group,
on a ``(sequences, heads, len, dim)`` batch: only the work inside the sequences, never a padded
``(N, max_len)`` computation. Every message starts with the function's name and names the
argument; offsets of the wrong dtype or shape and values that break a rule are ValueError (as
``kv_lengths``); a dtype of query, key or value is TypeError, as everywhere in the spec.
"""

from __future__ import annotations

import numbers
from itertools import pairwise
from typing import NamedTuple

from .arguments import Arguments, attention_arguments
from .checks import (
    ArrayInfo,
    Shape,
    check_flag,
    check_float_inputs,
    check_grad_output,
    check_int,
    check_scale,
    check_sinks,
    check_softcap,
)
from .tiles import Window

UNBOUNDED = -1  # window_size's "no limit on this side" (flash-attn, torch varlen_attn)


class VarlenArguments(NamedTuple):
    """The validated, normalised facts of one packed call."""

    dtype: str  # the dtype query, key and value share
    heads: int
    kv_heads: int
    head_dim: int
    v_dim: int
    total_q: int  # query tokens
    total_k: int  # key tokens (pages · page_size with block_table)
    count: int  # sequences: len(cu_seq_q) - 1
    max_q: int
    max_k: int
    scale: float
    softcap: float | None
    window: Window  # (left, right) with None for unbounded, or None: the spec's window
    return_lse: bool
    has_sinks: bool
    page_size: int | None  # block_table given: the pool's page size


class Sequence(NamedTuple):
    """One sequence's tokens: queries ``[q_start, q_start + q_len)`` of the packed query and
    keys ``[k_start, k_start + k_len)`` of the packed (with pages: gathered) key and value;
    ``k_len`` counts only the keys in use (``seqused_k``)."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int


class Group(NamedTuple):
    """Sequences of one shape, run as one ``(len(q_starts), heads, q_len, dim)`` batch."""

    q_len: int
    k_len: int
    q_starts: tuple[int, ...]
    k_starts: tuple[int, ...]


def _is_int_dtype(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


def check_window_size(fn: str, window_size: object) -> Window:
    """torch's ``window_size=(left, right)``, ``-1`` for unbounded: the spec's window, None
    when both sides are unbounded (ValueError for anything else)."""
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2
    ok = ok and all(isinstance(w, numbers.Integral) and not isinstance(w, bool)
                    and int(w) >= UNBOUNDED for w in window_size)
    if not ok:
        raise ValueError(
            f"{fn}: window_size must be a pair (left, right) of ints, each -1 (unbounded) or "
            f">= 0; (-1, 0) is causal; got window_size={window_size!r}"
        )
    left, right = (None if int(w) == UNBOUNDED else int(w) for w in window_size)
    return None if left is None and right is None else (left, right)


def check_offsets_info(fn: str, name: str, info: ArrayInfo, count: int | None) -> int:
    """``(N + 1,)`` ints, ``N + 1 >= 1`` (and ``N + 1 == count`` when given); returns N + 1."""
    shape, dtype = info
    if len(shape) != 1 or shape[0] < 1 or not _is_int_dtype(dtype):
        raise ValueError(
            f"{fn}: {name} must be a 1-D array of ints, the N + 1 cumulative offsets of N "
            f"sequences; got {name}.shape={tuple(shape)}, {name}.dtype={dtype}"
        )
    if count is not None and shape[0] != count:
        raise ValueError(
            f"{fn}: cu_seq_q and {name} must have the same length N + 1 (one entry per "
            f"sequence, plus one); got len(cu_seq_q)={count}, len({name})={shape[0]}"
        )
    return shape[0]


def varlen_arguments(
    fn: str,
    query: ArrayInfo,
    key: ArrayInfo,
    value: ArrayInfo,
    cu_seq_q: ArrayInfo,
    cu_seq_k: ArrayInfo | None,
    max_q: object,
    max_k: object,
    *,
    grad_output: ArrayInfo | None = None,
    scale: object = None,
    window_size: object = (-1, -1),
    enable_gqa: object = False,
    seqused_k: ArrayInfo | None = None,
    block_table: ArrayInfo | None = None,
    return_lse: object = False,
    softcap: object = None,
    sinks: ArrayInfo | None = None,
) -> VarlenArguments:
    """Every rule on shapes, dtypes and options, in order; the normalised facts.

    Args:
      fn: the public function's name, which starts every message.
      query, key, value, cu_seq_q, cu_seq_k, seqused_k, block_table, sinks, grad_output:
        ``(shape, dtype name)`` (None where not given).
      max_q, max_k, scale, window_size, enable_gqa, return_lse, softcap: as given.

    Returns:
      ``VarlenArguments``; raises TypeError (dtypes of query, key, value, sinks; Python lists)
      or ValueError (everything else).
    """
    dtypes = {"query": query[1], "key": key[1], "value": value[1]}
    if grad_output is not None:
        dtypes["grad_output"] = grad_output[1]
    dtype = check_float_inputs(fn, **dtypes)
    q_shape, k_shape, v_shape = tuple(query[0]), tuple(key[0]), tuple(value[0])
    paged = block_table is not None
    kv_rank, kv_layout = (4, "(total_pages, page_size, kv_heads, dim) with block_table") if \
        paged else (3, "(total_k, kv_heads, dim)")
    described = f"query.shape={q_shape}, key.shape={k_shape}, value.shape={v_shape}"
    if len(q_shape) != 3 or len(k_shape) != kv_rank or len(v_shape) != kv_rank:
        raise ValueError(
            f"{fn}: query must be (total_q, heads, head_dim) and key and value "
            f"{kv_layout}; got {described}"
        )
    if k_shape[:-1] != v_shape[:-1]:
        raise ValueError(
            f"{fn}: key and value must have the same tokens and kv_heads; got {described}"
        )
    if q_shape[-1] != k_shape[-1]:
        raise ValueError(f"{fn}: query and key must have the same head_dim; got {described}")
    heads, kv_heads = q_shape[1], k_shape[-2]
    enable_gqa = check_flag(fn, "enable_gqa", enable_gqa)
    if heads != kv_heads and not enable_gqa:
        raise ValueError(
            f"{fn}: query and key/value must have the same heads unless enable_gqa=True; "
            f"got {described}"
        )
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"{fn}: the heads of query must be a whole multiple of the heads of key/value "
            f"(grouped-query attention); got {described}"
        )
    if grad_output is not None:
        check_grad_output(fn, grad_output[0], q_shape[:-1] + v_shape[-1:])
    count = check_offsets_info(fn, "cu_seq_q", cu_seq_q, None)
    if cu_seq_k is None and not paged:
        raise ValueError(f"{fn}: cu_seq_k is required without block_table; got cu_seq_k=None")
    if cu_seq_k is not None:
        check_offsets_info(fn, "cu_seq_k", cu_seq_k, count)
    max_q = check_int(fn, "max_q", max_q)
    max_k = check_int(fn, "max_k", max_k)
    _check_lengths_info(fn, seqused_k, block_table, count - 1)
    check_sinks(fn, sinks, heads)
    return VarlenArguments(
        dtype, heads, kv_heads, q_shape[-1], v_shape[-1], q_shape[0],
        k_shape[0] * k_shape[1] if paged else k_shape[0], count - 1, max_q, max_k,
        check_scale(fn, scale, q_shape[-1]), check_softcap(fn, softcap),
        check_window_size(fn, window_size), check_flag(fn, "return_lse", return_lse),
        sinks is not None, k_shape[1] if paged else None,
    )


def _check_lengths_info(
    fn: str, seqused_k: ArrayInfo | None, block_table: ArrayInfo | None, count: int
) -> None:
    """``seqused_k (N,)`` ints; ``block_table (N, pages)`` ints and only with ``seqused_k``."""
    if seqused_k is not None:
        shape, dtype = seqused_k
        if tuple(shape) != (count,) or not _is_int_dtype(dtype):
            raise ValueError(
                f"{fn}: seqused_k must be ({count},) ints, the keys in use per sequence; "
                f"got seqused_k.shape={tuple(shape)}, seqused_k.dtype={dtype}"
            )
    if block_table is not None:
        shape, dtype = block_table
        if len(shape) != 2 or shape[0] != count or not _is_int_dtype(dtype):
            raise ValueError(
                f"{fn}: block_table must be ({count}, max_pages_per_sequence) ints, page "
                f"indices; got block_table.shape={tuple(shape)}, block_table.dtype={dtype}"
            )
        if seqused_k is None:
            raise ValueError(
                f"{fn}: block_table needs seqused_k, the keys in use per sequence (the last "
                f"page is usually part full); got seqused_k=None"
            )


def check_offsets(fn: str, name: str, offsets: list[int], total: int | None, what: str) -> None:
    """Offsets start at 0, never decrease and (``total`` given) end at ``total``."""
    if offsets[0] != 0:
        raise ValueError(f"{fn}: {name} must start at 0; got {name}[0]={offsets[0]}")
    for i, (a, b) in enumerate(pairwise(offsets)):
        if b < a:
            raise ValueError(
                f"{fn}: {name} must be non-decreasing (a sequence cannot have a negative "
                f"length); got {name}[{i}]={a} > {name}[{i + 1}]={b}"
            )
    if total is not None and offsets[-1] != total:
        raise ValueError(
            f"{fn}: {name} must end at the number of {what} tokens, {total}; "
            f"got {name}[-1]={offsets[-1]}"
        )


def check_max_len(fn: str, name: str, given: int, lengths: list[int], what: str) -> None:
    """``given`` bounds every length (flash-attn sizes its grid by it and would skip the rest
    of a longer sequence without a word)."""
    longest = max(lengths, default=0)
    if given < longest:
        raise ValueError(
            f"{fn}: {name} must be at least the longest {what} sequence, {longest} (the "
            f"offsets disagree with it); got {name}={given}"
        )


def sequences(
    fn: str,
    args: VarlenArguments,
    cu_seq_q: list[int],
    cu_seq_k: list[int] | None,
    seqused_k: list[int] | None = None,
    block_table: list[list[int]] | None = None,
) -> list[Sequence]:
    """The offsets' values checked (ValueError naming the rule); each sequence's tokens.

    Args:
      fn: the public function's name.
      args: ``varlen_arguments``' result.
      cu_seq_q, cu_seq_k: the offsets as Python ints (``cu_seq_k`` may be None with pages).
      seqused_k: keys in use per sequence, or None (all of them).
      block_table: ``(N, pages)`` page indices, or None. With pages, the sequences' keys are
        numbered in the order ``paged_key_index`` gathers them.

    Returns:
      ``N`` ``Sequence``s, in order.
    """
    check_offsets(fn, "cu_seq_q", cu_seq_q, args.total_q, "query")
    q_lens = [b - a for a, b in pairwise(cu_seq_q)]
    check_max_len(fn, "max_q", args.max_q, q_lens, "query")
    k_lens = None
    if cu_seq_k is not None:
        check_offsets(fn, "cu_seq_k", cu_seq_k, None if block_table is not None else
                      args.total_k, "key")
        k_lens = [b - a for a, b in pairwise(cu_seq_k)]
    if block_table is not None:  # the pages bound the keys: (pages per row) · page_size
        room = len(block_table[0]) * args.page_size if block_table else 0
        k_lens = [room] * args.count if k_lens is None else [min(n, room) for n in k_lens]
        pages = args.total_k // args.page_size
        for i, row in enumerate(block_table):
            bad = [p for p in row[:_pages(seqused_k[i], args.page_size)] if not 0 <= p < pages]
            if bad:
                raise ValueError(
                    f"{fn}: block_table must hold page indices in [0, {pages}) (the pages of "
                    f"key and value); got block_table[{i}] with {bad[0]}"
                )
    used = k_lens if seqused_k is None else list(seqused_k)
    for i, (n, bound) in enumerate(zip(used, k_lens, strict=True)):
        if not 0 <= n <= bound:
            raise ValueError(
                f"{fn}: seqused_k[{i}] must lie in [0, {bound}] (the keys of sequence {i}); "
                f"got seqused_k[{i}]={n}"
            )
    check_max_len(fn, "max_k", args.max_k, used, "key")
    k_starts = cu_seq_k[:-1] if block_table is None else _cumulative(used)
    return [Sequence(a, b - a, k, n)
            for (a, b), k, n in zip(pairwise(cu_seq_q), k_starts, used, strict=True)]


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _cumulative(lengths: list[int]) -> list[int]:
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts


def paged_key_index(
    block_table: list[list[int]], seqused_k: list[int], page_size: int
) -> list[int]:
    """The pool's flattened token index (``page · page_size + offset``) of every key in use,
    sequence after sequence: ``key.reshape(-1, kv_heads, dim)[index]`` is the packed key of
    the sequences that ``sequences`` numbers (a page shared by two sequences is read twice)."""
    index: list[int] = []
    for row, used in zip(block_table, seqused_k, strict=True):
        tokens: list[int] = []
        for page in row[:_pages(used, page_size)]:
            tokens.extend(range(page * page_size, (page + 1) * page_size))
        index.extend(tokens[:used])
    return index


def groups(seqs: list[Sequence]) -> list[Group]:
    """The sequences with queries, gathered by shape ``(q_len, k_len)``, the largest work
    ``q_len · k_len`` first (so the lanes of a thread pool end together), ties in order of
    appearance. A sequence without queries computes nothing and is left out."""
    found: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for s in seqs:
        if s.q_len:
            starts = found.setdefault((s.q_len, s.k_len), ([], []))
            starts[0].append(s.q_start)
            starts[1].append(s.k_start)
    order = sorted(found, key=lambda shape: -shape[0] * max(shape[1], 1))
    return [Group(q, k, tuple(found[q, k][0]), tuple(found[q, k][1])) for q, k in order]


def group_arguments(fn: str, args: VarlenArguments, group: Group) -> Arguments:
    """``attention_arguments`` of one group's batch ``(n, heads, q_len, head_dim)``: the
    window aligned bottom-right within each sequence (flash-attn's rule), scale, softcap,
    sinks and lse as given."""
    n = len(group.q_starts)
    dtype = args.dtype
    sinks = ((args.heads,), dtype) if args.has_sinks else None  # checked by varlen_arguments
    return attention_arguments(
        fn, ((n, args.heads, group.q_len, args.head_dim), dtype),
        ((n, args.kv_heads, group.k_len, args.head_dim), dtype),
        ((n, args.kv_heads, group.k_len, args.v_dim), dtype), causal_alignment="bottom_right",
        window=args.window, scale=args.scale, softcap=args.softcap, sinks=sinks,
        return_lse=args.return_lse,
    )


def check_pack(fn: str, padded: ArrayInfo, lengths: ArrayInfo) -> tuple[Shape, int]:
    """``pack_sequences``: padded ``(batch, heads, max_len[, dim])`` and lengths ``(batch,)``
    ints; returns the padded shape and the batch size."""
    shape, _ = padded
    if len(shape) not in (3, 4):
        raise ValueError(
            f"{fn}: padded must be (batch, heads, max_len, dim) or (batch, heads, max_len); "
            f"got padded.shape={tuple(shape)}"
        )
    l_shape, l_dtype = lengths
    if tuple(l_shape) != (shape[0],) or not _is_int_dtype(l_dtype):
        raise ValueError(
            f"{fn}: lengths must be ({shape[0]},) ints, one per sequence of padded; "
            f"got lengths.shape={tuple(l_shape)}, lengths.dtype={l_dtype}"
        )
    return tuple(shape), shape[0]


def check_lengths_values(fn: str, lengths: list[int], max_len: int) -> None:
    """Every length in ``[0, max_len]``."""
    for i, n in enumerate(lengths):
        if not 0 <= n <= max_len:
            raise ValueError(
                f"{fn}: lengths[{i}] must lie in [0, {max_len}] (padded's max_len); "
                f"got lengths[{i}]={n}"
            )


def check_unpack(fn: str, packed: ArrayInfo, cu_seq: ArrayInfo, max_len: object) -> int:
    """``unpack_sequences``: packed ``(total, heads[, dim])``, offsets ``(N + 1,)`` ints and
    ``max_len`` an int ``>= 0``; returns ``max_len``."""
    shape, _ = packed
    if len(shape) not in (2, 3):
        raise ValueError(
            f"{fn}: packed must be (total_tokens, heads, dim) or (total_tokens, heads); "
            f"got packed.shape={tuple(shape)}"
        )
    check_offsets_info(fn, "cu_seq", cu_seq, None)
    return check_int(fn, "max_len", max_len)
