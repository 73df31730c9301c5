"""The terminal report: ``text(result, verbose, width)``, the one renderer of a run as text.

It prints one of three views, every line within ``width`` columns (``--width``, 100 by default)
but a runnable reproducer's code, which stays runnable (a long line is wrapped at spaces,
``textwidth.fit``; tables continue in panels, ``textwidth.panels``):

* **the page** (``page``), a run of the spec backends and peers. The command line prints each
  spec backend's verdict before it (``overview.backend_verdict``: PASS or FAIL, its counts,
  the diagnoses and one rerun command), as soon as the backend's cells and bad inputs are
  done and before the peers run. Then, in this order:

  1. **summary**: one row per column (backend or peer): its key in the matrix, how many of its
     cells are ok, known, unexpected, n/a, failing (FAIL, error or timeout) and not checked
     (unsupported or not provided), and the worst ratio r of its ok cells (``R_LEGEND``);
  2. **the matrix**: one row per case, one cell per column, one glyph per dtype in the run's
     dtype order (one row per case × dtype, one glyph, when the rows are not every case in
     every dtype: the quick profile) (``GLYPHS``, whose legend comes once, above it); a
     column's header is its key (``KEYS`` for the project's columns, else derived from the
     name, ``column_keys``), which the summary maps to the name;
  3. the failing cells of the spec/user backends, step by step, then the peers' unexpected
     cells (the first ``MAX_FAILURES`` of each, the others counted; ``--verbose``: all);
  4. **the known differences**, each once over every peer (``spec.KNOWN_DIFFERENCES`` grouped
     by their ``short`` name): what differs, the alternative semantics that explain it, and per
     peer the cells it explains and their worst distance to the alternative (a cell explained
     by two entries counts under both); each peer's reason (``why``) is ``--verbose``'s;
  5. the bad-input line, the property checks, the missing packages and the summary line(s),
     whose last line starts with ``PASS:`` or ``FAIL:`` (``sections.summary_lines``), and in
     the quick profile what ``--full`` adds (``overview.profile_lines``);

* **the full report** (``full``, ``--verbose``): every cell's text (``sections.cell_text``) in a
  table of ``case dtype`` rows (``full_table``), every failing step, each peer's known
  differences with their reasons;

* **the focused report** (``focused``) of a run that checks a module of the user's ("plugin";
  ``running.plugins``), in this order:

  1. a one-line verdict that names each bug (the diagnosis of each group of failures,
     ``groups``), the failing bad inputs by kind (``sections.bad_inputs_text``) and failing
     property checks (``headline``);
  2. per group of failing cells (the first ``groups.MAX_GROUPS``): the features it involves,
     the cases and dtypes, the first failure explained, the smallest failing case ``shrink``
     finds as a runnable script, and the rerun command (``explain_group``); a wrong layout,
     found by rerunning (``groups.layout_symptoms``), is one group that names the fix;
  3. a compact table: one row per case, one column per backend, each cell summarised over the
     dtypes (``ok 0.31``, ``FAIL f16``, ``unsupported``; ``case_table``);
  4. per checked module: the features checked, those declared unsupported, the functions it
     does not provide (once, never as failures; ``contract_section``); the bad-input and
     property lines;
  5. the summary line (``PASS: …`` / ``FAIL: …``) of ``sections.summary``.

  With ``--verbose``: the full report followed by item 4.
"""

from __future__ import annotations

from ..comparing.results import RunResult
from .focused import focused
from .groups import checked_columns
from .overview import full, page
from .textwidth import DEFAULT_WIDTH


def text(result: RunResult, verbose: bool = False, width: int = DEFAULT_WIDTH) -> str:
    """The report of ``result``: ``focused`` when it checks a module, else ``page``
    (``verbose``: ``full``); each line within ``width`` but runnable code."""
    if checked_columns(result):
        return focused(result, verbose, width)
    return full(result, width) if verbose else page(result, width)


__all__ = ["text"]
