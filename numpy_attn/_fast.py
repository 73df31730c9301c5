"""The fast path of numpy_attn: the pipeline of ``functional.py``, blocked over queries.

``functional.py``'s steps are the code to read: each makes the whole ``(..., heads, q_len,
kv_len)`` score array, and NumPy's elementwise functions (``max``, ``exp``, ``sum``) run on one
core while only the matrix products use every core. For large inputs ``use_fast_path``
(the one selection rule; its numbers are ``attention_rules.FAST_PATHS["numpy_attn"]``) selects
``"blocked"``: no ``return_weights``, no dropout, no empty axis, and at least ``MIN_SCORES``
score entries with ``q_len >= MIN_Q_LEN``. ``fast_attention`` then cuts the queries into blocks
of ``BLOCK_Q`` rows and, per (batch, head, query block), computes the scores against the keys
that block can see (the causal rule and the window give a key range, ``rules.key_range``;
fully masked blocks are skipped, and the band is applied only to the diagonal strips), then
``(exp(s - max) @ value) / sum``, each step by ``functional.py``'s own helpers (``_softcap``,
``_in_band``, ``_unnormalised_softmax``); mask and bias are sliced per block from broadcast
views, never materialised. Its result equals the explicit steps' within float32 rounding
(``tests/test_performance_paths.py``), NaN and infinities included: a masked position's score
is replaced by ``-inf`` and a skipped block is never read.

The blocks run on a persistent pool of threads (NumPy releases the GIL in ufuncs and in
``matmul``), one per BLAS thread, while the BLAS library is limited to one thread so the two
levels of threading do not oversubscribe the cores. That limit uses ``threadpoolctl`` when it is
installed: it is optional, imported on the first fast-path call (never by ``import numpy_attn``),
and the BLAS library's own thread count is restored after each call (the limit is process-wide
while the call runs). Without ``threadpoolctl`` the blocks run in the calling thread with BLAS
left as configured, which is correct but uses one core for the elementwise work. Calling BLAS
libraries through ``ctypes`` would avoid the dependency but depends on how NumPy was built
(symbol names differ between OpenBLAS, scipy-openblas, MKL and Accelerate), so the project does
not. A call made while another thread is already inside the fast path also runs in its own
thread, without the pool.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

import attention_rules as rules

from . import functional  # the steps the fast path must equal, and reuses

NEG_INF = -np.inf
_BLOCKED = rules.FAST_PATHS["numpy_attn"]["blocked"]
BLOCK_Q = _BLOCKED["block_q"]  # query rows per block: a float32 block of scores stays in L2
MIN_SCORES = _BLOCKED["min_scores"]  # below this many score entries the plain path is as fast
MIN_Q_LEN = _BLOCKED["min_q_len"]  # few queries (decoding): one batched matmul is faster

# The threads of the fast path, made on first use (so ``import numpy_attn`` starts none and does
# not import threadpoolctl): "controller" is threadpoolctl's controller of the BLAS libraries
# (None without threadpoolctl), "pool" a persistent ThreadPoolExecutor made for "pool_key"
# (process id, workers), and "lock" lets one call at a time use them.
_threads: dict[str, Any] = {"lock": threading.Lock()}


def use_fast_path(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    args: rules.Arguments,
) -> str | None:
    """The fast path for these validated inputs (``"blocked"``), or None for the steps."""
    if args.return_weights or args.dropout_p > 0.0:
        return None  # the blocks never hold the whole weights, nor a keep-mask
    if rules.large_enough(query.shape, key.shape, value.shape, MIN_SCORES, MIN_Q_LEN):
        return "blocked"
    return None


def fast_attention(
    path: str,
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    args: rules.Arguments,
) -> np.ndarray:
    """``scaled_dot_product_attention``'s output on the path ``use_fast_path`` chose."""
    return _blocked_attention(query, key, value, mask, bias, args).astype(query.dtype, copy=False)


