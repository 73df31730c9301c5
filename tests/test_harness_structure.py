"""The conformance package's layout: imports run one way (no circle, subfolders included), no
module uses another's private names, files stay small, and no module imports a framework.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "conformance"


# ------------------------------------------------------------------------------ structure


def _name(path: Path) -> str:
    """A file's dotted name inside the package: ``cases``, ``spec`` (``spec/__init__.py``),
    ``peers.keras_ops``; the package's own ``__init__`` stays ``__init__``."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, ast.Module]:
    """Every file of the package and its subfolders, by dotted name."""
    return {_name(p): ast.parse(p.read_text(encoding="utf-8"))
            for p in sorted(PACKAGE.rglob("*.py"))}


def _packages() -> set[str]:
    return {_name(p) for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}


def _imports(name: str, tree: ast.Module, known: set[str], packages: set[str]
             ) -> tuple[set[str], list[str], dict[str, str]]:
    """Modules of the package a module imports (anywhere in it; a submodule's folders too,
    unless the importer lives in them), the private names it imports from them, and its
    aliases for them."""
    here = name if name in packages else name.rpartition(".")[0]  # the importer's package
    if name == "__init__":
        here = ""
    own = {".".join(here.split(".")[:i]) for i in range(1, here.count(".") + 2)} if here else set()
    deps, private, aliases = set(), [], {}

    def add(target: str) -> None:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in known and (prefix == target or prefix not in own):
                deps.add(prefix)

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not (node.module or "").startswith("conformance"):
                    continue
                base = (node.module or "").removeprefix("conformance").lstrip(".")
            else:
                up = here.split(".") if here else []
                up = up[:len(up) - (node.level - 1)] if node.level > 1 else up
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                if sub in known:  # a module: from . import x, from .spec import seed_example
                    add(sub)
                    aliases[alias.asname or alias.name] = sub
                elif base:
                    add(base)
                    if alias.name.startswith("_"):
                        private.append(alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("conformance."):
                    add(alias.name.removeprefix("conformance."))
    return deps, private, aliases


def test_conformance_imports_run_one_way_and_use_no_private_names() -> None:
    trees = _modules()
    known, packages = set(trees), _packages()
    graph = {}
    for name, tree in trees.items():
        deps, private, aliases = _imports(name, tree, known, packages)
        assert not private, f"{name} imports private names {private}"
        graph[name] = deps - {name, "__init__"}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                raise AssertionError(f"{name} uses {node.value.id}.{node.attr}")
    assert {"spec.functions", "peers.keras_ops", "context_parallel.run",
            "teaching.walkthrough"} <= known  # the subfolders are walked
    order: list[str] = []
    while graph:  # peel modules whose imports are all placed: fails on a circle
        ready = sorted(n for n, deps in graph.items() if deps <= set(order))
        assert ready, f"import circle among {sorted(graph)}"
        order += ready
        for n in ready:
            del graph[n]
    assert order.index("spec") < order.index("cases") < order.index("expected")
    assert order.index("compare") < order.index("results") < order.index("runner")
    assert order.index("peers") < order.index("runner")
    assert order.index("report") < order.index("__main__")
    assert order.index("context_parallel.cases") < order.index("context_parallel.run")


def test_harness_files_stay_small() -> None:
    """A newcomer reads one concern per file; data (the spec's chapters, the case catalogue)
    may be longer."""
    for path in PACKAGE.rglob("*.py"):
        name = _name(path)
        limit = 450 if name == "cases" or name.split(".")[0] == "spec" else 400
        lines = len(path.read_text(encoding="utf-8").splitlines())
        assert lines <= limit, f"{path.relative_to(PACKAGE)}: {lines} lines"


def test_harness_imports_no_framework() -> None:
    """Every module of the package and its subfolders imports (the walkthrough and pictures
    too) without pulling in a framework; a NumPy-only run stays NumPy-only."""
    modules = ", ".join(f"conformance.{n}" for n in sorted(_modules()) if n != "__init__")
    code = (f"import sys; import {modules}; "
            "from conformance.__main__ import main; "
            "main(['--backend', 'numpy', '--case', 'self', '--dtype', 'float32', '--no-peers']); "
            "bad = [m for m in ('jax', 'torch', 'matplotlib', 'hypothesis') "
            "if sys.modules.get(m) is not None]; "
            "print(bad); sys.exit(len(bad))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
