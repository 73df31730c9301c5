"""Packed variable-length batches in NumPy: ``varlen_attention``, its VJP by hand, and the
converters between a padded batch and the packed layout (``conformance/spec/varlen.py``).

A packed batch stores ``N`` sequences one after another along the token axis: query
``(total_q, heads, head_dim)``, key ``(total_k, kv_heads, head_dim)``, value ``(total_k,
kv_heads, v_dim)``, with cumulative offsets ``cu_seq_q`` and ``cu_seq_k`` (``(N + 1,)`` ints) —
``torch.nn.attention.varlen.varlen_attn``'s names and meaning. Each sequence attends to its own
keys only, its window aligned bottom-right (``window_size=(-1, 0)`` is causal).

Only the work inside the sequences is done: ``attention_rules.varlen`` checks the offsets and
gathers the sequences of one shape ``(q_len, k_len)`` into a group; each group is one batch
``(n, heads, q_len, dim)`` for ``functional.pipeline`` (the checked
``scaled_dot_product_attention`` on validated arrays), and the results are written back to the
group's rows. Groups that ``_fast.use_fast_path`` sends to the blocked path run one after
another, each on every core; the others are tasks of ``_threads.run_lanes`` (one group per
task, largest first, BLAS in one thread), where ``pipeline`` takes the explicit steps (the same
rule decides, on the same shapes, so no task ever starts the thread pool again). The VJP is the
same plan with ``backward.scaled_dot_product_attention_vjp`` (written by hand) per group.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import attention_rules as rules
from attention_rules import varlen as varlen_rules

from . import _fast, _threads
from ._arrays import _array, _describe
from .backward import scaled_dot_product_attention_vjp
from .functional import pipeline


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
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Attention of a packed batch: each sequence over its own keys, bottom-right aligned.

    Args:
      query: ``(total_q, heads, head_dim)``.
      key: ``(total_k, kv_heads, head_dim)``, or ``(total_pages, page_size, kv_heads,
        head_dim)`` with ``block_table``.
      value: ``(total_k, kv_heads, v_dim)`` (or paged like key).
      cu_seq_q: ``(N + 1,)`` ints: sequence ``i``'s queries are ``cu_seq_q[i]:cu_seq_q[i+1]``.
      cu_seq_k: ``(N + 1,)`` ints, the keys' offsets (may be None with ``block_table``).
      max_q: an int ``>=`` the longest query sequence.
      max_k: an int ``>=`` the longest key sequence.
      scale: default ``head_dim ** -0.5``.
      window_size: ``(left, right)``, ``-1`` unbounded; ``(-1, 0)`` is causal.
      enable_gqa: allow fewer key/value heads (a divisor of ``heads``).
      seqused_k: ``(N,)`` ints, the keys in use per sequence (required with pages), or None.
      block_table: ``(N, pages)`` page indices into key and value, or None.
      return_lse: also return the row log-sum-exp.
      softcap: ``softcap · tanh(scores / softcap)``, or None.
      sinks: ``(heads,)`` sink logits, or None.

    Returns:
      ``(total_q, heads, v_dim)`` in the input dtype; with ``return_lse`` also the lse
      ``(heads, total_q)`` in the compute dtype (``-inf`` for a row without a key nor a sink).
    """
    fn = "varlen_attention"
    args, plan, query, key, value, _ = _prepare(
        fn, query, key, value, None, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size,
        enable_gqa, seqused_k, block_table, return_lse, softcap, sinks)
    sinks = _array(sinks)
    output = np.zeros((args.total_q, args.heads, args.v_dim), query.dtype)
    lse = np.full((args.heads, args.total_q), -np.inf, rules.compute_dtype(args.dtype)) \
        if args.return_lse else None

    def block(_: int, q_rows: np.ndarray, __: np.ndarray, arrays: tuple,
              group_args: rules.Arguments, ___: Any) -> None:
        result = pipeline(*arrays, None, None, None, None, group_args, sinks)
        out, group_lse = result if args.return_lse else (result, None)
        output[q_rows] = out.transpose(0, 2, 1, 3)  # (n, q_len, heads, v_dim)
        if lse is not None:
            lse[:, q_rows] = group_lse.transpose(1, 0, 2)  # (heads, n, q_len)

    _run(fn, args, plan, (query, key, value), block)
    return output if lse is None else (output, lse)


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
) -> tuple[np.ndarray, ...]:
    """Gradients of ``varlen_attention``, by hand: ``scaled_dot_product_attention_vjp`` (the
    FlashAttention backward written out in ``backward.py``) per group of sequences, its
    gradients scattered back to the groups' tokens (into the pages, adding, with pages).

    Args:
      query, key, value, cu_seq_q, cu_seq_k, max_q, max_k: as in ``varlen_attention``.
      grad_output: ``(total_q, heads, v_dim)``.
      scale, window_size, enable_gqa, seqused_k, block_table, softcap, sinks: as in
        ``varlen_attention``.

    Returns:
      ``(grad_query, grad_key, grad_value)`` shaped and typed like query, key and value (keys
      outside ``seqused_k`` get 0), and with ``sinks`` ``grad_sinks (heads,)`` fourth.
    """
    fn = "varlen_attention_vjp"
    shapes = (np.shape(key), np.shape(value))  # with pages, the pools'
    args, plan, query, key, value, key_index = _prepare(
        fn, query, key, value, grad_output, cu_seq_q, cu_seq_k, max_q, max_k, scale,
        window_size, enable_gqa, seqused_k, block_table, False, softcap, sinks)
    grad_output, sinks = _array(grad_output), _array(sinks)
    grads: list = [None] * len(plan)  # per group, in the plan's order

    def block(index: int, q_rows: np.ndarray, k_rows: np.ndarray, arrays: tuple,
              _: rules.Arguments, __: Any) -> None:
        d_out = grad_output[q_rows].transpose(0, 2, 1, 3)  # (n, heads, q_len, v_dim)
        grads[index] = (q_rows, k_rows, scaled_dot_product_attention_vjp(
            *arrays, d_out, causal_alignment="bottom_right", window=args.window,
            scale=args.scale, softcap=args.softcap, sinks=sinks))

    _run(fn, args, plan, (query, key, value), block)
    grad_q, grad_k, grad_v = np.zeros_like(query), np.zeros_like(key), np.zeros_like(value)
    grad_sinks = None if sinks is None else np.zeros(sinks.shape, sinks.dtype)
    for q_rows, k_rows, (d_q, d_k, d_v, _, *d_sinks) in grads:  # added in the plan's order
        grad_q[q_rows] = d_q.transpose(0, 2, 1, 3)
        grad_k[k_rows] = d_k.transpose(0, 2, 1, 3)  # each key belongs to one sequence
        grad_v[k_rows] = d_v.transpose(0, 2, 1, 3)
        if d_sinks:
            grad_sinks += d_sinks[0]
    result = (grad_q, grad_k, grad_v)
    if key_index is not None:  # pages: the gathered keys' gradients go home, adding
        result = (grad_q, _to_pages(grad_k, key_index, args, shapes[0]),
                  _to_pages(grad_v, key_index, args, shapes[1]))
    return result if sinks is None else result + (grad_sinks,)


