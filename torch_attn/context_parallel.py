"""Context-parallel attention in PyTorch: the sequence split across the ranks of a process group.

A sequence too long for one device is split along its sequence axis: rank ``r`` of a
``torch.distributed`` process group holds a shard of the queries, keys and values
(``attention_rules.context_parallel`` says which positions), and the ranks exchange keys and
values so that every query meets every key it may attend to. The per-block math is
``blockwise.py``'s online softmax: each (query chunk, key chunk) pair gives a partial output and
its log-sum-exp ``lse``, and partial results over different keys merge exactly::

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b

Every rank calls ``context_parallel_attention`` with its own shards (numpy_attn's file is the
same algorithm with the ranks simulated in a loop):

* ``"ring"`` (Liu et al. 2023): at step ``s`` rank ``r`` holds the key/value block of rank
  ``r - s`` and passes it to rank ``r + 1`` (``batch_isend_irecv``, started before the block is
  computed so the transfer overlaps the work). The backward pass (a
  ``torch.autograd.Function``) runs the ring again; the key and value gradients travel with
  their blocks and arrive home at the end.
* ``"all_gather"``: ``all_gather_single`` of every key/value block; the backward pass
  gathers again and sums each block's gradients back to its owner (``reduce_scatter_single``).
* ``"ulysses"`` (DeepSpeed-Ulysses): ``all_to_all_single`` turns "all heads, 1/N of the
  sequence" into "1/N of the heads, the whole sequence"; a second one turns the output back.

The same code runs on gloo (CPU) and NCCL (GPU); nothing here names a device or a backend. A
rank that fails makes the others fail when the process group's timeout expires. The steps are
made of ``context_blocks.py``'s pairs and messages; memory per rank:
``docs/context_parallel.md``, "Memory per device".
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

import attention_rules as rules
from attention_rules import context_parallel as cp

from . import context_blocks as blocks
from ._arrays import (
    _array,
    _as_tensor,
    _describe,
    _describe_lengths,
    _dtype_name,
    _to_compute,
)
from .context_blocks import Communicator

# ------------------------------------------------------------------------------------------
# Public functions
# ------------------------------------------------------------------------------------------


def context_parallel_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    group: Any = None,
    strategy: str = "ring",
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    kv_lengths: Any = None,
    load_balance: bool = False,
) -> torch.Tensor:
    """Attention over a sequence split across the ranks of ``group``; call it on every rank.

    Rank ``r`` passes its shards; the result is its shard of
    ``blockwise_attention(query, key, value, kv_lengths=kv_lengths, ...)`` over the whole
    sequence. Differentiable: a ``torch.autograd.Function`` whose backward pass runs the
    strategy's backward schedule (ring: dK and dV travel with their blocks).

    Args:
      query: ``(batch, heads, q_len / N, head_dim)``: this rank's shard of the sequence in
        layout order (chunk ``r``; with ``load_balance``, chunks ``r`` and ``2N - 1 - r`` of
        ``2N``, concatenated).
      key: ``(batch, kv_heads, kv_len / N, head_dim)``, this rank's shard.
      value: ``(batch, kv_heads, kv_len / N, v_dim)``, this rank's shard.
      group: a ``torch.distributed`` process group of ``N`` ranks (None: the default group).
      strategy: ``"ring"``, ``"all_gather"`` or ``"ulysses"`` (heads and kv_heads multiples of
        ``N``).
      is_causal, causal_alignment, window, scale, softcap: as in
        ``scaled_dot_product_attention``; positions are global (natural order).
      kv_lengths: ``(batch,)`` ints in ``[0, kv_len]``, the same on every rank: key ``j`` of
        sequence ``b`` is attended only if ``j < kv_lengths[b]`` (global positions).
      load_balance: zig-zag layout (each shard holds two chunks; its length must be even).

    Returns:
      ``(batch, heads, q_len / N, v_dim)``, this rank's shard of the output, in the input dtype;
      fully masked rows give 0. Shards that differ across ranks raise ValueError on every rank.
    """
    fn = "context_parallel_attention"
    comm = blocks.communicator(group)
    args, sched = _arguments(fn, query, key, value, None, kv_lengths, comm, strategy, is_causal,
                             causal_alignment, window, scale, softcap, load_balance)
    query, key, value = _array(query), _array(key), _array(value)
    lengths = None if kv_lengths is None else _as_tensor(kv_lengths, query.device)
    return _ContextParallelAttention.apply(query, key, value, lengths, sched, args, comm)


def context_parallel_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    *,
    group: Any = None,
    strategy: str = "ring",
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    kv_lengths: Any = None,
    load_balance: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``context_parallel_attention`` for this rank's shards; call it on every rank.

    Through ``torch.autograd.grad`` on the ``torch.autograd.Function``.

    Args:
      query: ``(batch, heads, q_len / N, head_dim)``.
      key: ``(batch, kv_heads, kv_len / N, head_dim)``.
      value: ``(batch, kv_heads, kv_len / N, v_dim)``.
      grad_output: ``(batch, heads, q_len / N, v_dim)``, all this rank's shards.
      group, strategy, is_causal, causal_alignment, window, scale, softcap, kv_lengths,
        load_balance: as in ``context_parallel_attention``.

    Returns:
      ``(grad_query, grad_key, grad_value)``: this rank's shards, in the input dtype.
    """
    fn = "context_parallel_attention_vjp"
    comm = blocks.communicator(group)
    args, sched = _arguments(fn, query, key, value, grad_output, kv_lengths, comm, strategy,
                             is_causal, causal_alignment, window, scale, softcap, load_balance)
    query, key, value, grad_output = _array(query), _array(key), _array(value), _array(grad_output)
    lengths = None if kv_lengths is None else _as_tensor(kv_lengths, query.device)
    inputs = [t.detach().requires_grad_(True) for t in (query, key, value)]
    with torch.enable_grad():
        output = _ContextParallelAttention.apply(*inputs, lengths, sched, args, comm)
        grads = torch.autograd.grad(output, inputs, grad_outputs=grad_output)
    return tuple(grads)


