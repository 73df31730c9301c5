"""context_parallel_attention in every backend: forward and gradients against the float64
reference (through ``conformance.context_parallel``), the layout, the schedule, the bytes sent,
the bad calls, and the ring's memory per device. NumPy runs here; JAX in one subprocess with 4
host devices; torch in one subprocess spawning 4 gloo ranks (worlds of 2 and 4), each with a
deadline; the memory check compiles JAX programs in one more subprocess, then runs the torch
ring on 4 more gloo ranks. The subprocess checks are marked ``slow``.

numpy_attn's own calls are also checked in detail (tests from mutation testing,
docs/mutation.md): the trace of the messages each strategy sends, step by step; float64 to
1e-12 of the reference with padding; the defaults, dtypes and cross-attention's causal
alignment; every bad call naming the function (the forward's or the vjp's) and the argument."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import Any

import numpy as np
import pytest
from subprocesses import timeout

from attention_rules import context_parallel as cp
from conformance import context_parallel as ccp
from conformance import spec
from conformance.cases import reference
from numpy_attn import context_blocks as nblocks
from numpy_attn import context_parallel as ncp


def _failures(results: list) -> str:
    return "\n".join(r.line() for r in results if not r.passed)


# ------------------------------------------------------------------------------------------
# Layout and schedule (pure index arithmetic)
# ------------------------------------------------------------------------------------------


def test_zig_zag_layout_gives_rank_r_chunks_r_and_2n_minus_1_minus_r():
    # 16 positions, 4 ranks, 8 chunks of 2: rank 0 holds chunks 0 and 7, rank 3 chunks 3 and 4
    assert cp.positions(16, 4, True) == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert cp.positions(8, 4, False) == list(range(8))
    assert cp.segments(16, 4, 3, True) == ((6, 8), (8, 10))


def _computed_pairs(case_q: int, case_kv: int, world: int, load_balance: bool, **structure):
    """Brute force: per rank, the (query chunk, key chunk) pairs with an allowed position."""
    allowed = reference.structural_mask(case_q, case_kv, **structure)  # (q_len, kv_len)
    counts = []
    for rank in range(world):
        count = 0
        for q0, q1 in cp.segments(case_q, world, rank, load_balance):
            for other in range(world):
                for k0, k1 in cp.segments(case_kv, world, other, load_balance):
                    count += bool(allowed[q0:q1, k0:k1].any())
        counts.append(count)
    return counts


@pytest.mark.parametrize("load_balance", [False, True])
def test_ring_computes_exactly_the_pairs_the_causal_rule_keeps(monkeypatch, load_balance):
    calls = []
    original = nblocks.forward_tiles
    monkeypatch.setattr(nblocks, "forward_tiles",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 16, 4)) for _ in range(3))
    trace: list = []
    ncp.context_parallel_attention(q, k, v, world_size=4, is_causal=True,
                                   load_balance=load_balance, trace=trace)
    expected = _computed_pairs(16, 16, 4, load_balance, is_causal=True)
    assert len(calls) == sum(expected)
    if load_balance:  # zig-zag: every rank computes the same number of pairs
        assert len(set(expected)) == 1, expected
    else:  # contiguous: rank r computes r + 1 blocks, the last rank works 4× the first
        assert expected == [1, 2, 3, 4]


def test_ring_with_a_narrow_window_stops_after_the_neighbour_block():
    trace: list = []
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 16, 4)) for _ in range(3))
    out = ncp.context_parallel_attention(q, k, v, world_size=4, window=(2, 0), trace=trace)
    sends = [e for e in trace if e["event"] == "send" and e["what"] == "key"]
    assert len(sends) == 4  # one step of the ring: each rank sends its block once
    assert max(e["step"] for e in trace) == 1  # 2 of 4 steps
    ref = reference.attention(q, k, v, window=(2, 0)).output
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("strategy", cp.STRATEGIES)
def test_bytes_sent_match_each_strategys_formula(strategy):
    world, rng = 4, np.random.default_rng(2)
    q = rng.standard_normal((2, 8, 16, 4)).astype(np.float32)
    k = rng.standard_normal((2, 4, 16, 4)).astype(np.float32)
    v = rng.standard_normal((2, 4, 16, 4)).astype(np.float32)
    g = rng.standard_normal(q.shape).astype(np.float32)
    kwargs = {"world_size": world, "strategy": strategy, "is_causal": True, "load_balance": True}
    forward, both = [], []
    ncp.context_parallel_attention(q, k, v, trace=forward, **kwargs)
    ncp.context_parallel_attention_vjp(q, k, v, g, trace=both, **kwargs)
    sched = cp.schedule(strategy, world, 16, 16, True, "top_left", None, True)
    elements = {"query": q.size // world, "key": k.size // world, "value": v.size // world,
                "output": q.size // world}
    for rank in range(world):
        sent = sum(e["bytes"] for e in forward if e["event"] == "send" and e["rank"] == rank)
        total = sum(e["bytes"] for e in both if e["event"] == "send" and e["rank"] == rank)
        assert sent == cp.message_bytes(strategy, world, elements, 4, sched.steps, "forward")
        assert total - sent == cp.message_bytes(strategy, world, elements, 4, sched.steps,
                                                "backward")


def test_schedule_drawing_shows_the_balanced_zig_zag_ring():
    text = cp.draw(cp.schedule("ring", 4, 16, 16, True, "top_left", None, True))
    lines = text.splitlines()
    assert "zig-zag" in lines[0] and len(lines) == 6
    assert [line.split("|")[-1].strip() for line in lines[2:]] == ["9", "9", "9", "9"]


# ------------------------------------------------------------------------------------------
# Conformance: every backend against the float64 reference
# ------------------------------------------------------------------------------------------


#: JAX compiles one program per check: every strategy at 4 devices on the zig-zag GQA case and
#: at 2 devices on the cross bottom-right window case (``python -m conformance.context_parallel``
#: runs the whole matrix). torch and NumPy run every case at both world sizes.
CASES = {"jax": ("causal_zigzag_gqa_lengths@4", "cross_bottom_right_window@2")}


def _rows(backend: str) -> list:
    """The rows of ``backend``'s subprocess (JAX: 4 host devices; torch: 4 gloo ranks)."""
    return ccp.run_context_parallel((backend,), (2, 4), cases=CASES,
                                    timeout=timeout(500))


