"""Shared by the harness tests (``tests/test_harness_*.py``): the expected values of a case in
a dtype, computed once per test session whichever files ask for them."""

from __future__ import annotations

import functools

from conformance import cases, expected

NEEDS_HYPOTHESIS = "needs hypothesis: pip install -e '.[test]'"


@functools.cache
def _expected(case: str, dtype: str) -> expected.Expected:
    return expected.expected(cases.get(case), dtype)


__all__ = ["NEEDS_HYPOTHESIS", "_expected"]
