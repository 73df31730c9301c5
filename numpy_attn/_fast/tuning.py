"""The choices of numpy_attn's blocked fast path, made by measurement on the machine at hand.

The blocked path (``_fast/forward.py``, ``_fast/backward.py``) has choices that change its
speed and never what it computes (``spec.FAST_PATH_RULES["tuning"]``):

* ``block_q``: queries per forward block (a block's ``(block_q, kv_len)`` scores should stay in
  the core's cache);
* ``exp2``: the exponential of the forward blocks and of the VJP's tiles: ``exp`` of the
  scores, or ``exp2`` of the scores in units of log2 e (FlashAttention's trick: where NumPy
  vectorises float32 ``exp2``, in its AVX-512 loops, it takes half ``exp``'s time; elsewhere it
  loops over the C library's), decided with the forward pass;
* ``block_kv`` and ``block_q_backward``: keys per VJP task and queries per VJP tile;
* ``keys_first`` and ``keys_first_backward``: the order of the score products, forward and
  in the VJP's tiles: ``keys @ queriesᵀ`` into a ``(keys, queries)`` buffer, or ``queries @
  keysᵀ`` into a ``(queries, keys)`` one, the other steps reading it through its transpose
  (the same sums; OpenBLAS's kernels for ``(2048, 64) @ (64, 128)`` and ``(128, 64) @ (64,
  2048)`` differ by up to 1.4x, and which is faster depends on the CPU).

Which is fastest depends on the CPU (its caches, its SIMD width, the BLAS kernels NumPy has for
it), not on the code; so, as FFTW's planner and Triton's autotuner do, ``choose`` times the
candidates (``attention_rules.fast_paths.TUNING``, every combination of a step's entries: the
faster product order depends on the block) the first time a *shape class* needs them, and keeps
the fastest. A shape class is the step (``forward``; ``backward``, the VJP), the compute dtype,
``head_dim``, ``v_dim``, and ``q_len`` and ``kv_len`` rounded up to a power of two and capped at
the trial's sizes (``TRIAL``). Only full attention is measured: a causal or windowed call runs
the fixed table (``measure=False``; on the AVX-512 machine of ``benchmarks/RESULTS.md`` every
causal candidate was within the noise of the fixed table, and the process's CPU time and the
wall time ranked them in opposite orders, so a trial of a second could not choose honestly;
larger blocks also waste more on the diagonal). The trial runs the fast path itself on random
inputs of that class, one head per core; the VJP's trial times its tiles only (its forward pass
is the forward's choice for every candidate, and runs once). In each of ``ROUNDS`` rounds every
candidate runs twice and its second call is timed (the first lets the allocator settle after the
previous candidate's buffers: a fresh allocation made some candidates look 1.5x slower than they
run in a loop), by the process's CPU time (``_clock``: a busy machine's other work does not add
to it); a candidate's time is the median over the rounds of its time over the fixed table's in
the same round, and it replaces the fixed table's entries only when that is at most ``MARGIN``
(5 % faster) twice, in a second set of rounds against the fixed table alone: noise keeps today's
numbers. It costs about a second per class on two cores, once per machine: the choice is kept in
memory for the process and on disk, a small JSON file per machine (``cache_file``: CPU model,
cores, NumPy, its BLAS and numpy_attn's version) in
``attention_rules.fast_paths.tuning_cache_folder()``, beside JAX's persistent compilation cache.
The file is written atomically (a temporary file renamed over it) and read as untrusted input:
anything unreadable, malformed, of another machine or out of range is ignored, never an error.

Switches, read at each call: ``ATTENTION_TUNING=off`` (or ``set_tuning("off")``) runs the fixed
table, ``attention_rules.FAST_PATHS`` with ``_fast.forward.USE_EXP2`` (the test suite does, so
its results do not depend on the machine's timings); ``ATTENTION_TUNING=alternate`` runs the
fixed table with every block halved and every switch the other way (the other exponential and
product orders: a second fixed choice, for the tests); ``ATTENTION_TUNING="block_q=64,exp2=0"``
forces those entries; unset, ``on`` or ``set_tuning(None)`` tunes.

Determinism: once a class has its choice, every call of the process uses it (a lock makes the
first decision the only one, however many threads race to it), and a given choice gives the
same bits on every call, threads or not (``spec.CONCURRENCY``). Two choices differ by rounding
only (the order of the sums, the BLAS's kernel, ``exp`` against ``exp2``): within the
tolerance rule (``tests/test_tuning.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from attention_rules.fast_paths import TUNING, TUNING_ENV, tuning_cache_folder

from .. import _threads

CANDIDATES = TUNING["numpy_attn"]
# The trial's largest (q_len, kv_len) per step: the shape classes are capped alike.
TRIAL = {"forward": (512, 4096), "backward": (2048, 512)}
ROUNDS = 5  # rounds of timed calls, each candidate once per round
MARGIN = 0.95  # a candidate must take at most this fraction of the fixed table's time
FORMAT = 2  # the cache file's format (2: the product orders)
MAX_FILE_BYTES = 1 << 20  # a larger cache file is not read
# The entries each step decides; the others come from the fixed table (or, for the VJP, from
# the forward pass's choice).
TUNED = {"forward": ("block_q", "exp2", "keys_first"),
         "backward": ("block_kv", "block_q_backward", "keys_first_backward")}
# The entries that are switches (the others are sizes)
SWITCHES = ("exp2", "keys_first", "keys_first_backward")


@dataclasses.dataclass(frozen=True)
class Choice:
    """One set of the blocked path's choices (``FAST_PATH_RULES["tuning"]``)."""

    block_q: int  # queries per forward block
    block_kv: int  # keys per VJP task
    block_q_backward: int  # queries per VJP tile
    exp2: bool  # the exponential (forward and VJP tiles): exp2 in units of log2 e, else exp
    keys_first: bool  # the forward's scores as keys @ queriesᵀ, else queries @ keysᵀ
    keys_first_backward: bool  # the same for the VJP tiles' two (keys, queries) products

    def alternate(self) -> Choice:
        """The second fixed choice: every block halved, every switch the other way."""
        return Choice(max(1, self.block_q // 2), max(1, self.block_kv // 2),
                      max(1, self.block_q_backward // 2), not self.exp2, not self.keys_first,
                      not self.keys_first_backward)


# "mode": None (read ATTENTION_TUNING at each call) or what set_tuning was given; "memory": the
# choices of this process by shape class; "lock": one decision at a time; "machine": cached.
_state: dict = {"mode": None, "memory": {}, "lock": threading.Lock(), "machine": None}

# The trials' clock: the CPU time of the process (every thread), which other processes' load
# does not add to; the pool's threads wait without spinning. (The tests simulate it.)
_clock = time.process_time

Trial = Callable[[str, Choice, np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict], object]


def set_tuning(mode: str | dict | None) -> None:
    """Switch the tuner for this process: ``"off"`` (the fixed table), ``"on"`` (measure),
    ``"alternate"`` (the fixed table halved, the other exponential), a dict of entries to force
    (e.g. ``{"block_q": 64, "exp2": False}``), or None (back to ``$ATTENTION_TUNING``)."""
    _state["mode"] = None if mode is None else _parsed(mode, "set_tuning")


def tuning_mode() -> str | dict:
    """``"on"``, ``"off"``, ``"alternate"`` or the forced entries, from ``set_tuning`` or else
    ``$ATTENTION_TUNING``."""
    if _state["mode"] is not None:
        return _state["mode"]
    return _parsed(os.environ.get(TUNING_ENV, "on"), TUNING_ENV)


def forget() -> None:
    """Drop this process's choices (the next call of each class reads the cache or measures)."""
    with _state["lock"]:
        _state["memory"].clear()


def choose(kind: str, q_shape: tuple[int, ...], k_shape: tuple[int, ...],
           v_shape: tuple[int, ...], dtype: str, base: Choice, trial: Trial,
           measure: bool = True) -> Choice:
    """The choice for a call of step ``kind`` (``"forward"`` or ``"backward"``) on query ``(...,
    heads, q_len, head_dim)``, key ``(..., kv_heads, kv_len, head_dim)`` and value ``(...,
    kv_heads, kv_len, v_dim)`` in the compute ``dtype``: ``base`` (the fixed table, or for the
    VJP the forward pass's choice) with the entries of ``TUNED[kind]`` as the mode says; with
    ``measure=False`` (a causal or windowed call) tuning ``on`` returns ``base``. ``trial(kind,
    choice, q, k, v, grad_out, shared)`` runs the fast path once (``shared``: a dict per
    measurement, for what every candidate shares)."""
    mode = tuning_mode()
    if mode == "off":
        return base
    if mode == "alternate":  # this step's entries of base.alternate()
        other = base.alternate()
        return dataclasses.replace(base, **{name: getattr(other, name) for name in TUNED[kind]})
    if isinstance(mode, dict):
        return dataclasses.replace(base, **mode)
    if not measure:
        return base
    shape_class = _shape_class(kind, q_shape, k_shape, v_shape, dtype)
    found = _state["memory"].get(shape_class)
    if found is None:
        with _state["lock"]:  # one decision per class, however many threads ask
            found = _state["memory"].get(shape_class)
            if found is None:
                found = _read_cache().get(shape_class)
                if found is None:
                    found = _measure(kind, shape_class, base, trial)
                    _write_cache({shape_class: found})
                _state["memory"][shape_class] = found
    return dataclasses.replace(base, **found)


# ------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------


def _shape_class(kind: str, q_shape: tuple[int, ...], k_shape: tuple[int, ...],
                 v_shape: tuple[int, ...], dtype: str) -> str:
    """``"forward/float32/d64/v64/q512/k2048"``: the lengths rounded up to powers of two,
    capped at the trial's."""
    q_cap, k_cap = TRIAL[kind]
    q_len = min(1 << max(0, q_shape[-2] - 1).bit_length(), q_cap)
    kv_len = min(1 << max(0, k_shape[-2] - 1).bit_length(), k_cap)
    return f"{kind}/{dtype}/d{q_shape[-1]}/v{v_shape[-1]}/q{q_len}/k{kv_len}"


def _measure(kind: str, shape_class: str, base: Choice, trial: Trial) -> dict:
    """The fastest candidate's entries of ``TUNED[kind]`` on a trial problem of the class."""
    _, dtype, head_dim, v_dim, q_len, kv_len = shape_class.split("/")
    heads = _threads._cores()  # one head per lane
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, heads, int(n[1:]), int(head_dim[1:]))).astype(dtype)
            for n in (q_len, kv_len))
    v = rng.standard_normal((1, heads, int(kv_len[1:]), int(v_dim[1:]))).astype(dtype)
    g = rng.standard_normal(q.shape[:-1] + v.shape[-1:]).astype(dtype)
    shared: dict = {}  # what the trials of this measurement share (the VJP's forward pass)

    def relative(candidates: list[Choice]) -> list[float]:
        """Each candidate's time over the first's in the same round, the median over
        ``ROUNDS`` rounds (a change in the machine's load hits both)."""
        ratios: list[list[float]] = [[] for _ in candidates]
        for _ in range(ROUNDS):
            seconds = []
            for choice in candidates:
                trial(kind, choice, q, k, v, g, shared)  # untimed: the allocator settles
                start = _clock()
                trial(kind, choice, q, k, v, g, shared)
                seconds.append(_clock() - start)
            for i, s in enumerate(seconds):
                ratios[i].append(s / seconds[0] if seconds[0] > 0.0 else 1.0)
        return [sorted(r)[len(r) // 2] for r in ratios]

    def fastest(candidates: list[Choice]) -> Choice:
        """The fastest of ``candidates``: the first (``base``'s entries) unless another takes
        at most ``MARGIN`` of its time, twice (the winner is timed against the first again)."""
        trial(kind, candidates[0], q, k, v, g, shared)  # warm-up: pages, the pool, the allocator
        medians = relative(candidates)
        i = min(range(len(candidates)), key=medians.__getitem__)
        if i and medians[i] <= MARGIN and relative([candidates[0], candidates[i]])[1] <= MARGIN:
            return candidates[i]
        return candidates[0]

    choice = fastest([base] + [candidate for candidate in _grid(kind, base) if candidate != base])
    return {name: getattr(choice, name) for name in TUNED[kind]}


def _grid(kind: str, base: Choice) -> list[Choice]:
    """Every combination of the candidates of ``TUNED[kind]``'s entries, the others ``base``'s
    (the entries interact: the faster product order depends on the block)."""
    if kind == "forward":
        return [dataclasses.replace(base, exp2=e, keys_first=f, block_q=b)
                for e in CANDIDATES["exp2"] for f in CANDIDATES["keys_first"]
                for b in CANDIDATES["block_q"]]
    return [dataclasses.replace(base, keys_first_backward=f, block_kv=kv, block_q_backward=rows)
            for f in CANDIDATES["keys_first"] for kv, rows in CANDIDATES["backward_tiles"]]


# ------------------------------------------------------------------------------------------
# The cache file
# ------------------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    """What the choices depend on besides the code: CPU model, cores, NumPy, its BLAS (from
    threadpoolctl, else ``numpy.show_config``) and numpy_attn's version."""
    if _state["machine"] is None:
        import platform

        try:
            from importlib.metadata import version

            package = version("attention-three-ways")
        except Exception:  # noqa: BLE001 - not installed as a package: from a checkout
            package = "checkout"
        _state["machine"] = {
            "cpu": cpu_model(), "cores": str(_threads._cores()), "numpy": np.__version__,
            "blas": blas_name(), "numpy_attn": package, "python": platform.python_version(),
        }
    return _state["machine"]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s, else ``platform.processor()``)."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as file:
            for line in file:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def blas_name() -> str:
    """NumPy's BLAS: library, version and kernels (threadpoolctl), else its build config."""
    try:
        from threadpoolctl import threadpool_info

        for lib in threadpool_info():
            if lib.get("user_api") == "blas":
                return " ".join(str(lib.get(key)) for key in
                                ("internal_api", "version", "architecture", "threading_layer"))
    except Exception:  # noqa: BLE001 - optional, and its probing may fail: fall back
        pass
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name')} {blas.get('version')}"
    except Exception:  # noqa: BLE001 - NumPy 1.x has no mode="dicts"
        return "unknown"


