"""The blocked fast path of numpy_attn, forward: ``fast_attention``'s blocks on every core
(``_fast/__init__.py`` selects the path and passes its block sizes, ``blocks``, at each call; the
backward pass is ``_fast/backward.py``'s).

``blocked_attention``: the queries are cut into blocks of ``BLOCK_Q`` rows and, per (batch,
head, query block), the scores against the keys that block can see (the causal rule and the
window give a key range, ``rules.key_range``; fully masked blocks are skipped, and the band is
applied only to the diagonal strips) give ``(exp(s - max) @ value) / sum``, each step by the
explicit steps' own helpers (``_softcap``, ``_in_band``, ``_unnormalised_softmax``); mask and
bias are sliced per block from broadcast views, never materialised. Without a bias, a head whose
scores are all within ``±EXP_BOUND`` (``|q·k| <= |q| |k|``, from the row norms) skips the shift
by the row max, which changes nothing but rounding: ``exp`` can neither overflow nor underflow
there. Without a bias, ALiBi or ``score_mod``, where NumPy vectorises float32 ``exp2`` (its
AVX-512 loops: half ``exp``'s time; ``USE_EXP2``), the query is also scaled by ``LOG2E`` and
every ``exp`` is an ``exp2`` (the same weights: ``exp(s) = exp2(s · log2 e)``) and the soft cap
scaled alike; a head whose scores may pass the bound
takes its blocks' scores back to natural units for the shifted softmax. Each block's row
log-sum-exp ``max + log(sum)`` is kept when asked (``return_lse``: no
extra pass) or when ``sinks`` are given, which join each block's rows at its end (``output ·
exp(lse - logaddexp(lse, sink))``). The result equals the explicit steps' within float32
rounding (``tests/test_performance_paths.py``), NaN and infinities included: a masked position's
score is replaced by ``-inf``, a skipped block is never read, and a NaN or infinite norm takes
the shifted softmax. The scores' product runs in the order ``_fast/tuning.py`` chose
(``keys_first``: ``keys @ rowsᵀ`` into a ``(keys, rows)`` buffer that every later step reads
through its transpose, else ``rows @ keysᵀ``): the same steps on the same numbers, only the
BLAS's kernel differs.

Chunks, ALiBi, segment ids, ``score_mod`` and ``mask_mod`` (``spec.MASKS_AND_MODS``, the
``mods`` of ``_masking``): each block adds ALiBi and ``score_mod`` (on that block's indices, one
(batch, head) entry: 0-d batch and head); the chunk rule, the ids and ``mask_mod`` are first
evaluated once per block of ``BLOCK_Q`` rows over the keys the band leaves
(``_masking._mods_statuses``, per key block of ``BLOCK_KV``), each block's key range is narrowed
to the key blocks they leave, and only the key blocks they cut are masked (``_narrowed``), so a
causal ``mask_mod`` costs about what ``is_causal`` costs.

The blocks run in lanes on the one thread pool of ``_threads.py`` (``_threads.run_lanes``).
"""

from __future__ import annotations

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
    _mods_statuses,
    _outside_band,
)
from .._steps import _softcap, _unnormalised_softmax

# Scores within ±EXP_BOUND need no shift by their row max: exp(64) · kv_len cannot overflow and
# exp(-64) is a normal float32, far below the rounding of a row whose largest weight is ≥ e^-64.
EXP_BOUND = 64.0
# exp(s) = exp2(s · log2 e): where NumPy vectorises float32 exp2 (its AVX-512 loops) it takes
# about half exp's time (51 against 94 µs for a 128 × 2048 block, one thread), so without a
# bias, ALiBi or score_mod the query is scaled by LOG2E too and the scores are in units of log2
# (FlashAttention's trick). Elsewhere exp2 loops over the C library's exp2f: 1.8-3.3x exp's
# time on an AVX2 CPU (746-1319 against 398-405 µs), and the scores stay in natural units.
LOG2E = 1.4426950408889634


