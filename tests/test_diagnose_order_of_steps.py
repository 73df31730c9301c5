"""The diagnoses of the mistakes only the combined cases show
(``conformance.diagnosing.order_of_steps``): the steps before masking in another order,
negative segment ids treated as padding, and float16 computed entirely in float16.

Each wrong result is computed here, independently of the replays: the scores of a wrong order
written out step by step in float64 (handed to the reference as a ``score_mod``, so that the
masking and the softmax are the reference's), segment ids rewritten by hand, and a module that
accumulates every sum in float16 through ``np.cumsum`` (NumPy's own float16 sums and products
accumulate in float32; a cumulative sum does not). The expected diagnoses are the spec's words
for the mistake planted (``spec.PIPELINE_WITH_MODS``, ``spec.SEGMENT_IDS``,
``spec.COMPUTE_DTYPE``); a right result, another mistake, and a case without the features get
none of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from diagnose_inputs import expected_of, names

import numpy_attn
from conformance.cases import mods, reference
from conformance.diagnosing import diagnose, order_of_steps
from conformance.reporting import terminal
from conformance.running import runner

CASE = "combined_order_of_steps"

#: Each wrong order of soft-cap, bias, ALiBi and score_mod, and the name of its diagnosis.
WRONG_ORDERS = {
    ("alibi", "softcap", "bias", "score_mod"): "ALiBi added before the soft-cap",
    ("bias", "softcap", "alibi", "score_mod"): "the bias added before the soft-cap",
    ("bias", "alibi", "softcap", "score_mod"): "the bias and ALiBi added before the soft-cap",
    ("score_mod", "softcap", "bias", "alibi"):
        "score_mod applied before the soft-cap, the bias and ALiBi",
    ("bias", "alibi", "score_mod", "softcap"):
        "the soft-cap applied last, after the bias, ALiBi and score_mod",
}
#: The case's score_mod is an ALiBi of other slopes: it adds, so it commutes with the bias and
#: ALiBi, and this order is the spec's there.
COMMUTING = ("softcap", "score_mod", "bias", "alibi")


def _in_order(exp: Any, order: tuple[str, ...]) -> reference.Steps:
    """The float64 result of a backend that applies the steps before masking in ``order``."""
    a = exp.data.arrays
    kw = mods.sdpa_kwargs({k: v for k, v in a.items() if k != "grad_output"}, exp.data.options)
    q, k, v = (np.asarray(a[n], np.float64) for n in ("query", "key", "value"))
    k_rep = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
    s = q @ np.swapaxes(k_rep, -1, -2) * kw.pop("scale")  # (batch, heads, q_len, kv_len)
    cap, bias, slopes, mod = (kw.pop(n) for n in ("softcap", "bias", "alibi_slopes", "score_mod"))
    q_len, kv_len = s.shape[-2:]
    i = np.arange(q_len)[:, None] + kv_len - q_len  # bottom-right: query i at key i + 2
    alibi = -np.asarray(slopes, np.float64)[:, None, None] * np.abs(i - np.arange(kv_len))
    b, h, qi, ki = np.meshgrid(np.arange(s.shape[0]), np.arange(s.shape[1]), np.arange(q_len),
                               np.arange(kv_len), indexing="ij")
    for step in order:
        s = {"softcap": lambda x: cap * np.tanh(x / cap), "bias": lambda x: x + bias,
             "alibi": lambda x: x + alibi,
             "score_mod": lambda x: np.asarray(mod(x, b, h, qi, ki), np.float64)}[step](s)
    return reference.attention(q, k, v, score_mod=lambda x, *_: s, **kw)


def _result(steps: reference.Steps, step: str) -> np.ndarray:
    return {"output": steps.output, "output_weights": steps.weights, "lse": steps.lse}[step]


# ------------------------------------------------------------------------------ order of steps


def test_the_case_puts_the_four_steps_together_and_the_replay_is_the_spec_order() -> None:
    exp = expected_of(CASE)
    assert order_of_steps.present_steps(exp.data) == ("softcap", "bias", "alibi", "score_mod")
    right = _in_order(exp, ("softcap", "bias", "alibi", "score_mod"))
    np.testing.assert_allclose(right.output, exp.values["output"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("order", sorted(WRONG_ORDERS), ids="-".join)
@pytest.mark.parametrize("step", ["output", "output_weights", "lse"])
def test_each_wrong_order_gets_its_name(order: tuple[str, ...], step: str) -> None:
    exp = expected_of(CASE)
    wrong = _result(_in_order(exp, order), step)
    assert names(diagnose.diagnose(exp, step, wrong)) == [WRONG_ORDERS[order]]


@pytest.mark.parametrize("order", sorted(WRONG_ORDERS), ids="-".join)
def test_the_replay_of_each_order_is_the_wrong_result(order: tuple[str, ...]) -> None:
    exp = expected_of(CASE)
    want = _in_order(exp, order)
    got = order_of_steps.replay_order(exp.data, order)
    for field in ("output", "weights", "lse"):
        np.testing.assert_allclose(getattr(got, field), getattr(want, field), rtol=1e-12,
                                   atol=1e-12)


def test_an_additive_score_mod_moved_among_the_additions_is_the_spec_order() -> None:
    exp = expected_of(CASE)
    moved = _in_order(exp, COMMUTING)
    np.testing.assert_allclose(moved.output, exp.values["output"], rtol=1e-12, atol=1e-12)
    assert order_of_steps.order_of_steps(exp, "output", moved.output) == ""


def test_the_right_result_and_other_mistakes_get_no_order() -> None:
    exp = expected_of(CASE)
    for step in ("output", "lse"):  # the spec's values: no order reproduces them
        assert order_of_steps.order_of_steps(exp, step, exp.values[step]) == ""
    a = {k: v for k, v in exp.data.arrays.items() if k != "grad_output"}
    kw = mods.sdpa_kwargs(a, {k: v for k, v in exp.data.options.items() if k != "window"})
    no_window = reference.attention(a.pop("query"), a.pop("key"), a.pop("value"), **kw).output
    assert names(diagnose.diagnose(exp, "output", no_window)) == ["the window is ignored"]


def test_a_case_with_one_of_the_steps_replays_no_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost: a case with the soft-cap alone (or the bias alone) replays nothing."""
    def never(*args: Any) -> Any:
        raise AssertionError("replayed an order on a case with one step")

    monkeypatch.setattr(order_of_steps, "replay_order", never)
    for case in ("softcap", "bias", "alibi_gqa", "mods_causal_alibi"):
        exp = expected_of(case)
        assert len(order_of_steps.present_steps(exp.data)) == 1
        assert order_of_steps.order_of_steps(exp, "output", exp.values["output"] + 1.0) == ""


