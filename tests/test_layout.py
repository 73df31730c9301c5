"""The house: how the packages' files may import each other (``tests/import_graph.py``).

* The import graph of the whole library (``attention_rules``, the three backends, ``conformance``)
  has no circle, counting imports written inside functions and the packages around a module.
* Each backend is one ladder, the same in all three:
  ``_core < blockwise < _fast < functional < backward < modules``; a file imports only files
  below it on the ladder (``masks``, ``kv_cache``, ``_threads``, ``context_parallel``,
  ``interop`` and the integrations sit where their imports put them, without a circle).
* No file takes a private name from another file, by import or as ``module._name``, except
  from its backend's ``_core``: the unchecked steps and helpers every file of a backend shares
  live there and nowhere else (``conformance`` has no such room: none at all).
* The three backends have the same files, but for the two that concern one framework only.
"""

from __future__ import annotations

import ast

from import_graph import MODULES, ROOT, graph, imports, order, tree

BACKENDS = ("numpy_attn", "jax_attn", "torch_attn")
LADDER = ("_core", "blockwise", "_fast", "functional", "backward", "modules")


def _private(name: str | None) -> bool:
    return name is not None and name.startswith("_") and not name.startswith("__")


def test_the_import_graph_has_no_circle() -> None:
    assert len(order(graph())) == len(MODULES)


def test_each_backend_is_one_ladder() -> None:
    for backend in BACKENDS:
        rank = {f"{backend}.{name}": i for i, name in enumerate(LADDER)}
        assert set(rank) <= set(MODULES), f"{backend} lacks {sorted(set(rank) - set(MODULES))}"
        for module in rank:
            for target, _, _ in imports(module):
                if target in rank:
                    assert rank[target] < rank[module], (
                        f"{module} imports {target}: the ladder runs {' < '.join(LADDER)}"
                    )


def test_no_private_name_crosses_a_file_except_from_a_backends_core() -> None:
    crossings = []
    for module in MODULES:
        package = module.split(".")[0]
        allowed = {f"{package}._core"} if package in BACKENDS else set()
        aliases = {}  # local name → a library module imported as a module
        for target, name, alias in imports(module):
            if name is None:
                aliases[alias] = target
            elif _private(name) and target != module and target not in allowed:
                crossings.append(f"{module}: from {target} import {name}")
        for node in ast.walk(tree(module)):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and _private(node.attr)):
                target = aliases.get(node.value.id)
                if target and target not in allowed:
                    crossings.append(f"{module}: {node.value.id}.{node.attr}")
    assert not crossings, "private names crossing files:\n" + "\n".join(sorted(set(crossings)))


def test_the_backends_have_the_same_files() -> None:
    def files(backend: str) -> set[str]:
        return {p.relative_to(ROOT / backend).as_posix() for p in (ROOT / backend).glob("*.py")}

    # numpy_attn alone runs its own threads; torch_attn alone converts torch's own modules
    extra = {"numpy_attn": {"_threads.py"}, "torch_attn": {"interop.py"}, "jax_attn": set()}
    for backend in ("jax_attn", "torch_attn"):
        assert (files("numpy_attn") - extra["numpy_attn"]
                == files(backend) - extra[backend]), backend
