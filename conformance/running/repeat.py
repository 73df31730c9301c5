"""The bitwise-repeat check: every backend keeps the promises of ``spec.REPEATABLE``.

Each case (``CASES``) is a seeded float32 attention problem; its calls (``spec.REPEAT_CALLS``:
the output of ``scaled_dot_product_attention`` and the three gradients of
``scaled_dot_product_attention_vjp``) are made

* ``sequential``: twice, one after the other, each time on a new copy of the inputs (new
  memory): the two results must have the same bits;
* ``threads``: from ``threads`` threads at once, each making every call of every case
  ``rounds`` times, starting at a different case so that different shapes overlap: every
  result must have the bits of the sequential one.

Bits are compared as raw bytes (so ``-0.0 != 0.0`` and NaN payloads count). Three of the cases
are large enough to take every backend's fast path (``attention_rules.FAST_PATHS``), one takes
the explicit steps; JAX runs jitted (one compile per case and call, through
``Backend.function``). The threads have a deadline (``DEADLINE_S``): a call that never returns
fails the check instead of hanging it.

Entry points: ``check_repeat(backend_names, threads=4, rounds=2)`` returns ``RepeatResult``
rows (one per backend, case and mode); ``python -m conformance repeat [--backend B ...]
[--threads N] [--rounds N]`` prints them (exit 1 when a promised repeat fails).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .. import spec
from ..usage import UsageError, at_least
from . import backends as backends_mod

MODES = ("sequential", "threads")
STEPS = ("output", "grad_query", "grad_key", "grad_value")
SEED = 20261201
DEADLINE_S = 300.0  # all threads of one backend together


@dataclass(frozen=True)
class RepeatCase:
    """One problem: query ``(..., heads, q_len, head_dim)``, key/value ``(..., kv_heads,
    kv_len, head_dim)``, the static arguments, and whether a boolean mask / a bias is drawn."""

    name: str
    q_shape: tuple[int, ...]
    kv_shape: tuple[int, ...]
    options: dict = field(default_factory=dict)
    mask: bool = False
    bias: bool = False


CASES = (
    # every fast path (>= 2**20 scores, >= 256 queries): causal, grouped-query heads
    RepeatCase("fast_causal_gqa", (1, 4, 512, 32), (1, 2, 512, 32), {"is_causal": True}),
    # cross-attention with a padding-like mask (some rows fully masked)
    RepeatCase("fast_cross_mask", (2, 2, 384, 32), (2, 2, 700, 32), {}, mask=True),
    # bottom-right causal with a window, a soft-cap and a bias (torch_attn: blockwise tiles)
    RepeatCase("fast_window_softcap_bias", (1, 2, 512, 16), (1, 2, 1024, 16),
               {"is_causal": True, "causal_alignment": "bottom_right", "window": (64, 0),
                "softcap": 20.0}, bias=True),
    # the explicit steps
    RepeatCase("explicit_causal", (2, 3, 17, 8), (2, 3, 17, 8), {"is_causal": True}),
)


@dataclass(frozen=True)
class RepeatResult:
    """One backend, case and mode: whether every compared result had the same bits."""

    backend: str
    case: str
    mode: str  # "sequential" or "threads"
    promised: bool  # the spec promises bitwise repeats in this mode (spec.REPEATABLE)
    equal: bool  # every result had the bits of the first sequential call
    calls: int  # calls compared (one call gives the output, another the three gradients)
    seconds: float
    detail: str = ""  # the first difference, or why the check could not run

    @property
    def passed(self) -> bool:
        """Equal bits, or a mode the spec does not promise."""
        return self.equal or not self.promised

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``passed`` included)."""
        return {**asdict(self), "passed": self.passed}


