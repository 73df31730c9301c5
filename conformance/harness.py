"""The conformance engine: run cases through implementations, step by step, against float64.

For one case in one dtype the harness computes, once:

* the **expected** value of every step, from ``conformance.reference`` in float64 on the
  dtype-cast inputs (for modules: the projections in float64 around the reference);
* the **baseline error** of every step: the largest error of a straightforward implementation
  in that dtype (the same float64 pipeline with every intermediate rounded to the dtype, see
  ``naive_pipeline``), measured in the same run;

then runs every column (spec backend, user backend or peer) and compares each step with the
flash-attention rule of ``spec.TOLERANCES``::

    |actual - expected| <= atol + rtol·|expected| + k · baseline_error

A cell's number is the worst ``|actual - expected| / bound`` over its steps: below 1 passes.
Masked scores must be exactly ``-inf`` where the reference masks, masked weights exactly 0 and
fully masked rows exactly 0. When a spec backend fails, ``diagnose`` re-runs the reference with
common mistakes planted (flipped mask polarity, the other causal alignment, ``h % kv_heads``
grouping …) and names the one that reproduces the backend's result.

Steps are data (``STEPS``): a step has a name, the case kinds it applies to and how to run it on
a backend; expected and baseline values come from the pipelines by the same name. Adding a step
such as ``grad_q`` means adding one ``Step`` and one entry to each pipeline's result.
"""

from __future__ import annotations

import fnmatch
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import backends as backends_mod
from . import cases as cases_mod
from . import reference, spec
from .backends import Backend, numpy_dtype
from .cases import Case, CaseData

SPEC_COMPUTE = spec.COMPUTE_DTYPE

# ------------------------------------------------------------------------------ pipelines


def rounder(dtype: str) -> Callable[[np.ndarray], np.ndarray]:
    """Round float64 values to ``dtype`` and back (identity for float64)."""
    if dtype == "float64":
        return lambda x: np.asarray(x, dtype=np.float64)
    target = numpy_dtype(dtype)
    return lambda x: np.asarray(x, dtype=np.float64).astype(target).astype(np.float64)


def _sdpa_options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k in cases_mod.SDPA_OPTIONS}


def _sdpa_arrays(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in arrays.items() if k in cases_mod.SDPA_ARRAYS}


def _f64(x: np.ndarray | None) -> np.ndarray | None:
    return None if x is None else np.asarray(x).astype(np.float64)


def naive_attention(arrays: dict[str, np.ndarray], options: dict[str, Any],
                    r: Callable[[np.ndarray], np.ndarray]) -> reference.Steps:
    """The spec's pipeline with every intermediate rounded by ``r`` (a naive low-precision
    implementation; with the identity it equals the float64 reference)."""
    q, k, v = (_f64(arrays[n]) for n in ("query", "key", "value"))
    heads = q.shape[-3] if q.ndim >= 3 else 1
    k, v = reference._repeat_kv(k, heads), reference._repeat_kv(v, heads)
    scale = options.get("scale")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    scores = r(r(np.einsum("...qd,...kd->...qk", q, k)) * scale)
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
    masked = np.where(allowed, masked, -np.inf)
    keeps = allowed.any(-1, keepdims=True)
    row_max = np.where(keeps, np.max(np.where(allowed, masked, -1e308), -1, keepdims=True), 0.0)
    exp = np.where(allowed, r(np.exp(r(np.where(allowed, masked, 0.0) - row_max))), 0.0)
    total = r(exp.sum(-1, keepdims=True))
    weights = np.where(keeps, r(exp / np.where(total == 0, 1.0, total)), 0.0)
    kept = weights
    if options.get("dropout_p", 0.0) > 0:
        kept = r(weights * np.asarray(arrays["dropout_mask"], bool) / (1.0 - options["dropout_p"]))
    output = r(np.einsum("...qk,...kd->...qd", kept, v))
    return reference.Steps(scores=scores, masked_scores=masked, weights=weights, output=output)


