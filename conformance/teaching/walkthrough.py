"""``python -m conformance walkthrough``: the seed article's worked example, step by step.

The article (``docs/seed_article.md``) builds self-attention from a 6-token sentence, 3-d
embeddings and tiny weights, and prints every intermediate. This command redoes each step in
every requested backend, prints the values side by side and marks, per row and per step, whether
each backend agrees with a float64 computation within the spec's float32 tolerance
(``spec.TOLERANCES``: ``|x - ref| <= atol + rtol·|ref| + k·e``, ``e`` the error of a naive
float32 pipeline on the same inputs, as in the conformance harness). It also checks every number
the article prints, and says where the article's own numbers are inconsistent
(``seed_example.ARTICLE_INCONSISTENT``).

Weights: numpy_attn and jax_attn load the article's weights from ``seed_example``; torch_attn
draws them itself with ``torch.manual_seed(123)`` and the module constructor, as the article does,
and the walkthrough shows that the bits are identical. No jit: every JAX call runs eagerly.

What is computed lives in ``conformance.teaching.walkthrough_steps``; this module prints it.
Everything heavy is imported inside the functions (``import conformance`` stays NumPy-only).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

import numpy as np

from .. import spec
from ..comparing.compare import compare
from ..reporting.textwidth import add_width_argument, fit, panels, resolve_width
from ..running import backends
from ..spec import seed_example
from ..spec.seed_example import ARTICLE, ARTICLE_INCONSISTENT
from ..usage import UsageError
from .walkthrough_steps import (
    BACKENDS,
    DTYPE,
    SECTIONS,
    Step,
    article_inputs,
    claim_numbers,
    expected_values,
    run_backend,
)

# ------------------------------------------------------------------------------ printing


def _marks() -> tuple[str, str]:
    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "✓✗ω√−₂".encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return "ok", "XX"
    return "✓", "✗"


def _fmt(v: float) -> str:
    if np.isneginf(v):
        return "-inf"
    if np.isnan(v):
        return "nan"
    return f"{v:.4f}"


def _fitted(lines: list[str], width: int) -> list[str]:
    """``lines`` with each one longer than ``width`` wrapped at spaces (``textwidth.fit``), so a
    number is never cut."""
    return fit("\n".join(lines), width).split("\n")


def _rule(width: int) -> str:
    return "═" * min(78, width)


#: The width of one printed value (``_fmt`` right-justified).
VALUE_W = 8


def _row_text(values: np.ndarray) -> str:
    return "".join(_fmt(v).rjust(VALUE_W) for v in values)


def _ratio(step: Step, actual: np.ndarray, expected: np.ndarray, baseline: float,
           zeros: np.ndarray | None) -> float:
    return compare(step.key, actual, expected, baseline, DTYPE, zeros).ratio


def _article_check(got: np.ndarray, printed: np.ndarray) -> tuple[int, float]:
    """How many of the printed numbers the result rounds to (±1 in the 4th decimal)."""
    diff = np.abs(np.round(got.astype(np.float64), seed_example.PRINTED_DECIMALS) - printed)
    return int((diff <= seed_example.PRINTED_ATOL_FLOAT32).sum()), float(diff.max())


def _side_by_side(step: Step, results: dict[str, np.ndarray], marks: dict[str, list[str]],
                  label_w: int, block_w: int) -> list[str]:
    """The table with one block of columns per backend (``block_w`` wide), side by side."""
    names = list(results)
    lines = [(" " * label_w + "".join(n.center(block_w) for n in names)).rstrip()]
    if step.cols:
        cols = "".join(c[:VALUE_W - 1].rjust(VALUE_W) for c in step.cols) + "   "
        lines.append((" " * label_w + cols * len(names)).rstrip())
    for i, row in enumerate(step.rows):
        text = "    " + row.ljust(label_w - 4)
        for n in names:
            text += _row_text(results[n][i]) + " " + marks[n][i].ljust(2)
        lines.append(text.rstrip())
    return lines


def _one_per_line(step: Step, results: dict[str, np.ndarray], marks: dict[str, list[str]],
                  label_w: int, width: int) -> list[str]:
    """The table with one line per row and backend; where a row's values do not fit
    ``width``, its columns continue in further panels (``textwidth.panels``), each value
    whole, the row's mark after its last column."""
    names = list(results)
    name_w = max(len(n) for n in names) + 2
    ncols = len(results[names[0]][0])
    mark_w = 1 + max(len(m) for m in _marks())
    chunks = panels(label_w + name_w, [VALUE_W] * ncols, width - mark_w, gap=0)
    lines = []
    for cols in chunks:
        if len(chunks) > 1:
            lines.append(f"    column {cols[0] + 1} of {ncols}" if len(cols) == 1
                         else f"    columns {cols[0] + 1}–{cols[-1] + 1} of {ncols}")
        if step.cols:
            lines.append(" " * (label_w + name_w)
                         + "".join(step.cols[c][:VALUE_W - 1].rjust(VALUE_W) for c in cols))
        for i, row in enumerate(step.rows):
            for j, n in enumerate(names):
                label = ("    " + row).ljust(label_w) if j == 0 else " " * label_w
                mark = " " + marks[n][i] if cols is chunks[-1] else ""
                lines.append(label + n.ljust(name_w) + _row_text(results[n][i][cols]) + mark)
    return lines


