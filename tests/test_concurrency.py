"""Concurrency and determinism (``spec.CONCURRENCY``, ``spec.BLAS_LIMIT``, ``spec.REPEATABLE``).

* numpy_attn under load, its tiled paths in ``LANES`` lanes whatever the machine
  (``four_lanes``): THREADS threads × CALLS calls of mixed shapes, forward and VJP, causal and
  not, on the fast path and off it, all started together, each result compared bit for bit with
  the same call made alone; a deadline bounds the run;
* numpy_attn's fast path gives the caller's BLAS thread count back, and its bits do not depend
  on it;
* the harness's repeat check (``conformance.running.repeat``) passes for every installed
  backend, and fails when a backend's bits change from call to call.
"""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

from conformance.running import backends, repeat

THREADS, CALLS = 4, 4
LANES = 4
DEADLINE_S = 240.0
# (query shape, key/value shape, is_causal, bias shape): four take the fast path (>= 2**20
# scores); the biases are broadcast over heads (shared by the tasks of a key block) and over keys
# (shared by every key block), where the VJP's sums into grad_bias must keep their order
SHAPES = (
    ((1, 2, 512, 32), (1, 2, 1024, 32), False, None),
    ((1, 4, 512, 32), (1, 2, 512, 32), True, (1, 1, 512, 512)),
    ((2, 1, 256, 16), (2, 1, 2048, 16), False, None),
    ((1, 2, 256, 16), (1, 2, 2048, 16), True, (1, 1, 256, 1)),
    ((2, 2, 40, 8), (2, 2, 40, 8), True, None),
)


