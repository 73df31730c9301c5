"""How numpy_attn's tuner (``numpy_attn/_fast/tuning.py``) decides and keeps its choices.

The tuner times every combination of a step's candidates once per shape class (full attention
only), keeps a winner that beats the fixed table by ``MARGIN`` twice, and keeps the choice for
the process and in a cache file per machine, read as untrusted input. The trials run on a
simulated clock (``tuner``), so the machine's load cannot change a decision; one test runs the
real tuner on the real path. That a choice never changes values is ``test_tuning.py``.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from numerics import assert_matches_reference

import numpy_attn
from numpy_attn import _fast, _threads
from numpy_attn._fast import tuning


@pytest.fixture
def tuning_on(monkeypatch, tmp_path):
    """Tuning on, its cache in ``tmp_path``, no choice in memory."""
    monkeypatch.setenv("ATTENTION_TUNING", "on")
    monkeypatch.setenv("ATTENTION_TUNING_CACHE", str(tmp_path))
    tuning.forget()
    yield tmp_path
    tuning.forget()


@pytest.fixture
def tuner(tuning_on, monkeypatch):
    """``tuning_on`` with the trials' clock simulated (``_slow_unless``: the machine's load
    cannot change a decision)."""
    monkeypatch.setattr(tuning, "_clock", lambda: CLOCK[0])
    return tuning_on


CLOCK = [0.0]  # the simulated seconds of the trials


def _slow_unless(fast: dict, calls: list):
    """A trial that takes 1 ms, and 3 ms more for each entry of ``fast`` the choice lacks (on
    the simulated clock)."""
    def trial(kind, choice, *arrays):
        calls.append((kind, choice))
        CLOCK[0] += 0.001 + 0.003 * sum(getattr(choice, name) != value
                                        for name, value in fast.items())
    return trial


SHAPES = ((1, 8, 2048, 64), (1, 8, 2048, 64), (1, 8, 2048, 64))


BASE = tuning.Choice(128, 128, 512, False, False, True)


# the forward's candidates: every exponential, product order and block_q
FORWARD_CANDIDATES = (len(tuning.CANDIDATES["exp2"]) * len(tuning.CANDIDATES["keys_first"])
                      * len(tuning.CANDIDATES["block_q"]))


def test_measures_once_per_class_then_reads_the_cache_file(tuner):
    """The fastest candidate wins; a second class measures again; after ``forget`` (a new
    process) the cache file answers without a trial. The file names this machine."""
    calls = []
    trial = _slow_unless({"block_q": 64, "exp2": True, "keys_first": True}, calls)
    got = tuning.choose("forward", *SHAPES, "float32", BASE, trial)
    assert got == tuning.Choice(64, 128, 512, True, True, True)
    measured = len(calls)
    assert measured > 0
    assert tuning.choose("forward", *SHAPES, "float32", BASE, trial) == got
    assert len(calls) == measured  # in memory
    backward = tuning.choose("backward", *SHAPES, "float32", got, _slow_unless(
        {"block_kv": 256, "block_q_backward": 512, "keys_first_backward": False}, calls))
    assert backward == tuning.Choice(64, 256, 512, True, True, False)
    tuning.forget()
    calls.clear()
    assert tuning.choose("forward", *SHAPES, "float32", BASE, trial) == got
    assert tuning.choose("backward", *SHAPES, "float32", got, trial) == backward
    assert calls == []  # read back from the file
    data = json.loads(Path(tuning.cache_file()).read_text())
    assert data["machine"]["cpu"] == tuning.cpu_model()
    assert data["choices"] == {
        "forward/float32/d64/v64/q512/k2048": {"block_q": 64, "exp2": True, "keys_first": True},
        "backward/float32/d64/v64/q2048/k512": {"block_kv": 256, "block_q_backward": 512,
                                                "keys_first_backward": False}}
    assert [p.name for p in tuner.iterdir()] == [Path(tuning.cache_file()).name]  # no temp


def test_noise_keeps_the_fixed_table(tuner):
    """Candidates no faster than the fixed table's entries (by ``MARGIN``) leave them."""
    calls = []
    got = tuning.choose("forward", *SHAPES, "float32", BASE, _slow_unless({}, calls))
    assert got == BASE and len(calls) > 2


