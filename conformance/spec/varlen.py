"""Packed variable-length batches.

Training packs documents into one sequence and serving batches requests of different lengths
without padding: ``N`` sequences lie one after another along the token axis, with cumulative
offsets. ``varlen_attention`` takes the names and meaning of
``torch.nn.attention.varlen.varlen_attn`` (CUDA-only in torch 2.13) and flash-attn's
``flash_attn_varlen_func``, so code moves over unchanged, plus the spec's soft-cap and sinks.
``pack_sequences`` and ``unpack_sequences`` convert between a padded batch in the spec's layout
and the packed one. The rules' code: ``attention_rules/varlen.py``.
"""

from __future__ import annotations

from typing import Any

#: The layout and the rules of a packed batch.
VARLEN = (
    "Layout: query (total_q, heads, head_dim), key (total_k, kv_heads, head_dim), value "
    "(total_k, kv_heads, v_dim): tokens first, as torch's varlen_attn and flash-attn (not the "
    "spec's (..., heads, seq, dim)). cu_seq_q and cu_seq_k are the (N + 1,) integer offsets of N "
    "sequences: sequence i holds query tokens cu_seq_q[i]:cu_seq_q[i + 1] and key tokens "
    "cu_seq_k[i]:cu_seq_k[i + 1]; they start at 0, never decrease (an empty sequence repeats an "
    "offset) and end at total_q and total_k. max_q and max_k bound the longest query and key "
    "sequence (a larger value is allowed: the CUDA kernels size their grid by it; a smaller one "
    "would drop the rest of a longer sequence there, so it is an error). Each sequence attends "
    "only to its own keys, exactly as scaled_dot_product_attention on that sequence alone with "
    "causal_alignment='bottom_right': window_size=(left, right), -1 meaning unbounded, is the "
    "spec's window (None for -1) aligned to the sequence's bottom-right corner, so (-1, 0) is "
    "causal and (W, 0) causal with a sliding window of W keys back (torch: 'is_causal = "
    "window_size == (-1, 0)'). A query row with no key (an empty key sequence, or the rows above "
    "a bottom-right diagonal when q_len > k_len) gives output 0 and lse -inf (the sink with "
    "sinks). seqused_k (N,) keeps only the first seqused_k[i] keys of sequence i (a KV cache "
    "larger than its content); the alignment is then to the keys in use, as flash-attn. "
    "block_table (N, pages) with key and value a pool (total_pages, page_size, kv_heads, dim): "
    "sequence i's key t < seqused_k[i] is key[block_table[i, t // page_size], t % page_size]; "
    "seqused_k is required, cu_seq_k may be None (if given, its lengths bound seqused_k and it "
    "need not end at the pool's size); gradients flow into the pool's pages (a page shared by "
    "two sequences adds both). enable_gqa=False requires heads == kv_heads (torch's rule); "
    "with True, query head h uses kv head h // (heads // kv_heads). return_lse=True returns "
    "(output, lse) with lse (heads, total_q) in the compute dtype: the layout torch's kernel "
    "and flash-attn return (torch 2.13's docstring says (T_q, H_q), its kernel and meta "
    "function (H_q, T_q)). The value of a row with no key is not theirs: flash-attn (and "
    "torch's varlen_attn, which calls it) gives such a row lse +inf, this spec -inf "
    "(LOG_SUM_EXP), the value merge_attention needs to give the part no weight; a flash lse "
    "given to merge_attention makes such rows NaN, so map +inf to -inf first (lse = "
    "where(lse == inf, -inf, lse)). torch's return_aux=AuxRequest(lse=True) is return_lse=True "
    "here; num_splits (a CUDA scheduling choice) has no meaning here and is not taken."
)

