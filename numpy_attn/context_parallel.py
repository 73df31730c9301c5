"""Context-parallel attention in NumPy: ``world_size`` ranks simulated in one process.

A sequence too long for one device is split along its sequence axis: rank ``r`` holds a shard of
the queries, keys and values (``attention_rules.context_parallel`` says which positions), and
the ranks exchange keys and values so that every query meets every key it may attend to. The
per-block math is ``blockwise.py``'s online softmax: each (query chunk, key chunk) pair gives a
partial output and its log-sum-exp ``lse``, and partial results over different keys merge
exactly::

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b

Three strategies, each written as the code every rank runs, looped over the ranks here (on real
devices they run at the same time), with the messages explicit (``trace`` records them):

* ``"ring"`` (Liu et al. 2023): at step ``s`` rank ``r`` holds the key/value block of rank
  ``r - s`` and passes it to rank ``r + 1``. The backward pass runs the ring again; the key and
  value gradients travel with their blocks and arrive home at the end.
* ``"all_gather"``: every rank gathers every key/value block, attends, and in the backward pass
  the key/value gradients are summed back to their owners (reduce-scatter).
* ``"ulysses"`` (DeepSpeed-Ulysses): an all-to-all turns "all heads, 1/N of the sequence" into
  "1/N of the heads, the whole sequence"; each rank attends for its heads; a second all-to-all
  turns the output back.

jax_attn and torch_attn run the same schedule with their frameworks' collectives; this file is
their readable reference. ``python -m conformance.context_parallel schedule`` draws it. The
steps are made of ``context_blocks.py``'s pairs and messages.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import attention_rules as rules
from attention_rules import context_parallel as cp

from . import context_blocks as blocks
from ._arrays import _array, _describe, _describe_lengths, _to_compute
from ._steps import _merge_partials

# ------------------------------------------------------------------------------------------
# Public functions
# ------------------------------------------------------------------------------------------


def context_parallel_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    world_size: int,
    strategy: str = "ring",
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    kv_lengths: Any = None,
    load_balance: bool = False,
    trace: list | None = None,
) -> np.ndarray:
    """Attention over a sequence split across ``world_size`` ranks, simulated in one process.

    Equal to ``blockwise_attention(query, key, value, kv_lengths=kv_lengths, ...)`` on the
    whole sequence, computed as ``world_size`` ranks would: rank ``r`` owns the ``r``-th shard of
    the sequence axis and the ranks exchange blocks as ``strategy`` says.

    Args:
      query: ``(batch, heads, q_len, head_dim)``, the sequence in layout order (natural order
        unless ``load_balance``; then ``x[..., cp.positions(q_len, world_size, True), :]``).
      key: ``(batch, kv_heads, kv_len, head_dim)``, in layout order.
      value: ``(batch, kv_heads, kv_len, v_dim)``, in layout order.
      world_size: number of simulated ranks ``N`` (``>= 1``); ``q_len`` and ``kv_len`` must be
        multiples of ``N`` (of ``2N`` with ``load_balance``).
      strategy: ``"ring"``, ``"all_gather"`` or ``"ulysses"`` (heads and kv_heads multiples of
        ``N``).
      is_causal, causal_alignment, window, scale, softcap: as in
        ``scaled_dot_product_attention``; positions are global (natural order).
      kv_lengths: ``(batch,)`` ints in ``[0, kv_len]``: key ``j`` of sequence ``b`` is attended
        only if ``j < kv_lengths[b]`` (global positions).
      load_balance: zig-zag layout, rank ``r`` holding chunks ``r`` and ``2N - 1 - r`` of ``2N``.
      trace: a list that receives one dict per block computed and per message sent (``step``,
        ``rank``, ``event``, ...), or None.

    Returns:
      ``(batch, heads, q_len, v_dim)`` in the input dtype and layout order; fully masked rows
      give 0.
    """
    fn = "context_parallel_attention"
    args, sched = _arguments(fn, query, key, value, None, kv_lengths, world_size, strategy,
                             is_causal, causal_alignment, window, scale, softcap, load_balance)
    query, key, value = _array(query), _array(key), _array(value)
    lengths = None if kv_lengths is None else np.asarray(kv_lengths)
    q, k, v = (blocks.shards(x, sched.world_size) for x in (query, key, value))  # lists over ranks
    output, _ = _strategy_forward(q, k, v, lengths, sched, args, trace)
    return np.concatenate(output, axis=-2).astype(query.dtype, copy=False)


def context_parallel_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    *,
    world_size: int,
    strategy: str = "ring",
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    kv_lengths: Any = None,
    load_balance: bool = False,
    trace: list | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of ``context_parallel_attention``: its forward pass, then the strategy's
    backward pass (ring: the key/value gradients travel with their blocks).

    Args:
      query: ``(batch, heads, q_len, head_dim)``.
      key: ``(batch, kv_heads, kv_len, head_dim)``.
      value: ``(batch, kv_heads, kv_len, v_dim)``.
      grad_output: ``(batch, heads, q_len, v_dim)``, all in layout order.
      world_size, strategy, is_causal, causal_alignment, window, scale, softcap, kv_lengths,
        load_balance, trace: as in ``context_parallel_attention``.

    Returns:
      ``(grad_query, grad_key, grad_value)`` shaped like query, key and value, in their dtype.
    """
    fn = "context_parallel_attention_vjp"
    args, sched = _arguments(fn, query, key, value, grad_output, kv_lengths, world_size,
                             strategy, is_causal, causal_alignment, window, scale, softcap,
                             load_balance)
    query, key, value, grad_output = _array(query), _array(key), _array(value), _array(grad_output)
    lengths = None if kv_lengths is None else np.asarray(kv_lengths)
    q, k, v, d_out = (blocks.shards(x, sched.world_size) for x in (query, key, value, grad_output))
    _, saved = _strategy_forward(q, k, v, lengths, sched, args, trace)
    grads = _strategy_backward(q, k, v, lengths, saved, d_out, sched, args, trace)
    return tuple(np.concatenate(g, axis=-2).astype(query.dtype, copy=False) for g in grads)


