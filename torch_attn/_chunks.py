"""The chunks of split-KV decoding (``paged.split_kv_attention``, ``paged_attention`` and a
quantised cache's step, ``_dequantizing``): which keys of a chunk each query may attend, a
chunk's softmax with its row log-sum-exp, the per-thread buffer a chunk's keys and values are
copied into, and the merge of the chunks' partial results by their log-sum-exp."""

from __future__ import annotations

import threading

import torch

from ._steps import NEG_INF

_local = threading.local()  # each thread's buffers for the copied pages, per device (_buffer)


def _chunk_allowed(
    chunks: list[tuple[int, int]], width: int, kv_len: int, n: int, rows: int,
    device: torch.device,
) -> torch.Tensor | None:
    """``(rows, chunks, width)``: whether row ``r`` (query ``r % n`` of ``n``, bottom-right
    causal over ``kv_len`` keys) attends offset ``j`` of chunk ``c``'s slot (position
    ``start + j``, below the chunk's ``stop``); None when every row attends every key its
    slots hold (one query row, chunks full but the last): no mask, no empty row."""
    if n <= 1 and all(stop == min(start + width, kv_len) for start, stop in chunks):
        return None
    starts, stops = (torch.tensor(x, device=device)[:, None] for x in zip(*chunks, strict=True))
    positions = starts + torch.arange(width, device=device)  # (chunks, width)
    limits = kv_len - n + 1 + torch.arange(rows, device=device) % max(n, 1)  # (rows,)
    return (positions < stops) & (positions < limits[:, None, None])


def _chunk_softmax(
    scores: torch.Tensor, guard: bool, record: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every chunk's softmax over the last axis of ``scores (..., width)`` (``-inf`` where a
    key is left out): ``(weights (..., width), lse (...))``; ``guard``: a row may have no key
    (weights 0 and lse ``-inf`` there). torch: without autograd nor empty rows,
    ``torch.softmax`` (one pass: half the time of ``torch.exp`` alone on 262,144 scores) and
    ``lse = max - log(largest weight)`` (the largest weight is ``exp(0) / sum``); otherwise the
    shifted exponentials and their sum, out of place (the shift a constant for autograd)."""
    if not (guard or record):
        weights = torch.softmax(scores, dim=-1)
        return weights, scores.amax(dim=-1) - torch.log(weights.amax(dim=-1))
    shift = scores.detach().amax(dim=-1, keepdim=True)
    shift = torch.where(shift == NEG_INF, 0.0, shift)  # no -inf - -inf
    weights = torch.exp(scores - shift)
    total = weights.sum(dim=-1, keepdim=True)
    empty = total == 0.0  # no key in the chunk
    safe = torch.where(empty, 1.0, total)
    return weights / safe, torch.where(empty, NEG_INF, shift + torch.log(safe))[..., 0]


def _buffer(shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """This thread's buffer on ``like``'s device as a tensor of ``shape`` and ``like``'s dtype
    (uninitialised), grown when too small and reused otherwise: no allocation (and no fresh
    memory to fault in) per part."""
    size = shape[0] * shape[1] * like.element_size()
    buffers = _local.__dict__.setdefault("buffers", {})
    raw = buffers.get(like.device)
    if raw is None or raw.numel() < size:
        raw = buffers[like.device] = torch.empty(size, dtype=torch.uint8, device=like.device)
    return raw[:size].view(like.dtype).view(shape)


def _merge_chunks(
    outputs: torch.Tensor, lses: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial results ``(chunks, ..., heads, n, v_dim)`` with their lses ``(chunks,
    ..., heads, n)`` (``merge_attention``'s rule; ``sinks (heads,)`` join once, a part of
    output 0): ``(output (..., heads, n, v_dim), lse (..., heads, n))``, vectorised over the
    chunks; a part with lse ``-inf`` contributes nothing and gets gradient 0."""
    if outputs.shape[0] == 1 and sinks is None:  # one part: itself
        return outputs[0], lses[0]
    row_max = lses.detach().amax(dim=0)  # (..., heads, n): a shift, constant for autograd
    if sinks is not None:
        sink = sinks.to(lses.device, lses.dtype).reshape(-1, 1)  # (heads, 1)
        row_max = torch.maximum(row_max, sink.detach())
    shift = torch.where(row_max == NEG_INF, 0.0, row_max)  # no -inf - -inf
    scales = torch.exp(lses - shift)  # exp(lse_i - max) <= 1; 0 for no key
    total = scales.sum(dim=0)
    if sinks is not None:
        total = total + torch.exp(sink - shift)
    empty = total == 0.0  # no key in any part
    safe = torch.where(empty, 1.0, total)
    lse = torch.where(empty, NEG_INF, shift + torch.log(safe))
    output = (scales[..., None] * outputs).sum(dim=0) / safe[..., None]
    return output, lse

