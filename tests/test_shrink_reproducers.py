"""The smallest failing case of a checked module (``conformance.reporting.shrink``) as a script
that reproduces the failure wherever it is saved and run: it puts the folder the module imports
from on ``sys.path`` (``import_folder``: from the module's file and dotted name), and a failure
seen only in bfloat16 shrinks to a bfloat16 case (every floating array cast to a wider dtype,
bfloat16's NumPy kind "V" too), whose script still fails.
"""

from __future__ import annotations

import contextlib
import gc
import io
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from subprocesses import timeout

import numpy_attn
from conformance.cases import catalogue
from conformance.cases.expected import Expected, expected_for
from conformance.reporting import shrink
from conformance.running import backends, runner

#: A plugin with a planted bug (``examples/wrong_attention.py`` is the contract's example).
SQUARED_SCALE = '''
    """numpy_attn, but the default scale is 1 / head_dim, not 1 / sqrt(head_dim)."""
    import numpy_attn


    def scaled_dot_product_attention(query, key, value, *, scale=None, **kwargs):
        scale = 1.0 / query.shape[-1] if scale is None else scale  # the planted bug
        return numpy_attn.scaled_dot_product_attention(query, key, value, scale=scale, **kwargs)
'''


def _smallest_reproducer(backend: backends.Backend, case: str, dtype: str
                         ) -> tuple[Expected, str]:
    """The first failing step of ``case`` in ``dtype`` shrunk as the focused report shrinks
    it, and its script."""
    exp = expected_for(catalogue.prepare_inputs(catalogue.get(case), dtype), "sdpa", dtype, case)
    cell = runner.run_cell(backend, exp)
    step = next(s.step for s in cell.steps if s.error or not s.passed)
    small = shrink.shrink(backend, exp, [step], cell.status,
                          cell.reasons[0] if cell.reasons else "")
    return small, shrink.reproducer(backend, small, step)


def _printed(output: str) -> tuple[str, str]:
    """The script's two lines: what the module gave, the float64 reference."""
    actual, expected = (line.split(":", 1)[1].strip() for line in output.splitlines())
    return actual, expected


@pytest.mark.slow
def test_a_checked_modules_reproducer_runs_from_any_folder(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch):
    src = tmp_path / "src"
    (src / "planted_scale").mkdir(parents=True)
    (src / "planted_scale" / "__init__.py").write_text("")
    (src / "planted_scale" / "attention.py").write_text(textwrap.dedent(SQUARED_SCALE))
    monkeypatch.syspath_prepend(str(src))  # the harness imports it as `--backend` would
    name = "planted_scale.attention"
    try:
        _, code = _smallest_reproducer(backends.load(name), "self", "float32")
    finally:
        backends.unregister(name)
        gc.collect()  # its worker process ends
    assert backends.import_folder(name) == str(src.resolve())
    assert f"sys.path.insert(0, {str(src.resolve())!r})" in code
    saved, elsewhere = tmp_path / "saved" / "repro.py", tmp_path / "elsewhere"
    saved.parent.mkdir()
    elsewhere.mkdir()
    saved.write_text(code)
    ran = subprocess.run([sys.executable, str(saved)], cwd=elsewhere, capture_output=True,
                         text=True, timeout=timeout(120))
    assert ran.returncode == 0, ran.stderr
    actual, expected = _printed(ran.stdout)
    assert actual != expected, ran.stdout  # the failure, shown
    saved.write_text("\n".join(line for line in code.splitlines() if "sys.path" not in line))
    unfixed = subprocess.run([sys.executable, str(saved)], cwd=elsewhere, capture_output=True,
                             text=True, timeout=timeout(120))
    assert "planted_scale" in unfixed.stderr  # without the line the module is not found


def test_import_folder_from_a_modules_file_and_dotted_name(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "pkg_for_folder" / "sub").mkdir(parents=True)
    for init in ("pkg_for_folder", "pkg_for_folder/sub"):
        (tmp_path / init / "__init__.py").write_text("")
    (tmp_path / "pkg_for_folder" / "sub" / "attention.py").write_text("")
    (tmp_path / "flat_for_folder.py").write_text("")
    (tmp_path / "namespace_for_folder").mkdir()  # no __init__.py
    (tmp_path / "namespace_for_folder" / "attention.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    root = str(tmp_path.resolve())
    for name in ("flat_for_folder", "pkg_for_folder", "pkg_for_folder.sub.attention",
                 "namespace_for_folder.attention"):
        assert backends.import_folder(name) == root, name  # found on sys.path, not imported
        assert name not in sys.modules
    assert backends.import_folder("numpy_attn._steps") == str(
        Path(numpy_attn.__file__).resolve().parents[1])  # imported: from its __file__
    assert backends.import_folder("no_such_module_anywhere") is None


def _bf16_scale_bug(query: Any, key: Any, value: Any, **kwargs: Any) -> Any:
    """numpy_attn, but bfloat16 inputs lose the scale."""
    if query.dtype.name == "bfloat16":
        kwargs["scale"] = 1.0  # the planted bug
    return numpy_attn.scaled_dot_product_attention(query, key, value, **kwargs)


def test_a_failure_only_in_bfloat16_shrinks_to_a_bfloat16_case_that_still_fails():
    name = "planted_bf16_scale"
    module = types.ModuleType(name)
    module.scaled_dot_product_attention = _bf16_scale_bug
    backend = backends.register(backends.from_module(module, name=name))
    try:
        small, code = _smallest_reproducer(backend, "self", "bfloat16")
        assert small.dtype == "bfloat16"
        assert {x.dtype.name for x in small.data.arrays.values()} == {"bfloat16"}
        assert "dtype = backends.numpy_dtype('bfloat16')" in code
        assert small.data.arrays["query"].shape[-1] > 1  # a scale of 1 / sqrt(1) shows nothing
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "<reproducer>", "exec"), {})
        actual, expected = _printed(printed.getvalue())
        assert actual != expected, code
        for dtype in ("float32", "float64"):  # the wider dtypes pass: the shrink kept bfloat16
            wider = {n: catalogue.cast(x.astype(np.float64), dtype)
                     for n, x in small.data.arrays.items()}
            assert runner.run_cell(backend, expected_for(catalogue.CaseData(
                wider, small.data.options), "sdpa", dtype, "self")).status == "ok"
    finally:
        backends.unregister(name)
