"""The mistakes only the combined cases show (``conformance.cases.combined``), for
``conformance.diagnosing.diagnose``: the steps before masking in another order, a negative
segment id taken for padding, and half precision computed in half precision.

* ``order_of_steps`` replays the float64 reference with the steps between the scaled scores and
  the masking (``spec.PIPELINE_WITH_MODS``: soft-cap → + bias → + ALiBi → ``score_mod``) in one
  wrong order at a time (``ORDERS``: ALiBi, the bias, or both added before the soft-cap, the
  ``score_mod`` applied first, the soft-cap applied last), and
  names the order whose replay the result matches (the nearest, when the tolerance of a half
  precision passes several). A replay runs only where the case has two of those steps whose
  order the mistake changes; the masking, the softmax with the sinks and the output are the
  reference's own (the scores of the wrong order reach it as a ``score_mod``);
* ``ORDER_HYPOTHESES`` join ``diagnose.HYPOTHESES``: negative segment ids treated as padding
  (a query or key of a negative id attends nothing and is attended by nothing; the spec's ids
  are plain labels, ``spec.SEGMENT_IDS``: no id is special), replayed on the cases with a
  negative id;
* ``half_accumulation`` replays a float16 or bfloat16 case computed entirely in that dtype: the
  naive pipeline (``cases.naive``) with every sum (the scores' dot products, the softmax's row
  sum, the weighted sum of values) accumulated in the input dtype one term at a time, where the
  spec computes half-precision inputs in float32 (``spec.COMPUTE_DTYPE``). NumPy's own float16
  sums and products accumulate in float32, so only an accumulation written out (or a kernel's)
  makes the mistake; ``combined_long_keys``' 384 keys show it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..cases import mods, reference
from ..cases.catalogue import CaseData
from ..cases.dtypes import numpy_dtype
from ..cases.expected import Expected
from ..cases.naive import Precision, naive_attention
from ..comparing.compare import compare

#: The steps between the scaled scores and the masking, in the spec's order.
SPEC_ORDER = ("softcap", "bias", "alibi", "score_mod")

ALIBI_BEFORE_SOFTCAP = ("ALiBi added before the soft-cap: the spec soft-caps first, then adds "
                        "the bias and ALiBi (as flash-attention's kernel caps, then adds ALiBi)")
BIAS_BEFORE_SOFTCAP = ("the bias added before the soft-cap: the spec soft-caps first, then adds "
                       "the bias and ALiBi")
BIAS_AND_ALIBI_BEFORE_SOFTCAP = ("the bias and ALiBi added before the soft-cap: the spec "
                                 "soft-caps first, then adds the bias and ALiBi")
SCORE_MOD_FIRST = ("score_mod applied before the soft-cap, the bias and ALiBi: the spec applies "
                   "it after all of them, just before the masking, so that it sees the final "
                   "score")
SOFTCAP_LAST = ("the soft-cap applied last, after the bias, ALiBi and score_mod: the spec "
                "soft-caps the scaled scores first")

#: Each wrong order and its diagnosis, the single moves first: where a case lacks a step, two
#: orders can be the same replay, and the first names it (without ALiBi, "the bias and ALiBi
#: added before the soft-cap" is "the bias added before the soft-cap"). A ``score_mod`` moved
#: among the bias and ALiBi alone is no mistake the cases can show: the harness's score mods
#: that may meet a bias add (an ALiBi of other slopes), and additions commute (``_canonical``).
ORDERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (ALIBI_BEFORE_SOFTCAP, ("alibi", "softcap", "bias", "score_mod")),
    (BIAS_BEFORE_SOFTCAP, ("bias", "softcap", "alibi", "score_mod")),
    (BIAS_AND_ALIBI_BEFORE_SOFTCAP, ("bias", "alibi", "softcap", "score_mod")),
    (SCORE_MOD_FIRST, ("score_mod", "softcap", "bias", "alibi")),
    (SOFTCAP_LAST, ("bias", "alibi", "score_mod", "softcap")),
)

#: The steps a replay gives, by the name of ``reference.Steps``' field.
_REPLAYED = {"output": "output", "output_weights": "weights", "lse": "lse",
             "blockwise_output": "output", "blockwise_lse": "lse"}


def present_steps(data: CaseData) -> tuple[str, ...]:
    """The steps of ``SPEC_ORDER`` a case has (a soft-cap, a bias, ALiBi slopes, a
    ``score_mod``), in the spec's order."""
    a, o = data.arrays, data.options
    have = {"softcap": o.get("softcap") is not None, "bias": "bias" in a,
            "alibi": "alibi_slopes" in a, "score_mod": o.get("score_mod") is not None}
    return tuple(s for s in SPEC_ORDER if have[s])


def _additive(step: str, data: CaseData) -> bool:
    """The step adds a term independent of the score (two such steps commute)."""
    return step in ("bias", "alibi") or (step == "score_mod" and
                                         mods.additive(data.options.get("score_mod")))


