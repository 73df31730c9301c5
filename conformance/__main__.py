"""``python -m conformance``: one spec, every implementation, identical seeded inputs.

Subcommands (``run`` is the default)::

    python -m conformance [run] [--backend B ...] [--case NAME ...] [--dtype D ...]
                                [--hypothesis N] [--json F] [--markdown F] [--html F]
                                [--plot DIR] [--verbose] [--width N]
    python -m conformance export DIR            # golden vectors (.npz + manifest)
    python -m conformance check DIR --backend B [--verbose]  # check against them
    python -m conformance spec [...]            # the generated spec document
    python -m conformance walkthrough [--backend numpy|jax|torch|all]  # the article, step by step
    python -m conformance pictures DIR          # attention-weight heatmaps (PNG)
    python -m conformance exercise N --backend B --file F  # grade a learn/ exercise (--list)
    python -m conformance context-parallel [...]  # context parallelism, world sizes 2 and 4
    python -m conformance repeat [...]          # same inputs, same bits (spec.REPEATABLE)
    python -m conformance locate A B [...]      # where two attention blocks part, stage by stage

``--backend`` takes ``numpy``, ``jax``, ``torch``, a peer (``torch.sdpa``, ``torch.MHA``,
``jax.nn``) or the dotted path of your own module (``mypkg.attention``, see ``running.plugins``: its
report is the focused one of ``reporting.terminal``, ``--verbose`` for every cell). Exit code 0 only
when something was checked and every spec/user backend passes, 1 when one fails, 2 when nothing was
checked (every cell n/a, unsupported or not provided: a PASS on nothing is no PASS) and for a
mistake in the command (``usage.UsageError``: an unknown case, backend or golden directory, a named
backend or an option's package that is not installed — printed as one line with the install command,
before any work — or a checked module whose import fails, printed with its traceback). Anything else
is a bug and shows its traceback.

The report's lines fit ``--width N`` columns (100 by default, never wider than the terminal it
prints to: ``textwidth.resolve_width``); ``--help`` lists the subcommands, then ``run``'s
options (the options the README uses). A ``--backend`` that is a file path (``myattn.py``,
``pkg/attention.py``) is told the module name to give (``plugins.file_path_hint``).

To add a subcommand, write ``_add_NAME(parser)`` and ``_cmd_NAME(args)`` and list them in
``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import time
from collections.abc import Callable

from .cases.dtypes import DTYPES
from .comparing.results import Cell, Column, ErrorResult, RunResult
from .reporting.textwidth import resolve_width
from .running.plugins import PluginImportError
from .usage import UsageError, at_least


def _add_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", action="append", metavar="B",
                   help="numpy, jax, torch, a peer name, or a module path (repeatable); "
                        "default: every installed spec backend plus the peers")
    p.add_argument("--case", action="append", metavar="NAME",
                   help="case name or glob pattern (repeatable); default: all; see --list")
    p.add_argument("--dtype", action="append", choices=DTYPES, help="repeatable; default: all")
    p.add_argument("--full", action="store_true",
                   help="the full profile (for CI): every case in every dtype, every installed "
                        "peer, 100 property examples per backend; default: the quick profile, "
                        "the fewest rows that use every spec feature on every backend")
    peers = p.add_mutually_exclusive_group()
    peers.add_argument("--peers", dest="peers", action="store_true", default=None,
                       help="also run the frameworks' kernels (default without --backend)")
    peers.add_argument("--no-peers", dest="peers", action="store_false")
    p.add_argument("--no-errors", action="store_true", help="skip the bad-input checks")
    p.add_argument("--hypothesis", type=at_least(0), metavar="N", default=None,
                   help="N property-based examples per backend (0: none; default: "
                        "100 with --full, else 0)")
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    p.add_argument("--markdown", metavar="FILE", help="write the full report as Markdown")
    p.add_argument("--html", metavar="FILE", help="write one self-contained HTML page to explore "
                   "the report (offline; docs/checking.md, HTML report)")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots (needs matplotlib)")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="every cell, every failing step and each peer's reasons (default: "
                        "the summary and the matrix; a checked module's focused verdict)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    _add_timeout(p)
    _add_width(p)


def _add_width(p: argparse.ArgumentParser) -> None:
    from .reporting.textwidth import DEFAULT_WIDTH, MIN_WIDTH

    p.add_argument("--width", type=at_least(MIN_WIDTH), metavar="N", default=None,
                   help=f"report lines at most N characters (default {DEFAULT_WIDTH}; never "
                        f"wider than the terminal when printing to one)")


def _add_timeout(p: argparse.ArgumentParser) -> None:
    from .running.module_worker import DEFAULT_TIMEOUT_S, seconds_argument

    p.add_argument("--timeout", type=seconds_argument, metavar="S", default=DEFAULT_TIMEOUT_S,
                   help=f"seconds one call of a checked module may take before its cell is a "
                        f"timeout (default {DEFAULT_TIMEOUT_S:g}; 0: no limit)")


def require(module: str, install: str, what: str) -> None:
    """A ``UsageError`` naming the install command when ``module`` is not installed (checked
    before any work)."""
    if importlib.util.find_spec(module) is None:
        raise UsageError(f"{what} needs {module}; install: {install}")


def _cmd_run(args: argparse.Namespace) -> int:
    from .cases import catalogue as cases
    from .peers import PEERS
    from .reporting import json_report, markdown, overview, plots, sections, terminal
    from .running import backends, room, runner

    if args.list:
        for case in cases.CASES:
            print(f"{case.name:<32} {case.kind:<7} {case.description}")
        return 0
    if args.plot:
        require("matplotlib", "pip install matplotlib", "--plot")
    if args.hypothesis:
        require("hypothesis", "pip install hypothesis", "--hypothesis")
    if args.html:
        from .reporting import html

        html.check_path(args.html)
    width = resolve_width(args.width)
    profile = "full" if args.full else "quick"
    # A run that checks a module of the user's gets the focused report, which starts with its
    # verdict: the backends' verdict lines go before the page only.
    known = {*backends.SPEC_BACKENDS, *(p.name for p in PEERS)}
    page = all(name in known for name in args.backend or ())

    def verdict(column: Column, cells: list[Cell], errors: list[ErrorResult]) -> None:
        if page:
            print(overview.backend_verdict(column, cells, errors, seconds_since_start(), width),
                  flush=True)

    result = runner.run(args.backend, args.case, args.dtype, profile=profile, peers=args.peers,
                        check_errors=not args.no_errors, hypothesis=args.hypothesis,
                        timeout=args.timeout, room=room.Ahead if args.full else room.Threads,
                        backend_done=verdict)
    if page and any(c.backend is not None for c in result.columns):
        print(flush=True)
    if not result.columns:
        print(sections.missing_section(result, resolve_width(args.width, sys.stderr)),
              file=sys.stderr)
        print("error: no backend to run", file=sys.stderr)
        return 2
    if args.json:
        json_report.write_json(result, args.json)
    if args.markdown:
        markdown.write_markdown(result, args.markdown)
    if args.html:
        print(f"html: {html.write(result, args.html)}", file=sys.stderr)
    if args.plot:
        written = plots.write_plots(result, args.plot)
        print(f"plots: {len(written)} PNG files in {args.plot}", file=sys.stderr)
    result.seconds = seconds_since_start()  # the report's time: from the command's start
    print(terminal.text(result, args.verbose, width))
    return exit_code(result)


def seconds_since_start() -> float:
    """Wall seconds since this process started (Linux: from ``/proc``; elsewhere since this
    module was imported), so the report's time includes Python's and the frameworks' start."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


