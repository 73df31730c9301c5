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
rank that fails makes the others fail when the process group's timeout expires.
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import attention_rules as rules
from attention_rules import context_parallel as cp

from ._core import (
    _array,
    _as_tensor,
    _describe,
    _describe_lengths,
    _dtype_name,
    _merge_partials,
    _to_compute,
)
from .blockwise import DEFAULT_BLOCK_KV, DEFAULT_BLOCK_Q, backward_tiles, forward_tiles

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
    comm = _communicator(group)
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
    comm = _communicator(group)
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
    comm: _Communicator, strategy: Any, is_causal: Any, causal_alignment: Any, window: Any,
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


def _same_on_every_rank(fn: str, comm: _Communicator, *call: Any) -> None:
    """torch only: every rank compares a digest of its call (shapes, dtypes, options, the
    ``kv_lengths`` values) with the others'; on a mismatch every rank raises ValueError."""
    if comm.world_size == 1:
        return
    text = _call_text(call)
    device = call[0].device if isinstance(call[0], torch.Tensor) else torch.device("cpu")
    digest = torch.tensor([zlib.crc32(text.encode())], dtype=torch.int64, device=device)
    digests = torch.empty(comm.world_size, dtype=torch.int64, device=device)
    _all_gather_flat(digests, digest, comm)
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
        elif isinstance(x, torch.Tensor):
            words.append(f"{name}={x.tolist()}")
        elif hasattr(x, "shape"):
            words.append(f"{name}.shape={tuple(x.shape)}")
        else:
            words.append(f"{name}={x!r}")
    return ", ".join(words)


# ------------------------------------------------------------------------------------------
# The per-block math: blockwise.py's tiles on a pair of chunks (merged by _merge_partials)
# ------------------------------------------------------------------------------------------


def _pair_band(q_start: int, kv_start: int, sched: cp.Schedule) -> tuple[float, float]:
    """The band ``lo <= j - i <= hi`` in the chunks' own indices (``i``, ``j`` from 0)."""
    shift = kv_start - q_start
    return sched.lo - shift, sched.hi - shift


