"""The conformance package's layout: its layers import in order (subfolders included), files
stay small, and no module imports a framework (circles and private names: test_layout.py).
"""

from __future__ import annotations

import subprocess
import sys

from import_graph import MODULES, ROOT, graph, order

PACKAGE = ROOT / "conformance"


def _name(module: str) -> str:
    """A module's name inside the package: ``cases``, ``spec``, ``peers.keras_ops``."""
    return module.removeprefix("conformance").lstrip(".") or "__init__"


def test_conformance_imports_run_one_way() -> None:
    """No circle (``tests/test_layout.py`` checks it, and that no private name crosses a file,
    for the whole library); here: the harness's layers come in their order."""
    placed = [_name(m) for m in order(graph()) if m.split(".")[0] == "conformance"]
    assert {"spec.functions", "peers.keras_ops", "context_parallel.run",
            "teaching.walkthrough", "golden.folders"} <= set(placed)  # subfolders are walked
    assert placed.index("spec") < placed.index("cases") < placed.index("expected")
    assert placed.index("compare") < placed.index("results") < placed.index("runner")
    assert placed.index("peers") < placed.index("runner")
    assert placed.index("report") < placed.index("__main__")
    assert placed.index("context_parallel.cases") < placed.index("context_parallel.run")


def test_harness_files_stay_small() -> None:
    """A newcomer reads one concern per file; data (the spec's chapters, the case catalogue)
    may be longer."""
    for module, path in MODULES.items():
        if module.split(".")[0] != "conformance":
            continue
        name = _name(module)
        limit = 450 if name == "cases" or name.split(".")[0] == "spec" else 400
        lines = len(path.read_text(encoding="utf-8").splitlines())
        assert lines <= limit, f"{path.relative_to(PACKAGE)}: {lines} lines"


def test_harness_imports_no_framework() -> None:
    """Every module of the package and its subfolders imports (the walkthrough and pictures
    too) without pulling in a framework; a NumPy-only run stays NumPy-only."""
    modules = ", ".join(sorted(m for m in MODULES if m.startswith("conformance.")))
    code = (f"import sys; import {modules}; "
            "from conformance.__main__ import main; "
            "main(['--backend', 'numpy', '--case', 'self', '--dtype', 'float32', '--no-peers']); "
            "bad = [m for m in ('jax', 'torch', 'matplotlib', 'hypothesis') "
            "if sys.modules.get(m) is not None]; "
            "print(bad); sys.exit(len(bad))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
