"""Decoding at scale in PyTorch: split-KV decoding and a paged key/value cache.

``split_kv_attention`` attends a decoding step's few query rows over a contiguous cache (in
chunks of keys, ``rules.split_chunk``, or in one piece): a kv head's query rows are the rows of
one matrix, so the scores against every key are one ``bmm`` over the (batch, kv head) pairs (no
repeated keys, no copy of the cache), viewed as ``(..., chunks, width)`` for every chunk's
softmax at once (``_chunk_softmax``), and a pair's value products are one ``bmm``; the partial
results merge by their log-sum-exp in a few vectorised operations (``_merge_chunks``, the rule
of ``merge_attention``): about ten operations whatever the number of chunks, each a dispatch
and a hand-off to torch's threads. ``PagedKVCache`` keeps many sequences' keys and values in one
pool of pages ``(num_blocks, block_size, kv_heads, head_dim)`` (flash-attn's and vLLM's layout;
the bookkeeping of ``attention_rules.paging``). ``paged_attention``: every sequence in chunks of
whole pages (``rules.page_chunk``); a chunk's pages copied ``PART_BYTES`` at a time (one part
per chunk by default) by one ``index_select`` into a buffer the thread reuses (a fresh tensor
when autograd records the call), each part's scores one ``bmm`` over the kv heads on it; every
chunk's softmax at once; the values copied and multiplied alike. A ``bmm`` per page costs a
dispatch per page, more than its arithmetic, and a copy of a whole sequence leaves the cache
before its products read it (``benchmarks/RESULTS.md``). Autograd differentiates the page
reads (query, key_pages, value_pages, sinks); ``append`` stores detached copies.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch

import attention_rules as rules

from ._arrays import _array, _as_tensor, _cache_dtype, _describe, _dtype_name
from ._chunks import _buffer, _chunk_allowed, _chunk_softmax, _merge_chunks
from ._steps import NEG_INF, _softcap

#: Bytes of pages copied at a time by ``paged_attention`` (at least one page): the keys of a
#: chunk of 4,096 positions, 2 kv heads of 64 float32 (one copy and one product per chunk; 1 MiB
#: measured 1.1-1.2x slower), and the L2 cache here (torch_attn's choice).
PART_BYTES = 1 << 21

class PagedKVCache:
    """Pages ``(num_blocks, block_size, kv_heads, head_dim | v_dim)`` of keys and values shared
    by many sequences, each with its own page table (``spec.PAGED_CACHE``); torch: appends and
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
        block_size, kv_heads, v_dim)`` (``v_dim``: ``head_dim``); ``device``: a
        ``torch.device`` (or its name), None for torch's default device."""
        fn = "PagedKVCache"
        num_blocks, block_size, kv_heads, head_dim, v_dim = rules.check_page_pool(
            fn, num_blocks, block_size, kv_heads, head_dim, v_dim)
        dtype = _cache_dtype(fn, dtype)
        rules.check_float_inputs(fn, dtype=str(dtype).removeprefix("torch."))
        shape = (num_blocks, block_size, kv_heads)
        like = {"dtype": dtype, "device": device}  # torch: the device of the pages
        self.key_pages = torch.zeros(shape + (head_dim,), **like)
        self.value_pages = torch.zeros(shape + (v_dim,), **like)
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
        v_dim)``, row ``b`` to sequence ``seqs[b]`` (default ``0..batch-1``), detached; returns
        the cache, updated in place (nothing changes when it raises)."""
        fn = "PagedKVCache.append"
        keys, values = _as_tensor(keys), _as_tensor(values)
        rules.check_float_inputs(fn, keys=_dtype_name(keys))  # cast to the pages' dtype after
        rules.check_float_inputs(fn, values=_dtype_name(values))
        seqs = list(range(keys.shape[0] if keys.ndim else 0)) if seqs is None else list(seqs)
        rules.check_paged_append(fn, tuple(keys.shape), tuple(values.shape),
                                 tuple(self.key_pages.shape), tuple(self.value_pages.shape),
                                 len(seqs))
        device = self.key_pages.device
        with self._lock:  # one append or free at a time (spec.CONCURRENCY)
            book, pages, rows = rules.book_append(fn, self._book, seqs, keys.shape[2],
                                                  self.block_size, self.num_blocks)
            pages = torch.tensor(pages, dtype=torch.long, device=device)
            rows = torch.tensor(rows, dtype=torch.long, device=device)
            # (batch, kv_heads, n, dim) → one (kv_heads, dim) row per new position, row-major;
            # torch: without autograd history, as KVCache (the row count is explicit: -1 is
            # ambiguous for zero-width values)
            count = keys.shape[0] * keys.shape[2]
            self.key_pages[pages, rows] = keys.detach().transpose(1, 2).reshape(
                count, keys.shape[1], keys.shape[3]).to(device, self.key_pages.dtype)
            self.value_pages[pages, rows] = values.detach().transpose(1, 2).reshape(
                count, values.shape[1], values.shape[3]).to(device, self.value_pages.dtype)
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

    def tables(self, seqs: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_table (batch, max_blocks), seq_lens (batch,))``, int32, of ``seqs``
        (default ``0..`` the largest id + 1), on the pages' device; -1 past each sequence's
        last page."""
        seqs = None if seqs is None else list(seqs)
        table, lens = rules.book_tables("PagedKVCache.tables", self._book, seqs)
        like = {"dtype": torch.int32, "device": self.key_pages.device}
        return torch.tensor(table, **like), torch.tensor(lens, **like)

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
        seqs = range(_as_tensor(query).shape[0]) if seqs is None else seqs
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
    chunks of whole pages merged by their log-sum-exp (``spec.SPLIT_DECODING``).
    Differentiable (autograd through the page reads).

    Args:
      query: ``(batch, heads, q_len, head_dim)``.
      key_pages: ``(num_blocks, block_size, kv_heads, head_dim)``.
      value_pages: ``(num_blocks, block_size, kv_heads, v_dim)``.
      block_table: ``(batch, max_blocks)`` ints; seq_lens: ``(batch,)`` ints.
      scale, softcap, sinks, return_lse: as in ``scaled_dot_product_attention``.

    Returns:
      ``(batch, heads, q_len, v_dim)`` in the query's dtype, on its device; with
      ``return_lse``, ``(output, lse)``, lse ``(batch, heads, q_len)`` in the compute dtype.
    """
    fn = "paged_attention"
    args = rules.paged_arguments(
        fn, _describe(fn, "query", query), _describe(fn, "key_pages", key_pages),
        _describe(fn, "value_pages", value_pages), _describe(fn, "block_table", block_table),
        _describe(fn, "seq_lens", seq_lens), scale=scale, softcap=softcap,
        sinks=_describe(fn, "sinks", sinks))
    return_lse = rules.check_flag(fn, "return_lse", return_lse)
    table, lens = _array(block_table).tolist(), _array(seq_lens).tolist()  # torch: on the host
    rules.check_block_table(fn, table, lens, args.num_blocks, args.block_size)
    query = _array(query)
    output, lse = _paged(query, _array(key_pages), _array(value_pages), table, lens, args,
                         None if sinks is None else _array(sinks))
    output = output.to(query.dtype)
    return (output, lse) if return_lse else output


def split_kv_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    chunk: int,
    *,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoding step over a contiguous cache, split into chunks of ``chunk`` keys
    (``spec.SPLIT_DECODING``): ``query (..., heads, n, head_dim)`` are the last ``n``
    positions of ``key (..., kv_heads, kv_len, head_dim)`` / ``value (..., kv_heads, kv_len,
    v_dim)`` (the bottom-right causal rule); default scale. Validated inputs (the cache's);
    ``chunk >= kv_len`` is the step in one piece.

    torch: one ``bmm`` for the scores (keys @ rowsᵀ, copied always: rows @ keysᵀ took 1.9x as
    long), every chunk's softmax at once, a ``bmm`` per pair for the values, a vectorised merge.

    Returns:
      ``(output (..., heads, n, v_dim)`` in the query's dtype, ``lse (..., heads, n))``.
    """
    batch, (heads, n, head_dim) = tuple(query.shape[:-3]), tuple(query.shape[-3:])
    kv_heads, kv_len, v_dim = key.shape[-3], key.shape[-2], value.shape[-1]
    compute = getattr(torch, rules.compute_dtype(_dtype_name(query)))
    record = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (
        query, key, value, sinks))  # autograd records the call: nothing in place
    rows = query.reshape(-1, heads // kv_heads * n, head_dim).to(compute)
    rows = rows * rules.default_scale(head_dim)  # (pairs, rows, head_dim): a small copy
    keys = key.reshape(-1, kv_len, head_dim).to(compute)  # views where the cache allows
    values = value.reshape(-1, kv_len, v_dim).to(compute)
    chunks = rules.kv_chunks(kv_len, chunk)
    width = min(chunk, kv_len)
    scores = torch.bmm(keys, rows.mT).mT.clone(memory_format=torch.contiguous_format)
    if len(chunks) * width > kv_len:  # the shorter last chunk, padded
        scores = torch.nn.functional.pad(scores, (0, len(chunks) * width - kv_len),
                                         value=NEG_INF)
    scores = scores.unflatten(-1, (len(chunks), width))  # (pairs, rows, chunks, width)
    allowed = _chunk_allowed(chunks, width, kv_len, n, rows.shape[1], rows.device)
    if allowed is not None:  # (rows, chunks, width)
        scores = scores.masked_fill(~allowed, NEG_INF) if record else \
            scores.masked_fill_(~allowed, NEG_INF)
    weights, lse = _chunk_softmax(scores, allowed is not None, record)  # (pairs, rows, ...)
    full, output = kv_len // width, []  # the full chunks: a bmm per pair, on views
    for x in range(rows.shape[0] if len(chunks) > 1 else 0):
        parts = [torch.bmm(weights[x, :, :full].transpose(0, 1),
                           values[x, :full * width].view(full, width, v_dim))]
        if full < len(chunks):  # the shorter last chunk
            parts.append((weights[x, :, full, :kv_len - full * width]
                          @ values[x, full * width:])[None])
        output.append(parts[0] if len(parts) == 1 else torch.cat(parts))  # (chunks, rows, v)
    output = torch.stack(output) if output else torch.bmm(weights[:, :, 0], values)[:, None]
    shape = batch + (heads, n)
    output, lse = _merge_chunks(output.movedim(1, 0).reshape((-1,) + shape + (v_dim,)),
                                lse.movedim(-1, 0).reshape((-1,) + shape), sinks)
    return output.to(query.dtype), lse


def paged_cached_part(
    query: torch.Tensor, cache: PagedKVCache, lengths: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch only (``kv_cache.decode_step`` with grad mode on): every query row of ``query
    (batch, heads, n, head_dim)`` over the first ``lengths[b]`` positions of sequence ``b``
    (no causal rule: the positions before the step), default scale: ``(output, lse)``."""
    fn = "PagedKVCache.decode"
    table, _ = rules.book_tables(fn, cache._book, list(range(len(lengths))))
    args = rules.paged_arguments(
        fn, (tuple(query.shape), _dtype_name(query)),
        (tuple(cache.key_pages.shape), _dtype_name(cache.key_pages)),
        (tuple(cache.value_pages.shape), _dtype_name(cache.value_pages)),
        ((len(table), len(table[0])), "int32"), ((len(lengths),), "int32"))
    output, lse = _paged(query, cache.key_pages, cache.value_pages, table, lengths, args, None,
                         causal=False)
    return output.to(query.dtype), lse


def _paged(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    table: list[list[int]],
    lens: list[int],
    args: rules.PagedArguments,
    sinks: torch.Tensor | None,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_attention`` on validated inputs (``_paged_sequence`` each, merged): ``(output
    (batch, heads, q_len, v_dim), lse (batch, heads, q_len))``; ``causal=False``: no rule."""
    device, compute = query.device, getattr(torch, args.compute)
    bs, kv_heads, head_dim, v_dim = args.block_size, args.kv_heads, query.shape[-1], args.v_dim
    group = args.heads // kv_heads * args.q_len  # a kv head's query rows
    rows = query.reshape(args.batch, kv_heads, group, head_dim).to(compute) * args.scale
    record = torch.is_grad_enabled() and any(  # autograd keeps the parts: fresh ones
        x.requires_grad for x in (query, key_pages, value_pages))
    width = rules.page_chunk(bs) * bs
    per_sequence = [rules.kv_chunks(length, width) for length in lens]
    count = max([1] + [len(chunks) for chunks in per_sequence])
    shape = (count, args.batch, kv_heads, group)
    output = torch.zeros(shape + (v_dim,), dtype=compute, device=device)  # a slot no chunk
    lse = torch.full(shape, NEG_INF, dtype=compute, device=device)  # fills: an empty part
    for b, chunks in enumerate(per_sequence):
        if chunks:
            part = _paged_sequence(rows[b], key_pages, value_pages, table[b], chunks, width,
                                   lens[b], args, causal, record)
            if args.batch == 1 and len(chunks) == count:  # no copy into the slots
                output, lse = part[0][:, None], part[1][:, None]
            else:
                output[:len(chunks), b], lse[:len(chunks), b] = part
    shape = (count, args.batch, args.heads, args.q_len)
    return _merge_chunks(output.reshape(shape + (v_dim,)), lse.reshape(shape), sinks)


def _paged_sequence(
    rows: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    pages: list[int],
    chunks: list[tuple[int, int]],
    width: int,
    length: int,
    args: rules.PagedArguments,
    causal: bool,
    record: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's partial results, a chunk each: ``rows (kv_heads, rows, head_dim)``
    (scaled) over its ``length`` positions on ``pages`` in chunks of up to ``width`` keys:
    ``(output (chunks, kv_heads, rows, v_dim), lse (chunks, kv_heads, rows))``. Per chunk,
    its pages copied in parts (``_page_parts``), one ``bmm`` over the kv heads per part; the
    chunks' scores stacked (the shorter last one padded with ``-inf``) for every softmax at
    once; the pages of values copied again, one ``bmm`` per part."""
    compute, scores = rows.dtype, []
    for start, stop in chunks:  # (kv_heads, rows, dim) @ (kv_heads, dim, keys), by strides
        parts = [torch.bmm(rows, k.to(compute).permute(1, 2, 0))
                 for k in _page_parts(key_pages, pages, start, stop, record)]
        chunk = _softcap(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1),
                         args.softcap)  # before the padding: -inf stays -inf
        scores.append(chunk if stop - start == width else torch.nn.functional.pad(
            chunk, (0, width - (stop - start)), value=NEG_INF))  # the shorter last chunk
    scores = torch.stack(scores)  # (chunks, kv_heads, rows, width)
    allowed = _chunk_allowed(chunks, width, length, args.q_len if causal else 1,
                             rows.shape[1], rows.device)
    if allowed is not None:  # (rows, chunks, width) → (chunks, 1, rows, width)
        allowed = allowed.transpose(0, 1)[:, None]
        scores = scores.masked_fill(~allowed, NEG_INF) if record else \
            scores.masked_fill_(~allowed, NEG_INF)
    weights, lse = _chunk_softmax(scores, allowed is not None, record)  # (chunks, kv_h, rows)
    outputs = []
    for c, (start, stop) in enumerate(chunks):  # (kv_heads, rows, keys) @ (kv_heads, keys, v)
        acc, at = None, 0
        for v in _page_parts(value_pages, pages, start, stop, record):
            part = torch.bmm(weights[c, ..., at:at + v.shape[0]], v.to(compute).transpose(0, 1))
            acc = part if acc is None else acc + part
            at += v.shape[0]
        outputs.append(acc)
    return torch.stack(outputs), lse



def _page_parts(
    pool: torch.Tensor, row: list[int], start: int, stop: int, fresh: bool
) -> Iterator[torch.Tensor]:
    """Positions ``start..stop`` (``start`` at a page's first row) of the sequence whose pages
    are ``row`` (its table row), in parts of ``PART_BYTES`` yielded as ``(width, kv_heads,
    dim)``: with one kv head, a part whose pages lie in order is a view of the pool (with more,
    a head's rows there are every ``kv_heads``-th: read in place, slower than the copy), any
    other copied by one ``index_select`` into this thread's buffer (valid until the next part)
    or, with ``fresh`` (autograd may keep the part for the backward pass), a new tensor."""
    bs = pool.shape[1]
    flat = pool.reshape(pool.shape[0], pool[0].numel())  # (num_blocks, page): a view
    per = max(1, PART_BYTES // max(1, flat.shape[1] * pool.element_size()))  # pages per part
    first, last = start // bs, -(-stop // bs)
    for lo in range(first, last, per):
        hi = min(lo + per, last)
        if pool.shape[2] == 1 and row[lo:hi] == list(range(row[lo], row[lo] + hi - lo)):
            part = flat[row[lo]:row[lo] + hi - lo]  # one kv head, pages in order: the pool
        else:
            index = torch.tensor(row[lo:hi], dtype=torch.long, device=pool.device)
            part = flat.index_select(0, index) if fresh else torch.index_select(
                flat, 0, index, out=_buffer((hi - lo, flat.shape[1]), pool))
        yield part.view(((hi - lo) * bs,) + pool.shape[2:])[:min(stop, hi * bs) - lo * bs]