# ------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------


def _arguments(
    fn: str, query: Any, key: Any, value: Any, grad_output: Any, kv_lengths: Any,
    comm: Communicator, strategy: Any, is_causal: Any, causal_alignment: Any, window: Any,
    scale: Any, softcap: Any, load_balance: Any,
) -> tuple[rules.Arguments, cp.Schedule]:
    """Every rule, once (global shapes), and the static schedule. torch: the ranks first agree
    that they were called alike, so a bad call fails on every rank, never on one alone."""
    _same_on_every_rank(fn, comm, query, key, value, grad_output, kv_lengths, strategy,
                        is_causal, causal_alignment, window, scale, softcap, load_balance)
    described = [_global(_describe(fn, name, x), comm.world_size) for name, x in
                 (("query", query), ("key", key), ("value", value))]
    args = rules.attention_arguments(
        fn, *described,
        grad_output=None if grad_output is None else _global(
            _describe(fn, "grad_output", grad_output), comm.world_size),
        is_causal=is_causal, causal_alignment=causal_alignment, window=window, scale=scale,
        softcap=softcap, kv_lengths=_describe_lengths(kv_lengths),
    )
    strategy, world_size, load_balance = cp.check_context_parallel(
        fn, strategy, comm.world_size, described[0][0], described[1][0], load_balance)
    kv_len = described[1][0][-2]
    if kv_lengths is not None:  # the range needs the values
        rules.check_lengths(fn, "kv_lengths", _as_tensor(kv_lengths).tolist(), kv_len)
    sched = cp.schedule(strategy, world_size, described[0][0][-2], kv_len, args.is_causal,
                        args.causal_alignment, args.window, load_balance)
    return args, sched


def _global(info: rules.ArrayInfo, world_size: int) -> rules.ArrayInfo:
    """torch only: a shard's ``(shape, dtype)`` as the whole sequence's (sequence axis × N)."""
    shape, dtype = info
    if len(shape) < 2:
        return shape, dtype
    return shape[:-2] + (shape[-2] * world_size,) + shape[-1:], dtype


def _same_on_every_rank(fn: str, comm: Communicator, *call: Any) -> None:
    """torch only: every rank compares a digest of its call (shapes, dtypes, options, the
    ``kv_lengths`` values) with the others'; on a mismatch every rank raises ValueError."""
    if comm.world_size == 1:
        return
    text = _call_text(call)
    device = call[0].device if isinstance(call[0], torch.Tensor) else torch.device("cpu")
    digest = torch.tensor([zlib.crc32(text.encode())], dtype=torch.int64, device=device)
    digests = torch.empty(comm.world_size, dtype=torch.int64, device=device)
    blocks.all_gather_flat(digests, digest, comm)
    if len(set(digests.tolist())) > 1:  # every rank sees the same digests: all raise
        texts: list = [None] * comm.world_size
        dist.all_gather_object(texts, text, group=comm.group)
        cp.check_same_on_every_rank(fn, texts)


