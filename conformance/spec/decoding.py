"""Incremental decoding.

A key/value cache (``KVCache``) and the modules' ``decode`` method; decoding at scale:
split-KV decoding (``SPLIT_DECODING``) and a paged cache (``PagedKVCache``, ``paged_attention``).
"""

from __future__ import annotations

from typing import Any

from attention_rules import SPLIT_KV  # noqa: F401 - data of the spec, shown in the docs

#: Public classes outside MODULES: RoPE's stub is in rotary.py, MultiHeadLatentAttention's in
#: latent_attention.py (its methods are checked there, tests/test_latent_attention.py).
CLASSES = ("KVCache", "PagedKVCache", "RoPE", "MultiHeadLatentAttention")
#: The quantised cache's classes (their stubs are in quantized_cache.py).
CLASSES += ("KVQuantization", "QuantizedArray", "QuantizedKVCache")

#: Modules with a ``decode`` method (``DecodingModule.decode`` gives its signature).
DECODING_MODULES = ("CausalSelfAttention", "MultiHeadAttention")

DECODING = (
    "A KVCache preallocates keys (..., kv_heads, max_len, head_dim) and values (..., kv_heads, "
    "max_len, v_dim) and fills them left to right. append(key, value) returns the cache holding "
    "the new positions: numpy_attn and torch_attn write in place and return the same cache; "
    "jax_attn caches are immutable pytrees (length is a traced int32 scalar, so a jitted "
    "decoding step compiles once per chunk size) and return a new cache. Write "
    "`cache = cache.append(key, value)` to be portable. "
    "module.decode(x, cache) projects the new tokens x (..., n, d), appends their keys and "
    "values, and attends with the bottom-right causal rule over every cached position, so "
    "decoding a sequence token by token, or in chunks, equals forward(x, is_causal=True) "
    "(CausalSelfAttention: forward(x)). decode never applies dropout. It returns "
    "(output, cache); cache=None starts a cache of max_len positions (default: n). "
    "The cache holds values only, never autograd history (torch_attn stores detached "
    "copies), so a decoding loop's memory does not grow with the number of steps; torch_attn's "
    "decode records a graph only when a gradient is requested (grad mode on and the module in "
    "training mode; in eval() it runs as under torch.no_grad()), and then the cached positions "
    "are constants of that graph."
)

#: What appending past ``max_len`` does, in every backend.
CACHE_OVERFLOW = (
    "An append whose length + n exceeds max_len never writes silently. Where length is a "
    "concrete number (numpy_attn and torch_attn always, jax_attn outside jit) it is a "
    "ValueError naming max_len, raised before anything changes: the cache stays as it was. "
    "Under jax.jit, where length is traced and nothing can raise, the append makes the overflow "
    "impossible to miss: length still grows past max_len, so `cache.overflowed` (length > "
    "max_len, a traced bool) is True from then on; the write puts NaN in the last n positions "
    "of both buffers (lax.dynamic_update_slice clamps the start), so every later decode output "
    "is NaN (never a finite wrong number); and the write starts at the true, out-of-bounds "
    "position, which jax.experimental.checkify reports when the step is wrapped in "
    "checkify.checkify(step, errors=checkify.index_checks). `overflowed` exists in every "
    "backend (always False where an overflow raises)."
)


class KVCache:
    """Keys and values of the positions decoded so far, preallocated to ``max_len``.

    Attributes (read-only): ``keys`` ``(..., kv_heads, length, head_dim)`` and ``values``
    ``(..., kv_heads, length, v_dim)`` are views of the filled part (jax_attn: slices, outside
    jit only); ``length`` the number of filled positions (jax_attn: an int32 scalar array);
    ``max_len`` the capacity; ``overflowed`` True once an append went past ``max_len``
    (``CACHE_OVERFLOW``).
    """

    @classmethod
    def empty(
        cls,
        batch_shape: tuple,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        v_dim: int | None = None,
        *,
        dtype: Any = "float32",
        device: Any = None,
    ) -> Any:
        """An empty cache: buffers ``(*batch_shape, kv_heads, max_len, head_dim | v_dim)`` of zeros.

        ``v_dim`` defaults to ``head_dim``; ``dtype`` a dtype name or the backend's dtype;
        ``device`` as in ``causal_mask``.
        """

    def append(self, key: Any, value: Any) -> Any:
        """Add ``key (..., kv_heads, n, head_dim)`` and ``value (..., kv_heads, n, v_dim)``.

        Cast to the cache's dtype. Returns the cache (see ``DECODING``); ValueError when
        ``length + n > max_len`` (under ``jax.jit``: see ``CACHE_OVERFLOW``) or when the shapes
        do not match the cache.
        """


