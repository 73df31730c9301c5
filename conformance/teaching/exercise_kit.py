"""The parts of the graded exercises of ``learn/`` (``exercise_catalogue`` lists them).

An ``Exercise`` names the function a learner writes (in NumPy, JAX or PyTorch: ``learn/``), the
``Check``s that grade it — inputs drawn from the article's worked example
(``spec.seed_example``) and from a seeded generator, every input float32, each with its float64
expected value and the baseline error ``e`` of the harness's tolerance rule
(``compare.compare``: ``|actual − expected| ≤ atol + k·e``) — and the ``Mistake``s the grader
recognises: each a classic mistake planted into an independent float64 (or, for overflow,
float32) computation, named when the learner's result matches it.

Expected values come from the harness's own float64 pipeline where the exercise is a piece of
it (``expected.expected_for``: scores, weights, outputs, the multi-head wrapper), otherwise from
a float64 formula of the catalogue (context vectors, the zero-and-renormalise causal method) or
an explicit Jacobian (softmax's gradient). ``e`` is never below one rounding of the largest
result plus one of the largest sum of absolute products (``floor``): a learner's float32 code
that sums in another order than the naive baseline still passes, while every planted mistake
stays far outside the bound. ``to_backend``, ``is_native`` and ``to_numpy`` move a check's
arrays to the learner's framework and back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cases.catalogue import CaseData
from ..cases.expected import Expected, expected_for
from ..cases.naive import Precision
from ..spec import seed_example
from .exercise_child import is_native, to_backend, to_numpy

DTYPE = "float32"
UNIT = Precision(DTYPE).unit
SEED = 20261201


@dataclass(frozen=True)
class Check:
    """One call of the learner's function and what it must return.

    ``args`` are NumPy arrays (float32 or bool, converted to the backend's arrays) and Python
    scalars (passed as they are); ``expected`` is float64; ``zeros`` marks positions that must
    be exactly 0; ``exp`` is the harness's ``Expected`` where the check is an sdpa case (its
    ``diagnose`` then adds its reasons), ``step`` the compared step there.
    """

    name: str
    args: tuple[Any, ...]
    expected: np.ndarray
    baseline: float
    hint: str = ""
    zeros: np.ndarray | None = None
    exp: Expected | None = field(default=None, repr=False)
    step: str = ""
    mistake: Mistake | None = None


@dataclass(frozen=True)
class Mistake:
    """A classic mistake: ``compute(*args)`` gives the results it would produce (float64 arrays;
    several when the mistake may end in NaN or in 0), or an empty list where it cannot show."""

    key: str
    says: str
    hint: str
    compute: Callable[..., list[np.ndarray]]


@dataclass(frozen=True)
class Exercise:
    """One step of the sequence: the learner's function, its checks and known mistakes."""

    number: int
    slug: str
    function: str
    title: str
    build: Callable[[], list[Check]]
    mistakes: tuple[Mistake, ...]
    hint: str

    @property
    def stem(self) -> str:
        """The file name of its stub and solution, without ``.py``: ``ex03_softmax``."""
        return f"ex{self.number:02d}_{self.slug}"

    @functools.cached_property
    def checks(self) -> list[Check]:
        """The checks, built once."""
        return self.build()


# --------------------------------------------------------------------------- inputs


def f32(x: Any) -> np.ndarray:
    """``x`` as a float32 array (through float64, so lists of Python floats round once)."""
    return np.asarray(x, np.float64).astype(np.float32)


def f64(x: Any) -> np.ndarray:
    """``x`` as a float64 array (a copy)."""
    return np.asarray(x).astype(np.float64)


def rng_for(number: int) -> np.random.Generator:
    """The seeded generator of exercise ``number``'s random inputs."""
    return np.random.default_rng(SEED + number)


