"""Errors conform too: every bad input of ``spec.ERRORS`` on every installed backend."""

from __future__ import annotations

import pytest

from conformance import backends, errors, spec


def test_every_error_rule_has_a_case() -> None:
    covered = {case.rule for case in errors.ERROR_CASES}
    assert covered == set(spec.ERRORS)


@pytest.mark.parametrize("case", errors.ERROR_CASES, ids=lambda c: c.name)
def test_bad_input_raises_the_spec_error(backend: backends.Backend, case: errors.ErrorCase) -> None:
    result = errors.check(backend, case)
    assert result.passed, f"{backend.name} {case.name}: {result.problem} ({result.message!r})"


@pytest.mark.parametrize("case", errors.ERROR_CASES, ids=lambda c: c.name)
def test_messages_agree_across_backends(case: errors.ErrorCase) -> None:
    installed = [backends.get(n) for n in backends.SPEC_BACKENDS if backends.get(n).available()]
    messages = {b.name: errors.check(b, case).message for b in installed}
    assert len(set(messages.values())) == 1, messages
