"""Packaging promises: NumPy-only imports stay NumPy-only."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("jax", "torch", "matplotlib", "hypothesis")


@pytest.mark.parametrize(
    "module", ["numpy_attn", "conformance", "conformance.backends", "conformance.reference"]
)
def test_import_pulls_in_no_framework(module):
    code = (
        f"import sys, {module}; "
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"import {module} imported {result.stdout.strip()}"


def test_backends_import_no_other_backend():
    for package in ("numpy_attn", "jax_attn", "torch_attn"):
        others = [p for p in ("numpy_attn", "jax_attn", "torch_attn", "conformance")
                  if p != package]
        code = (
            f"import sys\ntry:\n    import {package}\nexcept ImportError:\n    pass\n"
            f"print(','.join(m for m in {others!r} if m in sys.modules))"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        assert result.stdout.strip() == "", f"{package} imported {result.stdout.strip()}"