def _compared(rows: list) -> set:
    return {(r.world_size, r.strategy, r.case, r.step) for r in rows if r.step in ccp.STEPS}


def test_numpy_matches_the_reference_at_world_sizes_2_and_4():
    rows = ccp.run_context_parallel(("numpy",), (2, 4))
    assert not _failures(rows), _failures(rows)
    assert len(_compared(rows)) == 2 * len(cp.STRATEGIES) * len(ccp.CASES) * len(ccp.STEPS)
    assert {r.case for r in rows if r.step == "bad call"} == set(ccp.BAD_CALLS)


def _needs(package: str) -> None:
    """Skip without ``package`` (found, not imported: the checks run in subprocesses)."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"needs {package}: pip install -r requirements-test.txt")


@pytest.mark.slow
def test_torch_gloo_ranks_match_the_reference_and_fail_together():
    _needs("torch")
    rows = _rows("torch")
    assert not _failures(rows), _failures(rows)
    assert len(_compared(rows)) == 2 * len(cp.STRATEGIES) * len(ccp.CASES) * len(ccp.STEPS)
    bad = {r.case for r in rows if r.step == "bad call"}
    assert bad == set(ccp.BAD_CALLS) | {"mismatched_shards", "rank_never_joins"}


@pytest.mark.slow
def test_jax_mesh_matches_the_reference():
    _needs("jax")
    rows = _rows("jax")
    assert not _failures(rows), _failures(rows)
    assert len(_compared(rows)) == 2 * len(cp.STRATEGIES) * len(ccp.STEPS)
    assert {r.case for r in rows if r.step == "bad call"} == set(ccp.BAD_CALLS) | {
        "mesh_without_axis"}


# ------------------------------------------------------------------------------------------
# numpy_attn: the messages each strategy sends (its trace), step by step
# ------------------------------------------------------------------------------------------

#: 3 ranks, 6 positions, 3 heads of 2 dims, float32: a rank's shard is 1·3·2·2·4 = 48 bytes
CP_WORLD, CP_SHARD = 3, 48


def _cp_inputs(dtype=np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(13)
    return [rng.standard_normal((1, 3, 6, 2)).astype(dtype) for _ in range(4)]


def _sends(step: int, what: str, to: Any, nbytes: int) -> list[dict]:
    """Every rank's send of ``what`` at ``step`` (``to``: a rank's receiver, or "all")."""
    return [{"step": step, "rank": r, "event": "send", "what": what,
             "to": to(r) if callable(to) else to, "bytes": nbytes} for r in range(CP_WORLD)]


def _ring_events(sched: cp.Schedule, backward: bool) -> list[dict]:
    """The ring as the module docstring tells it: at step ``s`` rank ``r`` computes block
    ``r - s``, then passes its blocks (and gradients) to ``r + 1``; gradients go home."""
    n, events = CP_WORLD, []
    for s in range(sched.steps):
        events += [{"step": s, "rank": r, "event": "compute", "block": (r - s) % n,
                    "pairs": cp.block_needed(sched, r, (r - s) % n)} for r in range(n)]
        if s + 1 < sched.steps:
            for what in ("key", "value") + (("grad_key", "grad_value") if backward else ()):
                events += _sends(s, what, lambda r: (r + 1) % n, CP_SHARD)
    home = (1 - sched.steps) % n  # rank r holds the gradients of rank r - (steps - 1)
    if backward and home:
        for what in ("grad_key", "grad_value"):
            events += _sends(sched.steps, what, lambda r: (r + home) % n, CP_SHARD)
    return events


@pytest.mark.parametrize("window", [None, (2, 0)])
def test_the_ring_sends_each_block_to_the_next_rank_and_the_gradients_home(window):
    q, k, v, g = _cp_inputs()
    options = {"world_size": CP_WORLD, "strategy": "ring", "window": window}
    sched = cp.schedule("ring", CP_WORLD, 6, 6, False, "top_left", window, False)
    assert sched.steps == (3 if window is None else 2)  # home: 1 rank on, or 2
    forward, both = [], []
    ncp.context_parallel_attention(q, k, v, trace=forward, **options)
    ncp.context_parallel_attention_vjp(q, k, v, g, trace=both, **options)
    assert forward == _ring_events(sched, False)
    assert both == _ring_events(sched, False) + _ring_events(sched, True)
    assert all(type(e["bytes"]) is int for e in both if e["event"] == "send")


def test_all_gather_and_ulysses_send_what_their_collectives_send():
    """all-gather: each rank sends its shard to the N - 1 others (keys, values; again in the
    backward pass), then the reduce-scatter sends (N - 1)/N of its whole-sequence gradient;
    Ulysses' all-to-alls send (N - 1)/N of each shard. Every ``step`` 0, bytes ints."""
    q, k, v, g = _cp_inputs()
    n, gather = CP_WORLD, (CP_WORLD - 1) * CP_SHARD
    scatter = (n - 1) * (n * CP_SHARD) // n  # of the whole sequence's gradient
    pieces = (n - 1) * CP_SHARD // n
    gathers = _sends(0, "key", "all", gather) + _sends(0, "value", "all", gather)
    expected = {
        "all_gather": (gathers, gathers + gathers + _sends(0, "grad_key", "all", scatter)
                       + _sends(0, "grad_value", "all", scatter)),
        "ulysses": ([e for w in ("query", "key", "value", "output")
                     for e in _sends(0, w, "all", pieces)],
                    [e for w in ("query", "key", "value", "output", "grad_output", "grad_query",
                                 "grad_key", "grad_value") for e in _sends(0, w, "all", pieces)]),
    }
    for strategy, (want_forward, want_both) in expected.items():
        forward, both = [], []
        ncp.context_parallel_attention(q, k, v, world_size=n, strategy=strategy, trace=forward)
        ncp.context_parallel_attention_vjp(q, k, v, g, world_size=n, strategy=strategy,
                                           trace=both)
        assert forward == want_forward, strategy
        assert both == want_both, strategy
        assert all(type(e["bytes"]) is int for e in both), strategy


