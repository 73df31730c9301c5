"""The fast path of numpy_attn: the pipeline of ``functional.py``, blocked, on every core.

The explicit steps (``_core.py``) and ``backward.py``'s VJP are the code to read: each makes the
whole ``(..., heads, q_len, kv_len)`` score array, and NumPy's elementwise functions (``max``,
``exp``, ``sum``) run on one core while only the matrix products use every core. For large
inputs ``use_fast_path`` (the one selection rule, for the forward pass and the VJP alike; its
numbers are ``attention_rules.FAST_PATHS["numpy_attn"]``) selects ``"blocked"``: no
``return_weights``, no dropout, no empty axis, and at least ``MIN_SCORES`` score entries with
``q_len >= MIN_Q_LEN``.

Forward, ``fast_attention``: the queries are cut into blocks of ``BLOCK_Q`` rows and, per
(batch, head, query block), the scores against the keys that block can see (the causal rule and
the window give a key range, ``rules.key_range``; fully masked blocks are skipped, and the band
is applied only to the diagonal strips) give ``(exp(s - max) @ value) / sum``, each step by the
explicit steps' own helpers (``_softcap``, ``_in_band``, ``_unnormalised_softmax``); mask and
bias are sliced per block from broadcast views, never materialised. Without a bias, a head
whose scores are all within ``±EXP_BOUND`` (``|q·k| <= |q| |k|``, from the row norms) skips the
shift by the row max, which changes nothing but rounding: ``exp`` can neither overflow nor
underflow there. Each block's row log-sum-exp ``max + log(sum)`` is kept when asked
(``return_lse``: no extra pass) or when ``sinks`` are given, which join each block's rows at its
end (``output · exp(lse - logaddexp(lse, sink))``). The result equals the explicit steps' within
float32 rounding
(``tests/test_performance_paths.py``), NaN and infinities included: a masked position's score
is replaced by ``-inf``, a skipped block is never read, and a NaN or infinite norm takes the
shifted softmax.

Chunks, ALiBi, segment ids, ``score_mod`` and ``mask_mod`` (``spec.MASKS_AND_MODS``, the
``mods`` of ``_core``): each block adds ALiBi and ``score_mod`` (on that block's indices, one
(batch, head) entry: 0-d batch and head); the chunk rule, the ids and ``mask_mod`` are first
evaluated once per block of ``BLOCK_Q`` rows over the keys the band leaves
(``_core._mods_statuses``, per key block of ``BLOCK_KV``), each block's key range is narrowed to
the key blocks they leave, and only the key blocks they cut are masked (``_narrowed``), so a
causal ``mask_mod`` costs about what ``is_causal`` costs. The VJP skips the (query chunk, key
block) tiles they empty and multiplies ``dS`` by ``score_mod.derivative``.

VJP, ``fast_attention_vjp``: FlashAttention-2's backward (Dao 2023, algorithm 2) with
``backward.py``'s formulas per tile. The forward pass above also keeps each row's log-sum-exp
``lse = max + log(sum)`` (``+inf`` on a fully masked row, so its weights recompute as 0), and
``delta = rowsum(dO ⊙ O)``. The keys are then cut into blocks of ``BLOCK_KV`` rows; a task is
one (batch, kv head, key block): for each query head that shares the kv head and each chunk of
at most ``BLOCK_Q_BACKWARD`` of the queries that can see the block (``rules.query_range``:
tiles the causal rule or the window mask entirely are never computed), it recomputes the
transposed tile ``Pᵀ = exp(K Qᵀ · scale - lse)`` and forms ``dV += Pᵀ dO``, ``dSᵀ = Pᵀ ⊙
(V dOᵀ - delta)``, ``dK += dSᵀ Q · scale`` in its own key block, and ``dQ += dS K · scale``
into its lane's own ``dQ`` (the lanes' copies are added at the end, in lane order): nothing
is shared, so nothing races, and every sum runs in the same order in every call. The
bias gradient (``dS`` summed over the axes the bias was broadcast along) is added under a lock,
by one task per key block (covering every head whose sums share its entries), or, for a bias
broadcast over keys, into each lane's own copy. ``- lse`` and ``- delta`` ride in one extra
column of the query and of ``dO`` (against a column of ones in the keys and values), so the
matrix products subtract them. Extra memory: a few tiles per lane, the inputs with their extra
column and a copy of ``dQ`` per extra lane (one lane per core), never a ``(q_len, kv_len)``
array.

The tasks run in lanes on the one thread pool of ``_threads.py`` (``_threads.run_lanes``,
BLAS limited to one thread while they run; ``blockwise.py`` runs its tiles on it too): the same
bits from any thread, whatever else the process is doing (``spec.CONCURRENCY``).
"""