def _exp2_is_vectorised() -> bool:
    """Whether this NumPy runs float32 ``exp2`` in its AVX-512 loops on this CPU (its CPU
    dispatch's features; False when NumPy does not say)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # NumPy 1.x
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as features
        except ImportError:
            return False
    return bool(features.get("AVX512_SKX") or features.get("X86_V4"))


# The fixed table's exponential, decided once per process (ATTENTION_TUNING=off); by default
# _fast/tuning.py times both on this CPU and passes its choice as ``exp2``.
USE_EXP2 = _exp2_is_vectorised()


# ------------------------------------------------------------------------------------------
# The blocked forward pass
# ------------------------------------------------------------------------------------------


def blocked_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    args: rules.Arguments,
    lse: np.ndarray | None,
    sinks: np.ndarray | None = None,
    mods: _Mods | None = None,
    *,
    blocks: tuple[int, int],
    exp2: bool | None = None,
    keys_first: bool = False,
) -> np.ndarray:
    """The output ``(..., heads, q_len, v_dim)`` in the compute dtype, block by block, on the
    thread pool; ``query`` is scaled. With ``lse`` ``(..., heads, q_len)``, each row's
    log-sum-exp is written there (``+inf`` for a row without a key nor a sink). The ``(heads,)``
    ``sinks`` (compute dtype) join each block's rows at its end (``finish``). ``mods``: ALiBi and
    ``score_mod`` on every block; the chunk rule, segment ids and ``mask_mod`` narrow each
    block's key range to the key blocks they leave (``_masking._mods_statuses``, evaluated once
    for every head that shares them) and mask only the key blocks they cut. ``blocks``:
    ``(BLOCK_Q, BLOCK_KV)``, ``exp2`` the exponential (None: ``USE_EXP2``) and ``keys_first``
    the order of the scores' product (``keys @ rowsᵀ`` into a ``(keys, rows)`` buffer, every
    later step reading it through its transpose; else ``rows @ keysᵀ``), ``_fast``'s choice
    (``_fast/tuning.py``)."""
    BLOCK_Q, BLOCK_KV = blocks  # _fast's, read at each call
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
    # Scores in units of log2 (exp2) where exp2 is fast, unless something is added to them in
    # natural units.
    use_exp2 = USE_EXP2 if exp2 is None else exp2
    unit, exp = (1.0, np.exp) if shifts or not use_exp2 else (LOG2E, np.exp2)
    if unit != 1.0:
        query = np.multiply(query, unit, dtype=query.dtype)
    softcap = None if args.softcap is None else args.softcap * unit  # unit · softcap(s)
    unshifted = None if shifts else _bounded_heads(query, key, groups, softcap, EXP_BOUND * unit)
    ones = np.ones(kv_len, query.dtype)  # row sums as products: 0.6 of ``sum(axis=-1)``'s time
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
        scores = _scores(buffer, i1 - i0, k1 - k0, keys_first)  # (rows, keys)
        if keys_first:  # keys @ rowsᵀ, read through its transpose; query is scaled
            np.matmul(key[kv_index][k0:k1], query[index][i0:i1].T, out=scores.T)
        else:
            np.matmul(query[index][i0:i1], key[kv_index][k0:k1].T, out=scores)
        scores = _softcap(scores, softcap)
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
            weights = exp(scores, out=scores)  # in place; 0 where masked
            row_sum = np.matmul(weights, ones[: k1 - k0])[:, None]  # (rows, 1): BLAS's sum
            if need_lse:  # 0: nothing was shifted; -inf: a fully masked row
                row_max = np.where(row_sum[:, 0] == 0.0, NEG_INF, 0.0).astype(output.dtype)
            row_sum[row_sum == 0.0] = 1.0  # 0 / 1 = 0 for fully masked rows
        else:
            if unit != 1.0:  # large scores (rare): back in natural units for the shared step
                scores *= 1.0 / unit
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


def _scores(buffer: np.ndarray, rows: int, keys: int, keys_first: bool) -> np.ndarray:
    """A block's ``(rows, keys)`` scores in the lane's ``buffer``: C-ordered, or with
    ``keys_first`` the transpose of a C-ordered ``(keys, rows)`` array (the same elementwise
    steps and products read either; the BLAS multiplies ``(keys, 64) @ (64, rows)`` up to
    1.4x faster than ``(rows, 64) @ (64, keys)`` on some CPUs)."""
    if keys_first:
        return buffer[: rows * keys].reshape(keys, rows).T
    return buffer[: rows * keys].reshape(rows, keys)


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
    query: np.ndarray, key: np.ndarray, groups: int, softcap: float | None,
    limit: float = EXP_BOUND,
) -> np.ndarray:
    """``(..., heads)`` bool: every score of the head is within ``±limit`` (Cauchy-Schwarz:
    ``|q·k| <= |q| |k|``; a soft-capped score within ``±softcap``), so its softmax may skip the
    shift by the row max. False where a norm is NaN or infinite. ``query`` is scaled."""
    query_norm = np.sqrt(np.einsum("...d,...d->...", query, query).max(axis=-1, initial=0.0))
    key_norm = np.sqrt(np.einsum("...d,...d->...", key, key).max(axis=-1, initial=0.0))
    bound = query_norm * np.repeat(key_norm, groups, axis=-1) if query.ndim > 2 else \
        query_norm * key_norm  # (..., heads)
    if softcap is not None:
        bound = np.minimum(bound, softcap)  # NaN stays NaN: not bounded
    return bound <= limit
