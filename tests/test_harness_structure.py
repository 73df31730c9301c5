"""The conformance package's layout: its stages import in pipeline order (subfolders included),
its top level holds only the stages, the cells' processes speak one protocol, and no module
imports a framework (circles and private names: test_layout.py).
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from import_graph import MODULES, ROOT, graph, imports, order
from subprocesses import timeout

PACKAGE = ROOT / "conformance"
#: The harness's layers, first to last: a module imports only from its own layer and those
#: before it (``conformance/__init__.py`` says the same).
LAYERS = (
    ("spec", "usage", "words"),  # the specification; a mistake in calling the harness; plurals
    ("cases",),  # what runs, and what each step should give
    ("comparing",),  # the one tolerance rule, the results
    ("diagnosing",),  # why a failing step or peer cell failed
    ("running", "peers"),  # where and how each cell runs; the frameworks' kernels as columns
    ("reporting",),  # terminal, JSON, Markdown, HTML
    ("golden", "suite", "teaching", "context_parallel", "locating"),  # the harness's other uses
    ("__main__",),
)
#: The files the top level keeps beside the layers' folders.
TOP_FILES = {"__init__.py", "__main__.py", "usage.py", "words.py", "py.typed"}


def _name(module: str) -> str:
    """A module's name inside the package: ``cases``, ``spec``, ``peers.keras_ops``."""
    return module.removeprefix("conformance").lstrip(".") or "__init__"


def _layer(module: str) -> int | None:
    """The index in ``LAYERS`` of a module of the package (None: the package itself)."""
    top = _name(module).split(".")[0]
    if top == "__init__":
        return None
    return next(i for i, names in enumerate(LAYERS) if top in names)


def test_conformance_imports_run_one_way() -> None:
    """No circle (``tests/test_layout.py`` checks it, and that no private name crosses a file,
    for the whole library); here: the harness's layers come in their order."""
    placed = [_name(m) for m in order(graph()) if m.split(".")[0] == "conformance"]
    assert {"spec.functions", "peers.keras_ops", "context_parallel.run",
            "teaching.walkthrough", "golden.folders"} <= set(placed)  # subfolders are walked
    assert placed.index("spec") < placed.index("cases.catalogue") < placed.index("cases.expected")
    assert placed.index("comparing.compare") < placed.index("comparing.results") \
        < placed.index("running.runner")
    assert placed.index("peers") < placed.index("running.runner")
    assert placed.index("reporting.sections") < placed.index("__main__")
    assert placed.index("context_parallel.cases") < placed.index("context_parallel.run")


def test_each_stage_imports_only_the_stages_before_it() -> None:
    """Data flows one way: cases < comparing < diagnosing < running < reporting < the other
    uses < the command line; a module imports only from its own layer and earlier ones."""
    upward = []
    for module, deps in graph().items():
        if module.split(".")[0] != "conformance" or _layer(module) is None:
            continue
        for dep in deps:
            if dep.split(".")[0] == "conformance" and _layer(dep) is not None \
                    and _layer(dep) > _layer(module):
                upward.append(f"{_name(module)} imports {_name(dep)}")
    assert not upward, upward


def test_the_top_level_reads_as_the_pipeline() -> None:
    """``ls conformance``: the stages and the harness's other uses, each a folder with a map
    in its ``__init__``; no flat file beside them but the entry points and ``usage``."""
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    files = {p.name for p in PACKAGE.iterdir() if p.is_file()}
    assert folders == {name for names in LAYERS for name in names} - {"usage", "words",
                                                                       "__main__"}
    assert files == TOP_FILES
    for folder in folders:
        assert ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text(
            encoding="utf-8"))), f"{folder}/__init__.py has no map"


def test_the_workers_speak_one_protocol() -> None:
    """Only ``running/workers.py`` starts a process for the cells or opens its socket: the
    checked module's worker, the peer worker and the Keras workers all go through it."""
    starters = []
    for module, path in MODULES.items():
        if _name(module).split(".")[0] not in ("running", "peers"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            called = isinstance(node, ast.Call) and getattr(
                node.func, "attr", getattr(node.func, "id", ""))
            if called in ("Popen", "socketpair", "Connection"):
                starters.append(_name(module))
    assert set(starters) == {"running.workers"}


def test_the_room_not_the_runners_loop_decides_where_cells_run() -> None:
    """``running.runner`` hands its cells to a room (``running.room``) and takes them back in
    order: no scheduling flag (``concurrent``, ``freeze``) and no ``gc`` in the runner."""
    tree = ast.parse(MODULES["conformance.running.runner"].read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    arguments = {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
                 for a in (*n.args, *n.kwonlyargs)}
    assert "gc" not in imported
    assert not arguments & {"concurrent", "freeze"}
    assert "conformance.running.room" in {t for t, *_ in imports("conformance.running.runner")}


@pytest.mark.slow
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
                          timeout=timeout(120))
    assert proc.returncode == 0, proc.stdout + proc.stderr