from __future__ import annotations

import threading

import numpy as np

import attention_rules as rules

from . import _threads
from ._core import (
    NEG_INF,
    _groups,
    _in_band,
    _Mods,
    _mods_allowed,
    _mods_scores,
    _mods_slope,
    _mods_statuses,
    _sinks_grad,
    _softcap,
    _unnormalised_softmax,
)

_BLOCKED = rules.FAST_PATHS["numpy_attn"]["blocked"]
BLOCK_Q = _BLOCKED["block_q"]  # query rows per block: a float32 block of scores stays in L2
BLOCK_KV = _BLOCKED["block_kv"]  # key rows per task of the VJP: dK and dV of a block are its own
BLOCK_Q_BACKWARD = _BLOCKED["block_q_backward"]  # queries per tile of the VJP (cache-sized)
MIN_SCORES = _BLOCKED["min_scores"]  # below this many score entries the plain path is as fast
MIN_Q_LEN = _BLOCKED["min_q_len"]  # few queries (decoding): one batched matmul is faster
# Scores within ±EXP_BOUND need no shift by their row max: exp(64) · kv_len cannot overflow and
# exp(-64) is a normal float32, far below the rounding of a row whose largest weight is ≥ e^-64.
EXP_BOUND = 64.0


def use_fast_path(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    args: rules.Arguments,
) -> str | None:
    """The fast path for these validated inputs (``"blocked"``), or None for the steps; the
    same rule selects ``fast_attention`` and ``fast_attention_vjp``."""
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
    sinks: np.ndarray | None = None,
    mods: _Mods | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """``scaled_dot_product_attention``'s output on the path ``use_fast_path`` chose:
    ``(..., heads, q_len, v_dim)`` in the input dtype, and with ``args.return_lse`` the
    row log-sum-exp ``(..., heads, q_len)`` the blocks computed anyway (compute dtype); the
    ``(heads,)`` ``sinks`` join each block's denominators at its end; ``mods`` (chunks, ALiBi,
    segment ids, the mods) apply per block, and the blocks they mask entirely are skipped."""
    dtype = query.dtype
    query, key, value = _compute_arrays(query, key, value, args.scale)
    lse = np.empty(query.shape[:-1], query.dtype) if args.return_lse else None
    sinks = None if sinks is None else sinks.astype(query.dtype, copy=False)
    output = _blocked_attention(query, key, value, mask, bias, args, lse, sinks, mods)
    output = output.astype(dtype, copy=False)
    if lse is None:
        return output
    lse[lse == np.inf] = NEG_INF  # the spec's -inf for a row without a key nor a sink
    return output, lse