def _call_text(call: tuple) -> str:
    """torch only: one line describing a rank's call, never raising (bad inputs are named by
    the checks that follow)."""
    names = ("query", "key", "value", "grad_output", "kv_lengths", "strategy", "is_causal",
             "causal_alignment", "window", "scale", "softcap", "load_balance")
    words = []
    for name, x in zip(names, call, strict=True):
        if isinstance(x, torch.Tensor) and name != "kv_lengths":
            words.append(f"{name}.shape={tuple(x.shape)} {_dtype_name(x)}")
        elif name == "kv_lengths" and hasattr(x, "tolist"):  # a tensor or array: its values
            words.append(f"{name}={x.tolist()}")
        elif hasattr(x, "shape"):  # a NumPy array: its dtype as a tensor's is named
            words.append(f"{name}.shape={tuple(x.shape)} {getattr(x, 'dtype', '')}")
        else:
            words.append(f"{name}={x!r}")
    return ", ".join(words)


# ------------------------------------------------------------------------------------------
# Strategies: the code every rank runs
# ------------------------------------------------------------------------------------------


def _strategy_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_lengths: torch.Tensor | None, sched: cp.Schedule, args: rules.Arguments,
                      comm: Communicator) -> tuple:
    """``(output shard, saved for the backward pass)``."""
    forward = {"ring": _ring_forward, "all_gather": _all_gather_forward,
               "ulysses": _ulysses_forward}[sched.strategy]
    return forward(q, k, v, kv_lengths, sched, args, comm)


def _strategy_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_lengths: torch.Tensor | None, saved: Any, grad_output: torch.Tensor,
                       sched: cp.Schedule, args: rules.Arguments, comm: Communicator) -> tuple:
    """``(grad_q, grad_k, grad_v)`` shards."""
    backward = {"ring": _ring_backward, "all_gather": _all_gather_backward,
                "ulysses": _ulysses_backward}[sched.strategy]
    return backward(q, k, v, kv_lengths, saved, grad_output, sched, args, comm)


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_lengths: torch.Tensor | None, sched: cp.Schedule, args: rules.Arguments,
                  comm: Communicator) -> tuple:
    """Step ``s``: this rank attends to the block of rank ``r - s``, then passes it on."""
    rank, result = comm.rank, None
    for step in range(sched.steps):
        origin = cp.ring_origin(sched.world_size, rank, step)
        # torch: the next block is on its way while this one is computed
        pending = blocks.ring_shift_start([k, v], 1, comm) if step + 1 < sched.steps else None
        result = blocks.attend(q, k, v, kv_lengths, sched.q_segments[rank],
                               sched.kv_segments[origin], sched, args, result)
        if pending is not None:
            k, v = blocks.ring_shift_finish(pending)
            pending = None  # torch: its requests hold the blocks sent: let them go now
    output, lse = result
    return output, (output, blocks.finish(lse))


def _ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   kv_lengths: torch.Tensor | None, saved: Any, grad_output: torch.Tensor,
                   sched: cp.Schedule, args: rules.Arguments, comm: Communicator) -> tuple:
    """The ring again; the key/value gradients travel with their blocks, then go home."""
    output, lse = saved
    rank = comm.rank
    grad_q = torch.zeros(q.shape, dtype=output.dtype, device=output.device)
    grad_k = torch.zeros(k.shape, dtype=output.dtype, device=output.device)
    grad_v = torch.zeros(v.shape, dtype=output.dtype, device=output.device)
    d_out = _to_compute(grad_output)
    for step in range(sched.steps):
        origin = cp.ring_origin(sched.world_size, rank, step)
        pending = blocks.ring_shift_start([k, v], 1, comm) if step + 1 < sched.steps else None
        # the gradient of the block held travels with it
        grad_q, grad_k, grad_v = blocks.attend_backward(
            q, k, v, kv_lengths, output, lse, d_out, sched.q_segments[rank],
            sched.kv_segments[origin], sched, args, (grad_q, grad_k, grad_v))
        if pending is not None:
            k, v = blocks.ring_shift_finish(pending)
            pending = None  # torch: its requests hold the blocks sent: let them go now
            grad_k, grad_v = blocks.ring_shift([grad_k, grad_v], 1, comm)
    home = -(sched.steps - 1) % sched.world_size  # this rank holds rank r - (steps - 1)'s
    if home:
        grad_k, grad_v = blocks.ring_shift([grad_k, grad_v], home, comm)
    return grad_q, grad_k, grad_v


