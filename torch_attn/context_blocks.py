"""The blocks of context parallelism in PyTorch: one pair of chunks, and the messages.

``context_parallel.py`` runs the strategies' schedules on every rank; this file holds what
every step of them is made of (numpy_attn's and jax_attn's ``context_blocks.py`` are the same
functions with their arrays and collectives):

* ``attend_pair``: one query chunk against one key chunk, ``blockwise.py``'s tiles, giving the
  partial output and its log-sum-exp ``lse``; ``attend`` merges the pairs of a step into the
  partial result (``_steps._merge_partials``) and ``attend_backward`` adds their gradients;
* the messages, ``torch.distributed`` on the ranks of a group (``Communicator``):
  ``ring_shift_start`` / ``ring_shift_finish`` (``batch_isend_irecv``), ``all_gather``,
  ``reduce_scatter``, ``all_to_all``.

torch: memory. Each pair runs one key/value head at a time and writes into its block of the
carried result in place, so a pair's tiles and partial results never exist for all heads at
once, and the blocks a rank has sent are let go as soon as the send is done
(``docs/context_parallel.md``, "Memory per device").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import attention_rules as rules
from attention_rules import context_parallel as cp

from ._arrays import _to_compute
from ._steps import _merge_partials
from ._tiles import backward_tiles, forward_tiles
from .blockwise import DEFAULT_BLOCK_KV, DEFAULT_BLOCK_Q

# ------------------------------------------------------------------------------------------
# The per-block math: blockwise.py's tiles on a pair of chunks (merged by _merge_partials)
# ------------------------------------------------------------------------------------------


def pair_band(q_start: int, kv_start: int, sched: cp.Schedule) -> tuple[float, float]:
    """The band ``lo <= j - i <= hi`` in the chunks' own indices (``i``, ``j`` from 0)."""
    shift = kv_start - q_start
    return sched.lo - shift, sched.hi - shift


