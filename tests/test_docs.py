"""The documentation's code runs and prints what the documentation says it prints; the README
is a front door (short, a backend import early, no measured figure, links that resolve).

Every ```python block of ``docs/backend_differences.md`` and ``README.md`` runs, in document
order, in one fresh Python process (so ``jax_enable_x64`` starts off, as for a reader, and the
frameworks are imported once). When a ```text block follows a python block (only blank lines
between), the snippet's printed output must equal it, line by line, trailing spaces ignored.
Snippets print rounded numbers, so no float normalisation is needed.

The documented outputs are **regression goldens**: ``--update`` (below) writes them from the
code, so they catch a change in what a snippet prints, not a wrong value. A number that matters
is computed inside its snippet against an independent expectation (a float64 reference written
out in plain NumPy, another framework, or another backend; never the value of the code it
describes), and the claims the project rests on have their own tests.

To refresh the documented outputs after a deliberate change::

    python tests/test_docs.py --update docs/backend_differences.md
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from subprocesses import timeout

ROOT = Path(__file__).resolve().parent.parent
DOCS = {"backend_differences": ROOT / "docs" / "backend_differences.md",
        "readme": ROOT / "README.md"}
BLOCK = re.compile(r"```python\n(?P<code>.*?)```\n(?:\n*```text\n(?P<out>.*?)```\n)?", re.S)
# backend_differences.md section 14 runs the peers' frameworks too
NEEDS = ("jax", "torch", "keras", "flax", "transformers", "onnx", "onnxruntime")

_DRIVER = r"""
import contextlib, io, json, sys, traceback, warnings
warnings.simplefilter("ignore")
snippets = json.load(sys.stdin)
results = []
for code in snippets:
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            exec(compile(code, "<snippet>", "exec"), {"__name__": "__snippet__"})
        error = None
    except BaseException:
        error = traceback.format_exc()
    results.append({"out": buffer.getvalue(), "error": error})
json.dump(results, sys.__stdout__)
"""


def blocks(path: Path) -> list[tuple[str, str | None]]:
    """``(code, documented output or None)`` for every python block of ``path``."""
    text = path.read_text(encoding="utf-8")
    return [(m["code"], m["out"]) for m in BLOCK.finditer(text)]


def run_snippets(codes: list[str]) -> list[dict]:
    """Run the snippets in order in one fresh interpreter; their stdout and errors."""
    proc = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps(codes),
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout(300))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _normal(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip("\n").splitlines()]


def check_snippets_in_process(path: Path, contains: str) -> None:
    """Run, in this process, the snippets of ``path`` whose code contains ``contains`` and
    assert each prints its documented output (there must be at least one)."""
    import contextlib
    import io

    snippets = [(code, out) for code, out in blocks(path) if contains in code]
    assert snippets, f"no snippet of {path.name} contains {contains!r}"
    for code, documented in snippets:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, str(path), "exec"), {"__name__": "__snippet__"})
        assert _normal(printed.getvalue()) == _normal(documented), code


def _frameworks_missing() -> list[str]:
    return [m for m in NEEDS if importlib.util.find_spec(m) is None]


def _doc_run(name: str) -> list[tuple[str, str | None, dict]]:
    """Every python block of document ``name`` with its documented output and what it
    printed (one fresh interpreter per document)."""
    found = blocks(DOCS[name])
    results = run_snippets([code for code, _ in found])
    return [(code, out, res) for (code, out), res in zip(found, results, strict=True)]


@pytest.mark.slow
@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_snippet_runs_and_prints_its_documented_output(doc):
    missing = _frameworks_missing()
    if missing:
        pytest.skip(f"the documentation's snippets need {', '.join(missing)} "
                    f"(pip install -r requirements-test.txt)")
    runs = _doc_run(doc)
    assert runs, f"{DOCS[doc].name} has no python blocks"
    for code, documented, result in runs:
        first = code.strip().splitlines()[0]
        assert result["error"] is None, f"{DOCS[doc].name}: snippet {first!r} failed:\n" \
                                        f"{result['error']}"
        if documented is not None:
            assert _normal(result["out"]) == _normal(documented), (
                f"{DOCS[doc].name}: snippet starting {first!r} printed\n{result['out']}\n"
                f"but the document says\n{documented}")


def test_backend_differences_covers_every_known_difference():
    """Each peer of spec.KNOWN_DIFFERENCES and each documented topic has its section."""
    from conformance import spec

    text = DOCS["backend_differences"].read_text(encoding="utf-8")
    for peer in spec.KNOWN_DIFFERENCES:
        name = {"torch.sdpa": "SDPA", "torch.MHA": "MultiheadAttention"}.get(peer, peer)
        assert name in text, peer
    for topic in ("BTNH", "polarity", "bottom-right", "mean of the", "NaN", "jax_enable_x64",
                  "TF32", "preferred_element_type", "keep-mask", "in place", "static_argnames",
                  "TracerBoolConversionError", "clamps", "jax.debug.print"):
        assert topic in text, topic
    with_output = [out for _, out in blocks(DOCS["backend_differences"]) if out is not None]
    assert len(with_output) >= 11


#: A measured figure: a time, a memory size, a rate, a score or a speed ratio after a number
#: ("4 min 02 s", "0.72 GB", "12.6 MiB", "99.3 %", "1.05×"); a default ("default 60") is none.
FIGURE = re.compile(r"\d(?:[\d,.]*\d)?\s*(?:ms|s|min|h|CPU-s|seconds|minutes|hours|[KMG]iB|[kMG]B"
                    r"|GFLOP/s|%)(?![\w/])|\d(?:\.\d+)?\s*×(?!\s*\d)")
#: A relative link of a markdown page: ``[text](target)``, an optional ``#anchor``.
LINK = re.compile(r"\]\((?!https?://|mailto:)(?P<path>[^)#\s]*)(?:#(?P<anchor>[^)\s]+))?\)")
TEST_COMMAND = "python -m pytest -n auto"
EDIT_LOOP = 'python -m pytest -m "not slow" -n auto'


def _anchors(page: Path) -> set[str]:
    """The anchors of a markdown page's headings, as GitHub makes them."""
    anchors = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_the_readme_is_a_front_door():
    """At most 200 lines, in the order what, install, learn, use, check, links; a backend import
    within the first 80 lines; and no measured figure (those live in docs/checking.md,
    docs/mutation.md and benchmarks/RESULTS.md, which it links)."""
    text = DOCS["readme"].read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    imports = [i for i, line in enumerate(lines, 1)
               if re.match(r"(import|from) (numpy_attn|jax_attn|torch_attn)\b", line)]
    assert imports and imports[0] <= 80, f"the first backend import is at line {imports[:1]}"
    headings = [line for line in lines if line.startswith("## ")]
    order = ["## Install", "## Learn", "## Use", "## Check", "## Links"]
    found = [next((i for i, h in enumerate(headings) if h.startswith(o)), None) for o in order]
    assert None not in found and found == sorted(found), headings
    figures = [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
               for m in FIGURE.finditer(text)]  # a figure may break across lines
    assert not figures, "measured figures in README.md:\n" + "\n".join(figures)
    assert not [line for line in lines if line.startswith("|")], "a table in README.md"
    for page in ("docs/checking.md", "docs/mutation.md", "benchmarks/RESULTS.md",
                 "CONTRIBUTING.md"):
        assert f"]({page}" in text, f"README.md does not link {page}"


