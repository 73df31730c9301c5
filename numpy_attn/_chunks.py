"""The chunks of split-KV decoding (``paged.split_kv_attention``, ``paged_attention`` and a
quantised cache's step, ``_dequantizing``): one chunk's partial attention and its row
log-sum-exp, the per-thread buffer a chunk's keys and values are copied into, and the merge of
the chunks' partial results by their log-sum-exp."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np

from ._steps import NEG_INF, _merge_attention, _softcap

_local = threading.local()  # each thread's buffer for the copied pages (``_buffer``)


def _buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """This thread's buffer as an array of ``shape`` and ``dtype`` (uninitialised), grown when
    too small and reused otherwise: no allocation (and no fresh memory to fault in) per part."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = getattr(_local, "buffer", None)
    if raw is None or raw.nbytes < size:
        raw = _local.buffer = np.empty(size, np.uint8)
    return raw[:size].view(dtype).reshape(shape)


def _partials(chunks: int, rows: np.ndarray, v_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots for every chunk's partial result: outputs ``(chunks, batch, kv_heads, rows,
    v_dim)`` of zeros and lses ``(chunks, batch, kv_heads, rows)`` of ``-inf`` (a slot no task
    fills is an empty part); at least one chunk."""
    shape = (max(1, chunks),) + rows.shape[:-1]
    return np.zeros(shape + (v_dim,), rows.dtype), np.full(shape, NEG_INF, rows.dtype)


def _limits(kv_len: int, q_len: int, rows: int, stop: int) -> np.ndarray | None:
    """``(rows, 1)``: row ``r`` (query ``r % q_len``) attends the positions below
    ``kv_len - q_len + 1 + r % q_len`` (bottom-right causal); None when every key before
    ``stop`` is allowed to every row."""
    if stop <= kv_len - q_len + 1:
        return None
    return (kv_len - q_len + 1 + np.arange(rows) % q_len)[:, None]


def _attend_chunk(
    rows: np.ndarray,
    width: int,
    keys: Iterable[np.ndarray],
    values: Iterable[np.ndarray],
    start: int,
    limits: np.ndarray | None,
    scale: float,
    softcap: float | None,
) -> tuple[np.ndarray, np.ndarray]:
    """One chunk's partial result: ``rows (kv_heads, rows, head_dim)`` (the query heads of a kv
    head, one after the other) against the chunk's ``width`` keys, given as consecutive parts
    ``(kv_heads, part, head_dim)`` (views; read once, in order) with their values as parts
    ``(kv_heads, part, v_dim)``, at positions from ``start``; ``limits`` as ``_limits``. A part
    that is not an array is a quantised cache's part of codes (``_dequantizing._Codes``): it
    makes its own products, ``scores(rows_t, out)`` and ``weighted(weights)``.
    Returns the output ``(kv_heads, rows, v_dim)`` and the lse ``(kv_heads, rows)``; a row
    without a key gives 0 and -inf."""
    # numpy: the scores as keys @ rowsᵀ, (part, head_dim) @ (head_dim, rows) per kv head: a
    # BLAS product with a few columns streams the keys once; rows @ keysᵀ, a few rows by a long
    # transposed matrix, took 3.8x as long (OpenBLAS, one thread, 32k keys)
    scores_t = np.empty(rows.shape[:-2] + (width, rows.shape[-2]), rows.dtype)
    rows_t, at = rows.swapaxes(-1, -2), 0
    for k in keys:  # one product per part (a part of codes folds its scales in itself)
        part = scores_t[..., at:at + k.shape[-2], :]
        if isinstance(k, np.ndarray):
            np.matmul(k.astype(rows.dtype, copy=False), rows_t, out=part)
        else:
            k.scores(rows_t, part)
        at += k.shape[-2]
    scores = np.ascontiguousarray(scores_t.swapaxes(-1, -2))  # (kv_heads, rows, width)
    scores *= scale
    scores = _softcap(scores, softcap)
    if limits is not None:  # (rows, width): the causal rule by absolute position
        scores[:, start + np.arange(width)[None, :] >= limits] = NEG_INF
    row_max = scores.max(axis=-1, keepdims=True)  # (kv_heads, rows, 1)
    shift = np.where(row_max == NEG_INF, 0.0, row_max).astype(rows.dtype)
    scores -= shift
    np.exp(scores, out=scores)
    row_sum = scores.sum(axis=-1, keepdims=True)
    output, at = None, 0
    for v in values:  # one product per part, summed in order
        weights = scores[..., at:at + v.shape[-2]]
        part = weights @ v.astype(rows.dtype, copy=False) if isinstance(v, np.ndarray) \
            else v.weighted(weights)
        if output is None:
            output = part
        else:
            output += part
        at += v.shape[-2]
    with np.errstate(divide="ignore"):  # log(0) = -inf: a row without a key
        lse = shift + np.log(row_sum)
    output /= np.where(row_sum == 0.0, 1.0, row_sum).astype(rows.dtype)
    return output, lse[..., 0]


def _merge_chunks(
    outputs: np.ndarray, lses: np.ndarray, sinks: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Merge partial results ``(chunks, ..., heads, n, v_dim)`` with their lses ``(chunks,
    ..., heads, n)`` in chunk order (``merge_attention``'s rule; ``sinks (heads,)`` join once):
    ``(output (..., heads, n, v_dim), lse (..., heads, n))``."""
    output, lse = _merge_attention(tuple(outputs), tuple(lses[..., None]), sinks)
    return output, lse[..., 0]