def case_inputs(case: RepeatCase) -> dict[str, np.ndarray | None]:
    """The case's float32 inputs (query, key, value, grad_output, mask, bias), seeded."""
    rng = np.random.default_rng([SEED, sum(map(ord, case.name))])
    q_shape, kv_shape = case.q_shape, case.kv_shape
    scores = q_shape[:-1] + kv_shape[-2:-1]  # (..., heads, q_len, kv_len)
    mask = None
    if case.mask:  # a padding mask per batch element, the last query rows of one fully masked
        mask = rng.random(scores[:-3] + (1,) + scores[-2:]) < 0.8
        mask[..., -3:, :] = False
    return {
        "query": rng.standard_normal(q_shape).astype(np.float32),
        "key": rng.standard_normal(kv_shape).astype(np.float32),
        "value": rng.standard_normal(kv_shape).astype(np.float32),
        "grad_output": rng.standard_normal(q_shape).astype(np.float32),
        "mask": mask,
        "bias": rng.standard_normal((1, 1) + scores[-2:]).astype(np.float32)
        if case.bias else None,
    }


class _Calls:
    """A backend's calls of one case: ``forward()`` and ``vjp()``, each on new copies of the
    inputs, results as NumPy arrays."""

    def __init__(self, backend: backends_mod.Backend, case: RepeatCase) -> None:
        self.backend, self.case = backend, case
        self.inputs = case_inputs(case)
        static = tuple(case.options)
        self._forward = backend.function("scaled_dot_product_attention", static)
        self._vjp = backend.function("scaled_dot_product_attention_vjp", static)

    def _fresh(self, name: str) -> Any:
        array = self.inputs[name]
        return None if array is None else self.backend.asarray(array.copy())

    def forward(self) -> list[np.ndarray]:
        """``[output]``."""
        output = self._forward(self._fresh("query"), self._fresh("key"), self._fresh("value"),
                               mask=self._fresh("mask"), bias=self._fresh("bias"),
                               **self.case.options)
        return [np.array(self.backend.to_numpy(output))]

    def vjp(self) -> list[np.ndarray]:
        """``[grad_query, grad_key, grad_value]``."""
        grads = self._vjp(self._fresh("query"), self._fresh("key"), self._fresh("value"),
                          self._fresh("grad_output"), mask=self._fresh("mask"),
                          bias=self._fresh("bias"), **self.case.options)
        return [np.array(self.backend.to_numpy(g)) for g in grads[:3]]

    def all(self) -> list[np.ndarray]:
        """The four compared arrays, ``STEPS`` order."""
        return self.forward() + self.vjp()


def first_difference(expected: list[np.ndarray], got: list[np.ndarray]) -> str:
    """``""`` when every array has the same dtype, shape and bytes; else where they first
    differ, e.g. ``"grad_query: 12 of 65536 entries differ, max |diff| 2.4e-07"``."""
    for step, a, b in zip(STEPS, expected, got, strict=True):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{step}: {b.dtype}{b.shape} != {a.dtype}{a.shape}"
        a_bytes = np.ascontiguousarray(a).view(np.uint8)
        b_bytes = np.ascontiguousarray(b).view(np.uint8)
        if not np.array_equal(a_bytes, b_bytes):
            differ = ~((a == b) | (np.isnan(a) & np.isnan(b)))
            with np.errstate(invalid="ignore"):
                worst = float(np.nanmax(np.abs(a.astype(np.float64) - b), initial=0.0))
            return (f"{step}: {int(differ.sum())} of {a.size} entries differ "
                    f"(bits: {int((a_bytes != b_bytes).sum())} bytes), max |diff| {worst:.2g}")
    return ""


