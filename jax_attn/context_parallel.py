"""Context-parallel attention in JAX: the sequence split across the devices of a mesh axis.

A sequence too long for one device is split along its sequence axis: device ``r`` of the mesh
axis ``axis_name`` holds a shard of the queries, keys and values (``attention_rules.
context_parallel`` says which positions), and the devices exchange keys and values so that
every query meets every key it may attend to. The per-block math is ``blockwise.py``'s online
softmax: each (query chunk, key chunk) pair gives a partial output and its log-sum-exp ``lse``,
and partial results over different keys merge exactly::

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b

The function body runs on every device under ``jax.shard_map`` (numpy_attn's file is the same
algorithm with the ranks simulated in a loop):

* ``"ring"`` (Liu et al. 2023): at step ``s`` device ``r`` holds the key/value block of device
  ``r - s`` and passes it to ``r + 1`` (``lax.ppermute``). A ``jax.custom_vjp`` gives it the
  paper's backward pass: the ring again, the key and value gradients travelling with their
  blocks and arriving home at the end (autodiff through the forward ring would keep every
  step's block).
* ``"all_gather"``: ``lax.all_gather`` of every key/value block; the backward pass gathers
  again and sums each block's gradients back to its owner (``lax.psum_scatter``).
* ``"ulysses"`` (DeepSpeed-Ulysses): ``lax.all_to_all`` turns "all heads, 1/N of the sequence"
  into "1/N of the heads, the whole sequence"; a second one turns the output back.

JAX: the device index ``lax.axis_index`` is traced, so a chunk's global position is looked up
in a static table and a pair of chunks that the causal rule or the window masks entirely is
skipped by ``lax.cond`` (every device runs one program). Any mesh works: CPU devices
(``jax_num_cpu_devices``), GPUs or TPUs. The steps are made of ``context_blocks.py``'s pairs
and messages; memory per device: ``docs/context_parallel.md``, "Memory per device".
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

import attention_rules as rules
from attention_rules import context_parallel as cp

from . import context_blocks as blocks
from ._arrays import _array, _describe, _describe_lengths, _to_compute

# ------------------------------------------------------------------------------------------
# Public functions
# ------------------------------------------------------------------------------------------


def context_parallel_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    mesh: Any,
    axis_name: str = "seq",
    strategy: str = "ring",
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    kv_lengths: Any = None,
    load_balance: bool = False,
) -> jax.Array:
    """Attention over a sequence sharded along the mesh axis ``axis_name``.

    Equal to ``blockwise_attention(query, key, value, kv_lengths=kv_lengths, ...)`` on the
    whole sequence, computed with device ``r`` holding the ``r``-th shard of the sequence axis
    (``jax.shard_map``, ``PartitionSpec(None, None, axis_name, None)``). jit-able and
    differentiable (``jax.custom_vjp``); all arguments but the arrays are static.

    Args:
      query: ``(batch, heads, q_len, head_dim)``, the sequence in layout order (natural order
        unless ``load_balance``; then ``x[..., cp.positions(q_len, N, True), :]``).
      key: ``(batch, kv_heads, kv_len, head_dim)``, in layout order.
      value: ``(batch, kv_heads, kv_len, v_dim)``, in layout order.
      mesh: a ``jax.sharding.Mesh`` with the axis ``axis_name`` of ``N`` devices (other axes
        replicate the computation).
      axis_name: the mesh axis the sequence is split along.
      strategy: ``"ring"``, ``"all_gather"`` or ``"ulysses"`` (heads and kv_heads multiples of
        ``N``).
      is_causal, causal_alignment, window, scale, softcap: as in
        ``scaled_dot_product_attention``; positions are global (natural order).
      kv_lengths: ``(batch,)`` ints in ``[0, kv_len]`` (may be traced): key ``j`` of sequence
        ``b`` is attended only if ``j < kv_lengths[b]`` (global positions).
      load_balance: zig-zag layout, device ``r`` holding chunks ``r`` and ``2N - 1 - r`` of
        ``2N``.

    Returns:
      ``(batch, heads, q_len, v_dim)`` in the input dtype and layout order, sharded like
      ``query``; fully masked rows give 0.
    """
    fn = "context_parallel_attention"
    args, sched = _arguments(fn, query, key, value, None, kv_lengths, mesh, axis_name, strategy,
                             is_causal, causal_alignment, window, scale, softcap, load_balance)
    query, key, value = _array(query), _array(key), _array(value)
    lengths = None if kv_lengths is None else jnp.asarray(kv_lengths)
    return _sharded(sched, args, mesh, axis_name, lengths is not None)(query, key, value, lengths)


def context_parallel_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    *,
    mesh: Any,
    axis_name: str = "seq",
    strategy: str = "ring",
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    kv_lengths: Any = None,
    load_balance: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of ``context_parallel_attention``, through ``jax.vjp`` and its custom VJP.

    Args:
      query: ``(batch, heads, q_len, head_dim)``.
      key: ``(batch, kv_heads, kv_len, head_dim)``.
      value: ``(batch, kv_heads, kv_len, v_dim)``.
      grad_output: ``(batch, heads, q_len, v_dim)``, all in layout order.
      mesh, axis_name, strategy, is_causal, causal_alignment, window, scale, softcap,
        kv_lengths, load_balance: as in ``context_parallel_attention``.

    Returns:
      ``(grad_query, grad_key, grad_value)`` shaped like query, key and value, in their dtype.
    """
    fn = "context_parallel_attention_vjp"
    args, sched = _arguments(fn, query, key, value, grad_output, kv_lengths, mesh, axis_name,
                             strategy, is_causal, causal_alignment, window, scale, softcap,
                             load_balance)
    query, key, value, grad_output = _array(query), _array(key), _array(value), _array(grad_output)
    lengths = None if kv_lengths is None else jnp.asarray(kv_lengths)
    attend = _sharded(sched, args, mesh, axis_name, lengths is not None)
    _, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, lengths), query, key, value)
    return pullback(grad_output)