# ------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------


def _arguments(
    fn: str, query: Any, key: Any, value: Any, grad_output: Any, kv_lengths: Any,
    world_size: Any, strategy: Any, is_causal: Any, causal_alignment: Any, window: Any,
    scale: Any, softcap: Any, load_balance: Any,
) -> tuple[rules.Arguments, cp.Schedule]:
    """Every rule, once (global shapes), and the static schedule."""
    described = [_describe(fn, name, x) for name, x in
                 (("query", query), ("key", key), ("value", value))]
    args = rules.attention_arguments(
        fn, *described,
        grad_output=None if grad_output is None else _describe(fn, "grad_output", grad_output),
        is_causal=is_causal, causal_alignment=causal_alignment, window=window, scale=scale,
        softcap=softcap, kv_lengths=_describe_lengths(kv_lengths),
    )
    strategy, world_size, load_balance = cp.check_context_parallel(
        fn, strategy, world_size, described[0][0], described[1][0], load_balance)
    kv_len = described[1][0][-2]
    if kv_lengths is not None:  # the range needs the values
        rules.check_lengths(fn, "kv_lengths", np.asarray(kv_lengths).tolist(), kv_len)
    sched = cp.schedule(strategy, world_size, described[0][0][-2], kv_len, args.is_causal,
                        args.causal_alignment, args.window, load_balance)
    return args, sched


# ------------------------------------------------------------------------------------------
# Strategies: the code every rank runs (numpy: a loop over the simulated ranks)
# ------------------------------------------------------------------------------------------


def _strategy_forward(q: list, k: list, v: list, kv_lengths: np.ndarray | None,
                      sched: cp.Schedule, args: rules.Arguments, trace: list | None) -> tuple:
    """``(output shards, saved for the backward pass)``."""
    forward = {"ring": _ring_forward, "all_gather": _all_gather_forward,
               "ulysses": _ulysses_forward}[sched.strategy]
    return forward(q, k, v, kv_lengths, sched, args, trace)


