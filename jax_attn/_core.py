"""The unchecked pipeline steps and the array/head helpers that every file of jax_attn shares.

The steps (scores, soft-cap, mask, softmax, dropout, weighted sum) take arrays that the public
functions have already validated; the gradient helpers serve the hand-written backward passes
(``blockwise.py``, the blocked fast path); the array helpers describe inputs for the rules, map
query heads onto kv heads and place arrays on devices. Imports run one way: ``_core <
blockwise < _fast < functional < backward < modules`` (``context_parallel`` and
``integrations`` above); nothing here validates (the public functions in ``functional.py`` do,
with ``attention_rules``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules

NEG_INF = -jnp.inf
HIGHEST = jax.lax.Precision.HIGHEST


# ------------------------------------------------------------------------------------------
# The steps, unchecked: each returns a fresh array (JAX arrays are immutable; XLA fuses
# the steps under jit). The public functions validate, then call these.
# ------------------------------------------------------------------------------------------


def _scores(query: jax.Array, key: jax.Array, scale: float, softcap: float | None) -> jax.Array:
    query = _to_compute(query) * scale  # (..., heads, q_len, head_dim); scaling q is cheapest
    key = _to_compute(key)  # (..., kv_heads, kv_len, head_dim)
    groups = _groups(query.shape, key.shape)
    if groups > 1:  # grouped-query: (..., kv_heads, groups, q_len, head_dim)
        query = _group_heads(query, groups)
        key = key[..., None, :, :]  # (..., kv_heads, 1, kv_len, head_dim)
    # matmul with the transposed key: XLA folds the transpose into the dot's dimension numbers
    scores = jnp.matmul(query, jnp.swapaxes(key, -1, -2), precision=HIGHEST)  # (..., q, kv)
    scores = scores.reshape(_merged(scores.shape, groups))  # (..., heads, q_len, kv_len)
    return _softcap(scores, softcap)


def _softcap(scores: jax.Array, softcap: float | None) -> jax.Array:
    """``softcap · tanh(scores / softcap)``; unchanged for None."""
    if softcap is not None:
        scores = jnp.tanh(scores * (1.0 / softcap)) * softcap  # no in-place ops in JAX
    return scores


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
        # replaced, not added: a NaN score at a masked position does not spread; and where,
        # not scores + log(mask): the gradient at a masked position is exactly 0
        scores = jnp.where(allowed, scores, NEG_INF)
    return scores


def _allowed(
    q_len: int,
    kv_len: int,
    mask: jax.Array | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
) -> jax.Array | None:
    """AND of the boolean mask, the causal rule and the window; None when all are absent."""
    allowed = mask
    if is_causal or window is not None:
        lo, hi = rules.band(q_len, kv_len, is_causal, causal_alignment, window)
        structural = _in_band(0, q_len, 0, kv_len, lo, hi)  # (q_len, kv_len)
        allowed = structural if allowed is None else allowed & structural
    return allowed


def _in_band(q_start: int, rows: int, kv_start: int, keys: int, lo: float, hi: float) -> jax.Array:
    """``(rows, keys)`` bool: ``lo <= j - i <= hi`` for queries ``i`` from ``q_start`` and keys
    ``j`` from ``kv_start`` (``rules.band``: the causal rule and the window; ±inf unbounded)."""
    distance = (kv_start + jnp.arange(keys, dtype=jnp.int32))[None, :] - (
        q_start + jnp.arange(rows, dtype=jnp.int32))[:, None]  # jax: starts may be traced
    return (distance >= lo) & (distance <= hi)  # (rows, keys)


def _softmax(scores: jax.Array) -> jax.Array:
    """Softmax over the last axis; rows that are all ``-inf`` become exactly 0."""
    weights, row_sum = _unnormalised_softmax(scores)  # (..., q_len, kv_len), (..., q_len, 1)
    return weights / row_sum


def _unnormalised_softmax(scores: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``exp(scores - row max)`` and its row sums ``(..., q_len, 1)``; a row that is all
    ``-inf`` gives 0 and a row sum of 1, so dividing by it gives 0, never NaN."""
    row_max = scores.max(axis=-1, keepdims=True, initial=NEG_INF)  # (..., q_len, 1)
    # softmax is shift-invariant, so stop_gradient is exact and keeps max's VJP out of the graph
    row_max = jax.lax.stop_gradient(row_max)
    row_max = jnp.where(row_max == NEG_INF, 0.0, row_max)  # fully masked: exp(-inf - 0) = 0
    scores = jnp.exp(scores - row_max)
    row_sum = scores.sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    row_sum = jnp.where(row_sum == 0.0, 1.0, row_sum)  # 0 / 1 = 0 for fully masked rows
    return scores, row_sum


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


