"""``conformance.diagnosing.diagnose``'s replayed mistakes: the hypotheses' builders,
``planted_mistake`` (the reference replayed with one mistake planted), ``_matches`` (a result
against a replayed mistake), a merge in log2, and ``diagnose`` (which diagnoses it asks, and how
it joins them).

Each test builds a wrong result by hand (the float64 reference, ``conformance.cases.reference``, run
with the mistake written out: a flipped mask, the other causal alignment, the kv heads taken
modulo, …) and asserts the diagnosis the spec's words name, or none for a result that is right
or wrong in another way; expectations come from the mistake planted, never from the
diagnosis's output. ``tests/test_diagnose_result_rows.py`` does the same for the diagnoses that
look at the result itself. Small cases, plain NumPy, no backend: a few seconds. The tests came
from mutation testing (docs/mutation.md).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from diagnose_inputs import attend, expected_for_arrays, expected_of, names

from conformance.cases import catalogue as cases
from conformance.cases import expected, reference
from conformance.cases.catalogue import CaseData
from conformance.diagnosing import diagnose

F32 = np.float32
MEAN = "fully masked rows give the mean of value (uniform weights); the spec gives exactly 0"


# ------------------------------------------------------------------------------ hypotheses


def test_flip_mask_and_other_alignment_build_the_mistake_or_nothing() -> None:
    mask = np.array([[True, False], [False, False]])
    a = {"query": np.zeros((2, 3)), "mask": mask}
    flipped, o = diagnose._flip_mask(a, {"scale": 2.0})
    np.testing.assert_array_equal(flipped["mask"], ~mask)
    assert flipped["query"] is a["query"] and o == {"scale": 2.0}
    assert diagnose._flip_mask({"query": a["query"]}, {}) is None
    assert diagnose._flip_mask({**a, "mask": None}, {}) is None
    # an int mask is read as bool: 2 is True, flipped to False
    assert diagnose._flip_mask({"mask": np.array([2, 0])}, {})[0]["mask"].tolist() == [
        False, True]
    assert diagnose._other_alignment(a, {}) is None
    assert diagnose._other_alignment(a, {"is_causal": False, "window": None}) is None
    assert diagnose._other_alignment(a, {"is_causal": True}) == (
        a, {"is_causal": True, "causal_alignment": "bottom_right"})
    assert diagnose._other_alignment(a, {"window": (1, 0), "causal_alignment": "bottom_right"}
                                     )[1]["causal_alignment"] == "top_left"
    assert diagnose._other_alignment(a, {"window": (1, 0), "causal_alignment": "top_left"}
                                     )[1]["causal_alignment"] == "bottom_right"


def test_gqa_modulo_tiles_the_kv_heads_or_declines() -> None:
    q = np.zeros((1, 4, 2, 3))
    k = np.arange(2 * 5 * 3.0).reshape(1, 2, 5, 3)
    v = -k[..., :2]
    arrays, options = diagnose._gqa_modulo({"query": q, "key": k, "value": v}, {"x": 1})
    # query head h meets kv head h % 2: kv heads 0, 1, 0, 1
    np.testing.assert_array_equal(arrays["key"], k[:, [0, 1, 0, 1]])
    np.testing.assert_array_equal(arrays["value"], v[:, [0, 1, 0, 1]])
    assert arrays["query"] is q and options == {"x": 1}
    for key in (k[:, :1], np.zeros((1, 4, 5, 3))):  # one kv head, or as many as the query's
        assert diagnose._gqa_modulo({"query": q, "key": key, "value": key}, {}) is None
    assert diagnose._gqa_modulo({"query": np.zeros((2, 3)), "key": np.zeros((5, 3)),
                                 "value": np.zeros((5, 3))}, {}) is None
    # 3-D inputs: heads on axis 0
    a3 = diagnose._gqa_modulo({"query": q[0], "key": k[0], "value": v[0]}, {})[0]
    np.testing.assert_array_equal(a3["key"], k[0][[0, 1, 0, 1]])


# ------------------------------------------------------------------------------ planted_mistake


def test_planted_mistake_names_a_flipped_mask_and_nothing_for_the_right_result() -> None:
    exp = expected_of("mask_and_bias")
    wrong = attend(exp, mask=~exp.data.arrays["mask"])
    for step in ("output", "weights", "lse", "masked_scores"):
        actual = getattr(wrong, step).astype(F32).astype(np.float64)
        assert diagnose.planted_mistake(exp, step, actual) == diagnose.HYPOTHESES[0][0]
        assert diagnose.planted_mistake(exp, step, exp.values[step]) == ""
    assert diagnose.planted_mistake(exp, "output", exp.values["output"] + 1.0) == ""


@pytest.mark.parametrize(("name", "change", "index"), [
    ("causal_bottom_right", {"causal_alignment": "top_left"}, 1),
    ("gqa", None, 2),
    ("bias", {"bias": None}, 4),
    ("scale", {"scale": None}, 5),
    ("softcap", {"softcap": None}, 9),
])
def test_planted_mistake_names_each_hypothesis(name: str, change: dict | None,
                                               index: int) -> None:
    exp = expected_of(name)
    if change is None:  # query head h on kv head h % kv_heads
        k, v = exp.data.arrays["key"], exp.data.arrays["value"]
        change = {"key": np.concatenate([k, k], -3), "value": np.concatenate([v, v], -3)}
    actual = attend(exp, **change).output.astype(F32).astype(np.float64)
    assert diagnose.planted_mistake(exp, "output", actual) == diagnose.HYPOTHESES[index][0]


def test_planted_mistake_skips_a_replay_equal_to_the_spec_value() -> None:
    """A bias of zeros: dropping it changes nothing (NaN included: a NaN query row), so the
    right result names no mistake; in float32, so a replay in the dtype would differ."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)).astype(F32) for _ in range(3))
    q[0, 1, 2, 0] = np.nan
    exp = expected_for_arrays(
        {"query": q, "key": k, "value": v, "bias": np.zeros((3, 3), F32)}, "float32")
    for step in ("output", "lse"):
        assert np.isnan(exp.values[step]).any()
        assert diagnose.planted_mistake(exp, step, exp.values[step]) == ""


