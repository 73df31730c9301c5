"""The pytest plugin: the conformance check as pytest items, for a kernel author's own CI.

::

    pytest --pyargs conformance.suite --attention-backend mypkg.attention -n auto --junitxml=r.xml
    ATTENTION_BACKEND=mypkg.attention pytest --pyargs conformance.suite

Registered as the ``pytest11`` entry point ``attention_conformance`` (``pyproject.toml``), so
every pytest of an environment where the project is installed knows the options, whatever the
directory it runs in; a ``conftest.py`` inside the package would not do: pytest reads the
options before it resolves ``--pyargs``. Until a run uses the suite the plugin does nothing
but add its options (the harness is not even imported), so other test runs are unchanged.

* **collection**: the items of ``checks`` (``test_cell[<case>-<dtype>-<step>]``, one per bad
  input, one for the property checks), collected from ``conformance/suite/checks.py``
  whenever pytest reaches that file (``--pyargs conformance.suite`` does). The rows (case ×
  dtype) and the property examples are the profile's (``--attention-profile``: ``quick``, the
  default, the harness's smallest set of rows that uses every feature, no property examples;
  ``full``, every case in every dtype and 100 property examples), unless ``--attention-case``
  or ``--attention-dtype`` select from the whole catalogue, as ``python -m conformance`` does;
* **the failures by diagnosis**: a failed item says two lines (its diagnosis, the rerun
  command), and the terminal summary explains each bug once (``summary``: grouped as the
  harness's report groups them, with the count of items, one example item, its first failure,
  its smallest failing case and the rerun command);
* **the module** is imported before the first item runs, as ``python -m conformance
  --backend`` imports it: in a worker process (``running.module_worker``), from the installed
  packages or the directory pytest started in. No module given, one that does not import, or a bad
  option is one line (``ERROR: …``, exit code 4) and nothing runs; ``--collect-only`` needs none;
* **xdist** (``-n auto``): every worker collects the same items; with xdist's default
  distribution (``load``) the items of one case × dtype go to one worker together (a scope
  per cell, ``CellScheduling``), so each cell is computed once;
* **a module that keeps hanging**: each call that does not return within the time limit
  writes a line on the terminal naming the item's case and dtype (``module_worker.calling``);
  after ``running.module_worker.TIMEOUTS_IN_A_ROW`` in a row the module is not called again,
  and every later item fails at once, saying why (as ``python -m conformance`` does);
* **nothing checked**: when every item of the suite that ran was skipped (the module supports
  or provides nothing selected), the run says so and exits with code 5 (pytest's "no tests
  ran"), never 0: a pass on nothing is not a pass (``python -m conformance`` exits 2 then).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import pytest

from ..usage import UsageError, at_least
from .config import (
    CHECKS,
    DEFAULT_PROFILE,
    backend_name,
    is_suite_item,
    missing_backend,
    selected,
    suite_of,
    targets_suite,
)

#: pytest's exit code when every item of the suite that ran was skipped.
NOTHING_CHECKED_EXIT = pytest.ExitCode.NO_TESTS_COLLECTED


def seconds(text: str) -> float:
    """The type of ``--attention-timeout``: seconds ``>= 0`` (``running.module_worker``'s rule)."""
    from ..running.module_worker import seconds_argument

    return seconds_argument(text)


def profile_name(text: str) -> str:
    """The type of ``--attention-profile``: a name of ``spec.PROFILES`` (otherwise pytest's
    one-line usage error, exit code 4)."""
    from .. import spec

    if text not in spec.PROFILES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a profile; expected one of {', '.join(spec.PROFILES)} "
            f"(docs/checking.md, In your CI)")
    return text


