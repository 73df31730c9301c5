"""What one case in one dtype must give: the expected value of every compared step.

For the dtype-cast inputs of a case, ``expected_for`` computes once:

* ``values``: every step in float64 (``reference``; for modules, the projections in float64 around
  it, ``module_pipelines``), gradients against a seeded
  ``grad_output``; the row log-sum-exp (``lse``, ``blockwise_lse``); with sinks ``grad_sinks``,
  ``output_weights`` with the sink in each denominator and ``weights`` without it (the
  softmax step ``attention_weights`` of the masked scores takes no sinks); a merge case's
  ``merge_output``/``merge_lse`` and a paged case's ``paged_output``/``paged_lse``/
  ``paged_cache_output`` are those of the float64 attention over every key (the pages gathered
  by ``case_inputs.contiguous``), never of the implementation's own merge or pages; a varlen
  case's ``varlen_*`` steps are the float64 attention (and its VJP) of one sequence at a time
  (``case_inputs.varlen_pieces``); a rotary case's ``rotary_*`` and ``rope_*`` steps are
  ``cases.rotary``'s float64 rotation and frequencies; a quantised case's steps are
  ``cases.quantized``'s float64 quantiser (and the reference attention over its dequantised
  cache), the MLA module case's ``cases.latent``'s float64 MLA (its ``grad_weights``
  ``cases.latent_grads``' chain rule); the naive baseline of a case
  with chunks, ALiBi, segment ids or mods (``mods.uses_mods``) runs on ``mods.dedicated`` (the
  same rules as a mask and a bias), and its ``masked_scores`` are not compared (``steps``:
  ``mask_scores`` takes none of those rules);
* ``baseline``: per step, the largest error of the naive implementation in that dtype
  (``conformance.cases.naive``), which scales the tolerance (``spec.TOLERANCES``);
* ``zeros``: positions that must be exactly 0 (masked weights, fully masked rows);
* ``unspecified``: positions where the spec's NaN rule allows any value.

A step's name is the key in ``values``; ``running.steps`` says how a backend computes it. To
compare a new step, add its value here (``pipeline``) and a ``Step`` there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import catalogue as cases_mod
from . import latent as latent_cases
from . import latent_grads, mods, reference
from . import quantized as quantized_cases
from . import rotary as rotary_cases
from .catalogue import Case, CaseData
from .dtypes import numpy_dtype
from .inputs import contiguous, varlen_pieces
from .module_pipelines import flatten_weight_grads, module_backward, module_forward
from .naive import (
    EXACT,
    Precision,
    naive_attention,
    naive_attention_vjp,
    naive_merge,
    rounding_error,
)

GRAD_SEED = 20261130
#: The VJPs' results in order; ``grad_sinks`` (a fifth element) only where the case has sinks.
GRAD_STEPS = ("grad_query", "grad_key", "grad_value", "grad_bias", "grad_sinks")

#: The blockwise backward is compared in these dtypes (its half-precision gradients are tested
#: by tests/test_blockwise.py): each further dtype costs JAX a compile of two scans per case.
BLOCKWISE_GRAD_DTYPES = ("float64", "float32")


def reference_attention(arrays: dict[str, np.ndarray], options: dict[str, Any],
                        p: Precision = EXACT) -> reference.Steps:
    """``reference.attention`` on a case's arrays and options (``p`` is ignored: float64)."""
    return reference.attention(arrays["query"], arrays["key"], arrays["value"],
                               **mods.sdpa_kwargs(arrays, options))


def reference_attention_vjp(arrays: dict[str, np.ndarray], options: dict[str, Any],
                            p: Precision = EXACT) -> reference.Grads:
    """``reference.attention_vjp`` against ``arrays["grad_output"]`` (float64)."""
    return reference.attention_vjp(arrays["query"], arrays["key"], arrays["value"],
                                   arrays["grad_output"], **mods.sdpa_kwargs(arrays, options))


