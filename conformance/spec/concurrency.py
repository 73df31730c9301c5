"""Concurrency and determinism.

What a caller may rely on when the same inputs come back, and when several threads call at once
(a server, a data loader). ``conformance/running/repeat.py`` checks the bitwise promises of
``REPEATABLE`` for every backend.
"""

from __future__ import annotations

#: What each backend guarantees on CPU, in words: repeatability, thread safety, and which
#: calls may run concurrently.
CONCURRENCY = {
    "numpy_attn": (
        "Every function is pure and may be called from any number of threads at once. The same "
        "inputs (values, shapes, dtypes and arguments) give the same bits in every call of one "
        "process, whatever other threads are doing: the fast path (BLOCKED_COMPUTATION) fixes "
        "its blocks, its BLAS thread count (one) and the order of every sum (its tasks are "
        "dealt into one lane per core the process may use, each lane summing into its own "
        "copy, the copies added in lane order) from the shapes and the core count alone, never "
        "from how many threads are free or which thread ran a block, and concurrent fast-path "
        "calls take turns through its one pool (a lock; one call already keeps every core "
        "busy). The BLAS thread limit: see BLAS_LIMIT. Without threadpoolctl the blocks run in "
        "the calling thread with BLAS as configured, which gives the same bits call after call "
        "as long as nobody changes the BLAS thread count. Bits may differ between machines "
        "(core count, BLAS build) and NumPy versions. "
        "Modules' forward and backward only read the weights and "
        "may run concurrently; load_weights, KVCache.append and decode write in place (one "
        "thread per cache, and one thread per module's decode state). PagedKVCache may be "
        "shared: append and free of different sequences may run from several threads at once "
        "(each takes the cache's lock for its bookkeeping and page writes), and tables and "
        "attend read a consistent book; calls on the same sequence must be ordered by the "
        "caller. QuantizedKVCache follows KVCache: append writes in place (one thread per "
        "cache); attend, keys and values only read and may run from several threads while no "
        "append runs; quantize_kv and dequantize_kv are pure. "
        "Dropout: the same seeded Generator state gives the same bits; a "
        "numpy Generator is not thread-safe, so give each thread its own."
    ),
    "jax_attn": (
        "Every function is pure; arrays, KVCache and PagedKVCache are immutable, so any thread "
        "may use them (an append or free returns a new cache: threads appending to one shared "
        "PagedKVCache each get their own new cache, so chain a shared pool's appends in one "
        "thread or under the caller's lock; a module's decode state likewise), "
        "and jitted functions may be called from several threads at once. On CPU the same "
        "compiled function gives the same bits for the same inputs, call after call and from "
        "several threads at once (XLA fixes its algorithms and its work split at compile "
        "time). An eager call and a jitted one, or two different jit boundaries around the "
        "same function, may differ in the last bits (XLA fuses differently). On GPU XLA may "
        "use non-deterministic reductions unless XLA_FLAGS=--xla_gpu_deterministic_ops=true "
        "(not checked here). QuantizedArray and QuantizedKVCache are immutable pytrees too: "
        "append returns a new cache, any thread may read one. "
        "Dropout: the same key gives the same bits."
    ),
    "torch_attn": (
        "Functions and modules' forward may be called from several threads at once (autograd "
        "is thread-safe; each thread builds its own graph). On CPU the same inputs give the "
        "same bits call after call and from several threads at once, for a fixed "
        "torch.get_num_threads() (another thread count may change the bits: set it once, before "
        "the threads start, with torch.set_num_threads; the count is per thread, and a new "
        "thread does not always start from its creator's: measured after a process's first "
        "autograd backward, new threads read 1 while the main thread read 2, and their products "
        "gave other bits, until torch.set_num_threads(2) was called again in the main thread). "
        "On CUDA the fused SDPA kernels' backward may be non-deterministic "
        "unless torch.use_deterministic_algorithms(True) (not checked here). KVCache.append and "
        "decode write the cache in place (one thread per cache, and one thread per module's "
        "decode state). PagedKVCache may be shared: append and free of different sequences may "
        "run from several threads at once (each takes the cache's lock for its bookkeeping and "
        "page writes); calls on the same sequence must be ordered by the caller. "
        "QuantizedKVCache follows KVCache: append writes in place (one thread per cache); "
        "attend, keys and values only read. load_weights "
        "writes the parameters. Dropout with rng=None draws from torch's global generator, "
        "shared by all threads: pass a torch.Generator per thread for repeatable masks."
    ),
}

#: numpy_attn's BLAS thread limit during the fast path, and who else it touches.
BLAS_LIMIT = (
    "The fast path runs its blocks on a pool of threads with BLAS limited to one thread, so the "
    "two levels of threading do not oversubscribe the cores. Where the BLAS library has a "
    "per-thread setting (OpenBLAS built with OpenMP) only the pool's threads and the calling "
    "thread are limited: no other thread sees a change. The OpenBLAS that NumPy's wheels "
    "bundle (pthreads; its openblas_set_num_threads_local is process-wide too), and MKL and "
    "BLIS as threadpoolctl sets them, have a process-wide setting only: it is set to one while "
    "a call's blocks run, and only then (not while the inputs are prepared or the results "
    "assembled), and restored after; during that span, matrix products of other threads also "
    "run on one BLAS thread (and give that thread count's bits). Without threadpoolctl "
    "nothing is changed (the blocks run in the calling thread)."
)

#: The bitwise-repeat promises the harness checks (``python -m conformance repeat``), per
#: backend: the same inputs give the same bits in these modes. ``sequential``: calls one after
#: the other, each on a new copy of the inputs; ``threads``: the same calls from several threads
#: at once, compared with the sequential results. The checked calls (REPEAT_CALLS) are
#: ``scaled_dot_product_attention`` and ``scaled_dot_product_attention_vjp``, on shapes that take
#: each backend's fast path and shapes that do not, causal and not (jax_attn: jitted).
REPEATABLE = {
    "numpy_attn": ("sequential", "threads"),
    "jax_attn": ("sequential", "threads"),
    "torch_attn": ("sequential", "threads"),
}
REPEAT_CALLS = ("scaled_dot_product_attention", "scaled_dot_product_attention_vjp")