def test_planted_mistake_names_a_mistake_in_a_blockwise_gradient() -> None:
    """The blockwise gradients are steps of float32 and float64 cases: the replay must keep
    the case's dtype to have them."""
    exp = expected_of("causal_bottom_right", gradients=True)
    a = exp.data.arrays
    assert "blockwise_grad_query" in exp.values
    wrong = reference.attention_vjp(a["query"], a["key"], a["value"], a["grad_output"],
                                    is_causal=True, causal_alignment="top_left")
    assert diagnose.planted_mistake(exp, "blockwise_grad_query", wrong.query.astype(F32)
                                    ) == diagnose.HYPOTHESES[1][0]


def test_planted_mistake_passes_over_hypotheses_that_fail_decline_or_lack_the_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    exp = expected_of("mask_and_bias", gradients=True)

    def raises(a: dict, o: dict) -> tuple[dict, dict]:  # the replay raises: head_dim 3 != 8
        return {**a, "key": a["key"][..., :3]}, o

    def no_grads(a: dict, o: dict) -> tuple[dict, dict]:
        return {n: x for n, x in a.items() if n != "grad_output"}, o

    monkeypatch.setattr(diagnose, "HYPOTHESES", (
        ("raises", raises), ("declines", lambda a, o: None), ("no grads", no_grads),
        ("flipped", diagnose._flip_mask)))
    a = exp.data.arrays
    wrong = reference.attention_vjp(a["query"], a["key"], a["value"], a["grad_output"],
                                    mask=~a["mask"], bias=a["bias"])
    assert diagnose.planted_mistake(exp, "grad_query", wrong.query) == "flipped"


def test_planted_mistake_accepts_anything_at_unspecified_positions() -> None:
    """nan_value_causal: rows 0-1 give weight 0 to the NaN value row, so their column is
    unspecified; a result with the causal rule ignored, NaN there too, is still named."""
    exp = expected_of("nan_value_causal")
    with np.errstate(all="ignore"):
        wrong = attend(exp, is_causal=None).output
    free = exp.unspecified["output"]
    assert free.any() and np.isnan(wrong[free]).all()
    actual = np.where(free, 5.0, wrong)  # any value where the spec allows one
    assert diagnose.planted_mistake(exp, "output", actual) == diagnose.HYPOTHESES[12][0]


# ------------------------------------------------------------------------------ _matches


def _hand(values: list[float], baseline: float = 1e-3) -> expected.Expected:
    """A float32 Expected of one step, ``paged_output``, with the given values."""
    return expected.Expected("hand", "paged", "float32", CaseData({}),
                             {"paged_output": np.array(values)}, {"paged_output": baseline})