def pack_sequences(padded: Any, lengths: Any) -> tuple[np.ndarray, np.ndarray]:
    """A padded batch to the packed layout; the padding is never read.

    Args:
      padded: ``(batch, heads, max_len, dim)`` or ``(batch, heads, max_len)``.
      lengths: ``(batch,)`` ints in ``[0, max_len]``.

    Returns:
      ``(packed, cu_seq)``: ``(sum(lengths), heads[, dim])`` in padded's dtype and the
      ``(batch + 1,)`` int32 offsets.
    """
    fn = "pack_sequences"
    shape, _ = varlen_rules.check_pack(fn, _describe(fn, "padded", padded),
                                       _describe(fn, "lengths", lengths))
    padded, lengths = _array(padded), _array(lengths)
    varlen_rules.check_lengths_values(fn, lengths.tolist(), shape[2])
    keep = np.arange(shape[2]) < lengths[:, None]  # (batch, max_len)
    packed = np.moveaxis(padded, 2, 1)[keep]  # (total, heads[, dim]), sequence after sequence
    cu_seq = np.zeros(shape[0] + 1, np.int32)
    np.cumsum(lengths, out=cu_seq[1:])
    return packed, cu_seq


def unpack_sequences(packed: Any, cu_seq: Any, max_len: int) -> np.ndarray:
    """The packed layout back to a padded batch, zeros after each sequence's end.

    Args:
      packed: ``(total, heads, dim)`` or ``(total, heads)``.
      cu_seq: ``(batch + 1,)`` int offsets.
      max_len: an int ``>=`` the longest sequence.

    Returns:
      ``(batch, heads, max_len, dim)`` (or ``(batch, heads, max_len)``) in packed's dtype.
    """
    fn = "unpack_sequences"
    max_len = varlen_rules.check_unpack(fn, _describe(fn, "packed", packed),
                                        _describe(fn, "cu_seq", cu_seq), max_len)
    packed, offsets = _array(packed), _array(cu_seq).tolist()
    varlen_rules.check_offsets(fn, "cu_seq", offsets, packed.shape[0], "packed")
    lengths = np.diff(np.asarray(offsets, np.int64))
    varlen_rules.check_max_len(fn, "max_len", max_len, lengths.tolist(), "packed")
    keep = np.arange(max_len) < lengths[:, None]  # (batch, max_len)
    padded = np.zeros((len(lengths), max_len) + packed.shape[1:], packed.dtype)
    padded[keep] = packed
    return np.moveaxis(padded, 1, 2)  # (batch, heads, max_len[, dim])


