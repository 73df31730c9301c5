"""A shared ``PagedKVCache`` under threads (``spec.CONCURRENCY``): numpy_attn's and torch_attn's
caches change in place, and several threads may append to and free *different* sequences of one
pool at once; jax_attn's cache is immutable (each append returns a new cache, the old one
unchanged, whichever thread holds it).

THREADS threads × APPENDS appends of one position each, every thread to its own sequence (one
in two also frees its sequence and starts it again now and then), all started together with a
tiny switch interval so that the threads interleave inside ``append``; ROUNDS rounds. Each
position's keys carry (sequence, position), so a lost append (a short sequence), a page given
to two sequences or a position written into another sequence's page all show.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np
import pytest

THREADS, APPENDS, ROUNDS, BLOCK = 4, 150, 3, 4
RESTART = 50  # the freeing threads free their sequence every RESTART appends


def _key(seq: int, position: int) -> np.ndarray:
    """The keys ``(1, 1, 1, 2)`` of ``seq``'s position ``position``: both numbers, exact."""
    return np.array([seq, position], np.float32).reshape(1, 1, 1, 2)


def _to_numpy(x: Any) -> np.ndarray:
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def _race(cache_class: type) -> list[str]:
    """One round on a fresh cache of ``cache_class``: what went wrong, in words (empty: nothing).
    """
    cache = cache_class(THREADS * APPENDS // BLOCK + THREADS, BLOCK, 1, 2)
    start = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def work(seq: int) -> None:
        try:
            start.wait()
            length = 0
            for _ in range(APPENDS):
                if seq % 2 and length == RESTART:  # odd sequences start again now and then
                    cache.free(seq)
                    length = 0
                cache.append(_key(seq, length), _key(seq, length) + 0.5, seqs=[seq])
                length += 1
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(seq,)) for seq in range(THREADS)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(old)
    problems = [f"a thread raised {e!r}" for e in errors]
    table, lens = (_to_numpy(x) for x in cache.tables(range(THREADS)))
    keys, values = _to_numpy(cache.key_pages), _to_numpy(cache.value_pages)
    for seq in range(THREADS):
        want = APPENDS - (APPENDS - 1) // RESTART * RESTART if seq % 2 else APPENDS
        if cache.seq_len(seq) != want or lens[seq] != want:
            problems.append(f"sequence {seq} holds {cache.seq_len(seq)} positions, not {want}")
            continue
        positions = np.arange(want)
        pages = table[seq, positions // BLOCK]
        got = keys[pages, positions % BLOCK, 0]  # (want, 2)
        expected = np.stack([np.full(want, seq), positions], axis=1)
        if not np.array_equal(got, expected) or not np.array_equal(
                values[pages, positions % BLOCK, 0], expected + 0.5):
            problems.append(f"sequence {seq}'s pages hold another sequence's keys or values")
    used = table[table >= 0]
    if len(set(used.tolist())) != used.size:
        problems.append("a page belongs to two sequences")
    if cache.num_free_blocks + used.size != cache.num_blocks:
        problems.append(f"{cache.num_free_blocks} free + {used.size} used pages != "
                        f"{cache.num_blocks}")
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy_attn", "torch_attn"])
def test_threads_append_and_free_different_sequences_of_one_pool(backend: str) -> None:
    """Appends and frees of different sequences from several threads at once lose nothing and
    mix nothing: every round ends with each sequence's positions, in its own pages."""
    module = pytest.importorskip(backend)
    for _ in range(ROUNDS):
        assert _race(module.PagedKVCache) == []


def test_jax_cache_is_immutable_across_threads() -> None:
    """jax_attn: threads appending to one shared cache each get a new cache; the shared one
    does not change (spec.CONCURRENCY: share it, or chain the appends in one thread)."""
    jax_attn = pytest.importorskip("jax_attn")
    shared = jax_attn.PagedKVCache(THREADS * 2, BLOCK, 1, 2).append(_key(0, 0), _key(0, 0))
    results: dict[int, Any] = {}

    def work(seq: int) -> None:
        results[seq] = shared.append(_key(seq, 1), _key(seq, 1), seqs=[seq])

    threads = [threading.Thread(target=work, args=(seq,)) for seq in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert shared.seq_len(0) == 1 and shared.num_free_blocks == THREADS * 2 - 1
    for seq, cache in results.items():
        table, _ = cache.tables([seq])
        page, row = int(np.asarray(table)[0, 0]), 1 if seq == 0 else 0  # position 1 / 0
        assert np.array_equal(np.asarray(cache.key_pages)[page, row, 0], [seq, 1])