def test_a_win_that_does_not_repeat_keeps_the_fixed_table(tuner):
    """A candidate faster in the first rounds only (a burst of load on the others) is timed
    against the fixed table again, and loses there."""
    calls = []
    first_rounds = 1 + tuning.ROUNDS * FORWARD_CANDIDATES * 2

    def trial(kind, choice, *arrays):
        calls.append(choice)
        CLOCK[0] += 0.001 if choice.block_q == 64 and len(calls) <= first_rounds else 0.004

    assert tuning.choose("forward", *SHAPES, "float32", BASE, trial) == BASE
    assert len(calls) == first_rounds + tuning.ROUNDS * 2 * 2


@pytest.mark.parametrize("content", [
    b"", b"not json", b"\xff\xfe", b"[1, 2]", b'{"format": 1}', b"{" * 100_000,
    "other machine", "older format", "wrong types", "a switch not a bool", "out of range",
    "entries not an object", "extra entry", "too large",
])
def test_a_bad_cache_file_is_ignored_and_replaced(tuner, content):
    path = Path(tuning.cache_file())
    good = {"format": tuning.FORMAT, "machine": tuning.machine(), "choices": {}}
    key = "forward/float32/d64/v64/q512/k2048"
    entries = {"block_q": 32, "exp2": True, "keys_first": False}  # valid on this machine
    if content == "other machine":
        content = dict(good, machine=dict(tuning.machine(), cpu="another CPU"),
                       choices={key: entries})
    elif content == "older format":
        content = dict(good, format=1, choices={key: {"block_q": 32, "exp2": True}})
    elif content == "wrong types":
        content = dict(good, choices={key: dict(entries, block_q=True, exp2=1)})
    elif content == "a switch not a bool":
        content = dict(good, choices={key: dict(entries, keys_first=0)})
    elif content == "out of range":
        content = dict(good, choices={key: dict(entries, block_q=0)})
    elif content == "entries not an object":
        content = dict(good, choices={key: [32, True, False]})
    elif content == "extra entry":
        content = dict(good, choices={key: dict(entries, block_kv=1)})
    elif content == "too large":
        content = dict(good, choices={key: entries}, padding="x" * (tuning.MAX_FILE_BYTES + 1))
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    calls = []
    got = tuning.choose("forward", *SHAPES, "float32", BASE, _slow_unless({"block_q": 256},
                                                                            calls))
    assert got.block_q == 256 and calls  # measured, not read
    assert json.loads(path.read_text())["choices"][key]["block_q"] == 256


