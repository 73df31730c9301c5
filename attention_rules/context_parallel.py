"""Context parallelism: which rank holds which part of the sequence, and the schedule they follow.

Pure index arithmetic, shared by every backend's ``context_parallel_attention``: the sequence
axis of query, key and value is cut into ``world_size`` shards, one per rank (a device, or a
``torch.distributed`` process). Without load balancing, rank ``r`` holds the contiguous chunk
``r``. With ``load_balance=True`` (for causal attention) the sequence is cut into ``2N``
chunks and rank ``r`` holds chunks ``r`` and ``2N - 1 - r`` ("zig-zag"), so every rank has one
early chunk (few keys to see) and one late chunk (many keys to see), and no rank idles while the
last one works. A rank's shard is its chunks concatenated in this order: the *layout order* of
the sequence is ``positions(seq_len, world_size, load_balance)``.

``schedule`` gives, per rank, the global positions of its query and key/value chunks (``Segments``)
and, for the ring, how many steps are needed: at step ``s`` rank ``r`` holds the key/value block
of rank ``(r - s) mod N``, and a (query chunk, key chunk) pair that the causal rule or the
window masks entirely is never computed; steps after the last one that any rank needs are
dropped (a narrow window needs only its neighbours' blocks). ``draw`` prints the schedule.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .checks import check_flag, check_int
from .tiles import band

STRATEGIES = ("ring", "all_gather", "ulysses")

Segment = tuple[int, int]  # [start, stop) global positions of one chunk


class Schedule(NamedTuple):
    """The static part of one context-parallel call, the same on every rank."""

    strategy: str
    world_size: int
    load_balance: bool
    q_len: int  # global lengths
    kv_len: int
    lo: float  # the band lo <= j - i <= hi of the causal rule and the window (rules.band)
    hi: float
    q_segments: tuple[tuple[Segment, ...], ...]  # per rank: its query chunks, in shard order
    kv_segments: tuple[tuple[Segment, ...], ...]  # per rank: its key/value chunks
    steps: int  # ring: steps that compute something (all_gather, ulysses: 1)


def chunks_per_rank(load_balance: bool) -> int:
    """1, or 2 with zig-zag load balancing."""
    return 2 if load_balance else 1


def segments(seq_len: int, world_size: int, rank: int, load_balance: bool) -> tuple[Segment, ...]:
    """Global ``[start, stop)`` of each chunk of ``rank``'s shard, in shard order."""
    n = world_size * chunks_per_rank(load_balance)
    size = seq_len // n
    chunks = (rank, n - 1 - rank) if load_balance else (rank,)
    return tuple((c * size, (c + 1) * size) for c in chunks)


def positions(seq_len: int, world_size: int, load_balance: bool) -> list[int]:
    """The layout order: global position of each index of the concatenated shards (rank 0's
    shard first). ``x[..., positions, :]`` lays a naturally ordered sequence out for the ranks."""
    return [i for rank in range(world_size)
            for start, stop in segments(seq_len, world_size, rank, load_balance)
            for i in range(start, stop)]


def pair_needed(q_segment: Segment, kv_segment: Segment, lo: float, hi: float) -> bool:
    """Whether any (query, key) position of the two chunks lies in ``lo <= j - i <= hi``."""
    d_min = kv_segment[0] - (q_segment[1] - 1)
    d_max = (kv_segment[1] - 1) - q_segment[0]
    return max(lo, d_min) <= min(hi, d_max)


def pair_is_full(q_segment: Segment, kv_segment: Segment, lo: float, hi: float) -> bool:
    """Whether every position of the pair lies in the band (no mask needed)."""
    d_min = kv_segment[0] - (q_segment[1] - 1)
    d_max = (kv_segment[1] - 1) - q_segment[0]
    return lo <= d_min and d_max <= hi


def block_needed(sched: Schedule, rank: int, origin: int) -> tuple[tuple[bool, ...], ...]:
    """Per (query chunk of ``rank``, key chunk of ``origin``): whether it is computed."""
    return tuple(tuple(pair_needed(qs, ks, sched.lo, sched.hi) for ks in sched.kv_segments[origin])
                 for qs in sched.q_segments[rank])


