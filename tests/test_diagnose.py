"""``conformance.diagnosing.diagnose``: each diagnosis on a result built by hand to commit its
mistake.

The wrong results are computed here from the float64 reference (``conformance.cases.reference``)
with the mistake written out in NumPy, independently of the replay ``diagnose`` does; the expected
text is the diagnosis's own name (``short``). Small shapes, plain NumPy, milliseconds per test.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.cases import catalogue as cases
from conformance.cases import expected, reference
from conformance.cases.catalogue import CaseData
from conformance.comparing import compare
from conformance.diagnosing import diagnose


def test_split_and_short_take_a_joined_text_apart() -> None:
    joined = "a: one; two" + diagnose.SEPARATOR + "b; three"
    assert diagnose.split(joined) == ["a: one; two", "b; three"]
    assert diagnose.split("") == []
    assert [diagnose.short(r) for r in diagnose.split(joined)] == ["a", "b"]


# ------------------------------------------------------------------------------ hypotheses
# The hypotheses are built once, at import (``HYPOTHESES``); these call the builders directly.


def _arrays() -> dict:
    rng = np.random.default_rng(0)
    return {"query": rng.standard_normal((2, 3, 4)), "key": rng.standard_normal((2, 5, 4)),
            "value": rng.standard_normal((2, 5, 6)).astype(np.float32),
            "bias": rng.standard_normal((3, 5))}


def test_drop_removes_an_array_or_an_option_off_its_default() -> None:
    a = _arrays()
    arrays, options = diagnose._drop("bias")(a, {"scale": 0.5})
    assert sorted(arrays) == ["key", "query", "value"] and options == {"scale": 0.5}
    assert diagnose._drop("is_causal", False)(a, {"is_causal": True, "scale": 0.5}) == (
        a, {"scale": 0.5})
    assert diagnose._drop("is_causal", False)(a, {"is_causal": False}) is None
    assert diagnose._drop("window")(a, {"window": None}) is None


def test_scale_as_replaces_the_custom_scale_with_the_wrong_one() -> None:
    a = _arrays()
    text, hypothesis = diagnose._scale_as("times head_dim", lambda scale, d: scale * d)
    assert text == "times head_dim"
    assert hypothesis(a, {"scale": 0.5, "softcap": 2.0}) == (a, {"scale": 2.0, "softcap": 2.0})
    assert hypothesis(a, {"softcap": 2.0}) is None


def test_no_rescale_multiplies_value_by_the_keep_probability() -> None:
    a = _arrays()
    arrays, options = diagnose._no_rescale(a, {"dropout_p": 0.25})
    np.testing.assert_array_equal(arrays["value"], a["value"].astype(np.float64) * 0.75)
    assert arrays["value"].dtype == np.float64 and options == {"dropout_p": 0.25}
    assert arrays["query"] is a["query"]
    assert diagnose._no_rescale(a, {"dropout_p": 0.0}) is None
    assert diagnose._no_rescale(a, {}) is None


# ------------------------------------------------------------------------------ merge


def _case(name: str, dtype: str, **change: object) -> CaseData:
    data = cases.prepare_inputs(cases.get(name), dtype)
    arrays = {**data.arrays, **{k: v for k, v in change.items() if isinstance(v, np.ndarray)}}
    options = {**data.options, **{k: v for k, v in change.items()
                                  if not isinstance(v, np.ndarray)}}
    return CaseData(arrays, options)


def _parts(data: CaseData) -> tuple[np.ndarray, np.ndarray]:
    """Each part's float64 attention, no sinks: outputs ``(parts, ..., q_len, v_dim)`` and
    lses ``(parts, ..., q_len)``."""
    a, o = data.arrays, data.options
    outs, lses = [], []
    for part in range(o["parts"]):
        keys = np.flatnonzero(a["key_part"] == part)
        cut = {n: (a[n] if a[n].shape[-1] == 1 else a[n][..., keys])
               for n in ("mask", "bias") if n in a}
        steps = reference.attention(a["query"], a["key"][..., keys, :], a["value"][..., keys, :],
                                    scale=o.get("scale"), softcap=o.get("softcap"), **cut)
        outs.append(steps.output)
        lses.append(steps.lse)
    return np.stack(outs), np.stack(lses)


def _weighted(outs: np.ndarray, shares: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return (shares[..., None] * outs).sum(0) / shares.sum(0)[..., None]


def _merge_diagnosis(data: CaseData, dtype: str, step: str, actual: np.ndarray) -> list[str]:
    exp = expected.expected_for(data, "merge", dtype, gradients=False)
    assert not compare.compare_step(exp, step, actual).passed  # the mistake fails the step
    with np.errstate(all="ignore"):  # the replayed overflow
        return diagnose.split(diagnose.diagnose(exp, step, actual))


def test_merge_of_lses_in_log2_is_named_with_bias_and_softcap() -> None:
    rng = np.random.default_rng(1)
    data = _case("merge_two_splits", "float64", bias=rng.standard_normal((5, 7)) * 2,
                 softcap=1.5, scale=0.9)
    outs, lses = _parts(data)
    scaled = lses * np.log2(np.e)
    actual = _weighted(outs, np.exp(scaled - scaled.max(0)))
    assert diagnose.MERGE_MISTAKES[1][0] in _merge_diagnosis(data, "float64", "merge_output",
                                                              actual)


def test_merge_without_the_largest_lse_overflows_and_is_named() -> None:
    data = _case("merge_four_splits_huge", "float32")
    outs, lses = _parts(data)
    with np.errstate(all="ignore"):
        actual = _weighted(outs, np.exp(lses.astype(np.float32)))  # inf / inf, 0 / 0: NaN
    assert np.isnan(actual).any()
    assert diagnose.MERGE_MISTAKES[0][0] in _merge_diagnosis(data, "float32", "merge_output",
                                                              actual)


def test_merge_without_the_sinks_is_named_for_output_and_lse() -> None:
    data = _case("merge_empty_split_sinks_gqa", "float64")
    outs, lses = _parts(data)
    with np.errstate(all="ignore"):
        top = lses.max(0)
        top = np.where(np.isfinite(top), top, 0.0)
        shares = np.exp(lses - top)
        total = shares.sum(0)
        output = np.where(total[..., None] > 0, _weighted(outs, shares), 0.0)
        lse = np.where(total > 0, top + np.log(total), -np.inf)
    text = diagnose.MERGE_MISTAKES[2][0]
    assert text in _merge_diagnosis(data, "float64", "merge_output", output)
    assert text in _merge_diagnosis(data, "float64", "merge_lse", lse)


# ------------------------------------------------------------------------------ paged


def _read_off_by(data: CaseData, shift: int) -> tuple[np.ndarray, np.ndarray]:
    """The float64 attention over the pages ``block_table + shift`` (mod the number of pages),
    rounded to float32 as a float32 backend returns it: output ``(batch, heads, q_len, v_dim)``
    and lse ``(batch, heads, q_len)``."""
    a, o = data.arrays, data.options
    kp, vp, table, lens = a["key_pages"], a["value_pages"], a["block_table"], a["seq_lens"]
    num_blocks, block_size = kp.shape[:2]
    q_len, kv_len = a["query"].shape[-2], int(lens.max())
    key = np.zeros((len(lens), kp.shape[2], kv_len, kp.shape[3]))
    value = np.zeros((len(lens), vp.shape[2], kv_len, vp.shape[3]))
    for b, n in enumerate(lens):
        for j in range(int(n)):
            page = (int(table[b, j // block_size]) + shift) % num_blocks
            key[b, :, j], value[b, :, j] = kp[page, j % block_size], vp[page, j % block_size]
    i, j = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    mask = (j[None] <= np.asarray(lens)[:, None, None] - q_len + i[None])[:, None]
    steps = reference.attention(a["query"], key, value, mask=mask, softcap=o.get("softcap"),
                                sinks=a.get("sinks"))
    return steps.output.astype(np.float32), steps.lse.astype(np.float32)


@pytest.mark.parametrize(("case", "shift"), [("paged_decode_gqa", 1),
                                             ("paged_two_queries_sinks", -1)])
def test_a_page_table_read_off_by_one_is_named_with_its_sign(case: str, shift: int) -> None:
    """The pages no sequence uses hold values of 1e4: a shifted read mixes them in, rounded in
    float32 (errors ~1e-4, far above the real values' tolerance, so the naive error must be
    rescaled for the replay to match); the lse step too (the second case with its soft-cap and
    sinks); a result wrong in another way gets no diagnosis."""
    data = _case(case, "float32")
    a = dict(data.arrays)
    block_size = a["key_pages"].shape[1]
    used = [p for b, n in enumerate(a["seq_lens"])
            for p in a["block_table"][b, :-(-int(n) // block_size)]]
    unused = np.setdiff1d(np.arange(a["key_pages"].shape[0]), used)
    assert unused.size
    garbage = np.random.default_rng(3).standard_normal(a["value_pages"][unused].shape) * 1e4
    a["value_pages"] = a["value_pages"].copy()
    a["value_pages"][unused] = garbage.astype(np.float32)
    data = CaseData(a, data.options)
    exp = expected.expected_for(data, "paged", "float32", gradients=False)
    output, lse = _read_off_by(data, shift)
    for step, actual in (("paged_output", output), ("paged_lse", lse)):
        assert not compare.compare_step(exp, step, actual).passed
        reasons = diagnose.split(diagnose.diagnose(exp, step, actual))
        assert [diagnose.short(r) for r in reasons] == ["the page table is read off by one"]
        assert f"block_table[b, i] {shift:+d} instead" in reasons[0]
    assert diagnose.diagnose(exp, "paged_output", exp.values["paged_output"] + 1.0) == ""


def test_merge_mistakes_name_nothing_outside_a_merge_or_for_sinks_a_case_lacks() -> None:
    sdpa = expected.expected(cases.get("self"), "float32")
    assert diagnose.merge_mistakes(sdpa, "output", sdpa.values["output"]) == ""
    # lses near 200 (a bias of 200): the replays without the largest lse overflow, in log2
    # differ, and without sinks equal the right result, which is no mistake for a case
    # without sinks
    bias = 200 + np.random.default_rng(2).standard_normal((5, 7)).astype(np.float32)
    large = expected.expected_for(_case("merge_two_splits", "float32", bias=bias), "merge",
                                  "float32", gradients=False)
    with np.errstate(all="ignore"):
        assert diagnose.merge_mistakes(large, "merge_output", large.values["merge_output"]) == ""


def test_merge_of_lses_in_log2_is_named_with_large_lses_and_with_sinks() -> None:
    """A bias of 200 puts every lse near 200: exp(lse) overflows float32 unless the largest lse
    is subtracted first."""
    bias = 200 + np.random.default_rng(2).standard_normal((5, 7)).astype(np.float32)
    for name, dtype, change in (("merge_two_splits", "float32", {"bias": bias}),
                                ("merge_empty_split_sinks_gqa", "float64", {})):
        data = _case(name, dtype, **change)
        outs, lses = _parts(data)
        with np.errstate(all="ignore"):
            scaled = lses * np.log2(np.e)
            top = scaled.max(0)
            top = np.where(np.isfinite(top), top, 0.0)
            shares = np.exp(scaled - top)
            output = np.where(shares.sum(0)[..., None] > 0, _weighted(outs, shares), 0.0)
            if "sinks" in data.arrays:  # the sinks joined after the merge, as merge_attention
                lse = np.where(shares.sum(0) > 0, top + np.log(shares.sum(0)), -np.inf)
                sink = reference.sink_column(data.arrays["sinks"], 3)[..., 0]
                output = output * np.exp(lse - np.logaddexp(lse, sink))[..., None]
        assert diagnose.MERGE_MISTAKES[1][0] in _merge_diagnosis(data, dtype, "merge_output",
                                                                  output), name


def test_merge_without_the_largest_lse_keeps_the_sinks_in_the_denominator() -> None:
    """Without overflow the mistake gives the right result: merge_mistakes names it (a failing
    step would have to fail for another reason), the sinks' exp in the denominator included."""
    data = _case("merge_empty_split_sinks_gqa", "float64")
    outs, lses = _parts(data)
    sink = np.exp(reference.sink_column(data.arrays["sinks"], 3)[..., 0])
    with np.errstate(all="ignore"):
        shares = np.exp(lses)
        total = shares.sum(0) + sink
        output = (shares[..., None] * outs).sum(0) / total[..., None]
    exp = expected.expected_for(data, "merge", "float64", gradients=False)
    assert diagnose.merge_mistakes(exp, "merge_output", output) == diagnose.MERGE_MISTAKES[0][0]
    assert diagnose.merge_mistakes(exp, "merge_lse", np.log(total)) == (
        diagnose.MERGE_MISTAKES[0][0])


