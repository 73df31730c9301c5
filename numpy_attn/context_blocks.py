"""The blocks of context parallelism in NumPy: one pair of chunks, and the messages.

``context_parallel.py`` runs the strategies' schedules over the simulated ranks; this file holds
what every step of them is made of (jax_attn's and torch_attn's ``context_blocks.py`` are the
same functions with their frameworks' arrays and collectives):

* ``attend_pair``: one query chunk against one key chunk, ``blockwise.py``'s tiles, giving the
  partial output and its log-sum-exp ``lse``; ``attend`` merges the pairs of a step
  (``_steps._merge_partials``) and ``attend_backward`` sums their gradients;
* the messages, explicit: ``ring_shift``, ``all_gather``, ``reduce_scatter``, ``all_to_all``
  move blocks between the ranks' lists and record every send in ``trace`` (``note``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import attention_rules as rules
from attention_rules import context_parallel as cp

from ._arrays import _to_compute
from ._steps import _merge_partials
from .blockwise import DEFAULT_BLOCK_KV, DEFAULT_BLOCK_Q, backward_tiles, forward_tiles

# ------------------------------------------------------------------------------------------
# The per-block math: blockwise.py's tiles on a pair of chunks (merged by _merge_partials)
# ------------------------------------------------------------------------------------------


def pair_band(q_start: int, kv_start: int, sched: cp.Schedule) -> tuple[float, float]:
    """The band ``lo <= j - i <= hi`` in the chunks' own indices (``i``, ``j`` from 0)."""
    shift = kv_start - q_start
    return sched.lo - shift, sched.hi - shift


def attend_pair(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_lengths: np.ndarray | None, q_start: int,
    kv_start: int, sched: cp.Schedule, args: rules.Arguments,
) -> tuple[np.ndarray, np.ndarray] | None:
    """``(output (..., heads, q_chunk, v_dim), lse (..., heads, q_chunk, 1))`` of one query
    chunk ``q (..., heads, q_chunk, head_dim)`` against one key chunk ``k``, ``v (...,
    kv_heads, kv_chunk, dim)`` (global starts given), lse ``-inf`` on rows with no allowed key;
    None when the band leaves the pair nothing."""
    lo, hi = pair_band(q_start, kv_start, sched)
    tiles = rules.plan(q.shape[-2], k.shape[-2], DEFAULT_BLOCK_Q, DEFAULT_BLOCK_KV, lo, hi)
    if not any(blocks for _, _, blocks in tiles):
        return None  # never computed
    lengths = None if kv_lengths is None else kv_lengths - kv_start  # in the chunk's indices
    output, lse = forward_tiles(q, k, v, None, lengths, tiles, lo, hi, args.scale, args.softcap)
    return output, np.where(lse == np.inf, -np.inf, lse)  # blockwise: +inf on empty rows


def attend(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_lengths: np.ndarray | None,
    q_segments: tuple, kv_segments: tuple, sched: cp.Schedule, args: rules.Arguments,
) -> tuple[np.ndarray, np.ndarray]:
    """``(output (..., heads, q_len, v_dim), lse (..., heads, q_len, 1))`` of the query chunks
    ``q_segments`` (concatenated in ``q (..., heads, q_len, head_dim)``) against the key chunks
    ``kv_segments`` (in ``k``, ``v (..., kv_heads, kv_len, dim)``); lse ``-inf`` on rows with no
    key."""
    q_size, kv_size = q.shape[-2] // len(q_segments), k.shape[-2] // len(kv_segments)
    q_c = _to_compute(q)
    outputs, lses = [], []
    for i, (q_start, _) in enumerate(q_segments):
        q_part = q_c[..., i * q_size:(i + 1) * q_size, :]  # (batch, heads, chunk, head_dim)
        out = np.zeros(q_part.shape[:-1] + v.shape[-1:], q_c.dtype)  # no key yet
        lse = np.full(q_part.shape[:-1] + (1,), -np.inf, q_c.dtype)
        for j, (kv_start, _) in enumerate(kv_segments):
            cols = slice(j * kv_size, (j + 1) * kv_size)
            part = attend_pair(q_part, k[..., cols, :], v[..., cols, :], kv_lengths, q_start,
                               kv_start, sched, args)
            if part is not None:
                out, lse = _merge_partials(out, lse, *part)
        outputs.append(out)
        lses.append(lse)
    return np.concatenate(outputs, axis=-2), np.concatenate(lses, axis=-2)