def _varlen_values(data: CaseData, attend: Callable, attend_vjp: Callable, p: Precision,
                   grads: bool, **offsets: np.ndarray) -> dict[str, np.ndarray]:
    """A varlen case's steps, one sequence at a time (``offsets``: other ``cu_seq_q`` /
    ``cu_seq_k`` than the case's, a mistake replayed)."""
    a = data.arrays
    q, k, v = a["query"], a["key"], a["value"]
    out = {"varlen_output": np.zeros(q.shape[:-1] + v.shape[-1:]),
           "varlen_lse": np.full(q.shape[1::-1], -np.inf)}
    if grads:
        out.update({f"varlen_{n}": np.zeros(x.shape) for n, x in (
            ("grad_query", q), ("grad_key", k), ("grad_value", v))})
        if "sinks" in a:
            out["varlen_grad_sinks"] = np.zeros(np.shape(a["sinks"]))
    for piece in varlen_pieces(a, data.options, **offsets):
        arrays = {n: x for n, x in piece.arrays.items() if n != "grad_output"}
        steps = attend(arrays, piece.options, p)
        out["varlen_output"][piece.q] = np.swapaxes(steps.output, 0, 1)
        out["varlen_lse"][:, piece.q] = steps.lse
        if grads:
            g = attend_vjp(piece.arrays, piece.options, p)
            out["varlen_grad_query"][piece.q] = np.swapaxes(g.query, 0, 1)
            out["varlen_grad_key"][piece.k] = np.swapaxes(g.key, 0, 1)
            out["varlen_grad_value"][piece.k] = np.swapaxes(g.value, 0, 1)
            if g.sinks is not None:  # a sum over the sequences, rounded as it goes
                out["varlen_grad_sinks"] = p.round(out["varlen_grad_sinks"] + g.sinks)
    return out


def varlen_values(data: CaseData, dtype: str, naive: bool = False,
                  **offsets: np.ndarray) -> dict[str, np.ndarray]:
    """A varlen case's expected steps in float64 (``naive``: the naive baseline in ``dtype``),
    optionally with other offsets (``cu_seq_q=``, ``cu_seq_k=``)."""
    grads = "grad_output" in data.arrays and data.finite
    if naive:
        return _varlen_values(data, naive_attention, naive_attention_vjp, Precision(dtype),
                              grads, **offsets)
    return _varlen_values(data, reference_attention, reference_attention_vjp, EXACT, grads,
                          **offsets)


def _varlen_floor(data: CaseData, p: Precision) -> tuple[dict[str, float], np.ndarray]:
    """The rounding floor of ``varlen_output``/``varlen_lse`` and the rows ``(total_q,
    heads)`` with no allowed key (output exactly 0)."""
    floor = {"varlen_output": 0.0, "varlen_lse": 0.0}
    empty = np.zeros(data.arrays["query"].shape[:-1], bool)
    for piece in varlen_pieces(data.arrays, data.options):
        arrays = {n: x for n, x in piece.arrays.items() if n != "grad_output"}
        ref = reference_attention(arrays, piece.options)
        rows = rounding_error(arrays, piece.options, p, ref)
        floor = {n: max(floor[n], rows[n.removeprefix("varlen_")]) for n in floor}
        empty[piece.q] = np.isneginf(ref.masked_scores).all(-1).T
    return floor, empty


