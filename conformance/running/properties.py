"""Property checks (``--hypothesis N``): Hypothesis draws problems, every backend must conform.

A problem's structure — shapes, mask kind, bias, causal rule, custom scale, soft-cap, window,
attention sinks — is one of ``LAYOUTS`` (ranks 2-4, lengths 1-5, odd head sizes, grouped heads,
value head sizes of their own, fully masked rows, both causal alignments, windows with and
without a causal rule, scales from 0.05 to 2, sinks on five layouts: 2-D, grouped heads whose
first rows see no key, a full mask with soft-capping, a decoding step, a window), its dtype one
of the four; its data is drawn freely (values of
magnitude 1e-3 to 100, i.e. logits up to ~1e5, mask contents, a seed). A backend that compiles
(JAX: ``Backend.function``) thus compiles at most ``len(LAYOUTS) × 4`` programs, however many
examples run. A checked module draws only the layouts and dtypes whose features its contract
supports (``plugins.Contract.unsupported``; ``layouts_for``); an example that still raises
``NotImplementedError`` is rejected (``runner.property_view``), never failed. For each problem
a backend must

* conform: ``output`` and ``weights`` pass ``compare`` against the float64 reference, with the
  naive baseline measured on the same example — the harness's one rule (``spec.TOLERANCES``);
* ignore keys no query may attend: changing their values leaves the output bit-identical;
* conform on the same problem with keys, values, mask and bias permuted along the keys (without
  a causal rule or a window, where positions carry no meaning), whose reference is the same
  output.

Rows of weights summing to 1 (or all 0) follow from the comparison of the weights. A failure is
shrunk by Hypothesis to a minimal problem and printed as runnable code.

Counting: ``--hypothesis N`` runs exactly N examples per backend when none fails (Hypothesis'
``max_examples`` counts valid examples; rejected ones are counted apart). When one fails, the
count stops at it (``examples``: the passing ones and the failing one); the calls Hypothesis
then makes to shrink it are counted apart (``shrink_calls``). ``worst_ratio`` is over the
passing examples; ``failure_ratio`` is the minimal failing example's (None when the failure is
not a comparison, e.g. an exception).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cases.catalogue import CaseData
from ..cases.dtypes import DTYPES, numpy_dtype
from ..cases.expected import Expected, expected_for
from ..comparing.compare import compare_step
from ..comparing.results import BackendProperties, PropertyResult
from . import backends, plugins
from .backends import Backend

MAGNITUDES = (1.0, 1e-3, 10.0, 100.0)


@dataclass(frozen=True)
class Layout:
    """The structure of a problem: everything that decides a compiled program's signature."""

    batch: tuple[int, ...]
    heads: int | None  # None: 2-D inputs (seq, head_dim)
    kv_heads: int | None
    q_len: int
    kv_len: int
    head_dim: int
    v_dim: int
    mask: str  # none | full (..., heads, q_len, kv_len) | keys (q_len, kv_len)
    bias: bool  # a (q_len, kv_len) additive bias
    causal: str | None  # None | top_left | bottom_right
    scale: float | None = None  # a custom scale (None: head_dim ** -0.5)
    softcap: float | None = None
    window: tuple[int | None, int | None] | None = None  # (left, right), None: unbounded
    align: str = "top_left"  # the causal_alignment of a window without a causal rule
    sinks: bool = False  # a sinks array (heads,) ((1,) for 2-D), in [-3, 3) · magnitude²

    def options(self) -> dict[str, Any]:
        """The scalar options of ``scaled_dot_product_attention`` this layout passes."""
        o: dict[str, Any] = {}
        if self.causal:
            o = {"is_causal": True, "causal_alignment": self.causal}
        elif self.window is not None and self.align != "top_left":
            o = {"causal_alignment": self.align}
        for name in ("scale", "softcap", "window"):
            if getattr(self, name) is not None:
                o[name] = getattr(self, name)
        return o


L = Layout
LAYOUTS: tuple[Layout, ...] = (  # as many as before scales, windows and soft-caps were drawn
    L((), None, None, 1, 1, 1, 1, "none", False, None),
    L((), None, None, 5, 3, 8, 8, "keys", True, None, scale=0.3, sinks=True),
    L((), None, None, 3, 5, 3, 3, "none", False, "bottom_right", window=(1, None)),
    L((), 2, 1, 3, 5, 8, 3, "full", False, "top_left", scale=2.0),
    L((), 4, 2, 5, 2, 3, 3, "none", True, "bottom_right", sinks=True),  # empty rows: sinks
    L((), 4, 4, 2, 2, 1, 3, "keys", False, None),
    L((1,), 4, 4, 5, 5, 8, 8, "full", True, None, softcap=2.5, sinks=True),
    L((2,), 4, 2, 3, 3, 8, 8, "none", False, "top_left", scale=0.05),
    L((2,), 2, 2, 1, 5, 3, 8, "full", False, "bottom_right", sinks=True),  # a decoding step
    L((1,), 4, 1, 5, 3, 1, 3, "keys", True, "top_left", window=(1, None)),
    L((2,), 1, 1, 5, 1, 8, 1, "none", True, None, scale=1.0, window=(1, 0),
      align="bottom_right"),  # rows 0-3 see no key
    L((1,), 2, 1, 2, 3, 3, 3, "full", True, "bottom_right", scale=0.7, softcap=1.5),
    L((2,), 4, 2, 5, 5, 3, 3, "keys", False, None, scale=0.3, window=(1, 1), sinks=True),
    L((), 2, 2, 5, 5, 8, 8, "full", False, None, scale=0.4),
)


