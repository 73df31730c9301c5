"""Known differences as hypotheses: each entry's alternative semantics, computed and checked.

An entry of ``spec.KNOWN_DIFFERENCES`` names the ``alternative`` that explains a peer's
difference (``spec.KNOWN_ALTERNATIVES`` says what each one means). Here each alternative is a
function that changes how the float64 expected value is built from the case's arrays and
options, reusing ``reference`` (through ``expected.expected_for``) and compared under the one
tolerance rule (``compare.compare``):

* input stage, in this order: ``float32`` (inputs cast to float32, float32 tolerance and
  results), ``top_left`` (the reference with ``causal_alignment="top_left"``), ``float32_scale``
  (the scale rounded through float32 as ONNX's function body computes it), ``additive_mask``
  (the boolean mask added to the scores as 0 / ``-inf``), ``mixed_heads`` (MHA's identity input
  projections, an exact IEEE product over all heads of a token);
* row stage, on the weights: ``float32_softmax`` (the softmax in float32; its input part sets
  float32's tolerance),
  then one rule for fully masked rows (``mean_of_value``, ``unmasked_row`` or ``nan_rows``),
  then ``nan_row_zero``; ``output = weights @ value`` in float64;
* output stage: ``mixed_heads``'s output projection;
* the row log-sum-exp (the ``lse`` step): ``conformance.diagnosing.lse_alternatives``;
* a ``varlen`` case: all of it on its padded batch (``varlen_padding.as_sdpa``, the sequences'
  rules as a mask, in the alignment ``top_left`` may change), packed back into its steps.

``raises`` is checked on the exception a peer raised instead: its type (or a base class) has the
entry's name and its message matches the entry's pattern.

``classify`` decides a peer cell that failed the spec: it tries the entries that cover the cell
(one, then every pair, …; two rules for fully masked rows never together) and the cell is
``known`` when one combination matches every failing step within the tolerance, else
``unexpected``, with the worst ratio to the spec and to the closest combination tried. Only the
steps that failed the spec are judged against the alternative (a step that meets the spec needs
no explanation); an alternative requires no exact zeros (its values are matched within the
tolerance, NaN and ``±inf`` exactly); a matching raise has distance 0. Dropout is not modelled
(no peer takes a given keep-mask).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import spec
from ..cases import reference, varlen_padding
from ..cases.catalogue import CaseData
from ..cases.dtypes import numpy_dtype
from ..cases.expected import Expected, expected_for, unspecified_positions
from ..comparing.compare import StepResult, compare
from ..comparing.results import Cell, error_text, known_differences
from .lse_alternatives import LSE_STAGE
from .rotary import rotary_hypothesis

#: Rules for fully masked rows: at most one of them in a combination.
EMPTY_ROW_RULES = ("mean_of_value", "unmasked_row", "nan_rows")


@dataclass
class Semantics:
    """The case as an alternative sees it: its inputs, the tolerance row, the results' dtype."""

    arrays: dict[str, np.ndarray]
    options: dict[str, Any]
    dtype: str  # the row of spec.TOLERANCES
    result: str  # the dtype the results must have
    names: tuple[str, ...] = ()


@dataclass
class Hypothesis:
    """The expected value of every step under a combination of alternatives (float64)."""

    names: tuple[str, ...]
    values: dict[str, np.ndarray]  # output (..., heads, q_len, v_dim), output_weights, lse
    baseline: dict[str, float]
    dtype: str  # the tolerance row
    result: str  # the results' dtype
    unspecified: dict[str, np.ndarray] = field(default_factory=dict)
    lse_result: str = ""  # the lse's dtype (the compute dtype of ``result``, or ``result``)


def _heads(x: np.ndarray) -> int:
    return x.shape[-3] if x.ndim >= 3 else 1


# ------------------------------------------------------------------------------ input stage


def float32(sem: Semantics) -> None:
    """Float64 inputs cast to float32, computed and returned in float32 (other dtypes: as is)."""
    if sem.dtype == "float64":
        sem.arrays = {n: a.astype(np.float32) if a.dtype.kind == "f" else a
                      for n, a in sem.arrays.items()}
        sem.dtype = sem.result = "float32"


