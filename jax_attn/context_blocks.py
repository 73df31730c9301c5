"""The blocks of context parallelism in JAX: one pair of chunks, and the messages.

``context_parallel.py`` runs the strategies' schedules; this file holds what every step of
them is made of (numpy_attn's and torch_attn's ``context_blocks.py`` are the same functions):

* ``attend_pair``: one query chunk against one key chunk, ``blockwise.py``'s tiles, giving the
  partial output and its log-sum-exp ``lse``; ``attend`` merges the pairs of a step into the
  partial result (``_steps._merge_partials``) and ``attend_backward`` adds their gradients;
* the messages, ``lax`` collectives over the mesh axis: ``ring_shift`` (``ppermute``),
  ``all_gather``, ``reduce_scatter`` (``psum_scatter``), ``all_to_all``.

JAX: the device's chunks are traced, so a pair that the causal rule or the window masks on some
devices only is skipped by ``lax.cond``. Memory: each pair runs one key/value head at a time
(a ``fori_loop``) and writes into its block of the carried result in place
(``dynamic_update_slice``), so a pair's slices, tiles and partial results never exist for all
heads at once, nor for several pairs, nor outside the ring's loop (``docs/context_parallel.md``,
"Memory per device").
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules
from attention_rules import context_parallel as cp

from ._arrays import _to_compute
from ._steps import _merge_partials
from .blockwise import (
    DEFAULT_BLOCK_KV,
    DEFAULT_BLOCK_Q,
    TileConfig,
    backward_tiles,
    forward_tiles,
)

# ------------------------------------------------------------------------------------------
# The per-block math: blockwise.py's tiles on a pair of chunks (merged by _merge_partials)
# ------------------------------------------------------------------------------------------


def pair_band(q_start: Any, kv_start: Any, sched: cp.Schedule) -> tuple[Any, Any]:
    """The band ``lo <= j - i <= hi`` in the chunks' own indices (``i``, ``j`` from 0); jax:
    traced when the starts are."""
    shift = kv_start - q_start
    return sched.lo - shift, sched.hi - shift


def _pair_config(q_len: int, kv_len: int, lo: Any, hi: Any, args: rules.Arguments) -> TileConfig:
    """jax only: ``blockwise.py``'s static configuration for one pair; with a traced band every
    tile is visited (the band masks them), with a static one only the tiles it keeps."""
    block_q, block_kv = min(DEFAULT_BLOCK_Q, q_len), min(DEFAULT_BLOCK_KV, kv_len)
    if isinstance(lo, jax.core.Tracer) or isinstance(hi, jax.core.Tracer):
        lo_plan, hi_plan = -np.inf, np.inf
    else:
        lo_plan, hi_plan = lo, hi
    tiles = rules.plan(q_len, kv_len, block_q, block_kv, lo_plan, hi_plan)
    starts = tuple((q_start, kv_start) for q_start, _, blocks in tiles
                   for kv_start, _, _ in blocks)
    return TileConfig(q_len, kv_len, block_q, block_kv, starts, lo, hi, args.scale, args.softcap)


def attend_pair(
    q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None, q_start: Any,
    kv_start: Any, sched: cp.Schedule, args: rules.Arguments,
) -> tuple[jax.Array, jax.Array]:
    """``(output (..., heads, q_chunk, v_dim), lse (..., heads, q_chunk, 1))`` of one query
    chunk ``q (..., heads, q_chunk, head_dim)`` against one key chunk ``k``, ``v (...,
    kv_heads, kv_chunk, dim)`` (global starts given), lse ``-inf`` on rows with no allowed key."""
    lo, hi = pair_band(q_start, kv_start, sched)
    cfg = _pair_config(q.shape[-2], k.shape[-2], lo, hi, args)
    lengths = None if kv_lengths is None else kv_lengths - kv_start  # in the chunk's indices
    output, lse = forward_tiles(q, k, v, None, lengths, cfg)
    return output, jnp.where(lse == jnp.inf, -jnp.inf, lse)  # blockwise: +inf on empty


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None, q_starts: list,
    kv_starts: list, needed: list, sched: cp.Schedule, args: rules.Arguments,
    into: tuple | None = None, per_head: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """``(output (..., heads, q_len, v_dim), lse (..., heads, q_len, 1))`` of the query chunks
    starting at ``q_starts`` (concatenated in ``q (..., heads, q_len, head_dim)``) against the
    key chunks at ``kv_starts`` (in ``k``, ``v (..., kv_heads, kv_len, dim)``), merged into
    ``into`` (the partial ``(output, lse)`` of earlier keys; None: no key yet); lse ``-inf`` on
    rows with no key. jax: starts and ``needed[i][j]`` may be traced (the device's own
    chunks): then ``lax.cond`` skips the pair on the devices that need none. With
    ``per_head`` each pair runs one key/value head at a time (``_in_place``; Ulysses, whose
    devices hold 1/N of the heads already, runs them all at once) and is merged into its block
    of ``into`` in place."""
    q_size, kv_size = q.shape[-2] // len(q_starts), k.shape[-2] // len(kv_starts)
    q_c, heads = _to_compute(q), k.shape[-3] if per_head else 1
    if into is None:  # no key yet
        into = (jnp.zeros(q.shape[:-1] + v.shape[-1:], q_c.dtype),
                jnp.full(q.shape[:-1] + (1,), -jnp.inf, q_c.dtype))
    for i, q_start in enumerate(q_starts):
        for j, kv_start in enumerate(kv_starts):
            rows, cols = (i * q_size, q_size), (j * kv_size, kv_size)

            def merge(h: Any, result: tuple, rows: tuple = rows, cols: tuple = cols,
                      q_start: Any = q_start, kv_start: Any = kv_start) -> tuple:
                part = attend_pair(_block(q_c, h, heads, rows), _block(k, h, heads, cols),
                                   _block(v, h, heads, cols), kv_lengths, q_start, kv_start,
                                   sched, args)
                merged = _merge_partials(*(_block(x, h, heads, rows) for x in result), *part)
                return tuple(_set_block(x, m, h, heads, rows)
                             for x, m in zip(result, merged, strict=True))

            into = _in_place(needed[i][j], merge, heads, into)
    return into


def attend_backward(
    q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None, output: jax.Array,
    lse: jax.Array, grad_output: jax.Array, q_starts: list, kv_starts: list, needed: list,
    sched: cp.Schedule, args: rules.Arguments, into: tuple | None = None,
    per_head: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Contributions of the key chunks at ``kv_starts`` to ``(grad_q, grad_k, grad_v)``
    (shaped like ``q``, ``k``, ``v``), from the final ``output`` and ``lse`` (``+inf`` on fully
    masked rows) of the query chunks and ``grad_output`` (shaped like ``output``), added to
    ``into`` (the gradients so far; None: zeros). jax: as in ``attend``."""
    q_size, kv_size = q.shape[-2] // len(q_starts), k.shape[-2] // len(kv_starts)
    dtype, heads = output.dtype, k.shape[-3] if per_head else 1  # the compute dtype
    if into is None:
        into = (jnp.zeros(q.shape, dtype), jnp.zeros(k.shape, dtype), jnp.zeros(v.shape, dtype))
    for i, q_start in enumerate(q_starts):
        for j, kv_start in enumerate(kv_starts):
            rows, cols = (i * q_size, q_size), (j * kv_size, kv_size)
            lo, hi = pair_band(q_start, kv_start, sched)
            cfg = _pair_config(q_size, kv_size, lo, hi, args)
            lengths = None if kv_lengths is None else kv_lengths - kv_start

            def add(h: Any, grads: tuple, rows: tuple = rows, cols: tuple = cols,
                    cfg: TileConfig = cfg, lengths: Any = lengths) -> tuple:
                at = (rows, cols, cols)
                parts = backward_tiles(
                    *(_block(x, h, heads, a) for x, a in zip((q, k, v), at, strict=True)), None,
                    lengths, cfg, *(_block(x, h, heads, rows) for x in (output, lse, grad_output)))
                return tuple(_set_block(g, _block(g, h, heads, a) + d, h, heads, a)
                             for g, d, a in zip(grads, parts[:3], at, strict=True))

            into = _in_place(needed[i][j], add, heads, into)
    return into


