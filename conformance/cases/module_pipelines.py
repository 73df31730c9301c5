"""The spec's modules in float64 (or rounded like a naive implementation), around an attention.

``module_forward`` and ``module_backward`` compute a module case (``cases`` kind ``"module"``)
from its inputs and weights (arrays ``w:<name>``): the projections, the head split and merge and
the output projection by hand, and the attention itself through a given function — the float64
reference (expected values) or the naive pipeline (the error baseline). The backward pass is the
projections' chain rule around the attention's VJP: what a module's ``parameter_gradients``
must return (the ``grad_weights`` step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import reference
from .catalogue import CaseData
from .naive import Precision

#: ``(arrays, options, precision) -> Steps``: the reference or the naive attention.
Attend = Callable[[dict[str, np.ndarray], dict[str, Any], Precision], reference.Steps]
#: ``(arrays with grad_output, options, precision) -> Grads``.
AttendVjp = Callable[[dict[str, np.ndarray], dict[str, Any], Precision], reference.Grads]

SINGLE_HEAD = ("SelfAttention", "CausalSelfAttention", "CrossAttention")


def _f64(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def _weights(data: CaseData) -> dict[str, np.ndarray]:
    return {n[2:]: _f64(x) for n, x in data.arrays.items() if n.startswith("w:")}


def _attention_arrays(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: Any = None,
                      grad_output: Any = None, sinks: Any = None) -> dict[str, np.ndarray]:
    arrays = {"query": q, "key": k, "value": v}
    if sinks is not None:  # MultiHeadAttention(sinks=True)'s weight w:sinks (num_heads,)
        arrays["sinks"] = sinks
    if mask is not None:
        arrays["mask"] = mask
    if grad_output is not None:
        arrays["grad_output"] = grad_output
    return arrays


def _single_head_inputs(data: CaseData) -> tuple[np.ndarray, np.ndarray]:
    a, name = data.arrays, data.options["module"]
    x1 = _f64(a["x_1"] if name == "CrossAttention" else a["x"])
    x2 = _f64(a["x_2"]) if name == "CrossAttention" else x1
    return x1, x2


class _MultiHead:
    """MultiHeadAttention's projections: ``(..., seq, d_model)`` ↔ ``(..., heads, seq, hd)``."""

    def __init__(self, data: CaseData, p: Precision) -> None:
        init = data.options["init"]
        self.p, self.w = p, _weights(data)
        self.heads = init["num_heads"]
        self.kv_heads = init.get("num_kv_heads") or self.heads
        self.head_dim = init["d_model"] // self.heads
        self.x = _f64(data.arrays["x"])
        self.context = _f64(data.arrays["context"]) if "context" in data.arrays else self.x
        self.mask = data.arrays.get("mask")
        self.options = {k: v for k, v in data.options["forward"].items()
                        if k != "return_weights"}

    def project(self, t: np.ndarray, name: str, heads: int) -> np.ndarray:
        """``t @ W_name + b_name`` split into heads: ``(..., heads, seq, head_dim)``."""
        y = self.p.matmul(t, self.w[f"W_{name}"])
        if f"b_{name}" in self.w:
            y = self.p.round(y + self.w[f"b_{name}"])
        return np.swapaxes(y.reshape(y.shape[:-1] + (heads, self.head_dim)), -2, -3)

    @staticmethod
    def join(t: np.ndarray) -> np.ndarray:
        """``(..., heads, seq, head_dim)`` → ``(..., seq, heads·head_dim)``."""
        t = np.swapaxes(t, -2, -3)
        return t.reshape(t.shape[:-2] + (-1,))

    def qkv(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The projected query, key and value heads."""
        return (self.project(self.x, "query", self.heads),
                self.project(self.context, "key", self.kv_heads),
                self.project(self.context, "value", self.kv_heads))


def module_forward(data: CaseData, p: Precision, attend: Attend) -> dict[str, np.ndarray]:
    """A module's forward around ``attend``: ``{"output": (..., q_len, d_out)}``, plus
    ``"output_weights" (..., heads, q_len, kv_len)`` for ``forward(return_weights=True)``."""
    name = data.options["module"]
    w = _weights(data)
    if name in SINGLE_HEAD:
        x1, x2 = _single_head_inputs(data)
        q, k, v = p.matmul(x1, w["W_query"]), p.matmul(x2, w["W_key"]), p.matmul(x2, w["W_value"])
        steps = attend(_attention_arrays(q, k, v), {"is_causal": name == "CausalSelfAttention"}, p)
        return {"output": steps.output}
    if name == "MultiHeadAttentionWrapper":
        x = _f64(data.arrays["x"])
        outs = []
        for h in range(data.options["init"]["num_heads"]):
            q, k, v = (p.matmul(x, w[f"heads.{h}.W_{n}"]) for n in ("query", "key", "value"))
            outs.append(attend(_attention_arrays(q, k, v), {}, p).output)
        return {"output": np.concatenate(outs, axis=-1)}
    if name == "MultiHeadAttention":
        mha = _MultiHead(data, p)
        steps = attend(_attention_arrays(*mha.qkv(), mha.mask, sinks=w.get("sinks")),
                       mha.options, p)
        out = p.matmul(mha.join(steps.output), w["W_out"])
        if "b_out" in w:
            out = p.round(out + w["b_out"])
        result = {"output": out}
        if data.options["forward"].get("return_weights"):
            result["output_weights"] = steps.weights
        return result
    raise ValueError(f"module_forward: unknown module {name!r}")


def _projection_grad(x: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """Gradient of ``W`` in ``y = x @ W``: ``xᵀ dy`` over every leading axis."""
    return x.reshape(-1, x.shape[-1]).T @ grad.reshape(-1, grad.shape[-1])


def module_backward(data: CaseData, p: Precision, attend: Attend,
                    attend_vjp: AttendVjp) -> dict[str, np.ndarray]:
    """Every weight's gradient of a module against ``data.arrays["grad_output"]``: weight name
    → array shaped like the weight."""
    name = data.options["module"]
    w = _weights(data)
    g = _f64(data.arrays["grad_output"])

    def single_head(x1: np.ndarray, x2: np.ndarray, grad: np.ndarray, prefix: str = "",
                    **options: Any) -> dict[str, np.ndarray]:
        q, k, v = (p.matmul(x, w[f"{prefix}W_{n}"])
                   for x, n in ((x1, "query"), (x2, "key"), (x2, "value")))
        grads = attend_vjp(_attention_arrays(q, k, v, grad_output=grad), options, p)
        return {f"{prefix}W_query": p.round(_projection_grad(x1, grads.query)),
                f"{prefix}W_key": p.round(_projection_grad(x2, grads.key)),
                f"{prefix}W_value": p.round(_projection_grad(x2, grads.value))}

    if name in SINGLE_HEAD:
        x1, x2 = _single_head_inputs(data)
        return single_head(x1, x2, g, is_causal=name == "CausalSelfAttention")
    if name == "MultiHeadAttentionWrapper":
        x = _f64(data.arrays["x"])
        result: dict[str, np.ndarray] = {}
        for h, grad in enumerate(np.split(g, data.options["init"]["num_heads"], axis=-1)):
            result.update(single_head(x, x, grad, prefix=f"heads.{h}."))
        return result
    mha = _MultiHead(data, p)
    q, k, v = mha.qkv()
    steps = attend(_attention_arrays(q, k, v, mha.mask, sinks=w.get("sinks")), mha.options, p)
    result = {"W_out": p.round(_projection_grad(mha.join(steps.output), g))}
    grad_heads = p.round(g @ w["W_out"].T)  # (..., q_len, heads·head_dim)
    grad_heads = np.swapaxes(grad_heads.reshape(g.shape[:-1] + (mha.heads, mha.head_dim)), -2, -3)
    grads = attend_vjp(_attention_arrays(q, k, v, mha.mask, grad_heads, w.get("sinks")),
                       mha.options, p)
    for n, source, grad in (("query", mha.x, grads.query), ("key", mha.context, grads.key),
                            ("value", mha.context, grads.value)):
        joined = mha.join(grad)
        result[f"W_{n}"] = p.round(_projection_grad(source, joined))
        if f"b_{n}" in w:
            result[f"b_{n}"] = p.round(joined.reshape(-1, joined.shape[-1]).sum(axis=0))
    if "b_out" in w:
        result["b_out"] = p.round(g.reshape(-1, g.shape[-1]).sum(axis=0))
    if "sinks" in w:
        result["sinks"] = p.round(grads.sinks)
    return result


def flatten_weight_grads(grads: dict[str, Any]) -> np.ndarray:
    """One vector of every weight gradient, in sorted name order (the ``grad_weights`` step)."""
    return np.concatenate([np.asarray(grads[n], dtype=np.float64).ravel() for n in sorted(grads)])


__all__ = ["Attend", "AttendVjp", "flatten_weight_grads", "module_backward", "module_forward"]
