"""Packaging promises: NumPy-only imports stay NumPy-only, the rules stay standard-library only,
and no backend imports another (each is imported for real: an ImportError fails the test)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("jax", "torch", "matplotlib", "hypothesis")
BACKENDS = ("numpy_attn", "jax_attn", "torch_attn")


def _run(code: str) -> str:
    """``python -c code`` in a fresh interpreter; its stdout (a failure fails the test)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.parametrize(
    "module", ["numpy_attn", "conformance", "conformance.backends", "conformance.reference"]
)
def test_import_pulls_in_no_framework(module):
    code = f"import sys, {module}; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    loaded = _run(code)
    assert loaded == "", f"import {module} imported {loaded}"


def test_the_rules_import_the_standard_library_only():
    code = (
        "import sys; before = set(sys.modules); import attention_rules; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "std = set(sys.stdlib_module_names) | {'attention_rules'}; "
        "print(','.join(sorted(new - std)))"
    )
    assert _run(code) == "", "attention_rules imported a module outside the standard library"
    for path in sorted((ROOT / "attention_rules").glob("*.py")):  # and says so in its source
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith(("import ", "from ")) and not line.startswith("from ."):
                top = line.split()[1].split(".")[0]
                assert top in sys.stdlib_module_names, f"{path.name}: {line}"


@pytest.mark.parametrize("package", BACKENDS)
def test_backends_import_no_other_backend(package):
    if package == "jax_attn":
        pytest.importorskip("jax")
    if package == "torch_attn":
        pytest.importorskip("torch")
    others = [p for p in BACKENDS + ("conformance",) if p != package]
    loaded = _run(
        f"import sys, {package}; print(','.join(m for m in {others!r} if m in sys.modules))"
    )
    assert loaded == "", f"{package} imported {loaded}"


def test_rules_and_backends_are_packaged():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for package in ("attention_rules",) + BACKENDS:
        assert f'"{package}"' in text.split("[tool.setuptools]")[1].split("\n")[1], package
        assert (ROOT / package / "py.typed").exists()
        assert f'{package} = ["py.typed"]' in text
