"""Scaled dot-product attention, step by step, in NumPy.

The pipeline (``conformance/spec.py``): scores → soft-cap → + bias → mask → softmax → dropout →
weighted sum of values. Every step is a public function, so every intermediate can be printed
and compared; ``scaled_dot_product_attention`` validates its inputs once and runs them all.

Precision: float16 and bfloat16 are computed in float32; float32 stays float32 (Python floats
only, never NumPy float64 scalars, so nothing is promoted); float64 stays float64.

Fast path. The steps above are the code to read: each makes the whole ``(..., heads, q_len,
kv_len)`` score array, and NumPy's elementwise functions (``max``, ``exp``, ``sum``) run on one
core while only the matrix products use every core. For large inputs
``scaled_dot_product_attention`` therefore runs the same pipeline as ``_blocked_attention`` (the
private section at the end of this file) when ``_use_blocked_path`` allows it: no
``return_weights``, no dropout, no empty axis, and at least ``_BLOCKED_MIN_SCORES`` score entries
with ``q_len >= _BLOCKED_MIN_Q_LEN``. It cuts the queries into blocks of ``_BLOCK_Q`` rows and,
per (batch, head, query block), computes the scores against the keys that block can see (the
causal rule and the window give a key range; fully masked blocks are skipped, and the rule is
applied only to the diagonal strips), then softmax in place and ``(exp(s - max) @ value) / sum``;
mask and bias are sliced per block from broadcast views, never materialised. Its result equals
the explicit path's within float32 rounding (``tests/test_performance_paths.py``).

The blocks run on a persistent pool of threads (NumPy releases the GIL in ufuncs and in
``matmul``), one per BLAS thread, while the BLAS library is limited to one thread so the two
levels of threading do not oversubscribe the cores. That limit uses ``threadpoolctl`` when it is
installed: it is optional, imported on the first fast-path call (never by ``import numpy_attn``),
and the BLAS library's own thread count is restored after each call (the limit is process-wide
while the call runs). Without ``threadpoolctl`` the blocks run in the calling thread with BLAS
left as configured, which is correct but uses one core for the elementwise work. Calling BLAS
libraries through ``ctypes`` would avoid the dependency but depends on how NumPy was built
(symbol names differ between OpenBLAS, scipy-openblas, MKL and Accelerate), so the project does
not. A call made while another thread is already inside the fast path also runs in its own
thread, without the pool.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import numpy as np

from . import _checks
from .masks import _positions

NEG_INF = -np.inf


def _to_compute(x: np.ndarray) -> np.ndarray:
    """Half types up to float32; float32 and float64 unchanged (no copy)."""
    return x.astype(_checks.compute_dtype(x.dtype.name), copy=False)


def _group_heads(x: np.ndarray, groups: int) -> np.ndarray:
    """``(..., heads, T, D)`` → ``(..., kv_heads, groups, T, D)``: query head ``h`` is
    ``(h // groups, h % groups)``, so it meets kv head ``h // groups``."""
    return x.reshape(x.shape[:-3] + (x.shape[-3] // groups, groups) + x.shape[-2:])


def _groups(x_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> int:
    return x_shape[-3] // kv_shape[-3] if len(x_shape) >= 3 else 1


# ------------------------------------------------------------------------------------------
# Unchecked steps: the public functions and scaled_dot_product_attention validate, then call
# these. Each returns a fresh array it owns, so later steps may work in place.
# ------------------------------------------------------------------------------------------


def _scores(query: np.ndarray, key: np.ndarray, scale: float, softcap: float | None) -> np.ndarray:
    query = _to_compute(query) * scale  # (..., heads, q_len, head_dim); scaling q is cheapest
    key = _to_compute(key)  # (..., kv_heads, kv_len, head_dim)
    groups = _groups(query.shape, key.shape)
    if groups > 1:  # grouped-query: (..., kv_heads, groups, q_len, head_dim)
        query = _group_heads(query, groups)
        key = key[..., None, :, :]  # (..., kv_heads, 1, kv_len, head_dim)
    scores = query @ np.swapaxes(key, -1, -2)  # (..., [kv_heads, groups,] q_len, kv_len)
    scores = scores.reshape(_merged(scores.shape, groups))  # (..., heads, q_len, kv_len)
    if softcap is not None:
        scores *= 1.0 / softcap
        np.tanh(scores, out=scores)
        scores *= softcap
    return scores


def _merged(shape: tuple[int, ...], groups: int) -> tuple[int, ...]:
    """Undo ``_group_heads``: ``(..., kv_heads, groups, T, S)`` → ``(..., heads, T, S)``."""
    if groups == 1:
        return shape
    return shape[:-4] + (shape[-4] * shape[-3],) + shape[-2:]


def _allowed(
    q_len: int,
    kv_len: int,
    mask: np.ndarray | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
) -> np.ndarray | None:
    """AND of the boolean mask, the causal rule and the window; None when all are absent."""
    offset = _checks.causal_offset(causal_alignment, q_len, kv_len)
    allowed = mask
    if is_causal or window is not None:
        distance = _positions(q_len, kv_len, offset)  # (q_len, kv_len): j - (i + offset)
        structural = np.ones((q_len, kv_len), dtype=bool)
        if is_causal:
            structural &= distance <= 0
        if window is not None:
            left, right = window
            if left is not None:
                structural &= distance >= -left
            if right is not None:
                structural &= distance <= right
        allowed = structural if allowed is None else allowed & structural
    return allowed


def _mask_scores(
    scores: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
) -> np.ndarray:
    if bias is not None:
        scores += bias.astype(scores.dtype, copy=False)  # (..., heads, q_len, kv_len)
    q_len, kv_len = scores.shape[-2:]
    allowed = _allowed(q_len, kv_len, mask, is_causal, causal_alignment, window)
    if allowed is not None:
        np.copyto(scores, NEG_INF, where=~allowed)
    return scores


def _softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in place; rows that are all ``-inf`` become exactly 0."""
    row_max = scores.max(axis=-1, keepdims=True, initial=NEG_INF)  # (..., q_len, 1)
    row_max[row_max == NEG_INF] = 0.0  # fully masked row: exp(-inf - 0) = 0, no NaN
    scores -= row_max
    np.exp(scores, out=scores)
    row_sum = scores.sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    row_sum[row_sum == 0.0] = 1.0  # 0 / 1 = 0 for fully masked rows
    scores /= row_sum
    return scores


def _dropout(
    weights: np.ndarray, dropout_p: float, dropout_mask: np.ndarray | None, rng: Any
) -> np.ndarray:
    if dropout_mask is None:
        rng = np.random.default_rng() if rng is None else rng
        dropout_mask = rng.random(weights.shape, dtype=np.float32) >= dropout_p
    return weights * dropout_mask * (1.0 / (1.0 - dropout_p))


def _output(weights: np.ndarray, value: np.ndarray) -> np.ndarray:
    value = _to_compute(value)  # (..., kv_heads, kv_len, v_dim)
    groups = _groups(weights.shape, value.shape)
    if groups > 1:
        weights = _group_heads(weights, groups)  # (..., kv_heads, groups, q_len, kv_len)
        value = value[..., None, :, :]  # (..., kv_heads, 1, kv_len, v_dim)
    output = weights.astype(value.dtype, copy=False) @ value
    return output.reshape(_merged(output.shape, groups))  # (..., heads, q_len, v_dim)


# ------------------------------------------------------------------------------------------
# Validation helpers
# ------------------------------------------------------------------------------------------


def _check_mask_bias(
    fn: str, mask: Any, bias: Any, target: tuple[int, ...]
) -> tuple[np.ndarray | None, np.ndarray | None]:
    if mask is not None:
        mask = np.asarray(mask)
        _checks.check_bool(fn, "mask", mask.dtype.name)
        _checks.check_broadcast(fn, "mask", mask.shape, target, "scores")
    if bias is not None:
        bias = np.asarray(bias)
        _checks.check_bias_dtype(fn, bias.dtype.name)
        _checks.check_broadcast(fn, "bias", bias.shape, target, "scores")
    return mask, bias


def _check_dropout_mask(fn: str, dropout_mask: Any, target: tuple[int, ...]) -> np.ndarray | None:
    if dropout_mask is None:
        return None
    dropout_mask = np.asarray(dropout_mask)
    _checks.check_bool(fn, "dropout_mask", dropout_mask.dtype.name)
    _checks.check_broadcast(fn, "dropout_mask", dropout_mask.shape, target, "weights")
    return dropout_mask


def _check_structure(
    fn: str, is_causal: bool, causal_alignment: str, window: Any
) -> tuple[int | None, int | None] | None:
    _checks.check_alignment(fn, causal_alignment)
    return None if window is None else _checks.check_window(fn, window)


def _check_scores_array(fn: str, name: str, x: Any) -> np.ndarray:
    x = np.asarray(x)
    _checks.check_float_inputs(fn, **{name: x.dtype.name})
    _checks.check_rank(fn, **{name: x.shape})
    return x


# ------------------------------------------------------------------------------------------
# Public steps
# ------------------------------------------------------------------------------------------


def attention_scores(
    query: Any, key: Any, *, scale: float | None = None, softcap: float | None = None
) -> np.ndarray:
    """Scaled, optionally soft-capped dot products: ``(query @ keyᵀ) · scale``.

    Args:
      query: ``(..., heads, q_len, head_dim)`` or ``(q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)`` or ``(kv_len, head_dim)``.
      scale: default ``head_dim ** -0.5``; ``1.0`` gives the article's unnormalised ω.
      softcap: positive cap: ``softcap · tanh(scores / softcap)``.

    Returns:
      ``(..., heads, q_len, kv_len)`` in the compute dtype.
    """
    fn = "attention_scores"
    query, key = np.asarray(query), np.asarray(key)
    _checks.check_float_inputs(fn, query=query.dtype.name, key=key.dtype.name)
    _checks.check_query_key(fn, query.shape, key.shape)
    scale = _checks.check_scale(fn, scale, query.shape[-1])
    softcap = _checks.check_softcap(fn, softcap)
    return _scores(query, key, scale, softcap)


def mask_scores(
    scores: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
) -> np.ndarray:
    """Add ``bias``, then set every disallowed position to ``-inf``.

    A position is allowed when ``mask`` is True there (True = may attend), the causal rule
    ``j <= i + offset`` holds (if ``is_causal``) and the window holds (if ``window``).

    Args:
      scores: ``(..., heads, q_len, kv_len)`` or ``(q_len, kv_len)``.
      mask: boolean, broadcastable to ``scores``.
      bias: floating point, broadcastable to ``scores``.
      is_causal: apply the causal rule.
      causal_alignment: ``"top_left"`` (offset 0) or ``"bottom_right"`` (``kv_len - q_len``).
      window: ``(left, right)``: ``i + offset - left <= j <= i + offset + right``.

    Returns:
      ``(..., heads, q_len, kv_len)`` in the compute dtype.
    """
    fn = "mask_scores"
    scores = _check_scores_array(fn, "scores", scores)
    mask, bias = _check_mask_bias(fn, mask, bias, scores.shape)
    window = _check_structure(fn, is_causal, causal_alignment, window)
    scores = scores.astype(_checks.compute_dtype(scores.dtype.name), copy=True)
    return _mask_scores(scores, mask, bias, is_causal, causal_alignment, window)


def attention_weights(scores: Any) -> np.ndarray:
    """Softmax over keys; a fully masked row (all ``-inf``) gives exactly 0.

    Args:
      scores: ``(..., q_len, kv_len)``.

    Returns:
      ``(..., q_len, kv_len)`` in the compute dtype; rows sum to 1 or are all 0.
    """
    fn = "attention_weights"
    scores = _check_scores_array(fn, "scores", scores)
    return _softmax(scores.astype(_checks.compute_dtype(scores.dtype.name), copy=True))


def apply_dropout(
    weights: Any, dropout_p: float, *, dropout_mask: Any = None, rng: Any = None
) -> np.ndarray:
    """Dropout of the weights: ``weights · keep / (1 - dropout_p)``.

    Args:
      weights: ``(..., q_len, kv_len)``.
      dropout_p: drop probability in ``[0, 1)``.
      dropout_mask: boolean keep-mask (True = keep), broadcastable to ``weights``.
      rng: ``numpy.random.Generator`` for the keep-mask when none is given
        (``None``: a fresh ``numpy.random.default_rng()``).

    Returns:
      ``(..., q_len, kv_len)``, same dtype as ``weights``.
    """
    fn = "apply_dropout"
    weights = _check_scores_array(fn, "weights", weights)
    dropout_p = _checks.check_dropout(fn, dropout_p, dropout_mask is not None)
    dropout_mask = _check_dropout_mask(fn, dropout_mask, weights.shape)
    if dropout_p == 0.0:
        return weights
    return _dropout(weights, dropout_p, dropout_mask, rng).astype(weights.dtype, copy=False)


def attention_output(weights: Any, value: Any) -> np.ndarray:
    """Weighted sum of values, ``weights @ value``, with the grouped-query head mapping.

    Args:
      weights: ``(..., heads, q_len, kv_len)`` or ``(q_len, kv_len)``.
      value: ``(..., kv_heads, kv_len, v_dim)`` or ``(kv_len, v_dim)``.

    Returns:
      ``(..., heads, q_len, v_dim)`` in the compute dtype.
    """
    fn = "attention_output"
    weights, value = np.asarray(weights), np.asarray(value)
    _checks.check_float_inputs(fn, weights=_checks.compute_dtype(weights.dtype.name),
                               value=_checks.compute_dtype(value.dtype.name))
    _checks.check_weights_value(fn, weights.shape, value.shape)
    return _output(_to_compute(weights), value)


def renormalized_causal_weights(weights: Any, *, causal_alignment: str = "top_left") -> np.ndarray:
    """The article's second causal method: zero the weights above the diagonal, renormalise.

    Equals masking the scores with ``-inf`` before the softmax wherever a row keeps a key;
    a row that keeps none gives 0 (not ``0 / 0``).

    Args:
      weights: ``(..., q_len, kv_len)`` softmax weights.
      causal_alignment: ``"top_left"`` or ``"bottom_right"``.

    Returns:
      ``(..., q_len, kv_len)``, same dtype as ``weights``.
    """
    fn = "renormalized_causal_weights"
    weights = _check_scores_array(fn, "weights", weights)
    _checks.check_alignment(fn, causal_alignment)
    q_len, kv_len = weights.shape[-2:]
    offset = _checks.causal_offset(causal_alignment, q_len, kv_len)
    masked = weights * (_positions(q_len, kv_len, offset) <= 0)  # (..., q_len, kv_len)
    row_sum = masked.sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    row_sum[row_sum == 0] = 1
    return masked / row_sum


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    dropout_mask: Any = None,
    rng: Any = None,
    return_weights: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Scaled dot-product attention: ``softmax(mask(q kᵀ · scale + bias)) @ v``.

    Args:
      query: ``(..., heads, q_len, head_dim)`` or ``(q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)`` or ``(kv_len, head_dim)``; ``heads`` must be
        a multiple of ``kv_heads`` (query head ``h`` uses kv head ``h // (heads // kv_heads)``).
      value: ``(..., kv_heads, kv_len, v_dim)`` or ``(kv_len, v_dim)``.
      mask: boolean, broadcastable to ``(..., heads, q_len, kv_len)``; True = may attend.
      bias: floating point, broadcastable to ``(..., heads, q_len, kv_len)``.
      is_causal: query ``i`` attends key ``j`` only if ``j <= i + offset``.
      causal_alignment: ``"top_left"`` (offset 0) or ``"bottom_right"`` (``kv_len - q_len``).
      window: ``(left, right)`` sliding window, aligned like the causal rule.
      scale: default ``head_dim ** -0.5``.
      softcap: ``softcap · tanh(scores / softcap)`` before the bias.
      dropout_p: dropout on the weights, in ``[0, 1)``.
      dropout_mask: boolean keep-mask broadcastable to the weights (True = keep).
      rng: ``numpy.random.Generator`` for dropout when no keep-mask is given.
      return_weights: also return the weights (before dropout).

    Returns:
      ``(..., heads, q_len, v_dim)`` in the input dtype, and with ``return_weights`` the
      weights ``(..., heads, q_len, kv_len)`` in the input dtype. Fully masked rows give 0.
    """
    fn = "scaled_dot_product_attention"
    query, key, value = np.asarray(query), np.asarray(key), np.asarray(value)
    dtype = _checks.check_float_inputs(
        fn, query=query.dtype.name, key=key.dtype.name, value=value.dtype.name
    )
    _checks.check_query_key(fn, query.shape, key.shape)
    _checks.check_key_value(fn, key.shape, value.shape)
    target = _checks.scores_shape(query.shape, key.shape)
    mask, bias = _check_mask_bias(fn, mask, bias, target)
    window = _check_structure(fn, is_causal, causal_alignment, window)
    scale = _checks.check_scale(fn, scale, query.shape[-1])
    softcap = _checks.check_softcap(fn, softcap)
    dropout_p = _checks.check_dropout(fn, dropout_p, dropout_mask is not None)
    dropout_mask = _check_dropout_mask(fn, dropout_mask, target)

    if _use_blocked_path(query.shape, key.shape, value.shape, dropout_p, return_weights):
        return _blocked_attention(
            query, key, value, mask, bias, is_causal, causal_alignment, window, scale, softcap
        ).astype(dtype, copy=False)  # large inputs: the same steps, blocked (see the docstring)

    scores = _scores(query, key, scale, softcap)  # (..., heads, q_len, kv_len)
    scores = _mask_scores(scores, mask, bias, is_causal, causal_alignment, window)
    weights = _softmax(scores)  # (..., heads, q_len, kv_len), in place
    kept = _dropout(weights, dropout_p, dropout_mask, rng) if dropout_p > 0 else weights
    output = _output(kept, value).astype(dtype, copy=False)  # (..., heads, q_len, v_dim)
    if return_weights:
        return output, weights.astype(dtype, copy=False)
    return output


# ------------------------------------------------------------------------------------------
# Fast path (private): the same pipeline, blocked over queries, on every core. See the module
# docstring for when it runs; the explicit steps above are the definition it must equal.
# ------------------------------------------------------------------------------------------

_BLOCK_Q = 128  # query rows per block: a float32 block of scores stays in the L2 cache
_BLOCKED_MIN_SCORES = 1 << 20  # below this many score entries the plain path is as fast
_BLOCKED_MIN_Q_LEN = 64  # few queries (decoding): one batched matmul in the plain path is faster
# The threads of the fast path, made on first use (so ``import numpy_attn`` starts none and does
# not import threadpoolctl): "controller" is threadpoolctl's controller of the BLAS libraries
# (None without threadpoolctl), "pool" a persistent ThreadPoolExecutor made for "pool_key"
# (process id, workers), and "lock" lets one call at a time use them.
_blocked_threads: dict[str, Any] = {"lock": threading.Lock()}


def _use_blocked_path(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    dropout_p: float,
    return_weights: bool,
) -> bool:
    """Whether ``scaled_dot_product_attention`` runs ``_blocked_attention`` (validated inputs)."""
    if return_weights or dropout_p > 0.0 or 0 in q_shape or 0 in k_shape or 0 in v_shape:
        return False
    scores = math.prod(q_shape[:-1]) * k_shape[-2]  # (..., heads, q_len) × kv_len
    return scores >= _BLOCKED_MIN_SCORES and q_shape[-2] >= _BLOCKED_MIN_Q_LEN


def _key_range(
    i0: int, i1: int, kv_len: int, offset: int, lo: int | None, hi: int | None
) -> tuple[int, int, int, int]:
    """Keys seen by query rows ``[i0, i1)`` when ``lo <= j - (i + offset) <= hi`` (None:
    unbounded): ``(k0, k1, a, b)`` with every allowed key in ``[k0, k1)`` and the columns
    ``[a, b)`` allowed for every row of the block (``a == b``: none is)."""
    k0 = 0 if lo is None else min(max(0, i0 + offset + lo), kv_len)
    k1 = kv_len if hi is None else max(min(kv_len, i1 - 1 + offset + hi + 1), 0)
    k1 = max(k1, k0)
    a = k0 if lo is None else min(max(k0, i1 - 1 + offset + lo), k1)
    b = k1 if hi is None else max(min(k1, i0 + offset + hi + 1), a)
    return k0, k1, a, b


def _blocked_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    scale: float,
    softcap: float | None,
) -> np.ndarray:
    """``scaled_dot_product_attention``'s output in the compute dtype, block by block."""
    compute = _checks.compute_dtype(query.dtype.name)
    query = np.multiply(query, scale, dtype=compute)  # (..., heads, q_len, head_dim), scaled
    key = np.ascontiguousarray(key, dtype=compute)  # (..., kv_heads, kv_len, head_dim)
    value = np.ascontiguousarray(value, dtype=compute)  # (..., kv_heads, kv_len, v_dim)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    target = _checks.scores_shape(query.shape, key.shape)  # (..., heads, q_len, kv_len)
    groups = _groups(query.shape, key.shape)
    output = np.empty(query.shape[:-1] + value.shape[-1:], dtype=compute)
    blocked = None if mask is None else np.broadcast_to(~mask, target)  # True = not allowed
    bias = None if bias is None else np.broadcast_to(bias.astype(compute, copy=False), target)
    offset = _checks.causal_offset(causal_alignment, q_len, kv_len)
    lo = hi = None  # lo <= j - (i + offset) <= hi
    if window is not None:
        lo = None if window[0] is None else -window[0]
        hi = window[1]
    if is_causal:
        hi = 0 if hi is None else min(hi, 0)

    tasks = []  # (batch-and-head index, query rows i0:i1, key range)
    for index in np.ndindex(query.shape[:-2]):
        for i0 in range(0, q_len, _BLOCK_Q):
            i1 = min(i0 + _BLOCK_Q, q_len)
            tasks.append((index, i0, i1, _key_range(i0, i1, kv_len, offset, lo, hi)))
    tasks.sort(key=lambda task: task[3][0] - task[3][1])  # longest key range first

    def block(index: tuple[int, ...], i0: int, i1: int, keys: tuple[int, int, int, int],
              buffer: np.ndarray) -> None:
        k0, k1, a, b = keys
        out = output[index][i0:i1]  # (rows, v_dim)
        if k1 == k0:  # no key allowed for any row: fully masked
            out[...] = 0.0
            return
        kv_index = index[:-1] + (index[-1] // groups,) if index else ()
        s = buffer[: (i1 - i0) * (k1 - k0)].reshape(i1 - i0, k1 - k0)  # (rows, keys)
        np.matmul(query[index][i0:i1], key[kv_index][k0:k1].T, out=s)
        if softcap is not None:
            s *= 1.0 / softcap
            np.tanh(s, out=s)
            s *= softcap
        if bias is not None:
            s += bias[index][i0:i1, k0:k1]
        for c0, c1 in ((k0, a), (b, k1)):  # strips where the causal rule / window bites
            if c1 > c0:
                distance = np.arange(c0, c1) - np.arange(i0 + offset, i1 + offset)[:, None]
                outside = np.zeros(distance.shape, dtype=bool)
                if lo is not None:
                    outside |= distance < lo
                if hi is not None:
                    outside |= distance > hi
                np.copyto(s[:, c0 - k0 : c1 - k0], NEG_INF, where=outside)
        if blocked is not None:
            np.copyto(s, NEG_INF, where=blocked[index][i0:i1, k0:k1])
        row_max = s.max(axis=-1, keepdims=True)  # (rows, 1)
        row_max[row_max == NEG_INF] = 0.0  # fully masked row: exp(-inf) = 0, no NaN
        s -= row_max
        np.exp(s, out=s)
        row_sum = s.sum(axis=-1, keepdims=True)  # (rows, 1)
        row_sum[row_sum == 0.0] = 1.0
        np.matmul(s, value[kv_index][k0:k1], out=out)
        out /= row_sum

    def work(queue: Any, lock: threading.Lock) -> None:
        buffer = np.empty(_BLOCK_Q * kv_len, dtype=compute)  # this worker's scores
        while True:
            with lock:
                task = next(queue, None)
            if task is None:
                return
            block(*task, buffer)

    queue, queue_lock = iter(tasks), threading.Lock()
    if not _blocked_threads["lock"].acquire(blocking=False):  # another thread is using the pool
        work(queue, queue_lock)
        return output
    try:
        if "controller" not in _blocked_threads:
            try:
                from threadpoolctl import ThreadpoolController  # optional: see the docstring
            except ImportError:
                controller = None
            else:  # scanning the loaded libraries takes milliseconds: do it once
                controller = ThreadpoolController().select(user_api="blas")
                controller = controller if controller.lib_controllers else None
            _blocked_threads["controller"] = controller
        controller, workers = _blocked_threads["controller"], 1
        if controller is not None:  # one worker per BLAS thread, at most one per usable core
            workers = max(lib.num_threads for lib in controller.lib_controllers)
            if hasattr(os, "sched_getaffinity"):
                workers = min(workers, len(os.sched_getaffinity(0)))
            workers = max(1, min(workers, len(tasks)))
        if workers == 1:
            work(queue, queue_lock)
            return output
        if _blocked_threads.get("pool_key") != (os.getpid(), workers):  # new, resized or forked
            from concurrent.futures import ThreadPoolExecutor

            old = _blocked_threads.get("pool")
            if old is not None and _blocked_threads["pool_key"][0] == os.getpid():
                old.shutdown(wait=False)  # resized: its idle threads exit
            _blocked_threads["pool"] = ThreadPoolExecutor(workers - 1, "numpy_attn")
            _blocked_threads["pool_key"] = (os.getpid(), workers)
        with controller.limit(limits=1):  # BLAS single-threaded while the blocks run in parallel
            pool = _blocked_threads["pool"]  # workers - 1 threads; the caller is the last worker
            futures = [pool.submit(work, queue, queue_lock) for _ in range(workers - 1)]
            try:
                work(queue, queue_lock)
            finally:
                for future in futures:
                    future.result()
    finally:
        _blocked_threads["lock"].release()
    return output