class DecodingModule:
    """The ``decode`` method of the modules named in ``DECODING_MODULES``."""

    def decode(self, x: Any, cache: Any = None, *, max_len: int | None = None) -> Any:
        """Attend the new tokens ``x`` over the cached ones and themselves (bottom-right causal).

        Args:
          x: ``(..., n, d_in)`` (``d_model`` for MultiHeadAttention): the next ``n`` tokens.
          cache: a ``KVCache`` from an earlier ``decode`` (``kv_heads`` = ``num_kv_heads``;
            CausalSelfAttention: 1 head of ``d_out_kq``/``d_out_v``), or None for a new one.
          max_len: capacity of the new cache when ``cache`` is None (default ``n``).

        Returns:
          ``(output, cache)``: ``output (..., n, d_out)`` as ``forward`` gives for these
          positions, and the cache holding every position so far.
        """


#: Split-KV decoding ("flash-decoding"), in words; its numbers are ``SPLIT_KV``.
SPLIT_DECODING = (
    "A decoding step over a long cache cuts the cached keys into chunks, attends the step's "
    "queries over each chunk on its own (a partial output and its row log-sum-exp, the "
    "bottom-right causal rule applied by absolute position), and merges the partial results "
    "by MERGING's rule (merge_attention: exact within rounding; sinks join once, in the "
    "merge). A KVCache step splits when it has at most SPLIT_KV['max_q_len'] query rows and "
    "at least SPLIT_KV['min_kv_len'] cached keys (jax_attn: max_len, the static buffer, "
    "whose unfilled positions are masked): chunks of SPLIT_KV['chunk'] consecutive keys, the "
    "last one shorter. The paged cache always attends in chunks of whole pages, max(1, "
    "chunk // block_size) pages each. numpy_attn runs the chunks as tasks on its thread pool "
    "(one query row is too little work to share any other way: a step uses every core), a "
    "paged chunk's pages copied a part at a time into a buffer reused by the thread, one "
    "product per part; jax_attn runs the chunks as one batched computation over a chunk axis "
    "(pages: a lax.scan over the chunks, each chunk in SPLIT_KV['steps'] steps of the online "
    "softmax, a step copying its pages of every sequence, large pages one at a time); "
    "torch_attn as a batched computation too (one product for the scores, every chunk's "
    "softmax at once, one bmm per batch row and kv head over its chunks; pages: a "
    "chunk's pages copied a part at a time by index_select, one bmm per part). The split "
    "changes rounding only; jax_attn and torch_attn differentiate through the chunks and the "
    "merge by autodiff."
)

#: The paged KV cache, in words.
PAGED_CACHE = (
    "PagedKVCache keeps the keys and values of many sequences in one pool of pages, key_pages "
    "(num_blocks, block_size, kv_heads, head_dim) and value_pages (num_blocks, block_size, "
    "kv_heads, v_dim) (the layout of flash-attn's flash_attn_with_kvcache and of vLLM's "
    "FlashAttention backend, whose kv_cache (2, num_blocks, block_size, kv_heads, head_dim) "
    "holds the two pools; vLLM's own PagedAttention kernels, paged_attention_v1 and v2, use "
    "other layouts: keys (num_blocks, kv_heads, head_dim / x, block_size, x), values "
    "(num_blocks, kv_heads, head_dim, block_size)): "
    "position t of sequence b lives in row t % block_size of page block_table[b, t // "
    "block_size]. Sequences are ints >= 0: append(keys, values, seqs) adds n positions to each "
    "sequence of the batch (an id the cache does not hold starts an empty sequence), taking a "
    "page from the free list (lowest index first) whenever a sequence's last page is full; "
    "free(seq) gives the sequence's pages back to the free list, and later appends reuse them. "
    "A pool too small for an append is a ValueError raised before anything changes. A page "
    "belongs to one sequence (prefix sharing, vLLM's copy-on-write, is not part of this "
    "spec). tables(seqs) gives block_table (batch, max_blocks) int32 (-1 past a sequence's "
    "last page) and seq_lens (batch,) int32, the arguments of paged_attention; attend(query, "
    "seqs) calls it. numpy_attn and torch_attn write in place and return the cache; jax_attn "
    "returns a new cache (its pages are immutable arrays; the bookkeeping is Python and runs "
    "outside jit, paged_attention itself is jit-able). The pages hold values only (torch_attn "
    "stores detached copies). module.decode(x, cache) takes a PagedKVCache too: sequences "
    "0..batch-1 of x's one batch axis, and the step equals decoding with a KVCache. "
    "Gradients: jax_attn and torch_attn differentiate paged_attention through its reads of "
    "the pages (query, key_pages, value_pages, sinks); numpy_attn computes the forward pass "
    "only (no VJP of paged_attention)."
)