@pytest.mark.parametrize(("values", "alternative", "error", "rescale", "passes"), [
    # float32: bound 1e-7 + 10 e; e = 1e-3 scaled by max(1, largest |alternative| / largest
    # |value|) over the positions finite in both: 50 / 0.5 = 100 here (bound ~1.0)
    ([0.5, -0.25, 3.0, np.nan], [50.0, -10.0, np.inf, 1000.0], 0.9, True, True),
    ([0.5, -0.25, 3.0, np.nan], [50.0, -10.0, np.inf, 1000.0], 1.1, True, False),
    ([0.5, -0.25, 3.0, np.nan], [50.0, -10.0, np.inf, 1000.0], 0.009, False, True),
    ([0.5, -0.25, 3.0, np.nan], [50.0, -10.0, np.inf, 1000.0], 0.9, False, False),
    ([1.0, 2.0], [1.5, 3.0], 0.012, True, True),  # scaled by 1.5: bound ~0.015
    ([1.0, 2.0], [1.5, 3.0], 0.018, True, False),
    ([4.0, 2.0], [1.0, 2.5], 0.008, True, True),  # 2.5 / 4 < 1: never scaled down
    ([4.0, 2.0], [1.0, 2.5], 0.012, True, False),
    ([np.nan, np.nan], [5.0, 6.0], 0.008, True, True),  # no common finite value: not scaled
    ([np.nan, np.nan], [5.0, 6.0], 0.012, True, False),
    ([1.0, 2.0], [1.0, 2.0], 0.0, True, False),  # the spec's own value is no mistake
    ([1.0, np.nan], [1.0, np.nan], 0.0, False, False),  # NaN included
])
def test_matches_scales_the_baseline_by_the_alternatives_size(
        values: list, alternative: list, error: float, rescale: bool, passes: bool) -> None:
    exp = _hand(values)
    alt = np.array(alternative)
    actual = np.where(np.isfinite(alt), alt + error, alt)
    assert diagnose._matches(exp, "paged_output", actual, alt, rescale=rescale) is passes
    if not rescale:  # the default
        assert diagnose._matches(exp, "paged_output", actual, alt) is passes
    assert exp.baseline == {"paged_output": 1e-3}  # the Expected is left as it was


def test_matches_accepts_anything_at_unspecified_positions() -> None:
    exp = _hand([1.0, 2.0, 3.0])
    alt = np.array([1.0, 2.5, 3.0])
    exp.unspecified["paged_output"] = np.array([False, False, True])
    assert diagnose._matches(exp, "paged_output", np.array([1.0, 2.5, np.nan]), alt)
    assert not diagnose._matches(exp, "paged_output", np.array([1.0, 2.5, np.nan]), alt * 2)


# ------------------------------------------------------------------------------ merge in log2


def _merged_in_log2(data: CaseData) -> tuple[np.ndarray, np.ndarray]:
    """The merge of the parts' float64 attention with their lses taken as log2 (each row's
    largest subtracted, the sinks joined after the merge, as merge_attention does): output
    ``(..., q_len, v_dim)`` and lse ``(..., q_len)``."""
    a, o = data.arrays, data.options
    outs, lses = [], []
    for part in range(o["parts"]):
        keys = np.flatnonzero(a["key_part"] == part)
        cut = {n: (a[n] if a[n].shape[-1] == 1 else a[n][..., keys])
               for n in ("mask", "bias") if n in a}
        steps = reference.attention(a["query"], a["key"][..., keys, :], a["value"][..., keys, :],
                                    **cut)
        outs.append(steps.output)
        lses.append(steps.lse * np.log2(np.e))
    with np.errstate(all="ignore"):
        top = np.max(lses, 0)
        top = np.where(np.isfinite(top), top, 0.0)  # (..., q_len)
        shares = np.exp(np.array(lses) - top)
        total = shares.sum(0)
        out = (shares[..., None] * np.array(outs)).sum(0) / np.where(total > 0, total, 1)[
            ..., None]
        lse = np.where(total > 0, top + np.log(total), -np.inf)
        if "sinks" in a:
            joined = np.logaddexp(lse, np.asarray(a["sinks"], np.float64)[:, None])
            out, lse = out * np.exp(lse - joined)[..., None], joined
    return out, lse


def test_merge_in_log2_is_named_for_the_lse_with_sinks_and_rows_far_apart() -> None:
    """The merged lse of a case with sinks; and float32 rows whose lses are 200 apart (a bias
    of 200 on query 0), where one largest lse for every row would leave the others' shares 0."""
    data = cases.prepare_inputs(cases.get("merge_empty_split_sinks_gqa"), "float64")
    exp = expected.expected_for(data, "merge", "float64", gradients=False)
    out, lse = _merged_in_log2(data)
    with np.errstate(all="ignore"):
        assert diagnose.MERGE_MISTAKES[1][0] in diagnose.split(
            diagnose.diagnose(exp, "merge_lse", lse))
    data = cases.prepare_inputs(cases.get("merge_two_splits"), "float32")
    bias = np.zeros((5, 7), F32)
    bias[0] = 200
    data = CaseData({**data.arrays, "bias": bias}, data.options)
    exp = expected.expected_for(data, "merge", "float32", gradients=False)
    out, lse = _merged_in_log2(data)
    assert np.ptp(exp.values["merge_lse"][..., :2]) > 150
    with np.errstate(all="ignore"):
        for step, actual in (("merge_output", out), ("merge_lse", lse)):
            assert diagnose.MERGE_MISTAKES[1][0] in diagnose.split(
                diagnose.diagnose(exp, step, actual.astype(F32))), step


