"""The fast path of numpy_attn: the pipeline of ``functional.py``, blocked, on every core. This
file selects the path and is its entry; ``_fast/forward.py`` holds the blocked forward pass and
``_fast/backward.py`` the blocked VJP.

The explicit steps (``_steps.py``) and the public ``backward.py``'s VJP are the code to read:
each makes the whole ``(..., heads, q_len, kv_len)`` score array, and NumPy's elementwise
functions (``max``, ``exp``, ``sum``) run on one core while only the matrix products use every
core. For large inputs ``use_fast_path`` (the one selection rule, for the forward pass and the
VJP alike; its numbers are ``attention_rules.FAST_PATHS["numpy_attn"]``) selects ``"blocked"``:
no ``return_weights``, no dropout, no empty axis, and at least ``MIN_SCORES`` score entries with
``q_len >= MIN_Q_LEN``.

Forward, ``fast_attention``: the queries in blocks of ``BLOCK_Q`` rows against the keys each
block can see, ``(exp(s - max) @ value) / sum`` per block (``_fast/forward.py``). VJP,
``fast_attention_vjp``: FlashAttention-2's backward per tile, ``BLOCK_KV`` keys a task, from
the forward pass's row log-sum-exp (``_fast/backward.py``). Both equal the explicit steps within
float32 rounding, NaN and infinities included (``tests/test_performance_paths.py``,
``tests/test_fast_backward_numpy.py``). The block sizes and the exponential are passed to
them at each call: ``_fast/tuning.py``'s choice for the shape, measured on this machine the
first time and cached on disk, or with ``ATTENTION_TUNING=off`` the fixed table, the constants
below and ``forward.USE_EXP2`` read at each call (the tests switch tuning off and shrink them).

The tasks run in lanes on the one thread pool of ``_threads.py`` (``_threads.run_lanes``,
BLAS limited to one thread while they run; ``_tiles.py`` runs its tiles on it too): the same
bits from any thread, whatever else the process is doing (``spec.CONCURRENCY``).
"""

from __future__ import annotations

import numpy as np

import attention_rules as rules

from .._masking import NEG_INF, _Mods
from .._steps import _sinks_grad
from . import backward, forward, tuning

_BLOCKED = rules.FAST_PATHS["numpy_attn"]["blocked"]
BLOCK_Q = _BLOCKED["block_q"]  # query rows per block: a float32 block of scores stays in L2
BLOCK_KV = _BLOCKED["block_kv"]  # key rows per task of the VJP: dK and dV of a block are its own
BLOCK_Q_BACKWARD = _BLOCKED["block_q_backward"]  # queries per tile of the VJP (cache-sized)
MIN_SCORES = _BLOCKED["min_scores"]  # below this many score entries the plain path is as fast
MIN_Q_LEN = _BLOCKED["min_q_len"]  # few queries (decoding): one batched matmul is faster
KEYS_FIRST = _BLOCKED["keys_first"]  # the forward's scores as keys @ queriesᵀ
KEYS_FIRST_BACKWARD = _BLOCKED["keys_first_backward"]  # the VJP's tiles as keys @ queriesᵀ


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
    choice = _choice("forward", query, key, value, args)
    return _forward(query, key, value, mask, bias, args, sinks, mods, choice)


