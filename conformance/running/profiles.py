"""The run's profiles: ``quick`` (the default: a first answer in seconds) and ``full`` (CI).

A profile says which rows (case × dtype), which peer columns and how many property examples a
run has when the command line names none (``spec.PROFILES``). ``full`` is every case of the
catalogue in every dtype, every peer, the property checks. ``quick`` is chosen by rule, never
by hand: every row of the catalogue has a set of **coverage items** (``covers``: the spec's
features the row uses, each step it compares, each module class, the behaviours the spec
singles out — causal top-left, fully masked rows, gradients — and "half precision" for a
bfloat16 or float16 row), and ``quick_rows`` picks a smallest set of rows covering every item
any row covers: a greedy set cover of every case in float32 (each time the row adding the most
uncovered items; ties go to the row with more items, then to the catalogue's order), then the
covering case with the most items once more in bfloat16. A feature added to the catalogue
therefore enters the quick profile by itself; ``tests/test_profiles.py`` proves that
a feature no row covers is noticed.

Every row of ``quick`` runs on every spec backend, and the spec backends run every step of
every row, so every item reaches every backend.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .. import spec
from ..cases import catalogue as cases_mod
from ..cases.expected import GRAD_STEPS, Expected, expected
from . import plugins
from .steps import steps_for

#: The half dtypes; the quick profile's half row is in the first.
HALF = ("bfloat16", "float16")
#: The coverage item of a half-precision row.
HALF_ITEM = "half precision"
#: ``spec.PLUGIN_FEATURES`` that are not features of a row: dtypes have ``HALF_ITEM``, the bad
#: inputs run in both profiles, and every sdpa row compares the weights.
_NOT_ROW_FEATURES = {"errors", "return_weights", "float64", "float32", "bfloat16", "float16"}


def covers(exp: Expected) -> frozenset[str]:
    """The coverage items of one row: its spec features (``spec.PLUGIN_FEATURES`` names),
    ``causal_top_left``, ``fully_masked_rows``, ``gradients``, ``module:<class>``, ``step:<name>``
    for each step it compares, and ``HALF_ITEM`` in bfloat16 or float16."""
    opts = exp.data.options
    items = set(plugins.features(exp.data.arrays, opts, exp.dtype, exp.data.finite))
    items -= _NOT_ROW_FEATURES
    if opts.get("is_causal") and opts.get("causal_alignment", "top_left") != "bottom_right":
        items.add("causal_top_left")
    if any(np.any(z) for name, z in exp.zeros.items() if "output" in name):
        items.add("fully_masked_rows")
    steps = [s.name for s in steps_for(exp)]
    if any(s.removeprefix("blockwise_") in GRAD_STEPS or s == "grad_weights" for s in steps):
        items.add("gradients")
    if exp.kind == "module":
        items.add(f"module:{opts['module']}")
    items.update(f"step:{s}" for s in steps)
    if exp.dtype in HALF:
        items.add(HALF_ITEM)
    used = items | ({"masking"} if items & MASKING else set())
    items.update(f"order:{a}+{b}" for a, b in ORDER_SENSITIVE if {a, b} <= used)
    return frozenset(items)


def cover(rows: dict[tuple[str, str], frozenset[str]]) -> list[tuple[str, str]]:
    """A small set of ``rows`` (in their order) covering every item any of them covers: greedy,
    each time the row adding the most uncovered items (ties: more items, then the earlier
    row). Returned in ``rows``' order."""
    order = list(rows)
    left = set().union(*rows.values()) if rows else set()
    chosen: list[tuple[str, str]] = []
    while left:
        best = max(order, key=lambda r: (len(rows[r] & left), len(rows[r]), -order.index(r)))
        chosen.append(best)
        left -= rows[best]
    return sorted(chosen, key=order.index)


