"""The house: how the packages' files may import each other (``tests/import_graph.py``), and
how large a file may grow.

* The import graph of the whole library (``attention_rules``, the three backends, ``conformance``)
  has no circle, counting imports written inside functions and the packages around a module.
* Each backend is one ladder, the same in all three: ``_core < _extras < _tiles < blockwise <
  _blocked < _blocked_vjp < _fast < functional < backward < modules``; a file imports only
  files below it on the ladder (``masks``, ``kv_cache``, ``_threads``, ``context_parallel``,
  ``interop`` and the integrations sit where their imports put them, without a circle).
* No file takes a private name from another file, by import or as ``module._name``, except
  from its backend's two shared rooms: ``_core`` (the unchecked steps, the mods applied to a
  tile, the gradient and array helpers) and ``_extras`` (sinks, log-sum-exp and merges, the
  mods built and the tiles planned, the pieces the blocked fast path's forward and backward
  share). The helpers several files of a backend share live there and nowhere else; a file
  split for size hands its parts public names (``_tiles.forward_tiles``,
  ``_blocked.blocked_attention``) or moves what they share into a room (``conformance`` has no
  such room: none at all).
* The three backends have the same files, but for the two that concern one framework only, and
  the rooms and the split files define the names they have in common in the same order (a
  reader diffs ``numpy_attn/X.py`` against ``jax_attn/X.py`` and sees only backend
  differences).
* Code files stay at most 450 lines (the backends, ``attention_rules`` and the tests;
  ``conformance`` keeps its own, lower limits: ``tests/test_harness_structure.py``).
"""

from __future__ import annotations

import ast

from import_graph import MODULES, ROOT, graph, imports, order, tree

BACKENDS = ("numpy_attn", "jax_attn", "torch_attn")
LADDER = ("_core", "_extras", "_tiles", "blockwise", "_blocked", "_blocked_vjp", "_fast",
          "functional", "backward", "modules")
ROOMS = ("_core", "_extras")  # the files whose private names the others of a backend may take
MAX_LINES = 450


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


def test_no_private_name_crosses_a_file_except_from_a_backends_rooms() -> None:
    crossings = []
    for module in MODULES:
        package = module.split(".")[0]
        allowed = {f"{package}.{room}" for room in ROOMS} if package in BACKENDS else set()
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


def test_the_rooms_and_split_files_define_their_common_names_in_the_same_order() -> None:
    """``_core``, ``_extras``, ``_tiles``, ``_blocked`` and ``_blocked_vjp`` (the other mirrored
    files have the same check in ``tests/test_signatures.py``): the top-level functions and
    classes all three backends define come in the same order in each."""

    def names(backend: str, name: str) -> list[str]:
        body = tree(f"{backend}.{name}").body
        return [node.name for node in body if isinstance(node, ast.FunctionDef | ast.ClassDef)]

    for name in ("_core", "_extras", "_tiles", "_blocked", "_blocked_vjp"):
        common = set(names("numpy_attn", name)).intersection(
            *(names(backend, name) for backend in BACKENDS[1:]))
        orders = {backend: [n for n in names(backend, name) if n in common] for backend in BACKENDS}
        assert orders["numpy_attn"] == orders["jax_attn"] == orders["torch_attn"], (name, orders)


def test_code_files_stay_within_450_lines() -> None:
    paths = [path for package in BACKENDS + ("attention_rules", "tests")
             for path in sorted((ROOT / package).rglob("*.py"))]
    long = [f"{path.relative_to(ROOT)}: {n} lines" for path in paths
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert not long, f"over {MAX_LINES} lines (split by concept):\n" + "\n".join(long)


def test_no_test_module_turns_jax_x64_on_for_the_whole_run() -> None:
    """conftest's rule: a module-level ``jax.config.update("jax_enable_x64", ...)`` in a test
    file would change what every later test sees (JAX's default is x64 off, what users get);
    tests ask for the ``x64_on`` or ``x64`` fixture instead."""
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            call = node.value if isinstance(node, ast.Expr) else None
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "update" and call.args
                    and isinstance(call.args[0], ast.Constant)
                    and call.args[0].value == "jax_enable_x64"):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders
