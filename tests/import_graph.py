"""The library's import graph, read from the source (``ast``), for the layout tests.

Nodes are dotted module names of the five packages (``conformance.spec.functions``; a package
is its ``__init__``). An edge is an import written anywhere in a file, function-local ones too;
importing ``a.b.c`` also imports the packages ``a`` and ``a.b`` (Python runs their
``__init__`` first), except those the importer lives in.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("attention_rules", "numpy_attn", "jax_attn", "torch_attn", "conformance")


def _module_files() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _module_files()


def tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(encoding="utf-8"))


def package_of(module: str) -> str:
    """The package a module lives in (a package lives in itself)."""
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in ``module`` names (before its imported names)."""
    if node.level == 0:
        return node.module or ""
    base = package_of(module).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str) -> list[tuple[str, str | None, str | None]]:
    """``(target module, imported name or None, local alias)`` for every import of the
    library's modules in ``module``; the name is None when the target itself is imported."""
    found: list[tuple[str, str | None, str | None]] = []
    for node in ast.walk(tree(module)):
        if isinstance(node, ast.Import):
            found += [(a.name, None, a.asname) for a in node.names if a.name in MODULES]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(module, node)
            if target not in MODULES:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:  # ``from . import functional``: a module
                    found.append((sub, None, alias.asname or alias.name))
                else:
                    found.append((target, alias.name, alias.asname or alias.name))
    return found


def graph() -> dict[str, set[str]]:
    """Module → the modules it imports, the packages around them included."""
    edges: dict[str, set[str]] = {}
    for module in MODULES:
        own = package_of(module).split(".")
        inside = {".".join(own[:i]) for i in range(1, len(own) + 1)}
        deps = set()
        for target, _, _ in imports(module):
            parts = target.split(".")
            deps |= {p for i in range(1, len(parts) + 1)
                     if (p := ".".join(parts[:i])) in MODULES and (p == target or p not in inside)}
        edges[module] = deps - {module}
    return edges


def order(edges: dict[str, set[str]]) -> list[str]:
    """The modules, each after everything it imports; AssertionError naming a circle."""
    placed: list[str] = []
    left = {m: set(deps) & set(edges) for m, deps in edges.items()}
    while left:
        ready = sorted(m for m, deps in left.items() if deps <= set(placed))
        if not ready:
            raise AssertionError("import circle: " + " -> ".join(_circle(left)))
        placed += ready
        for m in ready:
            del left[m]
    return placed


def _circle(edges: dict[str, set[str]]) -> list[str]:
    """One circle of a graph where every node is on or leads to one: walk until a repeat."""
    path = [min(edges)]
    while True:
        nxt = min(d for d in edges[path[-1]] if d in edges)
        if nxt in path:
            return path[path.index(nxt):] + [nxt]
        path.append(nxt)
