"""Every backend implements the spec's public API with the spec's exact signatures."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import attention_rules
from conformance import spec
from conformance.spec import specdoc

ROOT = Path(__file__).resolve().parent.parent
BACKEND_PACKAGES = ("numpy_attn", "jax_attn", "torch_attn")


def _parameters(obj):
    """(name, kind, default) of every parameter, ``self`` dropped."""
    params = inspect.signature(obj).parameters.values()
    return [(p.name, p.kind, p.default) for p in params if p.name != "self"]


@pytest.mark.parametrize("name", spec.FUNCTIONS)
def test_function_signature(backend, name):
    implementation = getattr(backend.module, name, None)
    assert implementation is not None, f"{backend.module_name} lacks {name}"
    assert _parameters(implementation) == _parameters(getattr(spec, name)), (
        f"{backend.module_name}.{name}{inspect.signature(implementation)} differs from "
        f"spec {name}{inspect.signature(getattr(spec, name))}"
    )
    assert implementation.__doc__ and "(" in implementation.__doc__, f"{name}: no shapes in doc"


@pytest.mark.parametrize("name", spec.MODULES)
def test_module_signature(backend, name):
    cls = getattr(backend.module, name, None)
    assert cls is not None, f"{backend.module_name} lacks {name}"
    stub = getattr(spec, name)
    assert _parameters(cls.__init__) == _parameters(stub.__init__), (
        f"{backend.module_name}.{name}.__init__{inspect.signature(cls.__init__)} differs from "
        f"spec {inspect.signature(stub.__init__)}"
    )
    for method in spec.MODULE_METHODS:
        impl = getattr(cls, method, None)
        assert impl is not None, f"{backend.module_name}.{name} lacks {method}"
        assert _parameters(impl) == _parameters(getattr(stub, method)), (
            f"{backend.module_name}.{name}.{method}{inspect.signature(impl)} differs from "
            f"spec {inspect.signature(getattr(stub, method))}"
        )


def test_public_names_are_the_spec_and_declared_extras(backend):
    exported = set(backend.module.__all__)
    expected = set(spec.FUNCTIONS) | set(spec.MODULES) | set(spec.CLASSES) | set(
        spec.BACKEND_EXTRAS[backend.module_name]
    ) | set(spec.CONTEXT_PARALLEL_FUNCTIONS)
    assert exported == expected


@pytest.mark.parametrize("method", ["empty", "append"])
def test_kv_cache_signature(backend, method):
    impl = getattr(backend.module.KVCache, method)
    assert _parameters(impl) == _parameters(getattr(spec.KVCache, method))


@pytest.mark.parametrize("name", spec.DECODING_MODULES)
def test_decode_signature(backend, name):
    impl = getattr(backend.module, name).decode
    assert _parameters(impl) == _parameters(spec.DecodingModule.decode)


# Rules of the spec that live once, in attention_rules: no backend may define them again.
RULE_FUNCTIONS = {  # names a backend's own copy would have had (today's or the old ones)
    "_band", "_plan", "_key_range", "_check_mask_bias", "_check_dropout_mask",
    "_check_structure", "_check_kv_lengths", "_check_append", "_check_room",
    "_use_blocked_path", "_blocked_attention_rule",
}
RULE_MESSAGES = (  # the words of rule messages: only attention_rules writes them
    "must be broadcastable", "must have the output's shape", "must be float16, bfloat16",
    "must share one dtype", "must be a pair (left, right)", "must lie in [0,",
    "must be ints shaped like the batch axes", "must be a multiple of", "weight names differ",
    "must be an array (numpy.ndarray", "must be a bool", "dropout needs the forward pass",
)


@pytest.mark.parametrize("package", BACKEND_PACKAGES)
def test_backends_have_the_mirrored_files(package):
    """The public files every backend has (the whole set is ``tests/test_layout.py``'s), its
    fast-path package, and ``py.typed``."""
    for name in ("functional.py", "blockwise.py", "backward.py", "modules.py",
                 "_fast/__init__.py"):
        assert (ROOT / package / name).exists(), f"{package} lacks the mirrored {name}"
    assert (ROOT / package / "py.typed").exists()


@pytest.mark.parametrize("package", BACKEND_PACKAGES)
def test_no_backend_defines_its_own_copy_of_a_rule(package):
    assert not (ROOT / package / "_checks.py").exists(), "the rules live in attention_rules"
    rules_api = set(attention_rules.__all__)
    for path in sorted((ROOT / package).rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        defined = {node.name for node in ast.walk(tree)
                   if isinstance(node, ast.FunctionDef | ast.ClassDef)}
        copies = defined & (RULE_FUNCTIONS | rules_api | {f"_{n}" for n in rules_api})
        assert not copies, f"{path.name} defines {sorted(copies)}: use attention_rules"
        for words in RULE_MESSAGES:
            assert words not in source, f"{path.name} writes the rule message {words!r}"
        imports = [node for node in ast.walk(tree) if isinstance(node, ast.Import)]
        name = path.relative_to(ROOT / package).as_posix()
        if name in ("functional.py", "blockwise.py", "backward.py", "_fast/__init__.py"):
            assert any(a.name == "attention_rules" for node in imports for a in node.names), (
                f"{name} does not use attention_rules"
            )


@pytest.mark.parametrize("pair", ["functional", "blockwise", "backward", "modules", "_fast"])
def test_mirrored_files_define_the_same_helpers_in_the_same_order(pair):
    """Same function names in the same order in every backend (library-only extras allowed at
    their own places): ``diff numpy_attn/X.py jax_attn/X.py`` shows library differences. The
    fast paths (``_fast/``) are each framework's own: only their entry points are common."""

    def names(package):
        path = ROOT / package / ("_fast/__init__.py" if pair == "_fast" else f"{pair}.py")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        return [node.name for node in tree.body
                if isinstance(node, ast.FunctionDef | ast.ClassDef)]

    common = set(names("numpy_attn")).intersection(*(names(p) for p in BACKEND_PACKAGES[1:]))
    if pair == "_fast":  # the fast paths differ by nature; their entry points do not
        assert {"use_fast_path", "fast_attention"} <= common
        return
    orders = {p: [n for n in names(p) if n in common] for p in BACKEND_PACKAGES}
    assert orders["jax_attn"] == orders["numpy_attn"] == orders["torch_attn"], orders
    if pair in ("functional", "blockwise", "backward"):  # every helper in every backend
        numpy_only = set(spec.BACKEND_EXTRAS["numpy_attn"]) | {"projection_grads"}
        for package in BACKEND_PACKAGES[1:]:
            missing = set(names("numpy_attn")) - set(names(package)) - numpy_only
            assert not missing, f"{package}/{pair}.py lacks numpy_attn's {sorted(missing)}"


def test_module_methods_in_the_same_order():
    for name in spec.MODULES:
        orders = []
        for package in BACKEND_PACKAGES:
            cls = getattr(importlib.import_module(package), name)
            methods = [m for m in ("forward", "parameter_gradients", "decode") if m in vars(cls)]
            orders.append(methods)
        assert orders[0] == orders[1] == orders[2], (name, orders)


def test_the_spec_and_the_rules_agree():
    """spec.py restates some of attention_rules' constants in words and dicts: the same.
    (``spec.FAST_PATHS``' numbers are checked by behaviour, each side of every threshold, in
    tests/test_performance_paths.py, tests/test_jax_fast_paths.py and
    tests/test_fast_backward_numpy.py.)"""
    assert tuple(spec.COMPUTE_DTYPE) == attention_rules.SUPPORTED_DTYPES[::-1]
    for dtype, compute in spec.COMPUTE_DTYPE.items():
        assert attention_rules.compute_dtype(dtype) == compute
    assert tuple(spec.CAUSAL_ALIGNMENTS) == attention_rules.CAUSAL_ALIGNMENTS
    assert spec.DEFAULT_CAUSAL_ALIGNMENT == "top_left"
    numbers = {key for paths in spec.FAST_PATHS.values() for path in paths.values() for key in path}
    assert numbers <= set(spec.FAST_PATH_RULES), "a FAST_PATHS key without its meaning"


def test_spec_doc_is_generated_from_spec():
    committed = (ROOT / "docs" / "spec.md").read_text(encoding="utf-8")
    assert committed == specdoc.render(), "run `python -m conformance spec --write`"