def _vector(values: Iterable[float]) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"


def render_step(step: Step, results: dict[str, np.ndarray], expected: np.ndarray,
                baseline: float, width: int) -> list[str]:
    """The lines of one step, each within ``width``: values per backend side by side where
    they fit, else one line per backend (in panels of columns where even that is too wide),
    the marks, and the article's numbers this step checks."""
    ok, bad = _marks()
    names = list(results)
    lines = [f"  ▸ {step.heading}", f"    {step.call}"]
    lines += [f"    · {note}" for note in step.notes]
    label_w = max(len(r) for r in step.rows) + 5
    zeros = step.zeros
    marks = {n: [ok if _ratio(step, results[n][i], expected[i], baseline,
                              None if zeros is None else zeros[i]) <= 1 else bad
                 for i in range(expected.shape[0])] for n in names}
    block_w = VALUE_W * expected.shape[-1] + 3
    if label_w + block_w * max(len(names), 1) <= width:
        lines += _side_by_side(step, results, marks, label_w, block_w)
    else:
        lines += _one_per_line(step, results, marks, label_w, width)
    tol = spec.TOLERANCES[DTYPE]
    parts = []
    for n in names:
        worst = _ratio(step, results[n], expected, baseline, zeros)
        parts.append(f"{n} {ok if worst <= 1 else bad} {worst:.2g}")
    lines.append(f"    vs float64 (|Δ| ≤ {tol['atol']:g} + {tol['k']:g}·{baseline:.1e}, "
                 f"worst |Δ|/bound): " + ", ".join(parts))
    if step.article:
        printed = np.array(ARTICLE[step.article], np.float64)
        parts, off = [], []
        for n in names:
            good, _ = _article_check(results[n], printed)
            parts.append(f"{n} {ok if good == printed.size else bad} {good}/{printed.size}")
            rounded = np.round(results[n].astype(np.float64), seed_example.PRINTED_DECIMALS)
            for i, j in np.argwhere(np.abs(rounded - printed) > 0.5e-4):  # not the same 4 decimals
                off.append((int(i), int(j)))
        lines.append("    the article prints these numbers (4 decimals): " + ", ".join(parts))
        for i, j in sorted(set(off)):
            got = ", ".join(f"{n} {results[n][i, j]:.6f}" for n in names)
            lines.append(f"      note: row {step.rows[i]!r}, column {j} is printed "
                         f"{printed[i, j]:.4f}; float64 gives {expected[i, j]:.8f}, float32 here "
                         f"{got} (one unit in the 4th decimal, allowed)")
    for key, row in step.inconsistent:
        entry = ARTICLE_INCONSISTENT[key]
        vec = _vector(entry["printed"])
        if np.allclose(entry["printed"], expected[row], atol=seed_example.PRINTED_ATOL_FLOAT32):
            lines.append(f"    {bad} the article's remark on row {step.rows[row]!r} {vec}: "
                         f"the row is right, the remark is not")
        else:  # the sentence broken at its ";": each vector on a line of its own where it fits
            lines += [f"    {bad} the article prints {vec} for query 3 ({step.rows[row]!r});",
                      f"      its own setup gives {_vector(expected[row])}"]
        lines.append(f"      why ({key}): {entry['why']}")
    return _fitted(lines, width)


def claim_lines(step: Step, numbers: dict[str, dict[str, float | int]], width: int) -> list[str]:
    """The lines of the article's claims that a step's float64 numbers contradict: the claim,
    the numbers recomputed here (``walkthrough_steps.claim_numbers``), and why; each within
    ``width``."""
    _, bad = _marks()
    lines = []
    for key in step.claims:
        entry = ARTICLE_INCONSISTENT[key]
        found = "; ".join(f"{name}: {value:g}" for name, value in numbers[key].items())
        lines += [f"    {bad} the article says “{entry['claim']}”; its own numbers: {found}",
                  f"      why ({key}): {entry['why']}"]
    return _fitted(lines, width) if lines else []


def _identity_lines(results: dict[str, dict[str, np.ndarray]]) -> list[str]:
    """torch drew its weights itself: are they the bits seed_example holds?"""
    if "torch" not in results:
        return []
    ok, bad = _marks()
    inputs = article_inputs()
    names = ["embedding", "W_query", "W_key", "W_value", "x_2",
             *(n for n in inputs if n.startswith("heads."))]
    same = [n for n in names if np.array_equal(results["torch"][n], inputs[n])]
    differ = [n for n in names if n not in same]
    mark = ok if not differ else bad
    text = (f"  {mark} torch drew the embedding, SelfAttention/CrossAttention weights, the 4 "
            f"wrapper heads and second_input itself (torch.manual_seed(123) + constructors): "
            f"{len(same)}/{len(names)} arrays bit-identical to seed_example")
    lines = [text]
    if differ:
        lines.append(f"    differ: {', '.join(differ)}")
    return lines