def top_left(sem: Semantics) -> None:
    """The causal rule and the window aligned top-left, whatever the case asks."""
    sem.options = {**sem.options, "causal_alignment": "top_left"}


def float32_scale(sem: Semantics) -> None:
    """ONNX's ``Attention`` function body: ``s = sqrt(scale)`` computed in float32 (the default
    scale ``1 / sqrt(head_dim)`` in float32 too), query and key each multiplied by ``s``."""
    head_dim = np.asarray(sem.arrays["query"]).shape[-1]
    one = np.float32(1.0)
    given = sem.options.get("scale")
    scale = one / np.sqrt(np.float32(head_dim)) if given is None else np.float32(given)
    root = float(np.sqrt(np.float32(scale)))
    sem.options = {**sem.options, "scale": root * root}


def additive_mask(sem: Semantics) -> None:
    """The boolean mask added to the scores (0 or ``-inf``) instead of replacing them: a NaN
    score at a masked position stays NaN and makes its row NaN."""
    mask = sem.arrays.get("mask")
    if mask is None:
        return
    fill = np.where(np.asarray(mask, bool), 0.0, -np.inf)
    bias = sem.arrays.get("bias")
    with np.errstate(invalid="ignore"):
        added = fill if bias is None else np.asarray(bias).astype(np.float64) + fill
    arrays = {n: a for n, a in sem.arrays.items() if n != "mask"}
    arrays["bias"] = added
    sem.arrays = arrays


def mix_heads(x: np.ndarray) -> np.ndarray:
    """``(..., heads, T, D)`` (or ``(T, D)``) through an identity projection over all heads of
    each token, as an exact IEEE product: ``y_j = Σ_i x_i·[i = j]``, so ``0·NaN = 0·inf = NaN``
    carries a non-finite value in one head to every head of its token. Returns float64."""
    x = np.asarray(x).astype(np.float64)
    tokens = np.swapaxes(x if x.ndim >= 3 else x[None], -2, -3)  # (..., T, heads, D)
    flat = tokens.reshape(tokens.shape[:-2] + (-1,))  # (..., T, heads·D)
    with np.errstate(invalid="ignore"):
        mixed = (flat[..., None, :] * np.eye(flat.shape[-1])).sum(-1)
    back = np.swapaxes(mixed.reshape(tokens.shape), -2, -3)
    return back if x.ndim >= 3 else back[0]


def mixed_heads(sem: Semantics) -> None:
    """torch MultiheadAttention with identity projections: query, key and value (key/value heads
    repeated to the query's, as the adapter does) through the input projection (``mix_heads``);
    the output projection comes after the rows (``OUTPUT_STAGE``)."""
    q = sem.arrays["query"]
    heads = _heads(np.asarray(q))
    arrays = dict(sem.arrays)
    for name in ("query", "key", "value"):
        x = reference.repeat_kv(np.asarray(arrays[name]).astype(np.float64), heads)
        arrays[name] = mix_heads(x)
    sem.arrays = arrays


def float32_tolerance(sem: Semantics) -> None:
    """``float32_softmax``'s input part: float64 inputs are compared with float32's tolerance
    (and float32's baseline error); the results keep the input dtype."""
    if sem.dtype == "float64":
        sem.dtype = "float32"


def float32_angles(sem: Semantics) -> None:
    """A rotary case's angles in float32 (``rotary.rotary_hypothesis`` computes it): float64
    is compared with float32's tolerance."""
    float32_tolerance(sem)


INPUT_STAGE: dict[str, Callable[[Semantics], None]] = {
    "float32": float32, "top_left": top_left, "float32_scale": float32_scale,
    "additive_mask": additive_mask, "mixed_heads": mixed_heads,
    "float32_softmax": float32_tolerance, "float32_angles": float32_angles}

# ------------------------------------------------------------------------------ row stage


