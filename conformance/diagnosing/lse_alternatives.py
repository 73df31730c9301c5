"""The alternative semantics of the row log-sum-exp (the ``lse`` step) that explain a peer's
known difference (``spec.KNOWN_DIFFERENCES``; ``alternatives`` applies them, after
the input and row stages, in this order):

* ``lse_masking_fill``: a fully masked row's lse is the log-sum-exp of the finite fill jax.nn
  puts in masked logits, not ``-inf``;
* ``lse_plus_inf``: a row with a ``+inf`` score has lse ``+inf``, not NaN;
* ``lse_input_dtype``: the lse is rounded to, and returned in, the input dtype.

Each takes the float64 lse ``(..., heads, q_len)`` of the (transformed) case, its float64 masked
scores ``(..., heads, q_len, kv_len)`` and the results' dtype name, and returns the lse under
the alternative, in float64.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..cases.dtypes import numpy_dtype

#: jax.nn's fill for masked logits: ``-0.7 · finfo(float32).max``, whatever the input dtype.
JAX_MASK_FILL = -0.7 * float(np.finfo(np.float32).max)


def lse_masking_fill(lse: np.ndarray, masked_scores: np.ndarray, result: str) -> np.ndarray:
    """A fully masked row's lse is that of its filled logits, ``JAX_MASK_FILL + log(kv_len)``
    in float32, as jax.nn computes it (about -2.4e38, finite; ``log(kv_len)`` is lost in the
    rounding), not ``-inf``; a merge still weighs such a part 0, but a check for ``-inf`` (no
    key) misses it."""
    empty = np.isneginf(masked_scores).all(-1)  # (..., heads, q_len)
    fill = np.float32(JAX_MASK_FILL) + np.log(np.float32(masked_scores.shape[-1]))
    return np.where(empty, float(fill), lse)


def lse_plus_inf(lse: np.ndarray, masked_scores: np.ndarray, result: str) -> np.ndarray:
    """A row with a ``+inf`` score has lse ``+inf`` (the log of an infinite sum), not the NaN of
    the spec's IEEE rule (``inf - inf`` once the row maximum is subtracted)."""
    return np.where((masked_scores == np.inf).any(-1), np.inf, lse)


def lse_input_dtype(lse: np.ndarray, masked_scores: np.ndarray, result: str) -> np.ndarray:
    """The lse rounded to the input dtype ``result`` (and returned in it) instead of kept in the
    compute dtype (float32 for half inputs): float16 rounds a fill beyond its range to
    ``-inf``."""
    with np.errstate(over="ignore"):
        return lse.astype(numpy_dtype(result)).astype(np.float64)


LseRule = Callable[[np.ndarray, np.ndarray, str], np.ndarray]

#: The lse alternatives, in the order a combination applies them.
LSE_STAGE: dict[str, LseRule] = {
    "lse_masking_fill": lse_masking_fill, "lse_plus_inf": lse_plus_inf,
    "lse_input_dtype": lse_input_dtype}

__all__ = ["JAX_MASK_FILL", "LSE_STAGE", "LseRule", "lse_input_dtype", "lse_masking_fill",
           "lse_plus_inf"]
