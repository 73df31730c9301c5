"""The run's profiles (``conformance.running.profiles``, ``spec.PROFILES``): the quick profile
covers, from the case table, every feature the spec names on every backend; deleting the cases
of a feature is noticed; a planted bug in each backend is caught by the quick profile with its
diagnosis; ``--full`` keeps the whole matrix.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import numpy as np
import pytest
from harness_helpers import _expected

from conformance import spec
from conformance.cases import catalogue as cases
from conformance.comparing.results import Column
from conformance.reporting import overview
from conformance.running import backends, profiles, room, runner
from conformance.running.steps import STEPS


def test_the_quick_rows_cover_every_item_the_spec_names() -> None:
    """The items come from the spec (features, modules, steps), the covering from the case
    table: a spec feature without a case, or a case the cover leaves out, fails here."""
    rows = profiles.quick_rows()
    assert profiles.uncovered(rows) == frozenset()
    required = profiles.required_items()
    assert {f"module:{m}" for m in spec.MODULES} <= required
    assert {f"step:{s}" for s in STEPS} <= required
    assert {"causal_top_left", "bottom_right", "fully_masked_rows", "gradients", "sinks",
            "lse", "merge", "chunked", "alibi", "segments", "score_mod", "mask_mod", "varlen",
            "paged", "dropout", "non_finite", "softcap", "window", "grouped_query",
            profiles.HALF_ITEM} <= required
    assert any(dtype in profiles.HALF for _, dtype in rows)
    assert len(rows) < len(cases.CASES) // 3  # a profile, not the catalogue


def test_a_feature_whose_cases_are_deleted_is_noticed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Delete every case that uses chunk_size: the cover of what is left cannot reach it, and
    ``uncovered`` names it (and nothing else)."""
    chunked = {c.name for c in cases.CASES if "chunked" in profiles._case_items(c.name)}
    assert chunked
    assert _uncovered_without(monkeypatch, chunked) == {"chunked"}


def _uncovered_without(monkeypatch: pytest.MonkeyPatch, names: set[str]) -> frozenset[str]:
    """``uncovered`` of the quick cover of the catalogue without the cases ``names``."""
    monkeypatch.setattr(cases, "CASES", tuple(c for c in cases.CASES if c.name not in names))
    profiles.quick_rows.cache_clear()
    try:
        return profiles.uncovered(profiles.quick_rows())
    finally:
        profiles.quick_rows.cache_clear()


def test_the_cover_is_greedy_and_small() -> None:
    """``cover`` on a made-up table: the row with most uncovered items first, ties to the
    row with more items, then the earlier one; every item covered."""
    rows = {("a", "f"): frozenset({1, 2}), ("b", "f"): frozenset({1, 2, 3, 4}),
            ("c", "f"): frozenset({4, 5}), ("d", "f"): frozenset({5}),
            ("e", "f"): frozenset({5, 6})}
    assert profiles.cover(rows) == [("b", "f"), ("e", "f")]
    assert profiles.cover({}) == []


def test_profiles_by_name() -> None:
    quick, full = profiles.get("quick"), profiles.get("full")
    assert quick.rows == profiles.quick_rows() and quick.hypothesis == 0
    assert set(quick.peers) == {"torch.sdpa", "jax.nn"}
    assert full.rows is None and full.peers is None and full.hypothesis == 100
    assert set(spec.PROFILES) == {"quick", "full"}
    with pytest.raises(ValueError, match="profile must be one of quick, full"):
        profiles.get("fast")


def test_the_full_profile_is_every_case_in_every_dtype(monkeypatch) -> None:  # noqa: ANN001
    """``runner.run(profile="full")`` hands every case × dtype to the run (counted, not run)."""
    seen: list[int] = []

    def counted(columns, expectations, missing, *, total=0, **kwargs):  # noqa: ANN001, ANN202
        seen.append(total)
        return runner.RunResult(columns, [], missing, [])

    monkeypatch.setattr(runner, "run_expectations", counted)
    assert runner.run(["numpy"], profile="full").profile == "full"
    assert runner.run(["numpy"]).profile == "quick"
    assert runner.run(["numpy"], ["self"]).profile == ""  # a selection is no profile
    assert seen == [len(cases.CASES) * len(backends.DTYPES), len(profiles.quick_rows()),
                    len(backends.DTYPES)]


# ------------------------------------------------------------------------------ planted bugs


def _as_numpy(x: Any) -> Any:
    return np.asarray(x) if hasattr(x, "shape") else x