# ------------------------------------------------------------------------------------------
# The plan: checks, pages, groups
# ------------------------------------------------------------------------------------------


def _prepare(
    fn: str, query: Any, key: Any, value: Any, grad_output: Any, cu_seq_q: Any, cu_seq_k: Any,
    max_q: Any, max_k: Any, scale: Any, window_size: Any, enable_gqa: Any, seqused_k: Any,
    block_table: Any, return_lse: Any, softcap: Any, sinks: Any,
) -> tuple[varlen_rules.VarlenArguments, list, np.ndarray, np.ndarray, np.ndarray,
           np.ndarray | None]:
    """Every rule (``attention_rules.varlen``), then the groups, query ``(total_q, heads,
    head_dim)`` and the packed key and value ``(keys, kv_heads, dim)`` (gathered from the pages,
    whose flat token index comes last; None without pages)."""
    args = varlen_rules.varlen_arguments(
        fn, _describe(fn, "query", query), _describe(fn, "key", key),
        _describe(fn, "value", value), _describe(fn, "cu_seq_q", cu_seq_q),
        _describe(fn, "cu_seq_k", cu_seq_k), max_q, max_k,
        grad_output=_describe(fn, "grad_output", grad_output), scale=scale,
        window_size=window_size, enable_gqa=enable_gqa,
        seqused_k=_describe(fn, "seqused_k", seqused_k),
        block_table=_describe(fn, "block_table", block_table), return_lse=return_lse,
        softcap=softcap, sinks=_describe(fn, "sinks", sinks),
    )
    used = None if seqused_k is None else _array(seqused_k).tolist()
    table = None if block_table is None else _array(block_table).tolist()
    seqs = varlen_rules.sequences(fn, args, _array(cu_seq_q).tolist(),
                                  None if cu_seq_k is None else _array(cu_seq_k).tolist(),
                                  used, table)
    query, key, value = _array(query), _array(key), _array(value)
    key_index = None
    if table is not None:
        key_index = np.asarray(varlen_rules.paged_key_index(table, used, args.page_size),
                               np.int64)
        key = key.reshape((-1,) + key.shape[2:])[key_index]  # (keys, kv_heads, head_dim)
        value = value.reshape((-1,) + value.shape[2:])[key_index]
    return args, varlen_rules.groups(seqs), query, key, value, key_index


def _rows(starts: tuple[int, ...], length: int) -> np.ndarray:
    """``(n, length)`` token indices: row ``s`` is ``starts[s] + arange(length)``."""
    return np.asarray(starts, np.int64)[:, None] + np.arange(length)


def _take(x: np.ndarray, starts: tuple[int, ...], length: int) -> np.ndarray:
    """``(n, length, ...)``: the tokens ``starts[s] + arange(length)`` of ``x (tokens, ...)``
    (one sequence: a view, no copy)."""
    if len(starts) == 1:
        return x[starts[0]:starts[0] + length][None]
    return x[_rows(starts, length)]


def _run(fn: str, args: varlen_rules.VarlenArguments, plan: list, arrays: tuple,
         block: Any) -> None:
    """``block(index, q_rows, k_rows, (q, k, v), group_args, scratch)`` per group of the plan:
    ``q_rows (n, q_len)`` and ``k_rows (n, k_len)`` its token indices, ``q, k, v`` its batch
    ``(n, heads | kv_heads, len, dim)``. The groups ``_fast.use_fast_path`` sends to the blocked
    path run now, one after another (each on every core), the others as tasks of
    ``run_lanes`` (where ``pipeline``, asked the same question, takes the explicit steps)."""
    query, key, value = arrays
    tasks = []
    for index, group in enumerate(plan):
        q_rows, k_rows = _rows(group.q_starts, group.q_len), _rows(group.k_starts, group.k_len)
        batch = tuple(_take(x, starts, length).transpose(0, 2, 1, 3) for x, starts, length in (
            (query, group.q_starts, group.q_len), (key, group.k_starts, group.k_len),
            (value, group.k_starts, group.k_len)))  # (n, heads | kv_heads, len, dim)
        group_args = varlen_rules.group_arguments(fn, args, group)
        task = (index, q_rows, k_rows, batch, group_args)
        if _fast.use_fast_path(*batch, None, None, group_args) is not None:
            block(*task, None)  # threaded inside: never from a lane
        else:
            tasks.append(task)
    _threads.run_lanes(tasks, block, lambda: None)


def _to_pages(grad: np.ndarray, key_index: np.ndarray, args: varlen_rules.VarlenArguments,
              shape: tuple[int, ...]) -> np.ndarray:
    """The gathered keys' gradients ``(keys, kv_heads, dim)`` added into the pool's pages
    ``(total_pages, page_size, kv_heads, dim)`` (a page read twice gets both)."""
    pool = np.zeros((args.total_k,) + shape[2:], grad.dtype)
    np.add.at(pool, key_index, grad)
    return pool.reshape(shape)
