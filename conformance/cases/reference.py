"""An independent float64 reference of the spec, for the harness and the tests.

Written differently from every backend on purpose: key/value heads are repeated (not grouped),
the causal and window rules come from ``np.tril``/``np.triu`` (not from position differences),
the softmax normalises only the rows that keep a key, and everything is float64. It returns
every intermediate of the pipeline, so each step can be compared on its own.

Non-finite inputs follow plain IEEE arithmetic, as the spec requires: a NaN in a query row gives
a NaN row of scores, weights and output; a NaN or ``+inf`` score at an allowed position makes its
row NaN (the row maximum is NaN or ``+inf`` and ``inf - inf`` is NaN); masking *replaces* a
score by ``-inf``, so a NaN at a masked position reaches nothing; ``weights @ value`` carries a
NaN value row into every output row (``0·NaN`` is NaN), including rows whose weight on it is 0,
which the spec leaves unspecified (``conformance.cases.expected`` marks those positions).

Sinks (``spec.SINKS``) are what GPT-OSS's eager attention does: the sink logit is appended to
every row as one more column of the masked scores, the softmax runs over ``kv_len + 1``
columns and the sink's column is dropped; the row log-sum-exp (``spec.LOG_SUM_EXP``) is that of
the same ``kv_len (+ 1)`` columns, ``-inf`` for a row with no allowed column.

The rules of ``spec.PIPELINE_WITH_MODS`` come straight from their chapter (``rule_mask``,
``alibi_bias``): the chunk rule compares ``(i + offset) // C`` with ``j // C`` over an outer
grid of positions, segment ids are compared with ``np.equal.outer``-style broadcasting, the
ALiBi bias ``-slope_h · |i + offset - j|`` is added after the soft-cap and the bias, then
``score_mod`` sees those scores and ``mask_mod`` ANDs its booleans with every other rule, both
called on the whole score grid (``spec.MOD_INDICES``). A packed batch (``varlen_attention``) is
``attention`` of one sequence at a time (``conformance.cases.expected``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Steps:
    """Every intermediate of the pipeline, float64."""

    scores: np.ndarray  # (..., heads, q_len, kv_len), after scale and softcap
    masked_scores: np.ndarray  # (..., heads, q_len, kv_len), after bias and masks
    weights: np.ndarray  # (..., heads, q_len, kv_len), before dropout
    output: np.ndarray  # (..., heads, q_len, v_dim)
    lse: np.ndarray | None = None  # (..., heads, q_len): the softmax's log denominator


def _f64(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def repeat_kv(x: np.ndarray, heads: int) -> np.ndarray:
    """``(..., kv_heads, T, D)`` → ``(..., heads, T, D)`` by repeating each kv head."""
    if x.ndim < 3 or x.shape[-3] == heads:
        return x
    return np.repeat(x, heads // x.shape[-3], axis=-3)


def structural_mask(
    q_len: int,
    kv_len: int,
    *,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
) -> np.ndarray:
    """``(q_len, kv_len)`` bool from the causal rule and the window, via tril/triu."""
    offset = 0 if causal_alignment == "top_left" else kv_len - q_len
    allowed = np.ones((q_len, kv_len), dtype=bool)
    if is_causal:
        allowed &= np.tril(np.ones((q_len, kv_len), dtype=bool), k=offset)
    if window is not None:
        left, right = window
        if right is not None:
            allowed &= np.tril(np.ones((q_len, kv_len), dtype=bool), k=offset + right)
        if left is not None:
            allowed &= np.triu(np.ones((q_len, kv_len), dtype=bool), k=offset - left)
    return allowed


def offset_of(q_len: int, kv_len: int, causal_alignment: str = "top_left") -> int:
    """Query ``i`` sits at key position ``i + offset``: 0 top-left, ``kv_len - q_len``
    bottom-right."""
    return 0 if causal_alignment == "top_left" else kv_len - q_len


def rule_mask(shape: tuple[int, ...], *, causal_alignment: str = "top_left",
              chunk_size: int | None = None, segment_ids: Any = None) -> np.ndarray:
    """Bool broadcastable to scores of ``shape`` ``(..., heads, q_len, kv_len)``: True where
    the chunk rule (``(i + offset) // C == j // C``, no chunk for a negative position) and the
    segment ids (equal ids; one array or a pair ``(..., q_len)``, ``(..., kv_len)``) allow."""
    q_len, kv_len = shape[-2:]
    allowed = np.ones((q_len, kv_len), dtype=bool)
    if chunk_size is not None:
        position = np.arange(q_len) + offset_of(q_len, kv_len, causal_alignment)
        same = np.equal.outer(position // chunk_size, np.arange(kv_len) // chunk_size)
        allowed = allowed & same & (position >= 0)[:, None]
    if segment_ids is not None:
        pair = segment_ids if isinstance(segment_ids, (list, tuple)) else (segment_ids,) * 2
        q_ids, kv_ids = (np.asarray(x) for x in pair)
        if q_ids.ndim == 1:
            allowed = allowed & (q_ids[:, None] == kv_ids[None, :])
        else:  # (..., q_len) against (..., kv_len), a heads axis between
            allowed = allowed & (q_ids[..., None, :, None] == kv_ids[..., None, None, :])
    return allowed


def alibi_bias(alibi_slopes: Any, shape: tuple[int, ...], causal_alignment: str = "top_left"
               ) -> np.ndarray:
    """The ALiBi bias ``-slope_h · |i + offset - j|`` (float64), broadcastable to scores of
    ``shape``: ``(heads, q_len, kv_len)``, or ``(q_len, kv_len)`` for 2-D scores."""
    q_len, kv_len = shape[-2:]
    position = np.arange(q_len) + offset_of(q_len, kv_len, causal_alignment)
    distance = np.abs(np.subtract.outer(position, np.arange(kv_len))).astype(np.float64)
    slopes = _f64(alibi_slopes)
    return -(slopes[:, None, None] * distance if len(shape) >= 3 else slopes[0] * distance)


def attention(
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
    sinks: Any = None,
    chunk_size: int | None = None,
    alibi_slopes: Any = None,
    segment_ids: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
) -> Steps:
    """The spec's pipeline in float64; ``dropout_mask`` (keep-mask) is used when ``dropout_p > 0``.

    Args:
      query: ``(..., heads, q_len, head_dim)`` or ``(q_len, head_dim)``.
      key: ``(..., kv_heads, kv_len, head_dim)`` or ``(kv_len, head_dim)``.
      value: ``(..., kv_heads, kv_len, v_dim)`` or ``(kv_len, v_dim)``.
      sinks: ``(heads,)`` sink logits (``(1,)`` for 2-D inputs), or None: one more column.
      chunk_size, alibi_slopes ``(heads,)``, segment_ids: ``rule_mask`` and ``alibi_bias``.
      score_mod, mask_mod: FlexAttention's callables, called once on the whole score grid
        with NumPy index arrays (``spec.MOD_INDICES``) and float64 scores.
    """
    q, k, v = _f64(query), _f64(key), _f64(value)
    heads = q.shape[-3] if q.ndim >= 3 else 1
    k, v = repeat_kv(k, heads), repeat_kv(v, heads)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    scores = np.einsum("...qd,...kd->...qk", q, k) * scale
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    masked = scores.copy()
    if bias is not None:
        masked = masked + _f64(bias)
    if alibi_slopes is not None:
        masked = masked + alibi_bias(alibi_slopes, masked.shape, causal_alignment)
    grid = mod_indices(masked.shape)
    if score_mod is not None:
        masked = np.broadcast_to(_f64(score_mod(masked, *grid)), masked.shape)
    q_len, kv_len = scores.shape[-2:]
    allowed = np.broadcast_to(
        structural_mask(
            q_len, kv_len, is_causal=is_causal, causal_alignment=causal_alignment, window=window
        ),
        masked.shape,
    )
    allowed = allowed & rule_mask(masked.shape, causal_alignment=causal_alignment,
                                  chunk_size=chunk_size, segment_ids=segment_ids)
    if mask_mod is not None:
        allowed = allowed & np.asarray(mask_mod(*grid), dtype=bool)
    if mask is not None:
        allowed = allowed & np.asarray(mask, dtype=bool)
    allowed = allowed & (masked != -np.inf)  # a bias of -inf masks its position too
    masked = np.where(allowed, masked, -np.inf)
    columns, allowed_columns = masked, allowed  # (..., heads, q_len, kv_len [+ 1])
    if sinks is not None:  # the sink: one more column of every row, dropped after the softmax
        sink = np.broadcast_to(sink_column(sinks, masked.ndim), masked.shape[:-1] + (1,))
        columns = np.concatenate([masked, sink], axis=-1)
        allowed_columns = np.concatenate([allowed, sink != -np.inf], axis=-1)
    keeps_any = allowed_columns.any(axis=-1, keepdims=True)  # (..., q_len, 1)
    safe = np.where(allowed_columns, columns, 0.0)
    row_max = np.where(keeps_any, np.max(np.where(allowed_columns, columns, -1e308), -1,
                                         keepdims=True, initial=-1e308), 0)  # kv_len 0 too
    exp = np.where(allowed_columns, np.exp(safe - row_max), 0.0)
    total = exp.sum(axis=-1, keepdims=True)
    weights = np.where(keeps_any, exp / np.where(keeps_any, total, 1.0), 0.0)
    lse = np.where(keeps_any, row_max + np.log(np.where(keeps_any, total, 1.0)), -np.inf)[..., 0]
    weights = weights[..., :kv_len]  # the sink's column dropped
    kept = weights
    if dropout_p > 0:
        kept = weights * np.asarray(dropout_mask, dtype=bool) / (1.0 - dropout_p)
    output = np.einsum("...qk,...kd->...qd", kept, v)
    return Steps(scores=scores, masked_scores=masked, weights=weights, output=output, lse=lse)


def mod_indices(shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """``(batch, head, q_idx, kv_idx)`` of ``spec.MOD_INDICES`` for scores of ``shape``:
    the flat batch index ``(..., 1, 1, 1)`` (0-d without batch axes), the head ``(heads, 1,
    1)`` (0-d for 2-D scores), ``q_idx (q_len, 1)`` and ``kv_idx (kv_len,)``, int64."""
    batch_axes = tuple(shape[:-3])
    batch = (np.arange(int(np.prod(batch_axes, dtype=np.int64))).reshape(batch_axes + (1, 1, 1))
             if batch_axes else np.zeros((), np.int64))
    head = np.arange(shape[-3]).reshape(-1, 1, 1) if len(shape) >= 3 else np.zeros((), np.int64)
    return batch, head, np.arange(shape[-2])[:, None], np.arange(shape[-1])


def sink_column(sinks: Any, ndim: int) -> np.ndarray:
    """``(heads,)`` sink logits as a float64 column against scores of rank ``ndim``:
    ``(heads, 1, 1)``, or ``(1, 1)`` for 2-D scores."""
    sinks = _f64(sinks)
    return sinks.reshape(sinks.shape + (1, 1)) if ndim >= 3 else sinks.reshape(1, 1)


@dataclass
class Grads:
    """Gradients of a loss with respect to the inputs, float64."""

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    bias: np.ndarray | None
    sinks: np.ndarray | None = None


def unbroadcast(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``grad`` down to ``shape`` (the shape an operand had before broadcasting)."""
    while grad.ndim > len(shape):
        grad = grad.sum(axis=0)
    for axis, size in enumerate(shape):
        if size == 1 and grad.shape[axis] != 1:
            grad = grad.sum(axis=axis, keepdims=True)
    return grad


def fold_kv(grad: np.ndarray, kv_shape: tuple[int, ...]) -> np.ndarray:
    """Undo ``repeat_kv``: add the gradients of the repeated copies of each kv head."""
    if len(kv_shape) < 3 or grad.shape[-3] == kv_shape[-3]:
        return grad
    kv_heads = kv_shape[-3]
    split = grad.reshape(grad.shape[:-3] + (kv_heads, grad.shape[-3] // kv_heads) + grad.shape[-2:])
    return split.sum(axis=-3)


def attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    grad_lse: Any = None,
    **options: Any,
) -> Grads:
    """Gradients of ``attention(...).output`` against ``grad_output`` (and of its ``lse``
    against ``grad_lse (..., heads, q_len)``, if given), in float64.

    Independent of the backends' backward passes: the softmax is differentiated through its
    Jacobian ``diag(w) - w wᵀ`` row by row (``np.einsum``) over every column, the sink's
    included (its value is 0, and ``d lse / d column = w``), kv heads are repeated and their
    gradients folded back, the soft-cap derivative is ``sech²`` and ``score_mod``'s its
    ``derivative`` method (the harness's mods have one, ``conformance.cases.mods``); ALiBi's slopes
    are constants (no gradient).
    """
    q, k, v = _f64(query), _f64(key), _f64(value)
    d_out = _f64(grad_output)
    heads = q.shape[-3] if q.ndim >= 3 else 1
    k_rep, v_rep = repeat_kv(k, heads), repeat_kv(v, heads)
    steps = attention(q, k_rep, v_rep, **options)
    scale = q.shape[-1] ** -0.5 if options.get("scale") is None else float(options["scale"])
    weights = steps.weights
    sinks = options.get("sinks")
    if sinks is not None:  # every column again, the sink's last: w_sink = exp(sink - lse)
        with np.errstate(invalid="ignore"):
            sink = np.broadcast_to(sink_column(sinks, weights.ndim), weights.shape[:-1] + (1,))
            w_sink = np.where(steps.lse[..., None] == -np.inf, 0.0,
                              np.exp(sink - steps.lse[..., None]))
        weights = np.concatenate([weights, w_sink], axis=-1)  # (..., q_len, kv_len + 1)
    kv_len = v_rep.shape[-2]
    kept = weights[..., :kv_len]
    dropout_p = options.get("dropout_p", 0.0)
    if dropout_p > 0:
        keep = np.asarray(options["dropout_mask"], dtype=bool) / (1.0 - dropout_p)
        kept = kept * keep
    grad_v = np.einsum("...qk,...qd->...kd", kept, d_out)
    grad_kept = np.einsum("...qd,...kd->...qk", d_out, v_rep)
    grad_weights = grad_kept * keep if dropout_p > 0 else grad_kept
    if sinks is not None:  # the sink's column carries no value: its weight's gradient is 0
        grad_weights = np.concatenate([grad_weights, np.zeros_like(grad_weights[..., :1])], -1)
    # softmax Jacobian, row by row: J = diag(w) - w wᵀ
    jacobian = np.einsum("...k,kl->...kl", weights, np.eye(weights.shape[-1])) - np.einsum(
        "...k,...l->...kl", weights, weights
    )
    grad_scores = np.einsum("...kl,...l->...k", jacobian, grad_weights)
    if grad_lse is not None:  # d lse / d column = its weight
        grad_scores = grad_scores + _f64(grad_lse)[..., None] * weights
    grad_sinks = None
    if sinks is not None:  # the sink's column, summed over every axis but the heads
        sink_grads = grad_scores[..., kv_len]  # (..., heads, q_len) or (q_len,)
        grad_sinks = (sink_grads.reshape(-1, *np.shape(sinks), sink_grads.shape[-1]).sum((0, 2))
                      if weights.ndim >= 3 else sink_grads.sum(keepdims=True))
        grad_scores = grad_scores[..., :kv_len]
    score_mod = options.get("score_mod")
    if score_mod is not None:  # through score_mod, at the scores it was given
        pre = steps.scores + (0.0 if options.get("bias") is None else _f64(options["bias"]))
        if options.get("alibi_slopes") is not None:
            pre = pre + alibi_bias(options["alibi_slopes"], pre.shape,
                                   options.get("causal_alignment", "top_left"))
        slope = _f64(score_mod.derivative(pre, *mod_indices(pre.shape)))
        grad_scores = np.where(np.isneginf(steps.masked_scores), 0.0, grad_scores * slope)
    bias = options.get("bias")
    grad_bias = None if bias is None else unbroadcast(grad_scores, np.shape(bias))
    softcap = options.get("softcap")
    if softcap is not None:
        raw = np.einsum("...qd,...kd->...qk", q, k_rep) * scale
        grad_scores = grad_scores / np.cosh(raw / softcap) ** 2
    grad_q = np.einsum("...qk,...kd->...qd", grad_scores, k_rep) * scale
    grad_k = np.einsum("...qk,...qd->...kd", grad_scores, q) * scale
    return Grads(
        query=grad_q,
        key=fold_kv(grad_k, k.shape),
        value=fold_kv(grad_v, v.shape),
        bias=grad_bias,
        sinks=grad_sinks,
    )