def _attend_pair(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lengths: torch.Tensor | None,
    q_start: int, kv_start: int, sched: cp.Schedule, args: rules.Arguments,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(output, lse)`` of one query chunk against one key chunk (global starts given), lse
    ``-inf`` on rows with no allowed key; None when the band leaves the pair nothing."""
    lo, hi = _pair_band(q_start, kv_start, sched)
    tiles = rules.plan(q.shape[-2], k.shape[-2], DEFAULT_BLOCK_Q, DEFAULT_BLOCK_KV, lo, hi)
    if not any(blocks for _, _, blocks in tiles):
        return None  # never computed
    lengths = None if kv_lengths is None else kv_lengths - kv_start  # in the chunk's indices
    output, lse = forward_tiles(q, k, v, None, None, lengths, tiles, lo, hi, args.scale,
                                args.softcap)  # no bias, no mask
    return output, torch.where(lse == torch.inf, -torch.inf, lse)  # blockwise: +inf on empty

def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lengths: torch.Tensor | None,
    q_segments: tuple, kv_segments: tuple, sched: cp.Schedule, args: rules.Arguments,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, lse)`` of the query chunks ``q_segments`` (concatenated in ``q``) against the
    key chunks ``kv_segments`` (in ``k`` and ``v``); lse ``-inf`` on rows with no key."""
    q_size, kv_size = q.shape[-2] // len(q_segments), k.shape[-2] // len(kv_segments)
    q_c = _to_compute(q)
    like = {"dtype": q_c.dtype, "device": q_c.device}  # torch: dtype and device of new tensors
    outputs, lses = [], []
    for i, (q_start, _) in enumerate(q_segments):
        q_part = q_c[..., i * q_size:(i + 1) * q_size, :]  # (batch, heads, chunk, head_dim)
        out = torch.zeros(q_part.shape[:-1] + v.shape[-1:], **like)  # no key yet
        lse = torch.full(q_part.shape[:-1] + (1,), -torch.inf, **like)
        for j, (kv_start, _) in enumerate(kv_segments):
            cols = slice(j * kv_size, (j + 1) * kv_size)
            part = _attend_pair(q_part, k[..., cols, :], v[..., cols, :], kv_lengths, q_start,
                                kv_start, sched, args)
            if part is not None:
                out, lse = _merge_partials(out, lse, *part)
        outputs.append(out)
        lses.append(lse)
    return torch.cat(outputs, dim=-2), torch.cat(lses, dim=-2)


def _attend_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lengths: torch.Tensor | None,
    output: torch.Tensor, lse: torch.Tensor, grad_output: torch.Tensor, q_segments: tuple,
    kv_segments: tuple, sched: cp.Schedule, args: rules.Arguments,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contributions of the key chunks ``kv_segments`` to ``(grad_q, grad_k, grad_v)``, from
    the final ``output`` and ``lse`` (``+inf`` on fully masked rows) of the query chunks."""
    q_size, kv_size = q.shape[-2] // len(q_segments), k.shape[-2] // len(kv_segments)
    like = {"dtype": output.dtype, "device": output.device}  # the compute dtype
    grad_q = torch.zeros(q.shape, **like)
    grad_k, grad_v = torch.zeros(k.shape, **like), torch.zeros(v.shape, **like)
    for i, (q_start, _) in enumerate(q_segments):
        rows = slice(i * q_size, (i + 1) * q_size)
        for j, (kv_start, _) in enumerate(kv_segments):
            cols = slice(j * kv_size, (j + 1) * kv_size)
            lo, hi = _pair_band(q_start, kv_start, sched)
            tiles = rules.plan(q_size, kv_size, DEFAULT_BLOCK_Q, DEFAULT_BLOCK_KV, lo, hi)
            if not any(blocks for _, _, blocks in tiles):
                continue  # never computed
            lengths = None if kv_lengths is None else kv_lengths - kv_start
            dq, dk, dv, _ = backward_tiles(
                q[..., rows, :], k[..., cols, :], v[..., cols, :], None, None, lengths, tiles, lo,
                hi, args.scale, args.softcap, output[..., rows, :], lse[..., rows, :],
                grad_output[..., rows, :])
            grad_q[..., rows, :] += dq
            grad_k[..., cols, :] += dk
            grad_v[..., cols, :] += dv
    return grad_q, grad_k, grad_v


def _finish(lse: torch.Tensor) -> torch.Tensor:
    """The saved log-sum-exp as ``blockwise.py``'s backward wants it: ``+inf`` on empty rows."""
    return torch.where(lse == -torch.inf, torch.inf, lse)


# ------------------------------------------------------------------------------------------
# Strategies: the code every rank runs
# ------------------------------------------------------------------------------------------


def _strategy_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_lengths: torch.Tensor | None, sched: cp.Schedule, args: rules.Arguments,
                      comm: _Communicator) -> tuple:
    """``(output shard, saved for the backward pass)``."""
    forward = {"ring": _ring_forward, "all_gather": _all_gather_forward,
               "ulysses": _ulysses_forward}[sched.strategy]
    return forward(q, k, v, kv_lengths, sched, args, comm)


