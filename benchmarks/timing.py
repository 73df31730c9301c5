"""Interleaved timing, shared by the benchmarks.

Every variant is called once to warm up (caches, thread pools, allocators), then all variants
run round after round, one call each per round, so that a change in the machine's load hits
them alike; before each call a short pause lets the previous framework's spinning threads
(OpenMP in torch, Eigen in XLA, OpenBLAS) go to sleep. Compare medians of one run as ratios.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import TypeVar

PAUSE_S = 0.1
Key = TypeVar("Key", bound=Hashable)


def interleaved(runs: dict[Key, Callable[[], object]], rounds: int,
                pause_s: float = PAUSE_S,
                clock: Callable[[], float] = time.perf_counter) -> dict[Key, list[float]]:
    """Seconds of each call of each variant: ``{key: [round 0, round 1, ...]}``, by ``clock``
    (wall time; ``time.process_time``: the CPU time of every thread of the process, which other
    processes' load does not add to, while threads that spin still count)."""
    for fn in runs.values():
        fn()  # warm-up
    times: dict[Key, list[float]] = {key: [] for key in runs}
    for _ in range(rounds):
        for key, fn in runs.items():
            time.sleep(pause_s)
            start = clock()
            fn()
            times[key].append(clock() - start)
    return times