def test_merge_replays_take_unbatched_inputs_with_sinks() -> None:
    """``(heads, seq, dim)`` inputs: the replay without the largest lse adds each head's sink to
    its own rows (it used to reshape the 4 sinks to one column and raise)."""
    data = _case("merge_empty_split_sinks_gqa", "float64")
    data = CaseData({n: (x[0] if n in ("query", "key", "value", "mask") else x)
                     for n, x in data.arrays.items()}, data.options)
    outs, lses = _parts(data)
    sink = np.exp(reference.sink_column(data.arrays["sinks"], 3)[..., 0])  # (heads, 1)
    with np.errstate(all="ignore"):
        shares = np.exp(lses)
        output = (shares[..., None] * outs).sum(0) / (shares.sum(0) + sink)[..., None]
    exp = expected.expected_for(data, "merge", "float64", gradients=False)
    assert diagnose.merge_mistakes(exp, "merge_output", output) == diagnose.MERGE_MISTAKES[0][0]


# ------------------------------------------------- the packed-batch hypotheses (built at import)


def test_packed_hypothesis_builders_drop_names_and_shift_the_chunk_rule() -> None:
    """``diagnose_packed``'s builders run at import (``PACKED_HYPOTHESES``), where no test can
    reach a mutant: called here directly, against tables written out from the rule."""
    from conformance.diagnosing import diagnose_packed as dp

    q, k = np.zeros((1, 5, 2)), np.zeros((1, 7, 2))  # 3-D: the sequence axis is -2, not 2
    a, o = {"query": q, "key": k, "alibi_slopes": np.ones(1)}, {"chunk_size": 3, "scale": 0.5}
    assert dp._without("q_segment_ids", "kv_segment_ids")(a, o) is None
    arrays, options = dp._without("alibi_slopes", "scale")(a, o)
    assert set(arrays) == {"query", "key"} and options == {"chunk_size": 3}
    assert dp._without("chunk_size")(a, o)[1] == {"scale": 0.5}
    assert dp._chunk_shifted(1)(a, {"scale": 0.5}) is None  # no chunks
    assert dp._chunk_shifted(1)(a, {**o, "mask_mod": object()}) is None
    for alignment, offset in (("top_left", 0), ("bottom_right", 2)):
        for shift in (1, -1):
            arrays, options = dp._chunk_shifted(shift)(a, {**o, "causal_alignment": alignment})
            want = np.array([[(i + offset + shift) // 3 == (j + shift) // 3 for j in range(7)]
                             for i in range(5)])
            assert arrays["mod_table"].shape == (1, 1, 5, 7)
            assert np.array_equal(arrays["mod_table"][0, 0], want), (alignment, shift)
            assert arrays["alibi_slopes"] is a["alibi_slopes"]
            assert options == {"scale": 0.5, "causal_alignment": alignment,
                               "mask_mod": {"name": "table"}}
    longer_q = {"query": np.zeros((1, 1, 4, 2)), "key": np.zeros((1, 1, 2, 2))}
    table = dp._chunk_shifted(1)(longer_q, {"chunk_size": 2, "causal_alignment": "bottom_right"}
                                 )[0]["mod_table"][0, 0]  # p = i - 2 + 1: rows 0 and 1 see none
    want = np.array([[(i - 1) // 2 == (j + 1) // 2 and i - 1 >= 1 for j in range(2)]
                     for i in range(4)])
    assert np.array_equal(table, want)


def test_shifted_offsets_move_the_inner_offsets_and_stay_valid() -> None:
    from conformance.diagnosing.diagnose_packed import shifted_offsets

    cu = np.array([0, 3, 3, 7, 10], np.int32)
    up, down = shifted_offsets(cu, 1), shifted_offsets(cu, -1)
    assert up.tolist() == [0, 4, 4, 8, 10] and down.tolist() == [0, 2, 2, 6, 10]
    assert up.dtype == down.dtype == np.int32 and cu.tolist() == [0, 3, 3, 7, 10]
    assert shifted_offsets(np.array([0, 9, 10]), 1).tolist() == [0, 10, 10]  # clipped to total
    assert shifted_offsets(np.array([0, 0, 5]), -1).tolist() == [0, 0, 5]  # and to 0
    assert shifted_offsets(np.array([0, 4, 3, 8]), -1).tolist() == [0, 3, 3, 8]  # non-decreasing
