"""Decoding at scale in PyTorch: split-KV decoding and a paged key/value cache.

``split_kv_attention`` attends a decoding step's few query rows over a long contiguous cache in
chunks of keys (``rules.split_chunk``) as a batched computation over a chunk axis: the scores
against every key are one product, viewed as ``(..., chunks, chunk)`` for every chunk's softmax
at once, and each (batch, kv head)'s value products are one ``bmm`` over its full chunks (on
views of the cache, never copies; few operations, since each costs a dispatch and a wake-up of
torch's threads); the partial results are merged by their log-sum-exp (``_merge_chunks``, the
rule of ``merge_attention``, ``spec.MERGING``).

``PagedKVCache`` keeps many sequences' keys and values in one pool of pages ``(num_blocks,
block_size, kv_heads, head_dim)`` (flash-attn's and vLLM's layout), with the bookkeeping of
``attention_rules.paging``. ``paged_attention`` is the kernel: every sequence's keys in chunks of
whole pages (``rules.page_chunk``); a chunk's pages are copied, a part of about ``PART_BYTES``
at a time, with one ``index_select`` into a buffer reused by every part and call of the thread
(a fresh tensor when autograd records the call), and each part's scores and values are one
``bmm`` over the kv heads on that buffer (transposed by strides), while the part is in the
cache; the chunks are merged by their log-sum-exp. torch: a ``bmm`` per page (the pool as it
lies) costs a dispatch per page, more than the page's arithmetic, and a copy of a whole
sequence leaves the cache before its products read it (``benchmarks/RESULTS.md``, decoding at
scale). Differentiable by autograd through the page reads (query, key_pages, value_pages,
sinks). The pages hold values only: ``append`` stores detached copies.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch

import attention_rules as rules

from ._core import NEG_INF, _array, _as_tensor, _describe, _dtype_name, _softcap
from ._extras import _merge_attention

#: Bytes of pages copied at a time by ``paged_attention`` (at least one page): half of a common
#: L2 cache, so a part is still there when its product reads it (torch_attn's choice).
PART_BYTES = 1 << 20
_local = threading.local()  # each thread's buffers for the copied pages, per device (_buffer)


def _dtype(dtype: Any) -> torch.dtype:
    """A dtype name (``"float32"``) or a ``torch.dtype``."""
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


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
        num_blocks = rules.check_int(fn, "num_blocks", num_blocks, minimum=1)
        block_size = rules.check_int(fn, "block_size", block_size, minimum=1)
        kv_heads = rules.check_int(fn, "kv_heads", kv_heads, minimum=1)
        head_dim = rules.check_int(fn, "head_dim", head_dim)
        v_dim = head_dim if v_dim is None else rules.check_int(fn, "v_dim", v_dim)
        dtype = _dtype(dtype)
        rules.check_float_inputs(fn, dtype=str(dtype).removeprefix("torch."))
        shape = (num_blocks, block_size, kv_heads)
        like = {"dtype": dtype, "device": device}  # torch: the device of the pages
        self.key_pages = torch.zeros(shape + (head_dim,), **like)
        self.value_pages = torch.zeros(shape + (v_dim,), **like)
        self._book = rules.new_book(num_blocks)

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
        seqs = list(range(keys.shape[0] if keys.ndim else 0)) if seqs is None else list(seqs)
        rules.check_paged_append(fn, tuple(keys.shape), tuple(values.shape),
                                 tuple(self.key_pages.shape), tuple(self.value_pages.shape),
                                 len(seqs))
        book, pages, rows = rules.book_append(fn, self._book, seqs, keys.shape[2],
                                              self.block_size, self.num_blocks)
        device = self.key_pages.device
        pages = torch.tensor(pages, dtype=torch.long, device=device)
        rows = torch.tensor(rows, dtype=torch.long, device=device)
        # (batch, kv_heads, n, dim) → one (kv_heads, dim) row per new position, row-major;
        # torch: without autograd history, as KVCache
        self.key_pages[pages, rows] = keys.detach().transpose(1, 2).reshape(
            -1, keys.shape[1], keys.shape[3]).to(device, self.key_pages.dtype)
        self.value_pages[pages, rows] = values.detach().transpose(1, 2).reshape(
            -1, values.shape[1], values.shape[3]).to(device, self.value_pages.dtype)
        self._book = book
        return self

    def free(self, seq: int) -> PagedKVCache:
        """Give sequence ``seq``'s pages back to the free list; returns the cache."""
        self._book = rules.book_free("PagedKVCache.free", self._book, seq)
        return self

    def seq_len(self, seq: int) -> int:
        """Positions held for sequence ``seq`` (0 for one the cache does not hold)."""
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
    v_dim)`` (the bottom-right causal rule); default scale. Validated inputs (the cache's).

    Returns:
      ``(output (..., heads, n, v_dim)`` in the query's dtype, ``lse (..., heads, n))``.
    """
    batch, (heads, n, head_dim) = tuple(query.shape[:-3]), tuple(query.shape[-3:])
    kv_heads, kv_len = key.shape[-3:-1]
    compute = getattr(torch, rules.compute_dtype(_dtype_name(query)))
    rows = query.reshape(-1, kv_heads, heads // kv_heads * n, head_dim).to(compute)
    rows = rows * rules.default_scale(head_dim)
    keys = key.reshape(-1, kv_heads, kv_len, head_dim)  # views where the cache allows
    values = value.reshape(-1, kv_heads, kv_len, value.shape[-1]).to(compute)
    chunks = rules.kv_chunks(kv_len, chunk)
    scores = rows @ keys.transpose(-1, -2).to(compute)  # (batch, kv_heads, rows, kv_len): one
    scores = torch.nn.functional.pad(scores, (0, len(chunks) * chunk - kv_len), value=NEG_INF)
    scores = scores.unflatten(-1, (len(chunks), chunk))  # (batch, kv_heads, rows, chunks, chunk)
    positions = torch.arange(len(chunks) * chunk, device=query.device).view(-1, chunk)
    stops = torch.tensor([stop for _, stop in chunks], device=query.device)[:, None]
    limits = _limits(torch.tensor([kv_len], device=query.device), n, rows.shape[-2])
    allowed = (positions < stops) & (positions < limits[0, :, :, None])  # (rows, chunks, chunk)
    scores = torch.where(allowed, scores, NEG_INF)
    row_max = scores.detach().amax(dim=-1, keepdim=True)  # a shift: constant for autograd
    shift = torch.where(row_max == NEG_INF, 0.0, row_max)  # no -inf - -inf
    weights = torch.exp(scores - shift)
    row_sum = weights.sum(dim=-1, keepdim=True)  # (batch, kv_heads, rows, chunks, 1)
    full = kv_len // chunk  # torch: per (batch, kv head), the full chunks in one bmm on views
    outputs = []
    for b in range(rows.shape[0]):
        for h in range(kv_heads):
            parts = [torch.bmm(weights[b, h, :, :full].transpose(0, 1),
                               values[b, h, :full * chunk].view(full, chunk, -1))]
            if full < len(chunks):  # the shorter last chunk
                rest = kv_len - full * chunk
                parts.append((weights[b, h, :, full, :rest] @ values[b, h, full * chunk:])[None])
            outputs.append(torch.cat(parts))  # (chunks, rows, v_dim)
    empty = row_sum == 0.0  # a chunk without a key
    safe = torch.where(empty, 1.0, row_sum)
    lse = torch.where(empty, NEG_INF, shift + torch.log(safe))[..., 0]  # (batch, kv_h, rows, c)
    output = torch.stack(outputs).unflatten(0, (-1, kv_heads)) / safe.transpose(-2, -3)
    shape = batch + (heads, n)
    output, lse = _merge_chunks(output.movedim(2, 0).reshape((-1,) + shape + (value.shape[-1],)),
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
    """``paged_attention`` on validated inputs: ``(output (batch, heads, q_len, v_dim)`` in the
    compute dtype, ``lse (batch, heads, q_len))``. Each sequence in chunks of whole pages
    (``rules.kv_chunks``), a chunk's pages copied in parts (``_page_parts``), one ``bmm`` over
    the kv heads per part. ``causal=False``: every row attends all ``lens[b]`` positions."""
    device, compute = query.device, getattr(torch, args.compute)
    bs, kv_heads, head_dim = args.block_size, args.kv_heads, query.shape[-1]
    group = args.heads // kv_heads * args.q_len  # a kv head's query rows
    rows = query.reshape(args.batch, kv_heads, group, head_dim).to(compute) * args.scale
    fresh = torch.is_grad_enabled() and any(  # autograd keeps the parts: no shared buffer
        x.requires_grad for x in (query, key_pages, value_pages))
    chunk = rules.page_chunk(bs) * bs
    per_sequence = [rules.kv_chunks(length, chunk) for length in lens]
    count = max([1] + [len(chunks) for chunks in per_sequence])
    empty_part = (torch.zeros(kv_heads, group, args.v_dim, dtype=compute, device=device),
                  torch.full((kv_heads, group), NEG_INF, dtype=compute, device=device))
    parts = [[empty_part] * args.batch for _ in range(count)]  # [chunk][sequence]
    for b, chunks in enumerate(per_sequence):
        limits = _limits(torch.tensor([lens[b]], device=device), args.q_len if causal else 1,
                         group)[0]  # (rows, 1)
        pages = torch.tensor(table[b][:rules.pages_needed(lens[b], bs)], dtype=torch.long,
                             device=device)  # the sequence's pages, in its order
        for c, (start, stop) in enumerate(chunks):
            # torch: (kv_heads, rows, dim) @ (kv_heads, dim, keys), a part transposed by
            # strides
            scores = torch.cat([torch.bmm(rows[b], k.to(compute).permute(1, 2, 0)) for k
                                in _page_parts(key_pages, pages, start, stop, fresh)], dim=-1)
            scores = _softcap(scores, args.softcap)  # (kv_heads, rows, keys)
            if stop > int(limits.min()):  # the causal rule reaches into this chunk
                positions = torch.arange(start, stop, device=device)
                scores = torch.where(positions < limits, scores, NEG_INF)
            parts[c][b] = _chunk_result(
                scores, _page_parts(value_pages, pages, start, stop, fresh), compute)
    outputs = torch.stack([torch.stack([o for o, _ in row]) for row in parts])
    lses = torch.stack([torch.stack([lse for _, lse in row]) for row in parts])
    shape = (count, args.batch, args.heads, args.q_len)
    return _merge_chunks(outputs.reshape(shape + (args.v_dim,)), lses.reshape(shape), sinks)


def _page_parts(
    pool: torch.Tensor, pages: torch.Tensor, start: int, stop: int, fresh: bool
) -> Iterator[torch.Tensor]:
    """Positions ``start..stop`` (``start`` at a page's first row) of the sequence whose pages
    are ``pages`` (its table row, as a tensor), in parts of ``PART_BYTES``, each copied by one
    ``index_select`` and yielded as ``(width, kv_heads, dim)``: a view of this thread's buffer
    (valid until the next part) or, with ``fresh`` (autograd records the call and may keep the
    part for the backward pass), a new tensor."""
    bs = pool.shape[1]
    flat = pool.reshape(pool.shape[0], pool[0].numel())  # (num_blocks, page): a view
    per = max(1, PART_BYTES // max(1, flat.shape[1] * pool.element_size()))  # pages per part
    first, last = start // bs, -(-stop // bs)
    for lo in range(first, last, per):
        hi = min(lo + per, last)
        if fresh:
            part = flat.index_select(0, pages[lo:hi])
        else:
            part = torch.index_select(flat, 0, pages[lo:hi],
                                      out=_buffer((hi - lo, flat.shape[1]), pool))
        yield part.view(((hi - lo) * bs,) + pool.shape[2:])[:min(stop, hi * bs) - lo * bs]


def _buffer(shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """This thread's buffer on ``like``'s device as a tensor of ``shape`` and ``like``'s dtype
    (uninitialised), grown when too small and reused otherwise: no allocation (and no fresh
    memory to fault in) per part."""
    size = shape[0] * shape[1] * like.element_size()
    buffers = _local.__dict__.setdefault("buffers", {})
    raw = buffers.get(like.device)
    if raw is None or raw.numel() < size:
        raw = buffers[like.device] = torch.empty(size, dtype=torch.uint8, device=like.device)
    return raw[:size].view(like.dtype).view(shape)


def _chunk_result(
    scores: torch.Tensor, values: Iterator[torch.Tensor], compute: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's partial result from its scores ``(kv_heads, rows, keys)`` (``-inf`` where
    not allowed) and its values, consecutive parts ``(keys, kv_heads, v_dim)`` (read once, in
    order): the output ``(kv_heads, rows, v_dim)`` and the lse ``(kv_heads, rows)``; a row
    without a key gives 0 and ``-inf``."""
    row_max = scores.detach().amax(dim=-1, keepdim=True)  # a shift: constant for autograd
    shift = torch.where(row_max == NEG_INF, 0.0, row_max)  # no -inf - -inf
    weights = torch.exp(scores - shift)
    row_sum = weights.sum(dim=-1, keepdim=True)
    acc, at = 0, 0
    for part in values:  # (kv_heads, rows, keys) @ (kv_heads, keys, v_dim)
        acc = acc + torch.bmm(weights[..., at:at + part.shape[0]],
                              part.to(compute).transpose(0, 1))
        at += part.shape[0]
    empty = row_sum == 0.0  # no key in the chunk
    safe = torch.where(empty, 1.0, row_sum)
    return acc / safe, torch.where(empty, NEG_INF, shift + torch.log(safe))[..., 0]


def _limits(lengths: torch.Tensor, q_len: int, rows: int) -> torch.Tensor:
    """``(len(lengths), rows, 1)``: row ``r`` (query ``r % q_len``) of a sequence of ``length``
    positions attends the positions below ``length - q_len + 1 + r % q_len`` (bottom-right
    causal)."""
    offsets = torch.arange(rows, device=lengths.device) % q_len if q_len else \
        torch.zeros(rows, dtype=torch.long, device=lengths.device)
    return (lengths[:, None] - q_len + 1 + offsets)[:, :, None]


def _merge_chunks(
    outputs: torch.Tensor, lses: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial results ``(chunks, ..., heads, n, v_dim)`` with their lses ``(chunks,
    ..., heads, n)`` in chunk order (``merge_attention``'s rule; ``sinks (heads,)`` join once):
    ``(output (..., heads, n, v_dim), lse (..., heads, n))``."""
    output, lse = _merge_attention(tuple(outputs), tuple(lses[..., None]), sinks)
    return output, lse[..., 0]