def fast_attention_vjp(
    path: str,
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    grad_output: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    args: rules.Arguments,
    sinks: np.ndarray | None = None,
    mods: _Mods | None = None,
) -> tuple[np.ndarray | None, ...]:
    """``scaled_dot_product_attention_vjp``'s gradients on the path ``use_fast_path`` chose:
    ``(grad_query, grad_key, grad_value, grad_bias)`` shaped like query ``(..., heads, q_len,
    head_dim)``, key ``(..., kv_heads, kv_len, head_dim)``, value ``(..., kv_heads, kv_len,
    v_dim)`` and bias (None without one), in their dtypes; with ``sinks`` ``(heads,)`` a fifth,
    ``grad_sinks``. The forward pass joins the sinks, so ``P`` and ``delta`` are those of the
    rows with their sinks and the tiles' formulas stay as they are."""
    compute = rules.compute_dtype(query.dtype.name)
    head_dim, v_dim = query.shape[-1], value.shape[-1]
    # One column more than the inputs (see _blocked_attention_vjp): [Q · scale, -lse], [K, 1],
    # [V, 1] and [dO, -delta]; the forward pass reads the first columns only.
    query_lse = np.empty(query.shape[:-1] + (head_dim + 1,), compute)
    np.multiply(query, args.scale, out=query_lse[..., :head_dim], dtype=compute)  # (q is cheapest)
    key_ones, value_ones = _with_ones(key, compute), _with_ones(value, compute)
    lse = query_lse[..., head_dim]  # (..., heads, q_len), written by the forward pass
    compute_sinks = None if sinks is None else sinks.astype(compute, copy=False)
    output = _blocked_attention(query_lse[..., :head_dim], key_ones[..., :head_dim],
                                value_ones[..., :v_dim], mask, bias, args, lse, compute_sinks,
                                mods)
    grad_output_delta = np.empty(grad_output.shape[:-1] + (v_dim + 1,), compute)
    grad_output_delta[..., :v_dim] = grad_output  # (..., heads, q_len, v_dim + 1)
    # delta = rowsum(dO ⊙ O): (..., heads, q_len)
    np.einsum("...d,...d->...", grad_output_delta[..., :v_dim], output,
              out=grad_output_delta[..., v_dim])
    del output
    grad_sinks = None  # d sink = -sum exp(sink - lse) · delta
    if sinks is not None:
        grad_sinks = _sinks_grad(compute_sinks, lse[..., None], grad_output_delta[..., v_dim:])
    np.negative(lse, out=lse)  # -lse: -inf on fully masked rows
    np.negative(grad_output_delta[..., v_dim], out=grad_output_delta[..., v_dim])  # -delta
    grad_q, grad_k, grad_v, grad_bias = _blocked_attention_vjp(
        query_lse, key_ones, value_ones, grad_output_delta, mask, bias, args, mods
    )
    dtype = query.dtype
    grads = (grad_q.astype(dtype, copy=False), grad_k.astype(dtype, copy=False),
             grad_v.astype(dtype, copy=False))
    grads += (None if grad_bias is None else
              grad_bias.reshape(bias.shape).astype(bias.dtype, copy=False),)
    return grads if sinks is None else grads + (grad_sinks.astype(sinks.dtype),)


def _with_ones(x: np.ndarray, compute: str) -> np.ndarray:
    """``(..., T, D)`` → ``(..., T, D + 1)`` in the compute dtype, the last column 1."""
    out = np.empty(x.shape[:-1] + (x.shape[-1] + 1,), compute)
    out[..., :-1] = x
    out[..., -1] = 1.0
    return out