# ------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------


def _arguments(
    fn: str, query: Any, key: Any, value: Any, grad_output: Any, kv_lengths: Any, mesh: Any,
    axis_name: Any, strategy: Any, is_causal: Any, causal_alignment: Any, window: Any,
    scale: Any, softcap: Any, load_balance: Any,
) -> tuple[rules.Arguments, cp.Schedule]:
    """Every rule, once (global shapes), and the static schedule."""
    cp.check_axis(fn, axis_name, tuple(getattr(mesh, "axis_names", ())))  # jax: the mesh
    described = [_describe(fn, name, x) for name, x in
                 (("query", query), ("key", key), ("value", value))]
    args = rules.attention_arguments(
        fn, *described,
        grad_output=None if grad_output is None else _describe(fn, "grad_output", grad_output),
        is_causal=is_causal, causal_alignment=causal_alignment, window=window, scale=scale,
        softcap=softcap, kv_lengths=_describe_lengths(kv_lengths),
    )
    strategy, world_size, load_balance = cp.check_context_parallel(
        fn, strategy, mesh.shape[axis_name], described[0][0], described[1][0], load_balance)
    kv_len = described[1][0][-2]
    if kv_lengths is not None and not isinstance(kv_lengths, jax.core.Tracer):
        rules.check_lengths(fn, "kv_lengths", np.asarray(kv_lengths).tolist(), kv_len)
    sched = cp.schedule(strategy, world_size, described[0][0][-2], kv_len, args.is_causal,
                        args.causal_alignment, args.window, load_balance)
    return args, sched


# ------------------------------------------------------------------------------------------
# jax only: the device's chunks (traced), the natural order, an order XLA keeps
# ------------------------------------------------------------------------------------------


def _chunks(sched: cp.Schedule, rank: Any, step: Any) -> tuple:
    """jax only: ``(q_starts, kv_starts, needed)`` of device ``rank`` (traced) at ring ``step``
    (an int, or traced inside the scan over the steps), holding the block of device
    ``rank - step``: global starts looked up in static tables; each ``needed[i][j]`` a Python
    bool when every device (and step) agrees, else traced."""
    n = sched.world_size
    q_table = jnp.asarray([[s for s, _ in segs] for segs in sched.q_segments])  # (N, chunks)
    q_starts = [q_table[rank, i] for i in range(len(sched.q_segments[0]))]
    kv_table = jnp.asarray([[s for s, _ in segs] for segs in sched.kv_segments])
    origin = (rank - step) % n
    kv_starts = [kv_table[origin, j] for j in range(len(sched.kv_segments[0]))]
    steps = [step] if isinstance(step, int) else range(sched.steps)
    table = np.array([[cp.block_needed(sched, r, cp.ring_origin(n, r, s)) for r in range(n)]
                      for s in range(sched.steps)])  # (steps, N, q chunks, kv chunks)
    needed = []
    for i in range(table.shape[2]):
        row = []
        for j in range(table.shape[3]):
            values = table[list(steps), :, i, j]
            row.append(bool(values.flat[0]) if (values == values.flat[0]).all()
                       else jnp.asarray(table[:, :, i, j])[step, rank])
        needed.append(row)
    return q_starts, kv_starts, needed


