"""Numerical helpers shared by the gradient tests."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def finite_differences(loss: Callable[[], float], x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of ``loss()`` with respect to every element of ``x`` (changed in
    place and restored): ``(loss(x + eps) - loss(x - eps)) / (2 eps)``, shaped like ``x``."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        old = x[index]
        x[index] = old + eps
        up = loss()
        x[index] = old - eps
        down = loss()
        x[index] = old
        grad[index] = (up - down) / (2 * eps)
    return grad
