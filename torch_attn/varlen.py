"""Packed variable-length batches in PyTorch: ``varlen_attention``, its VJP by autograd, and the
converters between a padded batch and the packed layout (``conformance/spec/varlen.py``).

``torch.nn.attention.varlen.varlen_attn``'s names and meaning, on any device (torch's own is
CUDA-only): query ``(total_q, heads, head_dim)``, key ``(total_k, kv_heads, head_dim)``, value
``(total_k, kv_heads, v_dim)``, cumulative offsets ``cu_seq_q`` and ``cu_seq_k`` (``(N + 1,)``
ints); each sequence attends to its own keys only, its window aligned bottom-right
(``window_size=(-1, 0)`` is causal). Differences from torch's: ``return_lse=True`` instead of
``return_aux=AuxRequest(lse=True)``, no ``num_splits``; soft-cap and sinks as in the spec.

Only the work inside the sequences is done: the offsets are read to the host (one
synchronisation), ``attention_rules.varlen`` checks them and gathers the sequences of one shape
``(q_len, k_len)`` into a group; each group is one batch ``(n, heads, q_len, dim)`` for
``functional.pipeline`` (with its fast path, torch's fused SDPA). The sequences are cut from the
packed tensors by one ``split`` each (whose backward is one concatenation: a slice per sequence
would give each slice a full-size zero gradient to add, ``O(N · total)``) and the outputs put
back in token order by one concatenation. Every step is differentiable, so
``varlen_attention_vjp`` is ``torch.autograd`` through it (numpy_attn derives it by hand).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import attention_rules as rules
from attention_rules import varlen as varlen_rules

from ._arrays import _array, _describe
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
      ``(total_q, heads, v_dim)`` in the input dtype, on query's device; with ``return_lse``
      also the lse ``(heads, total_q)`` in the compute dtype (``-inf`` for a row without a key
      nor a sink). Differentiable with respect to query, key, value and sinks.
    """
    fn = "varlen_attention"
    args, plan, query, key, value = _prepare(
        fn, query, key, value, None, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size,
        enable_gqa, seqused_k, block_table, return_lse, softcap, sinks)
    sinks = _array(sinks)
    q_pieces = _pieces(query, [(s, g.q_len) for g in plan for s in g.q_starts])
    k_ranges = [(s, g.k_len) for g in plan for s in g.k_starts]
    k_pieces, v_pieces = _pieces(key, k_ranges), _pieces(value, k_ranges)
    outputs, lses = [], []  # (first token, one sequence's rows)
    for group in plan:
        batch = [_stack([pieces[s, length] for s in starts]).transpose(1, 2)
                 for pieces, starts, length in ((q_pieces, group.q_starts, group.q_len),
                                                (k_pieces, group.k_starts, group.k_len),
                                                (v_pieces, group.k_starts, group.k_len))]
        result = pipeline(*batch, None, None, None, None,
                          varlen_rules.group_arguments(fn, args, group), sinks)
        out, lse = result if args.return_lse else (result, None)
        # one sequence's output (q_len, heads, v_dim) and lse (heads, q_len) each
        outputs += zip(group.q_starts, _unstack(out.transpose(1, 2)), strict=True)
        if lse is not None:
            lses += zip(group.q_starts, _unstack(lse), strict=True)
    output = _in_token_order(outputs, (0, args.heads, args.v_dim), query.dtype, query, 0)
    if not args.return_lse:
        return output
    compute = getattr(torch, rules.compute_dtype(args.dtype))
    return output, _in_token_order(lses, (args.heads, 0), compute, query, 1)


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
) -> tuple[torch.Tensor, ...]:
    """Gradients of ``varlen_attention``: ``torch.autograd`` through it (numpy_attn derives
    them by hand).

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
    _prepare(fn, query, key, value, grad_output, cu_seq_q, cu_seq_k, max_q, max_k, scale,
             window_size, enable_gqa, seqused_k, block_table, False, softcap, sinks)
    inputs = [_array(x).detach().requires_grad_(True) for x in (query, key, value, sinks)
              if x is not None]
    with torch.enable_grad():
        output = varlen_attention(
            *inputs[:3], cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
            enable_gqa=enable_gqa, seqused_k=seqused_k, block_table=block_table,
            softcap=softcap, sinks=inputs[3] if sinks is not None else None)
        grads = torch.autograd.grad(output, inputs, grad_outputs=_array(grad_output),
                                    allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in
                 zip(grads, inputs, strict=True))


def pack_sequences(padded: Any, lengths: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded batch to the packed layout; the padding is never read.

    Args:
      padded: ``(batch, heads, max_len, dim)`` or ``(batch, heads, max_len)``.
      lengths: ``(batch,)`` ints in ``[0, max_len]`` (read to the host).

    Returns:
      ``(packed, cu_seq)``: ``(sum(lengths), heads[, dim])`` in padded's dtype and the
      ``(batch + 1,)`` int32 offsets, on padded's device. Differentiable.
    """
    fn = "pack_sequences"
    shape, _ = varlen_rules.check_pack(fn, _describe(fn, "padded", padded),
                                       _describe(fn, "lengths", lengths))
    padded, lengths = _array(padded), _array(lengths)
    host = lengths.tolist()
    varlen_rules.check_lengths_values(fn, host, shape[2])
    keep = torch.arange(shape[2], device=padded.device) < lengths.to(padded.device)[:, None]
    packed = padded.movedim(2, 1)[keep]  # (total, heads[, dim]), sequence after sequence
    offsets = np.zeros(shape[0] + 1, np.int64)
    np.cumsum(host, out=offsets[1:])
    return packed, torch.as_tensor(offsets, dtype=torch.int32, device=padded.device)