def pytest_addoption(parser: pytest.Parser) -> None:
    """The suite's options (``pytest --help``, group "attention conformance")."""
    group = parser.getgroup("attention conformance",
                            "attention conformance (pytest --pyargs conformance.suite)")
    group.addoption("--attention-backend", metavar="MODULE", default=None,
                    help="the module to check, a dotted path (mypkg.attention), as "
                         "python -m conformance --backend takes it; default: "
                         "$ATTENTION_BACKEND")
    group.addoption("--attention-profile", metavar="NAME", type=profile_name, default=None,
                    help=f"quick (the default: the smallest set of case x dtype rows that uses "
                         f"every feature, no property checks) or full (every case in every "
                         f"dtype, 100 property examples; for CI); default {DEFAULT_PROFILE}")
    group.addoption("--attention-case", action="append", metavar="PATTERN", default=None,
                    help="only the cases matching this glob pattern, from the whole catalogue "
                         "whatever the profile (repeatable, as --case)")
    group.addoption("--attention-dtype", action="append", metavar="DTYPE", default=None,
                    help="only this dtype: float64, float32, bfloat16 or float16, every case "
                         "whatever the profile (repeatable)")
    group.addoption("--attention-hypothesis", metavar="N", type=at_least(0), default=None,
                    help="property-check examples (default: the profile's, quick 0, full 100; "
                         "0 when cases or dtypes are selected)")
    group.addoption("--attention-no-errors", action="store_true", default=False,
                    help="no bad-input items (as python -m conformance --no-errors)")
    group.addoption("--attention-timeout", metavar="S", type=seconds, default=None,
                    help="seconds one call of the module may take (0: no limit; default: that "
                         "of python -m conformance)")


def load(config: pytest.Config) -> None:
    """Import the module to check now: none given, one that does not exist, breaks the
    contract or fails to import is a ``pytest.UsageError`` (a failing import's traceback is
    written first)."""
    if backend_name(config) is None:
        raise pytest.UsageError(missing_backend())
    from ..running.plugins import PluginImportError

    try:
        suite_of(config).load()
    except PluginImportError as exc:
        sys.stderr.write(exc.traceback)
        raise pytest.UsageError(str(exc)) from None
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_configure(config: pytest.Config) -> None:
    """When the run names a module or selects cases: check the options (one line, exit code
    4) and let the module be imported from the directory pytest started in, as ``python -m``
    would (appended to ``sys.path``: installed packages come first). xdist's controller, which
    collects nothing, imports the module here when its arguments reach the suite (``load``):
    a worker's error would surface as xdist's internal error."""
    if selected(config):
        start = str(config.invocation_params.dir)
        if start not in sys.path:
            sys.path.append(start)
        suite_of(config)
    controller = getattr(config, "workerinput", None) is None and config.getoption(
        "dist", "no") != "no"
    if controller and not config.option.collectonly and targets_suite(config):
        load(config)


def pytest_collect_file(file_path: Any, parent: pytest.Collector) -> pytest.Collector | None:
    """``checks.SuiteFile`` for ``conformance/suite/checks.py``; nothing for any other file."""
    if file_path.name != CHECKS.name or file_path.parent.name != CHECKS.parent.name:
        return None
    try:
        if not file_path.samefile(CHECKS):
            return None
    except OSError:
        return None
    from .checks import SuiteFile

    return SuiteFile.from_parent(parent, path=file_path)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    """Once the items are chosen (``-k`` applied): if any is the suite's, import the module
    to check now; a missing, broken or failing module is one line and nothing runs (a failing
    import shows its traceback first)."""
    if config.option.collectonly or not any(is_suite_item(item.nodeid) for item in items):
        return
    load(config)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The header's lines, when the run names a module: the module checked, the time limit
    per call, and the profile with its rows and property examples and what ``full`` adds
    (``Suite.scope``)."""
    name = backend_name(config)
    if name is None:
        return []
    timeout = config.getoption("attention_timeout")
    limit = ("default time limit per call" if timeout is None else
             f"time limit per call {timeout:g} s")
    return [f"attention conformance: checking {name}; {limit}",
            f"attention conformance: {suite_of(config).scope()}"]


def checking(item: pytest.Item) -> str:
    """What a suite's item checks, as a call that times out names it: "case gqa dtype
    float32", "bad input <name>", "property checks"; "" for any other item."""
    key = getattr(item, "key", None)
    if not is_suite_item(item.nodeid):
        return ""
    if isinstance(key, tuple) and len(key) == 3:
        return f"case {key[0]} dtype {key[1]}"
    return f"bad input {key}" if key is not None else "property checks"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """A suite's item runs ``running.module_worker.calling`` what it checks (``checking``):
    a call that times out names it in a line on the terminal (pytest's capture would hide it
    on stderr: the item that computes a cell may be one that is skipped); on stderr in an
    xdist worker, which has no terminal."""
    where = checking(item)
    if not where:
        yield
        return
    from ..running.module_worker import calling

    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    capture = item.config.pluginmanager.get_plugin("capturemanager")

    def say(line: str) -> None:
        with capture.global_and_fixture_disabled():  # the item's output is captured
            reporter.write("\n")  # after the progress dots
            reporter.write_line(line, yellow=True)

    with calling(where, say if reporter is not None and capture is not None else None):
        yield