def _all_gather_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_lengths: torch.Tensor | None, sched: cp.Schedule,
                        args: rules.Arguments, comm: Communicator) -> tuple:
    """Gather every key/value block (layout order), then attend to all of them."""
    k_all, v_all = blocks.all_gather(k, comm), blocks.all_gather(v, comm)
    output, lse = blocks.attend(q, k_all, v_all, kv_lengths, sched.q_segments[comm.rank],
                                cp.all_segments(sched.kv_segments), sched, args)
    return output, (output, blocks.finish(lse))


def _all_gather_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         kv_lengths: torch.Tensor | None, saved: Any, grad_output: torch.Tensor,
                         sched: cp.Schedule, args: rules.Arguments, comm: Communicator) -> tuple:
    """Gather again (nothing of the whole sequence was kept), then sum each block's
    gradients back to its owner (reduce-scatter)."""
    output, lse = saved
    k_all, v_all = blocks.all_gather(k, comm), blocks.all_gather(v, comm)
    grad_q, grad_k_all, grad_v_all = blocks.attend_backward(
        q, k_all, v_all, kv_lengths, output, lse, _to_compute(grad_output),
        sched.q_segments[comm.rank], cp.all_segments(sched.kv_segments), sched, args)
    return grad_q, blocks.reduce_scatter(grad_k_all, comm), blocks.reduce_scatter(grad_v_all, comm)


def _ulysses_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     kv_lengths: torch.Tensor | None, sched: cp.Schedule, args: rules.Arguments,
                     comm: Communicator) -> tuple:
    """All-to-all: 1/N of the heads, the whole sequence (layout order); attend; all-to-all back."""
    q_h = blocks.all_to_all(q, "heads_to_sequence", comm)  # (batch, heads / N, q_len, head_dim)
    k_h = blocks.all_to_all(k, "heads_to_sequence", comm)
    v_h = blocks.all_to_all(v, "heads_to_sequence", comm)
    out_h, lse_h = blocks.attend(q_h, k_h, v_h, kv_lengths, cp.all_segments(sched.q_segments),
                                 cp.all_segments(sched.kv_segments), sched, args)
    output = blocks.all_to_all(out_h, "sequence_to_heads", comm)
    return output, (q_h, k_h, v_h, out_h, blocks.finish(lse_h))


def _ulysses_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_lengths: torch.Tensor | None, saved: Any, grad_output: torch.Tensor,
                      sched: cp.Schedule, args: rules.Arguments, comm: Communicator) -> tuple:
    """dO to the head split, the whole-sequence backward, gradients back."""
    q_h, k_h, v_h, out_h, lse_h = saved
    d_out_h = blocks.all_to_all(_to_compute(grad_output), "heads_to_sequence", comm)
    grads = blocks.attend_backward(q_h, k_h, v_h, kv_lengths, out_h, lse_h, d_out_h,
                                   cp.all_segments(sched.q_segments),
                                   cp.all_segments(sched.kv_segments), sched, args)
    return tuple(blocks.all_to_all(g, "sequence_to_heads", comm) for g in grads)


class _ContextParallelAttention(torch.autograd.Function):
    """torch only: autograd sees one node; its backward runs the strategy's backward schedule."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_lengths: torch.Tensor | None, sched: cp.Schedule, args: rules.Arguments,
                comm: Communicator) -> Any:
        output, saved = _strategy_forward(query, key, value, kv_lengths, sched, args, comm)
        ctx.save_for_backward(query, key, value, kv_lengths, *saved)
        ctx.static = (sched, args, comm)
        return output.to(query.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        query, key, value, kv_lengths, *saved = ctx.saved_tensors
        grad_q, grad_k, grad_v = _strategy_backward(query, key, value, kv_lengths, tuple(saved),
                                                    grad_output, *ctx.static)
        return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype), None, \
            None, None, None