def _in_place(needed: Any, update: Any, heads: int, state: tuple) -> tuple:
    """``update(h, state)`` for every key/value head ``h`` where ``needed`` (a bool, or traced:
    ``lax.cond``, the state passing through unchanged on the devices that need nothing).
    jax: the heads in a ``fori_loop``, so a pair's slices, tiles and partial results exist for
    one key/value head (and its query heads) at a time; the loop index also keeps XLA from
    hoisting those slices out of the ring's loop, where all of them would stay alive."""
    if needed is False:
        return state  # never computed, on any device

    def every_head(state: tuple) -> tuple:
        return jax.lax.fori_loop(0, heads, update, state)

    if needed is True:
        return every_head(state)
    return jax.lax.cond(needed, every_head, lambda state: state, state)


def _block(x: jax.Array, h: Any, heads: int, at: tuple[int, int]) -> jax.Array:
    """jax only: the block of ``x (batch, x_heads, seq, dim)`` of key/value head ``h`` of
    ``heads`` (its ``x_heads / heads`` heads: the query heads that share it, or itself) and
    of the positions ``at = (start, size)``."""
    per = x.shape[-3] // heads
    starts = (0,) * (x.ndim - 3) + (h * per, at[0], 0)
    return jax.lax.dynamic_slice(x, starts, x.shape[:-3] + (per, at[1], x.shape[-1]))


