"""The conformance harness catches real bugs: meta-tests plant classic bugs in a fake backend
(numpy_attn with one flaw) and check that the harness fails exactly the cases that expose each
bug and names the bug (the non-finite cases catch a NaN that vanishes and a masked NaN that
spreads; the lse, sinks and merge steps catch an lse in log2, a sink added to the numerator and
a merge without the max); the report of a wrong backend names its failing cases and exits 1;
the property checks apply the harness's rule, pass on numpy_attn, and shrink a planted bug to a
runnable reproducer.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness_helpers import NEEDS_HYPOTHESIS, check_planted_bug, fake_numpy

import numpy_attn
from conformance.__main__ import main
from conformance.cases import catalogue as cases
from conformance.cases import expected
from conformance.running import backends, properties, runner

# ------------------------------------------------------------------------------ planted bugs


def _wrap(transform):  # noqa: ANN001, ANN202 - test helper
    """mask_scores and scaled_dot_product_attention with kwargs transformed."""

    def mask_scores(scores, **kw):  # noqa: ANN001, ANN202
        return numpy_attn.mask_scores(scores, **transform(kw))

    def sdpa(q, k, v, **kw):  # noqa: ANN001, ANN202
        return numpy_attn.scaled_dot_product_attention(q, k, v, **transform(kw))

    return {"mask_scores": mask_scores, "scaled_dot_product_attention": sdpa}


def _flip_mask(kw: dict) -> dict:
    if kw.get("mask") is not None:
        kw["mask"] = ~np.asarray(kw["mask"])
    return kw


def _top_left(kw: dict) -> dict:
    kw["causal_alignment"] = "top_left"
    return kw


def _composed(softmax, masking=numpy_attn.mask_scores):  # noqa: ANN001, ANN202
    """attention_weights, mask_scores and a scaled_dot_product_attention built on a given
    softmax and a given masking of the scores."""

    def weights(scores):  # noqa: ANN001, ANN202
        return softmax(np.asarray(scores).astype(np.float32 if scores.dtype != np.float64
                                                 else np.float64))

    def sdpa(q, k, v, *, mask=None, bias=None, is_causal=False, causal_alignment="top_left",
             window=None, scale=None, softcap=None, dropout_p=0.0, dropout_mask=None, rng=None,
             return_weights=False):  # noqa: ANN001, ANN202
        s = numpy_attn.attention_scores(q, k, scale=scale, softcap=softcap)
        s = masking(s, mask=mask, bias=bias, is_causal=is_causal,
                    causal_alignment=causal_alignment, window=window)
        w = weights(s)
        kept = numpy_attn.apply_dropout(w, dropout_p, dropout_mask=dropout_mask) if dropout_p else w
        out = numpy_attn.attention_output(kept, v).astype(q.dtype)
        return (out, w.astype(q.dtype)) if return_weights else out

    # it takes neither sinks nor return_lse, and says so (docs/checking.md)
    return {"attention_weights": weights, "mask_scores": masking,
            "scaled_dot_product_attention": sdpa, "UNSUPPORTED": {"sinks", "lse"}}


def _softmax_no_max(s: np.ndarray) -> np.ndarray:
    e = np.exp(s)
    return e / e.sum(-1, keepdims=True)


def _softmax_nan_rows(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _softmax_nan_to_zero(s: np.ndarray) -> np.ndarray:
    """A kernel that treats a row without a finite maximum like a fully masked row."""
    w = numpy_attn.attention_weights(s)
    return np.where(np.isnan(w).any(-1, keepdims=True), 0, w).astype(w.dtype)


def _mask_by_adding(scores, *, mask=None, **kw):  # noqa: ANN001, ANN202
    """Masks by adding -inf (NaN + -inf stays NaN) instead of replacing the score."""
    if mask is None:
        return numpy_attn.mask_scores(scores, **kw)
    out = numpy_attn.mask_scores(scores, **kw)
    return out + np.where(np.asarray(mask), 0, -np.inf).astype(out.dtype)


def _tile_heads(q: np.ndarray, kv: np.ndarray) -> np.ndarray:
    if q.ndim < 3 or kv.shape[-3] == q.shape[-3]:
        return kv
    reps = [1] * kv.ndim
    reps[-3] = q.shape[-3] // kv.shape[-3]
    return np.tile(kv, reps)  # query head h meets kv head h % kv_heads


def _gqa_modulo() -> dict:
    def scores(q, k, **kw):  # noqa: ANN001, ANN202
        return numpy_attn.attention_scores(q, _tile_heads(q, k), **kw)

    def output(w, v):  # noqa: ANN001, ANN202
        return numpy_attn.attention_output(w, _tile_heads(w, v))

    def sdpa(q, k, v, **kw):  # noqa: ANN001, ANN202
        return numpy_attn.scaled_dot_product_attention(q, _tile_heads(q, k), _tile_heads(q, v),
                                                       **kw)

    return {"attention_scores": scores, "attention_output": output,
            "scaled_dot_product_attention": sdpa}


def _wrong_scale(wrong):  # noqa: ANN001, ANN202 - test helper
    """attention_scores and scaled_dot_product_attention with a custom scale used as
    ``wrong(scale, head_dim)`` (the default scale, None, is left alone)."""

    def fix(q, kw):  # noqa: ANN001, ANN202
        if kw.get("scale") is not None:
            kw["scale"] = wrong(kw["scale"], np.shape(q)[-1])
        return kw

    def scores(q, k, **kw):  # noqa: ANN001, ANN202
        return numpy_attn.attention_scores(q, k, **fix(q, kw))

    def sdpa(q, k, v, **kw):  # noqa: ANN001, ANN202
        return numpy_attn.scaled_dot_product_attention(q, k, v, **fix(q, kw))

    return {"attention_scores": scores, "scaled_dot_product_attention": sdpa}


LOG2_E = np.log2(np.e)


def _lse_in_log2() -> dict:
    """sdpa and blockwise_attention whose lse is log2-sum-exp2 (the unit kernels keep)."""

    def in_log2(result):  # noqa: ANN001, ANN202
        return (*result[:-1], (result[-1] * LOG2_E).astype(result[-1].dtype))

    def sdpa(q, k, v, **kw):  # noqa: ANN001, ANN202
        result = numpy_attn.scaled_dot_product_attention(q, k, v, **kw)
        return in_log2(result) if kw.get("return_lse") else result

    def blockwise(q, k, v, **kw):  # noqa: ANN001, ANN202
        result = numpy_attn.blockwise_attention(q, k, v, **kw)
        return in_log2(result) if kw.get("return_lse") else result

    return {"scaled_dot_product_attention": sdpa, "blockwise_attention": blockwise}


def _sink_in_numerator(q, k, v, *, sinks=None, return_weights=False, return_lse=False,
                       dropout_p=0.0, dropout_mask=None, rng=None, **kw):  # noqa: ANN001, ANN202
    """sdpa whose weights are (exp(s_ij) + exp(sink)) / (exp(sink) + sum_k exp(s_ik)) at every
    allowed key: the sink's term in each numerator too."""
    if sinks is None:
        return numpy_attn.scaled_dot_product_attention(
            q, k, v, return_weights=return_weights, return_lse=return_lse, **kw)
    scores = numpy_attn.attention_scores(q, k, scale=kw.pop("scale", None),
                                         softcap=kw.pop("softcap", None))
    scores = numpy_attn.mask_scores(scores, **kw)  # (..., heads, q_len, kv_len)
    sink = np.asarray(sinks, scores.dtype)[:, None, None]
    lse = np.logaddexp(np.logaddexp.reduce(scores, axis=-1, keepdims=True), sink)
    weights = np.where(np.isneginf(scores), 0, np.exp(scores - lse) + np.exp(sink - lse))
    out = numpy_attn.attention_output(weights, v).astype(q.dtype)
    result = (out,) + ((weights.astype(q.dtype),) if return_weights else ()) + (
        (lse[..., 0],) if return_lse else ())
    return result if len(result) > 1 else out