def test_threads_racing_to_a_class_get_one_decision(tuner):
    calls, results = [], []
    trial = _slow_unless({"block_q": 256}, calls)
    threads = [threading.Thread(target=lambda: results.append(
        tuning.choose("forward", *SHAPES, "float32", BASE, trial))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1 and len(results) == 4
    # one measurement: every combination of the forward's entries, the winner confirmed, each
    # candidate run twice a round
    assert len(calls) == 1 + tuning.ROUNDS * 2 * (FORWARD_CANDIDATES + 2)


def test_an_unwritable_cache_folder_keeps_the_choice_in_memory(tuner, monkeypatch):
    blocker = tuner / "file"
    blocker.write_text("")
    monkeypatch.setenv("ATTENTION_TUNING_CACHE", str(blocker / "tuning"))  # under a file
    calls = []
    got = tuning.choose("forward", *SHAPES, "float32", BASE, _slow_unless({"block_q": 64}, calls))
    assert got.block_q == 64
    n = len(calls)
    assert tuning.choose("forward", *SHAPES, "float32", BASE, _slow_unless({}, calls)) == got
    assert len(calls) == n


def test_the_real_tuner_on_the_real_path(tuning_on):
    """Tuning on, the shipped thresholds: the first call measures and writes the cache, every
    later call gives the first one's bits, and the result meets the tolerance rule like the
    fixed table's."""
    gen = np.random.default_rng(5)
    q, k, v = (gen.standard_normal((1, 4, 512, 32)).astype(np.float32) for _ in range(3))
    first = numpy_attn.scaled_dot_product_attention(q, k, v)
    choices = json.loads(Path(tuning.cache_file()).read_text())["choices"]
    assert list(choices) == ["forward/float32/d32/v32/q512/k512"]
    again = numpy_attn.scaled_dot_product_attention(q, k, v)
    assert first.tobytes() == again.tobytes()
    assert_matches_reference(first, {"query": q.astype(np.float64), "key": k.astype(np.float64),
                                     "value": v.astype(np.float64)}, "float32")


def test_the_entries_are_timed_together(tuner):
    """A combination that wins only whole (each of its entries alone is slower than the fixed
    table) is found: the candidates are every combination, not one entry at a time."""
    calls = []
    winner = {"keys_first_backward": False, "block_kv": 512, "block_q_backward": 256}

    def trial(kind, choice, *arrays):
        calls.append(choice)
        matches = sum(getattr(choice, name) == value for name, value in winner.items())
        CLOCK[0] += 0.001 if matches == len(winner) else 0.002 + 0.001 * matches

    assert tuning.choose("backward", *SHAPES, "float32", BASE, trial) == tuning.Choice(
        128, 512, 256, False, False, False)


def test_causal_and_windowed_calls_run_the_fixed_table(tuning_on, monkeypatch):
    """Tuning on: a causal or windowed call runs the fixed table and times nothing (only full
    attention is tuned), a full call of the same shapes measures."""
    gen = np.random.default_rng(6)
    q, k, v, g = (gen.standard_normal((1, 4, 512, 16)).astype(np.float32) for _ in range(4))
    trials = []
    monkeypatch.setattr(_fast, "_trial", lambda *args: trials.append(args[0]))
    numpy_attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    numpy_attn.scaled_dot_product_attention_vjp(q, k, v, g, window=(8, 0))
    assert trials == [] and not Path(tuning.cache_file()).exists()
    numpy_attn.scaled_dot_product_attention(q, k, v)
    assert trials and set(trials) == {"forward"}


def test_shape_classes_round_lengths_up_to_powers_of_two_and_cap_them():
    def name(kind, q_len, kv_len, head_dim=64, v_dim=32):
        return tuning._shape_class(kind, (1, 8, q_len, head_dim), (1, 2, kv_len, head_dim),
                                   (1, 2, kv_len, v_dim), "float32")

    assert name("forward", 300, 3000) == "forward/float32/d64/v32/q512/k4096"
    assert name("forward", 1, 1) == "forward/float32/d64/v32/q1/k1"
    assert name("forward", 65, 129, 16, 8) == "forward/float32/d16/v8/q128/k256"
    assert name("forward", 513, 9000) == "forward/float32/d64/v32/q512/k4096"  # capped
    assert name("backward", 3000, 100) == "backward/float32/d64/v32/q2048/k128"
    assert name("backward", 2048, 512) == "backward/float32/d64/v32/q2048/k512"
    assert name("backward", 2049, 513) == "backward/float32/d64/v32/q2048/k512"  # capped
    # the lengths are the second axis from the end, whatever the batch axes
    assert tuning._shape_class("forward", (100, 40), (70, 40), (70, 8), "float64") == \
        "forward/float64/d40/v8/q128/k128"
    assert tuning._shape_class("forward", (2, 3, 4, 300, 16), (2, 3, 4, 9, 16),
                               (2, 3, 4, 9, 16), "float32") == "forward/float32/d16/v16/q512/k16"


def test_the_trial_runs_on_random_inputs_of_the_class(tuner):
    """One head per core, the class's lengths and widths, in its dtype, standard normal."""
    seen = []

    def trial(kind, choice, q, k, v, g, shared):
        seen.append((q, k, v, g, shared))
        CLOCK[0] += 0.001

    shapes = ((1, 8, 300, 16), (1, 8, 1000, 16), (1, 8, 1000, 8))
    tuning.choose("forward", *shapes, "float32", BASE, trial)
    heads = _threads._cores()
    q, k, v, g, shared = seen[0]
    assert (q.shape, k.shape, v.shape, g.shape) == ((1, heads, 512, 16), (1, heads, 1024, 16),
                                                    (1, heads, 1024, 8), (1, heads, 512, 8))
    assert {x.dtype.name for x in (q, k, v, g)} == {"float32"}
    for x in (q, k, v, g):
        assert np.isfinite(x).all() and 0.8 < x.std() < 1.2 and abs(x.mean()) < 0.2
    assert isinstance(shared, dict)
    for other in seen:  # the same inputs, and the one shared dict, for every call
        assert all(a is b for a, b in zip(other, seen[0], strict=True))
    tuning.forget()  # a new process, a machine without the cache file: the same trial inputs
    Path(tuning.cache_file()).unlink()
    seen.clear()
    tuning.choose("forward", *shapes, "float32", BASE, trial)
    assert all((a == b).all() for a, b in zip(seen[0][:4], (q, k, v, g), strict=True))


def test_the_machine_is_named_by_its_cpu_model_and_blas(monkeypatch):
    """The cache file's key names this CPU (``/proc/cpuinfo``'s model name), NumPy's BLAS as
    threadpoolctl reports it, and the versions a choice depends on."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    monkeypatch.setitem(tuning._state, "machine", None)  # made again, not this process's
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                  if line.lower().startswith("model name")]
        if models:
            assert tuning.cpu_model() == models[0]
    from threadpoolctl import threadpool_info

    blas = [lib for lib in threadpool_info() if lib.get("user_api") == "blas"]
    if blas:
        assert tuning.blas_name() == " ".join(str(blas[0].get(key)) for key in (
            "internal_api", "version", "architecture", "threading_layer"))
    machine = tuning.machine()
    assert machine["cpu"] == tuning.cpu_model() and machine["blas"] == tuning.blas_name()
    assert machine["numpy"] == np.__version__ and machine["cores"] == str(_threads._cores())
    assert machine["python"] == platform.python_version()
    try:
        assert machine["numpy_attn"] == version("attention-three-ways")
    except PackageNotFoundError:  # run from a checkout that is not installed
        assert machine["numpy_attn"] == "checkout"
    assert sorted(machine) == ["blas", "cores", "cpu", "numpy", "numpy_attn", "python"]


def test_a_candidate_at_exactly_the_margin_wins(tuner):
    """``MARGIN`` is inclusive: a candidate that takes exactly that fraction of the fixed
    table's time, in both sets of rounds, replaces it (whole simulated seconds: exact)."""
    def trial(kind, choice, *arrays):
        CLOCK[0] += 95.0 if choice.block_q == 64 else 100.0

    assert tuning.MARGIN == 95.0 / 100.0
    assert tuning.choose("forward", *SHAPES, "float32", BASE, trial).block_q == 64


def test_the_median_over_the_rounds_decides(tuner):
    """A candidate fast in 2 of the 5 rounds of each set (a lull on a busy machine) is slow by
    the median: the fixed table stays."""
    calls = []
    first = 1 + tuning.ROUNDS * 2 * FORWARD_CANDIDATES  # warm-up, then the rounds

    def trial(kind, choice, *arrays):
        calls.append(choice)
        i = len(calls) - 1
        rounds = (i - 1) // (2 * FORWARD_CANDIDATES) if i < first else (i - first) // 4
        fast = choice.block_q == 64 and rounds < 2
        CLOCK[0] += 0.001 if fast else 0.004 if choice.block_q == 64 else 0.002

    assert tuning.choose("forward", *SHAPES, "float32", BASE, trial) == BASE


def test_the_cache_file_limits_are_inclusive(tuner):
    """Entries from 1 to 65,536 are valid, and a file of exactly ``MAX_FILE_BYTES`` is read;
    0, 65,537 and a byte more are not."""
    path = Path(tuning.cache_file())
    key = "forward/float32/d64/v64/q512/k2048"

    def written(block_q: int, size: int | None = None) -> dict:
        data = {"format": tuning.FORMAT, "machine": tuning.machine(),
                "choices": {key: {"block_q": block_q, "exp2": True, "keys_first": False}}}
        text = json.dumps(data)
        path.write_text(text if size is None else text + " " * (size - len(text)))
        return tuning._read_cache()

    assert written(1) and written(1 << 16)
    assert not written(0) and not written((1 << 16) + 1)
    assert written(64, tuning.MAX_FILE_BYTES)
    assert not written(64, tuning.MAX_FILE_BYTES + 1)


def test_a_clock_too_coarse_to_see_a_call_keeps_the_fixed_table(tuner):
    """Calls that take no time on the clock (its resolution) give ratios of 1, never a division
    by zero: nothing beats the fixed table."""
    def trial(kind, choice, *arrays):
        CLOCK[0] += 0.0 if choice == BASE else 0.001

    assert tuning.choose("forward", *SHAPES, "float32", BASE, trial) == BASE


def test_the_machine_is_named_without_proc_cpuinfo_or_threadpoolctl(monkeypatch):
    """Where ``/proc/cpuinfo`` cannot be read the CPU is ``platform``'s name, and without
    threadpoolctl the BLAS is NumPy's build configuration's."""
    import builtins
    import platform

    real_open = builtins.open

    def no_cpuinfo(path, *args, **kwargs):
        if str(path) == "/proc/cpuinfo":
            raise OSError("not here")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_cpuinfo)
    assert tuning.cpu_model() == (platform.processor() or platform.machine() or "unknown")
    monkeypatch.setattr(builtins, "open", real_open)
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # import fails
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    assert tuning.blas_name() == f"{blas['name']} {blas['version']}"


def test_a_trial_runs_the_fast_path_of_its_step_with_its_choice(monkeypatch):
    """``_fast._trial`` computes what the fast path computes with that choice, full attention:
    the forward pass's output, or the VJP's gradients (bit for bit: the same code, the same
    blocks); the VJP's forward pass runs once per ``shared`` dict, however many trials."""
    gen = np.random.default_rng(7)
    q, k, v, g = (gen.standard_normal((1, 2, 256, 16)).astype(np.float32) for _ in range(4))
    choice = tuning.Choice(64, 128, 128, True, True, False)
    entries = {name: getattr(choice, name) for name in (
        "block_q", "block_kv", "block_q_backward", "exp2", "keys_first", "keys_first_backward")}
    monkeypatch.setattr(_fast, "MIN_SCORES", 0)
    tuning.set_tuning(entries)
    try:
        want_out = numpy_attn.scaled_dot_product_attention(q, k, v)
        want_grads = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, g)
    finally:
        tuning.set_tuning(None)
    assert _fast._trial("forward", choice, q, k, v, g, {}).tobytes() == want_out.tobytes()
    forward_passes = []
    real_inputs = _fast._vjp_inputs
    monkeypatch.setattr(_fast, "_vjp_inputs", lambda *args: forward_passes.append(1)
                        or real_inputs(*args))
    shared: dict = {}
    for _ in range(2):
        grads = _fast._trial("backward", choice, q, k, v, g, shared)
        for got, want in zip(grads[:3], want_grads[:3], strict=True):
            assert got.tobytes() == want.tobytes()
    assert forward_passes == [1]
