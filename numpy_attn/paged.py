"""Decoding at scale in NumPy: split-KV decoding and a paged key/value cache.

``split_kv_attention`` attends a decoding step's few query rows over a long contiguous cache in
chunks of keys (``rules.split_chunk``): each chunk gives a partial output and its row
log-sum-exp, and the partial results are merged by their log-sum-exp (``_merge_chunks``, the
rule of ``merge_attention``, ``spec.MERGING``). One query row is too little work to share any
other way, so the chunks run as tasks on numpy_attn's thread pool (``_threads.run_lanes``), every
core busy: each task writes its own slot of the partial results, and the merge runs in chunk
order afterwards, so the bits do not depend on the threads.

``PagedKVCache`` keeps many sequences' keys and values in one pool of pages ``(num_blocks,
block_size, kv_heads, head_dim)`` (flash-attn's and vLLM's layout), with the bookkeeping of
``attention_rules.paging`` (a free list, one page table per sequence). ``paged_attention`` is
the kernel: per sequence, chunks of whole pages (``rules.page_chunk``) are the tasks. A task
copies its pages, a part of about ``PART_BYTES`` at a time, into its thread's buffer
(``np.take(..., out=)``: one ``memcpy`` per page) right before the part's matrix product, so
the product reads each kv head's rows from the cache while they are there, as a contiguous
chunk's product does. numpy: computing on the pool in place costs more, whether the pages are
scattered (a BLAS call per page, as long as the page's arithmetic) or in order (each kv head
reads every other ``head_dim`` floats of the pool, and the second head's rows come from memory
again); the copy runs at the speed of memory (``benchmarks/RESULTS.md``, decoding at scale).
The buffer is reused by every call in the thread (one per thread, ``PART_BYTES`` or one page,
whichever is larger). numpy_attn computes the forward pass only: no VJP of
``paged_attention`` (``spec.PAGED_CACHE``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

import attention_rules as rules

from . import _threads
from ._arrays import _array, _cache_dtype, _check_device, _describe
from ._chunks import _attend_chunk, _buffer, _limits, _merge_chunks, _partials

#: Bytes of pages copied at a time by ``paged_attention`` (at least one page): half of a common
#: L2 cache, so a part is still there when its product reads it (numpy_attn's choice).
PART_BYTES = 1 << 20

class PagedKVCache:
    """Pages ``(num_blocks, block_size, kv_heads, head_dim | v_dim)`` of keys and values shared
    by many sequences, each with its own page table (``spec.PAGED_CACHE``); numpy: appends and
    frees change the cache in place and return it."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        v_dim: int | None = None,
        *,
        dtype: Any = "float32",
        device: Any = None,
    ) -> None:
        """``num_blocks`` free pages of ``block_size`` positions, zeros: ``key_pages
        (num_blocks, block_size, kv_heads, head_dim)`` and ``value_pages (num_blocks,
        block_size, kv_heads, v_dim)`` (``v_dim``: ``head_dim``); ``device``: None or "cpu"."""
        fn = "PagedKVCache"
        num_blocks, block_size, kv_heads, head_dim, v_dim = rules.check_page_pool(
            fn, num_blocks, block_size, kv_heads, head_dim, v_dim)
        _check_device(fn, device)  # numpy: the CPU only
        dtype = _cache_dtype(fn, dtype)
        rules.check_float_inputs(fn, dtype=dtype.name)
        shape = (num_blocks, block_size, kv_heads)
        self.key_pages = np.zeros(shape + (head_dim,), dtype)
        self.value_pages = np.zeros(shape + (v_dim,), dtype)
        self._book = rules.new_book(num_blocks)
        # appends and frees of different sequences from several threads take turns here
        # (spec.CONCURRENCY): the book is read, the pages written and the new book set at once
        self._lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        """Pages in the pool."""
        return self.key_pages.shape[0]

    @property
    def block_size(self) -> int:
        """Positions per page."""
        return self.key_pages.shape[1]

    @property
    def num_free_blocks(self) -> int:
        """Pages on the free list."""
        return len(self._book.free)

    def append(self, keys: Any, values: Any, seqs: Any = None) -> PagedKVCache:
        """Add ``keys (batch, kv_heads, n, head_dim)`` and ``values (batch, kv_heads, n,
        v_dim)``, row ``b`` to sequence ``seqs[b]`` (default ``0..batch-1``); returns the
        cache, updated in place (nothing changes when it raises)."""
        fn = "PagedKVCache.append"
        keys, values = np.asarray(keys), np.asarray(values)
        rules.check_float_inputs(fn, keys=keys.dtype.name)  # cast to the pages' dtype after
        rules.check_float_inputs(fn, values=values.dtype.name)
        seqs = list(range(keys.shape[0] if keys.ndim else 0)) if seqs is None else list(seqs)
        rules.check_paged_append(fn, keys.shape, values.shape, self.key_pages.shape,
                                 self.value_pages.shape, len(seqs))
        with self._lock:  # one append or free at a time (spec.CONCURRENCY)
            book, pages, rows = rules.book_append(fn, self._book, seqs, keys.shape[2],
                                                  self.block_size, self.num_blocks)
            # (batch, kv_heads, n, dim) → one (kv_heads, dim) row per new position, row-major
            # (the row count is explicit: -1 is ambiguous for zero-width values)
            count = keys.shape[0] * keys.shape[2]
            self.key_pages[pages, rows] = keys.transpose(0, 2, 1, 3).reshape(
                count, keys.shape[1], keys.shape[3])
            self.value_pages[pages, rows] = values.transpose(0, 2, 1, 3).reshape(
                count, values.shape[1], values.shape[3])
            self._book = book
        return self

    def free(self, seq: int) -> PagedKVCache:
        """Give sequence ``seq``'s pages back to the free list; returns the cache."""
        with self._lock:
            self._book = rules.book_free("PagedKVCache.free", self._book, seq)
        return self

    def seq_len(self, seq: int) -> int:
        """Positions held for sequence ``seq`` (0 for one the cache does not hold)."""
        [seq] = rules.check_sequences("PagedKVCache.seq_len", [seq], name="seq")
        return self._book.lengths.get(seq, 0)

    def tables(self, seqs: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """``(block_table (batch, max_blocks), seq_lens (batch,))``, int32, of ``seqs``
        (default ``0..`` the largest id + 1); -1 past each sequence's last page."""
        seqs = None if seqs is None else list(seqs)
        table, lens = rules.book_tables("PagedKVCache.tables", self._book, seqs)
        return np.asarray(table, np.int32), np.asarray(lens, np.int32)

    def attend(
        self,
        query: Any,
        seqs: Any = None,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: Any = None,
        return_lse: bool = False,
    ) -> Any:
        """``paged_attention`` of ``query (batch, heads, q_len, head_dim)`` over the pages of
        ``seqs`` (default ``0..batch-1``): ``(batch, heads, q_len, v_dim)`` (and the lse)."""
        rules.check_flag("PagedKVCache.attend", "return_lse", return_lse)
        seqs = range(np.shape(query)[0]) if seqs is None else seqs
        block_table, seq_lens = self.tables(seqs)
        return paged_attention(query, self.key_pages, self.value_pages, block_table, seq_lens,
                               scale=scale, softcap=softcap, sinks=sinks, return_lse=return_lse)


def paged_attention(
    query: Any,
    key_pages: Any,
    value_pages: Any,
    block_table: Any,
    seq_lens: Any,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Any = None,
    return_lse: bool = False,
) -> Any:
    """Attention of each sequence's newest queries over its keys in a pool of pages.

    Query ``i`` of sequence ``b`` attends positions ``j <= seq_lens[b] - q_len + i``, position
    ``j`` read from row ``j % block_size`` of page ``block_table[b, j // block_size]``; in
    chunks of whole pages merged by their log-sum-exp (``spec.SPLIT_DECODING``). Forward only.

    Args:
      query: ``(batch, heads, q_len, head_dim)``.
      key_pages: ``(num_blocks, block_size, kv_heads, head_dim)``.
      value_pages: ``(num_blocks, block_size, kv_heads, v_dim)``.
      block_table: ``(batch, max_blocks)`` ints; seq_lens: ``(batch,)`` ints.
      scale, softcap, sinks, return_lse: as in ``scaled_dot_product_attention``.

    Returns:
      ``(batch, heads, q_len, v_dim)`` in the query's dtype; with ``return_lse``, ``(output,
      lse)``, lse ``(batch, heads, q_len)`` in the compute dtype.
    """
    fn = "paged_attention"
    args = rules.paged_arguments(
        fn, _describe(fn, "query", query), _describe(fn, "key_pages", key_pages),
        _describe(fn, "value_pages", value_pages), _describe(fn, "block_table", block_table),
        _describe(fn, "seq_lens", seq_lens), scale=scale, softcap=softcap,
        sinks=_describe(fn, "sinks", sinks))
    return_lse = rules.check_flag(fn, "return_lse", return_lse)
    table, lens = _array(block_table).tolist(), _array(seq_lens).tolist()
    rules.check_block_table(fn, table, lens, args.num_blocks, args.block_size)
    query = _array(query)
    compute = np.dtype(args.compute)
    group_rows = args.heads // args.kv_heads * args.q_len  # a kv head's query rows
    rows = query.reshape(args.batch, args.kv_heads, group_rows, query.shape[-1]).astype(compute)
    bs, per = args.block_size, rules.page_chunk(args.block_size)  # pages per chunk
    tasks = [(b, c, start, stop, lens[b]) for b in range(args.batch)
             for c, (start, stop) in enumerate(rules.kv_chunks(lens[b], per * bs))]
    outputs, lses = _partials(max([t[1] + 1 for t in tasks], default=0), rows, args.v_dim)
    key_pages, value_pages = _array(key_pages), _array(value_pages)

    def block(b: int, c: int, start: int, stop: int, length: int, scratch: None) -> None:
        outputs[c, b], lses[c, b] = _attend_chunk(
            rows[b], stop - start, _page_parts(key_pages, table[b], start, stop),
            _page_parts(value_pages, table[b], start, stop), start,
            _limits(length, args.q_len, rows.shape[-2], stop), args.scale, args.softcap)

    _threads.run_lanes(tasks, block, lambda: None)
    shape = (args.batch, args.heads, args.q_len)
    output, lse = _merge_chunks(outputs.reshape((-1,) + shape + (args.v_dim,)),
                                lses.reshape((-1,) + shape), _array(sinks))
    output = output.astype(query.dtype, copy=False)
    return (output, lse) if return_lse else output


def split_kv_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    chunk: int,
    *,
    sinks: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """A decoding step over a contiguous cache, split into chunks of ``chunk`` keys
    (``spec.SPLIT_DECODING``): ``query (..., heads, n, head_dim)`` are the last ``n``
    positions of ``key (..., kv_heads, kv_len, head_dim)`` / ``value (..., kv_heads, kv_len,
    v_dim)`` (the bottom-right causal rule); default scale. Validated inputs (the cache's).

    Returns:
      ``(output (..., heads, n, v_dim)`` in the query's dtype, ``lse (..., heads, n))``.
    """
    batch, (heads, n, head_dim) = query.shape[:-3], query.shape[-3:]
    kv_heads, kv_len = key.shape[-3:-1]
    compute = np.dtype(rules.compute_dtype(query.dtype.name))
    flat = int(np.prod(batch))  # the batch axes as one
    rows = query.reshape(flat, kv_heads, heads // kv_heads * n, head_dim).astype(compute)
    keys = key.reshape(flat, kv_heads, kv_len, head_dim)  # views where the cache allows
    values = value.reshape(flat, kv_heads, kv_len, value.shape[-1])
    chunks = rules.kv_chunks(kv_len, chunk)
    tasks = [(b, c, start, stop) for b in range(rows.shape[0])
             for c, (start, stop) in enumerate(chunks)]
    outputs, lses = _partials(len(chunks), rows, value.shape[-1])
    scale = rules.default_scale(head_dim)

    def block(b: int, c: int, start: int, stop: int, scratch: None) -> None:
        outputs[c, b], lses[c, b] = _attend_chunk(
            rows[b], stop - start, _parts(keys[b], start, stop),
            _parts(values[b], start, stop), start, _limits(kv_len, n, rows.shape[-2], stop), scale,
            None)

    _threads.run_lanes(tasks, block, lambda: None)
    shape = batch + (heads, n)
    output, lse = _merge_chunks(outputs.reshape((-1,) + shape + (value.shape[-1],)),
                                lses.reshape((-1,) + shape), sinks)
    return output.astype(query.dtype, copy=False), lse


def _page_parts(
    pages: np.ndarray, row: list[int], start: int, stop: int
) -> Iterator[np.ndarray]:
    """Positions ``start..stop`` (``start`` at a page's first row) of the sequence whose pages
    are ``row``, in parts of ``PART_BYTES``: each part copied into this thread's buffer as
    ``(width, kv_heads, dim)`` and yielded as ``(kv_heads, width, dim)`` (a view, valid until
    the next part is copied). The pages come out in the sequence's order, whatever their order
    in the pool."""
    bs = pages.shape[1]
    page_bytes = pages[0].nbytes
    per = max(1, PART_BYTES // max(1, page_bytes))  # pages per part (empty pages: one)
    first, last = start // bs, -(-stop // bs)
    for lo in range(first, last, per):
        hi = min(lo + per, last)
        buf = _buffer((hi - lo,) + pages.shape[1:], pages.dtype)
        # numpy: mode="clip" (the table is checked) copies page by page into ``out``; the
        # default mode buffers the whole result first
        np.take(pages, row[lo:hi], axis=0, out=buf, mode="clip")
        part = buf.reshape(((hi - lo) * bs,) + pages.shape[2:])[:min(stop, hi * bs) - lo * bs]
        yield part.swapaxes(0, 1)


def _parts(x: np.ndarray, start: int, stop: int) -> Iterator[np.ndarray]:
    """Positions ``start..stop`` of ``x (kv_heads, kv_len, dim)`` as consecutive views
    ``(kv_heads, part, dim)`` of about ``PART_BYTES`` each, the parts of ``_page_parts``.
    numpy: OpenBLAS multiplies a few score rows by 32k values 2.3-3.5x faster in parts of 2,048
    rows (each part's packed copy stays in the L2 cache) than in one product."""
    per = max(1, PART_BYTES // max(1, x.shape[0] * x.shape[-1] * x.itemsize))
    for lo in range(start, stop, per):
        yield x[:, lo:min(lo + per, stop)]


