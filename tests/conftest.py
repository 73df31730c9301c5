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


@pytest.fixture(params=["fast", "explicit"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """torch_attn's route: ``"fast"`` as it stands, ``"explicit"`` with the fast path switched
    off (``_fast.use_fast_path`` selects nothing). Shared by the torch autograd and fast-path
    tests; torch is imported only by a test that asks for it."""
    if request.param == "explicit":
        from torch_attn import _fast

        monkeypatch.setattr(_fast, "use_fast_path", lambda *args, **kwargs: None)
    return request.param