def exit_code(result: RunResult) -> int:
    """0 when something was checked and everything checked passed, 1 when a check failed, 2
    (with a one-line reason on stderr) when nothing was checked: a PASS on nothing is no PASS."""
    reason = result.nothing_checked()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    return 0 if result.ok else 1


def _add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="where to write the .npz files and manifest.json")
    p.add_argument("--case", action="append", metavar="NAME", help="case name or glob pattern")
    p.add_argument("--dtype", action="append", choices=DTYPES, help="default: all")


def _cmd_export(args: argparse.Namespace) -> int:
    from . import golden

    files = golden.export(args.directory, args.case, args.dtype)
    print(f"wrote {len(files)} golden cases and manifest.json to {args.directory}")
    return 0


def _add_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="a directory written by `python -m conformance export`")
    p.add_argument("--backend", action="append", metavar="B", required=True,
                   help="numpy, jax, torch or a module path (repeatable)")
    p.add_argument("--case", action="append", metavar="NAME", help="case name or glob pattern")
    p.add_argument("--dtype", action="append", choices=DTYPES)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--markdown", metavar="FILE")
    p.add_argument("--html", metavar="FILE", help="write one self-contained HTML page")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="every cell, every failing step and each peer's reasons (default: "
                        "the summary and the matrix; a checked module's focused verdict)")
    _add_timeout(p)
    _add_width(p)


def _cmd_check(args: argparse.Namespace) -> int:
    from . import golden
    from .reporting import json_report, markdown, terminal

    if args.html:
        from .reporting import html

        html.check_path(args.html)
    result = golden.check(args.directory, args.backend, args.case, args.dtype,
                          timeout=args.timeout)
    print(terminal.text(result, args.verbose, resolve_width(args.width)))
    if args.json:
        json_report.write_json(result, args.json)
    if args.markdown:
        markdown.write_markdown(result, args.markdown)
    if args.html:
        print(f"html: {html.write(result, args.html)}", file=sys.stderr)
    return exit_code(result)


