"""``--markdown FILE``: the report as Markdown (the summary, the table of every cell, then the
failures, known differences, bad inputs and missing packages as text blocks).
"""

from __future__ import annotations

from pathlib import Path

from ..comparing.results import RunResult
from .sections import cell_text, errors_section, failures, known_section, missing_section, summary


def write_markdown(result: RunResult, path: str | Path) -> None:
    """``--markdown FILE``: the table as Markdown, then failures, known differences, errors."""
    grid = {(c.case, c.dtype, c.column): c for c in result.cells}
    names = [c.name for c in result.columns]
    lines = ["# Conformance report", "", summary(result), "",
             "| case | dtype | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    for case, dtype in result.rows:
        cells = [cell_text(grid[(case, dtype, n)], 200).replace("|", "\\|")
                 if (case, dtype, n) in grid else "" for n in names]
        lines.append(f"| {case} | {dtype} | " + " | ".join(cells) + " |")
    for title, body in (("Failures", failures(result)), ("Known differences",
                                                          known_section(result)),
                        ("Errors", errors_section(result)), ("Missing", missing_section(result))):
        if body:
            lines += ["", f"## {title}", "", "```", body, "```"]
    Path(path).write_text("\n".join(lines) + "\n")


__all__ = ["write_markdown"]