def _forward(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    args: rules.Arguments,
    sinks: np.ndarray | None,
    mods: _Mods | None,
    choice: tuning.Choice,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """``fast_attention`` with the blocks and exponential of ``choice``."""
    dtype = query.dtype
    query, key, value = _compute_arrays(query, key, value, args.scale)
    lse = np.empty(query.shape[:-1], query.dtype) if args.return_lse else None
    sinks = None if sinks is None else sinks.astype(query.dtype, copy=False)
    output = forward.blocked_attention(query, key, value, mask, bias, args, lse, sinks, mods,
                                       blocks=(choice.block_q, choice.block_kv),
                                       exp2=choice.exp2, keys_first=choice.keys_first)
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
    choice = _choice("backward", query, key, value, args,
                     _choice("forward", query, key, value, args))
    inputs = _vjp_inputs(query, key, value, grad_output, mask, bias, args, sinks, mods, choice)
    return _vjp_tiles(inputs, query, mask, bias, args, sinks, mods, choice)


def _vjp_inputs(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    grad_output: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    args: rules.Arguments,
    sinks: np.ndarray | None,
    mods: _Mods | None,
    choice: tuning.Choice,
) -> tuple[np.ndarray, ...]:
    """The VJP's forward pass and what its tiles read: ``(query_lse, key_ones, value_ones,
    grad_output_delta, grad_sinks)`` (see ``backward.blocked_attention_vjp``; ``grad_sinks``
    None without sinks)."""
    compute = rules.compute_dtype(query.dtype.name)
    head_dim, v_dim = query.shape[-1], value.shape[-1]
    # One column more than the inputs (see backward.blocked_attention_vjp): [Q · scale,
    # -lse], [K, 1], [V, 1] and [dO, -delta]; the forward pass reads the first columns only.
    query_lse = np.empty(query.shape[:-1] + (head_dim + 1,), compute)
    np.multiply(query, args.scale, out=query_lse[..., :head_dim], dtype=compute)  # (q is cheapest)
    key_ones, value_ones = _with_ones(key, compute), _with_ones(value, compute)
    lse = query_lse[..., head_dim]  # (..., heads, q_len), written by the forward pass
    compute_sinks = None if sinks is None else sinks.astype(compute, copy=False)
    output = forward.blocked_attention(query_lse[..., :head_dim], key_ones[..., :head_dim],
                                       value_ones[..., :v_dim], mask, bias, args, lse,
                                       compute_sinks, mods,
                                       blocks=(choice.block_q, choice.block_kv),
                                       exp2=choice.exp2, keys_first=choice.keys_first)
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
    return query_lse, key_ones, value_ones, grad_output_delta, grad_sinks


def _vjp_tiles(
    inputs: tuple[np.ndarray, ...],
    query: np.ndarray,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    args: rules.Arguments,
    sinks: np.ndarray | None,
    mods: _Mods | None,
    choice: tuning.Choice,
) -> tuple[np.ndarray | None, ...]:
    """The VJP's tiles on ``_vjp_inputs``' ``inputs``: the gradients, query's and key's and
    value's in the dtype of ``query``, ``bias``'s and ``sinks``' in theirs."""
    query_lse, key_ones, value_ones, grad_output_delta, grad_sinks = inputs
    grad_q, grad_k, grad_v, grad_bias = backward.blocked_attention_vjp(
        query_lse, key_ones, value_ones, grad_output_delta, mask, bias, args, mods,
        blocks=(choice.block_q, choice.block_kv, choice.block_q_backward), exp2=choice.exp2,
        keys_first=choice.keys_first_backward)
    dtype = query.dtype
    grads = (grad_q.astype(dtype, copy=False), grad_k.astype(dtype, copy=False),
             grad_v.astype(dtype, copy=False))
    grads += (None if grad_bias is None else
              grad_bias.reshape(bias.shape).astype(bias.dtype, copy=False),)
    return grads if sinks is None else grads + (grad_sinks.astype(sinks.dtype),)


def _fixed() -> tuning.Choice:
    """The fixed table: the constants above, ``forward.USE_EXP2`` and the products' orders of
    ``attention_rules.FAST_PATHS``, read at each call."""
    return tuning.Choice(BLOCK_Q, BLOCK_KV, BLOCK_Q_BACKWARD, bool(forward.USE_EXP2),
                         bool(KEYS_FIRST), bool(KEYS_FIRST_BACKWARD))


def _choice(kind: str, query: np.ndarray, key: np.ndarray, value: np.ndarray,
            args: rules.Arguments, base: tuning.Choice | None = None) -> tuning.Choice:
    """The choice for step ``kind`` (``tuning.choose``) on query ``(..., heads, q_len,
    head_dim)``, key and value ``(..., kv_heads, kv_len, head_dim | v_dim)``; a causal or
    windowed call (``args``) is never measured: tuned, it takes ``base``, the fixed table (see
    ``tuning``: its candidates measured within noise of it, and a trial cannot rank them)."""
    compute = rules.compute_dtype(query.dtype.name)
    return tuning.choose(kind, query.shape, key.shape, value.shape, compute,
                         _fixed() if base is None else base, _trial,
                         measure=not args.is_causal and args.window is None)


def _trial(kind: str, choice: tuning.Choice, query: np.ndarray, key: np.ndarray,
           value: np.ndarray, grad_output: np.ndarray, shared: dict | None = None) -> object:
    """One call of the fast path with ``choice`` for the tuner, full attention: the forward
    pass (``kind == "forward"``) or the VJP's tiles, on query ``(1, heads, q_len, head_dim)``,
    key and value ``(1, heads, kv_len, head_dim | v_dim)`` and grad_output ``(1, heads, q_len,
    v_dim)``. The VJP's forward pass, the same for every candidate of a measurement (its
    entries are the forward's choice), runs once per ``shared`` (one dict per measurement) and
    is not part of what the tuner times."""
    shared = {} if shared is None else shared
    args = rules.Arguments(
        dtype=query.dtype.name, scores_shape=query.shape[:-1] + key.shape[-2:-1],
        output_shape=query.shape[:-1] + value.shape[-1:], is_causal=False,
        causal_alignment="top_left", window=None,
        scale=query.shape[-1] ** -0.5, softcap=None, dropout_p=0.0, return_weights=False,
        block_q=None, block_kv=None)
    if kind == "forward":
        return _forward(query, key, value, None, None, args, None, None, choice)
    if "inputs" not in shared:  # the candidates of a VJP measurement differ in tiles only
        shared["inputs"] = _vjp_inputs(query, key, value, grad_output, None, None, args, None,
                                       None, choice)
    return _vjp_tiles(shared["inputs"], query, None, None, args, None, None, choice)


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