def grad_output_for(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """The output cotangent of a case: seeded standard normal of ``shape``, in ``dtype``."""
    return np.random.default_rng(GRAD_SEED).standard_normal(shape).astype(numpy_dtype(dtype))


def blockwise_applies(data: CaseData) -> bool:
    """``blockwise_attention`` expresses the case: masks only as structure or ``kv_lengths``,
    no dropout (sinks it takes)."""
    a = data.arrays
    return ("mask" not in a or "kv_lengths" in a) and "dropout_mask" not in a


def pipeline(data: CaseData, kind: str, dtype: str, naive: bool) -> dict[str, np.ndarray]:
    """Every step's value: the float64 reference (``naive=False``) or the naive baseline in
    ``dtype``; gradients only for finite inputs with a ``grad_output`` (``expected_for`` adds
    one unless told not to)."""
    with np.errstate(all="ignore"):  # NaN and inf - inf are the IEEE rule at work
        return _pipeline(data, kind, dtype, naive)


def _pipeline(data: CaseData, kind: str, dtype: str, naive: bool) -> dict[str, np.ndarray]:
    if kind == "varlen":
        return varlen_values(data, dtype, naive)
    if kind == "rotary":
        return rotary_cases.values(data, dtype, naive)
    if kind == "quantized":
        return quantized_cases.values(data, dtype, naive)
    if kind == "module" and latent_cases.is_latent(data):
        values = latent_cases.values(data, dtype, naive)
        if "grad_output" in data.arrays and data.finite:
            values["grad_weights"] = flatten_weight_grads(latent_grads.weight_grads(
                data, Precision(dtype) if naive else EXACT))
        return values
    with_mods = kind == "sdpa" and mods.uses_mods(data)
    blockwise = blockwise_applies(data)
    scores_options = data.options  # "scores" comes before a score_mod folded into softcap
    bias_shape = np.shape(data.arrays["bias"]) if "bias" in data.arrays else None
    if naive and with_mods:  # the naive baseline knows the older arguments only
        scores_options = {k: v for k, v in data.options.items() if k not in mods.MOD_OPTIONS}
        data = mods.dedicated(data)
    p = Precision(dtype) if naive else EXACT
    attend = naive_attention if naive else reference_attention
    attend_vjp = naive_attention_vjp if naive else reference_attention_vjp
    grads = "grad_output" in data.arrays and data.finite
    if kind == "module":
        values = module_forward(data, p, attend)
        if data.options.get("decode"):
            values["decode_output"] = values["output"]  # decoding equals the causal forward
        if grads:
            values["grad_weights"] = flatten_weight_grads(
                module_backward(data, p, attend, attend_vjp))
        return values
    if kind == "merge":  # the float64 attention over every key; the naive merge of the parts
        if naive:
            output, lse = naive_merge(data.arrays, data.options, p)
        else:
            steps = attend(data.arrays, data.options, p)
            output, lse = steps.output, steps.lse
        return {"merge_output": output, "merge_lse": lse}
    if kind == "paged":  # the contiguous attention; the paged cache of the module must agree
        steps = attend(contiguous(data.arrays), data.options, p)
        return {"paged_output": steps.output, "paged_lse": steps.lse,
                "paged_cache_output": steps.output}
    steps = attend(data.arrays, data.options, p)
    values = {"scores": steps.scores, "masked_scores": steps.masked_scores,
              "weights": steps.weights, "output": steps.output, "output_weights": steps.weights,
              "lse": steps.lse}
    if naive and scores_options.get("softcap") != data.options.get("softcap"):
        values["scores"] = attend(data.arrays, scores_options, p).scores
    if "sinks" in data.arrays:  # attention_weights(masked scores) takes no sinks: its softmax
        without = {k: v for k, v in data.arrays.items() if k != "sinks"}
        values["weights"] = attend(without, data.options, p).weights
    if grads:
        g = attend_vjp(data.arrays, data.options, p)
        for name in GRAD_STEPS:
            value = getattr(g, name.removeprefix("grad_"))
            if name == "grad_bias" and value is not None and bias_shape is not None:
                value = reference.unbroadcast(value, bias_shape)  # of the bias ALiBi joined
            if value is not None:
                values[name] = value
    if blockwise:
        values["blockwise_output"] = values["output"]
        values["blockwise_lse"] = values["lse"]
        if dtype in BLOCKWISE_GRAD_DTYPES:
            for name in GRAD_STEPS:
                if name in values:
                    values[f"blockwise_{name}"] = values[name]
    return values


@dataclass
class Expected:
    """What one case in one dtype must give (see the module docstring)."""

    case: str
    kind: str
    dtype: str
    data: CaseData  # inputs, already in dtype
    values: dict[str, np.ndarray]
    baseline: dict[str, float]  # largest error of the naive implementation in dtype
    zeros: dict[str, np.ndarray] = field(default_factory=dict)  # positions that must be 0
    unspecified: dict[str, np.ndarray] = field(default_factory=dict)  # any value passes


def baseline_error(naive: np.ndarray, ref: np.ndarray, p: Precision) -> float:
    """Largest error of the naive result where the reference is finite; where the naive
    implementation overflows there, the error of rounding the reference itself to the dtype."""
    finite = np.isfinite(ref)
    if not finite.any():
        return 0.0
    if not np.isfinite(naive[finite]).all():
        rounded = p.round(ref[finite])
        ok = np.isfinite(rounded)
        return float(np.max(np.abs(rounded[ok] - ref[finite][ok]), initial=0.0))
    return float(np.max(np.abs(naive[finite] - ref[finite])))


def exact_zeros(values: dict[str, np.ndarray], masked_scores: np.ndarray | None = None
                ) -> dict[str, np.ndarray]:
    """Positions that must be exactly 0: in an sdpa case masked weights, and the output (and
    query gradient) of fully masked rows (with sinks too: the sink carries no value); in a
    merge case the merged output of rows with no allowed key in any part. ``masked_scores``:
    the reference's (a merge case has no step of that name)."""
    scores = values["masked_scores"] if masked_scores is None else masked_scores
    masked = np.isneginf(scores)  # (..., heads, q_len, kv_len)
    empty = masked.all(-1, keepdims=True)  # (..., heads, q_len, 1)
    zeros = {"weights": masked, "output_weights": masked}
    for name in ("output", "grad_query", "merge_output", "paged_output", "paged_cache_output"):
        if name in values:
            zeros[name] = np.broadcast_to(empty, values[name].shape)
            if f"blockwise_{name}" in values:
                zeros[f"blockwise_{name}"] = zeros[name]
    return {name: z for name, z in zeros.items() if name in values}


def unspecified_positions(data: CaseData, values: dict[str, np.ndarray]
                          ) -> dict[str, np.ndarray]:
    """Where the spec's NaN rule allows any value (sdpa cases with non-finite inputs).

    * weights: masked positions of a row that is NaN (``0 / NaN``, or 0 if a backend zeroes
      masked positions after normalising);
    * output: ``(row i, column d)`` where row ``i`` has weight 0 on a key ``j`` whose value
      ``value[j, d]`` is not finite (``0·NaN`` is NaN in a plain product, a blocked kernel may
      never read that tile).
    """
    weights = values["output_weights"]  # (..., heads, q_len, kv_len)
    masked = np.isneginf(values["masked_scores"])
    weights_any = masked & np.isnan(weights).any(-1, keepdims=True)
    value = np.asarray(data.arrays["value"]).astype(np.float64)
    heads = weights.shape[-3] if weights.ndim >= 3 else 1
    bad_value = ~np.isfinite(reference.repeat_kv(value, heads))  # (..., heads, kv_len, v_dim)
    unused = weights == 0
    if "dropout_mask" in data.arrays and data.options.get("dropout_p", 0.0) > 0:
        unused = unused | ~np.asarray(data.arrays["dropout_mask"], bool)
    output_any = np.einsum("...qk,...kd->...qd", unused.astype(np.float64),
                           bad_value.astype(np.float64)) > 0
    result = {"weights": weights_any, "output_weights": weights_any, "output": output_any,
              "blockwise_output": output_any}
    return {name: x for name, x in result.items() if name in values}


def expected_for(data: CaseData, kind: str, dtype: str, case: str = "", *,
                 gradients: bool = True) -> Expected:
    """Expected values, baseline errors, exact zeros and unspecified positions for dtype-cast
    inputs ``data`` of a case of ``kind`` (``"sdpa"``, ``"merge"``, ``"paged"``, ``"varlen"`` or
    ``"module"``); with
    ``gradients``, a seeded ``grad_output`` and the gradient steps (a merge or paged case has
    none; the inputs of a paged case are its pages, compared with the contiguous attention)."""
    if gradients and kind in ("sdpa", "module", "varlen", "rotary") and \
            "grad_output" not in data.arrays:
        if kind == "rotary" or latent_cases.is_latent(data):  # the output is shaped like x
            shape = data.arrays["x"].shape
        elif kind != "module":
            q, v = data.arrays["query"], data.arrays["value"]
            shape = q.shape[:-1] + v.shape[-1:]
        else:
            with np.errstate(all="ignore"):
                shape = module_forward(data, EXACT, reference_attention)["output"].shape
        data = CaseData({**data.arrays, "grad_output": grad_output_for(shape, dtype)},
                        data.options)
    with np.errstate(all="ignore"):
        values = pipeline(data, kind, dtype, naive=False)
        naive = pipeline(data, kind, dtype, naive=True)
        p = Precision(dtype)
        baseline = {n: baseline_error(naive[n], values[n], p) for n in values}
        arrays = contiguous(data.arrays) if kind == "paged" else data.arrays
        full = reference_attention(arrays, data.options) if kind not in (
            "module", "varlen", "rotary", "quantized") else None
        zeros = {}
        if kind == "varlen":
            floor, empty = _varlen_floor(data, p)
            for name in floor:
                baseline[name] = max(baseline[name], floor[name])
            zeros = {n: np.broadcast_to(empty[..., None], values[n].shape)
                     for n in ("varlen_output", "varlen_grad_query") if n in values}
        if full is not None:  # never below the first-order effect of rounding each score once
            floor = rounding_error(arrays, data.options, p, full)
            for name in ("blockwise_output", "merge_output", "paged_output",
                         "paged_cache_output"):
                floor[name] = floor["output"]
            for name in ("blockwise_lse", "merge_lse", "paged_lse"):
                floor[name] = floor["lse"]
            for name in floor:
                if name in baseline:
                    baseline[name] = max(baseline[name], floor[name])
        if full is not None:
            zeros = exact_zeros(values, full.masked_scores)
        unspecified = ({} if kind != "sdpa" or data.finite
                       else unspecified_positions(data, values))
    return Expected(case, kind, dtype, data, values, baseline, zeros, unspecified)


def expected(case: Case, dtype: str) -> Expected:
    """``expected_for`` the case's inputs cast to ``dtype``."""
    return expected_for(cases_mod.prepare_inputs(case, dtype), case.kind, dtype, case.name)


__all__ = ["BLOCKWISE_GRAD_DTYPES", "GRAD_SEED", "GRAD_STEPS", "Expected", "baseline_error",
           "blockwise_applies", "expected", "expected_for", "grad_output_for", "pipeline",
           "reference_attention", "reference_attention_vjp", "varlen_values"]
