"""Trust at the seams: natural variants of the named bugs are named too, and a module's seams
(a wrong result dtype, a keyword it does not take, ``return_weights`` swallowed, a keyword its
``**options`` swallows, every feature declared unsupported) get a verdict that says so instead
of "no diagnosis" or PASS.

Each module is a registered fake over ``numpy_attn`` with one planted flaw, run through
``runner.run`` on a case or two in float32 (float16 for the dtype); the mistakes that need no
module (a sink in the masked numerators, a chunk boundary shifted on the query side, a varlen
batch aligned top-left) are written out with numpy_attn and handed to ``diagnose``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import numpy_attn
from conformance import spec
from conformance.cases import catalogue as cases
from conformance.cases import expected, reference
from conformance.cases.inputs import contiguous, varlen_pieces
from conformance.diagnosing import diagnose
from conformance.reporting import groups, terminal
from conformance.running import runner

SDPA = numpy_attn.scaled_dot_product_attention


def _headline(name: str, run_cases: list[str], dtypes: tuple[str, ...] = ("float32",)) -> str:
    """The verdict, its lines joined."""
    result = runner.run([name], run_cases, list(dtypes), check_errors=False, hypothesis=0)
    return " ".join(terminal.text(result).split("\n\n")[0].split())


# ------------------------------------------------------------------------------ modules


def _float32_output(q: Any, k: Any, v: Any, **kw: Any) -> Any:
    """numpy_attn, the output always float32."""
    out = SDPA(q, k, v, **kw)
    if isinstance(out, tuple):
        return (out[0].astype(np.float32), *out[1:])
    return out.astype(np.float32)


def test_a_wrong_output_dtype_is_the_diagnosis(registered) -> None:  # noqa: ANN001
    registered("fake_f32_output", scaled_dot_product_attention=_float32_output)
    first = _headline("fake_f32_output", ["self"], ("float16",))
    assert first == "FAIL: fake_f32_output: wrong result dtype (1 case)"
    result = runner.run(["fake_f32_output"], ["self"], ["float16"], check_errors=False,
                        hypothesis=0)
    text = terminal.text(result)
    assert "output is float32, the spec requires float16" in text
    assert "no diagnosis" not in text


def _default_scale_over_d(q: Any, k: Any, v: Any, *, scale: float | None = None,
                          **kw: Any) -> Any:
    return SDPA(q, k, v, scale=1.0 / np.shape(q)[-1] if scale is None else scale, **kw)


def test_a_default_scale_of_one_over_d_is_named(registered) -> None:  # noqa: ANN001
    registered("fake_scale_d", scaled_dot_product_attention=_default_scale_over_d)
    assert _headline("fake_scale_d", ["self"]) == (
        "FAIL: fake_scale_d: the default scale is 1/head_dim (1 case)")


def _swallows_return_weights(q: Any, k: Any, v: Any, **options: Any) -> Any:
    options.pop("return_weights", None)
    return SDPA(q, k, v, **options)


def test_return_weights_swallowed_is_named(registered) -> None:  # noqa: ANN001
    registered("fake_no_weights", scaled_dot_product_attention=_swallows_return_weights)
    first = _headline("fake_no_weights", ["self", "padding"])
    assert first == ("FAIL: fake_no_weights: returns one array where return_weights=True asks "
                     "for (output, weights) (2 cases)")


def _before_sinks(q: Any, k: Any, v: Any, *, mask: Any = None, bias: Any = None,
                  is_causal: bool = False, causal_alignment: str = "top_left",
                  window: Any = None, scale: float | None = None, softcap: float | None = None,
                  dropout_p: float = 0.0, dropout_mask: Any = None, rng: Any = None,
                  return_weights: bool = False) -> Any:
    """A module written before sinks and return_lse existed."""
    return SDPA(q, k, v, mask=mask, bias=bias, is_causal=is_causal,
                causal_alignment=causal_alignment, window=window, scale=scale,
                softcap=softcap, dropout_p=dropout_p, dropout_mask=dropout_mask, rng=rng,
                return_weights=return_weights)


def test_a_module_without_return_lse_is_told_to_declare_it(registered) -> None:  # noqa: ANN001
    registered("fake_before_lse", scaled_dot_product_attention=_before_sinks)
    first = _headline("fake_before_lse", ["self", "padding"])
    assert first == ("FAIL: fake_before_lse: the module does not take return_lse, declare "
                     "UNSUPPORTED = {'lse'} (2 cases)")


def test_every_feature_unsupported_is_not_a_pass(registered) -> None:  # noqa: ANN001
    registered("fake_nothing", scaled_dot_product_attention=SDPA,
               UNSUPPORTED=set(spec.PLUGIN_FEATURES))
    first = _headline("fake_nothing", ["self", "padding"])
    assert not first.startswith("PASS") and first.startswith("NOTHING CHECKED: fake_nothing")


def _ignores(name: str) -> Callable[..., Any]:
    def sdpa(q: Any, k: Any, v: Any, **options: Any) -> Any:
        options.pop(name, None)
        return SDPA(q, k, v, **options)

    return sdpa


@pytest.mark.parametrize(("keyword", "feature", "case"), [
    ("score_mod", "score_mod", "mods_window_softcap"),
    ("chunk_size", "chunked", "chunked_causal_bottom_right"),
])
def test_a_keyword_swallowed_by_options_names_the_fix(registered, keyword: str, feature: str,  # noqa: ANN001
                                                      case: str) -> None:
    registered(f"fake_swallows_{keyword}", scaled_dot_product_attention=_ignores(keyword))
    first = _headline(f"fake_swallows_{keyword}", [case])
    assert first == (f"FAIL: fake_swallows_{keyword}: your function accepts {keyword} but "
                     f"ignores it, declare UNSUPPORTED = {{'{feature}'}} (1 case)")


def test_an_ignored_keyword_a_named_parameter_takes_keeps_its_diagnosis() -> None:
    def named(q: Any, k: Any, v: Any, *, score_mod: Any = None) -> Any:
        return q

    reason = "the score_mod is ignored"
    assert groups.seams.swallowed(reason, named) == reason
    assert groups.seams.swallowed(reason, None) == reason


# ------------------------------------------------------------------------------ planted variants


def _mask_batch_zero(q: Any, k: Any, v: Any, *, mask: Any = None, **kw: Any) -> Any:
    if mask is not None:
        shape = np.broadcast_shapes(np.shape(mask), (*np.shape(q)[:-1], np.shape(k)[-2]))
        full = np.broadcast_to(np.asarray(mask, bool), shape).copy()
        full[1:] = True
        mask = full
    return SDPA(q, k, v, mask=mask, **kw)


def test_a_mask_applied_to_batch_zero_only_is_named(registered) -> None:  # noqa: ANN001
    registered("fake_mask_b0", scaled_dot_product_attention=_mask_batch_zero)
    assert _headline("fake_mask_b0", ["padding"]) == (
        "FAIL: fake_mask_b0: the mask is applied to batch entry 0 only (1 case)")


def _lse_unscaled(q: Any, k: Any, v: Any, *, return_lse: bool = False, **kw: Any) -> Any:
    out = SDPA(q, k, v, return_lse=return_lse, **kw)
    if not return_lse:
        return out
    scale = kw.get("scale") or np.shape(q)[-1] ** -0.5
    return out[0], out[1] - np.float32(np.log(scale))


def test_an_lse_off_by_log_scale_is_named(registered) -> None:  # noqa: ANN001
    registered("fake_lse_scale", scaled_dot_product_attention=_lse_unscaled)
    assert _headline("fake_lse_scale", ["self"]) == (
        "FAIL: fake_lse_scale: the lse is off by log(scale) (1 case)")


def _merge_empty_as_zero(outputs: Any, lses: Any, **kw: Any) -> Any:
    lses = [np.where(np.isneginf(x), 0, x).astype(x.dtype) for x in lses]
    return numpy_attn.merge_attention(outputs, lses, **kw)


def test_a_merge_that_takes_an_empty_lse_as_zero_is_named(registered) -> None:  # noqa: ANN001
    registered("fake_merge_zero", scaled_dot_product_attention=SDPA,
               merge_attention=_merge_empty_as_zero)
    first = _headline("fake_merge_zero", ["merge_empty_split_sinks_gqa"])
    assert first == ("FAIL: fake_merge_zero: the merge takes an empty part's lse (-inf) as 0 "
                     "(1 case)")


def test_a_sink_in_every_numerator_masked_ones_too_is_named() -> None:
    exp = expected.expected(cases.get("sinks_fully_masked_rows"), "float64")
    a = exp.data.arrays
    w = np.asarray(SDPA(a["query"], a["key"], a["value"], mask=a["mask"], sinks=a["sinks"],
                        return_weights=True)[1])
    _, lse = SDPA(a["query"], a["key"], a["value"], mask=a["mask"], sinks=a["sinks"],
                  return_lse=True)
    wrong = w + np.exp(np.asarray(a["sinks"])[:, None, None] - np.asarray(lse)[..., None])
    out = np.einsum("...qk,...kd->...qd", wrong, a["value"])
    assert diagnose.sink_in_numerator(exp, "output", out).startswith(
        "the sink's term is added to every weight's numerator too")


@pytest.mark.parametrize("shift", [1, -1])
def test_a_chunk_boundary_shifted_on_the_query_side_is_named(shift: int) -> None:
    exp = expected.expected(cases.get("chunked_causal_bottom_right"), "float32")
    a, o = exp.data.arrays, exp.data.options
    q_len, kv_len, chunk = a["query"].shape[-2], a["key"].shape[-2], o["chunk_size"]
    p = np.arange(q_len)[:, None] + kv_len - q_len + shift
    j = np.arange(kv_len)[None, :]
    mask = (p // chunk == j // chunk) & (j <= np.arange(q_len)[:, None] + kv_len - q_len)
    out = SDPA(a["query"], a["key"], a["value"], mask=mask)
    assert diagnose.diagnose(exp, "output", out).startswith(
        "the chunk boundary is shifted by one position on the query side only")


def test_a_varlen_batch_aligned_top_left_is_named() -> None:
    exp = expected.expected(cases.get("varlen_causal_gqa"), "float32")
    a = exp.data.arrays
    out = np.zeros(a["query"].shape[:-1] + a["value"].shape[-1:], np.float32)
    for piece in varlen_pieces(a, exp.data.options):
        p = piece.arrays
        o = {**piece.options, "causal_alignment": "top_left"}
        heads = p["query"].shape[-3]
        k, v = (reference.repeat_kv(np.asarray(p[n]), heads) for n in ("key", "value"))
        res = SDPA(p["query"], k, v, is_causal=o.get("is_causal", False),
                   causal_alignment="top_left", window=o.get("window"), scale=o.get("scale"))
        out[piece.q] = np.swapaxes(np.asarray(res), 0, 1)
    assert diagnose.diagnose(exp, "varlen_output", out).startswith(
        "wrong causal alignment in the packed batch")


def _score_mod_after_mask_mod(q: Any, k: Any, v: Any, *, score_mod: Any = None,
                              mask_mod: Any = None, **kw: Any) -> Any:
    """numpy_attn with the mask_mod applied first (-inf) and the score_mod after it, to every
    position (the mod sees -inf; a soft-cap makes it -softcap, finite)."""
    if score_mod is None or mask_mod is None:
        return SDPA(q, k, v, score_mod=score_mod, mask_mod=mask_mod, **kw)

    def late(score: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        return score_mod(np.where(mask_mod(b, h, i, j), score, -np.inf), b, h, i, j)

    return SDPA(q, k, v, score_mod=late, **kw)


def test_a_score_mod_applied_after_the_masking_is_named(registered) -> None:  # noqa: ANN001
    registered("fake_mod_late", scaled_dot_product_attention=_score_mod_after_mask_mod)
    assert _headline("fake_mod_late", ["mods_window_softcap", "self"]) == (
        "FAIL: fake_mod_late: score_mod is applied after the masking (1 case)")


def _table_read(shift: int) -> Callable[..., Any]:
    """paged_attention reading block_table[b, i + shift] for entry i, the table read flat (past
    a row's end, the next row's first entry; an unused entry -1 is the last page, as NumPy
    indexes): the pages gathered, then numpy_attn's attention under the paged rule's mask."""
    def paged(q: Any, key_pages: Any, value_pages: Any, block_table: Any, seq_lens: Any, *,
              scale: float | None = None, softcap: float | None = None, sinks: Any = None,
              return_lse: bool = False) -> Any:
        table = np.asarray(block_table)
        off = np.take(table.ravel(), np.arange(table.size) + shift, mode="wrap").reshape(
            table.shape)
        kv = contiguous({"query": q, "key_pages": key_pages, "value_pages": value_pages,
                         "block_table": off, "seq_lens": seq_lens})
        return SDPA(q, kv["key"], kv["value"], mask=kv["mask"], scale=scale, softcap=softcap,
                    sinks=sinks, return_lse=return_lse)

    return paged


@pytest.mark.parametrize("shift", [1, -1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_page_table_read_one_entry_off_is_named(registered, dtype: str,  # noqa: ANN001
                                                   shift: int) -> None:
    registered("fake_table_off", scaled_dot_product_attention=SDPA,
               paged_attention=_table_read(shift))
    assert _headline("fake_table_off", ["paged_decode_gqa", "paged_two_queries_sinks"],
                     (dtype,)) == (
        f"FAIL: fake_table_off: the page table is read at entry i {shift:+d} (2 cases)")


def test_the_default_scale_and_batch_zero_replays_apply_only_where_they_can() -> None:
    """``_default_scale_over_d`` replays 1/head_dim only without a custom scale;
    ``_mask_batch_zero`` keeps batch 0's mask and lets every other entry attend freely, and
    does not apply without a mask, with one batch entry or without a heads axis."""
    from conformance.diagnosing import diagnose as d

    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 3, 4, 8)), rng.standard_normal((2, 3, 5, 8))
    a = {"query": q, "key": k, "value": k}
    assert d._default_scale_over_d(a, {"scale": 0.3}) is None
    assert d._default_scale_over_d(a, {"is_causal": True}) == (a, {"is_causal": True,
                                                                   "scale": 1.0 / 8})
    mask = rng.random((2, 1, 4, 5)) < 0.5  # broadcast over the heads
    arrays, options = d._mask_batch_zero({**a, "mask": mask}, {"window": (1, 1)})
    assert options == {"window": (1, 1)} and arrays["query"] is q
    assert arrays["mask"].shape == (2, 3, 4, 5)
    assert (arrays["mask"][0] == np.broadcast_to(mask[0], (3, 4, 5))).all()
    assert arrays["mask"][1].all() and not mask[0].all() and not mask[1].all()
    assert d._mask_batch_zero(a, {}) is None
    one = {"query": q[:1], "key": k[:1], "value": k[:1], "mask": mask[:1]}
    assert d._mask_batch_zero(one, {}) is None
    flat = {"query": q[0, 0], "key": k[0, 0], "value": k[0, 0], "mask": mask[0, 0]}
    assert d._mask_batch_zero(flat, {}) is None
    three = {"query": q[:, 0], "key": k[:, 0], "value": k[:, 0], "mask": mask[:, 0]}
    assert d._mask_batch_zero(three, {}) is None  # (batch, seq, dim): no heads axis
