"""The rules of decoding at scale: split-KV chunks and the paged KV cache (``paged_attention``,
``PagedKVCache``).

* ``SPLIT_KV`` and ``split_chunk``/``page_chunk``/``kv_chunks``: when a decoding step cuts its
  keys into chunks (each attended on its own, the partial results merged by their log-sum-exp,
  ``spec.SPLIT_KV``) and where the chunks start and stop;
* ``paged_arguments``: every shape and dtype rule of ``paged_attention``, in a fixed order;
  ``check_block_table``: the rules on the table's values (pages in range, no page used twice,
  ``seq_lens`` within the table);
* ``check_pool``, ``check_sequences``, ``check_paged_append``: the cache's own rules (a full
  pool, unknown sequences, keys that do not fit the pages).

Pure Python on shape tuples, dtype names and lists of ints, as the rest of the package: every
backend raises the same exception with the same message for the same bad input.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .checks import (
    ArrayInfo,
    Shape,
    check_float_inputs,
    check_int,
    check_scale,
    check_sinks,
    check_softcap,
    compute_dtype,
    is_int,
)

#: Split-KV decoding (``spec.SPLIT_KV``): a step with at most ``max_q_len`` query rows over at
#: least ``min_kv_len`` cached keys cuts the keys into chunks of ``chunk`` keys; the paged cache
#: always attends in chunks of whole pages, ``max(1, chunk // block_size)`` pages each, which
#: jax_attn attends in ``steps`` steps of the online softmax each, a chunk after the other. Below
#: ``min_kv_len`` a step is well under a millisecond and one piece is faster (the tasks and the
#: merge cost more than they share: ``benchmarks/RESULTS.md``, decoding at scale).
SPLIT_KV = {"chunk": 4096, "min_kv_len": 8192, "max_q_len": 16, "steps": 8}


class PagedArguments(NamedTuple):
    """The validated facts of one ``paged_attention`` call."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    v_dim: int
    num_blocks: int
    block_size: int
    max_blocks: int
    dtype: str  # the query's and the pages' dtype: the output's
    compute: str  # the dtype the scores, the softmax and the lse are computed in
    scale: float
    softcap: float | None


def split_chunk(q_len: int, kv_len: int) -> int | None:
    """Keys per chunk of a contiguous cache's decoding step over ``kv_len`` keys with ``q_len``
    query rows, or None when the step attends its keys in one piece (``SPLIT_KV``)."""
    if q_len > SPLIT_KV["max_q_len"] or kv_len < SPLIT_KV["min_kv_len"]:
        return None
    return SPLIT_KV["chunk"]