def cell_scope(nodeid: str) -> str:
    """xdist's scope of an item: its case × dtype for a suite's ``test_cell`` item
    (``…::test_cell[gqa-float32``), the item itself otherwise."""
    if is_suite_item(nodeid) and "::test_cell[" in nodeid:
        return nodeid.rsplit("-", 1)[0]
    return nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``-n`` and xdist's default distribution: ``CellScheduling``, xdist's ``loadscope``
    with one scope per case × dtype (``cell_scope``), when the run names a module; else
    xdist's own choice."""
    if config.getoption("dist", None) != "load" or backend_name(config) is None:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class CellScheduling(LoadScopeScheduling):
        """xdist's loadscope, a scope per case × dtype: a cell's step items share one worker
        and so one computation of the cell."""

        def _split_scope(self, nodeid: str) -> str:
            return cell_scope(nodeid)

    return CellScheduling(config, log)


def nothing_checked(stats: dict[str, list[Any]]) -> int:
    """How many of the suite's items ran, when all of them were skipped; 0 when one passed or
    failed, or none of the suite's ran."""
    def count(key: str) -> int:
        return sum(is_suite_item(getattr(r, "nodeid", "")) for r in stats.get(key, []))

    if count("passed") or count("failed") or count("error"):
        return 0
    return count("skipped")


def _stats(config: pytest.Config) -> dict[str, list[Any]]:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    return reporter.stats if reporter is not None else {}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Exit code 5 when every item of the suite that ran was skipped (``nothing_checked``)."""
    if exitstatus == 0 and not hasattr(session.config, "workerinput") \
            and nothing_checked(_stats(session.config)):
        session.exitstatus = NOTHING_CHECKED_EXIT


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int,
                            config: pytest.Config) -> None:
    """The failed cell steps grouped by diagnosis (``summary``), then the line that says
    nothing was checked (see ``pytest_sessionfinish``)."""
    failed = terminalreporter.stats.get("failed", [])
    if failed and backend_name(config) is not None:
        from . import summary

        items = summary.failures(failed)
        if items:
            terminalreporter.write_sep("=", summary.TITLE, red=True, bold=True)
            for line in summary.section(suite_of(config), items):
                terminalreporter.write_line(line)
    skipped = nothing_checked(terminalreporter.stats)
    if skipped and exitstatus == 0:
        terminalreporter.write_line(
            f"attention conformance: nothing was checked on {backend_name(config)}: all "
            f"{skipped} item(s) run were skipped (unsupported or not provided; -rs shows why); "
            f"exit code {int(NOTHING_CHECKED_EXIT)}", red=True)


__all__ = ["NOTHING_CHECKED_EXIT", "cell_scope", "checking", "load", "nothing_checked",
           "pytest_addoption", "pytest_collect_file", "pytest_collection_modifyitems",
           "pytest_configure", "pytest_report_header", "pytest_runtest_call",
           "pytest_sessionfinish", "pytest_terminal_summary", "pytest_xdist_make_scheduler",
           "seconds"]