def test_the_readme_gives_the_test_command_ci_runs():
    """The README's test command is the full suite, exactly what .ci/run runs; the edit loop
    and the markers are CONTRIBUTING.md's."""
    readme = DOCS["readme"].read_text(encoding="utf-8")
    commands = [line.strip() for line in readme.splitlines()
                if line.strip().startswith("python -m pytest")]
    assert commands == [TEST_COMMAND], commands
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if "pytest" in line and not line.lstrip().startswith("#")]
    assert ci == [TEST_COMMAND], ci
    contributing = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    for needed in (TEST_COMMAND, EDIT_LOOP, "@pytest.mark.slow", "--dist loadgroup",
                   "mutmut run", "docs/mutation.md", "ruff check .", "docs/read_the_code.md",
                   "LADDER", "one concept", "never by line count"):
        assert needed in contributing, needed


@pytest.mark.parametrize("page", ["README.md", "CONTRIBUTING.md"])
def test_every_relative_link_resolves(page):
    """Each relative link of the page names a file or folder of the repository, and each
    ``#anchor`` a heading of the page it points to."""
    source = ROOT / page
    broken = []
    for match in LINK.finditer(source.read_text(encoding="utf-8")):
        target = (source.parent / match["path"]).resolve() if match["path"] else source
        if not target.exists():
            broken.append(match.group(0))
        elif match["anchor"] and match["anchor"] not in _anchors(target):
            broken.append(match.group(0))
    assert not broken, f"{page}: broken links {broken}"


def update(path: Path) -> None:
    """Rewrite the text block after every python block of ``path`` with its real output."""
    text = path.read_text(encoding="utf-8")
    results = run_snippets([m["code"] for m in BLOCK.finditer(text)])
    pieces, last = [], 0
    for match, result in zip(BLOCK.finditer(text), results, strict=True):
        if result["error"]:
            raise SystemExit(f"snippet failed:\n{match['code']}\n{result['error']}")
        pieces.append(text[last:match.start()])
        pieces.append(f"```python\n{match['code']}```\n\n```text\n"
                      + "\n".join(_normal(result["out"])) + "\n```\n")
        last = match.end()
    pieces.append(text[last:])
    path.write_text("".join(pieces), encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--update":
        update(Path(sys.argv[2]))
    else:
        print(__doc__)


def test_the_readmes_first_check_is_the_quick_profile_and_ci_runs_it():
    """The README's first harness command is the bare `python -m conformance` (the quick
    profile), the line before it says what `--full` is for, and .ci/run runs it too."""
    readme = DOCS["readme"].read_text(encoding="utf-8")
    lines = [line.strip() for line in readme.splitlines()]
    first = next(i for i, line in enumerate(lines) if line.startswith("python -m conformance"))
    assert lines[first] == "python -m conformance"
    before = " ".join(lines[max(first - 6, 0):first])
    assert "--full" in before and "CI" in before
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert "python -m conformance" in [line.strip() for line in ci]