@dataclass
class Rows:
    """What the row rules read: the reference steps of the (transformed) case."""

    sem: Semantics
    steps: reference.Steps

    @property
    def empty(self) -> np.ndarray:
        """``(..., heads, q_len, 1)`` bool: rows with no allowed key."""
        return np.isneginf(self.steps.masked_scores).all(-1, keepdims=True)


def float32_softmax(rows: Rows, weights: np.ndarray) -> np.ndarray:
    """The softmax of the float64 masked scores computed in float32 (rows with a key)."""
    m = rows.steps.masked_scores.astype(np.float32)
    with np.errstate(all="ignore"):
        e = np.exp(m - m.max(-1, keepdims=True))
        w32 = (e / e.sum(-1, keepdims=True, dtype=np.float32)).astype(np.float64)
    return np.where(rows.empty, weights, w32)


def mean_of_value(rows: Rows, weights: np.ndarray) -> np.ndarray:
    """A fully masked row gets uniform weights over every key: its output is the mean of value."""
    return np.where(rows.empty, 1.0 / weights.shape[-1], weights)


def unmasked_row(rows: Rows, weights: np.ndarray) -> np.ndarray:
    """A fully masked row gets the weights of the same row without the boolean mask."""
    arrays = {n: a for n, a in rows.sem.arrays.items() if n not in ("mask", "dropout_mask")}
    free = expected_for(CaseData(arrays, rows.sem.options), "sdpa", rows.sem.dtype,
                        gradients=False).values["weights"]
    return np.where(rows.empty, free, weights)


def nan_rows(rows: Rows, weights: np.ndarray) -> np.ndarray:
    """A fully masked row gives NaN weights (the softmax of a row of ``-inf`` is 0/0)."""
    return np.where(rows.empty, np.nan, weights)


def nan_row_zero(rows: Rows, weights: np.ndarray) -> np.ndarray:
    """A row whose every allowed score is NaN gives weights 0 (a kernel that finds no finite
    maximum treats the row as fully masked)."""
    m = rows.steps.masked_scores
    all_nan = np.isnan(m).any(-1, keepdims=True) & ~(np.isfinite(m) | (m == np.inf)).any(
        -1, keepdims=True)
    return np.where(all_nan, 0.0, weights)


ROW_STAGE: dict[str, Callable[[Rows, np.ndarray], np.ndarray]] = {
    "float32_softmax": float32_softmax, "mean_of_value": mean_of_value,
    "unmasked_row": unmasked_row, "nan_rows": nan_rows, "nan_row_zero": nan_row_zero}

# ------------------------------------------------------------------------------ output stage


def project_output(output: np.ndarray, unspecified: np.ndarray | None
                   ) -> tuple[np.ndarray, np.ndarray | None]:
    """``mixed_heads``'s output projection; a token with an unspecified position is wholly
    unspecified (its NaN, if the kernel produces one, reaches every head)."""
    if unspecified is not None:
        spread = np.swapaxes(unspecified if unspecified.ndim >= 3 else unspecified[None], -2, -3)
        spread = np.broadcast_to(spread.any((-1, -2), keepdims=True), spread.shape)
        spread = np.swapaxes(spread, -2, -3)
        unspecified = spread if unspecified.ndim >= 3 else spread[0]
    return mix_heads(output), unspecified


#: Every alternative but ``raises``, in the order a combination applies them.
ORDER = tuple(dict.fromkeys((*INPUT_STAGE, *ROW_STAGE, *LSE_STAGE)))


