"""Shared fixtures: every behavioural test runs on each backend that is installed.

CI installs all three frameworks, so nothing is skipped there; a NumPy-only machine runs the
NumPy backend and skips the others with the command that installs them.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance import backends

BACKEND_NAMES = backends.SPEC_BACKENDS


@pytest.fixture(params=BACKEND_NAMES)
def backend(request: pytest.FixtureRequest) -> backends.Backend:
    """A backend adapter (numpy, jax, torch); skipped when its framework is missing."""
    adapter = backends.get(request.param)
    if not adapter.available():
        pytest.skip(f"{request.param} not installed ({adapter.install})")
    return adapter


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261130)
