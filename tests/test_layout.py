"""The house: how the packages' files may import each other (``tests/import_graph.py``).

These rules serve the reader; none of them counts lines or files (a file holds one concept and
is split by concept, CONTRIBUTING.md):

* The import graph of the whole library (``attention_rules``, the three backends, ``conformance``)
  has no circle, counting imports written inside functions and the packages around a module.
* Each backend is one ladder (``LADDER``, written once for readers in docs/read_the_code.md):
  its private rooms ``_arrays < _masking < _steps < _tiles < _fast/`` (numpy_attn's own
  ``_threads`` below them all), then its public files,
  ``functional < backward < modules``; a file imports only files below it on the ladder. The
  other public files (``blockwise``, ``varlen``, ``masks``, ``kv_cache``, ``paged``,
  ``context_*``, the integrations) sit where their imports put them, but above every private
  room: no private room imports a public file.
* A private name (``_x``) crosses files only out of a private room: a public file never takes
  another public file's private names.
* The three backends have the same public files and define the same public functions in them
  (a reader diffs ``numpy_attn/X.py`` against ``jax_attn/X.py`` and sees only backend
  differences); the rooms the three share define their common names in the same order.
* Backends never import each other, the harness or an array library in ``attention_rules``:
  ``tests/test_packaging.py``.
"""

from __future__ import annotations

import ast
import re

from import_graph import MODULES, ROOT, graph, imports, order, tree

BACKENDS = ("numpy_attn", "jax_attn", "torch_attn")
PRIVATE_ROOMS = ("_arrays", "_masking", "_steps", "_tiles", "_fast")
LADDER = PRIVATE_ROOMS + ("functional", "backward", "modules")
#: files one framework alone has: numpy_attn runs its own worker threads (``_threads``, below
#: every other room: it imports none), torch_attn converts torch's own modules (``interop``);
#: numpy_attn and torch_attn write split-KV decoding's chunks themselves (``_chunks``; jax_attn's
#: XLA does them its way), and all three a quantised cache's step (``_dequantizing``)
ONLY_IN = {"_threads": {"numpy_attn"}, "interop": {"torch_attn"},
           "_chunks": {"numpy_attn", "torch_attn"},
           "_dequantizing": {"numpy_attn", "jax_attn", "torch_attn"}}
BELOW_THE_LADDER = ("_threads",)
#: rooms of some frameworks, on the ladder above ``_fast/`` (below the public files)
ABOVE_FAST = ("_chunks", "_dequantizing")


def _private(name: str | None) -> bool:
    return name is not None and name.startswith("_") and not name.startswith("__")


