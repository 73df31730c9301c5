"""Pairwise coverage of the case table (``profiles.uncovered_pairs``): every pair of sdpa
features of ``profiles.PAIR_FEATURES`` that the spec lets meet meets in one case at least;
deleting the only case of a pair is noticed.
"""

from __future__ import annotations

import itertools

import pytest

from conformance import spec
from conformance.cases import catalogue as cases
from conformance.running import profiles


def test_every_pair_of_features_meets_in_a_case() -> None:
    assert profiles.uncovered_pairs() == frozenset()


def test_the_pairs_are_every_pair_but_the_impossible_ones() -> None:
    """The features are the spec's (the causal rule by its alignment); only the two causal
    alignments cannot meet, and they are no required pair."""
    features = set(profiles.PAIR_FEATURES)
    assert features - {"causal_top_left", "causal_bottom_right"} <= set(spec.PLUGIN_FEATURES)
    assert len(features) == len(profiles.PAIR_FEATURES) == 16
    assert profiles.IMPOSSIBLE_PAIRS == {frozenset({"causal_top_left", "causal_bottom_right"})}
    every = {frozenset(p) for p in itertools.combinations(features, 2)}
    assert profiles.required_pairs() == every - profiles.IMPOSSIBLE_PAIRS
    assert len(profiles.required_pairs()) == 16 * 15 // 2 - 1


@pytest.mark.parametrize(("case", "expected"), [
    ("causal_top_left", {"causal_top_left"}),
    ("causal_bottom_right", {"causal_bottom_right"}),
    ("window_causal_bottom_right", {"causal_bottom_right", "window"}),
    ("window", {"window"}),
    ("mask_and_bias", {"mask", "bias"}),
    ("mods_causal_alibi", {"mask_mod", "score_mod"}),  # a causal mask_mod is no is_causal
])
def test_a_case_has_the_pair_features_of_its_call(case: str, expected: set[str]) -> None:
    assert profiles.pair_features(profiles._case_items(case)) == expected


def test_a_pair_whose_only_case_is_deleted_is_noticed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Delete the one case where the causal rule top-left meets dropout: ``uncovered_pairs``
    names that pair, and exactly the other pairs that case alone has."""
    pair = frozenset({"causal_top_left", "dropout"})
    having = [c.name for c in cases.CASES
              if pair <= profiles.pair_features(profiles._case_items(c.name))]
    assert len(having) == 1
    alone = {frozenset(p) for p in itertools.combinations(
        profiles.pair_features(profiles._case_items(having[0])), 2)}
    for other in cases.CASES:
        if other.name != having[0]:
            alone -= {frozenset(p) for p in itertools.combinations(
                profiles.pair_features(profiles._case_items(other.name)), 2)}
    monkeypatch.setattr(cases, "CASES", tuple(c for c in cases.CASES if c.name != having[0]))
    assert pair in profiles.uncovered_pairs()
    assert profiles.uncovered_pairs() == alone
