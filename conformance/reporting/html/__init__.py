"""``python -m conformance --html report.html``: one self-contained page to explore a run.

The page (``page.render``) works offline from the file alone — no server, CDN or web font:
its CSS, JS and data are inline and its pictures are ``data:`` URIs. It shows

* the verdict and the summary line — for a failing run each group of failing cells by its
  diagnosis (``groups.groups``, as the terminal report groups them) with a rerun command, and
  the failing bad inputs and property checks — then per column (backends and peers) its key
  and how many cells are ok, known, n/a, unsupported, not provided or failing;
* the matrix as a colour grid — a row per case, per backend or peer a group of compact cells,
  one per dtype, each with a glyph as well as a colour (a known difference its own slate blue,
  neither ok's green nor a failure's red) — headed by the column's short key
  (``overview.column_keys``, the terminal report's), its full name on hover and in the key
  list under the grid: the full run's (``--full``) 18 columns of 4 dtypes fit 1,400 px; filters:
  by column, by dtype, by status, and a text filter on case names (rows with no cell left are
  hidden);
* on a click (or Enter) on a cell, in a panel docked at the bottom of the window (Esc closes
  it): every step against its tolerance (ratio, index, actual, float64 expected, bound, why),
  the diagnosis, the features the case uses; for a peer's known or unexpected cell the entries
  of ``spec.KNOWN_DIFFERENCES`` (the difference, the alternative semantics and what it means,
  the cause; the steps it explains shaded as known, not failed) and the distance to the
  alternative; for a failing
  cell of a checked backend the smallest failing case of its group as a runnable script and the
  command that reruns the cell; the case's heatmap of the float64 weights;
* the known differences once each, the bad inputs that failed, the property checks (with their
  reproducers), the missing packages, and the error-vs-tolerance plot of every column;
* the seed article's example (``article.example``): its plain and causal weights, each cell's
  score ω, scaled score and weight (float64) shown when the pointer is over it.

``write(result, path)`` computes it (``data.page_data``, ``pictures.embed``) and writes it;
``check_path`` validates ``--html FILE`` before a run starts.
"""

from __future__ import annotations

from pathlib import Path

from ...comparing.results import RunResult
from ...usage import UsageError
from . import data, page, pictures


def check_path(path: str | Path) -> Path:
    """``--html FILE`` checked before any work: its folder exists and it is not a folder;
    a ``UsageError`` naming the option otherwise."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"--html {path}: is a directory; give a file name (report.html)")
    if not target.parent.is_dir():
        raise UsageError(f"--html {path}: the directory {target.parent} does not exist")
    return target


def render(result: RunResult, *, with_pictures: bool = True) -> str:
    """The page of ``result`` as one HTML string (``with_pictures`` False: no plots drawn)."""
    pics = pictures.embed(result) if with_pictures else None
    return page.render(data.page_data(result, pics))


def write(result: RunResult, path: str | Path, *, with_pictures: bool = True) -> Path:
    """Write the page of ``result`` to ``path`` (UTF-8); returns the path."""
    target = check_path(path)
    target.write_text(render(result, with_pictures=with_pictures), encoding="utf-8")
    return target


__all__ = ["check_path", "render", "write"]
