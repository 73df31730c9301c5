"""A fixed sample of mutants of the harness's tolerance rule and diagnoses and of numpy_attn's
KV cache, run by mutmut and killed (docs/mutation.md).

The whole mutation run takes too long for CI (docs/mutation.md gives its command and figures);
this runs mutmut itself (the pinned version of requirements-test.txt) on a few named mutants,
in a copy of the packages in a temporary folder whose ``[tool.mutmut]`` selects only the fast tests
of ``tests/test_compare.py``, ``tests/test_diagnose.py`` and the NumPy tests of
``tests/test_kv_cache.py``, the tests written against those mutants. Each named mutant must
end ``killed``: a test that stops killing one fails here. A test file of its own (not a step
of ``.ci/run``): ``python -m pytest`` runs it like any other, and it is skipped where mutmut
is not installed. 10 to 20 s on 2 cores (copy, mutant
generation for three files, one run of the three test files to map tests to functions, a clean
run, one forced failure, then the mutants two at a time), under a 240 s limit on a quiet
machine (``subprocesses.timeout``: longer under load); marked ``slow``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from subprocesses import timeout

pytest.importorskip("mutmut", reason="pip install -r requirements-test.txt")

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("numpy_attn", "jax_attn", "torch_attn", "conformance", "attention_rules")
TESTS = ("conftest.py", "subprocesses.py", "test_compare.py", "test_diagnose.py",
         "test_kv_cache.py")

#: mutant name -> the mistake it plants (mutmut numbers the mutants of a function in order: a
#: change to one of these functions may renumber them; then pick the sample again from
#: ``mutmut results --all``)
SAMPLE = {
    "conformance.comparing.compare.x_bound__mutmut_1": "no tolerance row (tol = None)",
    "conformance.comparing.compare.x_compare__mutmut_20": "a shape mismatch passes",
    "conformance.comparing.compare.x_compare__mutmut_149": "a ratio of exactly 1 fails (< for <=)",
    "conformance.diagnosing.diagnose.x__no_rescale__mutmut_7":
        "value / (1 - p) for value * (1 - p)",
    "conformance.diagnosing.diagnose.x__scale_as__mutmut_17":
        "head_dim read from the sequence axis",
    "conformance.diagnosing.diagnose.x_paged_mistakes__mutmut_2": "the shift -1 never tried",
    "conformance.diagnosing.diagnose.x_paged_mistakes__mutmut_45":
        "garbage pages' error not rescaled",
    "numpy_attn.kv_cache.xǁKVCacheǁappend__mutmut_24": "n read from axis 2 (unbatched keys)",
    "numpy_attn.kv_cache.x_decode_step__mutmut_13": "sinks dropped on a paged cache",
    "numpy_attn.kv_cache.x_decode_step__mutmut_29": "a new cache in float64, not the keys' dtype",
    "numpy_attn.kv_cache.x_decode_step__mutmut_72": "sinks dropped on the split-KV path",
}

PYPROJECT = """\
[tool.pytest.ini_options]
testpaths = ["tests"]

[tool.mutmut]
source_paths = {packages}
only_mutate = ["conformance/comparing/compare.py", "conformance/diagnosing/diagnose.py",
               "numpy_attn/kv_cache.py"]
pytest_add_cli_args_test_selection = ["tests/test_compare.py", "tests/test_diagnose.py",
                                      "tests/test_kv_cache.py", "-k", "not torch and not jax"]
pytest_add_cli_args = ["-p", "no:cacheprovider"]
use_git_change_detection = false
"""


@pytest.mark.slow
def test_the_sampled_mutants_are_killed(tmp_path: Path) -> None:
    from mutmut.stats import status_by_exit_code

    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=ignore)
    (tmp_path / "tests").mkdir()
    for name in TESTS:
        shutil.copy2(ROOT / "tests" / name, tmp_path / "tests" / name)
    (tmp_path / "pyproject.toml").write_text(
        PYPROJECT.format(packages=json.dumps(list(PACKAGES))), encoding="utf-8")
    run = subprocess.run(
        [sys.executable, "-c", "import sys; from mutmut.__main__ import cli; "
         "sys.argv[0] = 'mutmut'; cli()", "run", "--max-children", "2", *SAMPLE],
        cwd=tmp_path, capture_output=True, text=True, timeout=timeout(240),
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    status = {}
    for module in ("conformance/comparing/compare", "conformance/diagnosing/diagnose",
                   "numpy_attn/kv_cache"):
        meta = tmp_path / "mutants" / f"{module}.py.meta"
        codes = json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"]
        status.update({name: status_by_exit_code[code] for name, code in codes.items()})
    assert {name: status.get(name, "missing") for name in SAMPLE} == dict.fromkeys(
        SAMPLE, "killed")

