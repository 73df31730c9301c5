"""The float64 reference of ``chunk_size``, ``alibi_slopes``, ``segment_ids``, ``mask_mod`` and
``score_mod`` for ``tests/test_masks_and_mods.py``.

Written from the spec's words, position by position in plain Python loops, independent of the
backends and of ``attention_rules``: the rules become one boolean mask and one additive bias,
which ``conformance.cases.reference`` (float64, ``np.tril``-based causal rule, Jacobian-based VJP)
turns into outputs, lses and gradients. ALiBi uses flash-attention's documented formula,
``-slope · |i + seqlen_k - seqlen_q - j|``, for ``causal_alignment="bottom_right"`` and
``-slope · |i - j|`` for ``"top_left"``. A score_mod that is not additive (``score_mod_attention``)
is applied to the float64 scores by this file's own small pipeline.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from conformance.cases import reference


def rules_as_mask_and_bias(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    *,
    causal_alignment: str = "top_left",
    chunk_size: int | None = None,
    alibi_slopes: np.ndarray | None = None,
    segment_ids: tuple[np.ndarray, np.ndarray] | None = None,
    mask_table: np.ndarray | None = None,
    bias_table: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(mask, bias)``, each ``(batch, heads, q_len, kv_len)``: True where the chunk rule, the
    segment ids and ``mask_table`` (``(heads, q_len, kv_len)`` bool, a mask_mod tabulated) allow
    a position; ALiBi plus ``bias_table`` (a score_mod that adds, tabulated) as the bias."""
    mask = np.ones((batch, heads, q_len, kv_len), bool)
    bias = np.zeros((batch, heads, q_len, kv_len))
    for b in range(batch):
        for h in range(heads):
            for i in range(q_len):
                for j in range(kv_len):
                    position = i if causal_alignment == "top_left" else i + kv_len - q_len
                    if chunk_size is not None and (math.floor(position / chunk_size)
                                                   != math.floor(j / chunk_size)):
                        mask[b, h, i, j] = False
                    if segment_ids is not None and segment_ids[0][b, i] != segment_ids[1][b, j]:
                        mask[b, h, i, j] = False
                    if mask_table is not None and not mask_table[h, i, j]:
                        mask[b, h, i, j] = False
                    if alibi_slopes is not None:
                        if causal_alignment == "bottom_right":  # flash-attention's docstring
                            distance = abs(i + kv_len - q_len - j)
                        else:
                            distance = abs(i - j)
                        bias[b, h, i, j] -= alibi_slopes[h] * distance
                    if bias_table is not None:
                        bias[b, h, i, j] += bias_table[h, i, j]
    return mask, bias


def relative_bias_table(table: np.ndarray, q_len: int, kv_len: int, offset: int = 0) -> np.ndarray:
    """``(heads, q_len, kv_len)``: ``table[h, clip(j - i - offset, -m, m) + m]`` for a
    ``(heads, 2m + 1)`` table (what ``relative_bias_mod`` adds), by loops."""
    heads, width = table.shape
    m = (width - 1) // 2
    out = np.zeros((heads, q_len, kv_len))
    for h in range(heads):
        for i in range(q_len):
            for j in range(kv_len):
                out[h, i, j] = table[h, min(max(j - i - offset, -m), m) + m]
    return out


def expected(query: np.ndarray, key: np.ndarray, value: np.ndarray, grad_output: np.ndarray,
             mask: np.ndarray, bias: np.ndarray, **options: Any) -> dict[str, np.ndarray]:
    """Output, weights, lse and the gradients of query, key and value, float64."""
    steps = reference.attention(query, key, value, mask=mask, bias=bias, **options)
    grads = reference.attention_vjp(query, key, value, grad_output, mask=mask, bias=bias,
                                    **options)
    return {"output": steps.output, "weights": steps.weights, "lse": steps.lse,
            "grad_query": grads.query, "grad_key": grads.key, "grad_value": grads.value}


def score_mod_attention(query: np.ndarray, key: np.ndarray, value: np.ndarray, score_mod: Any,
                        mask: np.ndarray) -> np.ndarray:
    """The output with a (NumPy) ``score_mod`` applied to the scaled float64 scores before the
    ``mask`` (True = may attend): this file's own pipeline, no backend involved."""
    heads = query.shape[-3]
    k = reference.repeat_kv(key, heads)
    v = reference.repeat_kv(value, heads)
    scores = np.einsum("...qd,...kd->...qk", query, k) * query.shape[-1] ** -0.5
    b, h, i, j = np.indices(scores.shape, sparse=True)
    scores = np.where(mask, score_mod(scores, b, h, i, j), -np.inf)
    row_max = np.max(np.where(mask, scores, -1e308), axis=-1, keepdims=True)
    weights = np.where(mask, np.exp(scores - row_max), 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    weights = weights / np.where(total == 0, 1.0, total)
    return np.einsum("...qk,...kd->...qd", weights, v)
