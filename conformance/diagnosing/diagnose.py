"""Why a spec backend failed a step, in plain words.

``diagnose(exp, step, actual)`` asks every function of ``DIAGNOSES`` and joins what they say
(``SEPARATOR``; ``split`` takes a joined text apart again, ``short`` names one diagnosis):

* ``planted_mistake`` replays the reference with one classic mistake planted at a time
  (``HYPOTHESES``: flipped mask polarity, the other causal alignment, ``h % kv_heads``
  grouping, an ignored argument, a wrong custom scale …) and names the first that reproduces
  the backend's result. On non-finite inputs the replay must reproduce the NaN pattern exactly
  too (``compare``'s rule), so a NaN-handling bug is not mistaken for a planted one;
* ``non_finite_rows`` explains NaN where the spec gives 0 or a finite value (fully masked rows,
  softmax overflow), and NaN missing or spreading on the non-finite cases (the spec's IEEE rule);
* ``mean_of_value`` recognises fully masked rows that give the mean of ``value``;
* ``lse_mistakes`` names an lse in log2, fully masked rows whose lse is 0 or ``+inf`` (not
  ``-inf``) and an lse that leaves the sink out; ``sink_in_numerator`` a sink whose term is
  added to every weight's numerator too (it belongs to the denominator alone);
* ``merge_mistakes`` (merge cases, after ``planted_mistake``: a part computed with a flipped mask
  is a merge with a flipped mask) replays the merge of the parts' float64 attention with one
  mistake at a time: ``exp(lse_i)`` without subtracting the largest lse (in the compute dtype,
  where it overflows), partial lses in log2, the sinks left out of the merge;
* ``paged_table_mistakes`` (paged cases) replays the contiguous attention over the pages a page
  table read at the wrong entry names (``block_table[b, i ± 1]``, ``paged_entry_mistakes``:
  the closer replay wins, half precision's tolerance passing both), else over pages off by one
  (``block_table[b, i] ± 1``, ``paged_mistakes``);
* ``diagnose_packed``: ALiBi's sign flipped, the chunk boundary shifted by one, a rule or mod
  ignored (hypotheses), a ``score_mod`` applied after the masking (``score_mod_after_mask``)
  and a varlen case's offsets off by one (``varlen_mistakes``);
* ``order_of_steps`` (the combined cases): the soft-cap, bias, ALiBi and ``score_mod`` in a
  wrong order (``order_of_steps``), negative segment ids taken for padding (hypotheses) and
  half precision accumulated in half precision (``half_accumulation``);
* ``rotary`` (rotary cases): the layout swapped, positions off by one or restarted, the base
  theta, the scaling, rotary_dim or the attention factor ignored (``rotary_mistakes``);
* ``latent_and_quantized`` (the MLA module case, quantised cases): rope dims not decoupled, the
  absorbed query without W_UK, the values' latent slice (``latent_mistakes``); the scale's
  granularity, fp8 saturation skipped, ties away from zero, the residual window off by one
  (``quantized_mistakes``).

A wrong layout (a ``(..., seq, heads, head_dim)`` module without ``LAYOUT = "bshd"``) needs the
module itself, not one result: ``reporting.groups`` reruns the failing cells transposed.

To add a diagnosis: a hypothesis (a change of the inputs or options that makes the reference
commit the mistake) to ``HYPOTHESES``, or a function ``(exp, step, actual) -> str`` to
``DIAGNOSES`` that looks at the result itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import spec
from ..cases import reference
from ..cases.catalogue import CaseData
from ..cases.expected import Expected, pipeline, reference_attention
from ..cases.inputs import contiguous, key_parts
from ..comparing.compare import compare
from .diagnose_packed import PACKED_HYPOTHESES, score_mod_after_mask, varlen_mistakes
from .latent_and_quantized import latent_mistakes, quantized_mistakes
from .order_of_steps import ORDER_HYPOTHESES, half_accumulation, order_of_steps
from .rotary import rotary_mistakes

#: Joins the diagnoses of one step (a diagnosis itself may contain "; ").
SEPARATOR = "; also: "

#: ``(arrays, options) -> (arrays, options)`` with the mistake planted, or None if the case
#: cannot show it.
Hypothesis = Callable[[dict[str, np.ndarray], dict[str, Any]],
                      "tuple[dict[str, np.ndarray], dict[str, Any]] | None"]


def _flip_mask(a: dict, o: dict) -> tuple[dict, dict] | None:
    return ({**a, "mask": ~np.asarray(a["mask"], bool)}, o) if a.get("mask") is not None else None


def _other_alignment(a: dict, o: dict) -> tuple[dict, dict] | None:
    if not (o.get("is_causal") or o.get("window")):
        return None
    bottom_right = o.get("causal_alignment", "top_left") == "bottom_right"
    return a, {**o, "causal_alignment": "top_left" if bottom_right else "bottom_right"}


def _gqa_modulo(a: dict, o: dict) -> tuple[dict, dict] | None:
    q, k = a["query"], a["key"]
    if q.ndim < 3 or k.shape[-3] in (1, q.shape[-3]):
        return None
    tile = [1] * k.ndim
    tile[-3] = q.shape[-3] // k.shape[-3]  # query head h meets kv head h % kv_heads
    return {**a, "key": np.tile(k, tile), "value": np.tile(a["value"], tile)}, o


def _drop(name: str, default: Any = None) -> Hypothesis:
    def hypothesis(a: dict, o: dict) -> tuple[dict, dict] | None:
        if name in a:
            return {k: v for k, v in a.items() if k != name}, o
        if o.get(name) not in (None, default):
            return a, {k: v for k, v in o.items() if k != name}
        return None

    return hypothesis


def _scale_as(text: str, wrong: Callable[[float, int], float]) -> tuple[str, Hypothesis]:
    """A hypothesis: the custom ``scale`` is used as ``wrong(scale, head_dim)``."""
    def hypothesis(a: dict, o: dict) -> tuple[dict, dict] | None:
        if o.get("scale") is None:
            return None
        return a, {**o, "scale": wrong(float(o["scale"]), a["query"].shape[-1])}

    return text, hypothesis


def _default_scale_over_d(a: dict, o: dict) -> tuple[dict, dict] | None:
    """The default scale ``1 / head_dim`` instead of ``1 / sqrt(head_dim)``."""
    if o.get("scale") is not None:
        return None
    return a, {**o, "scale": 1.0 / a["query"].shape[-1]}


def _mask_batch_zero(a: dict, o: dict) -> tuple[dict, dict] | None:
    """The mask applied to the first batch entry only (every other entry attends freely)."""
    mask, q = a.get("mask"), a["query"]
    if mask is None or q.ndim < 4 or q.shape[0] < 2:
        return None
    shape = np.broadcast_shapes(np.shape(mask), (*q.shape[:-2], q.shape[-2], a["key"].shape[-2]))
    full = np.broadcast_to(np.asarray(mask, bool), shape).copy()
    full[1:] = True
    return {**a, "mask": full}, o


def _no_rescale(a: dict, o: dict) -> tuple[dict, dict] | None:
    if not o.get("dropout_p"):
        return None
    return {**a, "value": np.asarray(a["value"], np.float64) * (1 - o["dropout_p"])}, o


HYPOTHESES: tuple[tuple[str, Hypothesis], ...] = (
    ("mask polarity flipped: the implementation treats True as 'masked out'; the spec's True "
     "means 'may attend'", _flip_mask),
    ("wrong causal alignment: the result matches the other alignment (top-left is offset 0, "
     "bottom-right is offset kv_len - q_len)", _other_alignment),
    ("wrong grouped-query mapping: query head h uses kv head h % kv_heads; the spec uses "
     "h // (heads // kv_heads)", _gqa_modulo),
    ("the mask is ignored", _drop("mask")),
    ("the bias is ignored", _drop("bias")),
    ("the custom scale is ignored (head_dim ** -0.5 used): the spec multiplies the scores by "
     "the given scale alone", _drop("scale")),
    _scale_as("the custom scale is multiplied by 1/sqrt(head_dim) as well: the spec multiplies "
              "the scores by the given scale alone", lambda scale, d: scale * d ** -0.5),
    _scale_as("the scores are divided by the custom scale: the spec multiplies them by it",
              lambda scale, d: 1.0 / scale if scale else scale),
    _scale_as("the custom scale is applied twice (scale ** 2, to query and to key): the spec "
              "applies it once, to the scores", lambda scale, d: scale * scale),
    ("soft-capping is skipped", _drop("softcap")),
    ("the dropout keep-mask is ignored", _drop("dropout_mask")),
    ("the window is ignored", _drop("window")),
    ("the causal rule is ignored", _drop("is_causal", False)),
    ("the default scale is 1/head_dim: without a custom scale the spec multiplies the scores "
     "by 1/sqrt(head_dim)", _default_scale_over_d),
    ("the mask is applied to batch entry 0 only: every batch entry has its own mask (the "
     "mask broadcasts over the leading dimensions)", _mask_batch_zero),
    ("dropout survivors are not rescaled by 1 / (1 - dropout_p)", _no_rescale),
    ("the sinks are ignored: each head's sink logit joins its rows' softmax denominator (a "
     "module without sinks declares UNSUPPORTED = {'sinks'})", _drop("sinks")),
    *PACKED_HYPOTHESES,  # ALiBi's sign, the chunk boundary, a rule or mod ignored
    *ORDER_HYPOTHESES,  # negative segment ids taken for padding
)


def planted_mistake(exp: Expected, step: str, actual: np.ndarray) -> str:
    """The first hypothesis whose reference result the backend's result matches (NaN, ±inf
    and the spec's exact zeros included; the spec's unspecified positions accept anything)."""
    for text, hypothesis in HYPOTHESES:
        variant = hypothesis(exp.data.arrays, exp.data.options)
        if variant is None:
            continue
        try:
            with np.errstate(all="ignore"):
                alt = pipeline(CaseData(*variant), exp.kind, exp.dtype, naive=False)
        except Exception:  # noqa: BLE001 - a hypothesis that cannot run explains nothing
            continue
        if step not in alt:
            continue
        res = compare(step, actual, alt[step], exp.baseline[step], exp.dtype,
                      unspecified=exp.unspecified.get(step))
        if res.passed and not np.array_equal(alt[step], exp.values[step], equal_nan=True):
            return text
    return ""


def _free(exp: Expected, step: str, shape: tuple[int, ...]) -> np.ndarray:
    unspecified = exp.unspecified.get(step)
    return np.zeros(shape, bool) if unspecified is None else np.broadcast_to(unspecified, shape)


def non_finite_rows(exp: Expected, step: str, actual: np.ndarray) -> str:
    """NaN or Inf where the spec says otherwise, or no NaN where its IEEE rule requires one."""
    ref = exp.values[step]
    free = _free(exp, step, ref.shape)
    if not exp.data.finite:
        spread = np.isnan(actual) & ~np.isnan(ref) & ~free
        missing = np.isnan(ref) & ~np.isnan(actual) & ~free
        if spread.any():
            return ("NaN reached positions the spec keeps finite: masking must replace a masked "
                    "score by -inf (NaN + -inf is NaN), and a NaN reaches only the rows that "
                    "attend it")
        if missing.any():
            if (actual[missing] == 0).all():
                return ("a NaN/Inf input gave 0 where the spec's IEEE rule gives NaN (the row "
                        "was treated like a fully masked row)")
            return "a NaN/Inf input did not reach positions the spec's IEEE rule makes NaN"
        return ""
    if not (step.endswith("output") or step.endswith("weights")) or ref.ndim < 2:
        return ""
    empty = np.isneginf(exp.values["masked_scores"]).all(-1)  # (..., q_len)
    nan_rows = np.isnan(actual).any(-1)  # (..., q_len)
    if empty.any() and nan_rows.any() and (nan_rows <= np.broadcast_to(empty, nan_rows.shape)
                                           ).all():
        return ("fully masked rows give NaN (softmax of a row of -inf, 0 / 0); the spec gives "
                "exactly 0")
    if nan_rows.any() or np.isinf(actual[np.isfinite(ref)]).any():
        masked = exp.values["masked_scores"]
        big = np.nanmax(np.abs(np.where(np.isfinite(masked), masked, 0)))
        if big > 80:
            return (f"non-finite values with logits up to {big:.3g}: the softmax overflows (exp "
                    "without subtracting the row maximum?)")
        return "non-finite values where the reference is finite"
    return ""


def mean_of_value(exp: Expected, step: str, actual: np.ndarray) -> str:
    """Fully masked rows that give the mean of ``value`` (uniform weights) instead of 0."""
    if not step.endswith("output") or "masked_scores" not in exp.values:
        return ""
    ref = exp.values[step]
    empty = np.isneginf(exp.values["masked_scores"]).all(-1)  # (..., heads, q_len)
    if not empty.any() or not np.isfinite(actual).all():
        return ""
    heads = ref.shape[-3] if ref.ndim >= 3 else 1
    v = reference.repeat_kv(np.asarray(exp.data.arrays["value"], np.float64), heads)
    mean_v = np.broadcast_to(v.mean(-2, keepdims=True), ref.shape)
    rows = np.broadcast_to(empty[..., None], ref.shape)
    if np.allclose(actual[rows], mean_v[rows], rtol=1e-2, atol=1e-2):
        return ("fully masked rows give the mean of value (uniform weights); the spec gives "
                "exactly 0")
    return ""


def _matches(exp: Expected, step: str, actual: np.ndarray, alternative: np.ndarray,
             rescale: bool = False) -> bool:
    """``actual`` passes against ``alternative`` (a mistake replayed), which differs from the
    spec's value; ``rescale``: the naive error scaled by how much larger the alternative's
    values are (a mistake that reads garbage of 1e4 rounds like values of 1e4)."""
    baseline = exp.baseline[step]
    if rescale:
        finite = np.isfinite(alternative) & np.isfinite(exp.values[step])
        big = np.max(np.abs(alternative[finite]), initial=0.0)
        baseline *= max(1.0, big / max(np.max(np.abs(exp.values[step][finite]), initial=0.0),
                                       1e-30))
    res = compare(step, actual, alternative, baseline, exp.dtype,
                  unspecified=exp.unspecified.get(step))
    return res.passed and not np.array_equal(alternative, exp.values[step], equal_nan=True)


def lse_mistakes(exp: Expected, step: str, actual: np.ndarray) -> str:
    """An lse step in log2 units, with fully masked rows at 0 or ``+inf``, off by
    ``log(scale)`` (from the unscaled scores), or without the sink."""
    if not step.endswith("lse") or step.startswith("merge"):
        return ""
    ref = exp.values[step]
    if _matches(exp, step, actual, ref * np.log2(np.e)):
        return ("the lse is in log2 (log2-sum-exp2, as kernels keep it internally); the spec's lse "
                "is the natural log: multiply by ln 2")
    empty = np.isneginf(ref)
    if empty.any() and np.isfinite(actual[~empty] - ref[~empty]).all() and (
            (actual[empty] == 0) | (actual[empty] == np.inf)).all():
        return ("fully masked rows give lse 0 or +inf; the spec gives -inf, so that a merge "
                "gives such a part no weight")
    a, o = exp.data.arrays, exp.data.options
    scale = o.get("scale")
    scale = a["query"].shape[-1] ** -0.5 if scale is None else float(scale)
    if scale > 0 and scale != 1.0:
        unscaled = pipeline(CaseData(a, {**o, "scale": 1.0}), "sdpa", exp.dtype,
                            naive=False).get("lse")
        for alt in (ref + np.log(scale), ref - np.log(scale), unscaled):
            if alt is not None and _matches(exp, step, actual, alt):
                return ("the lse is off by log(scale): it is computed from the unscaled scores "
                        "(or the scale is applied to it afterwards); the spec's lse is the "
                        "log-sum-exp of the scaled, masked scores the weights use")
    if "sinks" in exp.data.arrays:
        kept = {k: v for k, v in a.items() if k not in ("sinks", "grad_output")}
        no_sink = pipeline(CaseData(kept, o), "sdpa", exp.dtype, naive=False)["lse"]
        if _matches(exp, step, actual, no_sink):
            return ("the lse leaves the sink out: it is the log of the denominator actually "
                    "used, exp(sink) included")
    return ""


def sink_in_numerator(exp: Expected, step: str, actual: np.ndarray) -> str:
    """With sinks: every allowed weight (or every weight, masked ones included)
    ``exp(s_ij - lse) + exp(sink - lse)`` instead of ``exp(s_ij - lse)`` (the sink's term in
    the numerators too)."""
    if "sinks" not in exp.data.arrays or step not in (
            "output", "output_weights", "blockwise_output"):
        return ""
    a = exp.data.arrays
    without_dropout = {k: v for k, v in a.items() if k != "dropout_mask"}
    steps = reference_attention(without_dropout, {k: v for k, v in exp.data.options.items()
                                                  if k != "dropout_p"})  # every rule and mod
    lse = steps.lse[..., None]
    w_sink = np.where(lse == -np.inf, 0.0,
                      np.exp(reference.sink_column(a["sinks"], steps.weights.ndim) - lse))
    allowed_only = np.where(np.isneginf(steps.masked_scores), 0.0, steps.weights + w_sink)
    heads = steps.weights.shape[-3] if steps.weights.ndim >= 3 else 1
    value = reference.repeat_kv(np.asarray(a["value"], np.float64), heads)
    for weights in (allowed_only, steps.weights + w_sink):  # the masked weights too
        alt = (weights if step == "output_weights"
               else np.einsum("...qk,...kd->...qd", weights, value))
        if _matches(exp, step, actual, alt):
            return ("the sink's term is added to every weight's numerator too: the sink belongs "
                    "to the softmax denominator alone (it carries no value)")
    return ""


def _merge_replay(exp: Expected, lse_scale: float = 1.0, max_shift: bool = True,
                  sinks: bool = True, empty_zero: bool = False
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """The merge of the parts' float64 attention with a mistake: partial lses times
    ``lse_scale``, no largest lse subtracted (in the compute dtype), the sinks left out, an
    empty part's lse ``-inf`` taken as 0 (``empty_zero``; None when no part is empty)."""
    a, o = exp.data.arrays, exp.data.options
    results = [reference.attention(a["query"], part["key"], part["value"], mask=part.get("mask"),
                                   bias=part.get("bias"), scale=o.get("scale"),
                                   softcap=o.get("softcap"))
               for part in key_parts(a, o["parts"])]
    dtype = np.dtype(spec.COMPUTE_DTYPE[exp.dtype])
    lse = np.stack([r.lse for r in results]).astype(dtype) * lse_scale  # (parts, ..., q_len)
    if empty_zero:  # no empty part: the replay is the right merge, rounded
        if not np.isneginf(lse).any():
            return None
        lse = np.where(np.isneginf(lse), 0.0, lse).astype(dtype)
    m = lse.max(0) if max_shift else np.zeros(lse.shape[1:], dtype)
    m = np.where(np.isfinite(m), m, 0.0).astype(dtype)
    share = np.exp(lse - m)  # (parts, ..., q_len)
    total = share.sum(0)
    if sinks and "sinks" in a and not max_shift:
        total = total + np.exp(reference.sink_column(a["sinks"], lse.ndim)[..., 0])  # scores' rank
    out = sum(share[i][..., None] * r.output for i, r in enumerate(results))
    if max_shift:  # a correct merge, then the sinks as MERGING applies them
        total = np.where(total > 0, total, 1.0)
        merged = np.where(share.sum(0) > 0, m + np.log(total), -np.inf)
        out = out / total[..., None]
        if sinks and "sinks" in a:
            joined = np.logaddexp(merged, reference.sink_column(a["sinks"], out.ndim)[..., 0])
            out = out * np.exp(merged - joined)[..., None]
            merged = joined
        return out, merged
    return out / total[..., None], np.log(total) + m