def _compute_arrays(
    query: np.ndarray, key: np.ndarray, value: np.ndarray, scale: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Contiguous arrays in the compute dtype; the query scaled (scaling q is cheapest)."""
    compute = rules.compute_dtype(query.dtype.name)
    query = np.multiply(query, scale, dtype=compute)  # (..., heads, q_len, head_dim), scaled
    key = np.ascontiguousarray(key, dtype=compute)  # (..., kv_heads, kv_len, head_dim)
    value = np.ascontiguousarray(value, dtype=compute)  # (..., kv_heads, kv_len, v_dim)
    return query, key, value


def _blocked_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    args: rules.Arguments,
    lse: np.ndarray | None,
    sinks: np.ndarray | None = None,
    mods: _Mods | None = None,
) -> np.ndarray:
    """The output ``(..., heads, q_len, v_dim)`` in the compute dtype, block by block, on the
    thread pool; ``query`` is scaled. With ``lse`` ``(..., heads, q_len)``, each row's
    log-sum-exp is written there (``+inf`` for a row without a key nor a sink). The ``(heads,)``
    ``sinks`` (compute dtype) join each block's rows at its end (``finish``). ``mods``: ALiBi and
    ``score_mod`` on every block; the chunk rule, segment ids and ``mask_mod`` narrow each
    block's key range to the key blocks they leave (``_core._mods_statuses``, evaluated once
    for every head that shares them) and mask only the key blocks they cut."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    target = args.scores_shape  # (..., heads, q_len, kv_len)
    groups = _groups(query.shape, key.shape)
    output = np.empty(query.shape[:-1] + value.shape[-1:], dtype=query.dtype)
    masked_out = None if mask is None else np.broadcast_to(~mask, target)  # True = not allowed
    bias = None if bias is None else np.broadcast_to(bias.astype(query.dtype, copy=False), target)
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
    block_q = BLOCK_Q
    strips: dict = {}  # the masks of the strips, by their geometry (most blocks share one)
    shifts = bias is not None or (mods is not None and (mods.alibi is not None
                                                         or mods.score_mod is not None))
    unshifted = None if shifts else _bounded_heads(query, key, groups, args.softcap)
    statuses = None  # (..., heads | 1, q blocks, key blocks of BLOCK_KV)
    if mods is not None and mods.masks:
        statuses = _mods_statuses(mods, q_len, kv_len, block_q, BLOCK_KV, lo, hi, True)

    tasks = []  # (batch-and-head index, query rows i0:i1, key range)
    for index in np.ndindex(query.shape[:-2]):
        for i0 in range(0, q_len, block_q):
            i1 = min(i0 + block_q, q_len)
            keys = rules.key_range(i0, i1, kv_len, lo, hi) + (0, 0)  # no key block to mask
            if statuses is not None:
                keys = _narrowed(keys, _entry(statuses, index)[i0 // block_q], BLOCK_KV)
            tasks.append((index, i0, i1, keys))
    tasks.sort(key=lambda task: task[3][0] - task[3][1])  # longest key range first

    need_lse = lse is not None or sinks is not None

    def finish(index: tuple[int, ...], i0: int, i1: int, out: np.ndarray,
               row_lse: np.ndarray) -> None:
        """The rows' sink joined (``row_lse``: over the keys, ``-inf`` for none) and the lse
        stored (``+inf`` for a row without a key nor a sink: ``exp(s - lse)`` is 0 there)."""
        if sinks is not None:  # one logit per head, added to the denominator at the end
            total = np.logaddexp(row_lse, sinks[index[-1] if index else 0])
            out *= np.exp(row_lse - np.where(total == NEG_INF, 0.0, total))[:, None]
            row_lse = total
        if lse is not None:
            lse[index][i0:i1] = np.where(row_lse == NEG_INF, np.inf, row_lse)

    def block(index: tuple[int, ...], i0: int, i1: int, keys: tuple[int, ...],
              buffer: np.ndarray) -> None:
        k0, k1, a, b, p0, p1 = keys  # keys [p0, p1): the ones mods may mask
        out = output[index][i0:i1]  # (rows, v_dim)
        if k1 == k0:  # no key allowed for any row: fully masked
            out[...] = 0.0
            if need_lse:
                finish(index, i0, i1, out, np.full(i1 - i0, NEG_INF, output.dtype))
            return
        kv_index = index[:-1] + (index[-1] // groups,) if index else ()
        scores = buffer[: (i1 - i0) * (k1 - k0)].reshape(i1 - i0, k1 - k0)  # (rows, keys)
        np.matmul(query[index][i0:i1], key[kv_index][k0:k1].T, out=scores)  # query is scaled
        scores = _softcap(scores, args.softcap)
        if bias is not None:
            scores += bias[index][i0:i1, k0:k1]
        scores = _mods_scores(scores, mods, i0, k0, index)  # ALiBi, score_mod
        for c0, c1 in ((k0, a), (b, k1)):  # the strips the causal rule / window cut
            if c1 > c0:
                outside = _outside_band(strips, i0, i1 - i0, c0, c1 - c0, lo, hi)
                np.copyto(scores[:, c0 - k0 : c1 - k0], NEG_INF, where=outside)
        if masked_out is not None:
            np.copyto(scores, NEG_INF, where=masked_out[index][i0:i1, k0:k1])
        if p1 > p0:  # the key blocks chunks, segment ids or mask_mod cut
            allowed = _mods_allowed(mods, i0, i1 - i0, p0, p1 - p0, index)
            np.copyto(scores[:, p0 - k0 : p1 - k0], NEG_INF, where=~allowed)
        if unshifted is not None and unshifted[index]:  # |scores| <= EXP_BOUND: no row max
            weights = np.exp(scores, out=scores)  # in place; 0 where masked
            row_sum = weights.sum(axis=-1, keepdims=True)  # (rows, 1)
            if need_lse:  # 0: nothing was shifted; -inf: a fully masked row
                row_max = np.where(row_sum[:, 0] == 0.0, NEG_INF, 0.0).astype(output.dtype)
            row_sum[row_sum == 0.0] = 1.0  # 0 / 1 = 0 for fully masked rows
        else:
            if need_lse:  # the softmax below shifts the scores by their row max
                row_max = scores.max(axis=-1, initial=NEG_INF)  # (rows,)
            weights, row_sum = _unnormalised_softmax(scores)  # in place; (rows, 1)
        np.matmul(weights, value[kv_index][k0:k1], out=out)  # normalised after @ value
        out /= row_sum
        if need_lse:  # log-sum-exp over the keys: -inf on a fully masked row (log 1 - inf)
            finish(index, i0, i1, out, np.log(row_sum[:, 0]) + row_max)

    # a lane's scratch: the scores of one block
    _threads.run_lanes(tasks, block, lambda: np.empty(block_q * kv_len, dtype=query.dtype))
    return output


def _blocked_attention_vjp(
    query_lse: np.ndarray,
    key_ones: np.ndarray,
    value_ones: np.ndarray,
    grad_output_delta: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    args: rules.Arguments,
    mods: _Mods | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The gradients in the compute dtype (``grad_bias`` full rank), per (batch, kv head, key
    block) on the thread pool. ``mods`` as in the forward pass: ``score_mod``'s derivative
    multiplies ``dS`` before the bias takes it; the query chunks they leave no key of the
    block are skipped. The inputs carry one column more, so that two of the products
    also subtract: ``query_lse`` is ``[Q · scale, -lse]`` ``(..., heads, q_len, head_dim + 1)``,
    ``key_ones`` ``[K, 1]``, ``value_ones`` ``[V, 1]`` and ``grad_output_delta`` ``[dO,
    -delta]``; then ``[K, 1] [Q · scale, -lse]ᵀ = S - lse`` (without soft-cap: it comes between
    the product and ``- lse``) and ``[V, 1] [dO, -delta]ᵀ = dPᵀ - delta``, one pass over the
    tile less each."""
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
                weights_t = scratch["scores"][: keys * rows].reshape(keys, rows)
                np.matmul(key_block, query_s[index][c0:c1].T, out=weights_t)  # S (- lse)
                if softcap is not None:
                    weights_t = _softcap(weights_t, softcap)  # S1
                    slope = scratch["slope"][: keys * rows].reshape(keys, rows)
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
                np.exp(weights_t, out=weights_t)  # Pᵀ: 0 where masked or on fully masked rows
                # dV = Pᵀ dO
                _matmul_into(weights_t, grad_output[index][c0:c1], grad_v_block,
                             scratch["value"], first)
                # dSᵀ = Pᵀ ⊙ (V dOᵀ - delta), in the second tile buffer
                grad_s = scratch["grads"][: keys * rows].reshape(keys, rows)
                np.matmul(value_block, grad_output_delta[index][c0:c1].T, out=grad_s)
                grad_s *= weights_t
                if mod_slope is not None:  # through score_mod: dS ⊙ its derivative
                    grad_s *= mod_slope
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


def _entry(statuses: np.ndarray, index: tuple[int, ...]) -> np.ndarray:
    """The ``(q blocks, key blocks)`` statuses of one (batch..., head) ``index`` from
    ``_mods_statuses(..., per_entry=True)`` (whose size-1 axes hold for every entry)."""
    lead = statuses.shape[:-2]
    return statuses[tuple(0 if size == 1 else i for i, size in zip(index, lead, strict=True))]


def _narrowed(keys: tuple[int, ...], row: np.ndarray, block_kv: int) -> tuple[int, ...]:
    """``(k0, k1, a, b, p0, p1)``: a block's key range ``[k0, k1)`` and band columns ``[a, b)``
    (``rules.key_range``) narrowed to the key blocks whose status in ``row`` is not
    ``rules.NONE``, and ``[p0, p1)`` the span of those not ``rules.ALL`` (to be masked)."""
    k0, k1, a, b = keys[:4]
    kept = np.flatnonzero(row)
    if kept.size:
        k0, k1 = max(k0, int(kept[0]) * block_kv), min(k1, (int(kept[-1]) + 1) * block_kv)
    if not kept.size or k1 <= k0:
        return k0, k0, k0, k0, k0, k0  # every key masked
    a = min(max(a, k0), k1)
    b = max(min(b, k1), a)
    cut = np.flatnonzero(row[kept[0] : kept[-1] + 1] != rules.ALL) + kept[0]
    p0, p1 = k0, k0
    if cut.size:
        p0 = max(k0, int(cut[0]) * block_kv)
        p1 = max(min(k1, (int(cut[-1]) + 1) * block_kv), p0)
    return k0, k1, a, b, p0, p1


def _bounded_heads(
    query: np.ndarray, key: np.ndarray, groups: int, softcap: float | None
) -> np.ndarray:
    """``(..., heads)`` bool: every score of the head is within ``±EXP_BOUND`` (Cauchy-Schwarz:
    ``|q·k| <= |q| |k|``; a soft-capped score within ``±softcap``), so its softmax may skip the
    shift by the row max. False where a norm is NaN or infinite. ``query`` is scaled."""
    query_norm = np.sqrt(np.einsum("...d,...d->...", query, query).max(axis=-1, initial=0.0))
    key_norm = np.sqrt(np.einsum("...d,...d->...", key, key).max(axis=-1, initial=0.0))
    bound = query_norm * np.repeat(key_norm, groups, axis=-1) if query.ndim > 2 else \
        query_norm * key_norm  # (..., heads)
    if softcap is not None:
        bound = np.minimum(bound, softcap)  # NaN stays NaN: not bounded
    return bound <= EXP_BOUND


def _outside_band(
    strips: dict, q_start: int, rows: int, kv_start: int, keys: int, lo: float, hi: float
) -> np.ndarray:
    """``~_in_band(...)``: ``(rows, keys)``, True where ``j - i`` is outside the
    band. It depends on ``kv_start - q_start`` and the sizes only, so it is made once per
    geometry and kept in ``strips`` (a dict shared by the workers of one call)."""
    geometry = (kv_start - q_start, rows, keys)
    outside = strips.get(geometry)
    if outside is None:
        outside = ~_in_band(q_start, rows, kv_start, keys, lo, hi)
        strips[geometry] = outside  # two workers may both make it: the same array
    return outside


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
