"""The focused verdict names the bug: a module in the other layout, a wrong custom scale, one
group per bug, the property checks drawing every feature a module supports (exactly N
examples, a failure's own ratio), and failing bad inputs in the headline and the count.

Every module here is a registered fake over ``numpy_attn`` with one planted flaw; runs are
small (a few cases, float32, at most 30 property examples).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from harness_helpers import NEEDS_HYPOTHESIS, _expected

import numpy_attn
from conformance.cases import catalogue as cases
from conformance.cases.expected import expected_for
from conformance.comparing.results import Cell, Column, RunResult
from conformance.diagnosing import diagnose
from conformance.reporting import groups, terminal
from conformance.reporting.shrink import shrink
from conformance.running import backends, errors, plugins, properties, runner

FN = "scaled_dot_product_attention"


def _seq_first(query: Any, key: Any, value: Any, *, scale: float | None = None,
               **options: Any) -> Any:
    """The bshd module of docs/checking.md: query, key, value (..., seq, heads, head_dim)."""
    q, k, v = (np.swapaxes(np.asarray(x, np.float64), -3, -2) for x in (query, key, value))
    scores = q @ np.swapaxes(k, -1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.swapaxes(weights @ v, -3, -2).astype(np.asarray(query).dtype)


DOC_UNSUPPORTED = {"mask", "bias", "causal", "window", "dropout", "softcap", "grouped_query",
                   "2d_inputs", "return_weights", "sinks", "lse", "errors", "chunked", "alibi",
                   "segments", "score_mod", "mask_mod"}


def _scale_over_sqrt_d(q: Any, k: Any, v: Any, *, scale: float | None = None,
                       **kw: Any) -> Any:
    """numpy_attn, but a custom scale gets 1/sqrt(head_dim) on top."""
    if scale is not None:
        scale = scale / np.sqrt(np.shape(q)[-1])
    return numpy_attn.scaled_dot_product_attention(q, k, v, scale=scale, **kw)


def _ignores(name: str) -> Callable[..., Any]:
    """numpy_attn's sdpa that drops the keyword ``name``."""
    def sdpa(q: Any, k: Any, v: Any, **kw: Any) -> Any:
        kw.pop(name, None)
        return numpy_attn.scaled_dot_product_attention(q, k, v, **kw)

    return sdpa


# ------------------------------------------------------------------------------ layout


def test_an_undeclared_bshd_module_is_diagnosed_with_the_fix(registered) -> None:  # noqa: ANN001
    run_cases = ["self", "cross", "scale", "gqa"]
    registered("fake_bshd_no_layout", scaled_dot_product_attention=_seq_first,
               UNSUPPORTED=DOC_UNSUPPORTED)
    result = runner.run(["fake_bshd_no_layout"], run_cases, ["float32"], check_errors=False,
                        hypothesis=0)
    status = {c.case: c.status for c in result.cells}
    assert status == {"self": "FAIL", "cross": "error", "scale": "error", "gqa": "unsupported"}
    text = terminal.text(result)
    first = text.splitlines()[0]
    assert first == 'FAIL: fake_bshd_no_layout: wrong layout, set LAYOUT = "bshd" (3 cases)'
    assert "1. layout · fake_bshd_no_layout: 3 cases fail" in text
    assert "no diagnosis" not in text and "2. " not in text
    # the fix the verdict names makes every case pass
    registered("fake_bshd_declared", scaled_dot_product_attention=_seq_first, LAYOUT="bshd",
               UNSUPPORTED=DOC_UNSUPPORTED)
    fixed = runner.run(["fake_bshd_declared"], run_cases, ["float32"], check_errors=False,
                       hypothesis=0)
    assert fixed.ok and groups.layout_symptoms(fixed) == {}


def test_a_bhsd_module_declaring_bshd_is_told_to_remove_it(registered) -> None:  # noqa: ANN001
    registered("fake_bhsd_says_bshd", scaled_dot_product_attention=numpy_attn.
               scaled_dot_product_attention, LAYOUT="bshd")
    result = runner.run(["fake_bhsd_says_bshd"], ["cross", "gqa"], ["float32"],
                        check_errors=False, hypothesis=0)
    assert not result.ok
    assert terminal.text(result).splitlines()[0] == (
        'FAIL: fake_bhsd_says_bshd: wrong layout, remove LAYOUT = "bshd" (2 cases)')


def test_a_module_with_other_bugs_gets_no_layout_diagnosis(registered) -> None:  # noqa: ANN001
    registered("fake_scale_bug", scaled_dot_product_attention=_scale_over_sqrt_d)
    result = runner.run(["fake_scale_bug"], ["scale"], ["float32"], check_errors=False,
                        hypothesis=0)
    assert groups.layout_symptoms(result) == {}
    assert terminal.text(result).splitlines()[0] == (
        "FAIL: fake_scale_bug: the custom scale is multiplied by 1/sqrt(head_dim) as well "
        "(1 case)")


# ------------------------------------------------------------------------------ scale, shrink