# ------------------------------------------------------------------------------ diagnose


def test_diagnose_joins_every_diagnosis_that_applies_in_order() -> None:
    """Queries of zeros: every allowed score is 0, so with the mask ignored a fully masked row
    gets uniform weights, the mean of ``value``: two diagnoses of one result."""
    rng = np.random.default_rng(11)
    mask = rng.random((1, 2, 3, 4)) < 0.5
    mask[0, 1, 2] = False
    mask[0, 0, 0] = True
    exp = expected_for_arrays({"query": np.zeros((1, 2, 3, 5)),
                               "key": rng.standard_normal((1, 2, 4, 5)),
                               "value": rng.standard_normal((1, 2, 4, 3)), "mask": mask},
                              "float32")
    v = exp.data.arrays["value"].astype(np.float64)
    actual = np.broadcast_to(v.mean(-2, keepdims=True), exp.values["output"].shape)
    text = diagnose.diagnose(exp, "output", actual.astype(F32).tolist())  # any array-like
    assert names(text) == ["the mask is ignored", "fully masked rows give the mean of value "
                            "(uniform weights)"]
    assert text == diagnose.HYPOTHESES[3][0] + diagnose.SEPARATOR + MEAN
    assert diagnose.diagnose(exp, "output", exp.values["output"]) == ""


def test_diagnose_names_each_text_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def says(text: str):  # noqa: ANN202 - a stub diagnosis
        def diagnosis(exp: expected.Expected, step: str, actual: np.ndarray) -> str:
            calls.append((text, step, actual.dtype, actual.shape))
            return text
        return diagnosis

    monkeypatch.setattr(diagnose, "DIAGNOSES", (says("a"), says(""), says("a"), says("b")))
    exp = expected_of("self")
    actual = exp.values["output"].astype(F32) + 1  # a wrong result (a right one asks nothing)
    assert diagnose.diagnose(exp, "output", actual) == "a" + diagnose.SEPARATOR + "b"
    assert [c[0] for c in calls] == ["a", "", "a", "b"]
    assert {c[1:] for c in calls} == {("output", np.dtype(np.float64), actual.shape)}


def test_diagnose_asks_nothing_outside_its_kinds_steps_and_shapes() -> None:
    exp = expected_of("mask_and_bias")
    wrong = attend(exp, mask=~exp.data.arrays["mask"]).output
    assert diagnose.diagnose(exp, "output", wrong) == diagnose.HYPOTHESES[0][0]
    assert diagnose.diagnose(exp, "output", wrong[..., :-1]) == ""  # another shape
    assert diagnose.diagnose(exp, "grad_query", wrong) == ""  # no such step (no gradients)
    module = replace(exp, kind="module")
    assert diagnose.diagnose(module, "output", wrong) == ""


def test_diagnose_asks_planted_mistake_on_merge_cases_and_varlen_mistakes_on_varlen() -> None:
    merge = expected_of("merge_empty_split_sinks_gqa", "float64")
    a = merge.data.arrays
    flipped = reference.attention(a["query"], a["key"], a["value"], mask=~a["mask"],
                                  sinks=a["sinks"])
    assert names(diagnose.diagnose(merge, "merge_output", flipped.output)) == [
        diagnose.short(diagnose.HYPOTHESES[0][0])]
    # varlen: the queries split by cu_seq_q with every inner offset one later
    varlen = expected_of("varlen_causal_gqa", "float32")
    a = varlen.data.arrays
    cu_q, cu_k = [0, 4, 4, 5, 9, 10], a["cu_seq_k"]
    assert a["cu_seq_q"].tolist() == [0, 3, 3, 4, 8, 10]
    out = np.zeros(a["query"].shape[:-1] + a["value"].shape[-1:])
    for i in range(len(cu_q) - 1):
        q = slice(cu_q[i], cu_q[i + 1])
        k = slice(int(cu_k[i]), int(cu_k[i + 1]))
        steps = reference.attention(*(np.swapaxes(a[n][s], 0, 1) for n, s in (
            ("query", q), ("key", k), ("value", k))), is_causal=True,
            causal_alignment="bottom_right")
        out[q] = np.swapaxes(steps.output, 0, 1)
    text = diagnose.diagnose(varlen, "varlen_output", out.astype(F32))
    assert text.startswith("the offsets are off by one: the result matches cu_seq_q with "
                           "every inner offset +1")