def _strategy_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_lengths: torch.Tensor | None, saved: Any, grad_output: torch.Tensor,
                       sched: cp.Schedule, args: rules.Arguments, comm: _Communicator) -> tuple:
    """``(grad_q, grad_k, grad_v)`` shards."""
    backward = {"ring": _ring_backward, "all_gather": _all_gather_backward,
                "ulysses": _ulysses_backward}[sched.strategy]
    return backward(q, k, v, kv_lengths, saved, grad_output, sched, args, comm)


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_lengths: torch.Tensor | None, sched: cp.Schedule, args: rules.Arguments,
                  comm: _Communicator) -> tuple:
    """Step ``s``: this rank attends to the block of rank ``r - s``, then passes it on."""
    rank, result = comm.rank, None
    for step in range(sched.steps):
        origin = cp.ring_origin(sched.world_size, rank, step)
        # torch: the next block is on its way while this one is computed
        pending = _ring_shift_start([k, v], 1, comm) if step + 1 < sched.steps else None
        part = _attend(q, k, v, kv_lengths, sched.q_segments[rank], sched.kv_segments[origin],
                       sched, args)
        result = part if result is None else _merge_partials(*result, *part)
        if pending is not None:
            k, v = _ring_shift_finish(pending)
    output, lse = result
    return output, (output, _finish(lse))


def _ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   kv_lengths: torch.Tensor | None, saved: Any, grad_output: torch.Tensor,
                   sched: cp.Schedule, args: rules.Arguments, comm: _Communicator) -> tuple:
    """The ring again; the key/value gradients travel with their blocks, then go home."""
    output, lse = saved
    rank = comm.rank
    grad_q = torch.zeros(q.shape, dtype=output.dtype, device=output.device)
    grad_k = torch.zeros(k.shape, dtype=output.dtype, device=output.device)
    grad_v = torch.zeros(v.shape, dtype=output.dtype, device=output.device)
    d_out = _to_compute(grad_output)
    for step in range(sched.steps):
        origin = cp.ring_origin(sched.world_size, rank, step)
        pending = _ring_shift_start([k, v], 1, comm) if step + 1 < sched.steps else None
        dq, dk, dv = _attend_backward(
            q, k, v, kv_lengths, output, lse, d_out, sched.q_segments[rank],
            sched.kv_segments[origin], sched, args)
        grad_q += dq
        grad_k += dk  # the gradient of the block held: it travels with it
        grad_v += dv
        if pending is not None:
            k, v = _ring_shift_finish(pending)
            grad_k, grad_v = _ring_shift_finish(_ring_shift_start([grad_k, grad_v], 1, comm))
    home = -(sched.steps - 1) % sched.world_size  # this rank holds rank r - (steps - 1)'s
    if home:
        grad_k, grad_v = _ring_shift_finish(_ring_shift_start([grad_k, grad_v], home, comm))
    return grad_q, grad_k, grad_v


def _all_gather_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_lengths: torch.Tensor | None, sched: cp.Schedule,
                        args: rules.Arguments, comm: _Communicator) -> tuple:
    """Gather every key/value block (layout order), then attend to all of them."""
    k_all, v_all = _all_gather(k, comm), _all_gather(v, comm)
    output, lse = _attend(q, k_all, v_all, kv_lengths, sched.q_segments[comm.rank],
                          cp.all_segments(sched.kv_segments), sched, args)
    return output, (output, _finish(lse))


def _all_gather_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         kv_lengths: torch.Tensor | None, saved: Any, grad_output: torch.Tensor,
                         sched: cp.Schedule, args: rules.Arguments, comm: _Communicator) -> tuple:
    """Gather again (nothing of the whole sequence was kept), then sum each block's
    gradients back to its owner (reduce-scatter)."""
    output, lse = saved
    k_all, v_all = _all_gather(k, comm), _all_gather(v, comm)
    grad_q, grad_k_all, grad_v_all = _attend_backward(
        q, k_all, v_all, kv_lengths, output, lse, _to_compute(grad_output),
        sched.q_segments[comm.rank], cp.all_segments(sched.kv_segments), sched, args)
    return grad_q, _reduce_scatter(grad_k_all, comm), _reduce_scatter(grad_v_all, comm)