def _natural(x: jax.Array, seq_len: int, sched: cp.Schedule, to_layout: bool = False
             ) -> jax.Array:
    """jax only: a whole sequence from layout order to natural order (or back): one chunk
    pair instead of ``(2N)²``, so one block of the program to compile."""
    order = np.asarray(cp.positions(seq_len, sched.world_size, sched.load_balance))
    index = order if to_layout else np.argsort(order)
    return jnp.take(x, jnp.asarray(index), axis=x.ndim - 2)


def _after(value: jax.Array, make: Any) -> Any:
    """jax only: ``make()``, computed once ``value`` exists. XLA:CPU's scheduler may build a
    buffer that depends on nothing (zeroed gradients, copies of the inputs) long before it is
    needed, and keep it alive meanwhile; it drops ``optimization_barrier`` before scheduling,
    but keeps the order of a ``lax.cond`` on a predicate read from ``value`` (both branches
    ``make``)."""
    if not value.size:
        return make()
    return jax.lax.cond(jnp.isnan(value.ravel()[0]), make, make)


# ------------------------------------------------------------------------------------------
# Strategies: the code every device runs (under shard_map)
# ------------------------------------------------------------------------------------------


def _strategy_forward(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None,
                      sched: cp.Schedule, args: rules.Arguments, axis_name: str) -> tuple:
    """``(output shard, saved for the backward pass)``."""
    forward = {"ring": _ring_forward, "all_gather": _all_gather_forward,
               "ulysses": _ulysses_forward}[sched.strategy]
    return forward(q, k, v, kv_lengths, sched, args, axis_name)


def _strategy_backward(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None,
                       saved: Any, grad_output: jax.Array, sched: cp.Schedule,
                       args: rules.Arguments, axis_name: str) -> tuple:
    """``(grad_q, grad_k, grad_v)`` shards."""
    backward = {"ring": _ring_backward, "all_gather": _all_gather_backward,
                "ulysses": _ulysses_backward}[sched.strategy]
    return backward(q, k, v, kv_lengths, saved, grad_output, sched, args, axis_name)


def _ring_forward(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None,
                  sched: cp.Schedule, args: rules.Arguments, axis_name: str) -> tuple:
    """Step ``s``: this device attends to the block of device ``r - s``, then passes it on."""
    rank = jax.lax.axis_index(axis_name)

    def attend(result: tuple, k: jax.Array, v: jax.Array, step: Any) -> tuple:
        q_starts, kv_starts, needed = _chunks(sched, rank, step)
        return blocks.attend(q, k, v, kv_lengths, q_starts, kv_starts, needed, sched, args,
                             result)

    def step_and_pass(carry: tuple, step: jax.Array) -> tuple:
        k, v, result = carry
        result = attend(result, k, v, step)
        k = blocks.ring_shift(k, 1, sched, axis_name)
        v = blocks.ring_shift(v, 1, sched, axis_name)
        return (k, v, result), None

    dtype = _to_compute(q).dtype
    result = (jnp.zeros(q.shape[:-1] + v.shape[-1:], dtype),  # no key yet
              jnp.full(q.shape[:-1] + (1,), -jnp.inf, dtype))
    if sched.steps > 1:  # jax: one scan over the steps that pass their block on
        (k, v, result), _ = jax.lax.scan(step_and_pass, (k, v, result),
                                         jnp.arange(sched.steps - 1))
    output, lse = attend(result, k, v, sched.steps - 1)  # nobody needs the blocks after it
    return output, (output, blocks.finish(lse))


