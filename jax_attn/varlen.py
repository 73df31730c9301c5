"""Packed variable-length batches in JAX: ``varlen_attention``, its VJP by ``jax.vjp``, and the
converters between a padded batch and the packed layout (``conformance/spec/varlen.py``).

``torch.nn.attention.varlen.varlen_attn``'s names and meaning: query ``(total_q, heads,
head_dim)``, key ``(total_k, kv_heads, head_dim)``, value ``(total_k, kv_heads, v_dim)``,
cumulative offsets ``cu_seq_q`` and ``cu_seq_k`` (``(N + 1,)`` ints); each sequence attends to
its own keys only, its window aligned bottom-right (``window_size=(-1, 0)`` is causal).

Under ``jax.jit`` every shape must be static, and doing only the work inside the sequences needs
the offsets' values, so there are two paths, chosen by whether the offsets (and ``seqused_k``,
``block_table``) can be read on the host:

* **host offsets** (NumPy arrays, jax arrays outside ``jit``, or arrays a jitted function closes
  over): ``attention_rules.varlen`` checks them and gathers the sequences of one shape
  ``(q_len, k_len)`` into a group; each group is one batch ``(n, heads, q_len, dim)`` for
  ``functional.pipeline`` (with its blocked fast path), and one gather puts the rows back in
  token order. All indices are NumPy constants, so ``jit`` traces one program per set of
  offsets and ``jax.grad`` differentiates the gathers;
* **traced offsets** (arguments of a jitted function): one ``pipeline`` call over all the packed
  tokens with a ``(total_q, total_k)`` boolean mask built from segment ids
  (``searchsorted`` of the offsets), each sequence's bottom-right window and ``seqused_k``
  (pages gathered first with ``block_table``). It does ``total_q × total_k`` work, equals the
  grouped path within rounding, and cannot check the offsets' values (they are tracers):
  shapes, dtypes and options are still checked.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules
from attention_rules import varlen as varlen_rules

from ._arrays import _array, _describe
from .functional import pipeline

_TRACED = object()  # an offsets array whose values are not known at trace time


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
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of a packed batch: each sequence over its own keys, bottom-right aligned.

    Args:
      query: ``(total_q, heads, head_dim)``.
      key: ``(total_k, kv_heads, head_dim)``, or ``(total_pages, page_size, kv_heads,
        head_dim)`` with ``block_table``.
      value: ``(total_k, kv_heads, v_dim)`` (or paged like key).
      cu_seq_q: ``(N + 1,)`` ints: sequence ``i``'s queries are ``cu_seq_q[i]:cu_seq_q[i+1]``.
        Host values take the grouped path; traced ones the masked path (module docstring).
      cu_seq_k: ``(N + 1,)`` ints, the keys' offsets (may be None with ``block_table``).
      max_q: an int ``>=`` the longest query sequence (static).
      max_k: an int ``>=`` the longest key sequence (static).
      scale: default ``head_dim ** -0.5`` (static).
      window_size: ``(left, right)``, ``-1`` unbounded; ``(-1, 0)`` is causal (static).
      enable_gqa: allow fewer key/value heads (a divisor of ``heads``) (static).
      seqused_k: ``(N,)`` ints, the keys in use per sequence (required with pages), or None.
      block_table: ``(N, pages)`` page indices into key and value, or None.
      return_lse: also return the row log-sum-exp (static).
      softcap: ``softcap · tanh(scores / softcap)``, or None (static).
      sinks: ``(heads,)`` sink logits, or None; may be traced; differentiable.

    Returns:
      ``(total_q, heads, v_dim)`` in the input dtype; with ``return_lse`` also the lse
      ``(heads, total_q)`` in the compute dtype (``-inf`` for a row without a key nor a sink).
    """
    fn = "varlen_attention"
    args = _arguments(fn, query, key, value, None, cu_seq_q, cu_seq_k, max_q, max_k, scale,
                      window_size, enable_gqa, seqused_k, block_table, return_lse, softcap,
                      sinks)
    host = [_host(x) for x in (cu_seq_q, cu_seq_k, seqused_k, block_table)]
    query, key, value, sinks = _array(query), _array(key), _array(value), _array(sinks)
    if any(x is _TRACED for x in host):
        return _masked(args, query, key, value, *map(_array, (cu_seq_q, cu_seq_k, seqused_k,
                                                               block_table)), sinks)
    cu_q, cu_k, used, table = (None if x is None else x.tolist() for x in host)
    seqs = varlen_rules.sequences(fn, args, cu_q, cu_k, used, table)
    index = None if table is None else jnp.asarray(
        varlen_rules.paged_key_index(table, used, args.page_size), jnp.int32)
    return _grouped(query, key, value, sinks, index, plan=tuple(varlen_rules.groups(seqs)),
                    args=args)


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
) -> tuple[jax.Array, ...]:
    """Gradients of ``varlen_attention``: ``jax.vjp`` of it (numpy_attn derives them by hand).

    Args:
      query, key, value, cu_seq_q, cu_seq_k, max_q, max_k: as in ``varlen_attention``.
      grad_output: ``(total_q, heads, v_dim)``.
      scale, window_size, enable_gqa, seqused_k, block_table, softcap, sinks: as in
        ``varlen_attention``.

    Returns:
      ``(grad_query, grad_key, grad_value)`` shaped and typed like query, key and value (keys
      outside ``seqused_k`` get 0; with pages, the pool's gradients), and with ``sinks``
      ``grad_sinks (heads,)`` fourth.
    """
    fn = "varlen_attention_vjp"
    args = _arguments(fn, query, key, value, grad_output, cu_seq_q, cu_seq_k, max_q, max_k,
                      scale, window_size, enable_gqa, seqused_k, block_table, False, softcap,
                      sinks)
    host = [_host(x) for x in (cu_seq_q, cu_seq_k, seqused_k, block_table)]
    if not any(x is _TRACED for x in host):  # the values' rules, under this function's name
        varlen_rules.sequences(fn, args, *(None if x is None else x.tolist() for x in host))
    primals = [_array(x) for x in (query, key, value, sinks) if x is not None]

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, *extra: jax.Array) -> jax.Array:
        return varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                window_size=window_size, enable_gqa=enable_gqa,
                                seqused_k=seqused_k, block_table=block_table, softcap=softcap,
                                sinks=extra[0] if extra else None)

    _, pullback = jax.vjp(attend, *primals)
    return pullback(_array(grad_output))


