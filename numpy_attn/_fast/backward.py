"""The blocked fast path of numpy_attn, backward: ``fast_attention_vjp``'s tiles on every
core (``_fast/__init__.py`` runs the forward pass, then this, with its block sizes, ``blocks``).

``blocked_attention_vjp``: FlashAttention-2's backward (Dao 2023, algorithm 2) with the public
``backward.py``'s formulas per tile. The forward pass (``_fast/forward.py``) also keeps each
row's log-sum-exp ``lse = max + log(sum)`` (``+inf`` on a fully masked row, so its weights
recompute as 0), and ``delta = rowsum(dO ⊙ O)``. The keys are then cut into blocks of
``BLOCK_KV`` rows; a task is one (batch, kv head, key block): for each query head that shares
the kv head and each chunk of at most ``BLOCK_Q_BACKWARD`` of the queries that can see the block
(``rules.query_range``: tiles the causal rule or the window mask entirely are never computed),
it recomputes the transposed tile ``Pᵀ = exp(K Qᵀ · scale - lse)`` and forms ``dV += Pᵀ dO``,
``dSᵀ = Pᵀ ⊙ (V dOᵀ - delta)``, ``dK += dSᵀ Q · scale`` in its own key block, and ``dQ += dS K ·
scale`` into its lane's own ``dQ`` (the lanes' copies are added at the end, in lane order):
nothing is shared, so nothing races, and every sum runs in the same order in every call. The
bias gradient (``dS`` summed over the axes the bias was broadcast along) is added under a lock,
by one task per key block (covering every head whose sums share its entries), or, for a bias
broadcast over keys, into each lane's own copy. ``- lse`` and ``- delta`` ride in one extra
column of the query and of ``dO`` (against a column of ones in the keys and values), so the
matrix products subtract them. Extra memory: a few tiles per lane, the inputs with their extra
column and a copy of ``dQ`` per extra lane (one lane per core), never a ``(q_len, kv_len)``
array. Where ``Sᵀ`` and ``dPᵀ`` are made ``keys @ rowsᵀ`` (``keys_first``) or ``rows @ keysᵀ``
read through their transposes is ``_fast/tuning.py``'s choice: the same sums, another BLAS
kernel.

Chunks, ALiBi, segment ids and the mods: the (query chunk, key block) tiles the chunk rule,
the ids or ``mask_mod`` empty are skipped (``_masking._mods_statuses``), and ``dS`` is
multiplied by ``score_mod.derivative``. The tasks run in lanes on the one thread pool of
``_threads.py`` (``_threads.run_lanes``).
"""

from __future__ import annotations

import threading

import numpy as np

import attention_rules as rules

from .. import _threads
from .._arrays import _groups
from .._masking import (
    NEG_INF,
    _entry,
    _Mods,
    _mods_allowed,
    _mods_scores,
    _mods_slope,
    _mods_statuses,
    _outside_band,
)
from .._steps import _softcap
from .forward import LOG2E

# ------------------------------------------------------------------------------------------
# The blocked backward pass
# ------------------------------------------------------------------------------------------