def attend_pair(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lengths: torch.Tensor | None,
    q_start: int, kv_start: int, sched: cp.Schedule, args: rules.Arguments,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(output (..., heads, q_chunk, v_dim), lse (..., heads, q_chunk, 1))`` of one query
    chunk ``q (..., heads, q_chunk, head_dim)`` against one key chunk ``k``, ``v (...,
    kv_heads, kv_chunk, dim)`` (global starts given), lse ``-inf`` on rows with no allowed key;
    None when the band leaves the pair nothing."""
    lo, hi = pair_band(q_start, kv_start, sched)
    tiles = rules.plan(q.shape[-2], k.shape[-2], DEFAULT_BLOCK_Q, DEFAULT_BLOCK_KV, lo, hi)
    if not any(blocks for _, _, blocks in tiles):
        return None  # never computed
    lengths = None if kv_lengths is None else kv_lengths - kv_start  # in the chunk's indices
    output, lse = forward_tiles(q, k, v, None, None, lengths, tiles, lo, hi, args.scale,
                                args.softcap)  # no bias, no mask
    return output, torch.where(lse == torch.inf, -torch.inf, lse)  # blockwise: +inf on empty


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lengths: torch.Tensor | None,
    q_segments: tuple, kv_segments: tuple, sched: cp.Schedule, args: rules.Arguments,
    into: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output (..., heads, q_len, v_dim), lse (..., heads, q_len, 1))`` of the query chunks
    ``q_segments`` (concatenated in ``q (..., heads, q_len, head_dim)``) against the key chunks
    ``kv_segments`` (in ``k``, ``v (..., kv_heads, kv_len, dim)``), merged into ``into`` (the
    partial ``(output, lse)`` of earlier keys; None: no key yet); lse ``-inf`` on rows with no
    key.
    torch: each pair runs one key/value head at a time and is merged into its block of
    ``into`` in place, so a pair's tiles and partial result exist for one head at a time."""
    q_size, kv_size = q.shape[-2] // len(q_segments), k.shape[-2] // len(kv_segments)
    q_c = _to_compute(q)
    like = {"dtype": q_c.dtype, "device": q_c.device}  # torch: dtype and device of new tensors
    if into is None:  # no key yet
        into = (torch.zeros(q.shape[:-1] + v.shape[-1:], **like),
                torch.full(q.shape[:-1] + (1,), -torch.inf, **like))
    out, lse = into
    for i, (q_start, _) in enumerate(q_segments):
        rows = slice(i * q_size, (i + 1) * q_size)
        for j, (kv_start, _) in enumerate(kv_segments):
            cols = slice(j * kv_size, (j + 1) * kv_size)
            for qh, kh in _heads(q, k):
                part = attend_pair(q_c[..., qh, rows, :], k[..., kh, cols, :],
                                   v[..., kh, cols, :], kv_lengths, q_start, kv_start, sched,
                                   args)
                if part is None:
                    break  # never computed (for no head)
                merged = _merge_partials(out[..., qh, rows, :], lse[..., qh, rows, :], *part)
                out[..., qh, rows, :], lse[..., qh, rows, :] = merged
    return out, lse


def attend_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lengths: torch.Tensor | None,
    output: torch.Tensor, lse: torch.Tensor, grad_output: torch.Tensor, q_segments: tuple,
    kv_segments: tuple, sched: cp.Schedule, args: rules.Arguments, into: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contributions of the key chunks ``kv_segments`` to ``(grad_q, grad_k, grad_v)`` (shaped
    like ``q``, ``k``, ``v``), from the final ``output`` and ``lse`` (``+inf`` on fully masked
    rows) of the query chunks and ``grad_output`` (shaped like ``output``), added to ``into``
    (the gradients so far; None: zeros). torch: as in ``attend``, one key/value
    head at a time, added in place."""
    q_size, kv_size = q.shape[-2] // len(q_segments), k.shape[-2] // len(kv_segments)
    like = {"dtype": output.dtype, "device": output.device}  # the compute dtype
    if into is None:
        into = tuple(torch.zeros(x.shape, **like) for x in (q, k, v))
    grad_q, grad_k, grad_v = into
    for i, (q_start, _) in enumerate(q_segments):
        rows = slice(i * q_size, (i + 1) * q_size)
        for j, (kv_start, _) in enumerate(kv_segments):
            cols = slice(j * kv_size, (j + 1) * kv_size)
            lo, hi = pair_band(q_start, kv_start, sched)
            tiles = rules.plan(q_size, kv_size, DEFAULT_BLOCK_Q, DEFAULT_BLOCK_KV, lo, hi)
            if not any(blocks for _, _, blocks in tiles):
                continue  # never computed
            lengths = None if kv_lengths is None else kv_lengths - kv_start
            for qh, kh in _heads(q, k):
                dq, dk, dv, _ = backward_tiles(
                    q[..., qh, rows, :], k[..., kh, cols, :], v[..., kh, cols, :], None, None,
                    lengths, tiles, lo, hi, args.scale, args.softcap, output[..., qh, rows, :],
                    lse[..., qh, rows, :], grad_output[..., qh, rows, :])
                grad_q[..., qh, rows, :] += dq
                grad_k[..., kh, cols, :] += dk
                grad_v[..., kh, cols, :] += dv
    return grad_q, grad_k, grad_v


def _heads(q: torch.Tensor, k: torch.Tensor) -> list[tuple[slice, slice]]:
    """torch only: per key/value head, the slices of its query heads and of itself."""
    per = q.shape[-3] // k.shape[-3]
    return [(slice(h * per, (h + 1) * per), slice(h, h + 1)) for h in range(k.shape[-3])]


def finish(lse: torch.Tensor) -> torch.Tensor:
    """The saved log-sum-exp ``(..., heads, q_len, 1)`` as ``blockwise.py``'s backward wants it:
    ``+inf`` on empty rows."""
    return torch.where(lse == -torch.inf, torch.inf, lse)


# ------------------------------------------------------------------------------------------
# The messages (numpy: lists over ranks; jax: lax collectives; torch: torch.distributed)
# ------------------------------------------------------------------------------------------


class Communicator(NamedTuple):
    """torch only: the process group, this rank's index in it and its size."""

    group: Any
    rank: int
    world_size: int


def communicator(group: Any) -> Communicator:
    """torch only: the group (None: the default one), this rank and the size."""
    return Communicator(group, dist.get_rank(group), dist.get_world_size(group))


def _peer(comm: Communicator, rank: int) -> int:
    """torch only: the global rank of ``rank`` of the group (point-to-point ops want it)."""
    return rank if comm.group is None else dist.get_global_rank(comm.group, rank)


def ring_shift_start(tensors: list, shift: int, comm: Communicator) -> tuple:
    """Send each tensor to rank ``r + shift`` and receive rank ``r - shift``'s (started)."""
    n = comm.world_size
    to, source = _peer(comm, (comm.rank + shift) % n), _peer(comm, (comm.rank - shift) % n)
    received, ops = [], []
    for tensor in tensors:
        tensor = tensor.contiguous()
        buffer = torch.empty_like(tensor)
        ops.append(dist.P2POp(dist.isend, tensor, to, comm.group))
        ops.append(dist.P2POp(dist.irecv, buffer, source, comm.group))
        received.append(buffer)
    return dist.batch_isend_irecv(ops), received


def ring_shift_finish(pending: tuple) -> list:
    """Wait for a started shift; the received tensors."""
    requests, received = pending
    for request in requests:
        request.wait()
    return received


def ring_shift(tensors: list, shift: int, comm: Communicator) -> list:
    """Send each tensor to rank ``r + shift`` and receive rank ``r - shift``'s (waits)."""
    return ring_shift_finish(ring_shift_start(tensors, shift, comm))


def all_gather_flat(output: torch.Tensor, tensor: torch.Tensor, comm: Communicator) -> None:
    """``all_gather_single`` (``all_gather_into_tensor`` before torch 2.10) along dim 0."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=comm.group)


def all_gather(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Every rank's shard ``x (..., seq / N, dim)``, concatenated along the sequence axis in
    rank order: ``(..., seq, dim)``."""
    parts = x.movedim(-2, 0).contiguous()  # (seq / N, batch, heads, dim): gathered along dim 0
    gathered = torch.empty((comm.world_size * parts.shape[0],) + parts.shape[1:],
                           dtype=parts.dtype, device=parts.device)
    all_gather_flat(gathered, parts, comm)
    return gathered.movedim(0, -2)


def reduce_scatter(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Sum the ranks' whole-sequence arrays ``x (..., seq, dim)``; this rank keeps its shard of
    the sum, ``(..., seq / N, dim)``."""
    parts = x.movedim(-2, 0).contiguous()  # (seq, batch, heads, dim)
    shard = torch.empty((parts.shape[0] // comm.world_size,) + parts.shape[1:],
                        dtype=parts.dtype, device=parts.device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(shard, parts, group=comm.group)
    return shard.movedim(0, -2)


def all_to_all(x: torch.Tensor, direction: str, comm: Communicator) -> torch.Tensor:
    """``"heads_to_sequence"``: send head group ``j`` to rank ``j`` and receive this rank's head
    group of every rank's sequence shard, concatenated in rank order;
    ``"sequence_to_heads"`` undoes it."""
    n = comm.world_size
    batch, heads, seq, dim = x.shape
    if direction == "heads_to_sequence":  # (batch, n, heads / n, seq, dim): piece j to rank j
        pieces = x.reshape(batch, n, heads // n, seq, dim).movedim(1, 0)
    else:  # (batch, heads, n, seq / n, dim): sequence piece j goes back to rank j
        pieces = x.reshape(batch, heads, n, seq // n, dim).movedim(2, 0)
    pieces = pieces.contiguous()
    received = torch.empty_like(pieces)  # received[i]: the piece rank i sent
    dist.all_to_all_single(received, pieces, group=comm.group)
    if direction == "heads_to_sequence":  # (n, batch, heads / n, seq, dim) → sequence axis
        return received.movedim(0, 2).reshape(batch, heads // n, n * seq, dim)
    return received.movedim(0, 1).reshape(batch, n * heads, seq // n, dim)