#: Behaviours the spec singles out that no argument names: coverage items of their own.
BEHAVIOURS = ("causal_top_left", "fully_masked_rows", "gradients")
#: The features that mask positions (``spec.PIPELINE_WITH_MODS``'s "masking" step).
MASKING = frozenset({"mask", "causal", "window", "chunked", "segments", "mask_mod"})
#: Pairs of steps of ``spec.PIPELINE_WITH_MODS`` whose order changes the result when both are
#: used: the soft-cap before the bias, ALiBi and score_mod; bias and ALiBi before score_mod;
#: score_mod before the masking; the masking before the softmax with the sinks (which are
#: never masked); dropout after the softmax with the sinks. Each pair meets in one quick row
#: at least (an item ``order:a+b``), so a step in the wrong order cannot pass it.
ORDER_SENSITIVE = (("softcap", "bias"), ("softcap", "alibi"), ("softcap", "score_mod"),
                   ("bias", "score_mod"), ("alibi", "score_mod"), ("score_mod", "masking"),
                   ("masking", "sinks"), ("sinks", "dropout"))


def required_items() -> frozenset[str]:
    """What the quick profile must cover, from the spec alone (not from the catalogue): the
    row features of ``spec.PLUGIN_FEATURES``, ``BEHAVIOURS``, every module class of
    ``spec.MODULES``, every compared step, every pair of ``ORDER_SENSITIVE`` and
    ``HALF_ITEM``."""
    from .steps import STEPS

    return frozenset({*(set(spec.PLUGIN_FEATURES) - _NOT_ROW_FEATURES), *BEHAVIOURS,
                      *(f"module:{m}" for m in spec.MODULES), *(f"step:{s}" for s in STEPS),
                      *(f"order:{a}+{b}" for a, b in ORDER_SENSITIVE), HALF_ITEM})


def uncovered(rows: Iterable[tuple[str, str]]) -> frozenset[str]:
    """The items of ``required_items`` that none of ``rows`` (case, dtype) covers."""
    covered: set[str] = set()
    for case, dtype in rows:
        covered |= covers(expected(cases_mod.get(case), dtype))
    return required_items() - covered


@functools.cache
def _case_items(name: str) -> frozenset[str]:
    """The coverage items of a case in float32 (its inputs' dtype changes nothing else)."""
    return covers(expected(cases_mod.get(name), "float32"))


#: The dtype of the cover's rows, then the others in the order a module's lacks make it fall
#: back to them.
DTYPE_ORDER = ("float32", "float64", "bfloat16", "float16")


@functools.cache
def quick_rows(unsupported: frozenset[str] = frozenset()) -> tuple[tuple[str, str], ...]:
    """The quick profile's rows (case, dtype): ``cover`` of every case in float32, then the
    covering case with the most items again in bfloat16 (``HALF_ITEM``); in the catalogue's
    order, the half row last. For a checked module that declares ``unsupported`` features
    (``spec.PLUGIN_FEATURES`` names), the cover of the cases it can run, in the first dtype it
    supports, and its first supported half dtype: every feature it has reaches it."""
    dtypes = [d for d in DTYPE_ORDER if d not in unsupported]
    if not dtypes:
        return ()
    rows = {(case.name, dtypes[0]): items for case in cases_mod.CASES
            if not (items := _case_items(case.name)) & unsupported}
    chosen = cover(rows)
    half = [d for d in HALF if d in dtypes and d != dtypes[0]]
    if not chosen or not half:
        return tuple(chosen)
    richest = max(chosen, key=lambda r: (len(rows[r]), -chosen.index(r)))
    return (*chosen, (richest[0], half[0]))


#: The features of an sdpa call whose every pair must meet in one case at least (of the full
#: catalogue, any dtype): the scores' steps, the masking rules (the causal rule by its
#: alignment), sinks, grouped query heads, v_dim, dropout and scale. A bug that shows only where
#: two of them meet (one rule's positions read with the other's offset, a step skipped when
#: another is given) then fails a case.
PAIR_FEATURES = ("softcap", "bias", "alibi", "score_mod", "mask", "causal_top_left",
                 "causal_bottom_right", "window", "chunked", "segments", "mask_mod", "sinks",
                 "grouped_query", "v_dim", "dropout", "scale")
#: The pairs of ``PAIR_FEATURES`` that cannot meet, and why.
IMPOSSIBLE_PAIRS = frozenset({
    # A call has one causal_alignment: is_causal is top-left or bottom-right, never both.
    frozenset({"causal_top_left", "causal_bottom_right"}),
})