def pack_sequences(padded: Any, lengths: Any) -> tuple[jax.Array, jax.Array]:
    """A padded batch to the packed layout; the padding is never read.

    Args:
      padded: ``(batch, heads, max_len, dim)`` or ``(batch, heads, max_len)``.
      lengths: ``(batch,)`` ints in ``[0, max_len]``, known on the host (the packed length
        ``sum(lengths)`` is a shape): under ``jit`` a NumPy array or a static argument.

    Returns:
      ``(packed, cu_seq)``: ``(sum(lengths), heads[, dim])`` in padded's dtype and the
      ``(batch + 1,)`` int32 offsets. Differentiable with respect to padded.
    """
    fn = "pack_sequences"
    shape, _ = varlen_rules.check_pack(fn, _describe(fn, "padded", padded),
                                       _describe(fn, "lengths", lengths))
    host = _host(lengths)
    if host is _TRACED:
        raise ValueError(
            f"{fn}: lengths must be known on the host (the packed length sum(lengths) is a "
            f"shape); under jax.jit pass a NumPy array or a static argument; got a tracer"
        )
    varlen_rules.check_lengths_values(fn, host.tolist(), shape[2])
    rows = np.nonzero(np.arange(shape[2]) < host[:, None])  # (batch, position) of each token
    packed = jnp.moveaxis(_array(padded), 2, 1)[rows]  # (total, heads[, dim])
    offsets = np.zeros(shape[0] + 1, np.int64)
    np.cumsum(host, out=offsets[1:])
    return packed, jnp.asarray(offsets, jnp.int32)