def test_the_nearest_order_wins_where_several_pass() -> None:
    """bfloat16's tolerance: the result of one order is named by that order, even where the
    tolerance lets another pass too."""
    exp = expected_of(CASE, "bfloat16")
    for order, name in WRONG_ORDERS.items():
        wrong = _in_order(exp, order).output
        assert diagnose.short(order_of_steps.order_of_steps(exp, "output", wrong)) == name


# ------------------------------------------------------------------------------ segment ids


def _negative_ids_as_padding(q: Any, k: Any, v: Any, *, segment_ids: Any = None, **kw: Any) -> Any:
    """numpy_attn, with every negative segment id made padding: its queries an id no key has
    (10**6), its keys an id no query has (10**6 + 1)."""
    if segment_ids is not None:
        q_ids, kv_ids = (np.asarray(x) for x in segment_ids)
        segment_ids = (np.where(q_ids < 0, 10**6, q_ids), np.where(kv_ids < 0, 10**6 + 1, kv_ids))
    return numpy_attn.scaled_dot_product_attention(q, k, v, segment_ids=segment_ids, **kw)


def _headline(name: str, run_cases: list[str], dtypes: list[str]) -> str:
    result = runner.run([name], run_cases, dtypes, check_errors=False, hypothesis=0)
    assert all(c.status == "FAIL" for c in result.cells), result.cells
    return " ".join(terminal.text(result).split("\n\n")[0].split())


def test_negative_segment_ids_treated_as_padding_are_named(registered: Any) -> None:
    registered("planted_negative_padding", scaled_dot_product_attention=_negative_ids_as_padding)
    assert _headline("planted_negative_padding", ["combined_documents_in_chunks"],
                     ["float32", "bfloat16"]) == (
        "FAIL: planted_negative_padding: negative segment ids are treated as padding (1 case)")


