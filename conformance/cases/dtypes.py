"""The dtypes a case runs in, by name, and their NumPy dtypes (bfloat16 from ``ml_dtypes``).

Every input is generated once with NumPy in a case's dtype; the backends' adapters
(``running.backends``) hand the same bits to each framework.
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:  # bfloat16 for NumPy
    import ml_dtypes

    BFLOAT16: Any = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a hard dependency
    BFLOAT16 = None

#: Every dtype a case runs in, in the report's order.
DTYPES = ("float64", "float32", "bfloat16", "float16")


def numpy_dtype(name: str) -> np.dtype:
    """NumPy dtype for a dtype name (bfloat16 from ml_dtypes)."""
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


__all__ = ["BFLOAT16", "DTYPES", "numpy_dtype"]