def pair_features(items: frozenset[str]) -> frozenset[str]:
    """The ``PAIR_FEATURES`` among a row's coverage items (``covers``): ``causal`` is
    ``causal_top_left`` or ``causal_bottom_right``, by the call's alignment (a bottom-right
    window without the causal rule is ``window``)."""
    used = set(items)
    if "causal" in used and "causal_top_left" not in used:
        used.add("causal_bottom_right")
    return frozenset(used & set(PAIR_FEATURES))


def required_pairs() -> frozenset[frozenset[str]]:
    """Every pair of ``PAIR_FEATURES`` but ``IMPOSSIBLE_PAIRS``."""
    pairs = {frozenset(p) for p in itertools.combinations(PAIR_FEATURES, 2)}
    return frozenset(pairs - IMPOSSIBLE_PAIRS)


def uncovered_pairs() -> frozenset[frozenset[str]]:
    """The pairs of ``required_pairs`` that meet in no case of the catalogue."""
    met: set[frozenset[str]] = set()
    for case in cases_mod.CASES:
        met.update(frozenset(p) for p in
                   itertools.combinations(sorted(pair_features(_case_items(case.name))), 2))
    return required_pairs() - met


@dataclass(frozen=True)
class Profile:
    """What a run has when the command line names no case, dtype or property examples."""

    name: str
    #: (case, dtype) rows; None: every case in every dtype.
    rows: tuple[tuple[str, str], ...] | None
    #: The peer columns; None: every peer.
    peers: tuple[str, ...] | None
    #: Property-check examples per backend.
    hypothesis: int


def get(name: str) -> Profile:
    """The profile called ``name`` (``spec.PROFILES``)."""
    if name == "full":
        return Profile("full", None, None, FULL_PROPERTY_EXAMPLES)
    if name == "quick":
        return Profile("quick", quick_rows(), QUICK_PEERS, 0)
    raise ValueError(f"profile must be one of {', '.join(spec.PROFILES)}, got {name!r}")


def choose(profile: Profile, cases: list[str] | None, dtypes: list[str] | None,
           hypothesis: int | None, unsupported: Iterable[frozenset[str]] = ()
           ) -> tuple[list[tuple[str, str]], int]:
    """The rows (case name, dtype) and property examples of a run of ``profile``: named
    ``cases`` (glob patterns) or ``dtypes`` select from the whole catalogue (the matching cases,
    in the named dtypes or all four; naming a case means wanting it, whatever the profile) and
    turn the property checks off unless ``hypothesis`` is given; else the profile's rows and
    examples. ``unsupported``: what each checked module of the run declares; the quick
    profile's rows are then those of ``quick_rows`` for each (and the spec backends'), in
    order. The command line and the pytest plugin both choose this way."""
    from .backends import DTYPES

    selecting = bool(cases or dtypes)
    if selecting or profile.rows is None:
        rows = [(case.name, dtype) for case in cases_mod.select(cases)
                for dtype in dict.fromkeys(dtypes or DTYPES)]
    else:
        lacks = list(dict.fromkeys(frozenset(u) for u in unsupported)) or [frozenset()]
        rows = list(dict.fromkeys(r for u in lacks for r in quick_rows(u)))
    if hypothesis is None:
        hypothesis = 0 if selecting else profile.hypothesis
    return rows, hypothesis


#: Property-check examples per backend in the full profile.
FULL_PROPERTY_EXAMPLES = 100
#: The peers of the quick profile: the frameworks' own fused attention.
QUICK_PEERS = ("torch.sdpa", "jax.nn")

__all__ = ["BEHAVIOURS", "DTYPE_ORDER", "FULL_PROPERTY_EXAMPLES", "HALF", "HALF_ITEM",
           "IMPOSSIBLE_PAIRS", "MASKING", "ORDER_SENSITIVE", "PAIR_FEATURES", "QUICK_PEERS",
           "Profile", "choose", "cover", "covers", "get", "pair_features", "quick_rows",
           "required_items", "required_pairs", "uncovered", "uncovered_pairs"]