def cache_file() -> str:
    """This machine's cache file: ``numpy_attn-<hash of machine()>.json`` in the cache
    folder."""
    import hashlib

    digest = hashlib.sha256(json.dumps(machine(), sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(tuning_cache_folder(), f"numpy_attn-{digest}.json")


def _read_cache() -> dict[str, dict]:
    """The valid choices of this machine's cache file; ``{}`` for anything unreadable."""
    try:
        with open(cache_file(), "rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)
        data = json.loads(raw) if len(raw) <= MAX_FILE_BYTES else None
    except (OSError, ValueError, RecursionError):  # missing, unreadable, not JSON
        return {}
    if (not isinstance(data, dict) or data.get("format") != FORMAT
            or data.get("machine") != machine() or not isinstance(data.get("choices"), dict)):
        return {}
    return {key: value for key, value in data["choices"].items() if _valid(key, value)}


def _valid(shape_class: object, entries: object) -> bool:
    """A class name of a known step, with exactly that step's entries, each in range."""
    if not isinstance(shape_class, str) or not isinstance(entries, dict):
        return False
    kind = shape_class.split("/", 1)[0]
    if kind not in TUNED or set(entries) != set(TUNED[kind]):
        return False
    for name, value in entries.items():
        if name in SWITCHES:
            if not isinstance(value, bool):
                return False
        elif type(value) is not int or not 1 <= value <= 1 << 16:
            return False
    return True


def _write_cache(new: dict[str, dict]) -> None:
    """Add ``new`` to the cache file, atomically; a folder that cannot be written is left
    alone (the choices stay in memory)."""
    import tempfile

    path = cache_file()
    choices = _read_cache()
    choices.update(new)
    data = {"format": FORMAT, "machine": machine(), "choices": choices}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                json.dump(data, file, indent=1, sort_keys=True)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError:
        pass


# ------------------------------------------------------------------------------------------
# The switch
# ------------------------------------------------------------------------------------------


def _parsed(mode: str | dict, source: str) -> str | dict:
    """``"on"``, ``"off"``, ``"alternate"`` or a dict of forced entries; ValueError naming
    ``source`` otherwise."""
    fields = {field.name for field in dataclasses.fields(Choice)}
    if isinstance(mode, str) and mode.strip().lower() in ("", "on", "1", "true"):
        return "on"
    if isinstance(mode, str) and mode.strip().lower() in ("off", "0", "false"):
        return "off"
    if isinstance(mode, str) and mode.strip().lower() == "alternate":
        return "alternate"
    if isinstance(mode, str):  # "block_q=64,exp2=0"
        try:
            pairs = dict(part.split("=", 1) for part in mode.replace(" ", "").split(",") if part)
        except ValueError:
            pairs = {"": mode}
        mode = {name: (value.lower() in ("1", "true") if name in SWITCHES and
                       value.lower() in ("0", "1", "true", "false") else value)
                for name, value in pairs.items()}
        mode = {name: (int(value) if name not in SWITCHES and str(value).isdigit() else value)
                for name, value in mode.items()}
    if isinstance(mode, dict) and mode and set(mode) <= fields and all(
            isinstance(value, bool) if name in SWITCHES else
            type(value) is int and value >= 1 for name, value in mode.items()):
        return dict(mode)
    raise ValueError(
        f"{source}: expected 'on', 'off', 'alternate' or entries such as 'block_q=64,exp2=0' "
        f"(entries {sorted(fields)}; block sizes ints >= 1, {', '.join(SWITCHES)} 0 or 1); "
        f"got {mode!r}")