# ------------------------------------------------------------------------------------------
# numpy_attn: dtypes, padding, defaults, cross-attention and the bad calls
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", cp.STRATEGIES)
def test_context_parallel_in_float64_equals_the_reference_to_1e_12(strategy):
    """float64 in, float64 out (computed in float64: 1e-12 of the reference), on the zig-zag
    layout, causal, with ``kv_lengths`` (sequence 1 has no key: its rows and gradients are
    0); the reference reads ``kv_lengths`` as a mask of the keys."""
    rng = np.random.default_rng(14)
    world, lengths = 2, np.array([5, 0])
    q, k, v, g = (rng.standard_normal((2, 2, 8, 2)) for _ in range(4))
    order = cp.positions(8, world, True)  # layout order → natural order: x[..., back, :]
    back = np.argsort(order)
    options = {"world_size": world, "strategy": strategy, "is_causal": True,
               "kv_lengths": lengths, "load_balance": True}
    output = ncp.context_parallel_attention(q, k, v, **options)
    grads = ncp.context_parallel_attention_vjp(q, k, v, g, **options)
    mask = (np.arange(8)[None, :] < lengths[:, None])[:, None, None, :]
    natural = [x[..., back, :] for x in (q, k, v, g)]
    expected = reference.attention(*natural[:3], mask=mask, is_causal=True).output
    expected_grads = reference.attention_vjp(*natural, mask=mask, is_causal=True)
    assert output.dtype == np.float64 and all(x.dtype == np.float64 for x in grads)
    np.testing.assert_allclose(output[..., back, :], expected, rtol=0, atol=1e-12)
    for got, want in zip(grads, (expected_grads.query, expected_grads.key,
                                 expected_grads.value), strict=True):
        np.testing.assert_allclose(got[..., back, :], want, rtol=0, atol=1e-12)
    assert not output[1].any() and not grads[0][1].any()