def _planted(name: str, backend: str, transform: Any) -> types.ModuleType:
    """A checked module: ``backend``'s scaled_dot_product_attention on NumPy arrays, its
    keyword arguments changed by ``transform`` (the planted bug)."""
    real = backends.get(backend)

    def sdpa(query: Any, key: Any, value: Any, **kwargs: Any) -> Any:
        kwargs = transform(dict(kwargs))
        convert = {k: real.asarray(v) if isinstance(v, np.ndarray) else v
                   for k, v in kwargs.items()}
        out = real.module.scaled_dot_product_attention(
            real.asarray(query), real.asarray(key), real.asarray(value), **convert)
        if isinstance(out, tuple):
            return tuple(real.to_numpy(x) for x in out)
        return real.to_numpy(out)

    module = types.ModuleType(name)
    module.scaled_dot_product_attention = sdpa
    return module


def _other_alignment(kw: dict) -> dict:
    if kw.get("is_causal") or kw.get("window") is not None:
        kw["causal_alignment"] = ("top_left" if kw.get("causal_alignment") == "bottom_right"
                                  else "bottom_right")
    return kw


def _alibi_flipped(kw: dict) -> dict:
    if kw.get("alibi_slopes") is not None:
        kw["alibi_slopes"] = -np.asarray(kw["alibi_slopes"])
    return kw


def _sinks_ignored(kw: dict) -> dict:
    kw.pop("sinks", None)
    return kw


PLANTED = (("numpy", _other_alignment, "wrong causal alignment"),
           ("jax", _alibi_flipped, "ALiBi's sign is flipped"),
           ("torch", _sinks_ignored, "the sinks are ignored"))


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "transform", "named"), PLANTED,
                         ids=[p[0] for p in PLANTED])
def test_a_planted_bug_in_each_backend_is_caught_by_the_quick_profile_and_named(
        backend: str, transform: Any, named: str) -> None:
    name = f"planted_{backend}"
    backends.register(backends.from_module(_planted(name, backend, transform), name=name))
    try:
        result = runner.run([name], check_errors=False)
    finally:
        backends.unregister(name)
    assert result.profile == "quick"
    failing = [c for c in result.cells if c.status == "FAIL"]
    assert failing, "the quick profile missed the planted bug"
    assert any(r.startswith(named) for c in failing for r in c.reasons), [
        c.reasons for c in failing]
    column = result.columns[0]
    verdict = overview.backend_verdict(column, result.cells, [], 1.0)
    assert verdict.startswith(f"{name}: FAIL") and named in verdict
    assert "rerun one: python -m conformance" in verdict


@pytest.mark.slow
def test_two_threads_give_the_cells_of_one() -> None:
    """``room.Threads`` (the quick command line's room: a compiling backend's cells two at a
    time) gives the same cells, to the last bit, in the same order, as ``room.Room``."""
    columns = [Column(n, "backend", backend=backends.get(n)) for n in ("numpy", "jax")]
    exps = [_expected(case, "float32") for case in ("self", "causal_top_left", "gqa")]
    one = runner.run_columns(columns, exps)
    two = runner.run_columns(columns, exps, room=room.Threads)
    assert [repr(dataclasses.asdict(c)) for c in two.cells] == [
        repr(dataclasses.asdict(c)) for c in one.cells]
    assert [c.status for c in two.cells] == ["ok"] * 6


def test_each_order_sensitive_pair_meets_in_a_quick_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pair of ``profiles.ORDER_SENSITIVE`` is used together by one quick row; without
    the case that puts sinks and dropout together, that pair (and only it) is uncovered."""
    rows = profiles.quick_rows()
    met = set().union(*(profiles.covers(_expected(case, dtype)) for case, dtype in rows))
    assert {f"order:{a}+{b}" for a, b in profiles.ORDER_SENSITIVE} <= met
    assert _uncovered_without(monkeypatch, {"combined_masked_dropout"}) == {"order:sinks+dropout"}


def test_a_module_gets_the_cover_of_what_it_supports() -> None:
    """A checked module that declares features unsupported gets the quick cover of the cases it
    can run: none of its rows uses what it lacks, and every item those cases reach is covered
    (a plain module of docs/checking.md gets rows, not a run where nothing is checked)."""
    lacks = frozenset({"mask", "bias", "causal", "window", "dropout", "softcap", "grouped_query",
                       "2d_inputs", "sinks", "lse", "chunked", "alibi", "segments",
                       "score_mod", "mask_mod", "bfloat16"})
    rows = profiles.quick_rows(lacks)
    assert rows and all(not profiles._case_items(c) & lacks for c, _ in rows)
    assert ("float16" in {d for _, d in rows}) and "bfloat16" not in {d for _, d in rows}
    reachable = set().union(*(profiles._case_items(c.name) for c in cases.CASES
                              if not profiles._case_items(c.name) & lacks))
    # everything the module can reach is covered, the half item by its float16 row
    assert profiles.uncovered(rows) == profiles.required_items() - reachable - {
        profiles.HALF_ITEM}
    assert profiles.quick_rows(frozenset()) == profiles.quick_rows()
    chosen, _ = profiles.choose(profiles.get("quick"), None, None, None, [lacks, frozenset()])
    assert set(chosen) == set(rows) | set(profiles.quick_rows())