#: How every backend computes it: only the work inside the sequences.
VARLEN_COMPUTATION = (
    "The offsets are read to the host; the sequences with the same (q_len, k_len) are gathered "
    "into one (n, heads, len, dim) batch and run through the backend's own "
    "scaled_dot_product_attention (with its fast paths) once per shape, largest work first, and "
    "the results are scattered back: no padded (N, max_len) computation, no (total_q, total_k) "
    "mask. numpy_attn runs the groups too small for its blocked fast path as tasks of its thread "
    "pool (run_lanes: one group per task, BLAS in one thread) and the larger ones one after "
    "another, each on every core; its VJP is the same per group, with the hand-written "
    "scaled_dot_product_attention_vjp. torch_attn differentiates the gathers and scatters by "
    "autograd. jax_attn: under jax.jit the shapes must be static, and the grouping needs the "
    "offsets' values: with offsets known on the host (NumPy arrays, or jax arrays outside jit, "
    "or closed over by the jitted function) it groups as above and jit traces one program per "
    "set of offsets; with traced offsets (arguments of a jitted function) it cannot, and runs "
    "one masked scaled_dot_product_attention over the packed tokens instead: a (total_q, "
    "total_k) boolean mask built from segment ids (searchsorted of the offsets), the "
    "per-sequence bottom-right window and seqused_k; block_table is gathered first. That path "
    "does total_q x total_k work (the blocked fast path skips nothing for a data-dependent "
    "mask), equals the grouped one within rounding, and cannot check the offsets' values "
    "(traced): pass host offsets for speed and checks."
)

#: The errors of varlen_attention, its VJP and the converters (every backend: same type and
#: message, from attention_rules.varlen). A Python list where an array is expected is
#: TypeError, as ARRAY_INPUTS says.
VARLEN_ERRORS = {
    "query, key or value of a floating dtype not supported, or of different dtypes": "TypeError",
    "query not (total_q, heads, head_dim), key/value not (total_k, kv_heads, dim) (or "
    "(total_pages, page_size, kv_heads, dim) with block_table), key and value with different "
    "tokens or kv_heads, or query and key with different head_dim": "ValueError",
    "heads != kv_heads without enable_gqa=True, or heads not a multiple of kv_heads":
        "ValueError",
    "cu_seq_q or cu_seq_k not a 1-D integer array of N + 1 >= 1 entries, or of different "
    "lengths; cu_seq_k None without block_table": "ValueError",
    "offsets that do not start at 0, decrease, or do not end at total_q / total_k":
        "ValueError",
    "max_q or max_k not an int >= 0, or below the longest query / key sequence": "ValueError",
    "seqused_k not (N,) ints each in [0, that sequence's keys]; block_table not (N, pages) "
    "ints in [0, total_pages), or given without seqused_k": "ValueError",
    "window_size not a pair of ints each -1 or >= 0": "ValueError",
    "enable_gqa or return_lse not a bool (FLAGS), or sinks not floating point": "TypeError",
    "scale or softcap as in scaled_dot_product_attention, or sinks not (heads,)": "ValueError",
    "pack_sequences: padded not (batch, heads, max_len[, dim]), lengths not (batch,) ints in "
    "[0, max_len]; unpack_sequences: packed not (total, heads[, dim]), bad cu_seq (as above) "
    "or max_len below the longest sequence": "ValueError",
}