def hypothesis(exp: Expected, names: tuple[str, ...] | list[str]) -> Hypothesis:
    """The expected ``output``, ``output_weights`` and ``lse`` of ``exp``'s case under the
    alternatives ``names`` (any order; applied in ``ORDER``), with their baseline errors and
    tolerance row."""
    unknown = sorted(set(names) - set(ORDER))
    if unknown:
        raise ValueError(f"names: unknown alternative(s) {', '.join(unknown)}; known: "
                         f"{', '.join(ORDER)}")
    chosen = tuple(n for n in ORDER if n in names)
    if exp.kind == "rotary":  # the rotation's alternatives: diagnosing.rotary
        values, baseline, row = rotary_hypothesis(exp, chosen)
        return Hypothesis(chosen, values, baseline, row, exp.dtype)
    sem = Semantics(dict(exp.data.arrays), dict(exp.data.options), exp.dtype, exp.dtype, chosen)
    for name in chosen:
        if name in INPUT_STAGE:
            INPUT_STAGE[name](sem)
    data, padded = CaseData(sem.arrays, sem.options), None
    if exp.kind == "varlen":  # its padded batch, the sequences' rules as a mask
        data, padded = varlen_padding.as_sdpa(data)
        sem.arrays, sem.options = data.arrays, data.options
    with np.errstate(all="ignore"):
        base = expected_for(data, "sdpa", sem.dtype, gradients=False)
        steps = reference.Steps(base.values["scores"], base.values["masked_scores"],  # weights
                                base.values["output_weights"], base.values["output"])  # sinks too
        rows, weights = Rows(sem, steps), steps.weights
        for name in chosen:
            if name in ROW_STAGE:
                weights = ROW_STAGE[name](rows, weights)
        value = reference.repeat_kv(np.asarray(sem.arrays["value"]).astype(np.float64),
                                    _heads(np.asarray(sem.arrays["query"])))
        output = np.einsum("...qk,...kd->...qd", weights, value)
        lse = base.values["lse"]  # (..., heads, q_len)
        for name in chosen:
            if name in LSE_STAGE:
                lse = LSE_STAGE[name](lse, steps.masked_scores, sem.result)
        values = {**base.values, "weights": weights, "output_weights": weights, "output": output}
        unspecified = (unspecified_positions(data, values) if not data.finite
                       else {"output": None, "output_weights": None})
        out_unspecified = unspecified.get("output")
        if "mixed_heads" in chosen:
            output, out_unspecified = project_output(output, out_unspecified)
    lse_result = sem.result if "lse_input_dtype" in chosen else spec.COMPUTE_DTYPE[sem.result]
    values = {"output": output, "output_weights": weights, "lse": lse}
    if padded is not None:  # a varlen cell's steps: tokens first again
        values = {"varlen_output": varlen_padding.repack(output, padded),
                  "varlen_lse": varlen_padding.repack_lse(lse, padded)}
        base.baseline.update(varlen_output=base.baseline["output"],
                             varlen_lse=base.baseline["lse"])
    return Hypothesis(chosen, values, base.baseline, sem.dtype, sem.result,
                      {"output": out_unspecified,
                       "output_weights": unspecified.get("output_weights")}, lse_result)


def check(hyp: Hypothesis, results: dict[str, np.ndarray]) -> list[StepResult]:
    """Each of a peer's results against the hypothesis, under ``compare``'s rule and the
    hypothesis' tolerance row; a result of another dtype than ``hyp.result`` (the lse:
    ``hyp.lse_result``) fails."""
    out = []
    for step, actual in results.items():
        want = np.dtype(numpy_dtype(hyp.lse_result if step in ("lse", "varlen_lse")
                                    else hyp.result))
        if step not in hyp.values:
            out.append(StepResult(step, float("inf"), False,
                                  note="the alternatives define no value for this step"))
            continue
        with np.errstate(all="ignore"):
            res = compare(step, actual, hyp.values[step], hyp.baseline[step], hyp.dtype,
                          unspecified=hyp.unspecified.get(step))
        if np.asarray(actual).dtype != want:
            res.passed = False
            res.note = (res.note + "; " if res.note else "") + (
                f"dtype {np.asarray(actual).dtype.name}, the alternative returns {want.name}")
        out.append(res)
    return out


def raise_matches(entry: dict[str, Any], exc: BaseException) -> bool:
    """True when ``exc`` is what a ``raises`` entry names: its type or a base class is called
    ``entry["raises"]["type"]`` and its message matches ``entry["raises"]["match"]``."""
    want = entry.get("raises") or {}
    names = {cls.__name__ for cls in type(exc).__mro__}
    return want.get("type") in names and re.search(want.get("match", ""), str(exc)) is not None


