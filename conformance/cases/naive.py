"""The naive baseline: the spec's pipeline as a straightforward implementation in a low precision.

Every compared step's tolerance (``spec.TOLERANCES``) scales with the error ``e`` of this
baseline, measured on the same inputs in the same run (flash-attention's rule): the float64
pipeline with every intermediate (dot products, scaled scores, exp, row sums, weights, weighted
sum) rounded to the dtype under test, and every dot product and row sum accumulated in the
spec's compute dtype (float32 for float32, bfloat16 and float16; float64 for float64), as a plain
``query @ keyᵀ`` in that dtype does. ``Precision("float64")`` gives the float64 pipeline itself.

Non-finite inputs follow IEEE arithmetic here as in ``conformance.cases.reference``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import spec
from . import reference
from .dtypes import numpy_dtype
from .inputs import key_parts


@dataclass(frozen=True)
class Precision:
    """How a straightforward implementation in ``dtype`` rounds and accumulates."""

    dtype: str

    @property
    def accumulate(self) -> np.dtype:
        """The dtype dot products and sums accumulate in: the spec's compute dtype."""
        return np.dtype(spec.COMPUTE_DTYPE[self.dtype])

    def round(self, x: Any) -> np.ndarray:
        """Float64 values rounded to ``dtype`` and back (unchanged for float64)."""
        x = np.asarray(x, dtype=np.float64)
        if self.dtype == "float64":
            return x
        return x.astype(numpy_dtype(self.dtype)).astype(np.float64)

    def einsum(self, subscripts: str, a: Any, b: Any) -> np.ndarray:
        """``np.einsum`` of two operands accumulated in the compute dtype, result rounded."""
        acc = self.accumulate
        product = np.einsum(subscripts, np.asarray(a).astype(acc), np.asarray(b).astype(acc))
        return self.round(product)

    def matmul(self, a: Any, b: Any) -> np.ndarray:
        """``a @ b`` accumulated in the compute dtype, result rounded."""
        acc = self.accumulate
        return self.round(np.asarray(a).astype(acc) @ np.asarray(b).astype(acc))

    def sum(self, x: np.ndarray, axis: int = -1) -> np.ndarray:
        """Sum over ``axis`` (kept) accumulated in the compute dtype, result rounded."""
        return self.round(np.asarray(x).astype(self.accumulate).sum(axis, keepdims=True))

    @property
    def unit(self) -> float:
        """The unit roundoff of ``dtype``: half the distance from 1 to the next number."""
        if self.dtype == "bfloat16":
            return 2.0 ** -8
        return float(np.finfo(np.dtype(self.dtype)).eps) / 2


EXACT = Precision("float64")