def unpack_sequences(packed: Any, cu_seq: Any, max_len: int) -> jax.Array:
    """The packed layout back to a padded batch, zeros after each sequence's end.

    Args:
      packed: ``(total, heads, dim)`` or ``(total, heads)``.
      cu_seq: ``(batch + 1,)`` int offsets; may be traced (then unchecked).
      max_len: an int ``>=`` the longest sequence (static).

    Returns:
      ``(batch, heads, max_len, dim)`` (or ``(batch, heads, max_len)``) in packed's dtype.
      Differentiable with respect to packed.
    """
    fn = "unpack_sequences"
    max_len = varlen_rules.check_unpack(fn, _describe(fn, "packed", packed),
                                        _describe(fn, "cu_seq", cu_seq), max_len)
    packed, host = _array(packed), _host(cu_seq)
    if host is not _TRACED:
        varlen_rules.check_offsets(fn, "cu_seq", host.tolist(), packed.shape[0], "packed")
        varlen_rules.check_max_len(fn, "max_len", max_len, np.diff(host).tolist(), "packed")
    offsets = _array(cu_seq)
    batch = offsets.shape[0] - 1
    if packed.shape[0] == 0:
        return jnp.zeros((batch, *packed.shape[1:2], max_len, *packed.shape[2:]), packed.dtype)
    position = jnp.arange(max_len)
    index = offsets[:-1, None] + position  # (batch, max_len): the packed row of each slot
    keep = position < (offsets[1:] - offsets[:-1])[:, None]
    rows = packed[jnp.clip(index, 0, packed.shape[0] - 1)]  # (batch, max_len, heads[, dim])
    keep = keep.reshape(keep.shape + (1,) * (packed.ndim - 1))
    return jnp.moveaxis(jnp.where(keep, rows, jnp.zeros((), packed.dtype)), 1, 2)


# ------------------------------------------------------------------------------------------
# Checks, groups and the masked path for traced offsets
# ------------------------------------------------------------------------------------------


def _arguments(
    fn: str, query: Any, key: Any, value: Any, grad_output: Any, cu_seq_q: Any, cu_seq_k: Any,
    max_q: Any, max_k: Any, scale: Any, window_size: Any, enable_gqa: Any, seqused_k: Any,
    block_table: Any, return_lse: Any, softcap: Any, sinks: Any,
) -> varlen_rules.VarlenArguments:
    """Every rule on shapes, dtypes and options (``attention_rules.varlen``)."""
    return varlen_rules.varlen_arguments(
        fn, _describe(fn, "query", query), _describe(fn, "key", key),
        _describe(fn, "value", value), _describe(fn, "cu_seq_q", cu_seq_q),
        _describe(fn, "cu_seq_k", cu_seq_k), max_q, max_k,
        grad_output=_describe(fn, "grad_output", grad_output), scale=scale,
        window_size=window_size, enable_gqa=enable_gqa,
        seqused_k=_describe(fn, "seqused_k", seqused_k),
        block_table=_describe(fn, "block_table", block_table), return_lse=return_lse,
        softcap=softcap, sinks=_describe(fn, "sinks", sinks),
    )


def _host(x: Any) -> Any:
    """``x`` as a NumPy array, ``_TRACED`` when its values are unknown (a tracer), or None."""
    if x is None:
        return None
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return _TRACED


def _rows(starts: tuple[int, ...], length: int) -> np.ndarray:
    """``(n, length)`` token indices: row ``s`` is ``starts[s] + arange(length)``."""
    return np.asarray(starts, np.int64)[:, None] + np.arange(length)


def _take(x: jax.Array, starts: tuple[int, ...], length: int) -> jax.Array:
    """``(n, length, ...)``: the tokens ``starts[s] + arange(length)`` of ``x (tokens, ...)``
    (one sequence: a static slice)."""
    if len(starts) == 1:
        return x[starts[0]:starts[0] + length][None]
    return x[_rows(starts, length)]