def _rung(module: str) -> str | None:
    """The backend file or package a module belongs to: ``numpy_attn._fast.forward`` → ``_fast``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _is_private_room(module: str) -> bool:
    return any(_private(part) for part in module.split(".")[1:])


def _backend_modules(backend: str) -> list[str]:
    return [m for m in MODULES if m.split(".")[0] == backend and m != backend]


def test_the_import_graph_has_no_circle() -> None:
    assert len(order(graph())) == len(MODULES)


def test_each_backend_is_one_ladder() -> None:
    rungs_in_order = BELOW_THE_LADDER + PRIVATE_ROOMS + ABOVE_FAST + LADDER[len(PRIVATE_ROOMS):]
    rank = {name: i for i, name in enumerate(rungs_in_order)}
    for backend in BACKENDS:
        rungs = {_rung(m) for m in _backend_modules(backend)}
        assert set(LADDER) <= rungs, f"{backend} lacks {sorted(set(LADDER) - rungs)}"
        own = {r for r in BELOW_THE_LADDER + ABOVE_FAST if backend in ONLY_IN[r]}
        assert {r for r in rungs if _private(r)} == set(PRIVATE_ROOMS) | own, (
            f"{backend}'s private rooms are {sorted(r for r in rungs if _private(r))}; the "
            f"ladder names {PRIVATE_ROOMS} (add a room to LADDER and docs/read_the_code.md)")
        for module in _backend_modules(backend):
            here = _rung(module)
            for target, _, _ in imports(module):
                there = _rung(target) if target.split(".")[0] == backend else None
                if here in rank and there in rank and here != there:
                    assert rank[there] < rank[here], (
                        f"{module} imports {target}: the ladder runs {' < '.join(LADDER)}")


def test_no_private_room_imports_a_public_file() -> None:
    upward = [f"{module} imports {target}"
              for backend in BACKENDS for module in _backend_modules(backend)
              if _is_private_room(module)
              for target, _, _ in imports(module)
              if target.split(".")[0] == backend and target != backend
              and not _is_private_room(target)]
    assert not upward, "private rooms importing public files:\n" + "\n".join(sorted(upward))


def test_private_names_cross_files_only_out_of_private_rooms() -> None:
    crossings = []
    for module in MODULES:
        aliases = {}  # local name → a library module imported as a module
        for target, name, alias in imports(module):
            if name is None:
                aliases[alias] = target
            elif _private(name) and target != module and not _is_private_room(target):
                crossings.append(f"{module}: from {target} import {name}")
        for node in ast.walk(tree(module)):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and _private(node.attr)):
                target = aliases.get(node.value.id)
                if target and target != module and not _is_private_room(target):
                    crossings.append(f"{module}: {node.value.id}.{node.attr}")
    assert not crossings, "private names crossing files:\n" + "\n".join(sorted(set(crossings)))


def _public_files(backend: str) -> set[str]:
    return {p.stem for p in (ROOT / backend).glob("*.py")
            if not _private(p.stem) and p.stem != "__init__"}


def test_a_room_of_one_framework_is_declared() -> None:
    """A private room the ladder does not name is one framework's own and declared here."""
    for backend in BACKENDS:
        rooms = {p.stem for p in (ROOT / backend).glob("_*.py") if p.stem != "__init__"}
        rooms |= {p.name for p in (ROOT / backend).glob("_*") if p.is_dir()
                  and p.name != "__pycache__"}
        undeclared = rooms - set(PRIVATE_ROOMS) - {r for r in ONLY_IN if backend in ONLY_IN[r]}
        assert not undeclared, f"{backend}: rooms {sorted(undeclared)} are not on the ladder"


def _top_level_names(module: str) -> list[str]:
    body = tree(module).body
    return [node.name for node in body if isinstance(node, ast.FunctionDef | ast.ClassDef)]


def _exported(backend: str) -> set[str]:
    """The backend's ``__all__``, read from its ``__init__.py``."""
    for node in tree(backend).body:
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "__all__"):
            return set(ast.literal_eval(node.value))
    return set()


def test_the_backends_have_the_same_public_files_and_functions() -> None:
    """The same public files, and each of the API's names (``__all__``; the spec's extras of
    one backend aside, ``tests/test_signatures.py``) defined in the same file everywhere."""
    files = {backend: _public_files(backend) for backend in BACKENDS}
    for backend in BACKENDS:
        expected = {f for f in files["numpy_attn"] | files[backend]
                    if backend in ONLY_IN.get(f, set(BACKENDS))}
        assert files[backend] == expected, (backend, sorted(files[backend] ^ expected))
    api = set.intersection(*(_exported(backend) for backend in BACKENDS))
    assert api, "no name common to the three backends' __all__"
    for name in files["numpy_attn"]:
        defined = {backend: api.intersection(_top_level_names(f"{backend}.{name}"))
                   for backend in BACKENDS}
        assert defined["numpy_attn"] == defined["jax_attn"] == defined["torch_attn"], (
            name, defined)


def test_the_shared_rooms_define_their_common_names_in_the_same_order() -> None:
    """``_arrays``, ``_masking``, ``_steps`` and ``_tiles`` (``_fast/`` is each framework's own;
    the public files have the same check in ``tests/test_signatures.py``)."""
    for room in PRIVATE_ROOMS[:-1]:
        names = {backend: _top_level_names(f"{backend}.{room}") for backend in BACKENDS}
        common = set(names["numpy_attn"]).intersection(*names.values())
        orders = {backend: [n for n in names[backend] if n in common] for backend in BACKENDS}
        assert orders["numpy_attn"] == orders["jax_attn"] == orders["torch_attn"], (room, orders)


def test_the_ladder_is_written_once_for_readers() -> None:
    """docs/read_the_code.md states the ladder this test checks, in the same order."""
    text = (ROOT / "docs" / "read_the_code.md").read_text(encoding="utf-8")
    written = re.findall(r"`(_arrays < [^`]*)`", text)
    assert written, "docs/read_the_code.md does not state the ladder (`_arrays < ...`)"
    rungs = [r.strip().strip("/").removesuffix(".py") for r in written[0].split("<")]
    assert rungs == list(LADDER), (rungs, LADDER)


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
