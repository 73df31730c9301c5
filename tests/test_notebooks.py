"""The notebooks of ``learn/`` run from top to bottom, and are committed without outputs.

Each notebook asserts its own claims (the article's printed numbers, the √d_k saturation, the
overflow, token shuffling, the fused multi-head module, the ten sharp bits), so running it is
the test. ``article_walkthrough.ipynb`` runs once per installed backend, its ``parameters``
cell replaced as papermill would; ``sharp_bits.ipynb`` needs jax and torch. The kernel is this
interpreter (``sys.executable -m ipykernel_launcher``), whatever kernelspecs are installed.
The runs are marked ``slow``; a cell's time limit grows with the machine's load
(``subprocesses.timeout``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from subprocesses import timeout

LEARN = Path(__file__).resolve().parent.parent / "learn"
NOTEBOOKS = ("article_walkthrough.ipynb", "sharp_bits.ipynb")
CELL_TIMEOUT_S = 120
STARTUP_TIMEOUT_S = 60  # the kernel's start (nbclient's default)
NEEDS = ("nbclient", "nbformat", "ipykernel")


def _jax_cache() -> dict[str, str]:
    """The harness's persistent JAX compilation cache
    (``conformance.running.backends.jax_cache_env``), as JAX's environment variables: a second
    run compiles nothing."""
    from conformance.running import backends

    return backends.jax_cache_env()


KERNEL_ENV = {"MPLBACKEND": "Agg", **_jax_cache()}


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def execute(name: str, parameters: str | None = None) -> None:
    """Run ``learn/<name>`` in a fresh kernel of this interpreter (cwd ``learn/``); a failing
    cell raises ``nbclient.exceptions.CellExecutionError`` with its traceback."""
    missing = _missing(*NEEDS)
    if missing:
        pytest.skip(f"running the notebooks needs {', '.join(missing)} "
                    "(pip install -r requirements-test.txt)")
    import nbformat
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    class ThisInterpreter(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
            return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f",
                                    "{connection_file}"], display_name="this interpreter",
                              language="python", env=KERNEL_ENV)

    nb = nbformat.read(LEARN / name, as_version=4)
    if parameters is not None:
        cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
        cell.source = parameters
    km = KernelManager(kernel_name="here", kernel_spec_manager=ThisInterpreter())
    try:
        NotebookClient(nb, km=km, timeout=round(timeout(CELL_TIMEOUT_S)),
                       startup_timeout=round(timeout(STARTUP_TIMEOUT_S)),
                       resources={"metadata": {"path": str(LEARN)}}).execute()
    finally:  # nbclient leaves a kernel it was given running (0.1-0.7 GB each)
        if km.has_kernel:
            km.shutdown_kernel(now=True)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "jax", "torch"])
def test_the_article_walkthrough_runs_in_each_backend(backend):
    framework = {"numpy": "numpy", "jax": "jax", "torch": "torch"}[backend]
    if _missing(framework, "matplotlib"):
        pytest.skip(f"needs {framework} and matplotlib (pip install -r requirements-test.txt)")
    execute("article_walkthrough.ipynb", f'BACKEND = "{backend}"')


@pytest.mark.slow
def test_the_sharp_bits_run_and_hold():
    missing = _missing("jax", "torch")
    if missing:
        pytest.skip(f"the sharp bits compare jax and torch: pip install {' '.join(missing)}")
    execute("sharp_bits.ipynb")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebooks_are_committed_without_outputs(name):
    nb = json.loads((LEARN / name).read_text(encoding="utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    asserted = sum("assert" in "".join(c["source"]) for c in code)
    assert asserted >= (7 if name == "article_walkthrough.ipynb" else 10)  # claims, checked