def _strategy_backward(q: list, k: list, v: list, kv_lengths: np.ndarray | None, saved: Any,
                       grad_output: list, sched: cp.Schedule, args: rules.Arguments,
                       trace: list | None) -> tuple:
    """``(grad_q, grad_k, grad_v)`` shards."""
    backward = {"ring": _ring_backward, "all_gather": _all_gather_backward,
                "ulysses": _ulysses_backward}[sched.strategy]
    return backward(q, k, v, kv_lengths, saved, grad_output, sched, args, trace)


def _ring_forward(q: list, k: list, v: list, kv_lengths: np.ndarray | None,
                  sched: cp.Schedule, args: rules.Arguments, trace: list | None) -> tuple:
    """Step ``s``: rank ``r`` attends to the block of rank ``r - s``, then passes it on."""
    n = sched.world_size
    results = [None] * n
    for step in range(sched.steps):
        for rank in range(n):  # on devices: every rank at once
            origin = cp.ring_origin(n, rank, step)
            part = blocks.attend(q[rank], k[rank], v[rank], kv_lengths, sched.q_segments[rank],
                                 sched.kv_segments[origin], sched, args)
            held = results[rank]
            results[rank] = part if held is None else _merge_partials(*held, *part)
            blocks.note(trace, step, rank, "compute", block=origin,
                        pairs=cp.block_needed(sched, rank, origin))
        if step + 1 < sched.steps:  # nobody needs the blocks after the last step
            k = blocks.ring_shift(k, 1, trace, step, "key")
            v = blocks.ring_shift(v, 1, trace, step, "value")
    output = [out for out, _ in results]
    lse = [blocks.finish(lse) for _, lse in results]
    return output, (output, lse)


def _ring_backward(q: list, k: list, v: list, kv_lengths: np.ndarray | None, saved: Any,
                   grad_output: list, sched: cp.Schedule, args: rules.Arguments,
                   trace: list | None) -> tuple:
    """The ring again; the key/value gradients travel with their blocks, then go home."""
    output, lse = saved
    n = sched.world_size
    grad_q = [np.zeros(x.shape, o.dtype) for x, o in zip(q, output, strict=True)]
    grad_k = [np.zeros(x.shape, o.dtype) for x, o in zip(k, output, strict=True)]
    grad_v = [np.zeros(x.shape, o.dtype) for x, o in zip(v, output, strict=True)]
    d_out = [_to_compute(g) for g in grad_output]
    for step in range(sched.steps):
        for rank in range(n):
            origin = cp.ring_origin(n, rank, step)
            dq, dk, dv = blocks.attend_backward(
                q[rank], k[rank], v[rank], kv_lengths, output[rank], lse[rank], d_out[rank],
                sched.q_segments[rank], sched.kv_segments[origin], sched, args)
            grad_q[rank] += dq
            grad_k[rank] += dk  # the gradient of the block held: it travels with it
            grad_v[rank] += dv
            blocks.note(trace, step, rank, "compute", block=origin,
                        pairs=cp.block_needed(sched, rank, origin))
        if step + 1 < sched.steps:
            k = blocks.ring_shift(k, 1, trace, step, "key")
            v = blocks.ring_shift(v, 1, trace, step, "value")
            grad_k = blocks.ring_shift(grad_k, 1, trace, step, "grad_key")
            grad_v = blocks.ring_shift(grad_v, 1, trace, step, "grad_value")
    home = -(sched.steps - 1) % n  # rank r holds the gradients of rank r - (steps - 1)
    if home:
        grad_k = blocks.ring_shift(grad_k, home, trace, sched.steps, "grad_key")
        grad_v = blocks.ring_shift(grad_v, home, trace, sched.steps, "grad_value")
    return grad_q, grad_k, grad_v