def _ring_backward(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None,
                   saved: Any, grad_output: jax.Array, sched: cp.Schedule,
                   args: rules.Arguments, axis_name: str) -> tuple:
    """The ring again; the key/value gradients travel with their blocks, then go home."""
    output, lse = saved
    rank = jax.lax.axis_index(axis_name)
    d_out = _to_compute(grad_output)

    def attend(grads: tuple, k: jax.Array, v: jax.Array, step: Any) -> tuple:
        q_starts, kv_starts, needed = _chunks(sched, rank, step)
        # the gradient of the block held travels with it
        return blocks.attend_backward(q, k, v, kv_lengths, output, lse, d_out, q_starts,
                                      kv_starts, needed, sched, args, grads)

    def step_and_pass(carry: tuple, step: jax.Array) -> tuple:
        k, v, grads = carry
        grad_q, grad_k, grad_v = attend(grads, k, v, step)
        k, v, grad_k, grad_v = (blocks.ring_shift(x, 1, sched, axis_name)
                                for x in (k, v, grad_k, grad_v))
        return (k, v, (grad_q, grad_k, grad_v)), None

    # jax: made once the forward pass is done (it made lse), not kept alive across it
    k, v, grads = _after(lse, lambda: (k, v, tuple(jnp.zeros(x.shape, output.dtype)
                                                     for x in (q, k, v))))
    if sched.steps > 1:  # jax: one scan over the steps that pass their block on
        (k, v, grads), _ = jax.lax.scan(step_and_pass, (k, v, grads),
                                        jnp.arange(sched.steps - 1))
    grad_q, grad_k, grad_v = attend(grads, k, v, sched.steps - 1)
    home = -(sched.steps - 1) % sched.world_size  # this device holds r - (steps - 1)'s
    if home:
        grad_k = blocks.ring_shift(grad_k, home, sched, axis_name)
        grad_v = blocks.ring_shift(grad_v, home, sched, axis_name)
    return grad_q, grad_k, grad_v


def _all_gather_forward(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None,
                        sched: cp.Schedule, args: rules.Arguments, axis_name: str) -> tuple:
    """Gather every key/value block (layout order), then attend to all of them."""
    k_all = _natural(blocks.all_gather(k, axis_name), sched.kv_len, sched)  # jax: natural order
    v_all = _natural(blocks.all_gather(v, axis_name), sched.kv_len, sched)
    q_starts, needed = _own_chunks(sched, jax.lax.axis_index(axis_name))
    output, lse = blocks.attend(q, k_all, v_all, kv_lengths, q_starts, [0], needed, sched, args)
    return output, (output, blocks.finish(lse))


def _all_gather_backward(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None,
                         saved: Any, grad_output: jax.Array, sched: cp.Schedule,
                         args: rules.Arguments, axis_name: str) -> tuple:
    """Gather again (nothing of the whole sequence was kept), then sum each block's
    gradients back to its owner (reduce-scatter)."""
    output, lse = saved
    k_all = _natural(blocks.all_gather(k, axis_name), sched.kv_len, sched)
    v_all = _natural(blocks.all_gather(v, axis_name), sched.kv_len, sched)
    q_starts, needed = _own_chunks(sched, jax.lax.axis_index(axis_name))
    grad_q, grad_k_all, grad_v_all = blocks.attend_backward(
        q, k_all, v_all, kv_lengths, output, lse, _to_compute(grad_output), q_starts, [0],
        needed, sched, args)
    grad_k_all = _natural(grad_k_all, sched.kv_len, sched, to_layout=True)
    grad_v_all = _natural(grad_v_all, sched.kv_len, sched, to_layout=True)
    return (grad_q, blocks.reduce_scatter(grad_k_all, axis_name),
            blocks.reduce_scatter(grad_v_all, axis_name))


def _ulysses_forward(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None,
                     sched: cp.Schedule, args: rules.Arguments, axis_name: str) -> tuple:
    """All-to-all: 1/N of the heads, the whole sequence (layout order); attend; all-to-all back."""
    q_h = blocks.all_to_all(q, "heads_to_sequence", axis_name)  # (batch, heads / N, q_len, d)
    k_h = blocks.all_to_all(k, "heads_to_sequence", axis_name)
    v_h = blocks.all_to_all(v, "heads_to_sequence", axis_name)
    q_h, k_h, v_h = (_natural(x, n, sched) for x, n in
                     ((q_h, sched.q_len), (k_h, sched.kv_len), (v_h, sched.kv_len)))
    out_h, lse_h = blocks.attend(q_h, k_h, v_h, kv_lengths, [0], [0], [[True]], sched, args,
                                 per_head=False)  # jax: 1/N of the heads already
    output = blocks.all_to_all(_natural(out_h, sched.q_len, sched, to_layout=True),
                               "sequence_to_heads", axis_name)
    return output, (q_h, k_h, v_h, out_h, blocks.finish(lse_h))