@pytest.mark.parametrize(("change", "message"), [
    ({"strategy": "tree"}, "strategy must be one of"),
    ({"world_size": 3}, ""),
    ({"kv_lengths": np.array([7, 2])}, r"kv_lengths must lie in \[0, 4\]"),
])
def test_context_parallel_errors_name_the_function_called(change, message):
    """The forward and the vjp name themselves (the vjp's name is not the forward's)."""
    q, k, v, g = (np.zeros((2, 2, 4, 2), np.float32) for _ in range(4))
    options = {"world_size": 2, **change}
    with pytest.raises(ValueError, match=rf"^context_parallel_attention: .*{message}"):
        ncp.context_parallel_attention(q, k, v, **options)
    with pytest.raises(ValueError, match=rf"^context_parallel_attention_vjp: .*{message}"):
        ncp.context_parallel_attention_vjp(q, k, v, g, **options)


def test_context_parallel_defaults_scale_and_dtype():
    """The defaults (the ring, the natural layout, no causal rule) and a given scale: the
    reference's output and gradients; float32 in, float32 out; a ``grad_output`` of the wrong
    shape is named."""
    q, k, v, g = (x.astype(np.float64) for x in _cp_inputs())
    output = ncp.context_parallel_attention(q, k, v, world_size=2, scale=0.7)
    grads = ncp.context_parallel_attention_vjp(q, k, v, g, world_size=2, scale=0.7)
    np.testing.assert_allclose(output, reference.attention(q, k, v, scale=0.7).output,
                               rtol=0, atol=1e-12)
    expected = reference.attention_vjp(q, k, v, g, scale=0.7)
    for got, want in zip(grads, (expected.query, expected.key, expected.value), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    single = [x.astype(np.float32) for x in (q, k, v, g)]
    assert ncp.context_parallel_attention(*single[:3], world_size=2).dtype == np.float32
    grads = ncp.context_parallel_attention_vjp(*single, world_size=2)
    assert [x.dtype for x in grads] == [np.float32] * 3
    with pytest.raises(ValueError, match=r"^context_parallel_attention_vjp: .*grad_output"):
        ncp.context_parallel_attention_vjp(q, k, v, g[..., :1], world_size=2)


def test_context_parallel_checks_every_input_by_name():
    q = np.zeros((2, 2, 4, 2), np.float32)
    calls = [
        ({"query": q.tolist()}, TypeError, r"query must be an array"),
        ({"key": q.tolist()}, TypeError, r"key must be an array"),
        ({"value": q.tolist()}, TypeError, r"value must be an array"),
        ({"key": q.astype(np.float64)}, TypeError, r"inputs must share one dtype"),
        ({"kv_lengths": np.array([1.5, 2.0])}, ValueError, r"kv_lengths must be ints"),
        ({"kv_lengths": np.array([1, 2, 3])}, ValueError, r"kv_lengths must be ints"),
        ({"query": np.zeros((2, 2, 6, 2), np.float32), "world_size": 4}, ValueError,
         r"q_len and kv_len must split into 4 equal chunks .* q_len=6, kv_len=4"),
    ]
    for change, error, message in calls:
        args = {"query": q, "key": q, "value": q, "world_size": 2, **change}
        with pytest.raises(error, match=rf"^context_parallel_attention: {message}"):
            ncp.context_parallel_attention(**args)
    with pytest.raises(TypeError, match=r"^context_parallel_attention_vjp: grad_output must be"):
        ncp.context_parallel_attention_vjp(q, q, q, q.tolist(), world_size=2)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("strategy", cp.STRATEGIES)
def test_context_parallel_cross_attention_aligns_the_causal_rule(strategy, alignment):
    """4 queries over 8 keys, causal from the top left (query i sees keys j <= i) or the
    bottom right (j <= i + 4), at 2 ranks: the reference's output (the schedule's band
    follows the alignment)."""
    rng = np.random.default_rng(15)
    q = rng.standard_normal((1, 2, 4, 2))
    k, v = rng.standard_normal((1, 2, 8, 2)), rng.standard_normal((1, 2, 8, 2))
    options = {"is_causal": True, "causal_alignment": alignment}
    output = ncp.context_parallel_attention(q, k, v, world_size=2, strategy=strategy, **options)
    np.testing.assert_allclose(output, reference.attention(q, k, v, **options).output,
                               rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------
# Memory per device (issue 26): the ring holds about 1/N of one device's
# ------------------------------------------------------------------------------------------


def _memory_benchmark():
    """``benchmarks/context_parallel_memory.py``, the measurement these tests share with the
    benchmark (docs/context_parallel.md, "Memory per device", says what it counts)."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:  # spawned torch ranks import the module by this name too
        sys.path.insert(0, root)
    return importlib.import_module("benchmarks.context_parallel_memory")


def _memory_ratios() -> dict[str, float]:
    """Per framework and length, the ring's per-device peak over one device's (below)."""
    bench, ratios = _memory_benchmark(), {}
    if importlib.util.find_spec("jax") is not None:
        one, ring, one_long, ring_long = bench.jax_memory(
            (4096, 1, "blockwise"), (4096, 4, "ring"), (16384, 1, "blockwise"),
            (16384, 4, "ring"), timeout=timeout(600))
        ratios["jax 4096"] = ring["total"] / one["total"]
        ratios["jax 16384"] = ring_long["total"] / one_long["total"]
    if importlib.util.find_spec("torch") is not None:
        ring = bench.torch_memory(4096, 4, timeout=timeout(400))
        ratios["torch 4096"] = ring["total"] / bench.torch_memory(4096, 1)["total"]
    return ratios


@pytest.mark.slow
def test_ring_per_device_memory_is_at_most_035_of_one_device():
    """The ring at 4 devices, forward + backward, 8 heads of 64, causal, zig-zag: each device's
    peak within 0.35 of single-device ``blockwise_attention``'s. JAX: the compiled programs'
    memory analysis (arguments, outputs, temporaries; compiled, never run) at 4,096 and 16,384
    tokens, in a subprocess; torch: the live-tensor peak of rank 0 of 4 gloo ranks at 4,096
    tokens (the inputs plus every storage the call allocates). Before issue 26: JAX 0.51 and
    0.69, torch 0.48."""
    ratios = _memory_ratios()
    if not ratios:
        pytest.skip("needs jax or torch: pip install -r requirements-test.txt")
    assert all(r <= 0.35 for r in ratios.values()), ratios


# ------------------------------------------------------------------------------------------
# The spec's stubs
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("package", ["numpy_attn", "jax_attn", "torch_attn"])
@pytest.mark.parametrize("name", spec.CONTEXT_PARALLEL_FUNCTIONS)
def test_signatures_are_the_spec_stubs_with_the_backends_devices(package, name):
    if importlib.util.find_spec(package.split("_")[0]) is None:
        pytest.skip(f"{package} needs its framework (pip install -r requirements-test.txt)")
    function = getattr(importlib.import_module(package), name)
    devices = spec.CONTEXT_PARALLEL_DEVICES[package]
    params = inspect.signature(function).parameters.values()
    stub = inspect.signature(getattr(spec, name)).parameters.values()
    got = [(p.name, p.kind, p.default) for p in params if p.name not in devices]
    want = [(p.name, p.kind, p.default) for p in stub if p.name != "devices"]
    assert got == want
    assert [p.name for p in params if p.name in devices] == list(devices)
    assert "(" in function.__doc__
    assert tuple(spec.CONTEXT_PARALLEL_STRATEGIES) == cp.STRATEGIES


# ------------------------------------------------------------------------------------------
# The document's snippets
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_documents_snippets_run_and_print_what_it_says():
    """docs/context_parallel.md, run as tests/test_docs.py runs the other documents (one fresh
    process, in order); refresh with ``python tests/test_docs.py --update
    docs/context_parallel.md``."""
    _needs("jax")
    from test_docs import ROOT, _normal, blocks, run_snippets

    found = blocks(ROOT / "docs" / "context_parallel.md")
    assert len(found) >= 4
    for (code, documented), result in zip(found, run_snippets([c for c, _ in found]),
                                          strict=True):
        first = code.strip().splitlines()[0]
        assert result["error"] is None, f"snippet {first!r} failed:\n{result['error']}"
        if documented is not None:
            assert _normal(result["out"]) == _normal(documented), (first, result["out"])


@pytest.mark.parametrize(("file", "shared"), [
    ("context_parallel.py", {"_arguments", "_ring_forward", "_ring_backward", "_ulysses_forward"}),
    ("context_blocks.py", {"attend", "attend_pair", "attend_backward", "ring_shift", "all_to_all"}),
])
def test_the_three_files_define_their_shared_functions_in_the_same_order(file, shared):
    """``diff numpy_attn/context_parallel.py torch_attn/context_parallel.py`` (and the same of
    ``context_blocks.py``) shows the library differences: the functions they share come in the
    same order."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent

    def names(package: str) -> list[str]:
        tree = ast.parse((root / package / file).read_text(encoding="utf-8"))
        return [n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]

    packages = ("numpy_attn", "jax_attn", "torch_attn")
    common = set(names(packages[0])).intersection(*(names(p) for p in packages[1:]))
    orders = [[n for n in names(p) if n in common] for p in packages]
    assert orders[0] == orders[1] == orders[2], orders
    assert shared <= common  # the merge is _core._merge_partials