def blocked_attention_vjp(
    query_lse: np.ndarray,
    key_ones: np.ndarray,
    value_ones: np.ndarray,
    grad_output_delta: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    args: rules.Arguments,
    mods: _Mods | None = None,
    *,
    blocks: tuple[int, int, int],
    exp2: bool = False,
    keys_first: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The gradients in the compute dtype (``grad_bias`` full rank), per (batch, kv head, key
    block) on the thread pool. ``mods`` as in the forward pass: ``score_mod``'s derivative
    multiplies ``dS`` before the bias takes it; the query chunks they leave no key of the
    block are skipped. The inputs carry one column more, so that two of the products
    also subtract: ``query_lse`` is ``[Q · scale, -lse]`` ``(..., heads, q_len, head_dim + 1)``,
    ``key_ones`` ``[K, 1]``, ``value_ones`` ``[V, 1]`` and ``grad_output_delta`` ``[dO,
    -delta]``; then ``[K, 1] [Q · scale, -lse]ᵀ = S - lse`` (without soft-cap: it comes between
    the product and ``- lse``) and ``[V, 1] [dO, -delta]ᵀ = dPᵀ - delta``, one pass over the
    tile less each. ``blocks``: ``(BLOCK_Q, BLOCK_KV, BLOCK_Q_BACKWARD)``, and ``exp2`` the
    exponential, ``_fast``'s choice (``_fast/tuning.py``): with ``exp2`` and without soft-cap,
    bias, ALiBi or score_mod, the tile is ``exp2`` of ``[K, 1] [Q · scale, -lse]ᵀ · log2 e``
    (the same weights; where NumPy vectorises float32 ``exp2`` it takes half ``exp``'s time);
    ``keys_first`` the order of the two products that make a tile, ``Sᵀ`` and ``dPᵀ``: ``keys
    @ rowsᵀ`` into ``(keys, rows)`` buffers, else ``rows @ keysᵀ`` into ``(rows, keys)``
    buffers that the tile's other steps read through their transposes."""
    BLOCK_Q, BLOCK_KV, BLOCK_Q_BACKWARD = blocks  # _fast's, read at each call
    head_dim, v_dim = key_ones.shape[-1] - 1, value_ones.shape[-1] - 1
    query, key = query_lse[..., :head_dim], key_ones[..., :head_dim]  # scaled query
    neg_lse = query_lse[..., head_dim]  # -lse: (..., heads, q_len)
    grad_output = grad_output_delta[..., :v_dim]  # (..., heads, q_len, v_dim)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    target = args.scores_shape  # (..., heads, q_len, kv_len)
    groups = _groups(query.shape, key.shape)
    scaled_key = key * args.scale  # dQ = dS K · scale; (dK = dSᵀ Q · scale uses the scaled query)
    grad_key = np.zeros(key.shape, key.dtype)  # blocks no query sees: 0
    grad_value = np.zeros(value_ones.shape[:-1] + (v_dim,), key.dtype)
    masked_out = None if mask is None else np.broadcast_to(~mask, target)  # True = not allowed
    grad_bias = bias_lock = None
    bias_per_lane = bias_per_key_block = False
    if bias is not None:  # full rank, so its axes line up with the scores'
        bias = bias.astype(query.dtype, copy=False)
        grad_bias = np.zeros((1,) * (len(target) - bias.ndim) + bias.shape, query.dtype)
        bias_lock = threading.Lock()
        bias = np.broadcast_to(bias, target)
        # The tasks of one key block may add into the same entries of a bias broadcast over
        # heads or batch: they become one task, whose sums run in order. A bias broadcast over
        # keys is shared by every key block: each lane adds into its own copy (it is small).
        bias_per_lane = grad_bias.shape[-1] == 1
        bias_per_key_block = not bias_per_lane
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
    block_kv, block_q = BLOCK_KV, BLOCK_Q_BACKWARD
    softcap = args.softcap
    shifts = mods is not None and (mods.alibi is not None or mods.score_mod is not None)
    # without soft-cap (or ALiBi, score_mod) the product subtracts lse; else the tile does
    plain = softcap is None and not shifts
    query_s, key_s = (query_lse, key_ones) if plain else (query, key)
    exp = np.exp
    if plain and exp2 and bias is None:  # Pᵀ = exp2((S - lse) · log2 e), in units of log2
        query_s, exp = np.multiply(query_lse, LOG2E, dtype=query_lse.dtype), np.exp2
    strips: dict = {}  # the masks of the strips, by their geometry (most tiles share one)
    statuses = None  # (..., heads | 1, query blocks of BLOCK_Q, key blocks of block_kv)
    if mods is not None and mods.masks:
        statuses = _mods_statuses(mods, q_len, kv_len, BLOCK_Q, block_kv, lo, hi, True)

    tasks = []  # (batch-and-kv-head indices, key rows k0:k1, query range)
    kv_indices = list(np.ndindex(key.shape[:-2]))
    for k0 in range(0, kv_len, block_kv):
        k1 = min(k0 + block_kv, kv_len)
        queries = rules.query_range(k0, k1, q_len, lo, hi)
        if statuses is not None:  # the query blocks that see a key of the block, any head
            seen = np.flatnonzero(statuses[..., k0 // block_kv].reshape(-1, statuses.shape[-2])
                                  .any(axis=0))
            r0, r1 = (seen[0] * BLOCK_Q, (seen[-1] + 1) * BLOCK_Q) if seen.size else (0, 0)
            q0, q1 = max(queries[0], r0), min(queries[1], r1)
            queries = (q0, max(q1, q0)) + queries[2:]
        if queries[1] > queries[0]:  # else no query sees these keys: their gradients are 0
            if bias_per_key_block:
                tasks.append((kv_indices, k0, k1, queries))
            else:
                tasks += [([kv_index], k0, k1, queries) for kv_index in kv_indices]
    tasks.sort(key=lambda task: task[3][0] - task[3][1])  # longest query range first

    def block(kv_indices: list[tuple[int, ...]], k0: int, k1: int,
              queries: tuple[int, int, int, int], scratch: dict[str, np.ndarray]) -> None:
        for kv_index in kv_indices:  # in order
            kv_block(kv_index, k0, k1, queries, scratch)

    def kv_block(kv_index: tuple[int, ...], k0: int, k1: int, queries: tuple[int, int, int, int],
                 scratch: dict[str, np.ndarray]) -> None:
        q0, q1, a, b = queries
        keys = k1 - k0
        key_block, value_block = key_s[kv_index][k0:k1], value_ones[kv_index][k0:k1]
        grad_k_block, grad_v_block = grad_key[kv_index][k0:k1], grad_value[kv_index][k0:k1]
        first = True  # the first tile writes dK and dV of the block, the others add to them
        heads = [kv_index[:-1] + (kv_index[-1] * groups + g,) for g in range(groups)] \
            if kv_index else [()]
        for index in heads:  # the query heads that share this kv head
            for c0 in range(q0, q1, block_q):
                c1 = min(c0 + block_q, q1)
                rows = c1 - c0
                cut = False  # whether mods mask part of this tile
                if statuses is not None:
                    tile = _entry(statuses, index)[c0 // BLOCK_Q : -(-c1 // BLOCK_Q),
                                                   k0 // block_kv]
                    if not tile.any():
                        continue  # mods mask the whole tile: nothing to add
                    cut = bool((tile != rules.ALL).any())
                # Pᵀ, recomputed from the saved log-sum-exp: (keys, rows)
                weights_t = _tile(scratch["scores"], keys, rows, keys_first)
                _product_t(key_block, query_s[index][c0:c1], weights_t, keys_first)  # S (- lse)
                if softcap is not None:
                    weights_t = _softcap(weights_t, softcap)  # S1
                    slope = _tile(scratch["slope"], keys, rows, keys_first)
                    np.multiply(weights_t, 1.0 / softcap, out=slope)
                    np.square(slope, out=slope)
                    np.subtract(1.0, slope, out=slope)  # tanh': 1 - (S1 / c)²
                if bias is not None:
                    weights_t += bias[index][c0:c1, k0:k1].T
                mod_slope = None  # d score_mod / d score, at the scores before it
                if shifts:  # on the (rows, keys) view: ALiBi, then score_mod, in place
                    view = weights_t.T
                    _mods_scores(view, mods._replace(score_mod=None), c0, k0, index)
                    if mods.score_mod is not None:
                        mod_slope = np.broadcast_to(_mods_slope(view, mods, c0, k0, index),
                                                    view.shape).T  # (keys, rows)
                        _mods_scores(view, mods._replace(alibi=None), c0, k0, index)
                for s0, s1 in ((max(q0, c0), min(a, c1)), (max(b, c0), min(q1, c1))):
                    if s1 > s0:  # the strips of queries the causal rule / window cut
                        outside = _outside_band(strips, s0, s1 - s0, k0, keys, lo, hi)
                        np.copyto(weights_t[:, s0 - c0 : s1 - c0], NEG_INF, where=outside.T)
                if masked_out is not None:
                    np.copyto(weights_t, NEG_INF, where=masked_out[index][c0:c1, k0:k1].T)
                if cut:
                    allowed = _mods_allowed(mods, c0, rows, k0, keys, index)
                    np.copyto(weights_t.T, NEG_INF, where=~allowed)
                if not plain:
                    weights_t += neg_lse[index][c0:c1]
                exp(weights_t, out=weights_t)  # Pᵀ: 0 where masked or on fully masked rows
                # dV = Pᵀ dO
                _matmul_into(weights_t, grad_output[index][c0:c1], grad_v_block,
                             scratch["value"], first)
                # dSᵀ = Pᵀ ⊙ (V dOᵀ - delta), in the second tile buffer
                grad_s = _tile(scratch["grads"], keys, rows, keys_first)
                _product_t(value_block, grad_output_delta[index][c0:c1], grad_s, keys_first)
                grad_s *= weights_t
                if mod_slope is not None:  # through score_mod: dS ⊙ its derivative, and 0
                    # where Pᵀ is 0 (masked), also where the derivative is NaN there
                    np.multiply(grad_s, mod_slope, out=grad_s, where=weights_t != 0.0)
                if grad_bias is not None:
                    _add_bias_grad(scratch.get("grad_bias", grad_bias), grad_s, index, c0, c1,
                                   k0, k1, bias_lock)
                if softcap is not None:
                    grad_s *= slope
                # dK = dSᵀ Q · scale, dQ = dS K · scale
                _matmul_into(grad_s, query[index][c0:c1], grad_k_block, scratch["key"], first)
                part = scratch["query"][:rows]
                np.matmul(grad_s.T, scaled_key[kv_index][k0:k1], out=part)
                scratch["grad_query"][index][c0:c1] += part
                first = False

    def scratch() -> dict[str, np.ndarray]:  # one lane's tiles and its own dQ
        tile = block_kv * min(block_q, q_len)
        buffers = {
            "scores": np.empty(tile, query.dtype), "grads": np.empty(tile, query.dtype),
            "slope": np.empty(tile if softcap is not None else 0, query.dtype),
            "key": np.empty((block_kv, key.shape[-1]), query.dtype),
            "value": np.empty((block_kv, v_dim), query.dtype),
            "query": np.empty((block_q, key.shape[-1]), query.dtype),
            "grad_query": np.zeros(query.shape, query.dtype),
        }
        if bias_per_lane:  # a bias broadcast over keys: small
            buffers["grad_bias"] = np.zeros_like(grad_bias)
        return buffers

    scratches = _threads.run_lanes(tasks, block, scratch)
    if not scratches:
        return np.zeros(query.shape, query.dtype), grad_key, grad_value, grad_bias
    grad_query = scratches[0]["grad_query"]
    for other in scratches[1:]:  # in lane order: the same sums, whichever thread ran a lane
        grad_query += other["grad_query"]
    if bias_per_lane:
        for other in scratches:
            grad_bias += other["grad_bias"]
    return grad_query, grad_key, grad_value, grad_bias


def _tile(buffer: np.ndarray, keys: int, rows: int, keys_first: bool) -> np.ndarray:
    """A tile ``(keys, rows)`` in a lane's ``buffer``: C-ordered with ``keys_first``, else the
    transpose of a C-ordered ``(rows, keys)`` array."""
    if keys_first:
        return buffer[: keys * rows].reshape(keys, rows)
    return buffer[: keys * rows].reshape(rows, keys).T


def _product_t(a: np.ndarray, b: np.ndarray, out: np.ndarray, keys_first: bool) -> None:
    """``out = a @ bᵀ`` ``(keys, rows)`` for ``a (keys, d)``, ``b (rows, d)``, in the chosen
    order: ``a @ bᵀ`` with ``keys_first``, else ``b @ aᵀ`` into ``outᵀ`` (the same sums; the
    BLAS's kernel for the shape differs)."""
    if keys_first:
        np.matmul(a, b.T, out=out)
    else:
        np.matmul(b, a.T, out=out.T)


def _matmul_into(
    a: np.ndarray, b: np.ndarray, out: np.ndarray, buffer: np.ndarray, first: bool
) -> None:
    """``out = a @ b`` if ``first``, else ``out += a @ b`` (through ``buffer``)."""
    if first:
        np.matmul(a, b, out=out)
    else:
        part = buffer[: out.shape[0]]
        np.matmul(a, b, out=part)
        out += part


def _add_bias_grad(
    grad_bias: np.ndarray, grad_s: np.ndarray, index: tuple[int, ...], c0: int, c1: int,
    k0: int, k1: int, lock: threading.Lock,
) -> None:
    """Add the tile ``dSᵀ`` (keys k0:k1, queries c0:c1 of head ``index``) to the full-rank
    ``grad_bias``, summed over the axes along which the bias was broadcast."""
    shape = grad_bias.shape
    bias_index = tuple(0 if size == 1 else i for i, size in zip(index, shape[:-2], strict=True))
    grad = grad_s.T  # (queries, keys)
    if shape[-2] == 1:
        grad, q_slice = grad.sum(axis=0, keepdims=True), slice(None)
    else:
        q_slice = slice(c0, c1)
    if shape[-1] == 1:
        grad, k_slice = grad.sum(axis=1, keepdims=True), slice(None)
    else:
        k_slice = slice(k0, k1)
    with lock:  # tasks of several heads or key blocks may share these entries
        grad_bias[bias_index][q_slice, k_slice] += grad