def naive_attention_vjp(arrays: dict[str, np.ndarray], options: dict[str, Any],
                        r: Callable[[np.ndarray], np.ndarray]) -> reference.Grads:
    """The backward pass (FlashAttention's formulas) as a straightforward low-precision
    implementation: sums accumulate in the compute dtype (float32 for float32 and the half
    types), every intermediate is rounded by ``r``. The error baseline of the gradient steps."""
    steps = naive_attention(arrays, options, r)
    acc = np.float64 if r(np.float64(1 + 2**-40)) != 1.0 else np.float32

    def mm(subscripts: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return r(np.einsum(subscripts, a.astype(acc), b.astype(acc)).astype(np.float64))

    q, k, v = (_f64(arrays[n]) for n in ("query", "key", "value"))
    d_out = _f64(arrays["grad_output"])
    heads = q.shape[-3] if q.ndim >= 3 else 1
    k_rep, v_rep = reference._repeat_kv(k, heads), reference._repeat_kv(v, heads)
    scale = options.get("scale")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    weights, kept, keep = steps.weights, steps.weights, 1.0
    dropout_p = options.get("dropout_p", 0.0)
    if dropout_p > 0:
        keep = np.asarray(arrays["dropout_mask"], bool) / (1.0 - dropout_p)
        kept = r(weights * keep)
    grad_v = mm("...qk,...qd->...kd", kept, d_out)
    grad_w = r(mm("...qd,...kd->...qk", d_out, v_rep) * keep)
    row = r((d_out.astype(acc) * steps.output.astype(acc)).sum(-1, keepdims=True))  # rowsum(dO⊙O)
    grad_s = r(weights * r(grad_w - row))
    bias = arrays.get("bias")
    grad_bias = None if bias is None else r(reference._unbroadcast(grad_s, np.shape(bias)))
    softcap = options.get("softcap")
    if softcap is not None:
        grad_s = r(grad_s * r(1.0 - r(r(steps.scores / softcap) ** 2)))
    grad_s = r(grad_s * scale)
    grad_q = mm("...qk,...kd->...qd", grad_s, k_rep)
    grad_k = mm("...qk,...qd->...kd", grad_s, q)
    return reference.Grads(query=grad_q, key=r(reference._fold_kv(grad_k, k.shape)),
                           value=r(reference._fold_kv(grad_v, v.shape)), bias=grad_bias)


def _reference_attention_vjp(arrays: dict[str, np.ndarray], options: dict[str, Any],
                             r: Callable[[np.ndarray], np.ndarray]) -> reference.Grads:
    sdpa = _sdpa_arrays(arrays)
    extra = {n: sdpa[n] for n in ("mask", "bias", "dropout_mask") if n in sdpa}
    return reference.attention_vjp(sdpa["query"], sdpa["key"], sdpa["value"],
                                   arrays["grad_output"], **extra, **_sdpa_options(options))


def grad_output_for(arrays: dict[str, np.ndarray], dtype: str) -> np.ndarray:
    """The output cotangent of a case: seeded, shaped like the output, in ``dtype``."""
    q, v = arrays["query"], arrays["value"]
    shape = q.shape[:-1] + v.shape[-1:]
    return np.random.default_rng(GRAD_SEED).standard_normal(shape).astype(numpy_dtype(dtype))


GRAD_SEED = 20261130
GRAD_STEPS = ("grad_query", "grad_key", "grad_value", "grad_bias")


def _reference_attention(arrays: dict[str, np.ndarray], options: dict[str, Any],
                         r: Callable[[np.ndarray], np.ndarray]) -> reference.Steps:
    return reference.attention(**_sdpa_arrays(arrays), **_sdpa_options(options))


def _module_forward(data: CaseData, r: Callable[[np.ndarray], np.ndarray],
                    attention: Callable[..., reference.Steps]) -> dict[str, np.ndarray]:
    """A spec module's forward in float64 around ``attention`` (reference or naive)."""
    a, opts = data.arrays, data.options
    w = {n[2:]: _f64(x) for n, x in a.items() if n.startswith("w:")}
    name = opts["module"]

    def sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray, **kw: Any) -> reference.Steps:
        arrays = {"query": q, "key": k, "value": v}
        if kw.get("mask") is not None:
            arrays["mask"] = kw.pop("mask")
        kw.pop("mask", None)
        return attention(arrays, kw, r)

    if name in ("SelfAttention", "CausalSelfAttention", "CrossAttention"):
        x1 = _f64(a["x_1"] if name == "CrossAttention" else a["x"])
        x2 = _f64(a["x_2"]) if name == "CrossAttention" else x1
        q, k, v = r(x1 @ w["W_query"]), r(x2 @ w["W_key"]), r(x2 @ w["W_value"])
        steps = sdpa(q, k, v, is_causal=name == "CausalSelfAttention")
        return {"output": steps.output}
    if name == "MultiHeadAttentionWrapper":
        x = _f64(a["x"])
        outs = []
        for h in range(opts["init"]["num_heads"]):
            q, k, v = (r(x @ w[f"heads.{h}.W_{n}"]) for n in ("query", "key", "value"))
            outs.append(sdpa(q, k, v).output)
        return {"output": np.concatenate(outs, axis=-1)}
    if name == "MultiHeadAttention":
        init, fwd = opts["init"], opts["forward"]
        heads, kv_heads = init["num_heads"], init.get("num_kv_heads") or init["num_heads"]
        head_dim = init["d_model"] // heads
        x = _f64(a["x"])
        ctx = _f64(a["context"]) if "context" in a else x

        def project(t: np.ndarray, n: str, nh: int) -> np.ndarray:
            p = r(t @ w[f"W_{n}"])
            if f"b_{n}" in w:
                p = r(p + w[f"b_{n}"])
            return np.swapaxes(p.reshape(p.shape[:-1] + (nh, head_dim)), -2, -3)

        steps = sdpa(project(x, "query", heads), project(ctx, "key", kv_heads),
                     project(ctx, "value", kv_heads), mask=a.get("mask"),
                     **{k: v for k, v in fwd.items() if k != "return_weights"})
        merged = np.swapaxes(steps.output, -2, -3)
        merged = merged.reshape(merged.shape[:-2] + (-1,))
        out = r(merged @ w["W_out"])
        if "b_out" in w:
            out = r(out + w["b_out"])
        result = {"output": out}
        if fwd.get("return_weights"):
            result["output_weights"] = steps.weights
        return result
    raise KeyError(f"unknown module {name!r}")