def walkthrough(names: list[str], width: int) -> tuple[list[str], bool]:
    """The printed lines, each within ``width`` (a narrower one than ``textwidth.MIN_WIDTH``
    may leave a table wider), and whether every available backend agreed everywhere."""
    ok, bad = _marks()
    lines = ["Attention, step by step: the seed article's worked example "
             "(docs/seed_article.md)", ""]
    results: dict[str, dict[str, np.ndarray]] = {}
    for n in names:
        b = backends.get(n)
        if not b.available():
            lines.append(f"  {n}: not installed — {b.install}")
            continue
        try:
            results[n] = run_backend(n)
        except Exception as exc:  # noqa: BLE001 - a failing backend is a result
            lines.append(f"  {n}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    expected, baseline = expected_values()
    numbers = claim_numbers(expected)
    dc = seed_example.DICTIONARY
    code_words = seed_example.CODE_SENTENCE.split()
    code_dc = {w: i for i, w in enumerate(sorted(code_words))}
    tol = spec.TOLERANCES[DTYPE]
    lines += [
        f"backends: {', '.join(results) or 'none'}; dtype {DTYPE}; each compared with a float64 "
        f"computation on the same inputs",
        f"mark {ok}: |x − float64| ≤ atol + k·e (spec.TOLERANCES['float32']: atol "
        f"{tol['atol']:g}, k {tol['k']:g}; e = error of a naive float32 pipeline)",
        "",
        _rule(width),
        "0. 句子与字典 · the sentence, the dictionary, the token ids",
        _rule(width),
        f"  the article's code:  sentence = {seed_example.CODE_SENTENCE!r}",
        f"    dc = {code_dc}",
        f"    sentence_int = {[code_dc[w] for w in code_words]}",
        f"  {bad} but every number the article prints comes from "
        f"{seed_example.SENTENCE!r}:",
        f"    dc = {dc}",
        f"    sentence_int = {seed_example.TOKEN_IDS}",
        "    (the code's sentence gives other ids, so its embedding rows would be permuted)",
        "",
    ]
    lines += _identity_lines(results)
    all_ok = bool(results)
    for title, steps in SECTIONS:
        lines += [_rule(width), title, _rule(width)]
        for step in steps:
            shown = {n: r[step.key] for n, r in results.items()}
            if not shown:
                continue
            lines += render_step(step, shown, expected[step.key], baseline[step.key], width)
            lines += claim_lines(step, numbers, width)
            lines.append("")
            for n in shown:
                worst = _ratio(step, shown[n], expected[step.key], baseline[step.key],
                               step.zeros)
                all_ok &= worst <= 1
    if results:
        one = next(iter(results.values()))
        gap = float(np.abs(one["renormalized"].astype(np.float64)
                           - one["causal_weights"]).max())
        lines.append(f"  the two causal methods differ by at most {gap:.1e} "
                     f"({next(iter(results))}, float32)")
    summary = ok if all_ok else bad
    lines += ["", f"{summary} every step of every backend "
              f"{'agrees' if all_ok else 'does NOT agree'} with float64 within spec.TOLERANCES"
              f"['float32']; article inconsistencies: {', '.join(ARTICLE_INCONSISTENT)} "
              f"(docs/seed_article.md)"]
    return _fitted(lines, width), all_ok


# ------------------------------------------------------------------------------ CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m conformance walkthrough``."""
    p.add_argument("--backend", action="append", choices=[*BACKENDS, "all"],
                   help="numpy, jax, torch or all (repeatable; default: all)")
    add_width_argument(p, "lines (backends side by side where they fit)")


def main(args: argparse.Namespace) -> int:
    """Print the walkthrough; exit code 0 when every available backend agrees everywhere."""
    chosen = args.backend or ["all"]
    names = list(BACKENDS) if "all" in chosen else list(dict.fromkeys(chosen))
    missing = [n for n in names if not backends.get(n).available()]
    if missing and len(missing) == len(names):  # nothing to show: one line, exit 2
        raise UsageError(f"walkthrough --backend {missing[0]} needs {missing[0]}; install: "
                         f"{backends.get(missing[0]).install}")
    lines, all_ok = walkthrough(names, resolve_width(args.width))
    text = "\n".join(lines)
    try:
        print(text)
    except UnicodeEncodeError:  # a terminal without UTF-8
        print(text.encode("ascii", "replace").decode("ascii"))
    return 0 if all_ok else 1


__all__ = ["add_arguments", "article_inputs", "expected_values", "main", "run_backend",
           "walkthrough"]