def varlen_attention(
    query: Any,
    key: Any,
    value: Any,
    cu_seq_q: Any,
    cu_seq_k: Any,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: Any = None,
    block_table: Any = None,
    return_lse: bool = False,
    softcap: float | None = None,
    sinks: Any = None,
) -> Any:
    """Attention of a packed batch of variable-length sequences (``VARLEN``).

    Equals, for every sequence ``i``, ``scaled_dot_product_attention`` of its own tokens with
    ``causal_alignment="bottom_right"``, the window of ``window_size``, ``scale``, ``softcap``
    and ``sinks``; computed only inside the sequences (``VARLEN_COMPUTATION``).

    Args:
      query: ``(total_q, heads, head_dim)``.
      key: ``(total_k, kv_heads, head_dim)``, or ``(total_pages, page_size, kv_heads,
        head_dim)`` with ``block_table``.
      value: ``(total_k, kv_heads, v_dim)``, or ``(total_pages, page_size, kv_heads, v_dim)``.
      cu_seq_q: ``(N + 1,)`` ints, the queries' cumulative offsets.
      cu_seq_k: ``(N + 1,)`` ints, the keys' cumulative offsets (may be None with pages).
      max_q: an int ``>=`` the longest query sequence.
      max_k: an int ``>=`` the longest key sequence (keys in use).
      scale: default ``head_dim ** -0.5``.
      window_size: ``(left, right)``, ``-1`` unbounded; ``(-1, 0)`` is causal (bottom-right).
      enable_gqa: allow ``kv_heads < heads`` (a divisor).
      seqused_k: ``(N,)`` ints: the keys in use of each sequence, or None (all).
      block_table: ``(N, max_pages_per_sequence)`` ints: paged keys and values, or None.
      return_lse: also return the row log-sum-exp.
      softcap: ``softcap · tanh(scores / softcap)``, as in ``scaled_dot_product_attention``.
      sinks: ``(heads,)`` sink logits (``SINKS``), or None.

    Returns:
      ``(total_q, heads, v_dim)`` in the input dtype; with ``return_lse``, ``(output, lse)``,
      lse ``(heads, total_q)`` in the compute dtype (``-inf`` on a row without a key nor a sink).
    """


def varlen_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    cu_seq_q: Any,
    cu_seq_k: Any,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: Any = None,
    block_table: Any = None,
    softcap: float | None = None,
    sinks: Any = None,
) -> Any:
    """Gradients of ``varlen_attention`` with respect to query, key, value (and sinks).

    numpy_attn by hand (``scaled_dot_product_attention_vjp`` per group of sequences); jax_attn
    ``jax.vjp`` and torch_attn ``torch.autograd`` through ``varlen_attention``. Keys outside
    ``seqused_k`` get gradient 0; with pages, the gradients of the pool's pages.

    Args:
      query, key, value, cu_seq_q, cu_seq_k, max_q, max_k: as in ``varlen_attention``.
      grad_output: ``(total_q, heads, v_dim)``: the gradient of a loss w.r.t. the output.
      scale, window_size, enable_gqa, seqused_k, block_table, softcap, sinks: as in
        ``varlen_attention``.

    Returns:
      ``(grad_query, grad_key, grad_value)`` shaped and typed like query, key and value, and
      with ``sinks`` a fourth, ``grad_sinks (heads,)`` in the sinks' dtype.
    """


def pack_sequences(padded: Any, lengths: Any) -> Any:
    """A padded batch in the spec's layout to the packed layout: the first ``lengths[b]``
    positions of each sequence, one after another (the padding is never read).

    Args:
      padded: ``(batch, heads, max_len, dim)`` (or ``(batch, heads, max_len)``, e.g. an lse).
      lengths: ``(batch,)`` ints in ``[0, max_len]``. jax_attn: values known on the host (the
        packed length is a shape).

    Returns:
      ``(packed, cu_seq)``: ``(total, heads, dim)`` (or ``(total, heads)``) in padded's dtype,
      ``total = sum(lengths)``, and the ``(batch + 1,)`` int32 offsets.
    """


def unpack_sequences(packed: Any, cu_seq: Any, max_len: int) -> Any:
    """The packed layout back to a padded batch, zeros after each sequence's end.

    Args:
      packed: ``(total, heads, dim)`` (or ``(total, heads)``).
      cu_seq: ``(batch + 1,)`` int offsets (the rules of ``cu_seq_q``).
      max_len: an int ``>=`` the longest sequence.

    Returns:
      ``(batch, heads, max_len, dim)`` (or ``(batch, heads, max_len)``) in packed's dtype.
    """
