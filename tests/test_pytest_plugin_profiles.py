"""The pytest plugin's profiles (``--attention-profile``, ``spec.PROFILES``): what it collects.

``quick`` is the default and collects exactly the rows of ``profiles.get("quick")``, with no
property examples; ``full`` collects every case of the catalogue in every dtype of
``backends.DTYPES`` (the items the plugin collected before it had profiles) and its property
examples; ``--attention-case`` and ``--attention-dtype`` select from the whole catalogue
whatever the profile; ``--attention-hypothesis`` overrides the examples; an unknown profile is
one line, exit code 4. The expected items are computed here from the catalogue and
``steps_for``, never written down. In process on ``outcomes.Suite`` (what each process
collects), and in a child pytest (``--collect-only``, slow).
"""

from __future__ import annotations

import argparse
import re

import pytest
from harness_helpers import _expected
from plugin_runs import counts, run_suite

from conformance import spec
from conformance.cases import catalogue
from conformance.running import backends, errors, profiles
from conformance.running.steps import steps_for
from conformance.suite import config, outcomes, plugin
from conformance.usage import UsageError

#: A cell item's id: case, dtype, step.
CELL_ID = re.compile(r"::test_cell\[(.+)-(" + "|".join(backends.DTYPES) + r")-(\w+)\]$")


def _every_row() -> list[tuple[str, str]]:
    return [(case.name, dtype) for case in catalogue.CASES for dtype in backends.DTYPES]


def test_quick_is_the_default_with_the_quick_profiles_rows_and_no_examples() -> None:
    """No profile named: the quick profile's rows, in its order, each with its steps; the
    property item skips and says how to run it; the header says what full adds."""
    assert config.DEFAULT_PROFILE == "quick" and set(spec.PROFILES) == {"quick", "full"}
    suite = outcomes.Suite(None)
    quick = profiles.get("quick")
    assert suite.rows == list(quick.rows)
    assert list(dict.fromkeys((c, d) for c, d, _ in suite.cell_steps())) == list(quick.rows)
    assert suite.hypothesis == quick.hypothesis == 0
    assert suite.properties_outcome() == outcomes.Outcome(
        outcomes.SKIPPED, "profile quick: no property checks (--attention-profile full or "
                          "--attention-hypothesis N runs them)")
    others = len(_every_row()) - len(quick.rows)
    assert suite.scope() == (f"profile quick: {len(quick.rows)} case × dtype rows, 0 property "
                             f"examples; --attention-profile full adds the other {others} rows "
                             f"(every case in every dtype) and "
                             f"{profiles.FULL_PROPERTY_EXAMPLES} property examples")


def test_full_has_every_case_in_every_dtype_and_its_examples() -> None:
    """``full``: every case × dtype of the catalogue, the full profile's property examples."""
    suite = outcomes.Suite(None, profile="full")
    assert suite.rows == _every_row()
    assert suite.hypothesis == profiles.FULL_PROPERTY_EXAMPLES
    assert suite.scope().startswith(f"profile full: {len(_every_row())} case × dtype rows, ")


def test_cases_and_dtypes_select_from_the_whole_catalogue_whatever_the_profile() -> None:
    """A named case or dtype is wanted: its rows come from the whole catalogue in either
    profile (a case the quick profile leaves out included), with no property examples unless
    ``--attention-hypothesis`` asks; an explicit count overrides a profile's."""
    left_out = next(c.name for c in catalogue.CASES
                    if all(case != c.name for case, _ in profiles.get("quick").rows))
    for name in ("quick", "full"):
        suite = outcomes.Suite(None, profile=name, cases=[left_out])
        assert suite.rows == [(left_out, d) for d in backends.DTYPES]
        assert suite.hypothesis == 0
        half = outcomes.Suite(None, profile=name, dtypes=["float16"])
        assert half.rows == [(c.name, "float16") for c in catalogue.CASES]
    assert outcomes.Suite(None, cases=[left_out], hypothesis=7).hypothesis == 7
    assert outcomes.Suite(None, profile="full", hypothesis=3).hypothesis == 3
    assert outcomes.Suite(None, hypothesis=5).rows == list(profiles.get("quick").rows)


def test_an_unknown_profile_is_a_usage_error() -> None:
    """The option's type names the profiles; a ``Suite`` on an unknown profile is a
    ``UsageError`` naming the option."""
    with pytest.raises(argparse.ArgumentTypeError,
                       match=r"^'fast' is not a profile; expected one of quick, full "):
        plugin.profile_name("fast")
    assert plugin.profile_name("full") == "full"
    with pytest.raises(UsageError, match="^--attention-profile: profile must be one of quick, "):
        outcomes.Suite(None, profile="fast")


# ------------------------------------------------------------------------------ subprocess


def _collected(*args: str) -> tuple[list[tuple[str, str, str]], int]:
    """The cell items (case, dtype, step) a child pytest collects, and all its items."""
    result = run_suite("--attention-backend", "examples.sdpa_only", "--collect-only", *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    cells = [m.groups() for line in result.stdout.splitlines()
             if (m := CELL_ID.search(line.strip()))]
    return cells, counts(result.stdout)["tests collected"]


def _steps(rows: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    return [(c, d, s.name) for c, d in rows for s in steps_for(_expected(c, d))]


@pytest.mark.slow
def test_the_plugin_collects_quick_by_default_and_every_case_and_dtype_in_full() -> None:
    """The plugin's collection: by default the quick profile's rows and nothing else; with
    ``--attention-profile full`` every case × dtype, as many items as before profiles existed
    (every step of every row, every bad input, the property item)."""
    others = len(errors.ERROR_CASES) + 1
    cells, total = _collected()
    sdpa_only = frozenset({"chunked", "alibi", "segments", "score_mod", "mask_mod"})
    assert cells == _steps(list(profiles.quick_rows(sdpa_only)))  # what the module supports
    assert total == len(cells) + others
    cells, total = _collected("--attention-profile", "full")
    assert cells == _steps(_every_row())
    assert total == len(cells) + others
    cells, total = _collected("--attention-no-errors")  # as the CLI's --no-errors
    assert total == len(cells) + 1


@pytest.mark.slow
def test_an_unknown_profile_is_one_line_and_exit_code_4() -> None:
    """``--attention-profile fast``: pytest's usage error naming the option and the profiles."""
    result = run_suite("--attention-backend", "examples.sdpa_only", "--attention-profile", "fast")
    assert result.returncode == 4
    assert "argument --attention-profile: 'fast' is not a profile; expected one of quick, " \
           "full" in result.stderr
