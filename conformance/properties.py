"""Property-based mode (``--hypothesis N``): Hypothesis draws problems, every backend must agree.

Hypothesis draws shapes (including 1 and odd sizes; from small fixed sets, so JAX compiles a
bounded number of programs), dtype, rank, grouped heads, a mask (none, random, key padding, or
with a fully masked row), a bias, causal settings, and the magnitude of the values (from 1e-3 to
100, i.e. logits up to ~1e5). For each problem a backend must

* match the float64 reference (output and weights) under ``spec.TOLERANCES``;
* give rows of weights that sum to 1 or are all 0, and exactly 0 where masked;
* give an output that does not change when the values of keys no query may attend change;
* give the same output (within tolerance) when keys, values, mask and bias are permuted along
  the keys (without causal rule, where positions carry no meaning).

A failure is shrunk by Hypothesis to a minimal problem and printed as runnable code.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .backends import DTYPES, Backend, numpy_dtype
from .cases import CaseData
from .harness import compare, expected_for, tolerance

SEQ = (1, 2, 3, 5)
HEAD_DIM = (1, 3, 8)
MAGNITUDES = (1.0, 1e-3, 10.0, 100.0)
SUM_TOL = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 3e-2, "float16": 4e-3}


@dataclass
class Problem:
    """One drawn problem; inputs are generated from ``seed``."""

    dtype: str
    batch: tuple[int, ...]
    heads: int | None  # None for 2-D inputs
    kv_heads: int | None
    q_len: int
    kv_len: int
    head_dim: int
    v_dim: int
    magnitude: float
    mask: str  # none | random | keys | empty_row
    bias: bool
    is_causal: bool
    causal_alignment: str
    seed: int

    def arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The inputs, in ``dtype``, and the scalar options."""
        rng = np.random.default_rng(self.seed)
        lead_q = self.batch + ((self.heads,) if self.heads else ())
        lead_kv = self.batch + ((self.kv_heads,) if self.kv_heads else ())
        dt = numpy_dtype(self.dtype)
        a: dict[str, np.ndarray] = {
            "query": (rng.standard_normal(lead_q + (self.q_len, self.head_dim))
                      * self.magnitude).astype(dt),
            "key": (rng.standard_normal(lead_kv + (self.kv_len, self.head_dim))
                    * self.magnitude).astype(dt),
            "value": rng.standard_normal(lead_kv + (self.kv_len, self.v_dim)).astype(dt),
        }
        scores = lead_q + (self.q_len, self.kv_len)
        if self.mask == "random":
            a["mask"] = rng.random(scores) < 0.6
        elif self.mask == "keys":
            a["mask"] = np.broadcast_to(rng.random(self.kv_len) < 0.6, (self.q_len, self.kv_len)
                                        ).copy()
        elif self.mask == "empty_row":
            m = rng.random(scores) < 0.7
            m[..., 0, :] = False
            a["mask"] = m
        if self.bias:
            a["bias"] = rng.standard_normal((self.q_len, self.kv_len)).astype(dt)
        o: dict[str, Any] = {}
        if self.is_causal:
            o = {"is_causal": True, "causal_alignment": self.causal_alignment}
        return a, o


def problems() -> Any:
    """The Hypothesis strategy of problems."""
    from hypothesis import strategies as st

    @st.composite
    def draw_problem(draw: Any) -> Problem:
        rank = draw(st.sampled_from((2, 3, 4)))
        heads = kv_heads = None
        if rank >= 3:
            heads = draw(st.sampled_from((1, 2, 4)))
            kv_heads = draw(st.sampled_from(tuple(d for d in (1, 2, 4) if heads % d == 0)))
        head_dim = draw(st.sampled_from(HEAD_DIM))
        return Problem(
            dtype=draw(st.sampled_from(DTYPES)),
            batch=(draw(st.sampled_from((1, 2))),) if rank == 4 else (),
            heads=heads, kv_heads=kv_heads,
            q_len=draw(st.sampled_from(SEQ)), kv_len=draw(st.sampled_from(SEQ)),
            head_dim=head_dim, v_dim=draw(st.sampled_from((head_dim, 3))),
            magnitude=draw(st.sampled_from(MAGNITUDES)),
            mask=draw(st.sampled_from(("none", "random", "keys", "empty_row"))),
            bias=draw(st.booleans()),
            is_causal=draw(st.booleans()),
            causal_alignment=draw(st.sampled_from(("top_left", "bottom_right"))),
            seed=draw(st.integers(0, 2**16)),
        )

    return draw_problem()


def _sdpa(backend: Backend, a: dict[str, np.ndarray], o: dict[str, Any]
          ) -> tuple[np.ndarray, np.ndarray]:
    conv = {k: backend.asarray(v) for k, v in a.items()}
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        out, w = backend.module.scaled_dot_product_attention(
            conv.pop("query"), conv.pop("key"), conv.pop("value"), **conv, **o,
            return_weights=True)
    return backend.to_numpy(out), backend.to_numpy(w)


