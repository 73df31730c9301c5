"""Every backend implements the spec's public API with the spec's exact signatures."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from conformance import spec, specdoc

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
    )
    assert exported == expected


@pytest.mark.parametrize("method", ["empty", "append"])
def test_kv_cache_signature(backend, method):
    impl = getattr(backend.module.KVCache, method)
    assert _parameters(impl) == _parameters(getattr(spec.KVCache, method))


@pytest.mark.parametrize("name", spec.DECODING_MODULES)
def test_decode_signature(backend, name):
    impl = getattr(backend.module, name).decode
    assert _parameters(impl) == _parameters(spec.DecodingModule.decode)


@pytest.mark.parametrize("package", BACKEND_PACKAGES[1:])
def test_checks_module_is_identical_in_every_backend(package):
    reference = (ROOT / "numpy_attn" / "_checks.py").read_text()
    path = ROOT / package / "_checks.py"
    if not path.exists():
        pytest.skip(f"{package} has no _checks.py yet")
    assert path.read_text() == reference, f"{package}/_checks.py differs from numpy_attn's"


@pytest.mark.parametrize("package", BACKEND_PACKAGES)
def test_backends_mirror_file_names(package):
    reference = sorted(p.name for p in (ROOT / "numpy_attn").glob("*.py"))
    files = sorted(p.name for p in (ROOT / package).glob("*.py"))
    extras = {"interop.py"} if package == "torch_attn" else set()
    assert sorted(set(files) - extras) == reference
    assert (ROOT / package / "py.typed").exists()


def test_spec_doc_is_generated_from_spec():
    committed = (ROOT / "docs" / "spec.md").read_text(encoding="utf-8")
    assert committed == specdoc.render(), "run `python -m conformance spec --write`"