def attend_backward(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_lengths: np.ndarray | None,
    output: np.ndarray, lse: np.ndarray, grad_output: np.ndarray, q_segments: tuple,
    kv_segments: tuple, sched: cp.Schedule, args: rules.Arguments,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Contributions of the key chunks ``kv_segments`` to ``(grad_q, grad_k, grad_v)`` (shaped
    like ``q``, ``k``, ``v``), from the final ``output`` and ``lse`` (``+inf`` on fully masked
    rows) of the query chunks and ``grad_output`` (shaped like ``output``)."""
    q_size, kv_size = q.shape[-2] // len(q_segments), k.shape[-2] // len(kv_segments)
    dtype = output.dtype  # the compute dtype
    grad_q = np.zeros(q.shape, dtype)
    grad_k, grad_v = np.zeros(k.shape, dtype), np.zeros(v.shape, dtype)
    for i, (q_start, _) in enumerate(q_segments):
        rows = slice(i * q_size, (i + 1) * q_size)
        for j, (kv_start, _) in enumerate(kv_segments):
            cols = slice(j * kv_size, (j + 1) * kv_size)
            lo, hi = pair_band(q_start, kv_start, sched)
            tiles = rules.plan(q_size, kv_size, DEFAULT_BLOCK_Q, DEFAULT_BLOCK_KV, lo, hi)
            if not any(blocks for _, _, blocks in tiles):
                continue  # never computed
            lengths = None if kv_lengths is None else kv_lengths - kv_start
            dq, dk, dv, _ = backward_tiles(
                q[..., rows, :], k[..., cols, :], v[..., cols, :], None, lengths, tiles, lo, hi,
                args.scale, args.softcap, output[..., rows, :], lse[..., rows, :],
                grad_output[..., rows, :])
            grad_q[..., rows, :] += dq
            grad_k[..., cols, :] += dk
            grad_v[..., cols, :] += dv
    return grad_q, grad_k, grad_v


def finish(lse: np.ndarray) -> np.ndarray:
    """The saved log-sum-exp ``(..., heads, q_len, 1)`` as ``blockwise.py``'s backward wants it:
    ``+inf`` on empty rows."""
    return np.where(lse == -np.inf, np.inf, lse)


# ------------------------------------------------------------------------------------------
# The messages (numpy: lists over ranks; jax: lax collectives; torch: torch.distributed)
# ------------------------------------------------------------------------------------------


def shards(x: np.ndarray, world_size: int) -> list[np.ndarray]:
    """numpy only: rank ``r``'s shard is the ``r``-th of ``world_size`` equal parts of the
    sequence axis (the layout order already puts its chunks there)."""
    return np.split(x, world_size, axis=-2)


def ring_shift(blocks: list, shift: int, trace: list | None, step: int, what: str) -> list:
    """Rank ``r`` sends its block to rank ``r + shift`` and receives rank ``r - shift``'s."""
    n = len(blocks)
    for rank, block in enumerate(blocks):
        note(trace, step, rank, "send", what=what, to=(rank + shift) % n, bytes=block.nbytes)
    return [blocks[(rank - shift) % n] for rank in range(n)]


def all_gather(blocks: list, trace: list | None, what: str) -> list:
    """Every rank receives every block ``(..., seq / N, dim)``, concatenated along the sequence
    in rank order: ``(..., seq, dim)`` per rank."""
    n = len(blocks)
    for rank, block in enumerate(blocks):
        note(trace, 0, rank, "send", what=what, to="all", bytes=(n - 1) * block.nbytes)
    gathered = np.concatenate(blocks, axis=-2)
    return [gathered] * n


def reduce_scatter(blocks: list, trace: list | None, what: str) -> list:
    """Sum the ranks' whole-sequence arrays ``(..., seq, dim)``; rank ``r`` keeps the ``r``-th
    shard of the sum."""
    n = len(blocks)
    for rank, block in enumerate(blocks):
        note(trace, 0, rank, "send", what=what, to="all", bytes=(n - 1) * block.nbytes // n)
    return np.split(sum(blocks), n, axis=-2)


def all_to_all(blocks: list, direction: str, trace: list | None, what: str) -> list:
    """``"heads_to_sequence"``: rank ``r`` sends its ``j``-th group of heads to rank ``j`` and
    receives group ``r`` of every rank's sequence shard, concatenated in rank order;
    ``"sequence_to_heads"`` undoes it."""
    n = len(blocks)
    split, join = (-3, -2) if direction == "heads_to_sequence" else (-2, -3)
    pieces = [np.split(block, n, axis=split) for block in blocks]  # pieces[i][j]: i sends to j
    for rank, block in enumerate(blocks):
        note(trace, 0, rank, "send", what=what, to="all", bytes=(n - 1) * block.nbytes // n)
    return [np.concatenate([pieces[i][j] for i in range(n)], axis=join) for j in range(n)]


def note(trace: list | None, step: int, rank: int, event: str, **details: Any) -> None:
    """numpy only: record one event of the schedule."""
    if trace is not None:
        trace.append({"step": step, "rank": rank, "event": event, **details})