def _ulysses_backward(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None,
                      saved: Any, grad_output: jax.Array, sched: cp.Schedule,
                      args: rules.Arguments, axis_name: str) -> tuple:
    """dO to the head split, the whole-sequence backward, gradients back."""
    q_h, k_h, v_h, out_h, lse_h = saved
    d_out_h = blocks.all_to_all(_to_compute(grad_output), "heads_to_sequence", axis_name)
    d_out_h = _natural(d_out_h, sched.q_len, sched)
    grads = blocks.attend_backward(q_h, k_h, v_h, kv_lengths, out_h, lse_h, d_out_h, [0], [0],
                                   [[True]], sched, args, per_head=False)
    lengths = (sched.q_len, sched.kv_len, sched.kv_len)
    return tuple(blocks.all_to_all(_natural(g, n, sched, to_layout=True), "sequence_to_heads",
                                   axis_name) for g, n in zip(grads, lengths, strict=True))


def _own_chunks(sched: cp.Schedule, rank: Any) -> tuple:
    """jax only: ``(q_starts, needed)`` of this device's query chunks against the whole key
    sequence (natural order, one chunk starting at 0)."""
    q_table = jnp.asarray([[s for s, _ in segs] for segs in sched.q_segments])
    whole = (0, sched.kv_len)
    table = np.array([[[cp.pair_needed(qs, whole, sched.lo, sched.hi)] for qs in segs]
                      for segs in sched.q_segments])  # (N, q chunks, 1)
    needed = [[bool(table[0, i, 0]) if (table[:, i, 0] == table[0, i, 0]).all()
               else jnp.asarray(table[:, i, 0])[rank]] for i in range(table.shape[1])]
    return [q_table[rank, i] for i in range(table.shape[1])], needed


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _context_parallel(static: tuple, query: jax.Array, key: jax.Array, value: jax.Array,
                      kv_lengths: jax.Array | None) -> jax.Array:
    """jax only: one device's forward pass, with ``_context_parallel_bwd`` as its VJP."""
    return _strategy_forward(query, key, value, kv_lengths, *static)[0].astype(query.dtype)


def _context_parallel_fwd(static: tuple, query: jax.Array, key: jax.Array, value: jax.Array,
                          kv_lengths: jax.Array | None) -> tuple:
    output, saved = _strategy_forward(query, key, value, kv_lengths, *static)
    return output.astype(query.dtype), (query, key, value, kv_lengths, saved)


def _context_parallel_bwd(static: tuple, residuals: tuple, grad_output: jax.Array) -> tuple:
    query, key, value, kv_lengths, saved = residuals
    grad_q, grad_k, grad_v = _strategy_backward(query, key, value, kv_lengths, saved,
                                                grad_output, *static)
    # kv_lengths holds ints: no cotangent (None)
    return grad_q.astype(query.dtype), grad_k.astype(key.dtype), grad_v.astype(value.dtype), None


_context_parallel.defvjp(_context_parallel_fwd, _context_parallel_bwd)


@lru_cache(maxsize=64)
def _sharded(sched: cp.Schedule, args: rules.Arguments, mesh: Any, axis_name: str,
             has_lengths: bool) -> Any:
    """jax only: the jitted ``shard_map`` of ``_context_parallel`` for one static call."""
    shard = PartitionSpec(None, None, axis_name, None)  # (batch, heads, seq, dim): seq split
    static = (sched, args, axis_name)
    if has_lengths:
        body = partial(_context_parallel, static)
        in_specs = (shard, shard, shard, PartitionSpec())  # kv_lengths: on every device
    else:
        def body(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return _context_parallel(static, q, k, v, None)
        in_specs = (shard, shard, shard)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=shard,
                           check_vma=False)
    if has_lengths:
        return jax.jit(mapped)
    return jax.jit(lambda q, k, v, lengths: mapped(q, k, v))