def test_the_padding_replay_needs_a_negative_id_and_names_only_its_mistake() -> None:
    exp = expected_of("combined_documents_in_chunks")
    a = exp.data.arrays
    hypothesis = dict((diagnose.short(t), h) for t, h in diagnose.HYPOTHESES)[
        "negative segment ids are treated as padding"]
    positive = {**a, "q_segment_ids": np.abs(a["q_segment_ids"]),
                "kv_segment_ids": np.abs(a["kv_segment_ids"])}
    assert hypothesis(positive, exp.data.options) is None
    assert hypothesis({k: v for k, v in a.items() if "segment" not in k}, {}) is None
    ignored = reference.attention(
        a["query"], a["key"], a["value"],
        **mods.sdpa_kwargs({k: v for k, v in a.items() if "segment" not in k and
                            k != "grad_output"}, exp.data.options)).output
    assert names(diagnose.diagnose(exp, "output", ignored)) == ["the segment ids are ignored"]


# ------------------------------------------------------------------------------ float16


def _cumulative_sum(x: np.ndarray, axis: int) -> np.ndarray:
    """The float16 sum over ``axis``, one addition at a time (``np.cumsum`` in float16)."""
    return np.cumsum(x.astype(np.float16), axis=axis, dtype=np.float16).take(-1, axis=axis)


def _all_float16(q: Any, k: Any, v: Any, *, bias: Any = None, scale: Any = None,
                 return_lse: bool = False, return_weights: bool = False, **kw: Any) -> Any:
    """Every step in float16 (the spec's compute dtype for float16 is float32), the lse cast to
    float32 as the spec's dtypes ask; for cases with no mask, causal rule or sinks."""
    half = np.float16
    q, k, v = (np.asarray(x, half) for x in (q, k, v))
    scale = half(q.shape[-1] ** -0.5 if scale is None else scale)
    s = (_cumulative_sum(q[..., :, None, :] * k[..., None, :, :], -1) * scale).astype(half)
    if bias is not None:
        s = (s + np.asarray(bias, half)).astype(half)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m).astype(half)
    total = _cumulative_sum(e, -1)[..., None]
    w = (e / total).astype(half)
    out = _cumulative_sum(w[..., :, :, None] * v[..., None, :, :], -2)
    extra = [w] if return_weights else []
    if return_lse:
        extra.append(m[..., 0].astype(np.float32) + np.log(total[..., 0].astype(np.float32)))
    return (out, *extra) if extra else out


def test_float16_computed_entirely_in_float16_is_named(registered: Any) -> None:
    registered("planted_all_float16", scaled_dot_product_attention=_all_float16)
    assert _headline("planted_all_float16", ["combined_long_keys"], ["float16"]) == (
        "FAIL: planted_all_float16: float16 computed entirely in float16 (1 case)")


def test_the_half_accumulation_adds_one_rounded_term_at_a_time() -> None:
    """Sums of ones stop where the next integer is not representable: 2048 in float16 (11
    significant bits), 256 in bfloat16 (8); a float32 accumulation would reach 4096."""
    ones = np.ones((2, 4096))
    assert order_of_steps.HalfAccumulation("float16").sum(ones).tolist() == [[2048.0]] * 2
    assert order_of_steps.HalfAccumulation("bfloat16").sum(ones).tolist() == [[256.0]] * 2
    rng = np.random.default_rng(0)  # float16 inputs, as the case's are
    a, b = (rng.standard_normal(shape).astype(np.float16).astype(np.float64)
            for shape in ((3, 5, 64), (3, 9, 64)))
    got = order_of_steps.HalfAccumulation("float16").einsum("...qd,...kd->...qk", a, b)
    want = _cumulative_sum((a.astype(np.float16)[:, :, None] * b.astype(np.float16)[:, None]), -1)
    np.testing.assert_array_equal(got, want.astype(np.float64))


def test_the_half_accumulation_names_nothing_else() -> None:
    """Only float16 and bfloat16 replay it; a bias ignored in float16 is named as such."""
    exp = expected_of("combined_long_keys", "float16")
    a = exp.data.arrays
    no_bias = reference.attention(a["query"], a["key"], a["value"]).output
    assert names(diagnose.diagnose(exp, "output", no_bias)) == ["the bias is ignored"]
    exp32 = expected_of("combined_long_keys")
    assert order_of_steps.half_accumulation(exp32, "output", exp32.values["output"] * 1.01) == ""
