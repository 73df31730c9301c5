"""The documentation's code runs and prints what the documentation says it prints.

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
from background_lane import LANE

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
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
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


def _doc_runs() -> dict[str, list[tuple[str, str | None, dict]]]:
    """Per document, every python block with its documented output and what it printed."""
    runs = {}
    for name, path in DOCS.items():
        found = blocks(path)
        results = run_snippets([code for code, _ in found])
        runs[name] = [(code, out, res) for (code, out), res in zip(found, results, strict=True)]
    return runs


#: The background lane's job (``background_lane``): the snippets' interpreter runs on the
#: other core while the suite goes on.
BACKGROUND = {"documentation snippets": _doc_runs}


@pytest.fixture(scope="module")
def doc_runs() -> dict[str, list[tuple[str, str | None, dict]]]:
    missing = _frameworks_missing()
    if missing:
        pytest.skip(f"the documentation's snippets need {', '.join(missing)} "
                    f"(pip install -r requirements-test.txt)")
    return LANE.result("documentation snippets", _doc_runs)


@pytest.mark.background("documentation snippets", mib=1150)
@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_snippet_runs_and_prints_its_documented_output(doc, doc_runs):
    runs = doc_runs[doc]
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