def _f64(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def _scale(q: np.ndarray, options: dict[str, Any]) -> float:
    scale = options.get("scale")
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def naive_attention(arrays: dict[str, np.ndarray], options: dict[str, Any],
                    p: Precision) -> reference.Steps:
    """The spec's pipeline with every intermediate rounded by ``p``.

    ``arrays``: ``query (..., heads, q_len, head_dim)``, ``key (..., kv_heads, kv_len,
    head_dim)``, ``value (..., kv_heads, kv_len, v_dim)`` and optional ``mask``, ``bias``,
    ``dropout_mask``, ``sinks (heads,)`` (one more column, as in ``reference``); ``options``:
    the scalar options of ``scaled_dot_product_attention``.
    """
    q, k, v = (_f64(arrays[n]) for n in ("query", "key", "value"))
    heads = q.shape[-3] if q.ndim >= 3 else 1
    k, v = reference.repeat_kv(k, heads), reference.repeat_kv(v, heads)
    r = p.round
    scores = r(p.einsum("...qd,...kd->...qk", q, k) * _scale(q, options))
    softcap = options.get("softcap")
    if softcap is not None:
        scores = r(softcap * r(np.tanh(r(scores / softcap))))
    masked = scores if arrays.get("bias") is None else r(scores + _f64(arrays["bias"]))
    q_len, kv_len = scores.shape[-2:]
    allowed = np.broadcast_to(reference.structural_mask(
        q_len, kv_len, is_causal=options.get("is_causal", False),
        causal_alignment=options.get("causal_alignment", "top_left"),
        window=options.get("window")), masked.shape)
    if arrays.get("mask") is not None:
        allowed = allowed & np.asarray(arrays["mask"], dtype=bool)
    allowed = allowed & (masked != -np.inf)
    masked = np.where(allowed, masked, -np.inf)
    columns, allowed_columns = masked, allowed
    if arrays.get("sinks") is not None:  # the sink's column, rounded to the dtype like a score
        sink = r(reference.sink_column(arrays["sinks"], masked.ndim))
        sink = np.broadcast_to(sink, masked.shape[:-1] + (1,))
        columns = np.concatenate([masked, sink], -1)
        allowed_columns = np.concatenate([allowed, sink != -np.inf], -1)
    keeps = allowed_columns.any(-1, keepdims=True)  # (..., q_len, 1)
    row_max = np.where(keeps, np.max(np.where(allowed_columns, columns, -1e308), -1,
                                     keepdims=True, initial=-1e308), 0.0)  # kv_len 0 too
    exp = np.where(allowed_columns,
                   r(np.exp(r(np.where(allowed_columns, columns, 0.0) - row_max))), 0.0)
    total = p.sum(exp)
    weights = np.where(keeps, r(exp / np.where(total == 0, 1.0, total)), 0.0)[..., :kv_len]
    lse = np.where(keeps, r(row_max + r(np.log(np.where(keeps, total, 1.0)))), -np.inf)[..., 0]
    kept = weights
    if options.get("dropout_p", 0.0) > 0:
        kept = r(weights * np.asarray(arrays["dropout_mask"], bool) / (1.0 - options["dropout_p"]))
    output = p.einsum("...qk,...kd->...qd", kept, v)
    return reference.Steps(scores=scores, masked_scores=masked, weights=weights, output=output,
                           lse=lse)


def naive_attention_vjp(arrays: dict[str, np.ndarray], options: dict[str, Any],
                        p: Precision) -> reference.Grads:
    """The backward pass (FlashAttention's formulas) as a straightforward implementation.

    ``arrays`` as ``naive_attention``'s plus ``grad_output (..., heads, q_len, v_dim)``. Sums
    accumulate in the compute dtype and every intermediate is rounded by ``p``: the error
    baseline of the gradient steps.
    """
    steps = naive_attention(arrays, options, p)
    r = p.round
    q, k, v = (_f64(arrays[n]) for n in ("query", "key", "value"))
    d_out = _f64(arrays["grad_output"])
    heads = q.shape[-3] if q.ndim >= 3 else 1
    k_rep, v_rep = reference.repeat_kv(k, heads), reference.repeat_kv(v, heads)
    weights, kept, keep = steps.weights, steps.weights, 1.0
    dropout_p = options.get("dropout_p", 0.0)
    if dropout_p > 0:
        keep = np.asarray(arrays["dropout_mask"], bool) / (1.0 - dropout_p)
        kept = r(weights * keep)
    grad_v = p.einsum("...qk,...qd->...kd", kept, d_out)
    grad_w = r(p.einsum("...qd,...kd->...qk", d_out, v_rep) * keep)
    row = p.sum(d_out * steps.output)  # rowsum(dO ⊙ O), (..., q_len, 1)
    grad_s = r(weights * r(grad_w - row))
    bias = arrays.get("bias")
    grad_bias = None if bias is None else r(reference.unbroadcast(grad_s, np.shape(bias)))
    softcap = options.get("softcap")
    if softcap is not None:
        grad_s = r(grad_s * r(1.0 - r(r(steps.scores / softcap) ** 2)))
    grad_s = r(grad_s * _scale(q, options))
    grad_q = p.einsum("...qk,...kd->...qd", grad_s, k_rep)
    grad_k = p.einsum("...qk,...qd->...kd", grad_s, q)
    grad_sinks = None
    if arrays.get("sinks") is not None:  # -sum of w_sink · rowsum(dO ⊙ O), per head
        sink = reference.sink_column(arrays["sinks"], weights.ndim)[..., 0]  # (heads, 1)
        w_sink = np.where(steps.lse == -np.inf, 0.0, r(np.exp(r(sink - steps.lse))))
        terms = r(-w_sink * row[..., 0])  # (..., heads, q_len)
        terms = terms.reshape(-1, *np.shape(arrays["sinks"]), terms.shape[-1]) \
            if weights.ndim >= 3 else terms.reshape(1, 1, -1)
        grad_sinks = r(terms.astype(p.accumulate).sum((0, 2)))
    return reference.Grads(query=grad_q, key=r(reference.fold_kv(grad_k, k.shape)),
                           value=r(reference.fold_kv(grad_v, v.shape)), bias=grad_bias,
                           sinks=grad_sinks)


def naive_merge(arrays: dict[str, np.ndarray], options: dict[str, Any], p: Precision
                ) -> tuple[np.ndarray, np.ndarray]:
    """A merge case (``cases`` kind ``"merge"``) as a straightforward implementation: each
    part's ``naive_attention`` (without the sinks; its output and lse rounded by ``p``), then
    the merge of ``spec.MERGING`` with every intermediate rounded by ``p`` and its sums
    accumulated in the compute dtype, the sinks applied once at the end.

    ``arrays``: a merge case's (``query``, ``key``, ``value``, ``key_part`` and optional
    ``mask``, ``bias``, ``sinks``); ``options``: ``parts`` and the scalar options. Returns
    ``(output (..., heads, q_len, v_dim), lse (..., heads, q_len))``.
    """
    r = p.round
    outputs, lses = [], []
    for part in key_parts(arrays, options["parts"]):
        steps = naive_attention({"query": arrays["query"], **part}, options, p)
        outputs.append(steps.output)
        lses.append(steps.lse)
    lse = np.stack(lses)  # (parts, ..., heads, q_len)
    m = lse.max(axis=0)
    m = np.where(np.isfinite(m), m, 0.0)
    share = np.where(lse == -np.inf, 0.0, r(np.exp(r(lse - m))))  # (parts, ..., q_len)
    total = r(share.astype(p.accumulate).sum(axis=0))
    acc = sum(share[i][..., None].astype(p.accumulate) * outputs[i] for i in range(len(lses)))
    output = r(r(acc) / np.where(total > 0, total, 1.0)[..., None])
    merged = np.where(total > 0, r(m + r(np.log(np.where(total > 0, total, 1.0)))), -np.inf)
    if arrays.get("sinks") is not None:  # once, here: the sink joins every row's denominator
        sink = r(reference.sink_column(arrays["sinks"], output.ndim))[..., 0]  # (heads, 1)
        joined = r(np.logaddexp(merged, sink))
        keep = np.where(joined == -np.inf, 0.0, r(np.exp(r(merged - joined))))
        output = r(output * keep[..., None])
        merged = joined
    return output, merged


def rounding_error(arrays: dict[str, np.ndarray], options: dict[str, Any], p: Precision,
                   ref: reference.Steps) -> dict[str, float]:
    """The first-order effect of rounding every score once to ``p.dtype``, propagated through the
    softmax and the weighted sum (the floor of the naive baseline's error).

    A score ``s_ij`` that a straightforward implementation rounds once may be off by
    ``h_ij = u·(scale·Σ_d |q_id k_jd| + |s_ij|)``; to first order that moves weight ``w_ij`` by
    up to ``w_ij·(h_ij + Σ_k w_ik h_ik)``, output ``o_id`` by up to
    ``Σ_j w_ij h_ij |v_jd - o_id|`` and the row's log-sum-exp by up to ``Σ_j w_ij h_ij``; the
    final rounding of each adds ``u·|x|``. A measured naive
    error on a tiny example can be far smaller by luck (its roundings of two close scores cancel
    in their difference); the tolerance must not rely on that luck. Returns the largest estimate
    for ``weights``/``output_weights``, ``output`` and ``lse``; ``ref`` is the float64
    reference.
    """
    u = p.unit
    q, k, v = (_f64(arrays[n]) for n in ("query", "key", "value"))
    heads = q.shape[-3] if q.ndim >= 3 else 1
    k, v = reference.repeat_kv(k, heads), reference.repeat_kv(v, heads)
    with np.errstate(all="ignore"):
        magnitude = np.einsum("...qd,...kd->...qk", np.abs(q), np.abs(k)) * abs(_scale(q, options))
        allowed = np.isfinite(ref.masked_scores)
        h = np.where(allowed, u * (magnitude + np.abs(np.where(allowed, ref.masked_scores, 0))), 0)
        w = np.where(np.isfinite(ref.weights), ref.weights, 0.0)  # (..., heads, q_len, kv_len)
        o = np.where(np.isfinite(ref.output), ref.output, 0.0)  # (..., heads, q_len, v_dim)
        v = np.where(np.isfinite(v), v, 0.0)
        weights = w * (h + (w * h).sum(-1, keepdims=True)) + u * w
        spread = np.abs(v[..., None, :, :] - o[..., :, None, :])  # (..., q_len, kv_len, v_dim)
        output = np.einsum("...qk,...qkd->...qd", w * h, spread) + u * np.abs(o)
        lse = (w * h).sum(-1) + u * np.abs(np.where(np.isfinite(ref.lse), ref.lse, 0.0)) \
            if ref.lse is not None else np.zeros(0)
    largest = {"weights": float(np.max(weights, initial=0.0)),
               "output": float(np.max(output, initial=0.0)),
               "lse": float(np.max(lse, initial=0.0))}
    largest["output_weights"] = largest["weights"]
    return largest


__all__ = ["EXACT", "Precision", "naive_attention", "naive_attention_vjp", "naive_merge",
           "rounding_error"]
