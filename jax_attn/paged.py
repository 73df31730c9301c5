"""Decoding at scale in JAX: split-KV decoding and a paged key/value cache.

``split_kv_attention`` attends a decoding step's few query rows over a long cache buffer in
chunks of keys (``rules.split_chunk``) as one batched computation: the buffer reshaped to
``(..., kv_heads, chunks, chunk, head_dim)`` (a shorter last chunk computed beside it), a
partial output and row log-sum-exp per chunk, merged by their log-sum-exp (``_merge_chunks``,
the rule of ``merge_attention``, ``spec.MERGING``). ``length`` may be traced: the unfilled
positions are masked, so a jitted decoding step compiles once.

``PagedKVCache`` keeps many sequences' keys and values in one pool of pages ``(num_blocks,
block_size, kv_heads, head_dim)`` (flash-attn's and vLLM's layout), with the bookkeeping of
``attention_rules.paging``; jax: the pages are immutable arrays, so ``append`` and ``free``
return a new cache, and the bookkeeping is Python, outside jit. ``paged_attention`` is the
kernel, jit-able with a traced table and lengths: every sequence's keys in chunks of whole pages
(``rules.page_chunk``) merged by their log-sum-exp, a ``lax.scan`` over the chunks whose step is
a ``lax.scan`` of the online softmax over the chunk's pages in ``SPLIT_KV["steps"]`` steps
(``_step``). XLA on the CPU gives a product an array of its own, never a slice of the pool, so a
step copies its pages first (``jnp.take`` of whole pages in the pool's layout, one page at a
time: ``TAKE_POSITIONS``) and its products read each copy right after, while it is in the cache;
the copies are what a paged step costs more than a contiguous one. Up to ``FLAT_KV_HEADS`` kv
heads the products read the copies as they lie, one matrix ``(positions · kv_heads,
head_dim)`` against the query rows of every kv head, each head's own block kept (moving the kv
heads to the front costs a transposing copy); with more, per head. Why, and the figures:
``docs/paged_decoding.md`` and ``benchmarks/RESULTS.md`` (decoding at scale). A concrete table
is checked (``rules.check_block_table``); a traced one cannot raise, so a used entry outside the
pool, or a length outside ``[0, max_blocks · block_size]``, makes that sequence's output (and
lse) NaN, never a finite wrong number, and reads no other sequence's page (nor sends it a
gradient; ``spec.PAGED_CACHE``). Differentiable by autodiff (copies and scans).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules

from ._arrays import _array, _cache_dtype, _check_device, _describe, _place
from ._steps import NEG_INF, _merge_attention, _softcap

#: ``paged_attention`` reads the copied pages in the pool's layout, every kv head's query rows
#: against every kv head's keys, up to this many kv heads (jax_attn's choice: kv_heads times the
#: arithmetic, yet less than moving the heads; one token over 32,768 positions, 2 kv heads, CPU
#: time on a loaded 2-core machine: 1.2–1.4× the contiguous step, per head 1.5–1.8×).
FLAT_KV_HEADS = 8

#: ``paged_attention`` copies a step's pages one page at a time when a page holds this many
#: positions or more, else the step's pages at once (jax_attn's choice: one page of one sequence
#: is a ``dynamic_slice`` in XLA, on one thread; several pages a gather split over the threads,
#: 1.5× slower per step with pages of 256 positions on the loaded 2-core machine).
TAKE_POSITIONS = 256

class PagedKVCache:
    """Pages ``(num_blocks, block_size, kv_heads, head_dim | v_dim)`` of keys and values shared
    by many sequences, each with its own page table (``spec.PAGED_CACHE``); jax: immutable,
    ``append`` and ``free`` return a new cache."""

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
        ``jax.Device``, a platform name, or None for JAX's default placement."""
        fn = "PagedKVCache"
        num_blocks, block_size, kv_heads, head_dim, v_dim = rules.check_page_pool(
            fn, num_blocks, block_size, kv_heads, head_dim, v_dim)
        device = _check_device(fn, device)  # jax: a device or a platform name
        dtype = _cache_dtype(fn, dtype)
        rules.check_float_inputs(fn, dtype=dtype.name)
        shape = (num_blocks, block_size, kv_heads)
        self.key_pages = _place(jnp.zeros(shape + (head_dim,), dtype), device)
        self.value_pages = _place(jnp.zeros(shape + (v_dim,), dtype), device)
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
        v_dim)``, row ``b`` to sequence ``seqs[b]`` (default ``0..batch-1``); returns a new
        cache (jax: immutable; outside jit)."""
        fn = "PagedKVCache.append"
        keys, values = jnp.asarray(keys), jnp.asarray(values)
        rules.check_float_inputs(fn, keys=jnp.dtype(keys.dtype).name)  # cast to the pages'
        rules.check_float_inputs(fn, values=jnp.dtype(values.dtype).name)
        seqs = list(range(keys.shape[0] if keys.ndim else 0)) if seqs is None else list(seqs)
        rules.check_paged_append(fn, keys.shape, values.shape, self.key_pages.shape,
                                 self.value_pages.shape, len(seqs))
        book, pages, rows = rules.book_append(fn, self._book, seqs, keys.shape[2],
                                              self.block_size, self.num_blocks)
        pages, rows = np.asarray(pages, np.int32), np.asarray(rows, np.int32)
        new = object.__new__(PagedKVCache)
        new.key_pages = _write(self.key_pages, pages, rows, keys)
        new.value_pages = _write(self.value_pages, pages, rows, values)
        new._book = book
        return new

    def free(self, seq: int) -> PagedKVCache:
        """Give sequence ``seq``'s pages back to the free list; returns a new cache (the pages'
        contents stay until reused)."""
        new = object.__new__(PagedKVCache)
        new.key_pages, new.value_pages = self.key_pages, self.value_pages
        new._book = rules.book_free("PagedKVCache.free", self._book, seq)
        return new

    def seq_len(self, seq: int) -> int:
        """Positions held for sequence ``seq`` (0 for one the cache does not hold)."""
        [seq] = rules.check_sequences("PagedKVCache.seq_len", [seq], name="seq")
        return self._book.lengths.get(seq, 0)

    def tables(self, seqs: Any = None) -> tuple[jax.Array, jax.Array]:
        """``(block_table (batch, max_blocks), seq_lens (batch,))``, int32, of ``seqs``
        (default ``0..`` the largest id + 1); -1 past each sequence's last page."""
        seqs = None if seqs is None else list(seqs)
        table, lens = rules.book_tables("PagedKVCache.tables", self._book, seqs)
        return jnp.asarray(table, jnp.int32), jnp.asarray(lens, jnp.int32)

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