@pytest.fixture
def four_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy_attn's tiled paths deal their tasks into ``LANES`` lanes, whatever the machine.
    The lane count is the number of cores (``_threads._cores``): on 2 cores the two lanes'
    scratches, added in one order or the other, give the same bits (``a + b == b + a``), and a
    sum that followed the threads' timing instead of the lanes' order would go unseen. With 4
    lanes (run by up to as many threads as BLAS may use) it shows."""
    from numpy_attn import _threads

    monkeypatch.setattr(_threads, "_cores", lambda: LANES)


def _problems() -> list[tuple]:
    rng = np.random.default_rng(17)
    problems = []
    for q_shape, kv_shape, causal, bias_shape in SHAPES:
        q, k, v = (rng.standard_normal(s).astype(np.float32) for s in (q_shape, kv_shape,
                                                                       kv_shape))
        grad = rng.standard_normal(q_shape).astype(np.float32)
        bias = None if bias_shape is None else rng.standard_normal(bias_shape).astype(np.float32)
        problems.append((q, k, v, grad, causal, bias))
    return problems


def _call(numpy_attn, problem, kind: str) -> list[np.ndarray]:
    q, k, v, grad, causal, bias = (x.copy() if isinstance(x, np.ndarray) else x
                                   for x in problem)
    if kind == "forward":
        return [numpy_attn.scaled_dot_product_attention(q, k, v, bias=bias, is_causal=causal)]
    grads = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad, bias=bias,
                                                        is_causal=causal)
    return [g for g in grads if g is not None]


def _same_bits(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
               for x, y in zip(a, b, strict=True))


def test_numpy_threads_give_the_sequential_bits(four_lanes):
    import numpy_attn

    problems = _problems()
    jobs = [(i, kind) for i in range(len(problems)) for kind in ("forward", "vjp")]
    alone = {job: _call(numpy_attn, problems[job[0]], job[1]) for job in jobs}
    for i in (1, 3):  # repeatable, grad_bias too
        assert _same_bits(alone[(i, "vjp")], _call(numpy_attn, problems[i], "vjp"))
    start = threading.Barrier(THREADS)
    lock = threading.Lock()
    running, most, mismatches, errors, done = [0], [0], [], [], [0]

    def work(thread: int) -> None:
        try:
            start.wait(timeout=60)
            for m in range(CALLS):
                job = jobs[(thread + m * THREADS) % len(jobs)]  # every job, mixed kinds
                with lock:
                    running[0] += 1
                    most[0] = max(most[0], running[0])
                got = _call(numpy_attn, problems[job[0]], job[1])
                with lock:
                    running[0] -= 1
                    done[0] += 1
                    if not _same_bits(alone[job], got):
                        mismatches.append((thread, m, job))
        except Exception as exc:  # reported below: the test fails
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(THREADS)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, DEADLINE_S - (time.perf_counter() - began)))
    assert not any(t.is_alive() for t in threads), f"calls still running after {DEADLINE_S} s"
    assert not errors, errors
    assert done[0] == THREADS * CALLS
    assert not mismatches, f"(thread, call, (shape, kind)) with other bits: {mismatches}"
    assert most[0] >= 2, "the calls never overlapped: nothing concurrent was tested"


def test_numpy_fast_path_restores_blas_and_ignores_its_setting():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    import numpy_attn

    q, k, v, grad, causal, _ = _problems()[1]
    before = [lib["num_threads"] for lib in threadpoolctl.threadpool_info()]
    results = []
    for threads in (1, 2):
        with threadpoolctl.threadpool_limits(limits=threads, user_api="blas"):
            results.append([numpy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal)]
                           + list(numpy_attn.scaled_dot_product_attention_vjp(
                               q, k, v, grad, is_causal=causal)[:3]))
            inside = [lib["num_threads"] for lib in threadpoolctl.threadpool_info()
                      if lib["user_api"] == "blas"]
            assert inside == [threads] * len(inside), "the call did not restore the limit"
    assert [lib["num_threads"] for lib in threadpoolctl.threadpool_info()] == before
    assert _same_bits(results[0], results[1]), "the bits depend on the caller's BLAS threads"


# ------------------------------------------------------------------------------- the harness


def test_repeat_check_passes_for_numpy_and_torch():
    names = ["numpy"] + (["torch"] if backends.get("torch").available() else [])
    results = repeat.check_repeat(names, threads=2, rounds=1)
    assert {r.backend for r in results} == set(names)
    assert len(results) == len(names) * len(repeat.CASES) * len(repeat.MODES)
    failed = [r for r in results if not r.passed]
    assert not failed, repeat.format_results(failed)
    assert all(r.equal and r.promised and r.calls > 0 for r in results)


def test_repeat_check_passes_for_jax():
    pytest.importorskip("jax", reason="pip install jax")
    cases = [c for c in repeat.CASES if c.name in ("fast_causal_gqa", "explicit_causal")]
    results = repeat.check_repeat(["jax"], threads=2, rounds=1, cases=cases)
    failed = [r for r in results if not r.passed]
    assert not failed, repeat.format_results(failed)
    assert len(results) == 4 and all(r.equal for r in results)


def test_repeat_check_reports_changing_bits():
    """A module whose output moves by one ulp on every other call fails ``equal``."""
    import numpy_attn

    count = [0]

    def nudge(x):
        count[0] += 1
        return np.nextafter(x, np.inf) if count[0] % 2 == 0 else x

    fake = types.ModuleType("flaky_attention")
    fake.scaled_dot_product_attention = lambda *a, **kw: nudge(
        numpy_attn.scaled_dot_product_attention(*a, **kw))
    fake.scaled_dot_product_attention_vjp = numpy_attn.scaled_dot_product_attention_vjp
    backend = backends.register(backends.from_module(fake, "flaky"))
    try:
        explicit = [c for c in repeat.CASES if c.name == "explicit_causal"]
        results = repeat.check_repeat(["flaky"], threads=2, rounds=2, cases=explicit)
    finally:
        backends.unregister(backend.name)
    assert [r.mode for r in results] == ["sequential", "threads"]
    assert not any(r.equal for r in results)
    assert all(r.detail.startswith("output: ") for r in results)
    assert all(r.passed for r in results)  # a user module promises nothing (spec.REPEATABLE)


def test_first_difference_sees_the_sign_of_zero():
    a = [np.zeros(3, np.float32)] * 4
    b = [np.zeros(3, np.float32)] * 3 + [np.array([0.0, -0.0, 0.0], np.float32)]
    assert repeat.first_difference(a, a) == ""
    assert repeat.first_difference(a, b).startswith("grad_value: ")


def test_numpy_blockwise_vjp_gives_the_same_bits_from_threads(four_lanes):
    """blockwise_attention_vjp with a bias broadcast over keys (every key block adds into the
    same grad_bias entries): the sums follow the lanes' order, never the threads' timing."""
    import numpy_attn

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, n, 16)) for n in (256, 1024, 1024))
    bias, grad_out = rng.standard_normal((1, 1, 256, 1)), rng.standard_normal((1, 2, 256, 16))

    def call() -> tuple:
        return numpy_attn.blockwise_attention_vjp(q, k, v, grad_out, bias=bias, block_q=64,
                                                  block_kv=64)

    alone = call()
    results: list = [None] * THREADS

    def worker(i: int) -> None:
        results[i] = [call() for _ in range(2)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=DEADLINE_S)
    assert not any(t.is_alive() for t in threads), "a thread passed the deadline"
    for per_thread in results:
        for grads in per_thread:
            for got, want in zip(grads, alone, strict=True):
                assert got.tobytes() == want.tobytes()