def _canonical(order: tuple[str, ...], data: CaseData) -> tuple[Any, ...]:
    """``order`` with each run of additive steps as one set: two orders that differ only in
    the order of additions give the same scores."""
    out: list[Any] = []
    for step in order:
        if _additive(step, data) and out and isinstance(out[-1], frozenset):
            out[-1] = out[-1] | {step}
        else:
            out.append(frozenset({step}) if _additive(step, data) else step)
    return tuple(out)


def replay_order(data: CaseData, order: tuple[str, ...]) -> reference.Steps:
    """The float64 reference of an sdpa case with the steps of ``SPEC_ORDER`` applied in
    ``order`` (each step the case lacks skipped); arrays ``query (..., heads, q_len, head_dim)``
    and the rest as ``reference.attention`` takes them."""
    a = {k: v for k, v in data.arrays.items() if k != "grad_output"}
    kwargs = mods.sdpa_kwargs(a, data.options)
    softcap, bias = kwargs.pop("softcap", None), kwargs.pop("bias", None)
    slopes, score_mod = kwargs.pop("alibi_slopes", None), kwargs.pop("score_mod", None)
    q, k, v = (np.asarray(a[n]).astype(np.float64) for n in ("query", "key", "value"))
    heads = q.shape[-3] if q.ndim >= 3 else 1
    scale = q.shape[-1] ** -0.5 if kwargs.get("scale") is None else float(kwargs["scale"])
    scores = np.einsum("...qd,...kd->...qk", q, reference.repeat_kv(k, heads)) * scale
    grid = reference.mod_indices(scores.shape)  # (..., heads, q_len, kv_len)
    for step in order:
        if step == "softcap" and softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        elif step == "bias" and bias is not None:
            scores = scores + np.asarray(bias).astype(np.float64)
        elif step == "alibi" and slopes is not None:
            scores = scores + reference.alibi_bias(slopes, scores.shape,
                                                   kwargs.get("causal_alignment", "top_left"))
        elif step == "score_mod" and score_mod is not None:
            scores = np.asarray(score_mod(scores, *grid)).astype(np.float64)
    final = np.broadcast_to(scores, np.shape(scores))

    def reordered(score: np.ndarray, *_: np.ndarray) -> np.ndarray:
        return np.broadcast_to(final, np.shape(score))

    return reference.attention(q, k, v, score_mod=reordered, **kwargs)


def _distance(actual: np.ndarray, alt: np.ndarray) -> float:
    """The largest difference where both are finite (inf where they share no finite value)."""
    both = np.isfinite(actual) & np.isfinite(alt)
    return float(np.max(np.abs(actual[both] - alt[both]))) if both.any() else np.inf


def order_of_steps(exp: Expected, step: str, actual: np.ndarray) -> str:
    """The diagnosis of ``ORDERS`` whose replay (``replay_order``) the result matches, the
    nearest when several do; "" for a case with fewer than two of the steps, or none matching.
    ``actual``: the step's result, float64, shaped like ``exp.values[step]``."""
    if exp.kind != "sdpa" or step not in _REPLAYED:
        return ""
    present = present_steps(exp.data)
    if len(present) < 2:
        return ""
    seen = {_canonical(present, exp.data)}  # the spec's order explains nothing
    found: list[tuple[float, str]] = []
    for text, order in ORDERS:
        effective = tuple(s for s in order if s in present)
        key = _canonical(effective, exp.data)
        if key in seen:
            continue
        seen.add(key)
        try:
            with np.errstate(all="ignore"):
                alt = getattr(replay_order(exp.data, effective), _REPLAYED[step])
        except Exception:  # noqa: BLE001 - a replay that cannot run explains nothing
            continue
        if alt.shape != exp.values[step].shape or np.array_equal(alt, exp.values[step],
                                                                 equal_nan=True):
            continue
        if compare(step, actual, alt, exp.baseline[step], exp.dtype,
                   unspecified=exp.unspecified.get(step)).passed:
            found.append((_distance(actual, alt), text))
    return min(found)[1] if found else ""


def _negative_ids_as_padding(a: dict, o: dict) -> tuple[dict, dict] | None:
    """Every negative segment id made an id no other token has (queries one, keys another):
    those tokens attend nothing and nothing attends them. None without a negative id."""
    if "q_segment_ids" not in a:
        return None
    q_ids, kv_ids = (np.asarray(a[n]).astype(np.int64) for n in ("q_segment_ids",
                                                                  "kv_segment_ids"))
    if not ((q_ids < 0).any() or (kv_ids < 0).any()):
        return None
    top = max(int(q_ids.max(initial=0)), int(kv_ids.max(initial=0)), 0)
    return {**a, "q_segment_ids": np.where(q_ids < 0, top + 1, q_ids),
            "kv_segment_ids": np.where(kv_ids < 0, top + 2, kv_ids)}, o


