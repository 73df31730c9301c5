"""The smallest module the conformance harness checks: ``scaled_dot_product_attention`` alone.

Only this function is required (docs/checking.md); the harness runs every case through it and
lists the spec's other functions and modules once, as not provided. From the repository root::

    python -m conformance --backend examples.sdpa_only

It validates its arguments with the project's shared rules (``attention_rules``), so bad inputs
raise the spec's exceptions too, and computes the pipeline of the spec in NumPy, attention sinks
(one more softmax column without a value) and the row log-sum-exp (``return_lse``) included. It
has no ``merge_attention``: the merge cases are listed once, as not provided. It declares
chunked attention, ALiBi, segment ids and the mods unsupported (``UNSUPPORTED``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import attention_rules as rules

FN = "scaled_dot_product_attention"
#: The arguments of chunked attention, ALiBi, segment ids and the mods are not taken here: the
#: cases that use them are reported as unsupported (docs/checking.md).
UNSUPPORTED = {"chunked", "alibi", "segments", "score_mod", "mask_mod"}


def _describe(name: str, x: Any) -> tuple[tuple[int, ...], str] | None:
    """``(shape, dtype name)`` of an input for the shared rules; None for None."""
    if x is None:
        return None
    rules.check_array(FN, name, x)  # a Python list has no dtype: TypeError
    return tuple(np.shape(x)), np.asarray(x).dtype.name


def scaled_dot_product_attention(query: Any, key: Any, value: Any, *, mask: Any = None,
                                 bias: Any = None, is_causal: bool = False,
                                 causal_alignment: str = "top_left", window: tuple | None = None,
                                 scale: float | None = None, softcap: float | None = None,
                                 dropout_p: float = 0.0, dropout_mask: Any = None, rng: Any = None,
                                 return_weights: bool = False, sinks: Any = None,
                                 return_lse: bool = False) -> Any:
    """``softmax(mask(query @ keyᵀ · scale + bias)) @ value``.

    query ``(..., heads, q_len, head_dim)``, key ``(..., kv_heads, kv_len, head_dim)``, value
    ``(..., kv_heads, kv_len, v_dim)`` (or 2-D ``(seq, dim)``); mask True = may attend; sinks
    ``(heads,)`` logits, each joining its head's softmax denominators. Returns ``(...,
    heads, q_len, v_dim)``, then the weights ``(..., heads, q_len, kv_len)`` with
    ``return_weights`` and the row log-sum-exp ``(..., heads, q_len)`` with ``return_lse``.
    """
    args = rules.attention_arguments(
        FN, _describe("query", query), _describe("key", key), _describe("value", value),
        mask=_describe("mask", mask), bias=_describe("bias", bias), is_causal=is_causal,
        causal_alignment=causal_alignment, window=window, scale=scale, softcap=softcap,
        dropout_p=dropout_p, dropout_mask=_describe("dropout_mask", dropout_mask),
        return_weights=return_weights, sinks=_describe("sinks", sinks), return_lse=return_lse)
    compute = np.float64 if args.dtype == "float64" else np.float32  # half precision: float32
    q, k, v = (np.asarray(x).astype(compute) for x in (query, key, value))
    if q.ndim >= 3 and k.shape[-3] != q.shape[-3]:  # grouped-query: head h uses h // group
        group = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    scores = q @ np.swapaxes(k, -1, -2) * args.scale  # (..., heads, q_len, kv_len)
    if args.softcap is not None:
        scores = args.softcap * np.tanh(scores / args.softcap)
    if bias is not None:
        scores = scores + np.asarray(bias).astype(compute)
    q_len, kv_len = scores.shape[-2:]
    i, j = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    offset = kv_len - q_len if args.causal_alignment == "bottom_right" else 0
    allowed = np.ones((q_len, kv_len), bool)
    if args.is_causal:
        allowed &= j <= i + offset
    if args.window is not None:
        left, right = args.window
        allowed &= (j >= i + offset - left) if left is not None else True
        allowed &= (j <= i + offset + right) if right is not None else True
    if mask is not None:
        allowed = allowed & np.asarray(mask)
    scores = np.where(allowed, scores, -np.inf)  # replaced, so a masked NaN reaches nothing
    if sinks is not None:  # the sink: one more column of every row, with no value
        sink = np.asarray(sinks).astype(compute)  # (heads,) → (heads, 1, 1), or (1, 1) in 2-D
        sink = sink.reshape(-1, 1, 1) if scores.ndim >= 3 else sink.reshape(1, 1)
        scores = np.concatenate([scores, np.broadcast_to(sink, scores.shape[:-1] + (1,))], -1)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(row_max == -np.inf, 0.0, row_max)  # fully masked row: no -inf - -inf
    e = np.exp(scores - row_max)
    total = e.sum(axis=-1, keepdims=True)
    weights = (e / np.where(total == 0, 1.0, total))[..., :kv_len]  # the sink's column dropped
    lse = np.where(total == 0, -np.inf, row_max + np.log(np.where(total == 0, 1.0, total)))
    kept = weights
    if args.dropout_p > 0:
        keep = dropout_mask if dropout_mask is not None else (
            (rng or np.random.default_rng()).random(weights.shape) >= args.dropout_p)
        kept = weights * np.asarray(keep) / (1.0 - args.dropout_p)
    dtype = np.asarray(query).dtype
    output = (kept @ v).astype(dtype)  # (..., heads, q_len, v_dim)
    results = (output,) + ((weights.astype(dtype),) if args.return_weights else ()) + (
        (lse[..., 0].astype(compute),) if return_lse else ())
    return results if len(results) > 1 else output
