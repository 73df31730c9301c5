"""Text that fits a width: the terminal report's lines (``--width``, default 100 columns).

``resolve_width(width)``: the width to print at — ``--width N`` or ``DEFAULT_WIDTH``, never
wider than the terminal when stdout is one (``shutil.get_terminal_size``), never below
``MIN_WIDTH``; ``add_width_argument`` gives a command that option. ``fit(text, width)`` wraps
each line that is too wide (``columns``: a CJK character takes two) at spaces, with a hanging
indent; ``fit_code(code, width)`` breaks a long line of Python only where Python allows it (a
comment into comment lines, a trailing comment onto the line above, a statement after a comma
inside brackets), so a reproducer stays runnable; ``panels`` splits a table's columns into
panels that each fit. Standard library only (and ``usage``'s argument type)."""

from __future__ import annotations

import argparse
import io
import shutil
import sys
import textwrap
import tokenize
import unicodedata
from typing import TextIO

from ..usage import at_least

#: The terminal report's width without ``--width``.
DEFAULT_WIDTH = 100
#: The narrowest width the report is laid out for (a narrower terminal gets lines this long).
MIN_WIDTH = 40


def resolve_width(width: int | None = None, stream: TextIO | None = None) -> int:
    """``width`` (``--width N``; None: ``DEFAULT_WIDTH``), at most the terminal's columns when
    ``stream`` (default stdout) is a terminal, at least ``MIN_WIDTH``."""
    stream = sys.stdout if stream is None else stream
    chosen = DEFAULT_WIDTH if width is None else width
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        chosen = min(chosen, shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns)
    return max(chosen, MIN_WIDTH)


def add_width_argument(p: argparse.ArgumentParser, what: str = "report lines") -> None:
    """``--width N`` (at least ``MIN_WIDTH``; None when not given, which ``resolve_width``
    turns into ``DEFAULT_WIDTH`` or the terminal's width): the same option in every command
    that prints; ``what`` names what fits it in the help."""
    p.add_argument("--width", type=at_least(MIN_WIDTH), metavar="N", default=None,
                   help=f"{what} at most N characters (default {DEFAULT_WIDTH}; never wider "
                        f"than the terminal when printing to one)")


def columns(line: str) -> int:
    """How many terminal columns ``line`` takes: two for each wide character (CJK), one for
    any other."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line)


def fit(text: str, width: int | None) -> str:
    """``text`` with each line wider than ``width`` columns (``columns``) wrapped at spaces,
    its continuation lines indented two more than the line (a word longer than the width is
    cut); None: unchanged. Not for runnable code, which must stay as it is."""
    if width is None:
        return text
    out = []
    for line in text.split("\n"):
        wide = columns(line) - len(line)  # a wide character's second column
        if len(line) + wide <= width:
            out.append(line)
            continue
        indent = " " * min(len(line) - len(line.lstrip(" ")), width // 3)
        out += textwrap.wrap(line.strip(), max(width - wide, width // 2), initial_indent=indent,
                             subsequent_indent=indent + "  ", break_on_hyphens=False)
    return "\n".join(out)


def panels(label: int, widths: list[int], width: int | None, gap: int = 1) -> list[list[int]]:
    """The column indices of each panel of a table whose row label is ``label`` characters and
    whose columns are ``widths`` wide, ``gap`` apart: as many columns per panel as fit
    ``width`` (at least one; None: one panel)."""
    out: list[list[int]] = [[]]
    used = label
    for i, w in enumerate(widths):
        if out[-1] and width is not None and used + gap + w > width:
            out.append([])
            used = label
        out[-1].append(i)
        used += gap + w
    return out


def fit_command(line: str, width: int | None) -> str:
    """A line ending in a shell command (``  rerun: python -m conformance …``) within ``width``:
    broken at spaces with a trailing ``\\``, so that the lines pasted together still run as one
    command; None, or a line that fits: unchanged."""
    if width is None or len(line) <= width:
        return line
    lead = line[: len(line) - len(line.lstrip())]
    first, *words = line.lstrip().split()
    lines = [lead + first]
    for word in words:
        if len(lines[-1]) + 1 + len(word) > width - 2:  # room for " \\"
            lines[-1] += " \\"
            lines.append(lead + "    " + word)
        else:
            lines[-1] += " " + word
    return "\n".join(lines)


def _comment(text: str, indent: str, width: int) -> list[str]:
    return textwrap.wrap(text.lstrip("#").strip(), max(width - len(indent) - 2, 20),
                         initial_indent=indent + "# ", subsequent_indent=indent + "# ",
                         break_long_words=False, break_on_hyphens=False) or [indent + "#"]


def _code_line(line: str, width: int) -> list[str]:
    """One line of Python as lines of at most ``width`` where it can be broken safely."""
    indent = line[: len(line) - len(line.lstrip())]
    if line.lstrip().startswith("#"):
        return _comment(line, indent, width)
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line + "\n").readline))
    except (tokenize.TokenError, SyntaxError):
        return [line]  # part of a statement that spans lines: left as it is
    comment = next((t for t in tokens if t.type == tokenize.COMMENT), None)
    if comment is not None:  # the comment goes on its own line(s) above the statement
        code = line[: comment.start[1]].rstrip()
        return _comment(comment.string, indent, width) + _code_line(code, width)
    depth, cuts = 0, []
    for tok in tokens:
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif tok.type == tokenize.OP and tok.string == "," and depth > 0:
            cuts.append(tok.end[1])  # just after the comma
    out, start, prefix = [], 0, ""
    while len(prefix) + len(line) - start > width:
        fitting = [c for c in cuts if c > start and len(prefix) + c - start <= width]
        if not fitting:
            break
        out.append(prefix + line[start:fitting[-1]].strip())
        start, prefix = fitting[-1], indent + "    "
    return out + [prefix + line[start:].strip()] if out else [line]


def fit_code(code: str, width: int | None) -> str:
    """Python source with each line longer than ``width`` broken where Python allows it
    without a backslash: a comment into comment lines, a trailing comment onto its own line(s)
    above, a statement after a comma inside brackets (continuation lines indented four more).
    A line that cannot be broken that way stays as it is; None: unchanged."""
    if width is None:
        return code
    return "\n".join(part for line in code.split("\n")
                     for part in (_code_line(line, width) if len(line) > width else [line]))


__all__ = ["DEFAULT_WIDTH", "MIN_WIDTH", "add_width_argument", "columns", "fit", "fit_code",
           "fit_command", "panels", "resolve_width"]
