"""Shared by the harness tests (``tests/test_harness_*.py``): the expected values of a case in
a dtype, computed once per test session whichever files ask for them; numpy_attn as a checked
module with some functions replaced (a planted bug) or left out; and the check that the harness
catches a planted bug exactly where it should and names it."""

from __future__ import annotations

import functools
import types
from typing import Any

import numpy_attn
from conformance import spec
from conformance.cases import catalogue as cases
from conformance.cases import expected
from conformance.running import backends, runner

NEEDS_HYPOTHESIS = "needs hypothesis: pip install -e '.[test]'"


@functools.cache
def _expected(case: str, dtype: str) -> expected.Expected:
    return expected.expected(cases.get(case), dtype)


def fake_numpy(name: str, drop: tuple[str, ...] = (), **overrides: object) -> backends.Backend:
    """numpy_attn as a checked module named ``name``, without ``drop``, with ``overrides``."""
    module = types.ModuleType(name)
    for fn in spec.FUNCTIONS + spec.MODULES:
        if hasattr(numpy_attn, fn) and fn not in drop:
            setattr(module, fn, getattr(numpy_attn, fn))
    for key, value in overrides.items():
        setattr(module, key, value)
    return backends.from_module(module, name=name)


def check_planted_bug(bug: str, overrides: dict[str, Any], must_fail: set[str],
                      must_pass: set[str], words: str) -> dict[tuple[str, str], Any]:
    """numpy_attn with ``overrides`` (the bug) in float64 and float32: exactly the cases
    ``must_fail`` fail (of those and ``must_pass``), each naming ``words`` with its rerun
    command. Returns the failing cells by ``(case, dtype)`` for checks of their own."""
    fake = fake_numpy(f"fake_{bug}", **overrides)
    failing = {}
    for dtype in ("float64", "float32"):
        cells = {c: runner.run_cell(fake, _expected(c, dtype)) for c in must_fail | must_pass}
        failed = {c for c, cell in cells.items() if cell.status != "ok"}
        assert failed == must_fail, f"{bug} {dtype}: failed {sorted(failed)}"
        for c in must_fail:
            assert words in cells[c].detail, f"{bug} {dtype} {c}: {cells[c].detail}"
            assert f"--case {c} --dtype {dtype} --backend fake_{bug}" in cells[c].rerun
            failing[c, dtype] = cells[c]
    return failing


__all__ = ["NEEDS_HYPOTHESIS", "_expected", "check_planted_bug", "fake_numpy"]