def _merge_without_max(outputs, lses, *, sinks=None):  # noqa: ANN001, ANN202
    """merge_attention as sum_i exp(lse_i) o_i / sum_i exp(lse_i): no largest lse subtracted."""
    dtype = np.float64 if outputs[0].dtype == np.float64 else np.float32
    shares = [np.exp(np.asarray(lse, dtype)) for lse in lses]
    total = sum(shares) + (0 if sinks is None else np.exp(np.asarray(sinks, dtype))[:, None])
    out = sum(s[..., None] * np.asarray(o, dtype) for s, o in zip(shares, outputs, strict=True))
    return (out / total[..., None]).astype(outputs[0].dtype), np.log(total)


def _pages_off_by_one(q, key_pages, value_pages, block_table, seq_lens, **kw):  # noqa: ANN001, ANN202
    """paged_attention reading page block_table[b, i] + 1 (a 1-based page id read as 0-based)."""
    table = np.asarray(block_table)
    shifted = np.where(table >= 0, (table + 1) % np.shape(key_pages)[0], -1)
    return numpy_attn.paged_attention(q, key_pages, value_pages, shifted, seq_lens, **kw)


PLANTED = {
    # bug: (overrides, cases that must fail, cases that must pass, words of the diagnosis)
    "mask_polarity": (_wrap(_flip_mask), {"padding", "mask_and_bias", "fully_masked_rows"},
                      {"self", "causal_bottom_right", "gqa"}, "mask polarity flipped"),
    "top_left_for_bottom_right": (
        _wrap(_top_left),
        {"causal_bottom_right", "causal_bottom_right_q_longer", "window_causal_bottom_right"},
        {"causal_top_left", "causal_top_left_q_longer", "mask_and_bias"},
        "wrong causal alignment"),
    "softmax_without_max": (_composed(_softmax_no_max), {"huge_logits"},
                            {"self", "bias", "gqa"}, "overflows"),
    "nan_on_empty_rows": (_composed(_softmax_nan_rows),
                          {"fully_masked_rows", "padding", "causal_bottom_right_q_longer"},
                          {"self", "huge_logits", "causal_top_left"}, "NaN"),
    "gqa_modulo": (_gqa_modulo(), {"gqa", "three_d_gqa_causal"}, {"mqa", "self", "padding"},
                   "grouped-query mapping"),
    "nan_row_gives_zero": (_composed(_softmax_nan_to_zero), {"nan_query", "inf_key"},
                           {"self", "nan_value", "nan_key_masked", "padding"},
                           "treated like a fully masked row"),
    "masking_adds_minus_inf": (_composed(numpy_attn.attention_weights, _mask_by_adding),
                               {"nan_key_masked"}, {"self", "padding", "nan_query"},
                               "masking must replace a masked score by -inf"),
    # a custom scale gone wrong: only the case with one (scale 0.3) fails, and says how
    "scale_times_rsqrt_d": (_wrong_scale(lambda scale, d: scale / np.sqrt(d)), {"scale"},
                            {"self", "softcap", "gqa"},
                            "custom scale is multiplied by 1/sqrt(head_dim)"),
    "scale_ignored": (_wrong_scale(lambda scale, d: None), {"scale"}, {"self", "softcap"},
                      "custom scale is ignored"),
    "scale_divides": (_wrong_scale(lambda scale, d: 1 / scale), {"scale"}, {"self", "softcap"},
                      "divided by the custom scale"),
    # the row log-sum-exp, attention sinks and merging partial results
    "lse_in_log2": (_lse_in_log2(), {"self", "sinks_fully_masked_rows", "merge_two_splits"},
                    {"module_self_attention"}, "log2"),
    "sink_in_numerator": ({"scaled_dot_product_attention": _sink_in_numerator},
                          {"sinks_window", "sinks_causal_softcap",
                           "sinks_fully_masked_rows"},
                          {"self", "gqa", "merge_empty_split_sinks_gqa"}, "numerator"),
    "merge_without_max": ({"merge_attention": _merge_without_max},
                          {"merge_four_splits_huge"},
                          {"merge_two_splits", "merge_empty_split_sinks_gqa", "self"},
                          "does not subtract the largest lse"),
    "pages_off_by_one": ({"paged_attention": _pages_off_by_one},
                         {"paged_decode_gqa", "paged_two_queries_sinks"}, {"self"},
                         "page table is read off by one"),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bug_is_caught_and_named(bug: str) -> None:
    check_planted_bug(bug, *PLANTED[bug])


@pytest.mark.slow
def test_report_names_failing_cases_and_exit_code(capsys: pytest.CaptureFixture) -> None:
    code = main(["--backend", "examples.wrong_attention", "--dtype", "float32", "--no-errors",
                 "--verbose"])
    out = capsys.readouterr().out
    assert code == 1
    for case in ("padding", "mask_and_bias", "causal_bottom_right"):
        assert f"examples.wrong_attention · {case} · float32" in out
    assert "mask polarity flipped" in out and "wrong causal alignment" in out
    assert "python -m conformance --case padding --dtype float32 --backend " \
           "examples.wrong_attention" in out
    assert out.strip().splitlines()[-1].startswith("FAIL:")


# ------------------------------------------------------------------------------ properties


def test_properties_pass_on_numpy() -> None:
    pytest.importorskip("hypothesis", reason=NEEDS_HYPOTHESIS)
    result = properties.run([backends.get("numpy")], 40)
    assert result.passed, result.text()
    assert result.backends[0].examples == 40


def test_properties_apply_the_harness_rule() -> None:
    """A property example's ratio is the harness's ``compare`` ratio on the same example."""
    numpy_backend = backends.get("numpy")
    layout = next(lay for lay in properties.LAYOUTS if lay.causal)  # no permutation check
    problem = properties.Problem(layout, "float32", 10.0, False, 7)
    a, o = problem.arrays()
    exp = expected.expected_for(cases.CaseData(a, o), "sdpa", "float32", gradients=False)
    cell = runner.run_cell(numpy_backend, exp, steps=["output", "output_weights"])
    assert properties.check_problem(numpy_backend, problem) == pytest.approx(cell.ratio)


@pytest.mark.slow
def test_properties_shrink_a_planted_bug_to_runnable_code(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("hypothesis", reason=NEEDS_HYPOTHESIS)
    fake = backends.register(fake_numpy("fake_mask_polarity_prop", **_wrap(_flip_mask)))
    try:  # registered, so the reproducer's backends.load finds it
        result = properties.run([fake], 60)
        assert not result.passed
        code = result.backends[0].reproducer
        assert "scaled_dot_product_attention(" in code and "mask" in code
        exec(compile(code, "<reproducer>", "exec"), {})  # runs as printed
        assert "output - reference" in capsys.readouterr().out
    finally:
        backends.unregister(fake.name)