def _combinations(entries: list[dict[str, Any]]) -> list[tuple[dict[str, Any], ...]]:
    """Every non-empty combination of ``entries``, smallest first, at most one rule for fully
    masked rows and no alternative twice."""
    out = []
    for size in range(1, len(entries) + 1):
        for combo in itertools.combinations(entries, size):
            names = [e["alternative"] for e in combo]
            if len(set(names)) == len(names) and sum(n in EMPTY_ROW_RULES for n in names) <= 1:
                out.append(combo)
    return out


def _label(combo: tuple[dict[str, Any], ...]) -> str:
    return " + ".join(e.get("short", e["differs"]) for e in combo)


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return "inf" if not np.isfinite(x) else (f"{x:.2f}" if x < 100 else f"{x:.0e}")


def classify(cell: Cell, peer: str, exp: Expected, results: dict[str, np.ndarray] | None,
             raised: BaseException | None) -> Cell:
    """Turn a peer cell that failed the spec (``FAIL`` or ``error``) into ``known`` (an entry's
    alternative, or a combination of them, matches every failing step) or ``unexpected``;
    ``cell.alternatives`` names the combination (the closest one tried when unexpected) and
    ``cell.alternative_ratio`` its worst ratio. Returns ``cell``."""
    entries = known_differences(peer, exp.case, exp.dtype)
    spec_part = f"spec {_num(cell.ratio)}" if raised is None else f"raised {error_text(raised)}"
    best: tuple[float, tuple[dict[str, Any], ...], str] | None = None
    if raised is not None:
        for entry in (e for e in entries if e["alternative"] == "raises"):
            if raise_matches(entry, raised):
                best = (0.0, (entry,), "")
                break
            want = entry["raises"]
            best = best or (float("inf"), (entry,),
                            f"expected {want['type']} matching {want['match']!r}")
    else:
        failing = {s.step for s in cell.steps if s.error or not s.passed}
        shown = {n: a for n, a in results.items() if n in failing}
        for combo in _combinations([e for e in entries if e["alternative"] != "raises"]):
            steps = check(hypothesis(exp, [e["alternative"] for e in combo]), shown)
            ratio = max((s.ratio for s in steps), default=0.0)
            if all(s.passed for s in steps):
                best = (ratio, combo, "")
                break
            notes = " | ".join(f"{s.step}: {s.note}" for s in steps if not s.passed and s.note)
            if best is None or ratio < best[0]:
                best = (ratio, combo, notes)
    if best is not None and best[0] <= 1.0 and not best[2]:
        cell.status, cell.alternative_ratio = "known", best[0]
        cell.alternatives = tuple(e.get("short", e["differs"]) for e in best[1])
        cell.detail = f"{_label(best[1])} ({_num(best[0])})"
        return cell
    cell.status = "unexpected"
    if best is None:
        cell.alternative_ratio = None
        none = "says it raises" if raised is not None else "covers it"
        cell.detail = f"{spec_part}; no entry of spec.KNOWN_DIFFERENCES {none}" + (
            f" | {cell.detail}" if raised is None and cell.detail else "")
    else:
        cell.alternative_ratio = best[0]
        cell.alternatives = tuple(e.get("short", e["differs"]) for e in best[1])
        cell.detail = (f"{spec_part}; closest known difference {_label(best[1])}: "
                       f"{_num(best[0])}" + (f" | {best[2]}" if best[2] else ""))
    return cell


__all__ = ["EMPTY_ROW_RULES", "INPUT_STAGE", "ORDER", "ROW_STAGE", "Hypothesis", "Rows",
           "Semantics", "additive_mask", "check", "classify", "float32", "float32_scale",
           "float32_softmax", "float32_tolerance", "hypothesis", "mean_of_value", "mix_heads",
           "mixed_heads", "nan_row_zero", "nan_rows", "project_output", "raise_matches",
           "top_left", "unmasked_row"]
