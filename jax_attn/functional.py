"""Scaled dot-product attention, step by step, in JAX.

The pipeline (``conformance/spec.py``): scores → soft-cap → + bias → mask → softmax → dropout →
weighted sum of values. Every step is a public function, so every intermediate can be printed
and compared; ``scaled_dot_product_attention`` validates its inputs once and runs them all.

Every function works under ``jax.jit``, ``jax.vmap`` and ``jax.grad``/``jax.vjp``. Validation
runs at trace time on static shapes and dtypes, so the same bad input raises the same exception,
with the same message, as in numpy_attn. ``is_causal``, ``causal_alignment``, ``window``,
``scale``, ``softcap``, ``dropout_p`` and ``return_weights`` must be static (Python values; mark
them ``static_argnames`` when you jit a wrapper). Fully masked rows give weights and output
exactly 0, and their gradients are exactly 0 (never NaN).

Precision: float16 and bfloat16 are upcast to float32 before the matmuls (scores, softmax and
weighted sum in float32, as the spec says; this also sidesteps XLA:CPU builds that refuse half
matmuls accumulating in float32 — jax 0.10.2 accepts them, see docs/backend_differences.md) and
the result is cast back; float32 stays float32 (Python floats are weakly typed, nothing is
promoted); float64 stays float64 but needs ``jax.config.update("jax_enable_x64", True)``
(otherwise JAX turns float64 inputs into float32 on entry, as everywhere in JAX).

Matmul precision: every matmul of the explicit path passes ``precision=Precision.HIGHEST``,
whatever ``jax_default_matmul_precision`` says. The spec's float32 tolerances (2e-5 relative)
are tighter than TF32 or bf16-pass matmuls, which GPUs and TPUs use by default for float32;
on CPU HIGHEST costs nothing (XLA:CPU always computes full float32).

Fast path: without ``return_weights``, ``scaled_dot_product_attention`` calls
``jax.nn.dot_product_attention(..., implementation="cudnn")`` (flash attention) when
``_use_fast_path`` allows it: a GPU backend, float16/bfloat16 inputs, ``v_dim == head_dim``, no
``mask``, no ``bias``, no ``softcap``, no dropout, no empty axis, and a causal rule or window
only with ``q_len == kv_len`` (so both alignments agree) and a window only as ``(left, 0)`` or
with ``is_causal`` (what cuDNN supports). Under those conditions no row can be fully masked, so
jax.nn's semantics (which give ``mean(value)`` for a fully masked row) equal the spec's. In every
other case, on every other backend, and if cuDNN refuses the shapes, the explicit composition
below runs.

Blocked path (CPU): the explicit composition materialises the whole ``(..., heads, q_len,
kv_len)`` score array, and XLA:CPU then streams it through memory several times (max, exp, sum,
divide). For large inputs on the CPU backend, ``_use_blocked_path`` (no ``return_weights``, no
dropout, at least ``2 * _BLOCK_Q`` queries and ``_BLOCKED_MIN_SCORES`` score entries) selects
``_blocked_attention``: the same steps for ``_BLOCK_Q`` queries at a time under ``lax.map``, so a
block's scores stay in cache, with the division by the row sums moved after ``@ value``; with the
causal rule or a window the queries form at most ``_BLOCKED_SEGMENTS`` static segments, each
against only the keys it can see (fully masked work is skipped). It supports everything else
(mask, bias, softcap, grouped-query heads, both alignments, 2-D inputs), ``jit``, ``vmap`` and
``grad``, and equals the explicit path within float32 rounding
(``tests/test_performance_paths.py``). At 2048 tokens it is about 2.5 times as fast as
jax.nn's XLA implementation (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import _checks
from .masks import _dtype_name, _positions

NEG_INF = -jnp.inf
HIGHEST = jax.lax.Precision.HIGHEST

# Backends and implementation of the jax.nn fast path; tests patch these to force it on CPU.
_FAST_PATH_BACKENDS = ("gpu", "cuda")
_FAST_PATH_IMPLEMENTATION: str | None = "cudnn"


def _to_compute(x: jax.Array) -> jax.Array:
    """Half types up to float32; float32 and float64 unchanged (no copy)."""
    return x.astype(_checks.compute_dtype(x.dtype.name))


def _group_heads(x: jax.Array, groups: int) -> jax.Array:
    """``(..., heads, T, D)`` → ``(..., kv_heads, groups, T, D)``: query head ``h`` is
    ``(h // groups, h % groups)``, so it meets kv head ``h // groups``."""
    return x.reshape(x.shape[:-3] + (x.shape[-3] // groups, groups) + x.shape[-2:])


def _groups(x_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> int:
    return x_shape[-3] // kv_shape[-3] if len(x_shape) >= 3 else 1


# ------------------------------------------------------------------------------------------
# Unchecked steps: the public functions and scaled_dot_product_attention validate, then call
# these. JAX arrays are immutable: each step returns a new array and XLA fuses them under jit.
# ------------------------------------------------------------------------------------------


def _scores(query: jax.Array, key: jax.Array, scale: float, softcap: float | None) -> jax.Array:
    query = _to_compute(query) * scale  # (..., heads, q_len, head_dim); scaling q is cheapest
    key = _to_compute(key)  # (..., kv_heads, kv_len, head_dim)
    groups = _groups(query.shape, key.shape)
    if groups > 1:  # grouped-query: (..., kv_heads, groups, q_len, head_dim)
        query = _group_heads(query, groups)
        key = key[..., None, :, :]  # (..., kv_heads, 1, kv_len, head_dim)
    # matmul with the transposed key: XLA folds the transpose into the dot's dimension numbers
    scores = jnp.matmul(query, jnp.swapaxes(key, -1, -2), precision=HIGHEST)
    scores = scores.reshape(_merged(scores.shape, groups))  # (..., heads, q_len, kv_len)
    if softcap is not None:
        scores = jnp.tanh(scores * (1.0 / softcap)) * softcap  # no in-place ops in JAX
    return scores


def _merged(shape: tuple[int, ...], groups: int) -> tuple[int, ...]:
    """Undo ``_group_heads``: ``(..., kv_heads, groups, T, S)`` → ``(..., heads, T, S)``."""
    if groups == 1:
        return shape
    return shape[:-4] + (shape[-4] * shape[-3],) + shape[-2:]


def _allowed(
    q_len: int,
    kv_len: int,
    mask: jax.Array | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
) -> jax.Array | None:
    """AND of the boolean mask, the causal rule and the window; None when all are absent."""
    offset = _checks.causal_offset(causal_alignment, q_len, kv_len)
    allowed = mask
    if is_causal or window is not None:
        distance = _positions(q_len, kv_len, offset)  # (q_len, kv_len): j - (i + offset)
        structural = jnp.ones((q_len, kv_len), dtype=bool)
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
    scores: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
) -> jax.Array:
    if bias is not None:
        scores = scores + bias.astype(scores.dtype)  # (..., heads, q_len, kv_len)
    q_len, kv_len = scores.shape[-2:]
    allowed = _allowed(q_len, kv_len, mask, is_causal, causal_alignment, window)
    if allowed is not None:
        # where, not scores + log(mask): the gradient at a masked position is exactly 0
        scores = jnp.where(allowed, scores, NEG_INF)
    return scores


def _softmax(scores: jax.Array) -> jax.Array:
    """Softmax over the last axis; rows that are all ``-inf`` become exactly 0."""
    row_max = scores.max(axis=-1, keepdims=True, initial=NEG_INF)  # (..., q_len, 1)
    # softmax is shift-invariant, so stop_gradient is exact and keeps max's VJP out of the graph
    row_max = jax.lax.stop_gradient(row_max)
    row_max = jnp.where(row_max == NEG_INF, 0.0, row_max)  # fully masked: exp(-inf - 0) = 0
    scores = jnp.exp(scores - row_max)
    row_sum = scores.sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    row_sum = jnp.where(row_sum == 0.0, 1.0, row_sum)  # 0 / 1 = 0 for fully masked rows
    return scores / row_sum


def _dropout(
    weights: jax.Array, dropout_p: float, dropout_mask: jax.Array | None, rng: Any
) -> jax.Array:
    if dropout_mask is None:
        # an explicit jax.random key (checked by _check_rng), never hidden global state
        dropout_mask = jax.random.uniform(rng, weights.shape, dtype=jnp.float32) >= dropout_p
    return weights * dropout_mask * (1.0 / (1.0 - dropout_p))


def _output(weights: jax.Array, value: jax.Array) -> jax.Array:
    value = _to_compute(value)  # (..., kv_heads, kv_len, v_dim)
    groups = _groups(weights.shape, value.shape)
    if groups > 1:
        weights = _group_heads(weights, groups)  # (..., kv_heads, groups, q_len, kv_len)
        value = value[..., None, :, :]  # (..., kv_heads, 1, kv_len, v_dim)
    output = jnp.matmul(weights.astype(value.dtype), value, precision=HIGHEST)  # explicit
    return output.reshape(_merged(output.shape, groups))  # (..., heads, q_len, v_dim)


# ------------------------------------------------------------------------------------------
# Fast path: jax.nn.dot_product_attention where its semantics equal the spec's (GPU only)
# ------------------------------------------------------------------------------------------


def _use_fast_path(
    dtype: str,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    *,
    has_mask: bool,
    has_bias: bool,
    is_causal: bool,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    dropout_p: float,
    return_weights: bool,
    backend: str | None = None,
) -> bool:
    """Whether ``jax.nn.dot_product_attention`` computes exactly the spec's result here.

    Static arguments only (validated dtype name, shapes and options); ``backend`` defaults to
    ``jax.default_backend()``.
    """
    backend = jax.default_backend() if backend is None else backend
    if backend not in _FAST_PATH_BACKENDS or dtype not in _checks.HALF_DTYPES:
        return False  # CPU: the explicit path is faster; float32/64: cuDNN is half-only
    if has_mask or has_bias or softcap is not None or dropout_p > 0 or return_weights:
        return False  # a mask or bias could empty a row; jax.nn has no softcap/dropout/weights
    if v_shape[-1] != q_shape[-1] or 0 in q_shape or 0 in k_shape:
        return False  # jax.nn needs v_dim == head_dim; empty axes are not worth a kernel
    q_len, kv_len = q_shape[-2], k_shape[-2]
    if (is_causal or window is not None) and q_len != kv_len:
        return False  # alignment: cuDNN's causal mask is top-left only
    if window is not None and not is_causal and window[1] != 0:
        return False  # cuDNN windows look left only: (left, 0), or any window with is_causal
    return True


def _fast_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    scale: float,
    is_causal: bool,
    window: tuple[int | None, int | None] | None,
    implementation: str | None,
) -> jax.Array:
    """``jax.nn.dot_product_attention`` in this project's layout, ``(..., heads, seq, dim)``."""

    def to_btnh(x: jax.Array) -> jax.Array:  # (..., heads, seq, dim) → (batch, seq, heads, dim)
        x = x.reshape((-1,) + x.shape[-3:]) if x.ndim >= 3 else x[None, None]
        return jnp.swapaxes(x, 1, 2)

    local_window_size = None
    if window is not None:  # eligible windows are (left, 0) or causal: causal plus a left bound
        is_causal = True
        local_window_size = None if window[0] is None else (window[0], 0)
    output = jax.nn.dot_product_attention(
        to_btnh(query), to_btnh(key), to_btnh(value), scale=scale, is_causal=is_causal,
        local_window_size=local_window_size, implementation=implementation,
    )  # (batch, q_len, heads, v_dim)
    return jnp.swapaxes(output, 1, 2).reshape(query.shape[:-1] + (value.shape[-1],))


# ------------------------------------------------------------------------------------------
# Blocked path (private): the same pipeline over blocks of queries, for large inputs on CPU
# ------------------------------------------------------------------------------------------

_BLOCK_Q = 128  # query rows per lax.map step: the block's scores stay in the CPU caches
_BLOCKED_SEGMENTS = 4  # causal rule / window: static key ranges (more: slower compile, no faster)
_BLOCKED_MIN_SCORES = 1 << 20  # below this many score entries the explicit path is as fast
_BLOCKED_BACKENDS = ("cpu",)


def _use_blocked_path(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    dropout_p: float,
    return_weights: bool,
    backend: str | None = None,
) -> bool:
    """Whether ``scaled_dot_product_attention`` runs ``_blocked_attention`` (static arguments)."""
    backend = jax.default_backend() if backend is None else backend
    if backend not in _BLOCKED_BACKENDS or return_weights or dropout_p > 0.0:
        return False
    if 0 in q_shape or 0 in k_shape or 0 in v_shape or q_shape[-2] < 2 * _BLOCK_Q:
        return False
    scores = 1
    for n in q_shape[:-1]:  # (..., heads, q_len) × kv_len
        scores *= n
    return scores * k_shape[-2] >= _BLOCKED_MIN_SCORES


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
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    scale: float,
    softcap: float | None,
) -> jax.Array:
    """``scaled_dot_product_attention``'s output in the compute dtype, ``_BLOCK_Q`` queries at a
    time under ``lax.map`` (XLA keeps a block's scores in cache and spreads each op over the
    cores), normalising after ``@ value``. With the causal rule or a window the queries are cut
    into at most ``_BLOCKED_SEGMENTS`` static segments, each against only the keys it can see."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    offset = _checks.causal_offset(causal_alignment, q_len, kv_len)
    lo = hi = None  # allowed: lo <= j - (i + offset) <= hi
    if window is not None:
        lo = None if window[0] is None else -window[0]
        hi = window[1]
    if is_causal:
        hi = 0 if hi is None else min(hi, 0)
    if bias is not None:
        bias = bias.astype(_checks.compute_dtype(query.dtype.name))

    def rows(x: jax.Array | None, i0: Any, n: int) -> jax.Array | None:
        """Rows ``i0 : i0 + n`` of a mask or bias whose query axis is not broadcast."""
        if x is None or x.ndim < 2 or x.shape[-2] == 1:
            return x
        return jax.lax.dynamic_slice_in_dim(x, i0, n, axis=-2)

    def cols(x: jax.Array | None, k0: int, k1: int) -> jax.Array | None:
        if x is None or x.shape[-1] == 1:
            return x
        return x[..., k0:k1]

    def block(q_blk, i0, k0, k_seg, v_seg, mask_seg, bias_seg):  # (..., heads, n, head_dim)
        n, kw = q_blk.shape[-2], k_seg.shape[-2]
        scores = _scores(q_blk, k_seg, scale, softcap)  # (..., heads, n, kw)
        if bias_seg is not None:
            scores = scores + rows(bias_seg, i0, n)
        allowed = rows(mask_seg, i0, n)
        if lo is not None or hi is not None:  # j - (i + offset), with global positions
            distance = (k0 + jnp.arange(kw, dtype=jnp.int32))[None, :] - (
                i0 + offset + jnp.arange(n, dtype=jnp.int32)
            )[:, None]
            structural = jnp.ones((n, kw), dtype=bool)
            if lo is not None:
                structural &= distance >= lo
            if hi is not None:
                structural &= distance <= hi
            allowed = structural if allowed is None else allowed & structural
        if allowed is not None:
            scores = jnp.where(allowed, scores, NEG_INF)
        row_max = jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True, initial=NEG_INF))
        row_max = jnp.where(row_max == NEG_INF, 0.0, row_max)  # fully masked: exp(-inf) = 0
        unnormalised = jnp.exp(scores - row_max)
        row_sum = unnormalised.sum(axis=-1, keepdims=True)  # (..., heads, n, 1)
        row_sum = jnp.where(row_sum == 0.0, 1.0, row_sum)
        return _output(unnormalised, v_seg) / row_sum  # (..., heads, n, v_dim)

    n_blocks = q_len // _BLOCK_Q
    segments = 1 if lo is None and hi is None else min(_BLOCKED_SEGMENTS, n_blocks)
    bounds = [n_blocks * s // segments * _BLOCK_Q for s in range(segments)] + [q_len]
    outputs = []
    for r0, r1 in zip(bounds[:-1], bounds[1:], strict=True):  # static segments of query rows
        k0, k1, _, _ = _key_range(r0, r1, kv_len, offset, lo, hi)
        shape = query.shape[:-2] + (r1 - r0, value.shape[-1])
        if k1 == k0:  # no row of the segment sees a key: fully masked
            outputs.append(jnp.zeros(shape, _checks.compute_dtype(query.dtype.name)))
            continue
        segment = (k0, key[..., k0:k1, :], value[..., k0:k1, :],
                   cols(mask, k0, k1), cols(bias, k0, k1))
        full = (r1 - r0) // _BLOCK_Q * _BLOCK_Q  # rows in whole blocks; the rest is one block
        q_seg = query[..., r0 : r0 + full, :]
        q_seg = q_seg.reshape(q_seg.shape[:-2] + (-1, _BLOCK_Q, q_seg.shape[-1]))
        starts = r0 + _BLOCK_Q * jnp.arange(full // _BLOCK_Q, dtype=jnp.int32)
        out = jax.lax.map(
            lambda xs, segment=segment: block(xs[0], xs[1], *segment),
            (jnp.moveaxis(q_seg, -3, 0), starts),
        )  # (blocks, ..., heads, _BLOCK_Q, v_dim)
        outputs.append(jnp.moveaxis(out, 0, -3).reshape(shape[:-2] + (full, shape[-1])))
        if r0 + full < r1:
            outputs.append(block(query[..., r0 + full : r1, :], r0 + full, *segment))
    return jnp.concatenate(outputs, axis=-2)  # (..., heads, q_len, v_dim)


# ------------------------------------------------------------------------------------------
# Validation helpers
# ------------------------------------------------------------------------------------------


def _check_mask_bias(
    fn: str, mask: Any, bias: Any, target: tuple[int, ...]
) -> tuple[jax.Array | None, jax.Array | None]:
    if mask is not None:
        _checks.check_bool(fn, "mask", _dtype_name(mask))  # dtype as given, then convert
        mask = jnp.asarray(mask)
        _checks.check_broadcast(fn, "mask", mask.shape, target, "scores")
    if bias is not None:
        _checks.check_bias_dtype(fn, _dtype_name(bias))
        bias = jnp.asarray(bias)
        _checks.check_broadcast(fn, "bias", bias.shape, target, "scores")
    return mask, bias


def _check_dropout_mask(fn: str, dropout_mask: Any, target: tuple[int, ...]) -> jax.Array | None:
    if dropout_mask is None:
        return None
    _checks.check_bool(fn, "dropout_mask", _dtype_name(dropout_mask))
    dropout_mask = jnp.asarray(dropout_mask)
    _checks.check_broadcast(fn, "dropout_mask", dropout_mask.shape, target, "weights")
    return dropout_mask


def _check_rng(fn: str, dropout_p: float, dropout_mask: Any, rng: Any) -> None:
    # JAX has no global random state: dropout without a keep-mask needs an explicit key.
    if dropout_p > 0 and dropout_mask is None and rng is None:
        raise ValueError(
            f"{fn}: dropout_p > 0 needs rng, a jax.random key such as jax.random.key(0), "
            f"or a dropout_mask; got rng=None"
        )


def _check_structure(
    fn: str, is_causal: bool, causal_alignment: str, window: Any
) -> tuple[int | None, int | None] | None:
    _checks.check_alignment(fn, causal_alignment)
    return None if window is None else _checks.check_window(fn, window)


def _check_scores_array(fn: str, name: str, x: Any) -> jax.Array:
    _checks.check_float_inputs(fn, **{name: _dtype_name(x)})
    x = jnp.asarray(x)
    _checks.check_rank(fn, **{name: x.shape})
    return x


# ------------------------------------------------------------------------------------------
# Public steps
# ------------------------------------------------------------------------------------------


def attention_scores(
    query: Any, key: Any, *, scale: float | None = None, softcap: float | None = None
) -> jax.Array:
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
    _checks.check_float_inputs(fn, query=_dtype_name(query), key=_dtype_name(key))
    query, key = jnp.asarray(query), jnp.asarray(key)
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
) -> jax.Array:
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
    scores = _to_compute(scores)  # immutable: no defensive copy needed
    return _mask_scores(scores, mask, bias, is_causal, causal_alignment, window)


def attention_weights(scores: Any) -> jax.Array:
    """Softmax over keys; a fully masked row (all ``-inf``) gives exactly 0.

    Args:
      scores: ``(..., q_len, kv_len)``.

    Returns:
      ``(..., q_len, kv_len)`` in the compute dtype; rows sum to 1 or are all 0.
    """
    fn = "attention_weights"
    scores = _check_scores_array(fn, "scores", scores)
    return _softmax(_to_compute(scores))  # immutable: no defensive copy needed


def apply_dropout(
    weights: Any, dropout_p: float, *, dropout_mask: Any = None, rng: Any = None
) -> jax.Array:
    """Dropout of the weights: ``weights · keep / (1 - dropout_p)``.

    Args:
      weights: ``(..., q_len, kv_len)``.
      dropout_p: drop probability in ``[0, 1)`` (static).
      dropout_mask: boolean keep-mask (True = keep), broadcastable to ``weights``.
      rng: a ``jax.random`` key for the keep-mask; required when ``dropout_p > 0`` and no
        ``dropout_mask`` is given (ValueError otherwise).

    Returns:
      ``(..., q_len, kv_len)``, same dtype as ``weights``.
    """
    fn = "apply_dropout"
    weights = _check_scores_array(fn, "weights", weights)
    dropout_p = _checks.check_dropout(fn, dropout_p, dropout_mask is not None)
    dropout_mask = _check_dropout_mask(fn, dropout_mask, weights.shape)
    _check_rng(fn, dropout_p, dropout_mask, rng)  # JAX only: no global random state
    if dropout_p == 0.0:
        return weights
    return _dropout(weights, dropout_p, dropout_mask, rng).astype(weights.dtype)


def attention_output(weights: Any, value: Any) -> jax.Array:
    """Weighted sum of values, ``weights @ value``, with the grouped-query head mapping.

    Args:
      weights: ``(..., heads, q_len, kv_len)`` or ``(q_len, kv_len)``.
      value: ``(..., kv_heads, kv_len, v_dim)`` or ``(kv_len, v_dim)``.

    Returns:
      ``(..., heads, q_len, v_dim)`` in the compute dtype.
    """
    fn = "attention_output"
    _checks.check_float_inputs(fn, weights=_checks.compute_dtype(_dtype_name(weights)),
                               value=_checks.compute_dtype(_dtype_name(value)))
    weights, value = jnp.asarray(weights), jnp.asarray(value)
    _checks.check_weights_value(fn, weights.shape, value.shape)
    return _output(_to_compute(weights), value)


def renormalized_causal_weights(weights: Any, *, causal_alignment: str = "top_left") -> jax.Array:
    """The article's second causal method: zero the weights above the diagonal, renormalise.

    Equals masking the scores with ``-inf`` before the softmax wherever a row keeps a key;
    a row that keeps none gives 0 (not ``0 / 0``), with a zero gradient.

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
    row_sum = jnp.where(row_sum == 0, 1, row_sum)  # functional update; where keeps grads finite
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
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention: ``softmax(mask(q kᵀ · scale + bias)) @ v``.

    Args:
      query: ``(..., heads, q_len, head_dim)`` or ``(q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)`` or ``(kv_len, head_dim)``; ``heads`` must be
        a multiple of ``kv_heads`` (query head ``h`` uses kv head ``h // (heads // kv_heads)``).
      value: ``(..., kv_heads, kv_len, v_dim)`` or ``(kv_len, v_dim)``.
      mask: boolean, broadcastable to ``(..., heads, q_len, kv_len)``; True = may attend.
      bias: floating point, broadcastable to ``(..., heads, q_len, kv_len)``.
      is_causal: query ``i`` attends key ``j`` only if ``j <= i + offset`` (static).
      causal_alignment: ``"top_left"`` (offset 0) or ``"bottom_right"`` (``kv_len - q_len``).
      window: ``(left, right)`` sliding window, aligned like the causal rule (static).
      scale: default ``head_dim ** -0.5`` (static).
      softcap: ``softcap · tanh(scores / softcap)`` before the bias (static).
      dropout_p: dropout on the weights, in ``[0, 1)`` (static).
      dropout_mask: boolean keep-mask broadcastable to the weights (True = keep).
      rng: a ``jax.random`` key for dropout; required when ``dropout_p > 0`` and no
        ``dropout_mask`` is given.
      return_weights: also return the weights (before dropout) (static).

    Returns:
      ``(..., heads, q_len, v_dim)`` in the input dtype, and with ``return_weights`` the
      weights ``(..., heads, q_len, kv_len)`` in the input dtype. Fully masked rows give 0.
      On a GPU, half inputs may take the cuDNN fast path (see the module docstring).
    """
    fn = "scaled_dot_product_attention"
    _checks.check_float_inputs(
        fn, query=_dtype_name(query), key=_dtype_name(key), value=_dtype_name(value)
    )
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    dtype = query.dtype  # after JAX's canonicalisation: float64 is float32 without x64
    _checks.check_query_key(fn, query.shape, key.shape)
    _checks.check_key_value(fn, key.shape, value.shape)
    target = _checks.scores_shape(query.shape, key.shape)
    mask, bias = _check_mask_bias(fn, mask, bias, target)
    window = _check_structure(fn, is_causal, causal_alignment, window)
    scale = _checks.check_scale(fn, scale, query.shape[-1])
    softcap = _checks.check_softcap(fn, softcap)
    dropout_p = _checks.check_dropout(fn, dropout_p, dropout_mask is not None)
    dropout_mask = _check_dropout_mask(fn, dropout_mask, target)
    _check_rng(fn, dropout_p, dropout_mask, rng)  # JAX only: no global random state

    if _use_fast_path(
        dtype.name, query.shape, key.shape, value.shape, has_mask=mask is not None,
        has_bias=bias is not None, is_causal=is_causal, window=window, softcap=softcap,
        dropout_p=dropout_p, return_weights=return_weights,
    ):
        try:  # cuDNN checks its shapes at trace time; anything it refuses takes the explicit path
            return _fast_attention(
                query, key, value, scale, is_causal, window, _FAST_PATH_IMPLEMENTATION
            ).astype(dtype)
        except (ValueError, NotImplementedError, RuntimeError):
            pass

    if _use_blocked_path(query.shape, key.shape, value.shape, dropout_p, return_weights):
        return _blocked_attention(
            query, key, value, mask, bias, is_causal, causal_alignment, window, scale, softcap
        ).astype(dtype)  # large inputs on CPU: the same steps per block of queries

    scores = _scores(query, key, scale, softcap)  # (..., heads, q_len, kv_len)
    scores = _mask_scores(scores, mask, bias, is_causal, causal_alignment, window)
    weights = _softmax(scores)  # (..., heads, q_len, kv_len)
    kept = _dropout(weights, dropout_p, dropout_mask, rng) if dropout_p > 0 else weights
    output = _output(kept, value).astype(dtype)  # (..., heads, q_len, v_dim)
    if return_weights:
        return output, weights.astype(dtype)
    return output