def _blocked_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    args: rules.Arguments,
) -> np.ndarray:
    """The output in the compute dtype, block by block, on the thread pool."""
    compute = rules.compute_dtype(query.dtype.name)
    query = np.multiply(query, args.scale, dtype=compute)  # (..., heads, q_len, head_dim), scaled
    key = np.ascontiguousarray(key, dtype=compute)  # (..., kv_heads, kv_len, head_dim)
    value = np.ascontiguousarray(value, dtype=compute)  # (..., kv_heads, kv_len, v_dim)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    target = args.scores_shape  # (..., heads, q_len, kv_len)
    groups = functional._groups(query.shape, key.shape)
    output = np.empty(query.shape[:-1] + value.shape[-1:], dtype=compute)
    masked_out = None if mask is None else np.broadcast_to(~mask, target)  # True = not allowed
    bias = None if bias is None else np.broadcast_to(bias.astype(compute, copy=False), target)
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)

    tasks = []  # (batch-and-head index, query rows i0:i1, key range)
    for index in np.ndindex(query.shape[:-2]):
        for i0 in range(0, q_len, BLOCK_Q):
            i1 = min(i0 + BLOCK_Q, q_len)
            tasks.append((index, i0, i1, rules.key_range(i0, i1, kv_len, lo, hi)))
    tasks.sort(key=lambda task: task[3][0] - task[3][1])  # longest key range first

    def block(index: tuple[int, ...], i0: int, i1: int, keys: tuple[int, int, int, int],
              buffer: np.ndarray) -> None:
        k0, k1, a, b = keys
        out = output[index][i0:i1]  # (rows, v_dim)
        if k1 == k0:  # no key allowed for any row: fully masked
            out[...] = 0.0
            return
        kv_index = index[:-1] + (index[-1] // groups,) if index else ()
        scores = buffer[: (i1 - i0) * (k1 - k0)].reshape(i1 - i0, k1 - k0)  # (rows, keys)
        np.matmul(query[index][i0:i1], key[kv_index][k0:k1].T, out=scores)  # query is scaled
        scores = functional._softcap(scores, args.softcap)
        if bias is not None:
            scores += bias[index][i0:i1, k0:k1]
        for c0, c1 in ((k0, a), (b, k1)):  # the strips the causal rule / window cut
            if c1 > c0:
                allowed = functional._in_band(i0, i1 - i0, c0, c1 - c0, lo, hi)
                np.copyto(scores[:, c0 - k0 : c1 - k0], NEG_INF, where=~allowed)
        if masked_out is not None:
            np.copyto(scores, NEG_INF, where=masked_out[index][i0:i1, k0:k1])
        weights, row_sum = functional._unnormalised_softmax(scores)  # in place; (rows, 1)
        np.matmul(weights, value[kv_index][k0:k1], out=out)  # normalised after @ value
        out /= row_sum

    def work(queue: Any, lock: threading.Lock) -> None:
        buffer = np.empty(BLOCK_Q * kv_len, dtype=compute)  # this worker's scores
        while True:
            with lock:
                task = next(queue, None)
            if task is None:
                return
            block(*task, buffer)

    queue, queue_lock = iter(tasks), threading.Lock()
    if not _threads["lock"].acquire(blocking=False):  # another thread is using the pool
        work(queue, queue_lock)
        return output
    try:
        if "controller" not in _threads:
            try:
                from threadpoolctl import ThreadpoolController  # optional: see the docstring
            except ImportError:
                controller = None
            else:  # scanning the loaded libraries takes milliseconds: do it once
                controller = ThreadpoolController().select(user_api="blas")
                controller = controller if controller.lib_controllers else None
            _threads["controller"] = controller
        controller, workers = _threads["controller"], 1
        if controller is not None:  # one worker per BLAS thread, at most one per usable core
            workers = max(lib.num_threads for lib in controller.lib_controllers)
            if hasattr(os, "sched_getaffinity"):
                workers = min(workers, len(os.sched_getaffinity(0)))
            workers = max(1, min(workers, len(tasks)))
        if workers == 1:
            work(queue, queue_lock)
            return output
        if _threads.get("pool_key") != (os.getpid(), workers):  # new, resized or forked
            from concurrent.futures import ThreadPoolExecutor

            old = _threads.get("pool")
            if old is not None and _threads["pool_key"][0] == os.getpid():
                old.shutdown(wait=False)  # resized: its idle threads exit
            _threads["pool"] = ThreadPoolExecutor(workers - 1, "numpy_attn")
            _threads["pool_key"] = (os.getpid(), workers)
        with controller.limit(limits=1):  # BLAS single-threaded while the blocks run in parallel
            pool = _threads["pool"]  # workers - 1 threads; the caller is the last worker
            futures = [pool.submit(work, queue, queue_lock) for _ in range(workers - 1)]
            try:
                work(queue, queue_lock)
            finally:
                for future in futures:
                    future.result()
    finally:
        _threads["lock"].release()
    return output