@dataclass
class Problem:
    """One drawn problem: a layout, a dtype, and data generated from ``seed``."""

    layout: Layout
    dtype: str
    magnitude: float
    empty_row: bool  # a "full" mask with its first query row fully masked
    seed: int

    def arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The inputs, in ``dtype``, and the scalar options."""
        lay = self.layout
        rng = np.random.default_rng(self.seed)
        lead_q = lay.batch + ((lay.heads,) if lay.heads else ())
        lead_kv = lay.batch + ((lay.kv_heads,) if lay.kv_heads else ())
        dt = numpy_dtype(self.dtype)
        a: dict[str, np.ndarray] = {
            "query": (rng.standard_normal(lead_q + (lay.q_len, lay.head_dim))
                      * self.magnitude).astype(dt),
            "key": (rng.standard_normal(lead_kv + (lay.kv_len, lay.head_dim))
                    * self.magnitude).astype(dt),
            "value": rng.standard_normal(lead_kv + (lay.kv_len, lay.v_dim)).astype(dt),
        }
        if lay.mask == "full":
            mask = rng.random(lead_q + (lay.q_len, lay.kv_len)) < 0.65
            if self.empty_row:
                mask[..., 0, :] = False
            a["mask"] = mask
        elif lay.mask == "keys":
            keys = rng.random(lay.kv_len) < 0.6
            a["mask"] = np.broadcast_to(keys, (lay.q_len, lay.kv_len)).copy()
        if lay.bias:
            a["bias"] = rng.standard_normal((lay.q_len, lay.kv_len)).astype(dt)
        if lay.sinks:  # logits of the scores' size: from a negligible sink to a dominant one
            a["sinks"] = (rng.uniform(-3.0, 3.0, lay.heads or 1)
                          * max(self.magnitude, 1.0) ** 2).astype(dt)
        return a, lay.options()


def features(layout: Layout) -> frozenset[str]:
    """The names of ``spec.PLUGIN_FEATURES`` a layout's problems use, dtypes aside."""
    a, o = Problem(layout, "float64", 1.0, False, 0).arrays()
    return plugins.features(a, o, "float64") - {"float64"}


def layouts_for(unsupported: frozenset[str] = frozenset()
                ) -> tuple[tuple[Layout, ...], tuple[str, ...]]:
    """The layouts and dtypes whose features are all outside ``unsupported``."""
    return (tuple(lay for lay in LAYOUTS if not features(lay) & unsupported),
            tuple(d for d in DTYPES if d not in unsupported))


def problems(layouts: tuple[Layout, ...] = LAYOUTS, dtypes: tuple[str, ...] = DTYPES) -> Any:
    """The Hypothesis strategy of problems (of ``layouts`` in ``dtypes``)."""
    from hypothesis import strategies as st

    return st.builds(
        Problem,
        layout=st.sampled_from(layouts),
        dtype=st.sampled_from(dtypes),
        magnitude=st.sampled_from(MAGNITUDES),
        empty_row=st.booleans(),
        seed=st.integers(0, 2**16),
    )


def _sdpa(backend: Backend, a: dict[str, np.ndarray], o: dict[str, Any]
          ) -> tuple[np.ndarray, np.ndarray]:
    """``scaled_dot_product_attention(..., return_weights=True)``, compiled where it compiles."""
    fn = backend.function("scaled_dot_product_attention", tuple(sorted([*o, "return_weights"])))
    conv = {k: backend.asarray(v) for k, v in a.items()}
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        out, w = fn(conv.pop("query"), conv.pop("key"), conv.pop("value"), **conv, **o,
                    return_weights=True)
    return backend.to_numpy(out), backend.to_numpy(w)


class Mismatch(AssertionError):
    """A property example that does not conform; ``ratio``: its worst error / tolerance."""

    def __init__(self, message: str, ratio: float) -> None:
        super().__init__(message)
        self.ratio = ratio


def _conform(exp: Expected, out: np.ndarray, w: np.ndarray, what: str = "") -> float:
    worst = 0.0
    for step, actual in (("output", out), ("output_weights", w)):
        res = compare_step(exp, step, actual, "input")
        if not res.passed:
            raise Mismatch(
                f"{step}{what} differs from the float64 reference: worst {res.ratio:.3g}x "
                f"tolerance at {res.index}: actual {res.actual}, expected {res.expected}, "
                f"tolerance {res.bound:.3g}" + (f" ({res.note})" if res.note else ""),
                res.ratio)
        worst = max(worst, res.ratio)
    return worst


