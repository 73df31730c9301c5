"""The plugin features of attention sinks, the row log-sum-exp, merging and paged decoding
(``spec.PLUGIN_FEATURES``: ``sinks``, ``lse``, ``merge``, ``paged``): a checked module that
lacks them declares them and its cells are "unsupported", never failed; one that lacks them
without saying so is told how to; their bad inputs are skipped the same way; a ``bshd``
module's partial outputs reach its ``merge_attention`` in its own layout, and a module's own
array type reaches it inside the lists too; the property checks draw sinks only for a module
that takes them.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest
from harness_helpers import NEEDS_HYPOTHESIS

import numpy_attn
from conformance.cases import catalogue as cases
from conformance.cases import expected
from conformance.running import backends, errors, plugins, properties, runner

NEW_CASES = ["self", "sinks_window", "merge_two_splits", "paged_decode_gqa"]


def _module(name: str, **attrs: Any) -> backends.Backend:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    return backends.from_module(module, name=name)


def _old_sdpa(query: Any, key: Any, value: Any, *, mask: Any = None, bias: Any = None,
              is_causal: bool = False, causal_alignment: str = "top_left", window: Any = None,
              scale: Any = None, softcap: Any = None, dropout_p: float = 0.0,
              dropout_mask: Any = None, rng: Any = None, return_weights: bool = False) -> Any:
    """numpy_attn's sdpa behind the signature of a module written before sinks and the lse."""
    return numpy_attn.scaled_dot_product_attention(
        query, key, value, mask=mask, bias=bias, is_causal=is_causal,
        causal_alignment=causal_alignment, window=window, scale=scale, softcap=softcap,
        dropout_p=dropout_p, dropout_mask=dropout_mask, rng=rng, return_weights=return_weights)


def test_a_module_that_declares_sinks_and_lse_is_never_failed_for_them() -> None:
    backend = _module("declares_sinks_lse", scaled_dot_product_attention=_old_sdpa,
                      merge_attention=numpy_attn.merge_attention,
                      UNSUPPORTED={"sinks", "lse"})
    cells = {c: runner.run_cell(backend, expected.expected(cases.get(c), "float32"))
             for c in NEW_CASES}
    assert {c: cell.status for c, cell in cells.items()} == {
        "self": "ok", "sinks_window": "unsupported", "merge_two_splits": "unsupported",
        "paged_decode_gqa": "not provided"}
    steps = {s.step for s in cells["self"].steps}
    assert {"output", "output_weights"} <= steps and "lse" not in steps  # declared: not run
    assert cells["sinks_window"].detail == "declared unsupported: sinks"
    assert cells["merge_two_splits"].detail == "declared unsupported: lse"  # its parts need it
    assert cells["paged_decode_gqa"].detail == "not provided: paged_attention, PagedKVCache"


def test_a_module_that_lacks_them_silently_is_told_to_declare_them() -> None:
    backend = _module("silent_about_sinks", scaled_dot_product_attention=_old_sdpa)
    exp = expected.expected(cases.get("sinks_window"), "float32")
    cell = runner.run_cell(backend, exp)
    assert cell.status == "error"
    assert "UNSUPPORTED = {'sinks', ...}" in cell.detail
    cell = runner.run_cell(backend, expected.expected(cases.get("self"), "float32"))
    assert cell.status == "FAIL"  # output passes; the lse step fails, saying why
    lse = next(s for s in cell.steps if s.step == "lse")
    assert "return_lse" in lse.error and "UNSUPPORTED = {'lse', ...}" in lse.error
    assert all(s.passed for s in cell.steps if s.step != "lse")


def test_features_name_sinks_lse_merge_and_paged() -> None:
    def used(case: str) -> frozenset[str]:
        data = cases.prepare_inputs(cases.get(case), "float32")
        return plugins.features(data.arrays, data.options, "float32", data.finite)

    assert {"sinks", "window"} <= used("sinks_window") and "merge" not in used("sinks_window")
    assert {"merge", "lse", "sinks", "grouped_query", "mask"} <= used(
        "merge_empty_split_sinks_gqa")
    assert {"paged", "sinks", "softcap", "grouped_query"} <= used("paged_two_queries_sinks")
    assert "sinks" not in used("self") and "lse" not in used("self")
    outputs, lses = [np.zeros((1, 2, 3, 4), np.float32)], [np.zeros((1, 2, 3), np.float32)]
    assert plugins.call_features((outputs, lses), {}) == {"merge", "float32"}
    assert plugins.call_features(([[0.0]], np.zeros((2, 1))), {}) == {"float64"}  # a list query
    assert "lse" in plugins.call_features((), {"return_lse": True})


