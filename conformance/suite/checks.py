"""The suite's pytest items, collected from this file by the plugin (``plugin``).

``SuiteFile`` yields, in this order and identically in every process (xdist's workers check
that they collect the same items):

* ``test_cell[<case>-<dtype>-<step>]``: one per compared step of every selected case × dtype
  (``outcomes.Suite.cell_steps``), e.g. ``test_cell[gqa-float32-output]``;
* ``test_bad_input[<name>]``: one per bad input of ``errors.ERROR_CASES``;
* ``test_properties[<module>]``: the property checks of the module.

The items are pytest items of their own (not test functions), so the project's or the user's
``python_files`` and ``python_functions`` settings do not change what is collected, and the
ids are the ones above; ``-k`` matches them (``-k "gqa and float32"``). An item asks this
process's ``Suite`` for its ``Outcome`` and passes, skips with the reason or fails with the
message (no traceback: two lines, the harness's diagnosis and the rerun command); a failed cell
step also puts its ``Failure`` in the item's ``user_properties``, from which the plugin's
summary groups the failures by diagnosis (``summary``), and which ``--junitxml`` lists.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .config import suite_of
from .outcomes import FAILED, SKIPPED, Outcome


def settle(outcome: Outcome) -> None:
    """Turn an ``Outcome`` into pytest's: return (passed), ``pytest.skip`` or ``pytest.fail``
    with the message and no traceback."""
    if outcome.status == SKIPPED:
        pytest.skip(outcome.message)
    if outcome.status == FAILED:
        pytest.fail(outcome.message, pytrace=False)


class SuiteItem(pytest.Item):
    """One item of the suite; ``key`` says what it checks."""

    def __init__(self, *, key: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.key = key

    def outcome(self) -> Outcome:
        """What this item's check gives (``outcomes.Suite``)."""
        raise NotImplementedError

    def runtest(self) -> None:
        """Pass, skip or fail as ``outcome`` says; a failure's ``Failure`` goes into the
        item's ``user_properties`` first."""
        outcome = self.outcome()
        if outcome.failure is not None:
            self.user_properties.extend(outcome.failure.properties())
        settle(outcome)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        """Where pytest says the item is: this file and the item's name."""
        return self.path, None, self.name


class CellItem(SuiteItem):
    """One compared step of one case × dtype: ``key`` is ``(case, dtype, step)``."""

    def outcome(self) -> Outcome:
        """``Suite.step_outcome``."""
        return suite_of(self.config).step_outcome(*self.key)


class BadInputItem(SuiteItem):
    """One bad input: ``key`` is its name in ``errors.ERROR_CASES``."""

    def outcome(self) -> Outcome:
        """``Suite.bad_input_outcome``."""
        return suite_of(self.config).bad_input_outcome(self.key)


class PropertyItem(SuiteItem):
    """The property checks of the module."""

    def outcome(self) -> Outcome:
        """``Suite.properties_outcome``."""
        return suite_of(self.config).properties_outcome()


class SuiteFile(pytest.File):
    """This file, as the collector of the suite's items."""

    def collect(self) -> Iterator[SuiteItem]:
        """Every item, in the report's order (see the module docstring)."""
        suite = suite_of(self.config)
        for case, dtype, step in suite.cell_steps():
            yield CellItem.from_parent(self, name=f"test_cell[{case}-{dtype}-{step}]",
                                       key=(case, dtype, step))
        no_errors = self.config.getoption("attention_no_errors", False)
        for name in [] if no_errors else suite.bad_inputs():
            yield BadInputItem.from_parent(self, name=f"test_bad_input[{name}]", key=name)
        yield PropertyItem.from_parent(self, name=f"test_properties[{suite.name or 'module'}]")


__all__ = ["BadInputItem", "CellItem", "PropertyItem", "SuiteFile", "SuiteItem", "settle"]