def softmax64(s: np.ndarray) -> np.ndarray:
    """Softmax over the last axis in float64 (finite rows only)."""
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@functools.cache
def article() -> dict[str, np.ndarray]:
    """The article's projections of ``'Life is short, eat dessert first'``, float32:
    ``queries``, ``keys`` (6 × 2), ``values`` (6 × 4), ``weights`` = softmax(ω / √2) (6 × 6),
    the cross-attention's ``cross_weights`` (6 × 8) and ``cross_values`` (8 × 4), and the
    embedding ``x`` (6 × 3)."""
    x = f64(seed_example.EMBEDDING)
    w = {n: f64(a) for n, a in seed_example.self_attention_weights().items()}
    q, k, v = x @ w["W_query"], x @ w["W_key"], x @ w["W_value"]
    x2 = f64(seed_example.cross_second_input())
    return {"x": f32(x), "queries": f32(q), "keys": f32(k), "values": f32(v),
            "weights": f32(softmax64(q @ k.T / np.sqrt(2))),
            "cross_weights": f32(softmax64(q @ (x2 @ w["W_key"]).T / np.sqrt(2))),
            "cross_values": f32(x2 @ w["W_value"])}


def floor(expected: np.ndarray, magnitude: np.ndarray | float = 0.0) -> float:
    """The least baseline error: one rounding of the largest finite result and one of the
    largest ``magnitude`` (a sum of absolute products, e.g. ``|A| @ |B|``)."""
    finite = expected[np.isfinite(expected)]
    return UNIT * (float(np.max(np.abs(finite), initial=0.0)) + float(np.max(magnitude)))


def measured(fn: Callable[..., np.ndarray], *args: np.ndarray) -> float:
    """The largest error of ``fn`` evaluated in float32 against ``fn`` in float64, where the
    float64 result is finite: the naive baseline of a formula the pipeline does not cover."""
    with np.errstate(all="ignore"):
        low = fn(*(a.astype(np.float32) for a in args)).astype(np.float64)
        high = fn(*(f64(a) for a in args))
    ok = np.isfinite(high)
    return float(np.max(np.abs(low[ok] - high[ok]), initial=0.0))


def formula_check(name: str, fn: Callable[..., np.ndarray], args: tuple[np.ndarray, ...],
                  magnitude: np.ndarray | float = 0.0, hint: str = "",
                  zeros: np.ndarray | None = None) -> Check:
    """A check whose expected value is ``fn`` in float64 on the float32 ``args``; ``zeros``:
    positions that must be exactly 0."""
    with np.errstate(all="ignore"):
        value = fn(*(f64(a) for a in args))
    baseline = max(measured(fn, *args), floor(value, magnitude))
    return Check(name, args, value, baseline, hint, zeros)


def sdpa_check(name: str, arrays: dict[str, np.ndarray], options: dict[str, Any], step: str,
               args: tuple[Any, ...], hint: str = "",
               magnitude: np.ndarray | float = 0.0) -> Check:
    """A check whose expected value is a step of the harness's float64 pipeline on ``arrays``
    (cast to float32; bool masks stay bool), with its exact zeros and its ``Expected``."""
    data = CaseData({n: (a if a.dtype == bool else f32(a)) for n, a in arrays.items()}, options)
    exp = expected_for(data, "sdpa", DTYPE, name, gradients=False)
    value = exp.values[step]
    baseline = max(exp.baseline[step], floor(value, magnitude))
    return Check(name, args, value, baseline, hint, exp.zeros.get(step), exp, step)


def module_check(name: str, arrays: dict[str, np.ndarray], options: dict[str, Any],
                 args: tuple[Any, ...], hint: str = "") -> Check:
    """A check whose expected value is the output of one of the spec's modules in float64."""
    data = CaseData({n: f32(a) for n, a in arrays.items()}, options)
    exp = expected_for(data, "module", DTYPE, name, gradients=False)
    value = exp.values["output"]
    return Check(name, args, value, max(exp.baseline["output"], floor(value)), hint)