def test_a_wrong_custom_scale_shrinks_without_a_red_herring_v_dim(registered) -> None:  # noqa: ANN001
    fake = registered("fake_scale_shrink", scaled_dot_product_attention=_scale_over_sqrt_d)
    exp = _expected("scale", "float32")
    cell = runner.run_cell(fake, exp)
    assert cell.status == "FAIL" and cell.reasons
    reason = diagnose.split(cell.reasons[0])[0]
    assert reason.startswith("the custom scale is multiplied by 1/sqrt(head_dim)")
    small = shrink(fake, exp, ["output"], "FAIL", reason)
    q, v = small.data.arrays["query"], small.data.arrays["value"]
    assert v.shape[-1] == q.shape[-1] >= 2  # 1/sqrt(1) = 1 would hide the bug
    assert plugins.features(small.data.arrays, small.data.options, small.dtype) & {
        "v_dim", "mask", "causal", "grouped_query"} == set()
    assert small.data.options == {"scale": 0.3}
    again = runner.run_cell(fake, small, steps=["output"])  # the smallest case still fails
    assert again.status == "FAIL" and reason[:40] in again.reasons[0]
    # a value head_dim of its own is dropped too when the failure does not need it
    rng = np.random.default_rng(0)
    arrays = {"query": rng.standard_normal((1, 2, 3, 4)), "key": rng.standard_normal((1, 2, 5, 4)),
              "value": rng.standard_normal((1, 2, 5, 3))}
    own = expected_for(cases.CaseData(arrays, {"scale": 0.5}), "sdpa", "float64", "own_v_dim")
    small = shrink(fake, own, ["output"], "FAIL", reason)
    assert small.data.arrays["value"].shape[-1] == small.data.arrays["query"].shape[-1]


# ------------------------------------------------------------------------------ one bug, one group


def _always_bottom_right(q: Any, k: Any, v: Any, *, causal_alignment: str = "top_left",
                         **kw: Any) -> Any:
    return numpy_attn.scaled_dot_product_attention(q, k, v, causal_alignment="bottom_right",
                                                   **kw)


def test_one_alignment_bug_is_one_group_finite_or_not(registered) -> None:  # noqa: ANN001
    registered("fake_always_bottom_right", scaled_dot_product_attention=_always_bottom_right)
    run_cases = ["causal_top_left", "inf_key", "nan_value_causal"]
    result = runner.run(["fake_always_bottom_right"], run_cases, ["float32"],
                        check_errors=False, hypothesis=0)
    assert {c.case for c in result.cells if c.status == "FAIL"} == set(run_cases)
    found = groups.groups(result)
    assert [diagnose.short(reason) for _, _, reason in found] == ["wrong causal alignment"]
    assert {c.case for c in next(iter(found.values()))} == set(run_cases)


def test_mask_polarity_with_a_nan_key_is_one_group() -> None:
    result = runner.run(["examples.wrong_attention"], ["padding", "nan_key_masked"],
                        ["float32"], check_errors=False, hypothesis=0)
    found = groups.groups(result)
    assert [diagnose.short(reason) for _, _, reason in found] == ["mask polarity flipped"]
    assert terminal.text(result).splitlines()[0] == (
        "FAIL: examples.wrong_attention: mask polarity flipped (2 cases)")


def test_a_cell_joins_the_group_its_most_shared_diagnosis_names() -> None:
    """Reasons that differ in their order, their extra symptoms or their wording after the
    name: the bug (by name) most cases share decides."""
    align = "wrong causal alignment: the result matches the other alignment"
    nan = "fully masked rows give NaN (softmax of a row of -inf, 0 / 0); the spec gives 0"
    cells = [Cell("a", "float32", "m", "FAIL", reasons=[align]),
             Cell("b", "float32", "m", "FAIL", reasons=[nan + diagnose.SEPARATOR + align]),
             Cell("c", "float32", "m", "FAIL", reasons=[align + "; at other positions"]),
             Cell("d", "float32", "m", "FAIL", reasons=[nan])]
    result = RunResult([Column("m", "backend")], cells, {}, [(c.case, "float32") for c in cells])
    found = groups.groups(result)
    assert {diagnose.short(r): sorted(c.case for c in got) for (_, _, r), got in found.items()} \
        == {"wrong causal alignment": ["a", "b", "c"], diagnose.short(nan): ["d"]}


# ------------------------------------------------------------------------------ properties


def _property_view(backend: backends.Backend) -> backends.Backend:
    """The backend as a run's property checks call it (its module imported first, as after
    the run's cells: ``runner.property_view`` reads the contract)."""
    _ = backend.module
    view = runner.property_view(backend, [])
    assert view is not None
    return view


def _property_features(layouts: tuple[properties.Layout, ...]) -> set[str]:
    out: set[str] = set()
    for layout in layouts:
        a, o = properties.Problem(layout, "float32", 1.0, False, 0).arrays()
        out |= plugins.features(a, o, "float32")
    return out