def unpack_sequences(packed: Any, cu_seq: Any, max_len: int) -> torch.Tensor:
    """The packed layout back to a padded batch, zeros after each sequence's end.

    Args:
      packed: ``(total, heads, dim)`` or ``(total, heads)``.
      cu_seq: ``(batch + 1,)`` int offsets.
      max_len: an int ``>=`` the longest sequence.

    Returns:
      ``(batch, heads, max_len, dim)`` (or ``(batch, heads, max_len)``) in packed's dtype,
      on its device. Differentiable.
    """
    fn = "unpack_sequences"
    max_len = varlen_rules.check_unpack(fn, _describe(fn, "packed", packed),
                                        _describe(fn, "cu_seq", cu_seq), max_len)
    packed, offsets = _array(packed), _array(cu_seq).tolist()
    varlen_rules.check_offsets(fn, "cu_seq", offsets, packed.shape[0], "packed")
    lengths = np.diff(np.asarray(offsets, np.int64))
    varlen_rules.check_max_len(fn, "max_len", max_len, lengths.tolist(), "packed")
    keep = torch.as_tensor(np.arange(max_len) < lengths[:, None], device=packed.device)
    padded = packed.new_zeros((len(lengths), max_len) + tuple(packed.shape[1:]))
    padded = padded.index_put((keep,), packed)  # out of place: autograd reaches packed
    return padded.movedim(1, 2)  # (batch, heads, max_len[, dim])


# ------------------------------------------------------------------------------------------
# The plan: checks, pages, groups
# ------------------------------------------------------------------------------------------


def _prepare(
    fn: str, query: Any, key: Any, value: Any, grad_output: Any, cu_seq_q: Any, cu_seq_k: Any,
    max_q: Any, max_k: Any, scale: Any, window_size: Any, enable_gqa: Any, seqused_k: Any,
    block_table: Any, return_lse: Any, softcap: Any, sinks: Any,
) -> tuple[varlen_rules.VarlenArguments, list, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rule (``attention_rules.varlen``), then the groups, query ``(total_q, heads,
    head_dim)`` and the packed key and value ``(keys, kv_heads, dim)`` (gathered from the
    pages with pages: autograd adds their gradients back into the pool)."""
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
    if table is not None:
        index = np.asarray(varlen_rules.paged_key_index(table, used, args.page_size), np.int64)
        key = key.flatten(0, 1)[_index(index, key)]  # (keys, kv_heads, head_dim)
        value = value.flatten(0, 1)[_index(index, value)]
    return args, varlen_rules.groups(seqs), query, key, value


def _pieces(x: torch.Tensor, ranges: list[tuple[int, int]]) -> dict:
    """``{(start, length): x[start:start + length]}`` for token ranges that do not overlap,
    cut by one ``split`` (its backward is one concatenation, where a slice per sequence would
    give each its own full-size zero gradient to add)."""
    sizes, wanted, position = [], [], 0
    for start, length in sorted(set(ranges)):
        if start > position:
            sizes.append(start - position)  # unused tokens (past seqused_k)
            wanted.append(None)
        sizes.append(length)
        wanted.append((start, length))
        position = start + length
    sizes.append(x.shape[0] - position)
    wanted.append(None)
    return {key: part for key, part in zip(wanted, x.split(sizes), strict=True) if key}


def _stack(parts: list[torch.Tensor]) -> torch.Tensor:
    """``(n, length, ...)`` from ``n`` pieces ``(length, ...)`` (one: a view)."""
    return parts[0].unsqueeze(0) if len(parts) == 1 else torch.stack(parts)


def _index(rows: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """Host indices as an int64 tensor on ``like``'s device."""
    return torch.as_tensor(rows, dtype=torch.int64, device=like.device)


def _unstack(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(n, ...)`` to ``n`` tensors ``(...)``; one: a view (``unbind``'s backward would stack
    a copy)."""
    return (x.squeeze(0),) if x.shape[0] == 1 else x.unbind(0)


def _in_token_order(parts: list, empty: tuple[int, ...], dtype: torch.dtype,
                    like: torch.Tensor, axis: int) -> torch.Tensor:
    """``(first token, rows)`` of every sequence with queries, concatenated along ``axis`` in
    token order (one copy); ``empty`` shaped when there is none."""
    if not parts:
        return torch.zeros(empty, dtype=dtype, device=like.device)
    return torch.cat([rows for _, rows in sorted(parts, key=lambda part: part[0])], dim=axis)