@jax.jit
def _write(pages: jax.Array, page: jax.Array, row: jax.Array, x: jax.Array) -> jax.Array:
    """``pages`` with ``x (batch, kv_heads, n, dim)`` written to rows ``row`` of pages ``page``
    (``(batch · n,)`` each, row-major): one compiled scatter per shape."""
    # one row per position (the count is explicit: -1 is ambiguous for zero-width values)
    x = x.transpose(0, 2, 1, 3).reshape(x.shape[0] * x.shape[2], x.shape[1], x.shape[3])
    return pages.at[page, row].set(x.astype(pages.dtype))


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
    chunks of whole pages merged by their log-sum-exp (``spec.SPLIT_DECODING``). Jit-able
    (``block_table`` and ``seq_lens`` may be traced); differentiable.

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
    if not any(isinstance(x, jax.core.Tracer) for x in (block_table, seq_lens)):  # concrete
        rules.check_block_table(fn, np.asarray(block_table).tolist(),
                                np.asarray(seq_lens).tolist(), args.num_blocks, args.block_size)
    query = _array(query)
    per = rules.page_chunk(args.block_size)  # pages per chunk
    chunks = tuple(rules.kv_chunks(max(1, args.max_blocks) * args.block_size,
                                   per * args.block_size))
    per = min(per, max(1, args.max_blocks))
    most = max(1, per // rules.SPLIT_KV["steps"])  # pages per step: a divisor of per
    step = max(d for d in range(1, most + 1) if per % d == 0)
    take = 1 if args.block_size >= TAKE_POSITIONS else step  # pages per copy
    outputs, lses = _paged(query, _array(key_pages), _array(value_pages),
                           _array(block_table).astype(jnp.int32),
                           _array(seq_lens).astype(jnp.int32), args=args, chunks=chunks,
                           per=per, step=step, take=take)
    output, lse = _merge_chunks(outputs, lses, _array(sinks))
    return (output.astype(query.dtype), lse) if return_lse else output.astype(query.dtype)


def split_kv_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    chunk: int,
    *,
    sinks: jax.Array | None = None,
    length: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """A decoding step over a contiguous cache, split into chunks of ``chunk`` keys
    (``spec.SPLIT_DECODING``): ``query (..., heads, n, head_dim)`` are the last ``n`` of the
    first ``length`` positions of ``key (..., kv_heads, kv_len, head_dim)`` / ``value (...,
    kv_heads, kv_len, v_dim)`` (the bottom-right causal rule; jax: ``length`` may be traced,
    default ``kv_len``, later positions are masked); default scale. Validated inputs.

    Returns:
      ``(output (..., heads, n, v_dim)`` in the query's dtype, ``lse (..., heads, n))``.
    """
    kv_len = key.shape[-2]
    length = kv_len if length is None else length
    outputs, lses = _split_partials(query, key, value, jnp.asarray(length),
                                    chunks=tuple(rules.kv_chunks(kv_len, chunk)), chunk=chunk)
    output, lse = _merge_chunks(outputs, lses, sinks)
    return output.astype(query.dtype), lse


@functools.partial(jax.jit, static_argnames=("chunks", "chunk"))
def _split_partials(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    length: jax.Array,
    *,
    chunks: tuple[tuple[int, int], ...],
    chunk: int,
) -> tuple[jax.Array, jax.Array]:
    """The partial results of ``split_kv_attention``, one compiled program per shape and plan:
    outputs ``(chunks, ..., heads, n, v_dim)`` and lses ``(chunks, ..., heads, n)`` in the
    compute dtype. The full chunks run as one batch (the buffer reshaped to ``(..., kv_heads,
    chunks, chunk, head_dim)``), a shorter last one beside them."""
    batch, (heads, n, head_dim) = query.shape[:-3], query.shape[-3:]
    kv_heads, kv_len = key.shape[-3:-1]
    compute = jnp.dtype(rules.compute_dtype(jnp.dtype(query.dtype).name))
    rows = query.reshape(-1, kv_heads, heads // kv_heads * n, head_dim).astype(compute)
    rows = rows * rules.default_scale(head_dim)
    keys = key.reshape(-1, kv_heads, kv_len, head_dim)
    values = value.reshape(-1, kv_heads, kv_len, value.shape[-1])
    limits = (length - n + 1 + jnp.arange(rows.shape[-2]) % max(n, 1))[:, None]  # (rows, 1)
    full = kv_len // chunk  # jax: the full chunks as one batch, the shorter last one beside
    outputs, lses = [], []
    for first, last, width in ((0, full, chunk), (full, len(chunks), kv_len - full * chunk)):
        if last <= first:
            continue
        span = slice(first * chunk, first * chunk + (last - first) * width)
        part_keys = keys[..., span, :].reshape(keys.shape[:2] + (last - first, width, -1))
        part_values = values[..., span, :].reshape(values.shape[:2] + (last - first, width, -1))
        scores = jnp.einsum("bhrd,bhckd->bhcrk", rows, part_keys.astype(compute))
        positions = (jnp.asarray([start for start, _ in chunks[first:last]])[:, None, None]
                     + jnp.arange(width))  # (chunks, 1, width)
        stops = jnp.asarray([stop for _, stop in chunks[first:last]])[:, None, None]
        allowed = (positions < stops) & (positions < limits)  # (chunks, rows, width)
        output, lse = _softmax_output(jnp.where(allowed, scores, NEG_INF),
                                      part_values.astype(compute), "bhcrk,bhckv->bhcrv")
        outputs.append(output)
        lses.append(lse)
    output = jnp.concatenate(outputs, axis=2)  # (batch, kv_heads, chunks, rows, v_dim)
    lse = jnp.concatenate(lses, axis=2)
    shape = batch + (heads, n)
    return (jnp.moveaxis(output, 2, 0).reshape((-1,) + shape + (value.shape[-1],)),
            jnp.moveaxis(lse, 2, 0).reshape((-1,) + shape))


@functools.partial(jax.jit, static_argnames=("args", "chunks", "per", "step", "take"))
def _paged(
    query: jax.Array, key_pages: jax.Array, value_pages: jax.Array, table: jax.Array,
    lens: jax.Array, *, args: rules.PagedArguments, chunks: tuple[tuple[int, int], ...],
    per: int, step: int, take: int,
) -> tuple[jax.Array, jax.Array]:
    """The partial results of ``paged_attention`` (table and lengths may be traced), one
    program per shape and plan: outputs ``(chunks, batch, heads, q_len, v_dim)`` and lses
    ``(chunks, batch, heads, q_len)`` in the compute dtype: a ``lax.scan`` over ``chunks``
    (``per`` pages each; a sequence's stops at its length), each a ``lax.scan`` of the online
    softmax over its pages, ``step`` pages a step, copied ``take`` at a time (``_step``)."""
    compute = jnp.dtype(args.compute)
    batch, bs, count = args.batch, args.block_size, len(chunks)
    table = jnp.pad(table, ((0, 0), (0, max(0, count * per - args.max_blocks))))
    table = table[:, :count * per].reshape(batch, count, per)
    first = jnp.asarray([start for start, _ in chunks])  # (chunks,): a chunk's first position
    position = (first[:, None] // bs + jnp.arange(per)) * bs  # (chunks, per): each page's first
    used = position[None] < lens[:, None, None]  # (batch, chunks, per): the pages read
    # jax: a traced table cannot raise; a used entry outside the pool makes its sequence NaN
    # (the NaN goes into the scores), never another page's numbers nor their gradients
    bad = (used & ((table < 0) | (table >= args.num_blocks))).any(axis=(1, 2))  # (batch,)
    bad |= (lens < 0) | (lens > args.max_blocks * bs)  # a length the table cannot hold
    pages = jnp.where(used, table, 0)  # unread slots read page 0, masked
    pages = pages.reshape(batch, count, per // step, step).transpose(1, 2, 0, 3)  # scans' order
    stops = jnp.minimum(jnp.asarray([stop for _, stop in chunks])[:, None], lens)  # (ch, b)
    group = args.heads // args.kv_heads * args.q_len  # a kv head's query rows
    rows = query.reshape(batch, args.kv_heads, group, query.shape[-1]).astype(compute) * args.scale
    limits = lens[:, None] - args.q_len + 1 + jnp.arange(rows.shape[-2]) % max(args.q_len, 1)
    poison = jnp.where(bad, jnp.nan, 0.0).astype(compute)[:, None, None, None]
    pools = tuple(pool.reshape(pool.shape[0], -1 if pool.size else 0)  # (num_blocks, page)
                  for pool in (key_pages, value_pages))
    width = step * bs  # a step's positions

    def chunk_step(carry: None, chunk: tuple) -> tuple[None, tuple[jax.Array, jax.Array]]:
        start, stop, page = chunk  # (), (batch,), (steps, batch, step)

        def online(stats: tuple, part: tuple) -> tuple[tuple, None]:
            index, part_pages = part  # (), (batch, step)
            positions = start + index * width + jnp.arange(width)  # (keys,)
            held = positions < stop[:, None]  # (batch, keys): the sequence's positions
            allowed = held[:, None, :] & (positions[None, None, :] < limits[:, :, None])
            return _step(stats, rows, pools, part_pages, (allowed, held), poison, args, take), None

        zeros = jnp.zeros(rows.shape[:-1] + (1,), compute)  # (batch, kv_heads, rows, 1)
        stats = (zeros + NEG_INF, zeros, jnp.zeros(rows.shape[:-1] + (args.v_dim,), compute))
        (row_max, row_sum, acc), _ = jax.lax.scan(online, stats, (jnp.arange(per // step), page))
        empty = row_sum == 0.0  # a chunk without a key
        safe = jnp.where(empty, 1.0, row_sum)
        return None, (acc / safe, jnp.where(empty, NEG_INF, row_max + jnp.log(safe))[..., 0])

    _, (output, lse) = jax.lax.scan(chunk_step, None, (first, stops, pages))
    # a bad sequence that reads no page (a negative length) is NaN too; 0 for the others
    output, lse = output + poison[None], lse + poison[None, ..., 0]
    shape = (count, batch, args.heads, args.q_len)  # (chunks, batch, kv_heads, rows, ...)
    return output.reshape(shape + (args.v_dim,)), lse.reshape(shape)


def _step(
    stats: tuple[jax.Array, jax.Array, jax.Array], rows: jax.Array,
    pools: tuple[jax.Array, jax.Array], page: jax.Array, masks: tuple[jax.Array, jax.Array],
    poison: jax.Array, args: rules.PagedArguments, take: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One step of the online softmax over a few pages of every sequence: ``rows (batch,
    kv_heads, rows, head_dim)`` (scaled) against the pages ``page (batch, step)`` of ``pools``
    (keys and values, ``(num_blocks, page)`` each), copied ``take`` pages at a time; ``masks``:
    the keys ``allowed (batch, rows, step · block_size)``, and the positions ``held (batch, step ·
    block_size)`` by the sequence: the others (the rest of a last page, page 0 for an unused
    slot) read as 0, so a NaN there reaches neither the output nor the gradients
    (``spec.PAGED_CACHE``: never read); ``poison (batch, 1, 1, 1)`` (NaN or 0) added to the
    scores. Updates ``stats`` = ``(row max, row sum, weighted sum)``, ``(batch, kv_heads, rows,
    1 | 1 | v_dim)`` in ``rows``' dtype (``_online_step``'s rule)."""
    batch, kv_heads, group, head_dim = rows.shape
    allowed, held = masks
    flat = kv_heads <= FLAT_KV_HEADS
    width = take * args.block_size  # a take's positions

    def taken(pool: jax.Array, index: jax.Array) -> jax.Array:  # (batch, keys, kv_heads, dim)
        # jax: "fill", not "clip": an entry outside the pool reads (and differentiates) no page
        x = jnp.take(pool, page[:, index * take:(index + 1) * take], axis=0, mode="fill")
        x = x.reshape(batch, width, kv_heads, -1).astype(rows.dtype)  # not held: 0
        return jnp.where(held[:, index * width:(index + 1) * width, None, None], x, 0.0)

    takes = range(page.shape[1] // take)
    values = [taken(pools[1], i) for i in takes]
    parts = []
    for i in takes:
        keys = taken(pools[0], i)
        if flat:  # every head's rows against every head's keys, then each head's block: the
            # products read the copied pages as they lie (no transposing copy)
            every = jnp.einsum("bkd,bxd->bkx", keys.reshape(batch, width * kv_heads, head_dim),
                               rows.reshape(batch, kv_heads * group, head_dim))
            every = every.reshape(batch, width, kv_heads, kv_heads, group)
            part = jnp.stack([every[:, :, h, h] for h in range(kv_heads)], axis=1)
            parts.append(jnp.swapaxes(part, -1, -2))  # (batch, kv_heads, rows, keys)
        else:  # the heads to the front, then per-head products
            parts.append(jnp.einsum("bhkd,bhrd->bhrk", jnp.swapaxes(keys, 1, 2), rows))
    scores = _softcap(jnp.concatenate(parts, axis=-1), args.softcap) + poison
    scores = jnp.where(allowed[:, None], scores, NEG_INF)

    def weighted(weights: jax.Array) -> jax.Array:  # (batch, kv_heads, rows, v_dim)
        acc = 0.0
        for i in takes:
            part = weights[..., i * width:(i + 1) * width]
            if flat:
                every = jnp.einsum("bxk,bkv->bxv", part.reshape(batch, kv_heads * group, width),
                                   values[i].reshape(batch, width, -1))
                every = every.reshape(batch, kv_heads, group, kv_heads, args.v_dim)
                acc = acc + jnp.stack([every[:, h, :, h] for h in range(kv_heads)], axis=1)
            else:
                acc = acc + jnp.einsum("bhrk,bhkv->bhrv", part, jnp.swapaxes(values[i], 1, 2))
        return acc

    return _online_step(stats, scores, weighted)


def _online_step(stats: tuple | None, scores: jax.Array, values: Any,
                 spec: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One step of the online softmax over more keys of the same rows: ``scores (..., rows,
    keys)`` (``-inf`` where not allowed) and ``values`` (``spec``: the einsum of the weights
    and the values; or a function of the weights that returns their weighted sum) update
    ``(row max, row sum, weighted sum)`` ``(..., rows, 1)``, ``(..., rows, 1)``, ``(..., rows,
    v_dim)``. The maxima are constants for autodiff (a shift)."""
    step_max = jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True))
    row_max = step_max if stats is None else jnp.maximum(stats[0], step_max)
    shift = jnp.where(row_max == NEG_INF, 0.0, row_max)  # no -inf - -inf
    weights = jnp.exp(scores - shift)
    row_sum = weights.sum(axis=-1, keepdims=True)
    acc = values(weights) if callable(values) else jnp.einsum(spec, weights, values)
    if stats is not None:
        rescale = jnp.exp(jnp.where(stats[0] == NEG_INF, NEG_INF, stats[0] - shift))
        row_sum = stats[1] * rescale + row_sum
        acc = stats[2] * rescale + acc
    return row_max, row_sum, acc


def _softmax_output(scores: jax.Array, values: jax.Array,
                    spec: str) -> tuple[jax.Array, jax.Array]:
    """One chunk's partial result: ``scores (..., rows, keys)`` (``-inf`` where not allowed)
    and ``values`` (``spec`` as in ``_online_step``) give the output ``(..., rows, v_dim)`` and
    the lse ``(..., rows)``; a row without a key gives 0 and ``-inf``."""
    row_max, row_sum, acc = _online_step(None, scores, values, spec)
    empty = row_sum == 0.0
    safe = jnp.where(empty, 1.0, row_sum)
    return acc / safe, jnp.where(empty, NEG_INF, row_max + jnp.log(safe))[..., 0]


def _merge_chunks(outputs: jax.Array, lses: jax.Array,
                  sinks: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Merge partial results ``(chunks, ..., heads, n, v_dim)`` with their lses ``(chunks,
    ..., heads, n)`` in chunk order (``merge_attention``'s rule; ``sinks (heads,)`` join once):
    ``(output (..., heads, n, v_dim), lse (..., heads, n))``."""
    output, lse = _merge_attention(tuple(outputs), tuple(lses[..., None]), sinks)
    return output, lse[..., 0]