def test_bad_inputs_of_a_declared_feature_are_skipped() -> None:
    backend = _module("no_sinks_no_merge", scaled_dot_product_attention=numpy_attn.
                      scaled_dot_product_attention, merge_attention=numpy_attn.merge_attention,
                      UNSUPPORTED={"sinks", "merge"})
    assert backend.available()  # imported: its contract is known (as runner.run does first)
    notes: list[str] = []
    ran = {r.case for r in runner.run_errors([backend], notes)}
    sinks = {c.name for c in errors.ERROR_CASES if "sinks" in c.name}
    merge = {c.name for c in errors.ERROR_CASES if c.fn.startswith("merge_attention")}
    assert sinks and merge and not (sinks | merge) & ran
    assert "return_lse_int" in ran  # lse is not declared: its bad input runs
    assert any("of" in note and "checked on no_sinks_no_merge" in note for note in notes)


def _bshd(x: Any) -> Any:
    return None if x is None else np.swapaxes(np.asarray(x), -3, -2)


def _bshd_sdpa(query: Any, key: Any, value: Any, **kw: Any) -> Any:
    result = numpy_attn.scaled_dot_product_attention(_bshd(query), _bshd(key), _bshd(value), **kw)
    if isinstance(result, tuple):  # (output[, weights][, lse]): weights and lse keep their axes
        return (_bshd(result[0]), *result[1:])
    return _bshd(result)


def _bshd_merge(outputs: Any, lses: Any, **kw: Any) -> Any:
    output, lse = numpy_attn.merge_attention([_bshd(o) for o in outputs], lses, **kw)
    return _bshd(output), lse


def test_a_bshd_module_merges_its_own_layout() -> None:
    backend = _module("bshd_merge", scaled_dot_product_attention=_bshd_sdpa,
                      merge_attention=_bshd_merge, LAYOUT="bshd")
    for case in ("merge_two_splits", "merge_empty_split_sinks_gqa", "sinks_window"):
        cell = runner.run_cell(backend, expected.expected(cases.get(case), "float32"))
        assert cell.status == "ok", (case, cell.detail)
        assert "lse" in {s.step for s in cell.steps} or case.startswith("merge")


def test_property_checks_draw_sinks_only_for_modules_that_take_them() -> None:
    pytest.importorskip("hypothesis", reason=NEEDS_HYPOTHESIS)
    with_sinks = [lay for lay in properties.LAYOUTS if lay.sinks]
    assert len(with_sinks) == 5 and all("sinks" in properties.features(lay) for lay in with_sinks)
    layouts, _ = properties.layouts_for(frozenset({"sinks"}))
    assert layouts and not any(lay.sinks for lay in layouts)
    seen: list[bool] = []
    numpy_backend = backends.get("numpy")
    spy = types.ModuleType("spy")
    spy.__dict__.update(vars(numpy_attn))

    def sdpa(q: Any, k: Any, v: Any, **kw: Any) -> Any:
        seen.append(kw.get("sinks") is not None)
        return numpy_attn.scaled_dot_product_attention(q, k, v, **kw)

    spy.scaled_dot_product_attention = sdpa
    import dataclasses

    result = properties.run([dataclasses.replace(numpy_backend, name="spy", _module=spy,
                                                 _compiled={})], 40)
    assert result.passed, result.text()
    assert any(seen) and not all(seen)


class _Box:
    """A checked module's own array type."""

    def __init__(self, x: Any) -> None:
        self.x = np.asarray(x)


def _unbox(x: Any) -> Any:
    return x.x if isinstance(x, _Box) else x


def test_merge_lists_reach_a_module_as_its_own_arrays() -> None:
    """``merge_attention``'s lists of partial outputs and lses are converted with the module's
    ``asarray`` like every top-level array."""
    def sdpa(q: Any, k: Any, v: Any, **kw: Any) -> Any:
        assert all(isinstance(x, _Box) for x in (q, k, v))
        result = numpy_attn.scaled_dot_product_attention(
            q.x, k.x, v.x, **{n: _unbox(x) for n, x in kw.items()})
        return tuple(map(_Box, result)) if isinstance(result, tuple) else _Box(result)

    def merge(outputs: Any, lses: Any, **kw: Any) -> Any:
        assert all(isinstance(x, _Box) for x in (*outputs, *lses)), "NumPy arrays in the lists"
        output, lse = numpy_attn.merge_attention([o.x for o in outputs], [x.x for x in lses],
                                                 **{n: _unbox(x) for n, x in kw.items()})
        return _Box(output), _Box(lse)

    backend = _module("boxed", scaled_dot_product_attention=sdpa, merge_attention=merge,
                      asarray=_Box, to_numpy=_unbox)
    for case in ("merge_two_splits", "merge_empty_split_sinks_gqa"):
        cell = runner.run_cell(backend, expected.expected(cases.get(case), "float32"))
        assert cell.status == "ok", (case, cell.detail)
