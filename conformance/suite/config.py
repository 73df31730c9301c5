"""The plugin's options and this process's ``Suite`` (shared by ``plugin`` and ``checks``).

The module to check comes from ``--attention-backend MODULE``, else from the environment
variable ``ATTENTION_BACKEND`` (as array-api-tests reads ``ARRAY_API_TESTS_MODULE``); the other
options choose the profile (``quick``, the default, or ``full``: ``spec.PROFILES``), select cases
and dtypes, and set the property checks' examples and the per-call time limit.
Only pytest and the standard library are imported here: the plugin is loaded by every pytest
run of an environment where the project is installed, and the harness is imported only when
the suite is used (``suite_of``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

#: The environment variable naming the module to check when ``--attention-backend`` is not given.
ENV = "ATTENTION_BACKEND"
#: The profile when ``--attention-profile`` is not given (``spec.PROFILES``).
DEFAULT_PROFILE = "quick"
#: The file whose items the suite collects (``plugin.pytest_collect_file``).
CHECKS = Path(__file__).with_name("checks.py")
#: The names of the suite's items, before their ``[id]``.
ITEM_KINDS = ("test_cell", "test_bad_input", "test_properties")
_SUITE = pytest.StashKey[Any]()


def backend_name(config: pytest.Config) -> str | None:
    """The module to check: ``--attention-backend``, else ``$ATTENTION_BACKEND``; None when
    neither is given (or both are empty)."""
    name = config.getoption("attention_backend", None) or os.environ.get(ENV, "")
    return name.strip() or None


def selected(config: pytest.Config) -> bool:
    """True when the run names a module to check or selects cases or dtypes: the user means
    the suite, so its options are validated before any work."""
    return bool(backend_name(config) or config.getoption("attention_case", None)
                or config.getoption("attention_dtype", None))


def targets_suite(config: pytest.Config) -> bool:
    """True when a path or ``--pyargs`` package among the run's arguments holds the suite's
    file (``--pyargs conformance.suite``, ``conformance/``, …): what the items will be, known
    before collection (xdist's controller collects nothing itself)."""
    for arg in config.args:
        name = str(arg).split("::")[0]
        candidates = [config.invocation_params.dir / name]
        if config.option.pyargs:
            try:
                found = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                found = None
            if found is not None and found.origin:
                candidates.append(Path(found.origin).parent if found.submodule_search_locations
                                  else Path(found.origin))
        for path in candidates:
            try:
                if path.resolve() == CHECKS.resolve() or path.resolve() in CHECKS.resolve().parents:
                    return True
            except OSError:
                continue
    return False


def missing_backend() -> str:
    """The one line that says how to name the module to check."""
    return (f"no module to check: give --attention-backend MODULE or set {ENV}=MODULE (a "
            f"dotted path, e.g. mypkg.attention; docs/checking.md, In your CI)")


def suite_of(config: pytest.Config) -> Any:
    """This process's ``outcomes.Suite``, made from the options on first use (a bad option is
    a ``pytest.UsageError``: one line, exit code 4)."""
    if _SUITE not in config.stash:
        from ..usage import UsageError
        from .outcomes import Suite

        timeout = config.getoption("attention_timeout", None)
        try:
            config.stash[_SUITE] = Suite(
                backend_name(config),
                profile=config.getoption("attention_profile", None) or DEFAULT_PROFILE,
                cases=config.getoption("attention_case"),
                dtypes=config.getoption("attention_dtype"),
                hypothesis=config.getoption("attention_hypothesis", None),
                **({"timeout": timeout} if timeout is not None else {}))
        except UsageError as exc:
            raise pytest.UsageError(str(exc)) from None
    return config.stash[_SUITE]


def is_suite_item(nodeid: str) -> bool:
    """True for the node id of one of the suite's items (``checks.py::test_cell[...]``)."""
    path, _, name = nodeid.partition("::")
    return Path(path).name == CHECKS.name and name.partition("[")[0] in ITEM_KINDS


__all__ = ["CHECKS", "DEFAULT_PROFILE", "ENV", "ITEM_KINDS", "backend_name", "is_suite_item",
           "missing_backend", "selected", "suite_of", "targets_suite"]