def _add_walkthrough(p: argparse.ArgumentParser) -> None:
    from .teaching import walkthrough

    walkthrough.add_arguments(p)


def _cmd_walkthrough(args: argparse.Namespace) -> int:
    from .teaching import walkthrough

    return walkthrough.main(args)


def _add_pictures(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="where to write the PNG files")


def _cmd_pictures(args: argparse.Namespace) -> int:
    require("matplotlib", "pip install matplotlib", "pictures")
    from .teaching import pictures

    return pictures.main(args)


def _add_exercise(p: argparse.ArgumentParser) -> None:
    from .teaching import exercises

    exercises.add_arguments(p)


def _cmd_exercise(args: argparse.Namespace) -> int:
    from .teaching import exercises

    return exercises.main(args)


def _cmd_spec(argv: list[str]) -> int:
    from .spec import specdoc

    return int(specdoc.main(argv) or 0)


def _cmd_context_parallel(argv: list[str]) -> int:
    from . import context_parallel

    return int(context_parallel.main(argv) or 0)


def _cmd_repeat(argv: list[str]) -> int:
    from .running import repeat

    return int(repeat.main(argv) or 0)


def _cmd_locate(argv: list[str]) -> int:
    from .locating import cli

    return cli.main(argv)


#: name → (add arguments, handler); handlers taking raw argv are listed in RAW_COMMANDS.
COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None],
                          Callable[[argparse.Namespace], int]]] = {
    "run": (_add_run, _cmd_run),
    "export": (_add_export, _cmd_export),
    "check": (_add_check, _cmd_check),
    "walkthrough": (_add_walkthrough, _cmd_walkthrough),
    "pictures": (_add_pictures, _cmd_pictures),
    "exercise": (_add_exercise, _cmd_exercise),
}
#: Subcommands that own their argument parsing: name → handler(argv).
RAW_COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "spec": _cmd_spec, "context-parallel": _cmd_context_parallel, "repeat": _cmd_repeat,
    "locate": _cmd_locate,
}

HELP = {
    "run": "run every case on every backend (default)",
    "export": "write golden vectors (.npz, float64 expected values, checksums)",
    "check": "check an implementation against golden vectors (needs only NumPy)",
    "spec": "print or write the generated spec document",
    "repeat": "check the bitwise-repeat promises (spec.REPEATABLE) of every backend, "
    "sequentially and from several threads at once",
    "context-parallel": "context-parallel attention (ring, all-gather, Ulysses) at world sizes "
    "2 and 4 against the float64 reference; `schedule` draws the ring",
    "walkthrough": "the seed article's worked example, step by step, backends side by side",
    "pictures": "write attention-weight heatmaps (PNG) for every mask type (needs matplotlib)",
    "exercise": "grade your answer to an exercise of learn/ (build attention step by step)",
    "locate": "where two attention blocks part: the first stage whose error exceeds the "
    "tolerance, per position, on the smallest input (docs/checking.md)",
}


def parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand; its ``--help`` ends with ``run``'s options
    (``run`` is the default subcommand, and its options are the ones the README uses)."""
    p = argparse.ArgumentParser(prog="python -m conformance", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", title="subcommands", metavar="SUBCOMMAND")
    for name, (add, _) in COMMANDS.items():
        add(sub.add_parser(name, help=HELP.get(name), description=HELP.get(name)))
    for name in RAW_COMMANDS:
        sub.add_parser(name, help=HELP.get(name), add_help=False)
    run_help = sub.choices["run"].format_help()
    options = re.split(r"\n(?:options|optional arguments):\n", run_help, maxsplit=1)[-1]
    p.epilog = ("options of run, the default subcommand (the others: SUBCOMMAND --help):\n"
                + options)
    p.usage = "%(prog)s [SUBCOMMAND] [options]"  # after the subcommands took their prog
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 with a one-line message for a ``UsageError``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in RAW_COMMANDS:
            return RAW_COMMANDS[argv[0]](argv[1:])
        if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
            argv = ["run", *argv]
        args = parser().parse_args(argv)
        return COMMANDS[args.command][1](args)
    except UsageError as exc:
        if isinstance(exc, PluginImportError):
            print(exc.traceback, file=sys.stderr, end="")
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _exit_quietly_on_broken_pipe() -> int:
    """``main()``; a reader that stops early (``| head``) ends the output without a traceback."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's recipe: point stdout at devnull so the interpreter's final flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code


if __name__ == "__main__":
    sys.exit(_exit_quietly_on_broken_pipe())
