"""The terminal report fits its width: the default report of every column, case and dtype (and
``--verbose``, and a checked module's verdict) has no line over 100 characters, ``--width`` and
the terminal's width set it, reproducers stay runnable when broken; beside it what a new user
meets first: one install line per missing package, the progress bar, ``--help``, a file path
given to ``--backend``, and what ``requirements.txt`` installs.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
from harness_helpers import _expected

from conformance import peers, spec
from conformance.__main__ import main
from conformance.cases import catalogue as cases
from conformance.comparing.compare import StepResult
from conformance.comparing.results import (
    BackendProperties,
    Cell,
    Column,
    ErrorResult,
    PropertyResult,
    RunResult,
)
from conformance.reporting import overview, sections, terminal
from conformance.reporting.textwidth import fit_code, resolve_width
from conformance.running import backends, progress, runner

ROOT = Path(__file__).resolve().parents[1]
LONG = ("the implementation treats True as 'masked out' where the spec's True means 'may "
        "attend', and fully masked rows give the mean of value rather than 0 " * 3).strip()
#: A reproducer with lines no terminal holds: a comment, a call, an array literal.
SCRIPT = "\n".join([
    "# " + LONG,
    "import numpy as np",
    "values = np.array([" + ", ".join(f"{i / 7:.15f}" for i in range(24)) + "])  # " + LONG,
    "total = float(np.sum(values, axis=0, keepdims=False, dtype=np.float64, where=values > -1,"
    " initial=0.0))",
    "print('total:', round(total, 6))",
])
#: The statuses the synthetic cells cycle through, per kind of column.
BACKEND_STATUSES = ("ok", "ok", "FAIL", "error", "timeout", "ok", "unsupported", "not provided")
PEER_STATUSES = ("ok", "known", "n/a", "unexpected", "ok", "known")


def _synthetic_cell(case: str, dtype: str, column: str, i: int) -> Cell:
    """A cell of every status there is, with long texts where a report prints them."""
    peer = column not in backends.SPEC_BACKENDS
    status = (PEER_STATUSES if peer else BACKEND_STATUSES)[i % (6 if peer else 8)]
    if status == "known" and not spec.KNOWN_DIFFERENCES.get(column):
        status = "ok"  # a peer without known differences (transformers.gpt_oss) is never known
    cell = Cell(case, dtype, column, status, ratio=0.37 if status == "ok" else None,
                spec_backend=not peer,
                rerun=f"python -m conformance --case {case} --dtype {dtype} --backend {column}")
    if status == "FAIL":
        cell.ratio = 3.1e4
        cell.steps = [StepResult("masked_scores", 3.1e4, False, (0, 1, 2, 3), -1e30, 0.243779,
                                 1.7e-6, note=LONG)]
        cell.reasons = [LONG]
    elif status in ("error", "timeout"):
        cell.detail = "RuntimeError: " + LONG
    elif status == "known":
        shorts = [e.get("short", e["differs"]) for e in spec.KNOWN_DIFFERENCES.get(column, [])]
        cell.alternatives, cell.alternative_ratio = tuple(shorts[i % len(shorts):][:1]), 0.12
        cell.detail = f"{cell.alternatives[0]} (0.12)"
    elif status == "unexpected":
        cell.ratio, cell.alternative_ratio = 2.0e3, 40.0
        cell.detail = "fails the spec (2e+03); no entry of spec.KNOWN_DIFFERENCES explains " + LONG
        cell.steps = [StepResult("output", 2.0e3, False, (0, 0), 1.0, 0.5, 1e-6, note=LONG)]
    return cell


def full_result() -> RunResult:
    """Every column (the spec backends and every peer) × every case × every dtype: the real
    cells of a small numpy run where it has them, synthetic cells of every status elsewhere;
    failing bad inputs, a failing property check with its reproducer, missing packages, a
    note."""
    real = runner.run(["numpy"], ["padding", "causal_bottom_right"], ["float32"], peers=False,
                      check_errors=False, hypothesis=0, progress=False)
    names = [*backends.SPEC_BACKENDS, *(p.name for p in peers.PEERS)]
    rows = [(c.name, d) for c in cases.CASES for d in backends.DTYPES]
    got = {(c.case, c.dtype, c.column): c for c in real.cells}
    cells = [got.get((case, dtype, name)) or _synthetic_cell(case, dtype, name, i + j)
             for i, (case, dtype) in enumerate(rows) for j, name in enumerate(names)]
    columns = [Column(n, "backend" if n in backends.SPEC_BACKENDS else "peer") for n in names]
    errors = [ErrorResult("ragged_mask", "torch", "ValueError", "RuntimeError", LONG, False,
                          problem="raised RuntimeError, not ValueError"),
              ErrorResult("bad_dtype", "jax", "TypeError", "TypeError", "fine", True)]
    props = PropertyResult(100, [BackendProperties("numpy", 100, worst_ratio=0.3),
                                 BackendProperties("jax", 7, failure=LONG, reproducer=SCRIPT,
                                                   failure_ratio=3.8e11, shrink_calls=64)])
    return RunResult(columns, cells, {"ghost.attention": "pip install ghost-" + "x" * 120},
                     rows, errors=errors, properties=props, seconds=81.2, notes=[LONG])


def _too_long(text: str, width: int) -> list[str]:
    return [line for line in text.splitlines() if len(line) > width]


@pytest.fixture(scope="module")
def full() -> RunResult:
    return full_result()


def test_default_report_of_every_column_case_and_dtype_fits_100_columns(full: RunResult) -> None:
    out = terminal.text(full)  # what `python -m conformance` prints (no checked module)
    assert _too_long(out, 100) == []
    lines = out.splitlines()
    assert lines[-1].startswith("FAIL: ") and "backend cells pass" in lines[-1]
    # a summary first: one row per column, its counts as the cells say
    keys = overview.column_keys([c.name for c in full.columns])
    for col in full.columns:
        row = next(line for line in lines if line.startswith(col.name + " "))
        mine = [c.status for c in full.cells if c.column == col.name]
        numbers = [int(n) for n in row[len(col.name):].split()[1:7]]
        assert row.split()[1] == keys[col.name]
        assert numbers == [mine.count("ok"), mine.count("known"), mine.count("unexpected"),
                           mine.count("n/a"), sum(mine.count(s) for s in ("FAIL", "error",
                                                                           "timeout")),
                           mine.count("unsupported") + mine.count("not provided")], col.name
    # the matrix: one row per case per panel, one glyph per dtype, as the cells say
    glyph = {(c.case, c.dtype, c.column): overview.GLYPHS[c.status] for c in full.cells}
    heads = [i for i, line in enumerate(lines) if line.startswith("case ")]
    assert heads and all(len(lines[h + 1 + k].split()) > 1 for h in heads
                         for k in range(len(cases.CASES)))
    shown = {}
    for h in heads:
        shown_keys = lines[h].split()[1:]
        for k, case in enumerate(cases.CASES):
            row = lines[h + 1 + k]
            assert row.startswith(case.name + " ")
            for key, text in zip(shown_keys, row[len(case.name):].split(), strict=True):
                shown[(case.name, key)] = text
    for case in cases.CASES:
        for name in keys:
            want = "".join(glyph[(case.name, d, name)] for d in backends.DTYPES)
            assert shown[(case.name, keys[name])] == want, (case.name, name)
    # the first failing backend cells and unexpected peer cells step by step, the rest counted
    failing = [c for c in full.cells if c.spec_backend and c.status in ("FAIL", "error",
                                                                         "timeout")]
    assert sum(line.startswith("FAIL: ") and " · " in line for line in lines) == \
        overview.MAX_FAILURES
    assert f"… and {len(failing) - overview.MAX_FAILURES} more failing cells: --verbose" in out
    unexpected = sum(c.status == "unexpected" for c in full.cells)
    assert out.count("peer differs (unexpected, not counted): ") == overview.MAX_FAILURES
    assert f"… and {unexpected - overview.MAX_FAILURES} more unexpected peer cells" in out
    # each known difference once
    met = {s for c in full.cells if c.status == "known" for s in c.alternatives}
    for short in met:
        assert sum(line.startswith(f"  {short}: ") for line in lines) == 1, short


def test_verbose_and_narrow_reports_fit_too(full: RunResult) -> None:
    verbose = terminal.text(full, verbose=True)
    assert _too_long(verbose, 100) == []
    assert "why: " + LONG[:40] in verbose  # today's detail: each failing step's diagnosis
    for width in (60, 140):
        assert _too_long(terminal.text(full, width=width), width) == []
        assert _too_long(terminal.text(full, verbose=True, width=width), width) == []


def test_a_broken_reproducer_keeps_its_meaning() -> None:
    """``fit_code`` breaks only where Python allows: the same program, line for line."""
    for width in (100, 60):
        fitted = fit_code(SCRIPT, width)
        assert _too_long(fitted, width) == []
        assert ast.dump(ast.parse(fitted)) == ast.dump(ast.parse(SCRIPT))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(fitted, "<fitted>", "exec"), {})
        assert printed.getvalue() == f"total: {round(sum(i / 7 for i in range(24)), 6)}\n"


def test_width_option_and_the_terminal(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(shutil, "get_terminal_size",
                        lambda fallback=(100, 24): shutil.os.terminal_size((72, 24)))
    assert resolve_width(None, io.StringIO()) == 100
    assert resolve_width(160, io.StringIO()) == 160  # piped: as wide as asked
    assert resolve_width(160, Tty()) == 72 and resolve_width(None, Tty()) == 72
    args = ["--backend", "numpy", "--case", "causal_bottom_right_q_longer", "--dtype", "float32",
            "--no-errors"]
    assert main([*args, "--width", "50"]) == 0
    out = capsys.readouterr().out
    assert _too_long(out, 50) == [] and "causal_bottom_right_q_longer" in out
    with pytest.raises(SystemExit) as stop:  # below the narrowest layout: argparse's error
        main([*args, "--width", "10"])
    assert stop.value.code == 2 and "argument --width" in capsys.readouterr().err


def test_verdict_of_a_checked_module_fits_and_its_scripts_still_run(
        capsys: pytest.CaptureFixture) -> None:
    args = ["--backend", "examples.wrong_attention", "--case", "padding", "--case",
            "causal_bottom_right", "--dtype", "float32", "--no-errors"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert _too_long(out, 100) == []
    headline = " ".join(out.split("\n\n")[0].split())  # wrapped, it reads as before
    assert headline.startswith("FAIL: examples.wrong_attention: ")
    assert sorted(headline.split(": ", 2)[2].split("; ")) == [
        "mask polarity flipped (1 case)", "wrong causal alignment (1 case)"]
    scripts = [textwrap.dedent(block.split("\n   rerun:")[0])
               for block in out.split("runnable:\n")[1:]]
    assert len(scripts) == 2
    for script in scripts:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(script, "<reproducer>", "exec"), {})
        actual, expected = (line.split(":", 1)[1] for line in printed.getvalue().splitlines())
        assert actual.strip() != expected.strip()  # still reproduces the difference
    reruns = {" ".join(r.replace("\\\n", " ").split())  # the shell joins a broken line
              for r in re.findall(r"rerun: ((?:.*\\\n)*.*)", out)}
    assert reruns == {f"python -m conformance --case {case} --dtype float32 --backend "
                      f"examples.wrong_attention" for case in ("padding", "causal_bottom_right")}
    assert any(line.endswith(" \\") for line in out.splitlines())  # one of them is broken


def _missing_lines(monkeypatch: pytest.MonkeyPatch, hidden: list[str],
                   missing: dict[str, str]) -> list[str]:
    for name in hidden:  # importlib.util.find_spec gives None: not installed
        monkeypatch.setitem(sys.modules, name, None)
    return sections.missing_section(RunResult([], [], missing, [])).splitlines()


def test_one_install_line_per_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a NumPy-only machine: what the runner records (each column's own hint), reported as
    one line per package, torch's once; with torch installed, no torch hint."""
    frameworks = ["torch", "jax", "keras", "flax", "transformers", "onnx", "onnxruntime"]
    numpy_only = {"jax": backends.get("jax").install, "torch": backends.get("torch").install,
                  **{p.name: p.install for p in peers.PEERS},
                  "hypothesis": "pip install hypothesis (for the property checks)"}
    with monkeypatch.context() as m:
        lines = _missing_lines(m, [*frameworks, "hypothesis"], numpy_only)
    packages = [line.split()[1] for line in lines if line.startswith("missing: ")]
    assert sorted(packages) == sorted([*frameworks, "hypothesis"])  # each once
    torch_lines = [line for line in lines if "torch==" in line]
    assert len(torch_lines) == 1 and torch_lines[0].endswith("install: pip install torch==2.13.0")
    assert torch_lines[0].startswith("missing: torch (torch, torch.sdpa, torch.MHA, "
                                     "torch.MHA[sdpa], torch.flex, keras[torch], "
                                     "transformers.eager, transformers.sdpa, "
                                     "transformers.gpt_oss, transformers.rope[llama], "
                                     "transformers.rope[deepseek_v3], "
                                     "transformers.rope[gpt_neox])")
    assert "missing: hypothesis (the property checks); install: pip install hypothesis" in lines
    assert lines[-1] == "everything at once, from a clone: pip install -r requirements.txt"
    keras_missing = {p.name: p.install for p in peers.PEERS if p.framework == "keras"}
    lines = _missing_lines(monkeypatch, ["keras"], keras_missing)
    assert lines[0] == ("missing: keras (keras[numpy], keras[jax], keras[torch]); install: pip "
                        "install keras") and "torch==" not in "\n".join(lines)