MERGE_MISTAKES = (
    ("the merge does not subtract the largest lse: exp(lse_i) overflows for large logits and "
     "gives 0/0 for rows whose parts are all empty", {"max_shift": False}),
    ("the parts' lse are in log2 (or merged with exp2): the spec's lse is the natural log",
     {"lse_scale": float(np.log2(np.e))}),
    ("the merge leaves the sinks out: merge_attention applies them, once", {"sinks": False}),
    ("the merge takes an empty part's lse (-inf) as 0: a part with no allowed key must get "
     "weight exp(-inf - max) = 0", {"empty_zero": True}),
)


def merge_mistakes(exp: Expected, step: str, actual: np.ndarray) -> str:
    """A merge case's result that one replayed mistake (``MERGE_MISTAKES``) reproduces."""
    if exp.kind != "merge":
        return ""
    for text, mistake in MERGE_MISTAKES:
        if mistake.get("sinks") is False and "sinks" not in exp.data.arrays:
            continue
        replay = _merge_replay(exp, **mistake)
        if replay is None:
            continue
        out, lse = replay
        if _matches(exp, step, actual, out if step == "merge_output" else lse):
            return text
    return ""


def paged_mistakes(exp: Expected, step: str, actual: np.ndarray) -> str:
    """A paged case's result that the pages of ``block_table ± 1`` reproduce."""
    for shift in (1, -1):
        variant = CaseData(contiguous(exp.data.arrays, page_shift=shift), exp.data.options)
        alt = pipeline(variant, "sdpa", exp.dtype, naive=False)
        name = "lse" if step.endswith("lse") else "output"
        if _matches(exp, step, actual, alt[name], rescale=True):
            return (f"the page table is read off by one: page block_table[b, i] {shift:+d} "
                    f"instead of block_table[b, i] (position j lives in row j % block_size of "
                    f"page block_table[b, j // block_size])")
    return ""


