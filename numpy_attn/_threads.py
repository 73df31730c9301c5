"""The threads of numpy_attn's tiled paths: lanes of tasks on one persistent pool, with BLAS
limited to one thread while they run (``run_lanes``: the tiles of ``_tiles.py``, the blocks of
``_fast/``, the plan of ``_masking._mods_statuses``, and the chunks and groups of ``paged.py``
and ``varlen.py`` run on it). It imports nothing of numpy_attn, so every room may use it.

NumPy releases the GIL in ufuncs and in ``matmul``, so tasks on threads use every core; the pool
runs at most one thread per BLAS thread and per core, while the BLAS library is limited to one
thread so the two levels of threading do not oversubscribe the cores. The results do not depend
on the threads (``spec.CONCURRENCY``): the tasks are dealt into a fixed number of lanes (one per
core the process may use), each lane with its own scratch (e.g. its own copy of dQ), run in
order by one thread, and the callers add the lanes' scratches in lane order; BLAS always runs in
one thread during the blocks; and concurrent calls take turns through the one pool (a lock), so
no call ever runs under another's BLAS setting. One caller keeps every core busy, so taking
turns costs no throughput.

That limit uses ``threadpoolctl`` when it is installed: it is optional, imported on the first
call (never by ``import numpy_attn``), covers only the span in which the blocks run, and the
BLAS library's own thread count is restored after it. Where the library's limit is per thread
(OpenBLAS built with OpenMP) only the pool's threads and the calling thread are limited.
**The OpenBLAS of NumPy's wheels (pthreads), MKL and BLIS have a process-wide setting only:
while a call's blocks run, other threads' BLAS calls also run on one thread** (``spec.BLAS_LIMIT``).
Without ``threadpoolctl`` the tasks run in the calling thread with BLAS left as configured and
nothing is changed for other threads; that is correct but uses one core for the elementwise
work. Calling BLAS libraries through ``ctypes`` would avoid the dependency but depends on how
NumPy was built (symbol names differ between OpenBLAS, scipy-openblas, MKL and Accelerate), and
OpenBLAS's ``openblas_set_num_threads_local`` is process-wide in its pthreads builds, so the
project does not.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

# Made on first use (so ``import numpy_attn`` starts no thread and does not import
# threadpoolctl): "controller" is threadpoolctl's controller of the BLAS libraries (None without
# threadpoolctl), "pool" a persistent ThreadPoolExecutor made for "pool_key" (process id,
# threads), and "lock" lets one call at a time use them and limit BLAS.
_state: dict[str, Any] = {"lock": threading.Lock()}


def run_lanes(tasks: list, block: Callable[..., None], scratch: Callable[[], Any]) -> list:
    """``block(*task, scratch)`` for every task; returns one scratch per lane, in lane order.

    The tasks are dealt, in their order, into at most ``_cores()`` lanes (``_lanes``); a lane
    makes its own ``scratch()`` and runs its tasks in order, in one thread. What a block adds
    into its scratch (a copy of dQ) is therefore summed in an order fixed by the tasks and the
    number of cores, never by how many threads were free or which ran a lane. With
    ``threadpoolctl`` the lanes run on the pool, one call at a time (concurrent calls take
    turns), with BLAS in one thread (``spec.BLAS_LIMIT``): the same bits whatever else the
    process is doing. Without it they run in the calling thread, BLAS as configured.

    Args:
      tasks: ``(len(tasks),)`` tuples of arguments, longest first; each block writes rows of
        its own (e.g. query rows ``i0:i1`` of ``output (..., heads, q_len, v_dim)``).
      block: ``block(*task, scratch)``, run once per task.
      scratch: makes one lane's scratch (e.g. its own ``dQ (..., heads, q_len, head_dim)``).

    Returns:
      ``(lanes,)`` scratches, in lane order (``[]`` without tasks), for the caller to add in
      that order.
    """
    if not tasks:
        return []
    lanes = _lanes(tasks)
    scratches: list = [None] * len(lanes)
    claims, claim_lock = iter(range(len(lanes))), threading.Lock()

    def work() -> None:
        while True:
            with claim_lock:
                lane = next(claims, None)
            if lane is None:
                return
            own = scratches[lane] = scratch()
            for task in lanes[lane]:
                block(*task, own)

    controller = _controller()
    if controller is None:  # no threadpoolctl: the calling thread, BLAS as configured
        work()
        return scratches
    with _state["lock"]:  # one call at a time: no other call's BLAS limit is ever in force
        workers = min(len(lanes), _cores(), max(lib.num_threads for lib in
                                                controller.lib_controllers))
        with controller.limit(limits=1):  # the shortest span: only while the lanes run
            if max(lib.num_threads for lib in controller.lib_controllers) != 1:
                workers = 1  # another thread controls a process-wide BLAS setting
            if workers == 1:
                work()
                return scratches
            pool = _pool(workers - 1)  # the caller is the last worker
            per_thread = _per_thread_limit(controller)

            def pool_work() -> None:
                if per_thread:  # the pool's threads limit themselves, and only themselves
                    with controller.limit(limits=1):
                        work()
                else:
                    work()

            futures = [pool.submit(pool_work) for _ in range(workers - 1)]
            try:
                work()
            finally:
                for future in futures:
                    future.result()
    return scratches


def _lanes(tasks: list) -> list[list]:
    """The tasks dealt round-robin, in their order, into ``min(len(tasks), _cores())`` lanes
    (the tasks come longest first, so the lanes' work is about even)."""
    count = min(len(tasks), _cores())
    return [tasks[lane::count] for lane in range(count)]


def _cores() -> int:
    """The cores this process may run on (its affinity; fixed for the process)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _controller() -> Any:
    """threadpoolctl's controller of the loaded BLAS libraries, made once (scanning the
    libraries takes milliseconds); None without threadpoolctl or without a known BLAS."""
    if "controller" not in _state:
        try:
            from threadpoolctl import ThreadpoolController  # optional: see the docstring
        except ImportError:
            controller = None
        else:
            controller = ThreadpoolController().select(user_api="blas")
            controller = controller if controller.lib_controllers else None
        _state["controller"] = controller
    return _state["controller"]


def _per_thread_limit(controller: Any) -> bool:
    """True when every BLAS library's thread limit is per thread (OpenBLAS built with OpenMP,
    as threadpoolctl documents); False for a process-wide one (OpenBLAS with pthreads, as in
    NumPy's wheels, MKL, BLIS)."""
    return all(lib.internal_api == "openblas" and getattr(lib, "threading_layer", "") ==
               "openmp" for lib in controller.lib_controllers)


def _pool(size: int) -> Any:
    """The persistent pool of ``size`` threads (made again when resized or after a fork)."""
    if _state.get("pool_key") != (os.getpid(), size):
        from concurrent.futures import ThreadPoolExecutor

        old = _state.get("pool")
        if old is not None and _state["pool_key"][0] == os.getpid():
            old.shutdown(wait=False)  # resized: its idle threads exit
        _state["pool"] = ThreadPoolExecutor(size, "numpy_attn")
        _state["pool_key"] = (os.getpid(), size)
    return _state["pool"]


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: a lock they held is free again."""
    _state["lock"] = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