def _all_gather_forward(q: list, k: list, v: list, kv_lengths: np.ndarray | None,
                        sched: cp.Schedule, args: rules.Arguments, trace: list | None) -> tuple:
    """Every rank gathers every key/value block (layout order), then attends to all of them."""
    k_all, v_all = blocks.all_gather(k, trace, "key"), blocks.all_gather(v, trace, "value")
    kv_segments = cp.all_segments(sched.kv_segments)
    output, lse = [], []
    for rank in range(sched.world_size):
        out, rank_lse = blocks.attend(q[rank], k_all[rank], v_all[rank], kv_lengths,
                                      sched.q_segments[rank], kv_segments, sched, args)
        output.append(out)
        lse.append(blocks.finish(rank_lse))
    return output, (output, lse)


def _all_gather_backward(q: list, k: list, v: list, kv_lengths: np.ndarray | None, saved: Any,
                         grad_output: list, sched: cp.Schedule, args: rules.Arguments,
                         trace: list | None) -> tuple:
    """Gather again (nothing of the whole sequence was kept), then sum each block's
    gradients back to its owner (reduce-scatter)."""
    output, lse = saved
    k_all, v_all = blocks.all_gather(k, trace, "key"), blocks.all_gather(v, trace, "value")
    kv_segments = cp.all_segments(sched.kv_segments)
    grad_q, grad_k_all, grad_v_all = [], [], []
    for rank in range(sched.world_size):
        dq, dk, dv = blocks.attend_backward(
            q[rank], k_all[rank], v_all[rank], kv_lengths, output[rank], lse[rank],
            _to_compute(grad_output[rank]), sched.q_segments[rank], kv_segments, sched, args)
        grad_q.append(dq)
        grad_k_all.append(dk)
        grad_v_all.append(dv)
    grad_k = blocks.reduce_scatter(grad_k_all, trace, "grad_key")
    grad_v = blocks.reduce_scatter(grad_v_all, trace, "grad_value")
    return grad_q, grad_k, grad_v


def _ulysses_forward(q: list, k: list, v: list, kv_lengths: np.ndarray | None,
                     sched: cp.Schedule, args: rules.Arguments, trace: list | None) -> tuple:
    """All-to-all: 1/N of the heads, the whole sequence (layout order); attend; all-to-all back."""
    q_h = blocks.all_to_all(q, "heads_to_sequence", trace, "query")  # (batch, heads/N, q_len, d)
    k_h = blocks.all_to_all(k, "heads_to_sequence", trace, "key")
    v_h = blocks.all_to_all(v, "heads_to_sequence", trace, "value")
    q_segments, kv_segments = cp.all_segments(sched.q_segments), cp.all_segments(sched.kv_segments)
    out_h, lse_h = [], []
    for rank in range(sched.world_size):
        out, lse = blocks.attend(q_h[rank], k_h[rank], v_h[rank], kv_lengths, q_segments,
                                 kv_segments, sched, args)
        out_h.append(out)
        lse_h.append(blocks.finish(lse))
    output = blocks.all_to_all(out_h, "sequence_to_heads", trace, "output")
    return output, (q_h, k_h, v_h, out_h, lse_h)


def _ulysses_backward(q: list, k: list, v: list, kv_lengths: np.ndarray | None, saved: Any,
                      grad_output: list, sched: cp.Schedule, args: rules.Arguments,
                      trace: list | None) -> tuple:
    """dO to the head split, the whole-sequence backward per rank, gradients back."""
    q_h, k_h, v_h, out_h, lse_h = saved
    d_out_h = blocks.all_to_all([_to_compute(g) for g in grad_output], "heads_to_sequence",
                                trace, "grad_output")
    q_segments, kv_segments = cp.all_segments(sched.q_segments), cp.all_segments(sched.kv_segments)
    grads = [blocks.attend_backward(q_h[r], k_h[r], v_h[r], kv_lengths, out_h[r], lse_h[r],
                                    d_out_h[r], q_segments, kv_segments, sched, args)
             for r in range(sched.world_size)]
    names = ("grad_query", "grad_key", "grad_value")
    return tuple(blocks.all_to_all([g[i] for g in grads], "sequence_to_heads", trace, names[i])
                 for i in range(3))