def test_progress_bar_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal the bar shows the share done and the time left, a JAX cell weighing
    more than a NumPy one (``progress.CELL_WEIGHTS``); piped, nothing."""
    pytest.importorskip("tqdm", reason="pip install tqdm")

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    columns = [Column(n, "backend", backend=backends.get(n)) for n in ("numpy", "jax")]
    exp = _expected("self", "float32")
    for stream, shown in ((Tty(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        bar = progress.Progress(columns, 2)
        for col in (columns[0], columns[0], columns[1]):  # numpy's two cells, one of jax's
            bar.running(col, exp)
            bar.done(col)
            bar._bar.refresh() if shown else None
        if shown:
            eager, compiles = progress.CELL_WEIGHTS["eager"], progress.CELL_WEIGHTS["compiles"]
            percent = int(re.findall(r"(\d+)% ", stream.getvalue())[-1])
            assert percent == round(100 * (2 * eager + compiles) / (2 * (eager + compiles)))
            assert "left" in stream.getvalue() and "jax self float32" in stream.getvalue()
        bar.close()
        assert (stream.getvalue() == "") == (not shown)


def test_help_lists_the_run_options(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for option in ("--backend", "--case", "--dtype", "--hypothesis", "--json", "--verbose",
                   "--timeout", "--width"):  # the options the README uses, and --width
        assert re.search(rf"^  {option}\b", out, re.M), option
    assert re.search(r"^\s+walkthrough\s", out, re.M)  # the subcommands stay listed


@pytest.mark.parametrize(("given", "told"), [
    ("myattn.py", "drop '.py': --backend myattn"),
    ("./myattn.py", "--backend myattn"),
    ("pkg/attention.py", "--backend pkg.attention"),
    ("pkg/attention", "--backend pkg.attention"),
])
def test_a_file_path_for_backend_is_told_the_module_name(
        given: str, told: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["--backend", given, "--case", "self", "--no-errors"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and err.count("\n") == 0 and told in err, err


def test_requirements_install_what_the_default_report_uses() -> None:
    """``pip install -r requirements.txt`` installs every peer's packages, the property checks,
    the plots and the progress bar; ``pip install -e .`` stays NumPy-only."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = [line.split("#")[0].strip()
             for line in (ROOT / "requirements.txt").read_text().splitlines()]
    extras = re.search(r"^-e \.\[([^\]]*)\]$", "\n".join(lines), re.M).group(1).split(",")
    requirements = [r for line in lines if line and not line.startswith("-") for r in [line]]
    requirements += project["dependencies"]
    requirements += [r for extra in extras for r in project["optional-dependencies"][extra]]
    names = {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0].lower() for r in requirements}
    needed = {pkg for p in peers.PEERS for pkg in (p.framework, *p.requires)}
    assert needed | {"jax", "torch", "hypothesis", "matplotlib", "tqdm"} <= names
    assert "torch==2.13.0" in lines
    base = {re.split(r"[<>=]", r, maxsplit=1)[0] for r in project["dependencies"]}
    assert base == {"numpy", "ml_dtypes", "tqdm"}


def test_a_later_matrix_panel_leaves_out_its_rows_of_n_a() -> None:
    """In the second panel of columns (and later ones), a row that is n/a in every one of its
    columns is left out and counted; the first panel keeps every row."""
    names = [*backends.SPEC_BACKENDS, *(p.name for p in peers.PEERS)]
    rows = [("self", "float32"), ("window", "float32")]
    cells = [Cell(case, dtype, name, "n/a" if case == "window" and i >= 3 else "ok",
                  ratio=None if case == "window" and i >= 3 else 0.1, spec_backend=i < 3)
             for case, dtype in rows for i, name in enumerate(names)]
    columns = [Column(n, "backend" if i < 3 else "peer") for i, n in enumerate(names)]
    text = overview.matrix(RunResult(columns, cells, {}, rows), 60)
    panels = text.split("\n\n")
    assert len(panels) >= 2
    assert "window" in panels[0] and "self" in panels[0]
    for panel in panels[1:]:
        assert "window" not in panel and "\nself " in panel
        assert panel.splitlines()[-1] == "(1 more row: n/a in every column of this panel)"