class PagedKVCache:
    """A pool of key/value pages shared by many sequences (``PAGED_CACHE``).

    ``PagedKVCache(num_blocks, block_size, kv_heads, head_dim, v_dim=None, *, dtype="float32",
    device=None)``: ``num_blocks`` pages of ``block_size`` positions, all free, zeros;
    ``v_dim`` defaults to ``head_dim``; ``dtype`` and ``device`` as in ``KVCache.empty``.
    Attributes (read-only): ``key_pages`` ``(num_blocks, block_size, kv_heads, head_dim)``,
    ``value_pages`` ``(num_blocks, block_size, kv_heads, v_dim)``, ``num_blocks``,
    ``block_size``, ``num_free_blocks`` (an int).
    """

    def append(self, keys: Any, values: Any, seqs: Any = None) -> Any:
        """Add ``keys (batch, kv_heads, n, head_dim)`` and ``values (batch, kv_heads, n,
        v_dim)``: row ``b`` to sequence ``seqs[b]`` (default ``0..batch-1``), cast to the
        pages' dtype. Returns the cache (see ``PAGED_CACHE``); ValueError for a full pool,
        repeated or negative ids, or shapes that do not fit the pages.
        """

    def free(self, seq: int) -> Any:
        """Give sequence ``seq``'s pages back to the free list; returns the cache (ValueError
        for a sequence the cache does not hold)."""

    def seq_len(self, seq: int) -> int:
        """Positions held for sequence ``seq`` (0 for one the cache does not hold)."""

    def tables(self, seqs: Any = None) -> Any:
        """``(block_table, seq_lens)`` of sequences ``seqs`` (default ``0..`` the largest id
        + 1): ``(batch, max_blocks)`` int32 page indices (-1 past each sequence's last page;
        ``max_blocks`` the most pages any of them holds, at least 1) and ``(batch,)`` int32."""

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
        """``paged_attention(query, key_pages, value_pages, *tables(seqs), ...)``: ``query
        (batch, heads, q_len, head_dim)``, the last ``q_len`` positions of each sequence."""


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

    Query ``i`` of sequence ``b`` is position ``seq_lens[b] - q_len + i`` and attends the
    positions ``j <= seq_lens[b] - q_len + i`` (the bottom-right causal rule; with ``q_len =
    1`` every position below ``seq_lens[b]``), position ``j`` read from row ``j % block_size``
    of page ``block_table[b, j // block_size]``: equal, within rounding, to
    ``scaled_dot_product_attention`` over the sequence's keys gathered into one array with
    ``is_causal=True, causal_alignment="bottom_right"`` (a row without a key: output 0, lse
    ``-inf`` or its sink). Computed in chunks of whole pages merged by their log-sum-exp
    (``SPLIT_DECODING``). Entries past ``ceil(seq_lens[b] / block_size)`` are never read.
    ValueError (via ``attention_rules``, naming the entry and the numbers) for a used entry
    outside ``[0, num_blocks)``, a page used twice (by another sequence, or twice by one),
    ``seq_lens[b]`` outside ``[0, max_blocks · block_size]``; under ``jax.jit``, where the
    table is traced and nothing can raise, every index or length the library reads poisons
    the rows it governs instead: an out-of-range used entry or a ``seq_lens[b]`` outside
    ``[0, max_blocks · block_size]`` gives NaN in that sequence's output and lse (never a
    finite wrong number, nor zeros) and reads no other sequence's page, nor sends one a
    gradient. ``varlen_attention`` follows the same rule with traced offsets: a ``block_table``
    entry a sequence uses outside the pool, or a ``seqused_k[i]`` outside its keys, makes that
    sequence's query rows NaN; ``cu_seq_q`` / ``cu_seq_k`` that do not start at 0, go down, or
    end before or after their tokens, or a sequence longer than ``max_q`` / ``max_k``, make
    every row NaN.

    Args:
      query: ``(batch, heads, q_len, head_dim)``; ``heads`` a multiple of ``kv_heads``.
      key_pages: ``(num_blocks, block_size, kv_heads, head_dim)``, the query's dtype.
      value_pages: ``(num_blocks, block_size, kv_heads, v_dim)``.
      block_table: ``(batch, max_blocks)`` ints: the pages of each sequence, in order.
      seq_lens: ``(batch,)`` ints: the positions each sequence holds.
      scale, softcap, sinks, return_lse: as in ``scaled_dot_product_attention``.

    Returns:
      ``(batch, heads, q_len, v_dim)`` in the query's dtype; with ``return_lse``, ``(output,
      lse)``, lse ``(batch, heads, q_len)`` in the compute dtype.
    """