@functools.partial(jax.jit, static_argnames=("plan", "args"))
def _grouped(
    query: jax.Array, key: jax.Array, value: jax.Array, sinks: jax.Array | None,
    index: jax.Array | None, *, plan: tuple[varlen_rules.Group, ...],
    args: varlen_rules.VarlenArguments,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The host-offsets path, one compiled program per plan: each group ``(n, heads, len,
    dim)`` through ``pipeline``, the rows put back in token order by one gather; ``index``:
    the pool's flat token of each key in use (pages), or None."""
    if index is not None:
        key = key.reshape((-1,) + key.shape[2:])[index]  # (keys, kv_heads, head_dim)
        value = value.reshape((-1,) + value.shape[2:])[index]
    outputs, lses, order = [], [], []
    for group in plan:
        q_rows = _rows(group.q_starts, group.q_len)
        batch = [_take(x, starts, length).transpose(0, 2, 1, 3) for x, starts, length in
                 ((query, group.q_starts, group.q_len), (key, group.k_starts, group.k_len),
                  (value, group.k_starts, group.k_len))]  # (n, heads, len, dim)
        result = pipeline(*batch, None, None, None, None,
                          varlen_rules.group_arguments("varlen_attention", args, group), sinks)
        out, lse = result if args.return_lse else (result, None)
        outputs.append(out.transpose(0, 2, 1, 3).reshape(-1, args.heads, args.v_dim))
        if lse is not None:  # (n, heads, q_len) -> (heads, n · q_len)
            lses.append(lse.transpose(1, 0, 2).reshape(args.heads, -1))
        order.append(q_rows.reshape(-1))
    back = np.argsort(np.concatenate(order)) if order else np.zeros(0, np.int64)
    output = jnp.concatenate(outputs)[back] if outputs else \
        jnp.zeros((0, args.heads, args.v_dim), query.dtype)
    if not args.return_lse:
        return output
    compute = rules.compute_dtype(args.dtype)
    return output, (jnp.concatenate(lses, axis=1)[:, back] if lses else
                    jnp.zeros((args.heads, 0), compute))


def _masked(
    args: varlen_rules.VarlenArguments, query: jax.Array, key: jax.Array, value: jax.Array,
    cu_seq_q: jax.Array, cu_seq_k: jax.Array | None, seqused_k: jax.Array | None,
    block_table: jax.Array | None, sinks: jax.Array | None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The traced-offsets path: one ``pipeline`` call over ``(heads, total_q, head_dim)``
    against every packed key, with the ``(total_q, total_k)`` mask of segment ids, windows and
    keys in use (pages gathered to ``(N · pages · page_size, kv_heads, dim)`` first)."""
    pool = key.shape[0]  # packed keys, or pages with block_table
    if block_table is not None:  # sequence i's keys: the slots [i · room, (i + 1) · room)
        room = block_table.shape[1] * args.page_size
        key = key[block_table].reshape((-1,) + key.shape[2:])
        value = value[block_table].reshape((-1,) + value.shape[2:])
        k_starts = jnp.arange(args.count) * room
        k_lens = jnp.full((args.count,), room) if cu_seq_k is None else \
            jnp.minimum(cu_seq_k[1:] - cu_seq_k[:-1], room)
    else:
        k_starts, k_lens = cu_seq_k[:-1], cu_seq_k[1:] - cu_seq_k[:-1]
    used = k_lens if seqused_k is None else seqused_k
    total_k = key.shape[0]
    if args.count == 0 or args.total_q == 0:  # no query row
        mask = jnp.zeros((args.total_q, total_k), bool)
    else:
        seq_q = jnp.clip(jnp.searchsorted(cu_seq_q, jnp.arange(args.total_q), side="right") - 1,
                         0, args.count - 1)  # (total_q,): the sequence of each query
        k_ends = jnp.concatenate([k_starts[1:], jnp.full((1,), total_k)])
        seq_k = jnp.clip(jnp.searchsorted(k_ends, jnp.arange(total_k), side="right"), 0,
                         args.count - 1)  # (total_k,): the sequence of each key slot
        pos_q = jnp.arange(args.total_q) - cu_seq_q[seq_q]
        pos_k = jnp.arange(total_k) - k_starts[seq_k]
        offset = (used - (cu_seq_q[1:] - cu_seq_q[:-1]))[seq_q]  # bottom-right, per sequence
        distance = pos_k[None, :] - pos_q[:, None] - offset[:, None]  # j - i - offset
        mask = (seq_q[:, None] == seq_k[None, :]) & (pos_k < used[seq_k])[None, :]
        left, right = args.window if args.window is not None else (None, None)
        if left is not None:
            mask &= distance >= -left
        if right is not None:
            mask &= distance <= right
    attention = rules.attention_arguments(
        "varlen_attention", ((args.heads, args.total_q, args.head_dim), args.dtype),
        ((args.kv_heads, total_k, args.head_dim), args.dtype),
        ((args.kv_heads, total_k, args.v_dim), args.dtype), mask=(mask.shape, "bool"),
        scale=args.scale, softcap=args.softcap, return_lse=args.return_lse,
        sinks=((args.heads,), args.dtype) if sinks is not None else None,
    )
    result = pipeline(*(x.transpose(1, 0, 2) for x in (query, key, value)), mask, None, None,
                      None, attention, sinks)
    out, lse = result if args.return_lse else (result, None)
    output = out.transpose(1, 0, 2)  # (total_q, heads, v_dim)
    if args.count and args.total_q:  # jax: traced indices cannot raise; bad ones give NaN
        poison = _poisoned_rows(args, cu_seq_q, cu_seq_k, seqused_k, block_table, total_k,
                                pool, seq_q)
        output = jnp.where(poison[:, None, None], jnp.nan, output)
        lse = None if lse is None else jnp.where(poison[None, :], jnp.nan, lse)
    return output if lse is None else (output, lse)


def _poisoned_rows(
    args: varlen_rules.VarlenArguments, cu_seq_q: jax.Array, cu_seq_k: jax.Array | None,
    seqused_k: jax.Array | None, block_table: jax.Array | None, total_k: int, pool: int,
    seq_q: jax.Array,
) -> jax.Array:
    """``(total_q,)``: the query rows the masked path makes NaN (``spec.PAGED_CACHE``), where
    eager raises ValueError: every row when an offsets array does not start at 0, goes down,
    or ends before or after its tokens (``pool``: the packed keys, or the pages), or a
    sequence is longer than ``max_q`` / ``max_k``; a sequence's rows when its ``seqused_k`` is
    negative or more than its keys, or a page it uses is outside the pool."""
    q_lens = cu_seq_q[1:] - cu_seq_q[:-1]
    bad_all = (cu_seq_q[0] != 0) | (cu_seq_q[-1] != args.total_q) | (q_lens < 0).any()
    bad_all |= (q_lens > args.max_q).any()
    if cu_seq_k is not None:
        k_lens = cu_seq_k[1:] - cu_seq_k[:-1]
        bad_all |= (cu_seq_k[0] != 0) | (k_lens < 0).any()
        if block_table is None:
            bad_all |= cu_seq_k[-1] != pool
    room = total_k if block_table is None else block_table.shape[1] * args.page_size
    own = jnp.full((args.count,), room) if cu_seq_k is None else jnp.minimum(k_lens, room)
    used = own if seqused_k is None else seqused_k
    bad_all |= (used > args.max_k).any()
    bad_seq = (used < 0) | (used > own)
    if block_table is not None:
        first = jnp.arange(block_table.shape[1]) * args.page_size  # each page's first slot
        read = first[None, :] < used[:, None]  # (count, pages): the pages the sequence uses
        outside = (block_table < 0) | (block_table >= pool)
        bad_seq |= (read & outside).any(axis=1)
    return bad_all | bad_seq[seq_q]