def _softmax_lse(scores: jax.Array, sinks: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Softmax over the last axis and each row's log-sum-exp ``(..., q_len)``: ``scores
    (..., heads, q_len, kv_len)``; ``sinks (heads,)`` (or None) join every row's denominator
    as a column without a value (``spec.SINKS``). A row that is all ``-inf`` gives weights 0
    and, without a sink, lse ``-inf``; its gradients are 0, never NaN."""
    row_max = scores.max(axis=-1, keepdims=True, initial=NEG_INF)  # (..., q_len, 1)
    if sinks is not None:  # the shift covers the sink too: exp(sink - max) <= 1
        sink = _sink_column(sinks, scores.ndim, scores.dtype)  # (heads, 1, 1)
        row_max = jnp.maximum(row_max, sink)
    # shift-invariant (weights and lse alike): stop_gradient is exact
    row_max = jax.lax.stop_gradient(row_max)
    row_max = jnp.where(row_max == NEG_INF, 0.0, row_max)  # fully masked: exp(-inf - 0) = 0
    weights = jnp.exp(scores - row_max)
    row_sum = weights.sum(axis=-1, keepdims=True)  # (..., q_len, 1)
    if sinks is not None:
        row_sum = row_sum + jnp.exp(sink - row_max)
    empty = row_sum == 0.0  # no key, no sink
    safe_sum = jnp.where(empty, 1.0, row_sum)  # where, not log(0): gradients stay finite
    lse = jnp.where(empty, NEG_INF, row_max + jnp.log(safe_sum))[..., 0]  # (..., q_len)
    return weights / safe_sum, lse


def _sink_column(sinks: jax.Array, ndim: int, dtype: Any) -> jax.Array:
    """``(heads,)`` sink logits against rows ``(..., heads, q_len, 1)`` of rank ``ndim``:
    ``(heads, 1, 1)``, or ``(1, 1)`` for inputs without a heads axis, in ``dtype``."""
    sinks = sinks.astype(dtype)
    return sinks.reshape(sinks.shape + (1, 1)) if ndim >= 3 else sinks.reshape(1, 1)


def _merge_attention(
    outputs: tuple[jax.Array, ...], lses: tuple[jax.Array, ...], sinks: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Partial results over disjoint key sets of the same rows, each an output
    ``(..., rows, v_dim)`` and its log-sum-exp ``(..., rows, 1)`` (``-inf``: no key), merged
    into the attention over every key set and its log-sum-exp (``spec.MERGING``; the online
    softmax's step). ``sinks (heads,)`` join the denominator once: a part whose output is 0.
    Differentiable: a part with lse ``-inf`` gets gradient 0."""
    lses = list(lses)
    if sinks is not None:
        lses.append(_sink_column(sinks, outputs[0].ndim, lses[0].dtype))
    row_max = jax.lax.stop_gradient(functools.reduce(jnp.maximum, lses))  # (..., rows, 1)
    shift = jnp.where(row_max == NEG_INF, 0.0, row_max)  # no -inf - -inf
    scales = [jnp.exp(lse - shift) for lse in lses]  # exp(lse_i - max) <= 1; 0 for no key
    total = functools.reduce(jnp.add, scales)
    empty = total == 0.0  # no key in any part
    safe_total = jnp.where(empty, 1.0, total)
    lse = jnp.where(empty, NEG_INF, shift + jnp.log(safe_total))
    output = functools.reduce(jnp.add, [a * out for a, out in zip(scales, outputs, strict=False)])
    return output / safe_total, lse


def _merge_partials(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Two partial results over different keys of the same rows (``_merge_attention`` of two
    parts, the ring's and the causal pieces' step): outputs ``(..., rows, v_dim)``, lses
    ``(..., rows, 1)`` (``-inf``: no key)."""
    return _merge_attention((out_a, out_b), (lse_a, lse_b), None)


def _with_sinks(
    output: jax.Array, lse: jax.Array, sinks: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Rows finished over their keys by the online softmax, ``output (..., rows, v_dim)`` and
    ``lse (..., rows, 1)`` (``+inf`` for a row without a key, the tiles' convention), in the
    spec's terms: the sinks joined (``_merge_attention``) and ``-inf`` for a row without a key
    nor a sink."""
    lse = jnp.where(lse == jnp.inf, NEG_INF, lse)
    if sinks is None:
        return output, lse
    return _merge_attention((output,), (lse,), sinks)


def _sinks_grad(sinks: jax.Array, lse: jax.Array, row_dot: jax.Array) -> jax.Array:
    """``d sinks (heads,)`` in ``lse``'s dtype: ``-sum p_sink · row_dot`` over every axis but
    the heads, ``p_sink = exp(sink - lse)`` (0 where lse is ``±inf``: a row with no key nor
    sink); ``lse`` and ``row_dot = rowsum(dO ⊙ O) - dlse`` are ``(..., heads, rows, 1)`` (the
    blocked path's hand-written VJP)."""
    sink = _sink_column(sinks, lse.ndim, lse.dtype)
    p_sink = jnp.where(jnp.isinf(lse), 0.0, jnp.exp(sink - lse))  # (..., heads, rows, 1)
    terms = -p_sink * row_dot
    if lse.ndim < 3:  # no heads axis: one sink
        return terms.sum().reshape(1)
    return terms.sum(axis=tuple(a for a in range(terms.ndim) if a != terms.ndim - 3))


def _describe_parts(fn: str, name: str, parts: Any) -> list[rules.ArrayInfo]:
    """``merge_attention``'s partial results as the rules see them: a list or tuple of arrays,
    ``name[i]`` each."""
    rules.check_parts(fn, name, parts)
    return [_describe(fn, f"{name}[{i}]", x) for i, x in enumerate(parts)]


# ------------------------------------------------------------------------------------------
# Gradients: grouped heads and broadcast inputs
# ------------------------------------------------------------------------------------------


def _matmul_grouped(a: jax.Array, b: jax.Array, groups: int) -> jax.Array:
    """``a (..., heads, T, S) @ b (..., kv_heads, S, D)`` with the grouped-query head mapping."""
    if groups == 1:
        return jnp.matmul(a, b, precision=HIGHEST)
    product = jnp.matmul(_group_heads(a, groups), b[..., None, :, :], precision=HIGHEST)
    return product.reshape(a.shape[:-1] + (b.shape[-1],))  # (..., heads, T, D)


def _sum_groups(x: jax.Array, groups: int) -> jax.Array:
    """``(..., heads, T, D)`` → ``(..., kv_heads, T, D)``: add the query heads sharing a kv head."""
    if groups == 1:
        return x
    return _group_heads(x, groups).sum(axis=-3)


def _sum_to_shape(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sum ``x`` over the axes along which an array of ``shape`` was broadcast to ``x.shape``."""
    leading = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(leading))) if leading else x
    stretched = tuple(axis for axis, size in enumerate(shape) if size == 1 and x.shape[axis] != 1)
    return x.sum(axis=stretched, keepdims=True) if stretched else x



# ------------------------------------------------------------------------------------------
# Arrays, dtypes, heads and devices
# ------------------------------------------------------------------------------------------


def _describe(fn: str, name: str, x: Any) -> rules.ArrayInfo | None:
    """What the rules see of an input: ``(shape, dtype name)``; None for None. A Python list,
    tuple or scalar is refused (TypeError): it has no dtype of its own."""
    if x is None:
        return None
    rules.check_array(fn, name, x)
    return tuple(np.shape(x)), _dtype_name(x)  # jax: the dtype as given, before x64 rules


def _describe_lengths(kv_lengths: Any) -> rules.ArrayInfo | None:
    """``(shape, dtype name)`` of ``kv_lengths`` (a list of ints is welcome)."""
    if kv_lengths is None:
        return None
    return tuple(np.shape(kv_lengths)), _dtype_name(kv_lengths)  # jax: the dtype as given


def _array(x: Any) -> jax.Array | None:
    """A validated input as a JAX array; None stays None."""
    return None if x is None else jnp.asarray(x)


def _check_scores(fn: str, name: str, x: Any) -> rules.ArrayInfo:
    """A floating array of rank >= 2 (scores or weights); its ``(shape, dtype name)``."""
    shape, dtype = _describe(fn, name, x)
    rules.check_float_inputs(fn, **{name: dtype})
    rules.check_rank(fn, **{name: shape})
    return shape, dtype


def _to_compute(x: jax.Array) -> jax.Array:
    """Half types up to float32; float32 and float64 unchanged (no copy)."""
    return x.astype(rules.compute_dtype(x.dtype.name))


def _group_heads(x: jax.Array, groups: int) -> jax.Array:
    """``(..., heads, T, D)`` → ``(..., kv_heads, groups, T, D)``: query head ``h`` is
    ``(h // groups, h % groups)``, so it meets kv head ``h // groups``."""
    return x.reshape(x.shape[:-3] + (x.shape[-3] // groups, groups) + x.shape[-2:])


def _groups(x_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> int:
    return x_shape[-3] // kv_shape[-3] if len(x_shape) >= 3 else 1


def _merged(shape: tuple[int, ...], groups: int) -> tuple[int, ...]:
    """Undo ``_group_heads``: ``(..., kv_heads, groups, T, S)`` → ``(..., heads, T, S)``."""
    if groups == 1:
        return shape
    return shape[:-4] + (shape[-4] * shape[-3],) + shape[-2:]


def _dtype_name(x: Any) -> str:
    # The dtype as given, before JAX's x64 canonicalisation (int64 stays "int64" in messages).
    return np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype).name


def _check_device(fn: str, device: Any) -> Any:
    # JAX arrays live on a jax.Device; a platform name ("cpu", "gpu") means its first device.
    if device is None or isinstance(device, jax.Device):
        return device
    if isinstance(device, str):
        try:
            return jax.devices(device)[0]
        except RuntimeError:
            pass
    raise ValueError(
        f"{fn}: device must be None, a jax.Device or a platform name such as 'cpu'; "
        f"got device={device!r}"
    )


def _place(array: jax.Array, device: Any) -> jax.Array:
    # Only an explicit device moves the mask; None keeps JAX's default placement (and jit's).
    return array if device is None else jax.device_put(array, device)