def identity_keys(scores: np.ndarray) -> dict[str, np.ndarray]:
    """query = ``scores``, key = value = I, so that with scale 1 the pipeline's scores are
    ``scores`` exactly (a product with 1 and sums of zeros) and its weights their softmax."""
    n = scores.shape[-1]
    eye = np.broadcast_to(np.eye(n), scores.shape[:-2] + (n, n)).copy()
    return {"query": scores, "key": eye, "value": eye}


# --------------------------------------------------------------------------- the backends' arrays


TYPE_NAMES = {"numpy": "a NumPy array", "jax": "a JAX array (jax.numpy, not numpy: NumPy "
              "functions turn JAX arrays into NumPy arrays, which fails under jax.jit)",
              "torch": "a torch.Tensor (so autograd and devices keep working)"}


# --------------------------------------------------------------------------- mistakes


def one(fn: Callable[..., np.ndarray]) -> Callable[..., list[np.ndarray]]:
    """A mistake with one result, ``fn`` on the check's arrays in float64 (scalars as given);
    none where the check's shapes cannot show it (``fn`` raises)."""
    def compute(*args: Any) -> list[np.ndarray]:
        with np.errstate(all="ignore"):
            try:
                return [fn(*(f64(a) if isinstance(a, np.ndarray) else a for a in args))]
            except (ValueError, IndexError):
                return []
    return compute


def swap(x: np.ndarray) -> np.ndarray:
    """The last two axes swapped (a batched transpose)."""
    return np.swapaxes(x, -1, -2)


def normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    """Seeded standard normal values times ``scale``, as float32."""
    return f32(rng.standard_normal(shape) * scale)


def product_scores(q: np.ndarray, k: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """``q @ kᵀ · scale`` over the last two axes."""
    return q @ swap(k) * scale


def magnitude(q: np.ndarray, k: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """``|q| @ |k|ᵀ · scale`` in float64: the sums of absolute products behind each score."""
    return np.abs(q.astype(np.float64)) @ swap(np.abs(k.astype(np.float64))) * scale


def masked_softmax(s: np.ndarray, allowed: np.ndarray, empty_rows: str = "zero") -> np.ndarray:
    """Softmax of ``s`` over its allowed keys (float64); a row with none gives 0
    (``empty_rows="zero"``) or NaN (``"nan"``, the naive ``0 / 0``)."""
    with np.errstate(all="ignore"):
        s = np.where(allowed, s, -np.inf)
        m = np.max(s, -1, keepdims=True)
        e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
        total = e.sum(-1, keepdims=True)
        if empty_rows == "zero":
            total = np.where(total == 0, 1.0, total)
        return e / total


def either_empty_row(s: np.ndarray, allowed: np.ndarray) -> list[np.ndarray]:
    """``masked_softmax`` with empty rows as 0 and as NaN: a mistake that empties a row shows
    either way, whatever the learner's softmax does with it."""
    return [masked_softmax(s, allowed, "zero"), masked_softmax(s, allowed, "nan")]


def band(s: np.ndarray, lo: int | None = None, hi: int | None = None) -> np.ndarray:
    """``(q_len, kv_len)`` bool: ``lo <= j - i <= hi`` (None: unbounded)."""
    i, j = np.ogrid[: s.shape[-2], : s.shape[-1]]
    allowed = np.ones(s.shape[-2:], bool)
    if lo is not None:
        allowed &= j - i >= lo
    if hi is not None:
        allowed &= j - i <= hi
    return allowed


__all__ = ["DTYPE", "SEED", "TYPE_NAMES", "UNIT", "Check", "Exercise", "Mistake", "article",
           "band", "either_empty_row", "f32", "f64", "floor", "formula_check", "identity_keys",
           "is_native", "magnitude", "masked_softmax", "measured", "module_check", "normal",
           "one", "product_scores", "rng_for", "sdpa_check", "softmax64", "swap", "to_backend",
           "to_numpy"]