def page_chunk(block_size: int) -> int:
    """Pages per chunk of the paged cache: whole pages, about ``SPLIT_KV["chunk"]`` keys."""
    return max(1, SPLIT_KV["chunk"] // block_size)


def kv_chunks(kv_len: int, chunk: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: keys ``0..kv_len`` cut into consecutive chunks of ``chunk``
    keys (the last one shorter); ``[]`` for ``kv_len == 0``."""
    return [(start, min(start + chunk, kv_len)) for start in range(0, kv_len, chunk)]


def _int_array(fn: str, name: str, info: ArrayInfo, rank: int, axes: str) -> Shape:
    shape, dtype = tuple(info[0]), info[1]
    if len(shape) != rank or not dtype.startswith(("int", "uint")):
        raise ValueError(
            f"{fn}: {name} must be an array of ints shaped {axes}; "
            f"got {name}.shape={shape}, {name}.dtype={dtype}"
        )
    return shape


def paged_arguments(
    fn: str,
    query: ArrayInfo,
    key_pages: ArrayInfo,
    value_pages: ArrayInfo,
    block_table: ArrayInfo,
    seq_lens: ArrayInfo,
    *,
    scale: object = None,
    softcap: object = None,
    sinks: ArrayInfo | None = None,
) -> PagedArguments:
    """Every shape and dtype rule of a paged attention call, in order; the normalised facts.

    Args:
      fn: the public function's name, which starts every message.
      query: ``(shape, dtype)`` of ``(batch, heads, q_len, head_dim)``.
      key_pages, value_pages: of ``(num_blocks, block_size, kv_heads, head_dim | v_dim)``.
      block_table: of ``(batch, max_blocks)`` ints; seq_lens: of ``(batch,)`` ints.
      scale, softcap, sinks: as in ``scaled_dot_product_attention``.

    Returns:
      ``PagedArguments``; TypeError for dtypes, ValueError for shapes.
    """
    dtype = check_float_inputs(fn, query=query[1], key_pages=key_pages[1],
                               value_pages=value_pages[1])
    q_shape, k_shape, v_shape = (tuple(x[0]) for x in (query, key_pages, value_pages))
    if len(q_shape) != 4:
        raise ValueError(f"{fn}: query must be (batch, heads, q_len, head_dim); "
                         f"got query.shape={q_shape}")
    if len(k_shape) != 4 or len(v_shape) != 4 or k_shape[:3] != v_shape[:3]:
        raise ValueError(
            f"{fn}: key_pages and value_pages must be (num_blocks, block_size, kv_heads, "
            f"head_dim | v_dim) with the same first three axes; "
            f"got key_pages.shape={k_shape}, value_pages.shape={v_shape}"
        )
    if k_shape[-1] != q_shape[-1]:
        raise ValueError(f"{fn}: query and key_pages must have the same head_dim; "
                         f"got query.shape={q_shape}, key_pages.shape={k_shape}")
    if k_shape[2] == 0 or q_shape[1] % k_shape[2] != 0:
        raise ValueError(f"{fn}: the heads of query must be a multiple of the kv_heads of "
                         f"key_pages; got query.shape={q_shape}, key_pages.shape={k_shape}")
    table = _int_array(fn, "block_table", block_table, 2, "(batch, max_blocks)")
    lens = _int_array(fn, "seq_lens", seq_lens, 1, "(batch,)")
    if table[0] != q_shape[0] or lens[0] != q_shape[0]:
        raise ValueError(
            f"{fn}: block_table and seq_lens must have one row per sequence of query's batch "
            f"({q_shape[0]}); got block_table.shape={table}, seq_lens.shape={lens}"
        )
    check_sinks(fn, sinks, q_shape[1])
    return PagedArguments(
        q_shape[0], q_shape[1], k_shape[2], q_shape[2], v_shape[3], k_shape[0], k_shape[1],
        table[1], dtype, compute_dtype(dtype), check_scale(fn, scale, q_shape[-1]),
        check_softcap(fn, softcap),
    )


def check_page_pool(fn: str, num_blocks: object, block_size: object, kv_heads: object,
                    head_dim: object, v_dim: object) -> tuple[int, int, int, int, int]:
    """A pool's sizes as ints: ``num_blocks``, ``block_size`` and ``kv_heads`` at least 1,
    ``head_dim`` and ``v_dim`` (None: ``head_dim``) at least 0; ValueError otherwise."""
    num_blocks = check_int(fn, "num_blocks", num_blocks, minimum=1)
    block_size = check_int(fn, "block_size", block_size, minimum=1)
    kv_heads = check_int(fn, "kv_heads", kv_heads, minimum=1)
    head_dim = check_int(fn, "head_dim", head_dim)
    v_dim = head_dim if v_dim is None else check_int(fn, "v_dim", v_dim)
    return num_blocks, block_size, kv_heads, head_dim, v_dim


def pages_needed(length: int, block_size: int) -> int:
    """Pages that hold ``length`` positions: ``ceil(length / block_size)``."""
    return math.ceil(length / block_size)


def check_block_table(
    fn: str, table: list[list[int]], seq_lens: list[int], num_blocks: int, block_size: int
) -> None:
    """The table's values: each ``seq_lens[b]`` in ``[0, max_blocks · block_size]``, and the
    pages sequence ``b`` uses (``block_table[b, :ceil(seq_lens[b] / block_size)]``; the rest
    of the row is ignored) in ``[0, num_blocks)`` and used once in the whole table: a page
    holds the keys of one sequence (ValueError naming the entry otherwise)."""
    max_blocks = len(table[0]) if table else 0
    owner: dict[int, tuple[int, int]] = {}
    for b, (row, length) in enumerate(zip(table, seq_lens, strict=True)):
        if length < 0 or length > max_blocks * block_size:
            raise ValueError(
                f"{fn}: seq_lens[{b}]={length} must lie in [0, max_blocks · block_size] = "
                f"[0, {max_blocks * block_size}] (block_table has max_blocks={max_blocks} "
                f"pages of block_size={block_size} per sequence)"
            )
        for i in range(pages_needed(length, block_size)):
            page = row[i]
            if not 0 <= page < num_blocks:
                raise ValueError(
                    f"{fn}: block_table[{b}, {i}]={page} is not a page of the cache: page "
                    f"indices must lie in [0, num_blocks) = [0, {num_blocks})"
                )
            if page in owner:
                ob, oi = owner[page]
                whose = "another sequence's page" if ob != b else "a page this sequence uses"
                raise ValueError(
                    f"{fn}: block_table[{b}, {i}]={page} points into {whose}: "
                    f"block_table[{ob}, {oi}]={page} (a page holds block_size={block_size} "
                    f"positions of one sequence)"
                )
            owner[page] = (b, i)


def check_pool(fn: str, needed: int, free: int, num_blocks: int) -> None:
    """``needed`` more pages fit in the ``free`` ones (ValueError naming the pool otherwise)."""
    if needed > free:
        raise ValueError(
            f"{fn}: the pool is full; {needed} more pages are needed, {free} of "
            f"num_blocks={num_blocks} are free (free a sequence or make a larger cache)"
        )


def check_sequences(fn: str, seqs: list, known: object = None, name: str = "seqs") -> list[int]:
    """``seqs``: distinct ids, Python or NumPy ints ``>= 0``; each in ``known`` when given
    (ValueError naming the argument ``name`` otherwise). Returns them as Python ints."""
    ids = []
    for seq in seqs:
        if not is_int(seq) or int(seq) < 0:
            raise ValueError(f"{fn}: {name} must be sequence ids, ints >= 0; got {seq!r}")
        ids.append(int(seq))
        if known is not None and int(seq) not in known:  # type: ignore[operator]
            raise ValueError(f"{fn}: sequence {int(seq)} holds no positions in this cache; "
                             f"its sequences are {sorted(known)}")  # type: ignore[call-overload]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{fn}: {name} must be distinct; got {name}={ids}")
    return ids


def check_paged_append(
    fn: str, k_shape: Shape, v_shape: Shape, k_pages: Shape, v_pages: Shape, batch: int
) -> None:
    """Keys ``(batch, kv_heads, n, head_dim)`` and values ``(batch, kv_heads, n, v_dim)`` that
    fit pages ``(num_blocks, block_size, kv_heads, head_dim | v_dim)`` (ValueError naming
    keys and values), one row per sequence of ``seqs`` (``batch`` ids; ValueError naming
    seqs)."""
    k_shape, v_shape = tuple(k_shape), tuple(v_shape)
    fits = (len(k_shape) == 4 and len(v_shape) == 4 and k_shape[:3] == v_shape[:3]
            and k_shape[1] == k_pages[2] and k_shape[3] == k_pages[3]
            and v_shape[3] == v_pages[3])
    if not fits:
        raise ValueError(
            f"{fn}: keys and values must be (batch, kv_heads, n, head_dim | v_dim) = "
            f"({batch}, {k_pages[2]}, n, {k_pages[3]} | {v_pages[3]}), one row per sequence; "
            f"got keys.shape={k_shape}, values.shape={v_shape}"
        )
    if k_shape[0] != batch:
        raise ValueError(
            f"{fn}: seqs must name one sequence per row of keys and values; "
            f"got len(seqs)={batch}, keys.shape={k_shape}, values.shape={v_shape}"
        )


class PageBook(NamedTuple):
    """The paged cache's bookkeeping, immutable (each change returns a new book): the pages of
    each sequence in position order, its length, and the free pages, ascending."""

    pages: dict[int, tuple[int, ...]]
    lengths: dict[int, int]
    free: tuple[int, ...]


def new_book(num_blocks: int) -> PageBook:
    """A book with no sequence and every page free."""
    return PageBook({}, {}, tuple(range(num_blocks)))


def book_append(
    fn: str, book: PageBook, seqs: list[int], n: int, block_size: int, num_blocks: int
) -> tuple[PageBook, list[int], list[int]]:
    """Add ``n`` positions to each of ``seqs`` (distinct ids; a new id starts empty), taking
    the lowest free pages, sequence by sequence, only where a last page is full.

    Returns:
      the new book and, for row ``b`` of ``seqs`` and new position ``t`` (row-major,
      ``len(seqs) · n`` of each), the page and the row within the page to write to.
      ValueError (``check_sequences``, ``check_pool``) before anything changes.
    """
    seqs = check_sequences(fn, seqs)
    lengths = {seq: book.lengths.get(seq, 0) for seq in seqs}
    needed = sum(pages_needed(lengths[s] + n, block_size) - len(book.pages.get(s, ()))
                 for s in seqs)
    check_pool(fn, needed, len(book.free), num_blocks)
    free, pages, new_lengths = list(book.free), dict(book.pages), dict(book.lengths)
    slots_page: list[int] = []
    slots_row: list[int] = []
    for seq in seqs:
        own = list(pages.get(seq, ()))
        grow = pages_needed(lengths[seq] + n, block_size) - len(own)
        own += free[:grow]
        del free[:grow]
        for position in range(lengths[seq], lengths[seq] + n):
            slots_page.append(own[position // block_size])
            slots_row.append(position % block_size)
        pages[seq], new_lengths[seq] = tuple(own), lengths[seq] + n
    return PageBook(pages, new_lengths, tuple(free)), slots_page, slots_row


def book_free(fn: str, book: PageBook, seq: int) -> PageBook:
    """The book without sequence ``seq``, its pages free again (ValueError for an unknown id)."""
    [seq] = check_sequences(fn, [seq], book.lengths, name="seq")
    pages, lengths = dict(book.pages), dict(book.lengths)
    freed = pages.pop(seq)
    del lengths[seq]
    return PageBook(pages, lengths, tuple(sorted(book.free + freed)))


def book_tables(fn: str, book: PageBook, seqs: list[int] | None) -> tuple[list, list]:
    """``(block_table, seq_lens)`` as lists of ints for sequences ``seqs`` (default: ``0..``
    the largest id + 1): rows of ``max_blocks`` page indices (at least 1), -1 past each
    sequence's last page, and the lengths (0 for an id the book does not hold)."""
    if seqs is None:
        seqs = list(range(max(book.lengths, default=-1) + 1))
    seqs = check_sequences(fn, seqs)
    rows = [book.pages.get(seq, ()) for seq in seqs]
    width = max([1] + [len(row) for row in rows])
    table = [list(row) + [-1] * (width - len(row)) for row in rows]
    return table, [book.lengths.get(seq, 0) for seq in seqs]