def _fix_torch_thread_count() -> None:
    """torch's promise holds for a fixed ``torch.get_num_threads()``, set before the threads
    start (``spec.CONCURRENCY``): set it to the calling thread's count when torch is loaded.
    torch's count is per thread, and a new thread does not always start from the calling
    thread's: after the first autograd backward of a process, new threads were measured at 1
    while the main thread read 2, and their products gave other bits."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(torch.get_num_threads())


def _check_backend(backend: backends_mod.Backend, cases: tuple[RepeatCase, ...], threads: int,
                   rounds: int) -> list[RepeatResult]:
    promised = spec.REPEATABLE.get(backend.module_name, ())
    calls = [_Calls(backend, case) for case in cases]
    results, baseline = [], []
    for call in calls:  # sequential: twice, new copies of the inputs each time
        start = time.perf_counter()
        first = call.all()
        detail = first_difference(first, call.all())
        baseline.append(first)
        results.append(RepeatResult(backend.name, call.case.name, "sequential",
                                    "sequential" in promised, not detail, 4,
                                    time.perf_counter() - start, detail))
    # threads: every thread makes every call of every case, `rounds` times, from its own start
    found: dict[int, str] = {}
    counts = [0] * len(calls)
    lock = threading.Lock()
    errors: list[str] = []

    def work(thread: int) -> None:
        try:
            for round_ in range(rounds):
                for k in range(len(calls)):
                    i = (thread + k) % len(calls)
                    got = calls[i].all()
                    detail = first_difference(baseline[i], got)
                    with lock:
                        counts[i] += 4
                        if detail and i not in found:
                            found[i] = f"{detail} (thread {thread}, round {round_})"
        except Exception as exc:  # reported, never swallowed: the check fails
            with lock:
                errors.append(f"thread {thread}: {type(exc).__name__}: {exc}")

    _fix_torch_thread_count()
    start = time.perf_counter()
    workers = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(max(0.0, DEADLINE_S - (time.perf_counter() - start)))
    seconds = time.perf_counter() - start
    hung = sum(worker.is_alive() for worker in workers)
    for i, call in enumerate(calls):
        detail = found.get(i, "")
        if errors:
            detail = "; ".join(errors)
        elif hung:
            detail = f"{hung} of {threads} threads still running after {DEADLINE_S:.0f} s"
        results.append(RepeatResult(backend.name, call.case.name, "threads",
                                    "threads" in promised, not detail, counts[i], seconds,
                                    detail))
    return results


def check_repeat(backend_names: Iterable[str] = backends_mod.SPEC_BACKENDS, *,
                 threads: int = 4, rounds: int = 2,
                 cases: Iterable[RepeatCase] = CASES) -> list[RepeatResult]:
    """Check the bitwise-repeat promises of ``spec.REPEATABLE`` for each backend.

    Args:
      backend_names: spec backends (``"numpy"``, ``"jax"``, ``"torch"``) or module paths.
      threads: threads calling at once in the ``threads`` mode.
      rounds: how many times each thread makes every call.
      cases: the problems (default ``CASES``).

    Returns:
      One ``RepeatResult`` per backend, case and mode; a backend that is not installed gives
      one row per case and mode with ``equal=False`` and the install command as ``detail``
      (``promised=False``, so it does not fail the check).
    """
    results: list[RepeatResult] = []
    cases = tuple(cases)
    for name in backend_names:
        backend = backends_mod.load(name)
        if not backend.available():
            results += [RepeatResult(name, case.name, mode, False, False, 0, 0.0,
                                     f"not installed ({backend.install})")
                        for case in cases for mode in MODES]
            continue
        results += _check_backend(backend, cases, threads, rounds)
        backend.release()
    return results


def format_results(results: list[RepeatResult]) -> str:
    """A plain-text table, one row per backend, case and mode."""
    lines = [f"{'backend':8} {'case':26} {'mode':10} {'calls':>5} {'s':>6}  result"]
    for r in results:
        verdict = "same bits" if r.equal else ("FAILED" if r.promised else "not promised")
        text = f"{verdict}: {r.detail}" if r.detail else verdict
        lines.append(f"{r.backend:8} {r.case:26} {r.mode:10} {r.calls:5d} {r.seconds:6.2f}  "
                     f"{text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m conformance repeat``: print the check; exit 1 when a promise fails."""
    parser = argparse.ArgumentParser(prog="python -m conformance repeat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", action="append", help="repeatable; default: all three")
    parser.add_argument("--threads", type=at_least(1), default=4,
                        help="threads calling at once (at least 1)")
    parser.add_argument("--rounds", type=at_least(1), default=2,
                        help="times each thread makes every call (at least 1)")
    args = parser.parse_args(argv)
    for name in args.backend or ():
        backend = backends_mod.load(name)  # an unknown name: UsageError
        if not backend.available():
            raise UsageError(f"backend {name!r} is not installed; install: {backend.install}")
    results = check_repeat(args.backend or backends_mod.SPEC_BACKENDS, threads=args.threads,
                           rounds=args.rounds)
    print(format_results(results))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    from ..usage import exit_code_of

    sys.exit(exit_code_of(main))