def _entry_tables(table: np.ndarray, shift: int, num_blocks: int) -> list[np.ndarray]:
    """The block tables a kernel reads when it takes entry ``i + shift`` for entry ``i``: the
    table read flat, row after row (past a row's end, the next row's first entry; past the
    table's, its first), or each row clipped to its own entries; an unused entry (-1) read as a
    page is the last page (as NumPy, torch and JAX index). Each distinct table once."""
    rows, cols = np.indices(table.shape)
    flat = np.take(table.ravel(), rows * table.shape[1] + cols + shift, mode="wrap")
    clipped = table[rows, np.clip(cols + shift, 0, table.shape[1] - 1)]
    out: list[np.ndarray] = []
    for moved in (flat, clipped):
        moved = moved % num_blocks
        if not any(np.array_equal(moved, t) for t in out):
            out.append(moved)
    return out


def _paged_replay(exp: Expected, step: str, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """``step`` (a paged output or lse) of the contiguous attention ``arrays`` gives."""
    alt = pipeline(CaseData(arrays, exp.data.options), "sdpa", exp.dtype, naive=False)
    return alt["lse" if step.endswith("lse") else "output"]


def _distance(actual: np.ndarray, alt: np.ndarray) -> float:
    """The largest difference where both are finite (inf where they share no finite value)."""
    both = np.isfinite(actual) & np.isfinite(alt)
    return float(np.max(np.abs(actual[both] - alt[both]))) if both.any() else np.inf


def paged_entry_mistakes(exp: Expected, step: str, actual: np.ndarray) -> str:
    """A paged case's result that the table read at entry ``i ± 1`` reproduces
    (``_entry_tables``) and that no page ``block_table ± 1`` reproduces as closely (under half
    precision's tolerance both can pass)."""
    a = exp.data.arrays
    num_blocks = np.shape(a["key_pages"])[0]
    for shift in (1, -1):
        for table in _entry_tables(np.asarray(a["block_table"]), shift, num_blocks):
            alt = _paged_replay(exp, step, contiguous({**a, "block_table": table}))
            if not _matches(exp, step, actual, alt, rescale=True):
                continue
            near = _distance(actual, alt)
            pages = (_paged_replay(exp, step, contiguous(a, page_shift=s)) for s in (1, -1))
            if all(_distance(actual, page) > near for page in pages):
                return (f"the page table is read at entry i {shift:+d}: page block_table[b, i "
                        f"{shift:+d}] instead of block_table[b, i] (position j lives in row j % "
                        f"block_size of page block_table[b, j // block_size])")
    return ""


def paged_table_mistakes(exp: Expected, step: str, actual: np.ndarray) -> str:
    """``paged_entry_mistakes``, else ``paged_mistakes``: the table read at the wrong entry or
    a wrong page read from the right entry."""
    return paged_entry_mistakes(exp, step, actual) or paged_mistakes(exp, step, actual)


#: The diagnosis of a function that returns only the output where ``return_weights=True``
#: asks for ``(output, weights)``.
ONE_ARRAY = ("returns one array where return_weights=True asks for (output, weights): the "
             "harness read the output's first batch entry as the output (a keyword swallowed by "
             "**options?); return the pair, or declare UNSUPPORTED = {'return_weights'}")


def one_array(exp: Expected, step: str, actual: np.ndarray) -> str:
    """``ONE_ARRAY`` when the ``output`` step got the first entry of the output (the harness
    took ``result[0]`` of a lone array): shaped like ``output[0]`` and equal to it."""
    ref = exp.values[step]
    if step != "output" or exp.kind != "sdpa" or ref.ndim < 2 or actual.shape != ref.shape[1:]:
        return ""
    baseline = exp.baseline[step]
    return ONE_ARRAY if compare(step, actual, ref[0], baseline, exp.dtype).passed else ""


DIAGNOSES: tuple[Callable[[Expected, str, np.ndarray], str], ...] = (
    planted_mistake, non_finite_rows, mean_of_value, lse_mistakes, sink_in_numerator,
    score_mod_after_mask, order_of_steps, half_accumulation,
)


def diagnose(exp: Expected, step: str, actual: Any) -> str:
    """Plain-words reasons for a failed step of an sdpa, merge, paged, varlen, rotary,
    quantised or module case ("" when none applies)."""
    if exp.kind not in ("sdpa", "merge", "paged", "varlen", "rotary", "quantized", "module") or \
            step not in exp.values:
        return ""
    actual = np.asarray(actual).astype(np.float64)
    if actual.shape != exp.values[step].shape:
        return one_array(exp, step, actual)  # "" but for an sdpa output
    if compare(step, actual, exp.values[step], exp.baseline[step], exp.dtype,
               exp.zeros.get(step), unspecified=exp.unspecified.get(step)).passed:
        return ""  # the values conform: the step failed on its dtype (``seams.cell_reasons``)
    reasons = []
    kinds = {"sdpa": DIAGNOSES, "merge": (planted_mistake, merge_mistakes),
             "paged": (paged_table_mistakes,), "varlen": (varlen_mistakes,),
             "rotary": (rotary_mistakes,), "quantized": (quantized_mistakes,),
             "module": (latent_mistakes,)}
    for diagnosis in kinds[exp.kind]:
        text = diagnosis(exp, step, actual)
        if text and text not in reasons:
            reasons.append(text)
    return SEPARATOR.join(reasons)


def split(reasons: str) -> list[str]:
    """The single diagnoses of a text ``diagnose`` joined (``SEPARATOR``), in order."""
    return [r for r in reasons.split(SEPARATOR) if r]


def short(reason: str) -> str:
    """The name of one diagnosis: its words before the first colon or semicolon (``wrong causal
    alignment``); two cells with the same name show the same bug."""
    return reason.split(":")[0].split(";")[0].strip()


__all__ = ["DIAGNOSES", "HYPOTHESES", "MERGE_MISTAKES", "ONE_ARRAY", "SEPARATOR", "diagnose",
           "lse_mistakes", "mean_of_value", "merge_mistakes", "non_finite_rows", "one_array",
           "paged_entry_mistakes", "paged_mistakes", "paged_table_mistakes", "planted_mistake",
           "sink_in_numerator", "short", "split"]