def _set_block(x: jax.Array, block: jax.Array, h: Any, heads: int, at: tuple[int, int]
               ) -> jax.Array:
    """jax only: ``x`` with ``_block(x, h, heads, at)`` replaced by ``block`` (in place)."""
    starts = (0,) * (x.ndim - 3) + (h * (x.shape[-3] // heads), at[0], 0)
    return jax.lax.dynamic_update_slice(x, block.astype(x.dtype), starts)


def finish(lse: jax.Array) -> jax.Array:
    """The saved log-sum-exp ``(..., heads, q_len, 1)`` as ``blockwise.py``'s backward wants it:
    ``+inf`` on empty rows."""
    return jnp.where(lse == -jnp.inf, jnp.inf, lse)


# ------------------------------------------------------------------------------------------
# The messages (numpy: lists over ranks; jax: lax collectives; torch: torch.distributed)
# ------------------------------------------------------------------------------------------


def ring_shift(x: jax.Array, shift: int, sched: cp.Schedule, axis_name: str) -> jax.Array:
    """Device ``r`` sends ``x`` (any shape) to ``r + shift`` and receives ``r - shift``'s."""
    n = sched.world_size
    return jax.lax.ppermute(x, axis_name, [(r, (r + shift) % n) for r in range(n)])


def all_gather(x: jax.Array, axis_name: str) -> jax.Array:
    """Every device's shard ``x (..., seq / N, dim)``, concatenated along the sequence axis in
    device order: ``(..., seq, dim)``."""
    return jax.lax.all_gather(x, axis_name, axis=x.ndim - 2, tiled=True)


def reduce_scatter(x: jax.Array, axis_name: str) -> jax.Array:
    """Sum the devices' whole-sequence arrays ``x (..., seq, dim)``; this device keeps its shard
    of the sum, ``(..., seq / N, dim)``."""
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=x.ndim - 2, tiled=True)


def all_to_all(x: jax.Array, direction: str, axis_name: str) -> jax.Array:
    """``"heads_to_sequence"``: ``x (batch, heads, seq / N, dim)`` → ``(batch, heads / N, seq,
    dim)``, sending head group ``j`` to device ``j`` and receiving this device's head group of
    every device's sequence shard, concatenated in device order; ``"sequence_to_heads"`` undoes
    it."""
    heads, seq = x.ndim - 3, x.ndim - 2
    if direction == "heads_to_sequence":
        return jax.lax.all_to_all(x, axis_name, split_axis=heads, concat_axis=seq, tiled=True)
    return jax.lax.all_to_all(x, axis_name, split_axis=seq, concat_axis=heads, tiled=True)