NEGATIVE_IDS_AS_PADDING = ("negative segment ids are treated as padding: their queries attend "
                           "nothing and their keys are never attended; the spec's ids are plain "
                           "labels, no id is special (tokens of equal ids attend each other, "
                           "-1 included)")

#: ``diagnose.HYPOTHESES`` of the combined cases: ``(text, (arrays, options) -> (arrays,
#: options) | None)``.
ORDER_HYPOTHESES: tuple[tuple[str, Callable[[dict, dict], Any]], ...] = (
    (NEGATIVE_IDS_AS_PADDING, _negative_ids_as_padding),
)


class HalfAccumulation(Precision):
    """A straightforward implementation in ``dtype`` (float16 or bfloat16) that also
    accumulates in ``dtype``: each product rounded, then added to a running sum rounded after
    every addition, term after term."""

    @property
    def accumulate(self) -> np.dtype:
        """The input dtype itself (the mistake; the spec's compute dtype is float32)."""
        return numpy_dtype(self.dtype)

    def _running_sum(self, terms: np.ndarray, axis: int) -> np.ndarray:
        """The sum over ``axis`` (dropped), one rounded addition at a time, float64."""
        terms = np.moveaxis(self.round(terms), axis, -1)
        total = np.zeros(terms.shape[:-1])
        for j in range(terms.shape[-1]):
            total = self.round(total + terms[..., j])
        return total

    def einsum(self, subscripts: str, a: Any, b: Any) -> np.ndarray:
        """The two contractions of ``naive_attention``: ``...qd,...kd->...qk`` (scores) and
        ``...qk,...kd->...qd`` (weights @ value), accumulated in ``dtype``."""
        a, b = (np.asarray(x).astype(np.float64) for x in (a, b))
        if subscripts == "...qd,...kd->...qk":  # (..., q, k, d) products, summed over d
            return self._running_sum(a[..., :, None, :] * b[..., None, :, :], -1)
        if subscripts == "...qk,...kd->...qd":  # (..., q, k, d) products, summed over k
            return self._running_sum(a[..., :, :, None] * b[..., None, :, :], -2)
        raise ValueError(f"HalfAccumulation.einsum: no running sum for {subscripts!r}")

    def matmul(self, a: Any, b: Any) -> np.ndarray:
        """``a @ b`` (``(..., n, m) @ (..., m, p)``) accumulated in ``dtype``."""
        a, b = (np.asarray(x).astype(np.float64) for x in (a, b))
        return self._running_sum(a[..., :, :, None] * b[..., None, :, :], -2)

    def sum(self, x: np.ndarray, axis: int = -1) -> np.ndarray:
        """Sum over ``axis`` (kept) accumulated in ``dtype``."""
        return np.expand_dims(self._running_sum(np.asarray(x), axis), axis)


HALF_ACCUMULATION = ("{dtype} computed entirely in {dtype}: the sums (the scores' dot products, "
                     "the softmax's row sum, the weighted sum of values) are accumulated in "
                     "{dtype}; the spec computes half-precision inputs in float32 "
                     "(COMPUTE_DTYPE) and rounds the result to {dtype} once")


def half_accumulation(exp: Expected, step: str, actual: np.ndarray) -> str:
    """``HALF_ACCUMULATION`` when a float16 or bfloat16 sdpa case's result matches the naive
    pipeline with every sum accumulated in that dtype (``HalfAccumulation``); mods are folded
    into a mask and a bias first (``mods.dedicated``). ``actual``: float64, shaped like
    ``exp.values[step]``."""
    if exp.kind != "sdpa" or exp.dtype not in ("float16", "bfloat16") or step not in _REPLAYED:
        return ""
    data = CaseData({k: v for k, v in exp.data.arrays.items() if k != "grad_output"},
                    exp.data.options)
    try:
        if mods.uses_mods(data):
            data = mods.dedicated(data)
        with np.errstate(all="ignore"):
            alt = getattr(naive_attention(data.arrays, data.options,
                                          HalfAccumulation(exp.dtype)), _REPLAYED[step])
    except ValueError:  # a soft-cap score_mod after a bias: no dedicated replay
        return ""
    if alt.shape != exp.values[step].shape:
        return ""
    res = compare(step, actual, alt, exp.baseline[step], exp.dtype,
                  unspecified=exp.unspecified.get(step))
    return HALF_ACCUMULATION.format(dtype=exp.dtype) if res.passed else ""


__all__ = ["ALIBI_BEFORE_SOFTCAP", "BIAS_AND_ALIBI_BEFORE_SOFTCAP", "BIAS_BEFORE_SOFTCAP",
           "HALF_ACCUMULATION", "NEGATIVE_IDS_AS_PADDING", "ORDERS", "ORDER_HYPOTHESES",
           "SCORE_MOD_FIRST", "SOFTCAP_LAST", "SPEC_ORDER",
           "HalfAccumulation", "half_accumulation", "order_of_steps", "present_steps",
           "replay_order"]