def check_problem(backend: Backend, problem: Problem) -> None:
    """Every property on one backend; AssertionError with a plain-words message otherwise."""
    a, o = problem.arrays()
    exp = expected_for(CaseData(a, o), "sdpa", problem.dtype)
    out, w = _sdpa(backend, a, o)
    for step, actual in (("output", out), ("output_weights", w)):
        res = compare(step, actual, exp.values[step], exp.baseline[step], problem.dtype,
                      exp.zeros.get(step), "input")
        assert res.passed, (
            f"{step} differs from the float64 reference: worst {res.ratio:.3g}x tolerance at "
            f"{res.index}: actual {res.actual}, expected {res.expected}"
            + (f" ({res.note})" if res.note else ""))
    w64 = w.astype(np.float64)
    sums = w64.sum(-1)
    ok = (np.abs(sums - 1) <= SUM_TOL[problem.dtype]) | (w64 == 0).all(-1)
    assert ok.all(), (f"a row of weights sums to {sums[~ok].flat[0]!r}, neither 1 nor all 0")
    allowed = ~np.isneginf(exp.values["masked_scores"])  # (..., heads, q_len, kv_len)
    value = a["value"]
    if value.ndim >= 3:  # keys that no query of any head of a kv group attends
        groups = allowed.shape[-3] // value.shape[-3]
        per_kv = allowed.reshape(allowed.shape[:-3] + (value.shape[-3], groups)
                                 + allowed.shape[-2:])
        unused = ~per_kv.any(axis=(-3, -2))  # (..., kv_heads, kv_len)
    else:
        unused = ~allowed.any(-2)
    if unused.any():
        poisoned = value.copy()
        poisoned[unused] = np.asarray(1e3, dtype=value.dtype)
        out2, _ = _sdpa(backend, {**a, "value": poisoned}, o)
        assert np.array_equal(out2, out, equal_nan=True), (
            "changing the values of keys that no query may attend changed the output")
    if not problem.is_causal and problem.kv_len > 1:
        perm = np.random.default_rng(problem.seed + 1).permutation(problem.kv_len)
        b = dict(a)
        b["key"], b["value"] = a["key"][..., perm, :], a["value"][..., perm, :]
        for n in ("mask", "bias"):
            if n in a:
                b[n] = a[n][..., perm]
        out3, _ = _sdpa(backend, b, o)
        tol = tolerance(problem.dtype)
        bound = tol["atol"] + tol["k"] * exp.baseline["output"] + tol["rtol"] * np.abs(out)
        diff = np.abs(out3.astype(np.float64) - out.astype(np.float64))
        assert (diff <= bound).all(), (
            f"permuting the keys changed the output by up to {float(np.max(diff)):.3g}")


def reproducer(backend: Backend, problem: Problem, message: str) -> str:
    """Runnable code that reproduces a failure."""
    a, o = problem.arrays()
    lines = [
        f"# {backend.name}: {message}",
        "import numpy as np",
        "from conformance import backends, reference",
        f"backend = backends.load({backend.name!r})",
        f"dtype = backends.numpy_dtype({problem.dtype!r})",
    ]
    for name, x in a.items():
        if x.dtype == np.bool_:
            lines.append(f"{name} = np.array({x.tolist()!r}, dtype=bool)")
        else:
            lines.append(f"{name} = np.array({x.astype(np.float64).tolist()!r}).astype(dtype)")
    extra = ", ".join(f"{n!r}: {n}" for n in a if n not in ("query", "key", "value"))
    lines += [
        f"arrays = {{{extra}}}",
        f"options = {o!r}",
        "out, weights = backend.module.scaled_dot_product_attention(",
        "    *(backend.asarray(x) for x in (query, key, value)),",
        "    **{n: backend.asarray(x) for n, x in arrays.items()}, **options, return_weights=True)",
        "ref = reference.attention(query, key, value, **arrays, **options)",
        "print('output - reference:', backend.to_numpy(out).astype(np.float64) - ref.output)",
        "print('weights - reference:', backend.to_numpy(weights).astype(np.float64) - ref.weights)",
    ]
    return "\n".join(lines)


@dataclass
class BackendProperties:
    """The outcome of the property run on one backend."""

    backend: str
    examples: int = 0
    failure: str = ""
    reproducer: str = ""


@dataclass
class PropertyResult:
    """The outcome of ``--hypothesis N``."""

    n: int
    backends: list[BackendProperties] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when no backend failed a property."""
        return not any(b.failure for b in self.backends)

    def summary(self) -> str:
        """A short part of the summary line."""
        bad = [b.backend for b in self.backends if b.failure]
        total = sum(b.examples for b in self.backends)
        return f"hypothesis: {total} examples, " + (f"FAIL on {', '.join(bad)}" if bad else "ok")

    def text(self) -> str:
        """Failures with their minimal reproducers."""
        lines = []
        for b in self.backends:
            if b.failure:
                lines.append(f"FAIL hypothesis · {b.backend}: {b.failure}\n"
                             f"  minimal reproducer (runnable):\n\n{b.reproducer}\n")
        return "\n".join(lines) or self.summary()

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the JSON report."""
        return {"n": self.n, "backends": [vars(b) for b in self.backends]}


def run_backend(backend: Backend, n: int) -> BackendProperties:
    """``n`` drawn problems on one backend, shrinking the first failure."""
    from hypothesis import HealthCheck, Verbosity, given, settings

    outcome = BackendProperties(backend.name)
    last: dict[str, Any] = {}

    @settings(max_examples=n, deadline=None, database=None, derandomize=True,
              verbosity=Verbosity.quiet, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(problems())
    def prop(problem: Problem) -> None:
        outcome.examples += 1
        try:
            check_problem(backend, problem)
        except Exception as exc:
            last["problem"], last["message"] = problem, f"{type(exc).__name__}: {exc}"
            raise

    try:
        prop()
    except Exception:  # noqa: BLE001 - Hypothesis re-raises the minimal failure
        if "problem" in last:
            outcome.failure = last["message"]
            outcome.reproducer = reproducer(backend, last["problem"], last["message"])
        else:
            raise
    return outcome


def run(backend_list: list[Backend], n: int) -> PropertyResult:
    """``--hypothesis N``: N examples per backend."""
    return PropertyResult(n, [run_backend(b, n) for b in backend_list])


__all__ = ["Problem", "PropertyResult", "check_problem", "problems", "reproducer", "run"]

