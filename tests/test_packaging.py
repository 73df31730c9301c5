"""Packaging promises: NumPy-only imports stay NumPy-only, the rules stay standard-library only,
and no backend imports another (each is imported for real: an ImportError fails the test)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from subprocesses import timeout

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("jax", "torch", "matplotlib", "hypothesis")
BACKENDS = ("numpy_attn", "jax_attn", "torch_attn")


def _no_framework(module: str) -> str:
    return f"import sys, {module}; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"


def _no_other_backend(package: str) -> str:
    others = [p for p in BACKENDS + ("conformance",) if p != package]
    return f"import sys, {package}; print(','.join(m for m in {others!r} if m in sys.modules))"


RULES_ONLY = (
    "import sys; before = set(sys.modules); import attention_rules; "
    "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
    "std = set(sys.stdlib_module_names) | {'attention_rules'}; "
    "print(','.join(sorted(new - std)))"
)
IMPORTERS = ("numpy_attn", "conformance", "conformance.running.backends",
             "conformance.cases.reference")


def _run(code: str) -> str:
    """``python -c code`` in a fresh interpreter; its stdout (a failure fails the test)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=timeout(120))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.slow
@pytest.mark.parametrize("module", IMPORTERS)
def test_import_pulls_in_no_framework(module):
    loaded = _run(_no_framework(module))
    assert loaded == "", f"import {module} imported {loaded}"


@pytest.mark.slow
def test_the_rules_import_the_standard_library_only():
    assert _run(RULES_ONLY) == "", "attention_rules imported a module outside the standard library"
    for path in sorted((ROOT / "attention_rules").glob("*.py")):  # and says so in its source
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith(("import ", "from ")) and not line.startswith("from ."):
                top = line.split()[1].split(".")[0]
                assert top in sys.stdlib_module_names, f"{path.name}: {line}"


@pytest.mark.slow
@pytest.mark.parametrize("package", BACKENDS)
def test_backends_import_no_other_backend(package):
    if package == "jax_attn":
        pytest.importorskip("jax")
    if package == "torch_attn":
        pytest.importorskip("torch")
    loaded = _run(_no_other_backend(package))
    assert loaded == "", f"{package} imported {loaded}"


TORCH_HEAVY = ("torch._dynamo", "torch.nn.attention.bias", "torch.nn.attention.flex_attention")


@pytest.mark.slow
def test_torch_attn_import_stays_as_light_as_torch():
    """``import torch_attn`` imports torch's compiler stack only when a call needs it (it would
    double the import's cost): ``torch.nn.attention.bias`` pulls in ``torch._dynamo``."""
    pytest.importorskip("torch")
    loaded = _run(f"import sys, torch_attn; "
                  f"print(','.join(m for m in {TORCH_HEAVY!r} if m in sys.modules))")
    assert loaded == "", f"import torch_attn imported {loaded}"


def test_rules_and_backends_are_packaged():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    found = text.split("[tool.setuptools.packages.find]")[1].split("\n\n")[0]
    for package in ("attention_rules",) + BACKENDS + ("conformance",):
        assert f'"{package}"' in found and f'"{package}.*"' in found, package  # subpackages too
        assert (ROOT / package / "py.typed").exists()
        assert f'{package} = ["py.typed"]' in text


PACKAGES = ("attention_rules",) + BACKENDS + ("conformance",)
SUBPACKAGES = ("conformance.spec", "conformance.peers", "conformance.context_parallel",
               "conformance.teaching", "conformance.cases", "conformance.comparing",
               "conformance.diagnosing", "conformance.running", "conformance.reporting",
               "conformance.reporting.html", "jax_attn.integrations", "torch_attn.integrations")


def _check(command: list[str], **kwargs) -> str:
    """Run ``command`` (at most 120 s on a quiet machine); its stdout (a failure fails the
    test)."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout(120),
                            **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.slow
def test_the_wheel_installs_and_runs_the_harness_outside_the_repository(tmp_path: Path):
    """The wheel, built from a copy of the sources, holds every package and subpackage,
    ``py.typed`` and the LICENSE; installed (no dependencies) into a fresh venv without system
    site packages, it runs ``python -m conformance`` from outside the repository. NumPy and
    ml_dtypes reach the venv through a ``.pth`` naming their directories: a plain directory in a
    ``.pth`` is added to ``sys.path`` without running the ``.pth`` files in it, so the editable
    install of this project (a ``.pth`` with a finder, in the main environment) stays off."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = tmp_path / "wheels"
    _check([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
            "--no-index", "-q", "-w", str(wheels)], cwd=tmp_path)
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)
    for package in PACKAGES + SUBPACKAGES:
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    assert {f"{package}/py.typed" for package in PACKAGES} <= names

    venv = tmp_path / "venv"
    _check([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = Path(_check([str(python), "-c", "import sysconfig; "
                        "print(sysconfig.get_paths()['purelib'])"]).strip())
    _check([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
            "--target", str(site), str(wheel)])
    deps = {str(Path(importlib.util.find_spec(m).origin).parent.parent)
            for m in ("numpy", "ml_dtypes")}
    (site / "main_environment_numpy.pth").write_text("\n".join(sorted(deps)) + "\n")

    outside = tmp_path / "outside"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    where = _check([str(python), "-c", "import conformance, numpy_attn; "
                    "print(conformance.__file__); print(numpy_attn.__file__)"],
                   cwd=outside, env=env).split()
    for path in map(Path, where):
        assert path.is_relative_to(site) and not path.is_relative_to(ROOT), path
    assert Path(sysconfig.get_paths()["purelib"]) != site
    out = _check([str(python), "-m", "conformance", "--backend", "numpy", "--case", "self",
                  "--dtype", "float32", "--no-peers"], cwd=outside, env=env)
    assert "PASS: 1/1 backend cells pass" in out, out