def ring_origin(world_size: int, rank: int, step: int) -> int:
    """The rank whose key/value block ``rank`` holds at ring step ``step`` (blocks travel to
    ``rank + 1``)."""
    return (rank - step) % world_size


def _ring_steps(world_size: int, q_segments: tuple, kv_segments: tuple, lo: float,
                hi: float) -> int:
    last = 0
    for step in range(world_size):
        for rank in range(world_size):
            origin = ring_origin(world_size, rank, step)
            if any(pair_needed(qs, ks, lo, hi) for qs in q_segments[rank]
                   for ks in kv_segments[origin]):
                last = step
    return last + 1


def check_context_parallel(
    fn: str,
    strategy: object,
    world_size: object,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    load_balance: object,
) -> tuple[str, int, bool]:
    """The rules of context parallelism that need no data; global shapes
    ``(batch, heads, seq, head_dim)``. Returns ``(strategy, world_size, load_balance)``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"{fn}: strategy must be one of {STRATEGIES}; got strategy={strategy!r}")
    world_size = check_int(fn, "world_size", world_size, minimum=1)
    load_balance = check_flag(fn, "load_balance", load_balance)
    if len(q_shape) != 4 or len(k_shape) != 4:
        raise ValueError(
            f"{fn}: query, key and value must be 4-D (batch, heads, seq, head_dim); "
            f"got query.shape={tuple(q_shape)}, key.shape={tuple(k_shape)}"
        )
    n = world_size * chunks_per_rank(load_balance)
    q_len, kv_len = q_shape[-2], k_shape[-2]
    if q_len % n or kv_len % n:
        how = "2 × world_size with load_balance=True" if load_balance else "world_size"
        raise ValueError(
            f"{fn}: q_len and kv_len must split into {n} equal chunks ({how}); got "
            f"q_len={q_len}, kv_len={kv_len}, world_size={world_size}, "
            f"load_balance={load_balance}"
        )
    heads, kv_heads = q_shape[-3], k_shape[-3]
    if strategy == "ulysses" and (heads % world_size or kv_heads % world_size):
        raise ValueError(
            f"{fn}: strategy='ulysses' splits the heads across ranks, so heads and kv_heads "
            f"must be multiples of world_size; got heads={heads}, kv_heads={kv_heads}, "
            f"world_size={world_size}"
        )
    return strategy, world_size, load_balance


def check_axis(fn: str, axis_name: object, axis_names: tuple) -> None:
    """The mesh has the sequence axis (jax_attn)."""
    if axis_name not in axis_names:
        raise ValueError(
            f"{fn}: the mesh has no axis {axis_name!r} to split the sequence along; got "
            f"axis_name={axis_name!r}, mesh axes {tuple(axis_names)}"
        )


def check_same_on_every_rank(fn: str, described: list[str]) -> None:
    """Every rank called with the same shapes, dtype and options (torch_attn: ``described`` is
    each rank's description, gathered from all ranks); ValueError on every rank otherwise."""
    if len(set(described)) > 1:
        listing = "; ".join(f"rank {r}: {d}" for r, d in enumerate(described))
        raise ValueError(f"{fn}: every rank must pass shards of the same shapes, dtype and "
                         f"options; got {listing}")


def schedule(
    strategy: str, world_size: int, q_len: int, kv_len: int, is_causal: bool,
    causal_alignment: str, window: tuple | None, load_balance: bool,
) -> Schedule:
    """The static schedule of a checked call (global lengths)."""
    lo, hi = band(q_len, kv_len, is_causal, causal_alignment, window)
    q_segments = tuple(segments(q_len, world_size, r, load_balance) for r in range(world_size))
    kv_segments = tuple(segments(kv_len, world_size, r, load_balance) for r in range(world_size))
    steps = (_ring_steps(world_size, q_segments, kv_segments, lo, hi) if strategy == "ring"
             else 1)
    return Schedule(strategy, world_size, load_balance, q_len, kv_len, lo, hi, q_segments,
                kv_segments, steps)


def all_segments(segments_per_rank: tuple[tuple[Segment, ...], ...]) -> tuple[Segment, ...]:
    """The chunks of every rank in layout order: the gathered sequence (all_gather, ulysses)."""
    return tuple(s for rank_segments in segments_per_rank for s in rank_segments)


# ------------------------------------------------------------------------------------------
# Messages and the picture of a schedule
# ------------------------------------------------------------------------------------------


def message_bytes(strategy: str, world_size: int, shard_elements: dict[str, int],
                  itemsize: int, steps: int, direction: str) -> int:
    """Bytes one rank sends in one ``direction`` (``"forward"`` or ``"backward"``) of a call,
    by the formula of each strategy.

    ``shard_elements``: elements of one rank's ``query``, ``key``, ``value`` and ``output``
    shards. Ring, forward: ``steps - 1`` sends of K and V; backward: ``steps - 1`` sends of K,
    V, dK and dV, then dK and dV go home in one more send unless they arrived there.
    All-gather, forward: the ``N - 1`` other shards of K and V; backward: the same gather again
    and a reduce-scatter of dK and dV (the same volume). Ulysses: an all-to-all keeps ``1/N`` of
    an array and sends the rest; forward: Q, K and V in, the output back; backward: dO in, dQ,
    dK and dV back (the head-split Q, K, V, output and log-sum-exp were kept).
    """
    n, e = world_size, shard_elements
    kv = e["key"] + e["value"]
    backward = direction == "backward"
    if strategy == "ring":
        if not backward:
            return (steps - 1) * kv * itemsize
        home = kv if (steps - 1) % n else 0
        return ((steps - 1) * 2 * kv + home) * itemsize
    if strategy == "all_gather":
        return (n - 1) * kv * (2 if backward else 1) * itemsize
    per_rank = e["query"] + kv + e["output"]  # forward: q, k, v in, output back; backward alike
    return (n - 1) * per_rank // n * itemsize


def draw(sched: Schedule) -> str:
    """The schedule as text: per rank, its query chunks, then per step the key/value chunks it
    holds and, per (query chunk, key chunk) pair, ``■`` (computed whole), ``◣`` (computed, the
    band cuts it) or ``·`` (never computed); the last column counts the pairs computed."""
    n = sched.world_size
    chunks = n * chunks_per_rank(sched.load_balance)
    size_q, size_kv = sched.q_len // chunks, sched.kv_len // chunks
    gathered = sched.strategy != "ring"

    def names(segs: tuple[Segment, ...], size: int) -> str:
        return ",".join(str(start // size) for start, _ in segs)

    rows = []
    for rank in range(n):
        cells, work = [], 0
        for step in range(sched.steps):
            origin = ring_origin(n, rank, step)
            kv_segs = all_segments(sched.kv_segments) if gathered else sched.kv_segments[origin]
            marks = []
            for qs in sched.q_segments[rank]:
                row = ""
                for ks in kv_segs:
                    if not pair_needed(qs, ks, sched.lo, sched.hi):
                        row += "·"
                        continue
                    work += 1
                    row += "■" if pair_is_full(qs, ks, sched.lo, sched.hi) else "◣"
                marks.append(row)
            held = "all" if gathered else names(kv_segs, size_kv)
            cells.append(f"kv {held}  {' '.join(marks)}")
        rows.append((str(rank), names(sched.q_segments[rank], size_q), cells, str(work)))
    width = max(len(c) for _, _, cells, _ in rows for c in cells)
    title = (f"{sched.strategy}, {n} ranks, {chunks} chunks of {size_q} queries and {size_kv} "
             f"keys{', zig-zag' if sched.load_balance else ''}; band: "
             f"{_band_words(sched.lo, sched.hi)}")
    steps = "".join(f" | {'step ' + str(s):<{width}}" for s in range(sched.steps))
    lines = [title, f"rank  q chunks{steps} | pairs"]
    for rank, q_names, cells, work in rows:
        body = "".join(f" | {c:<{width}}" for c in cells)
        lines.append(f"{rank:>4}  {q_names:<8}{body} | {work:>5}")
    return "\n".join(line.rstrip() for line in lines)


def _band_words(lo: float, hi: float) -> str:
    if lo == -math.inf and hi == math.inf:
        return "none (every pair computed)"
    left = "-inf" if lo == -math.inf else str(int(lo))
    right = "inf" if hi == math.inf else str(int(hi))
    return f"{left} <= key - query <= {right}"