def test_the_property_layouts_cover_every_feature_they_can() -> None:
    covered = _property_features(properties.LAYOUTS)
    assert {"mask", "bias", "causal", "bottom_right", "window", "scale", "softcap",
            "grouped_query", "v_dim", "2d_inputs"} <= covered
    options = [properties.Problem(lay, "float32", 1.0, False, 0).arrays()[1]
               for lay in properties.LAYOUTS]
    assert {o.get("causal_alignment", "top_left") for o in options if o.get("is_causal")} == {
        "top_left", "bottom_right"}
    assert any("window" in o and o.get("is_causal") for o in options)
    assert any("window" in o and not o.get("is_causal") for o in options)
    assert {lay.mask for lay in properties.LAYOUTS} == {"none", "full", "keys"}
    assert len({o["scale"] for o in options if "scale" in o}) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["scale_over_sqrt_d", "window", "softcap"])
def test_properties_catch_bugs_of_scale_window_and_softcap(registered, bug: str) -> None:  # noqa: ANN001
    pytest.importorskip("hypothesis", reason=NEEDS_HYPOTHESIS)
    sdpa = _scale_over_sqrt_d if bug == "scale_over_sqrt_d" else _ignores(bug)
    fake = registered(f"fake_prop_{bug}", scaled_dot_product_attention=sdpa)
    result = properties.run([_property_view(fake)], 30)
    outcome = result.backends[0]
    assert not result.passed and outcome.failure_ratio is not None
    assert outcome.failure_ratio > 1 >= outcome.worst_ratio
    line = result.text().splitlines()[0]
    assert line.startswith(f"hypothesis · fake_prop_{bug}: FAIL at example {outcome.examples}: "
                           f"the failing example: worst error {outcome.failure_ratio:.3g} x the "
                           f"tolerance")
    calls = "more call" if outcome.shrink_calls == 1 else "more calls"
    assert f"{outcome.shrink_calls} {calls} to shrink it" in line


def test_properties_draw_only_supported_features_and_run_exactly_n(registered) -> None:  # noqa: ANN001
    pytest.importorskip("hypothesis", reason=NEEDS_HYPOTHESIS)
    seen: list[frozenset[str]] = []

    def sdpa(q: Any, k: Any, v: Any, **kw: Any) -> Any:
        seen.append(plugins.call_features((q, k, v), kw))
        return _scale_over_sqrt_d(q, k, v, **kw)  # the bug hides behind the declaration

    fake = registered("fake_prop_no_scale", scaled_dot_product_attention=sdpa,
                      UNSUPPORTED={"scale", "float16"})
    result = properties.run([_property_view(fake)], 30)
    assert result.passed, result.text()
    assert result.backends[0].examples == 30 and result.backends[0].rejected == 0
    drawn = set().union(*seen)
    assert "scale" not in drawn and "float16" not in drawn
    assert {"window", "softcap", "mask", "bias", "causal", "grouped_query"} <= drawn


def test_rejected_examples_do_not_count(registered) -> None:  # noqa: ANN001
    pytest.importorskip("hypothesis", reason=NEEDS_HYPOTHESIS)

    def sdpa(q: Any, k: Any, v: Any, *, bias: Any = None, **kw: Any) -> Any:
        if bias is not None:
            raise NotImplementedError("no bias")
        return numpy_attn.scaled_dot_product_attention(q, k, v, **kw)

    fake = registered("fake_prop_no_bias", scaled_dot_product_attention=sdpa)
    result = properties.run([_property_view(fake)], 30)
    outcome = result.backends[0]
    assert result.passed and outcome.examples == 30 and outcome.rejected > 0
    assert result.text().startswith(f"hypothesis · fake_prop_no_bias: ok, 30 examples, worst "
                                    f"ratio {outcome.worst_ratio:.2f}, {outcome.rejected} "
                                    f"rejected")
    assert result.summary() == "hypothesis: 30 examples, ok"


# ------------------------------------------------------------------------------ bad inputs


def test_failing_bad_inputs_are_in_the_headline_and_the_count(registered) -> None:  # noqa: ANN001
    def sdpa(q: Any, k: Any, v: Any, **kw: Any) -> Any:
        try:
            return _scale_over_sqrt_d(q, k, v, **kw)
        except ValueError as exc:
            raise RuntimeError(str(exc)) from None  # the wrong type, the same message

    registered("fake_wrong_error_type", scaled_dot_product_attention=sdpa)
    result = runner.run(["fake_wrong_error_type"], ["scale"], ["float32"], check_errors=True,
                        hypothesis=0)
    checked = [c for c in errors.ERROR_CASES if c.fn == FN]  # what the fake provides
    wrong = [c for c in checked if c.exception == "ValueError"]
    assert wrong and len(result.errors) == len(checked)
    text = terminal.text(result)
    assert " ".join(text.split("\n\n")[0].split()) == (  # the headline, wrapped to 100 columns
        "FAIL: fake_wrong_error_type: the custom scale is multiplied by 1/sqrt(head_dim) as "
        f"well (1 case); bad inputs: {len(wrong)} of {len(checked)} raise the wrong type")
    assert text.splitlines()[-1].startswith(
        f"FAIL: 0/1 backend cells pass; {len(checked) - len(wrong)}/{len(checked)} bad inputs "
        f"raise the spec's error;")
