"""The house: how the packages' files may import each other.

* The import graph of the whole library (``attention_rules``, the three backends, ``conformance``)
  has no circle, counting imports written inside functions too.
* Each backend is one ladder, the same in all three:
  ``_core < blockwise < _fast < functional < backward < modules``; a file imports only files
  below it on the ladder (``masks``, ``kv_cache``, ``_threads``, ``context_parallel``,
  ``interop`` and the integrations sit where their imports put them, without a circle).
* Inside a backend no file takes a private name from another file except from ``_core``: the
  unchecked steps and helpers every file shares live there and nowhere else.
* The three backends have the same files.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("attention_rules", "numpy_attn", "jax_attn", "torch_attn", "conformance")
BACKENDS = ("numpy_attn", "jax_attn", "torch_attn")
LADDER = ("_core", "blockwise", "_fast", "functional", "backward", "modules")


def _module_files() -> dict[str, Path]:
    """Dotted module name → file, for every module of the library's packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _module_files()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in ``module`` names (before its imported names)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, str | None]]:
    """``(target module, imported name or None)`` for every import of the library's modules in
    ``module``, at any depth of the file (function-local imports too)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name in MODULES]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            if target not in MODULES:
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in MODULES:
                    found.append((submodule, None))  # ``from . import functional``
                else:
                    found.append((target, alias.name))
    return found


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _ in _imports(m)} - {m} for m in MODULES}


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_circle() -> None:
    circle = _circle(_graph())
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_each_backend_is_one_ladder() -> None:
    for backend in BACKENDS:
        rank = {f"{backend}.{name}": i for i, name in enumerate(LADDER)}
        assert set(rank) <= set(MODULES), f"{backend} lacks {sorted(set(rank) - set(MODULES))}"
        for module in rank:
            for target, _ in _imports(module):
                if target in rank:
                    assert rank[target] < rank[module], (
                        f"{module} imports {target}: the ladder runs {' < '.join(LADDER)}"
                    )


def test_no_private_name_crosses_a_backend_file_except_from_core() -> None:
    crossings = []
    for module in MODULES:
        backend = module.split(".")[0]
        if backend not in BACKENDS:
            continue
        core = f"{backend}._core"
        tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
        aliases = {}  # local name → module of this backend imported as a module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(module, node)
                for alias in node.names:
                    if f"{target}.{alias.name}" in MODULES:
                        aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
                    elif (target.startswith(backend) and target != core and target != module
                          and alias.name.startswith("_") and not alias.name.startswith("__")):
                        crossings.append(f"{module}: from {target} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in MODULES:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                target = aliases.get(node.value.id)
                if target and target.startswith(backend) and target != core:
                    crossings.append(f"{module}: {node.value.id}.{node.attr}")
    assert not crossings, "private names crossing files:\n" + "\n".join(sorted(set(crossings)))


def test_the_backends_have_the_same_files() -> None:
    def files(backend: str) -> set[str]:
        return {p.relative_to(ROOT / backend).as_posix()
                for p in (ROOT / backend).glob("*.py")}

    numpy_files = files("numpy_attn")
    for backend in ("jax_attn", "torch_attn"):
        # numpy_attn alone runs its own threads; torch_attn alone converts torch's own modules
        extra = {"numpy_attn": {"_threads.py"}, "torch_attn": {"interop.py"}, "jax_attn": set()}
        assert numpy_files - extra["numpy_attn"] == files(backend) - extra[backend], backend