def _ulysses_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     kv_lengths: torch.Tensor | None, sched: cp.Schedule, args: rules.Arguments,
                     comm: _Communicator) -> tuple:
    """All-to-all: 1/N of the heads, the whole sequence (layout order); attend; all-to-all back."""
    q_h = _all_to_all(q, "heads_to_sequence", comm)  # (batch, heads / N, q_len, head_dim)
    k_h = _all_to_all(k, "heads_to_sequence", comm)
    v_h = _all_to_all(v, "heads_to_sequence", comm)
    out_h, lse_h = _attend(q_h, k_h, v_h, kv_lengths, cp.all_segments(sched.q_segments),
                           cp.all_segments(sched.kv_segments), sched, args)
    output = _all_to_all(out_h, "sequence_to_heads", comm)
    return output, (q_h, k_h, v_h, out_h, _finish(lse_h))


def _ulysses_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_lengths: torch.Tensor | None, saved: Any, grad_output: torch.Tensor,
                      sched: cp.Schedule, args: rules.Arguments, comm: _Communicator) -> tuple:
    """dO to the head split, the whole-sequence backward, gradients back."""
    q_h, k_h, v_h, out_h, lse_h = saved
    d_out_h = _all_to_all(_to_compute(grad_output), "heads_to_sequence", comm)
    grads = _attend_backward(q_h, k_h, v_h, kv_lengths, out_h, lse_h, d_out_h,
                             cp.all_segments(sched.q_segments),
                             cp.all_segments(sched.kv_segments), sched, args)
    return tuple(_all_to_all(g, "sequence_to_heads", comm) for g in grads)


class _ContextParallelAttention(torch.autograd.Function):
    """torch only: autograd sees one node; its backward runs the strategy's backward schedule."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_lengths: torch.Tensor | None, sched: cp.Schedule, args: rules.Arguments,
                comm: _Communicator) -> Any:
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


# ------------------------------------------------------------------------------------------
# The messages (numpy: lists over ranks; jax: lax collectives; torch: torch.distributed)
# ------------------------------------------------------------------------------------------


class _Communicator(NamedTuple):
    """torch only: the process group, this rank's index in it and its size."""

    group: Any
    rank: int
    world_size: int


def _communicator(group: Any) -> _Communicator:
    """torch only: the group (None: the default one), this rank and the size."""
    return _Communicator(group, dist.get_rank(group), dist.get_world_size(group))


def _peer(comm: _Communicator, rank: int) -> int:
    """torch only: the global rank of ``rank`` of the group (point-to-point ops want it)."""
    return rank if comm.group is None else dist.get_global_rank(comm.group, rank)


def _ring_shift_start(tensors: list, shift: int, comm: _Communicator) -> tuple:
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


def _ring_shift_finish(pending: tuple) -> list:
    """Wait for a started shift; the received tensors."""
    requests, received = pending
    for request in requests:
        request.wait()
    return received


def _all_gather_flat(output: torch.Tensor, tensor: torch.Tensor, comm: _Communicator) -> None:
    """``all_gather_single`` (``all_gather_into_tensor`` before torch 2.10) along dim 0."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=comm.group)


def _all_gather(x: torch.Tensor, comm: _Communicator) -> torch.Tensor:
    """Every rank's shard, concatenated along the sequence axis in rank order."""
    parts = x.movedim(-2, 0).contiguous()  # (seq / N, batch, heads, dim): gathered along dim 0
    gathered = torch.empty((comm.world_size * parts.shape[0],) + parts.shape[1:],
                           dtype=parts.dtype, device=parts.device)
    _all_gather_flat(gathered, parts, comm)
    return gathered.movedim(0, -2)


def _reduce_scatter(x: torch.Tensor, comm: _Communicator) -> torch.Tensor:
    """Sum the ranks' whole-sequence arrays; this rank keeps its shard of the sum."""
    parts = x.movedim(-2, 0).contiguous()  # (seq, batch, heads, dim)
    shard = torch.empty((parts.shape[0] // comm.world_size,) + parts.shape[1:],
                        dtype=parts.dtype, device=parts.device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(shard, parts, group=comm.group)
    return shard.movedim(0, -2)


def _all_to_all(x: torch.Tensor, direction: str, comm: _Communicator) -> torch.Tensor:
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
