"""The expected ``grad_weights`` of the MLA module case: every weight's gradient of the naive
form (``spec.LATENT_ATTENTION``) against the case's ``grad_output``, by the chain rule written
here from the spec's formulas over ``cases.latent.Parts`` (never from a backend).

Backwards through the forward: ``o_proj``; the attention's VJP (``reference.attention_vjp``,
or ``naive.naive_attention_vjp`` for the naive baseline); the split of query and key into their
``nope`` and rotated parts, each rotated part's gradient turned back by ``-angle`` (the rotation
is orthogonal: its transpose is its inverse) and ``k_pe``'s summed over the heads that share
it; ``kv_b_proj``; the RMSNorms (``_rms_norm_vjp``); the down-projections.

With a ``Precision`` other than float64 every product and sum accumulates in the compute dtype
and every intermediate is rounded to the dtype, as ``module_pipelines.module_backward`` does for
the other modules: the naive baseline that scales the tolerance.
"""

from __future__ import annotations

import numpy as np

from . import reference
from .inputs import CaseData
from .latent import RMS_EPS, Parts
from .naive import EXACT, Precision, naive_attention_vjp


def _weight_grad(p: Precision, x: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """The gradient of ``W (out, in)`` in ``y = x @ Wᵀ``: ``dyᵀ x`` over every leading axis,
    ``(out, in)``."""
    return p.matmul(grad.reshape(-1, grad.shape[-1]).T, x.reshape(-1, x.shape[-1]))


def _rms_norm_vjp(parts: Parts, t: np.ndarray, grad: np.ndarray,
                  name: str) -> tuple[np.ndarray, np.ndarray]:
    """The VJP of ``parts.rms(t, name)``: ``(dL/dt (..., dim), dL/dgain (dim,))``. With ``n = t
    · s``, ``s = (mean(t²) + eps)^-½`` and ``y = g · n``: ``dn_i/dt_j = s (δ_ij - n_i n_j /
    dim)``, so ``dt = s · (dn - n · mean(dn · n))`` where ``dn = dy · g``; ``dg = Σ dy · n``
    over every leading axis."""
    p = parts.p
    acc = p.accumulate
    tc = t.astype(acc)
    inv_rms = 1.0 / np.sqrt(np.mean(tc * tc, axis=-1, keepdims=True) + acc.type(RMS_EPS))
    normed = p.round(tc * inv_rms)  # as the forward rounds it before the gain
    grad_gain = p.round((grad * normed).reshape(-1, t.shape[-1]).astype(acc).sum(axis=0))
    grad_normed = p.round(grad * parts.w[name])
    along = p.round(np.mean((grad_normed * normed).astype(acc), axis=-1, keepdims=True))
    grad_t = p.round(inv_rms * p.round(grad_normed - p.round(normed * along)))
    return grad_t, grad_gain


def _attention_vjp(parts: Parts, query: np.ndarray, key: np.ndarray, value: np.ndarray,
                   grad: np.ndarray) -> reference.Grads:
    """The attention's VJP at the forward options: the float64 reference, or the naive one
    rounded by ``parts.p``."""
    if parts.p.dtype == "float64":
        return reference.attention_vjp(query, key, value, grad, **parts.options)
    arrays = {"query": query, "key": key, "value": value, "grad_output": grad}
    return naive_attention_vjp(arrays, parts.options, parts.p)


def weight_grads(data: CaseData, p: Precision = EXACT) -> dict[str, np.ndarray]:
    """Every weight's gradient of the case's naive MLA forward (``latent.mla(data, p)``)
    contracted with ``data.arrays["grad_output"] (..., seq, d_model)``: weight name (without
    ``w:``) → array shaped like the weight, ``(out, in)`` or ``(dim,)``."""
    parts = Parts(data, p)
    w, dn, r = parts.w, parts.dn, parts.r
    grad_out = np.asarray(data.arrays["grad_output"]).astype(np.float64)
    query, key, value = parts.naive_qkv()
    context = parts.attend(query, key, value).output  # (..., H, S, dv)
    grads = {"o_proj.weight": _weight_grad(p, parts.merge(context), grad_out)}
    grad_context = parts.heads(p.matmul(grad_out, w["o_proj.weight"]))  # (..., H, S, dv)
    g = _attention_vjp(parts, query, key, value, grad_context)
    # q = [q_nope ; rot(q_pe)]: the rotated part's gradient turned back
    grad_q = np.concatenate([g.query[..., :dn], parts.rotate(g.query[..., dn:], inverse=True)],
                            axis=-1)
    # k_pe (..., 1, S, dr) is shared by every head: its gradient is their sum, turned back
    shared = p.round(g.key[..., dn:].astype(p.accumulate).sum(axis=-3, keepdims=True))
    grad_k_pe = parts.rotate(shared, inverse=True)[..., 0, :, :]  # (..., S, dr)
    grad_kv = parts.merge(np.concatenate([g.key[..., :dn], g.value], axis=-1))
    grads["kv_b_proj.weight"] = _weight_grad(p, parts.c[..., 0, :, :], grad_kv)
    grad_c = p.matmul(grad_kv, w["kv_b_proj.weight"])  # (..., S, r)
    grad_latent, grads["kv_a_layernorm.weight"] = _rms_norm_vjp(
        parts, parts.kv_a[..., :r], grad_c, "kv_a_layernorm.weight")
    grad_kv_a = np.concatenate([grad_latent, grad_k_pe], axis=-1)  # (..., S, r + dr)
    grads["kv_a_proj_with_mqa.weight"] = _weight_grad(p, parts.x, grad_kv_a)
    grad_q_flat = parts.merge(grad_q)  # (..., S, H * (dn + dr))
    if "q_proj.weight" in w:
        grads["q_proj.weight"] = _weight_grad(p, parts.x, grad_q_flat)
    else:
        grads["q_b_proj.weight"] = _weight_grad(p, parts.q_normed, grad_q_flat)
        grad_q_a, grads["q_a_layernorm.weight"] = _rms_norm_vjp(
            parts, parts.q_a, p.matmul(grad_q_flat, w["q_b_proj.weight"]),
            "q_a_layernorm.weight")
        grads["q_a_proj.weight"] = _weight_grad(p, parts.x, grad_q_a)
    return grads


__all__ = ["weight_grads"]