def _projection_grad(x: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """Gradient of ``W`` in ``y = x @ W``: ``xᵀ dy`` over every leading axis."""
    return x.reshape(-1, x.shape[-1]).T @ grad.reshape(-1, grad.shape[-1])


def _module_backward(data: CaseData, r: Callable[[np.ndarray], np.ndarray],
                     attention: Callable[..., reference.Steps],
                     vjp: Callable[..., reference.Grads]) -> dict[str, np.ndarray]:
    """Every weight's gradient of a spec module against ``grad_output``, in float64 (reference
    VJP) or rounded (naive VJP): the projections' chain rule around the attention's VJP."""
    a, opts = data.arrays, data.options
    w = {n[2:]: _f64(x) for n, x in a.items() if n.startswith("w:")}
    g = _f64(a["grad_output"])
    name = opts["module"]

    def attend_vjp(q: np.ndarray, k: np.ndarray, v: np.ndarray, grad: np.ndarray,
                   **kw: Any) -> reference.Grads:
        arrays = {"query": q, "key": k, "value": v, "grad_output": grad}
        if kw.get("mask") is not None:
            arrays["mask"] = kw["mask"]
        kw.pop("mask", None)
        return vjp(arrays, kw, r)

    def single_head(x1: np.ndarray, x2: np.ndarray, grad: np.ndarray, prefix: str = "",
                    **kw: Any) -> dict[str, np.ndarray]:
        q, k, v = (r(x @ w[f"{prefix}W_{n}"]) for x, n in
                   ((x1, "query"), (x2, "key"), (x2, "value")))
        grads = attend_vjp(q, k, v, grad, **kw)
        return {f"{prefix}W_query": r(_projection_grad(x1, grads.query)),
                f"{prefix}W_key": r(_projection_grad(x2, grads.key)),
                f"{prefix}W_value": r(_projection_grad(x2, grads.value))}

    if name in ("SelfAttention", "CausalSelfAttention", "CrossAttention"):
        x1 = _f64(a["x_1"] if name == "CrossAttention" else a["x"])
        x2 = _f64(a["x_2"]) if name == "CrossAttention" else x1
        return single_head(x1, x2, g, is_causal=name == "CausalSelfAttention")
    if name == "MultiHeadAttentionWrapper":
        x = _f64(a["x"])
        heads = opts["init"]["num_heads"]
        result: dict[str, np.ndarray] = {}
        for h, grad in enumerate(np.split(g, heads, axis=-1)):
            result.update(single_head(x, x, grad, prefix=f"heads.{h}."))
        return result
    init, fwd = opts["init"], opts["forward"]
    heads, kv_heads = init["num_heads"], init.get("num_kv_heads") or init["num_heads"]
    head_dim = init["d_model"] // heads
    x = _f64(a["x"])
    ctx = _f64(a["context"]) if "context" in a else x

    def project(t: np.ndarray, n: str, nh: int) -> np.ndarray:
        p = r(t @ w[f"W_{n}"])
        if f"b_{n}" in w:
            p = r(p + w[f"b_{n}"])
        return np.swapaxes(p.reshape(p.shape[:-1] + (nh, head_dim)), -2, -3)

    def join(t: np.ndarray) -> np.ndarray:  # (..., heads, seq, head_dim) → (..., seq, heads·hd)
        t = np.swapaxes(t, -2, -3)
        return t.reshape(t.shape[:-2] + (-1,))

    q, k, v = project(x, "query", heads), project(ctx, "key", kv_heads), project(
        ctx, "value", kv_heads)
    options = {key: val for key, val in fwd.items() if key != "return_weights"}
    steps = attention({"query": q, "key": k, "value": v, **(
        {"mask": a["mask"]} if "mask" in a else {})}, options, r)
    result = {"W_out": r(_projection_grad(join(steps.output), g))}
    grad_split = np.swapaxes(r(g @ w["W_out"].T).reshape(g.shape[:-1] + (heads, head_dim)),
                             -2, -3)
    grads = attend_vjp(q, k, v, grad_split, mask=a.get("mask"), **options)
    for n, source, grad in (("query", x, grads.query), ("key", ctx, grads.key),
                            ("value", ctx, grads.value)):
        joined = join(grad)
        result[f"W_{n}"] = r(_projection_grad(source, joined))
        if f"b_{n}" in w:
            result[f"b_{n}"] = r(joined.reshape(-1, joined.shape[-1]).sum(axis=0))
    if "b_out" in w:
        result["b_out"] = r(g.reshape(-1, g.shape[-1]).sum(axis=0))
    return result


def flatten_weight_grads(grads: dict[str, Any]) -> np.ndarray:
    """One vector of every weight gradient, in sorted name order (the ``grad_weights`` step)."""
    return np.concatenate([np.asarray(grads[n], dtype=np.float64).ravel() for n in sorted(grads)])


def pipeline(data: CaseData, kind: str, dtype: str, naive: bool) -> dict[str, np.ndarray]:
    """Every step's value: the float64 reference (``naive=False``) or the rounded baseline."""
    r = rounder(dtype) if naive else rounder("float64")
    attention = naive_attention if naive else _reference_attention
    if kind == "module":
        result = _module_forward(data, r, attention)
        if data.options.get("decode"):
            result["decode_output"] = result["output"]  # decoding equals the causal forward
        if "grad_output" in data.arrays:
            vjp = naive_attention_vjp if naive else _reference_attention_vjp
            result["grad_weights"] = flatten_weight_grads(
                _module_backward(data, r, attention, vjp))
        return result
    steps = attention(data.arrays, data.options, r)
    values = {"scores": steps.scores, "masked_scores": steps.masked_scores,
              "weights": steps.weights, "output": steps.output, "output_weights": steps.weights}
    if "grad_output" in data.arrays:
        vjp = naive_attention_vjp if naive else _reference_attention_vjp
        grads = vjp(data.arrays, data.options, r)
        for name in GRAD_STEPS:
            value = getattr(grads, name.removeprefix("grad_"))
            if value is not None:
                values[name] = value
    if blockwise_applies(data):
        values["blockwise_output"] = values["output"]
        if dtype in BLOCKWISE_GRAD_DTYPES:
            for name in GRAD_STEPS:
                if name in values:
                    values[f"blockwise_{name}"] = values[name]
    return values


#: The blockwise backward is compared in these dtypes (its half-precision gradients are tested
#: by tests/test_blockwise.py): each further dtype costs JAX a compile of two scans per case,
#: and the default run must stay near two minutes on two cores.
BLOCKWISE_GRAD_DTYPES = ("float64", "float32")


def blockwise_applies(data: CaseData) -> bool:
    """``blockwise_attention`` expresses the case: masks only as structure or ``kv_lengths``,
    no dropout."""
    a = data.arrays
    return ("mask" not in a or "kv_lengths" in a) and "dropout_mask" not in a


# ------------------------------------------------------------------------------ expectations


@dataclass
class Expected:
    """What one case in one dtype must give: float64 values, baseline errors, exact zeros."""

    case: str
    kind: str
    dtype: str
    data: CaseData  # inputs, already in dtype
    values: dict[str, np.ndarray]
    baseline: dict[str, float]  # largest error of the naive implementation in dtype
    zeros: dict[str, np.ndarray] = field(default_factory=dict)  # positions that must be 0


def _baseline_error(naive: np.ndarray, ref: np.ndarray, r: Callable[[np.ndarray], np.ndarray]
                    ) -> float:
    """Largest error of the naive result; where the naive implementation overflows (not
    finite where the reference is), the error of rounding the reference itself to the dtype."""
    finite = np.isfinite(ref)
    if not finite.any():
        return 0.0
    if not np.isfinite(naive[finite]).all():
        rounded = r(ref[finite])
        ok = np.isfinite(rounded)
        return float(np.max(np.abs(rounded[ok] - ref[finite][ok]), initial=0.0))
    return float(np.max(np.abs(naive[finite] - ref[finite])))


def expected_for(data: CaseData, kind: str, dtype: str, case: str = "") -> Expected:
    """Reference values, baseline errors and required zeros for dtype-cast inputs ``data``."""
    if "grad_output" not in data.arrays:  # a new CaseData: callers keep theirs
        if kind == "sdpa":
            grad_output = grad_output_for(data.arrays, dtype)
        else:
            with np.errstate(all="ignore"):
                shape = _module_forward(data, rounder("float64"), _reference_attention)[
                    "output"].shape
            grad_output = np.random.default_rng(GRAD_SEED).standard_normal(shape).astype(
                numpy_dtype(dtype))
        data = CaseData({**data.arrays, "grad_output": grad_output}, data.options)
    with np.errstate(all="ignore"):
        values = pipeline(data, kind, dtype, naive=False)
        naive = pipeline(data, kind, dtype, naive=True)
    r = rounder(dtype)
    baseline = {n: _baseline_error(naive[n], values[n], r) for n in values}
    zeros: dict[str, np.ndarray] = {}
    if kind == "sdpa":
        masked = np.isneginf(values["masked_scores"])
        zeros["weights"] = zeros["output_weights"] = masked
        empty = masked.all(-1, keepdims=True)
        zeros["output"] = np.broadcast_to(empty, values["output"].shape)
        zeros["grad_query"] = np.broadcast_to(empty, values["grad_query"].shape)
        for name in ("output", "grad_query"):
            if f"blockwise_{name}" in values:
                zeros[f"blockwise_{name}"] = zeros[name]
    return Expected(case, kind, dtype, data, values, baseline, zeros)


def expected(case: Case, dtype: str) -> Expected:
    """``expected_for`` the case's inputs cast to ``dtype``."""
    return expected_for(cases_mod.prepare_inputs(case, dtype), case.kind, dtype, case.name)


# ------------------------------------------------------------------------------ running


class NotApplicable(Exception):
    """A column cannot express a case (e.g. a peer without soft-capping)."""


class Execution:
    """One column (backend) on one case in one dtype; results cached per call."""

    def __init__(self, backend: Backend, exp: Expected) -> None:
        self.backend = backend
        self.exp = exp
        self._cache: dict[str, Any] = {}

    @property
    def module(self) -> Any:
        """The backend's package."""
        return self.backend.module

    def to_backend(self, x: Any) -> Any:
        """NumPy array → backend array; other values unchanged."""
        return self.backend.asarray(x) if isinstance(x, np.ndarray) else x

    def call(self, fn_name: str, *args: Any, **kwargs: Any) -> Any:
        """``module.fn_name`` on NumPy inputs; array results back as NumPy."""
        fn = getattr(self.module, fn_name)
        result = fn(*(self.to_backend(a) for a in args),
                    **{k: self.to_backend(v) for k, v in kwargs.items()})
        if isinstance(result, tuple):
            return tuple(self.backend.to_numpy(x) for x in result)
        return self.backend.to_numpy(result)

    def compute_input(self, step: str) -> np.ndarray:
        """The reference value of ``step`` in the compute dtype (input of the next step)."""
        return self.exp.values[step].astype(numpy_dtype(SPEC_COMPUTE[self.exp.dtype]))

    def sdpa(self) -> tuple[np.ndarray, np.ndarray]:
        """``scaled_dot_product_attention(..., return_weights=True)``, once."""
        if "sdpa" not in self._cache:
            a, o = self.exp.data.arrays, self.exp.data.options
            extra = {k: v for k, v in a.items() if k in ("mask", "bias", "dropout_mask")}
            self._cache["sdpa"] = self.call(
                "scaled_dot_product_attention", a["query"], a["key"], a["value"],
                **extra, **_sdpa_options(o), return_weights=True)
        return self._cache["sdpa"]

    def vjp(self) -> tuple[np.ndarray | None, ...]:
        """``scaled_dot_product_attention_vjp(...)`` against the case's grad_output, once."""
        if "vjp" not in self._cache:
            a, o = self.exp.data.arrays, self.exp.data.options
            extra = {k: v for k, v in a.items() if k in ("mask", "bias", "dropout_mask")}
            grads = self.module.scaled_dot_product_attention_vjp(
                *(self.to_backend(a[n]) for n in ("query", "key", "value", "grad_output")),
                **{k: self.to_backend(v) for k, v in extra.items()}, **_sdpa_options(o))
            self._cache["vjp"] = tuple(
                None if g is None else self.backend.to_numpy(g) for g in grads)
        return self._cache["vjp"]

    def _blockwise_args(self) -> tuple[list[Any], dict[str, Any]]:
        a, o = self.exp.data.arrays, self.exp.data.options
        options = _sdpa_options(o)
        options.update({k: a[k] for k in ("bias", "kv_lengths") if k in a})
        options.update(cases_mod.BLOCKWISE_TILES)
        return [a["query"], a["key"], a["value"]], options

    def blockwise(self) -> np.ndarray:
        """``blockwise_attention(...)`` with small tiles, once."""
        if "blockwise" not in self._cache:
            args, options = self._blockwise_args()
            self._cache["blockwise"] = self.call("blockwise_attention", *args, **options)
        return self._cache["blockwise"]

    def blockwise_vjp(self) -> tuple[np.ndarray | None, ...]:
        """``blockwise_attention_vjp(...)`` against the case's grad_output, once."""
        if "blockwise_vjp" not in self._cache:
            args, options = self._blockwise_args()
            grads = self.module.blockwise_attention_vjp(
                *(self.to_backend(x) for x in args + [self.exp.data.arrays["grad_output"]]),
                **{k: self.to_backend(v) for k, v in options.items()})
            self._cache["blockwise_vjp"] = tuple(
                None if g is None else self.backend.to_numpy(g) for g in grads)
        return self._cache["blockwise_vjp"]

    def _build_module(self) -> Any:
        a, o = self.exp.data.arrays, self.exp.data.options
        cls = getattr(self.module, o["module"])
        m = cls(**o["init"], rng=self.backend.rng(cases_mod.get(self.exp.case).seed)
                if self.exp.case in cases_mod.CASE_NAMES else self.backend.rng(0))
        if hasattr(m, "eval"):
            m = m.eval() or m
        return m.load_weights({n[2:]: x for n, x in a.items() if n.startswith("w:")})

    def module_backward(self) -> np.ndarray:
        """The module's ``backward`` (weight gradients), flattened in sorted name order, once."""
        if "backward" not in self._cache:
            a, o = self.exp.data.arrays, self.exp.data.options
            m = self._build_module()
            inputs = [self.to_backend(a[n]) for n in ("x", "x_1", "x_2") if n in a]
            grad_output = self.to_backend(a["grad_output"])
            if o["module"] == "MultiHeadAttention":
                kwargs = {k: v for k, v in o["forward"].items() if k != "return_weights"}
                if "mask" in a:
                    kwargs["mask"] = self.to_backend(a["mask"])
                context = self.to_backend(a["context"]) if "context" in a else None
                grads = m.backward(inputs[0], grad_output, context, **kwargs)
            else:
                grads = m.backward(*inputs, grad_output)
            self._cache["backward"] = flatten_weight_grads(grads)
        return self._cache["backward"]

    def module_decode(self) -> np.ndarray:
        """Decode ``x`` chunk by chunk with the module's ``decode`` and a KV cache, once."""
        if "decode" not in self._cache:
            m = self._build_module()
            x = self.exp.data.arrays["x"]
            cache, outputs, start = None, [], 0
            for n in self.exp.data.options["decode"]:
                chunk = self.to_backend(np.ascontiguousarray(x[..., start:start + n, :]))
                out, cache = m.decode(chunk, cache, max_len=x.shape[-2])
                outputs.append(self.backend.to_numpy(out))
                start += n
            self._cache["decode"] = np.concatenate(outputs, axis=-2)
        return self._cache["decode"]

    def module_forward(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Build the case's module in the backend, load its weights, run forward, once."""
        if "module" not in self._cache:
            a, o = self.exp.data.arrays, self.exp.data.options
            m = self._build_module()
            inputs = [a[n] for n in ("x", "x_1", "x_2", "context") if n in a]
            kwargs = {"mask": a["mask"]} if "mask" in a else {}
            kwargs.update(o["forward"])
            result = m.forward(*(self.to_backend(x) for x in inputs),
                               **{k: self.to_backend(v) for k, v in kwargs.items()})
            if isinstance(result, tuple):
                out, weights = (self.backend.to_numpy(x) for x in result)
            else:
                out, weights = self.backend.to_numpy(result), None
            self._cache["module"] = (out, weights)
        return self._cache["module"]


@dataclass(frozen=True)
class Step:
    """One compared step: its name, the case kinds it applies to, how a backend computes it,
    and the dtype the spec requires of the result (``"input"``, ``"compute"`` or None)."""

    name: str
    kinds: tuple[str, ...]
    run: Callable[[Execution], np.ndarray]
    result_dtype: str | None
    description: str


def _opts(exe: Execution, names: Iterable[str]) -> dict[str, Any]:
    a, o = exe.exp.data.arrays, exe.exp.data.options
    return {n: a[n] if n in a else o[n] for n in names if n in a or n in o}


def _run_scores(exe: Execution) -> np.ndarray:
    a = exe.exp.data.arrays
    return exe.call("attention_scores", a["query"], a["key"], **_opts(exe, ("scale", "softcap")))


def _run_masked(exe: Execution) -> np.ndarray:
    names = ("mask", "bias", "is_causal", "causal_alignment", "window")
    return exe.call("mask_scores", exe.compute_input("scores"), **_opts(exe, names))


def _run_weights(exe: Execution) -> np.ndarray:
    return exe.call("attention_weights", exe.compute_input("masked_scores"))


def _run_output(exe: Execution) -> np.ndarray:
    return exe.module_forward()[0] if exe.exp.kind == "module" else exe.sdpa()[0]


def _run_output_weights(exe: Execution) -> np.ndarray:
    if exe.exp.kind == "module":
        weights = exe.module_forward()[1]
        if weights is None:
            raise ValueError("forward(return_weights=True) returned no weights")
        return weights
    return exe.sdpa()[1]


def _grad_step(index: int) -> Callable[[Execution], np.ndarray]:
    def run(exe: Execution) -> np.ndarray:
        grad = exe.vjp()[index]
        if grad is None:
            raise ValueError(f"scaled_dot_product_attention_vjp returned no {GRAD_STEPS[index]}")
        return grad

    return run


def _blockwise_grad_step(index: int) -> Callable[[Execution], np.ndarray]:
    def run(exe: Execution) -> np.ndarray:
        grad = exe.blockwise_vjp()[index]
        if grad is None:
            raise ValueError(f"blockwise_attention_vjp returned no {GRAD_STEPS[index]}")
        return grad

    return run


STEPS: dict[str, Step] = {
    s.name: s
    for s in (
        Step("scores", ("sdpa",), _run_scores, "compute",
             "attention_scores(query, key, scale, softcap)"),
        Step("masked_scores", ("sdpa",), _run_masked, "compute",
             "mask_scores(reference scores, mask, bias, is_causal, causal_alignment, window)"),
        Step("weights", ("sdpa",), _run_weights, "compute",
             "attention_weights(reference masked scores)"),
        Step("output", ("sdpa", "module"), _run_output, "input",
             "scaled_dot_product_attention(...) output, or the module's forward"),
        Step("output_weights", ("sdpa", "module"), _run_output_weights, "input",
             "the weights scaled_dot_product_attention(..., return_weights=True) returns"),
        *(Step(name, ("sdpa",), _grad_step(i), "input",
               f"scaled_dot_product_attention_vjp(..., grad_output) -> {name}")
          for i, name in enumerate(GRAD_STEPS)),
        Step("blockwise_output", ("sdpa",), lambda exe: exe.blockwise(), "input",
             "blockwise_attention(..., block_q=2, block_kv=3): online softmax in tiles"),
        *(Step(f"blockwise_{name}", ("sdpa",), _blockwise_grad_step(i), "input",
               f"blockwise_attention_vjp(..., grad_output) -> {name}, recomputed per tile")
          for i, name in enumerate(GRAD_STEPS)),
        Step("decode_output", ("module",), lambda exe: exe.module_decode(), "input",
             "module.decode(x chunk, cache) chunk by chunk: equals the causal forward"),
        Step("grad_weights", ("module",), lambda exe: exe.module_backward(), None,
             "module.backward(inputs, grad_output): every weight's gradient, flattened in "
             "sorted name order"),
    )
}


def steps_for(exp: Expected, only: Iterable[str] | None = None) -> list[Step]:
    """The steps that apply to a case (those with an expected value), optionally restricted."""
    chosen = [s for s in STEPS.values() if exp.kind in s.kinds and s.name in exp.values]
    if only is not None:
        keep = set(only)
        chosen = [s for s in chosen if s.name in keep]
    return chosen


# ------------------------------------------------------------------------------ comparing


@dataclass
class StepResult:
    """One step of one cell: the worst error relative to its tolerance, and where."""

    step: str
    ratio: float  # worst |actual - expected| / bound; inf for a structural violation
    passed: bool
    index: tuple[int, ...] | None = None
    actual: float | None = None
    expected: float | None = None
    bound: float | None = None
    note: str = ""
    error: str = ""  # the backend raised


def tolerance(dtype: str) -> dict[str, float]:
    """``spec.TOLERANCES[dtype]``: k, atol, rtol."""
    return spec.TOLERANCES[dtype]


def compare(step: str, actual: Any, expected_value: np.ndarray, baseline: float, dtype: str,
            zeros: np.ndarray | None = None, result_dtype: str | None = None) -> StepResult:
    """Compare one step's result with the float64 reference under ``spec.TOLERANCES``."""
    actual = np.asarray(actual)
    if actual.shape != expected_value.shape:
        return StepResult(step, float("inf"), False,
                          note=f"shape {actual.shape}, expected {expected_value.shape}")
    tol = tolerance(dtype)
    measured = 0.0 if not np.isfinite(baseline) else baseline
    a = actual.astype(np.float64)
    e = expected_value
    with np.errstate(all="ignore"):
        bound = tol["atol"] + tol["rtol"] * np.abs(e) + tol["k"] * measured
        ratio = np.where(np.isfinite(e), np.abs(a - e) / bound, np.where(a == e, 0.0, np.inf))
    ratio = np.where(np.isnan(ratio), np.inf, ratio)  # NaN in the result
    note = ""
    if zeros is not None:
        nonzero = np.broadcast_to(zeros, a.shape) & (a != 0)
        if nonzero.any():
            ratio = np.where(nonzero, np.inf, ratio)
            note = "must be exactly 0 (masked position or fully masked row)"
    if ratio.size == 0:
        return StepResult(step, 0.0, True)
    flat = int(np.argmax(ratio))
    index = tuple(int(i) for i in np.unravel_index(flat, ratio.shape))
    worst = float(ratio.flat[flat])
    if not note and not np.isfinite(worst):
        if np.isnan(a.flat[flat]):
            note = "NaN where the reference is finite"
        elif np.isinf(e.flat[flat]):
            note = "the reference is -inf (masked) here"
        else:
            note = "non-finite value where the reference is finite"
    passed = worst <= 1.0
    if result_dtype is not None:
        want = np.dtype(numpy_dtype(dtype if result_dtype == "input" else SPEC_COMPUTE[dtype]))
        if actual.dtype != want:
            passed = False
            note = (note + "; " if note else "") + (
                f"dtype {actual.dtype.name}, the spec requires {want.name}")
    return StepResult(step, worst, passed, index, float(a.flat[flat]), float(e.flat[flat]),
                      float(np.broadcast_to(bound, e.shape).flat[flat]), note)


# ------------------------------------------------------------------------------ diagnosis


def _gqa_modulo(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    q, k = arrays["query"], arrays["key"]
    if q.ndim < 3 or k.shape[-3] in (1, q.shape[-3]):
        return None
    reps = q.shape[-3] // k.shape[-3]
    tile = [1] * k.ndim
    tile[-3] = reps
    return {**arrays, "key": np.tile(k, tile), "value": np.tile(arrays["value"], tile)}


Hypothesis = Callable[[dict[str, np.ndarray], dict[str, Any]],
                      "tuple[dict[str, np.ndarray], dict[str, Any]] | None"]


def _flip_mask(a: dict, o: dict) -> tuple[dict, dict] | None:
    return ({**a, "mask": ~np.asarray(a["mask"], bool)}, o) if a.get("mask") is not None else None


def _other_alignment(a: dict, o: dict) -> tuple[dict, dict] | None:
    if not (o.get("is_causal") or o.get("window")):
        return None
    bottom_right = o.get("causal_alignment", "top_left") == "bottom_right"
    other = "top_left" if bottom_right else "bottom_right"
    return a, {**o, "causal_alignment": other}


def _gqa(a: dict, o: dict) -> tuple[dict, dict] | None:
    tiled = _gqa_modulo(a)
    return (tiled, o) if tiled is not None else None


def _drop(name: str, default: Any = None) -> Hypothesis:
    def hyp(a: dict, o: dict) -> tuple[dict, dict] | None:
        if name in a:
            return {k: v for k, v in a.items() if k != name}, o
        if o.get(name) not in (None, default):
            return a, {k: v for k, v in o.items() if k != name}
        return None

    return hyp


def _no_rescale(a: dict, o: dict) -> tuple[dict, dict] | None:
    if not o.get("dropout_p"):
        return None
    p = o["dropout_p"]
    return {**a, "value": (np.asarray(a["value"], np.float64) * (1 - p))}, o


HYPOTHESES: tuple[tuple[str, Hypothesis], ...] = (
    ("mask polarity flipped: the implementation treats True as 'masked out'; the spec's True "
     "means 'may attend'", _flip_mask),
    ("wrong causal alignment: the result matches the other alignment (top-left is offset 0, "
     "bottom-right is offset kv_len - q_len)", _other_alignment),
    ("wrong grouped-query mapping: query head h uses kv head h % kv_heads; the spec uses "
     "h // (heads // kv_heads)", _gqa),
    ("the mask is ignored", _drop("mask")),
    ("the bias is ignored", _drop("bias")),
    ("the scale argument is ignored (head_dim ** -0.5 used)", _drop("scale")),
    ("soft-capping is skipped", _drop("softcap")),
    ("the dropout keep-mask is ignored", _drop("dropout_mask")),
    ("the window is ignored", _drop("window")),
    ("the causal rule is ignored", _drop("is_causal", False)),
    ("dropout survivors are not rescaled by 1 / (1 - dropout_p)", _no_rescale),
)


def diagnose(exp: Expected, step: str, actual: np.ndarray) -> str:
    """A plain-words reason for a failed step, found by replaying common mistakes."""
    if exp.kind != "sdpa" or step not in exp.values:
        return ""
    actual = np.asarray(actual).astype(np.float64)
    if actual.shape != exp.values[step].shape:
        return ""
    reasons = []
    a, o = exp.data.arrays, exp.data.options
    for text, hypothesis in HYPOTHESES:
        variant = hypothesis(a, o)
        if variant is None:
            continue
        try:
            with np.errstate(all="ignore"):
                alt = pipeline(CaseData(*variant), "sdpa", exp.dtype, naive=False)
        except Exception:  # noqa: BLE001 - a hypothesis that cannot run explains nothing
            continue
        res = compare(step, actual, alt[step], exp.baseline[step], exp.dtype)
        if res.passed and not np.array_equal(alt[step], exp.values[step], equal_nan=True):
            reasons.append(text)
            break
    ref = exp.values[step]
    if "output" in step or step == "weights":
        masked = exp.values["masked_scores"]
        empty = np.isneginf(masked).all(-1)  # (..., q_len)
        rows = actual if step != "output" else actual
        nan_rows = np.isnan(rows).any(-1)
        if empty.any() and nan_rows.any() and (nan_rows <= np.broadcast_to(empty, nan_rows.shape)
                                               ).all():
            reasons.append("fully masked rows give NaN (softmax of a row of -inf, 0 / 0); the "
                           "spec gives exactly 0")
        elif nan_rows.any() or np.isinf(actual[np.isfinite(ref)]).any():
            big = np.nanmax(np.abs(np.where(np.isfinite(masked), masked, 0)))
            if big > 80:
                reasons.append(f"non-finite values with logits up to {big:.3g}: the softmax "
                               "overflows (exp without subtracting the row maximum?)")
            else:
                reasons.append("non-finite values where the reference is finite")
        if step == "output" and empty.any() and not reasons:
            v = reference._repeat_kv(np.asarray(a["value"], np.float64),
                                     ref.shape[-3] if ref.ndim >= 3 else 1)
            mean_v = np.broadcast_to(v.mean(-2, keepdims=True), ref.shape)
            sel = np.broadcast_to(empty[..., None], ref.shape)
            if np.allclose(actual[sel], mean_v[sel], rtol=1e-2, atol=1e-2):
                reasons.append("fully masked rows give the mean of value (uniform weights); "
                               "the spec gives exactly 0")
    return "; ".join(reasons)


# ------------------------------------------------------------------------------ cells


@dataclass
class Cell:
    """One (case, dtype, column) of the report."""

    case: str
    dtype: str
    column: str
    status: str  # ok | FAIL | known | n/a | error
    ratio: float | None = None
    steps: list[StepResult] = field(default_factory=list)
    detail: str = ""  # error text, n/a reason, known-difference text or diagnosis
    spec_backend: bool = True
    rerun: str = ""

    @property
    def failed(self) -> bool:
        """True when this cell makes the run fail (a spec backend that did not pass)."""
        return self.spec_backend and self.status not in ("ok", "n/a")

    def worst_step(self) -> StepResult | None:
        """The step with the largest ratio (or the first error)."""
        bad = [s for s in self.steps if s.error] or self.steps
        return max(bad, key=lambda s: s.ratio if not s.error else np.inf) if bad else None


def rerun_command(case: str, dtype: str, column: str) -> str:
    """The command that reruns one cell."""
    return f"python -m conformance --case {case} --dtype {dtype} --backend {column}"


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def run_cell(backend: Backend, exp: Expected, *, column: str | None = None,
             steps: Iterable[str] | None = None) -> Cell:
    """Run every applicable step of one case on one backend and compare each."""
    column = column or backend.name
    cell = Cell(exp.case, exp.dtype, column, "ok", 0.0,
                rerun=rerun_command(exp.case, exp.dtype, column))
    exe = Execution(backend, exp)
    for step in steps_for(exp, steps):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with np.errstate(all="ignore"):
                    actual = step.run(exe)
        except NotApplicable as exc:
            cell.status, cell.detail, cell.ratio = "n/a", str(exc), None
            return cell
        except Exception as exc:  # noqa: BLE001 - any failure of a backend is a result
            cell.steps.append(StepResult(step.name, float("inf"), False, error=_error_text(exc)))
            continue
        with np.errstate(all="ignore"):
            res = compare(step.name, actual, exp.values[step.name], exp.baseline[step.name],
                          exp.dtype, exp.zeros.get(step.name),
                          step.result_dtype if exp.kind == "sdpa" else None)
        if not res.passed:
            why = diagnose(exp, step.name, actual)
            if why:
                res.note = f"{res.note}; {why}" if res.note else why
        cell.steps.append(res)
    _finish(cell)
    return cell


def _finish(cell: Cell) -> None:
    errors = [s for s in cell.steps if s.error]
    finite = [s.ratio for s in cell.steps if not s.error]
    cell.ratio = max(finite) if finite else None
    if errors and not finite:
        cell.status, cell.detail = "error", errors[0].error
    elif errors or any(not s.passed for s in cell.steps):
        cell.status = "FAIL"
        notes = [f"{s.step}: {s.error or s.note}" for s in cell.steps
                 if (s.error or not s.passed) and (s.error or s.note)]
        cell.detail = " | ".join(notes)


# ------------------------------------------------------------------------------ the run


@dataclass
class Column:
    """A report column: a spec/user backend, or a peer (see ``conformance.peers``)."""

    name: str
    kind: str  # "backend" or "peer"
    backend: Backend | None = None
    peer: Any = None


@dataclass
class RunResult:
    """Everything a run produced, for the report."""

    columns: list[Column]
    cells: list[Cell]
    missing: dict[str, str]  # column → how to install
    rows: list[tuple[str, str]]  # (case, dtype) in order
    expectations: dict[tuple[str, str], Expected] = field(default_factory=dict)
    errors: list[Any] = field(default_factory=list)  # conformance.errors results
    properties: Any = None  # conformance.properties result
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when every spec/user backend cell passed (and errors/properties conform)."""
        cells_ok = not any(c.failed for c in self.cells)
        errors_ok = all(e.passed for e in self.errors if getattr(e, "spec_backend", True))
        props_ok = self.properties is None or self.properties.passed
        return cells_ok and errors_ok and props_ok


class Progress:
    """A one-line progress indicator on stderr, only when stderr is a terminal."""

    def __init__(self, total: int, enabled: bool | None = None) -> None:
        self.total, self.done = total, 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled

    def tick(self, text: str) -> None:
        """Advance by one and show ``text``."""
        self.done += 1
        if self.enabled:
            sys.stderr.write(f"\r\x1b[K[{self.done:4d}/{self.total}] {text}")
            sys.stderr.flush()

    def close(self) -> None:
        """Clear the line."""
        if self.enabled:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def known_difference(peer: str, case: str, dtype: str) -> dict[str, Any] | None:
    """The entry of ``spec.KNOWN_DIFFERENCES`` that covers ``peer`` on ``case``, if any."""
    for entry in getattr(spec, "KNOWN_DIFFERENCES", {}).get(peer, []):
        patterns = entry["cases"]
        patterns = [patterns] if isinstance(patterns, str) else patterns
        dtypes = entry.get("dtypes")
        if any(fnmatch.fnmatchcase(case, p) for p in patterns) and (
            dtypes is None or dtype in dtypes
        ):
            return entry
    return None


def run_columns(
    columns: list[Column],
    cases: list[Case],
    dtypes: list[str],
    *,
    progress: Progress | None = None,
) -> tuple[list[Cell], dict[tuple[str, str], Expected]]:
    """Every case × dtype × column; expectations computed once per case × dtype."""
    cells: list[Cell] = []
    expectations: dict[tuple[str, str], Expected] = {}
    for case in cases:
        for dtype in dtypes:
            exp = expected(case, dtype)
            expectations[(case.name, dtype)] = exp
            for col in columns:
                if progress:
                    progress.tick(f"{col.name:<24} {case.name} {dtype}")
                if col.kind == "peer":
                    cell = col.peer.run_cell(exp)
                    cell.spec_backend = False
                    if cell.status in ("FAIL", "error"):
                        known = known_difference(col.name, case.name, dtype)
                        if known is not None:
                            cell.status = "known"
                            cell.detail = known.get("short", known["differs"])
                else:
                    cell = run_cell(col.backend, exp, column=col.name)
                cells.append(cell)
    return cells, expectations


def resolve_backends(names: list[str] | None) -> tuple[list[Column], dict[str, str]]:
    """Columns for backend names/dotted module paths; missing ones with their install hint.

    With ``names`` None: every installed spec backend (numpy, jax, torch). A peer's name
    (``torch.sdpa`` …) gives that peer's column.
    """
    from . import peers as peers_mod

    columns, missing = [], {}
    for name in names or list(backends_mod.SPEC_BACKENDS):
        if name in {p.name for p in peers_mod.PEERS}:
            peer = peers_mod.get(name)
            if peer.available():
                columns.append(Column(peer.name, "peer", peer=peer))
            else:
                missing[name] = peer.install
            continue
        backend = backends_mod.load(name)
        if backend.available():
            columns.append(Column(backend.name, "backend", backend=backend))
        else:
            missing[name] = backend.install
    return columns, missing


def run(
    backend_names: list[str] | None = None,
    case_patterns: list[str] | None = None,
    dtypes: list[str] | None = None,
    *,
    peers: bool | None = None,
    check_errors: bool = True,
    progress: bool | None = None,
) -> RunResult:
    """The whole conformance run, as ``python -m conformance run`` does it."""
    import time

    from . import peers as peers_mod

    start = time.perf_counter()
    columns, missing = resolve_backends(backend_names)
    if peers is None:
        peers = backend_names is None
    if peers:
        for peer in peers_mod.PEERS:
            if peer.available():
                columns.append(Column(peer.name, "peer", peer=peer))
            else:
                missing[peer.name] = peer.install
    selected = cases_mod.select(case_patterns)
    dtypes = list(dtypes or backends_mod.DTYPES)
    rows = [(c.name, d) for c in selected for d in dtypes]
    bar = Progress(len(rows) * len(columns), progress)
    try:
        cells, expectations = run_columns(columns, selected, dtypes, progress=bar)
    finally:
        bar.close()
    result = RunResult(columns, cells, missing, rows, expectations)
    if check_errors:
        from . import errors as errors_mod

        result.errors = errors_mod.run([c.backend for c in columns if c.backend is not None])
    result.seconds = time.perf_counter() - start
    return result