def _unused_keys(exp: Expected, value: np.ndarray) -> np.ndarray:
    """Keys no query of any head of their kv group may attend: ``(..., [kv_heads,] kv_len)``."""
    allowed = ~np.isneginf(exp.values["masked_scores"])  # (..., heads, q_len, kv_len)
    if value.ndim < 3:
        return ~allowed.any(-2)
    groups = allowed.shape[-3] // value.shape[-3]
    per_kv = allowed.reshape(allowed.shape[:-3] + (value.shape[-3], groups) + allowed.shape[-2:])
    return ~per_kv.any(axis=(-3, -2))


def check_problem(backend: Backend, problem: Problem) -> float:
    """Every property on one backend; the worst ratio, or AssertionError in plain words
    (``Mismatch``, with the ratio, for a result outside the tolerance)."""
    a, o = problem.arrays()
    exp = expected_for(CaseData(a, o), "sdpa", problem.dtype, gradients=False)
    out, w = _sdpa(backend, a, o)
    worst = _conform(exp, out, w)
    unused = _unused_keys(exp, a["value"])
    if unused.any():
        poisoned = a["value"].copy()
        poisoned[unused] = np.asarray(1e3, dtype=poisoned.dtype)
        out2, _ = _sdpa(backend, {**a, "value": poisoned}, o)
        assert np.array_equal(out2, out, equal_nan=True), (
            "changing the values of keys that no query may attend changed the output")
    if not problem.layout.causal and problem.layout.window is None \
            and problem.layout.kv_len > 1:
        perm = np.random.default_rng(problem.seed + 1).permutation(problem.layout.kv_len)
        b = dict(a)
        b["key"], b["value"] = a["key"][..., perm, :], a["value"][..., perm, :]
        for n in ("mask", "bias"):
            if n in a:
                b[n] = a[n][..., perm]
        permuted = expected_for(CaseData(b, o), "sdpa", problem.dtype, gradients=False)
        out3, w3 = _sdpa(backend, b, o)
        worst = max(worst, _conform(permuted, out3, w3, " (keys permuted)"))
    return worst


def reproducer(backend: Backend, problem: Problem, message: str) -> str:
    """Runnable code that reproduces a failure."""
    a, o = problem.arrays()
    lines = [
        f"# {backend.name}: {message}",
        "import numpy as np",
        "from conformance.cases import reference",
        "from conformance.running import backends",
        *backends.load_lines(backend, "backend"),
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


def run_backend(backend: Backend, n: int) -> BackendProperties:
    """``n`` drawn problems on one backend (exactly ``n`` when none fails), shrinking the first
    failure; a checked module draws only what its contract supports (``layouts_for``)."""
    from hypothesis import HealthCheck, Verbosity, given, settings
    from hypothesis.errors import Unsatisfiable, UnsatisfiedAssumption

    outcome = BackendProperties(backend.name)
    _ = backend.module  # a checked module's contract is known once it is imported
    contract = backend.contract
    layouts, dtypes = layouts_for(contract.unsupported if contract is not None else frozenset())
    if not layouts or not dtypes:
        outcome.note = ("no example to draw: every layout or every dtype uses a feature "
                        "declared unsupported")
        return outcome
    last: dict[str, Any] = {}
    start = time.perf_counter()

    @settings(max_examples=n, deadline=None, database=None, derandomize=True,
              verbosity=Verbosity.quiet, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(problems(layouts, dtypes))
    def prop(problem: Problem) -> None:
        failed = "problem" in last  # from here on Hypothesis shrinks the failure
        try:
            ratio = check_problem(backend, problem)
        except UnsatisfiedAssumption:
            outcome.rejected += 0 if failed else 1
            raise
        except Exception as exc:
            outcome.examples += 0 if failed else 1
            outcome.shrink_calls += 1 if failed else 0
            last["problem"], last["message"] = problem, f"{type(exc).__name__}: {exc}"
            last["ratio"] = exc.ratio if isinstance(exc, Mismatch) else None
            raise
        if failed:
            outcome.shrink_calls += 1
        else:
            outcome.examples += 1
            outcome.worst_ratio = max(outcome.worst_ratio, ratio)

    try:
        prop()
    except Unsatisfiable:
        outcome.note = "no example ran: every drawn example was rejected (NotImplementedError)"
    except Exception:  # noqa: BLE001 - Hypothesis re-raises the minimal failure
        if "problem" not in last:
            raise
        outcome.failure = last["message"]
        outcome.failure_ratio = last["ratio"]
        outcome.reproducer = reproducer(backend, last["problem"], last["message"])
    outcome.seconds = time.perf_counter() - start
    return outcome


def run(backend_list: list[Backend], n: int) -> PropertyResult:
    """``--hypothesis N``: N examples per backend."""
    result = PropertyResult(n)
    for backend in backend_list:
        result.backends.append(run_backend(backend, n))
        backend.release()  # the programs compiled for these layouts
    return result


__all__ = ["LAYOUTS", "Layout", "Mismatch", "Problem", "check_problem", "features",
           "layouts_for", "problems", "reproducer", "run", "run_backend"]
