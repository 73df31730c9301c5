"""Inputs of the direct tests of ``conformance.diagnosing.diagnose``
(``tests/test_diagnose_planted_mistakes.py``, ``tests/test_diagnose_result_rows.py``): the
expected values of small cases, and the float64 reference with a mistake planted."""

from __future__ import annotations

from functools import cache

from conformance.cases import catalogue as cases
from conformance.cases import expected, reference
from conformance.cases.catalogue import CaseData
from conformance.diagnosing import diagnose


@cache
def expected_of(name: str, dtype: str = "float32", gradients: bool = False
                ) -> expected.Expected:
    """The expected values of the catalogue case ``name`` in ``dtype`` (shared: read only)."""
    data = cases.prepare_inputs(cases.get(name), dtype)
    return expected.expected_for(data, cases.get(name).kind, dtype, name, gradients=gradients)


def expected_for_arrays(arrays: dict, dtype: str = "float64", **options: object
                        ) -> expected.Expected:
    """The expected values of an sdpa case built by hand (arrays already in ``dtype``), no
    gradients."""
    return expected.expected_for(CaseData(arrays, dict(options)), "sdpa", dtype,
                                 gradients=False)


def attend(exp: expected.Expected, **change: object) -> reference.Steps:
    """The float64 reference on ``exp``'s inputs with arrays or options changed (a value of
    None drops that input): the result of a backend that makes that mistake."""
    kw = {k: v for k, v in {**exp.data.arrays, **exp.data.options}.items()
          if k not in ("grad_output", "kv_lengths")}  # kv_lengths: already in the mask
    kw.update(change)
    kw = {k: v for k, v in kw.items() if v is not None}
    return reference.attention(kw.pop("query"), kw.pop("key"), kw.pop("value"), **kw)


def names(text: str) -> list[str]:
    """The short names of the diagnoses ``diagnose`` joined in ``text``."""
    return [diagnose.short(r) for r in diagnose.split(text)]
