"""The fast paths of jax_attn: cuDNN's flash attention on a GPU, the blocked steps on the CPU.

``use_fast_path`` is the one selection rule (its numbers are
``attention_rules.FAST_PATHS["jax_attn"]``); ``fast_attention`` runs the path it chose. The
package: this file selects and runs a path; the blocked path's forward pass is ``forward.py``,
its backward pass ``backward.py``, and the slicing both share ``slicing.py`` (imports run
``slicing < forward < backward < __init__``, above ``_arrays < _masking < _steps < _tiles``).

The platform is the one of the devices the query lives on (a concrete ``jax.Array``), or
``jax.default_backend()`` for a tracer under ``jit`` (it has no concrete device).

``"cudnn"``: without ``return_weights``, ``jax.nn.dot_product_attention(...,
implementation="cudnn")`` (flash attention) when on a GPU, float16/bfloat16 inputs,
``v_dim == head_dim``, no ``mask``, no ``bias``, no ``softcap``, no dropout, no empty axis, and a
causal rule or window only with ``q_len == kv_len`` (so both alignments agree) and a window
only as ``(left, 0)`` or with ``is_causal`` (what cuDNN supports). Under those conditions no row
can be fully masked, so jax.nn's semantics (which give ``mean(value)`` for a fully masked row)
equal the spec's. If cuDNN refuses the shapes at trace time, ``fast_attention`` returns None and
the explicit steps run. NaN and infinities: a NaN in a query row or in an attended key gives a
NaN row there too, but what cuDNN's kernel does with a non-finite key at a causally masked
position, or with a row whose allowed scores are all ``-inf``, is not checked by this project
(no GPU in its CI): inputs that may hold NaN or infinities should be given in float32, or with
``return_weights=True``, which take the explicit steps (the spec's IEEE rule, tested).

``"blocked"`` (CPU): for large inputs (no ``return_weights``, no dropout, at least
``MIN_Q_LEN`` queries and ``MIN_SCORES`` score entries), the same steps for ``BLOCK_Q`` queries
at a time under ``lax.map`` (``forward.py``: a block's scores stay in cache; fully masked work
is skipped), whose backward pass is its own (``backward.py``): ``_blocked_attention_lse``
below is the ``jax.custom_vjp`` that joins them. It supports everything else (mask, bias,
softcap, grouped-query heads, both alignments, 2-D inputs, chunks, ALiBi, segment ids and the
mods; with ``sinks`` or ``return_lse``, ``_blocked_attention_lse`` joins the sinks to each
row's denominator after the blocks and returns the row log-sum-exp they compute anyway, and
its VJP gives the sinks' gradient; cuDNN is never taken then), ``jit``, ``vmap`` and
``grad``, and equals the explicit steps within float32 rounding, NaN and infinities included
(``tests/test_performance_paths.py``). Its block sizes are the constants below, passed to
``forward.py`` and ``backward.py`` at each call (the tests shrink them). A ``mask_mod``
whose values, known at trace time, are exactly the top-left causal triangle (and no other
rule but ``is_causal``) runs as ``is_causal=True`` (``_causal_mask_mod``).

Neither path runs when ``score_mod`` captures a tracer (``_masking.
_mods_capture_tracers``: a closure cell, a default, an attribute of a callable object): the
``custom_vjp`` cannot close over a traced array, nor give it a gradient, so the explicit steps
run, differentiated by plain autodiff (``spec.SCORE_MOD``). Under ``jit`` every array is a
tracer, so a mod capturing any array passed into the jitted function takes the steps.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules

from .. import _masking, _steps
from .._steps import NEG_INF
from . import backward, forward

_CUDNN = rules.FAST_PATHS["jax_attn"]["cudnn"]
_BLOCKED = rules.FAST_PATHS["jax_attn"]["blocked"]
CUDNN_PLATFORMS = _CUDNN["platforms"]  # tests patch these two to run the path on the CPU
CUDNN_IMPLEMENTATION: str | None = "cudnn"
CUDNN_DTYPES = _CUDNN["dtypes"]  # cuDNN's flash attention is half-only
BLOCKED_PLATFORMS = _BLOCKED["platforms"]
BLOCK_Q = _BLOCKED["block_q"]  # query rows per lax.map step: the block's scores stay in cache
SEGMENTS = _BLOCKED["segments"]  # causal rule / window: static key ranges (more: slower compile)
BLOCK_KV = _BLOCKED["block_kv"]  # keys per lax.scan step of the VJP, against all their queries
BLOCK_SCORES = _BLOCKED["block_scores"]  # a forward block grows to 2x, 4x BLOCK_Q rows within it
MIN_SCORES = _BLOCKED["min_scores"]  # below this many score entries the steps are as fast
MIN_Q_LEN = _BLOCKED["min_q_len"]  # at least BLOCK_Q: a lax.map of whole blocks
# With chunks, segment ids or mask_mod: at most this many static segments (each a lax.map of
# its own: more compile, fewer products of tiles those rules empty)
MOD_SEGMENTS = 16
MOD_CHECK_ENTRIES = 1 << 22  # _causal_mask_mod: positions of the mod evaluated at once
_FN = "scaled_dot_product_attention"  # the name in messages raised inside the custom VJP


def use_fast_path(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    args: rules.Arguments,
    backend: str | None = None,
) -> str | None:
    """The fast path for these validated inputs (``"cudnn"``, ``"blocked"``), or None for the
    steps. Static information only (shapes, dtypes, options, platforms); ``backend`` defaults
    to the platform(s) of the query's devices (``_platforms``).

    Args:
      query: ``(..., heads, q_len, head_dim)``; key: ``(..., kv_heads, kv_len, head_dim)``;
        value: ``(..., kv_heads, kv_len, v_dim)`` (arrays, tracers or ``ShapeDtypeStruct``).
      mask, bias: None or broadcastable to ``(..., heads, q_len, kv_len)``.
      args: the normalised options (``rules.attention_arguments``).
      backend: a platform name (``"cpu"``, ``"gpu"``) instead of the query's.
    """
    if args.return_weights or args.dropout_p > 0.0:
        return None  # neither path returns the weights or takes a keep-mask
    if _masking._mods_capture_tracers(args):
        return None  # a captured tracer's gradient: plain autodiff through the steps
    platforms = _platforms(query) if backend is None else {backend}
    lse_or_sinks = args.return_lse or args.has_sinks  # jax.nn here has neither: blocked only
    if platforms <= set(CUDNN_PLATFORMS) and not lse_or_sinks and _cudnn_fits(
        query, key, value, mask, bias, args
    ):
        return "cudnn"
    if platforms <= set(BLOCKED_PLATFORMS) and rules.large_enough(
        query.shape, key.shape, value.shape, MIN_SCORES, MIN_Q_LEN
    ):
        return "blocked"
    return None


def _platforms(x: Any) -> set[str]:
    """The platforms (``"cpu"``, ``"gpu"``, ...) of the devices a concrete ``jax.Array`` lives
    on; ``{jax.default_backend()}`` for anything else: a tracer under ``jit`` has no concrete
    device (jit places the computation on the default backend), nor has a ``ShapeDtypeStruct``."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return {device.platform for device in x.devices()}
    return {jax.default_backend()}


def fast_attention(
    path: str,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    args: rules.Arguments,
    sinks: jax.Array | None = None,
    mods: _masking._Mods | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array] | None:
    """``scaled_dot_product_attention``'s output on the path ``use_fast_path`` chose; None when
    cuDNN refuses the shapes (then the explicit steps run). With ``args.return_lse`` also the
    row log-sum-exp ``(..., heads, q_len)`` the blocks computed anyway (compute dtype); the
    ``(heads,)`` ``sinks`` join each row's denominator once, after the blocks
    (``_blocked_attention_lse``); ``mods`` (chunks, ALiBi, segment ids, the mods) apply per
    block, and the blocks they mask entirely are not computed (``_masking._mods_segments``)."""
    if path == "cudnn":
        try:  # cuDNN checks its shapes at trace time
            output = _cudnn_attention(
                query, key, value, args.scale, args.is_causal, args.window, CUDNN_IMPLEMENTATION
            )
        except (ValueError, NotImplementedError, RuntimeError):
            return None
        return output.astype(query.dtype)
    mod_arrays = None
    if mods is not None:  # what a mod returns is checked here, with the caller's name
        _check_mods(mods, query, key)
        mod_arrays = mods.arrays
        if _causal_mask_mod(mods, args, query.shape[-2], key.shape[-2]):  # is_causal's path
            args = args._replace(is_causal=True, causal_alignment="top_left", mask_mod=None)
            mod_arrays = None
    output, lse = _blocked_attention_lse(args, query, key, value, mask, bias, sinks, mod_arrays)
    output = output.astype(query.dtype)
    return (output, lse[..., 0]) if args.return_lse else output


# ------------------------------------------------------------------------------------------
# cuDNN: jax.nn.dot_product_attention where its semantics equal the spec's (GPU only)
# ------------------------------------------------------------------------------------------


def _cudnn_fits(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    args: rules.Arguments,
) -> bool:
    """Whether ``jax.nn.dot_product_attention`` computes exactly the spec's result here."""
    if query.dtype.name not in CUDNN_DTYPES:
        return False  # float32/64: cuDNN's flash attention is half-only
    if mask is not None or bias is not None or args.softcap is not None or args.has_mods:
        return False  # a mask or bias could empty a row; jax.nn has no softcap, no mods
    if value.shape[-1] != query.shape[-1] or rules.has_empty_axis(query.shape, key.shape):
        return False  # jax.nn needs v_dim == head_dim; empty axes are not worth a kernel
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if (args.is_causal or args.window is not None) and q_len != kv_len:
        return False  # alignment: cuDNN's causal mask is top-left only
    if args.window is not None and not args.is_causal and args.window[1] != 0:
        return False  # cuDNN windows look left only: (left, 0), or any window with is_causal
    return True


def _cudnn_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    scale: float,
    is_causal: bool,
    window: tuple[int | None, int | None] | None,
    implementation: str | None,
) -> jax.Array:
    """``jax.nn.dot_product_attention`` in this project's layout, ``(..., heads, seq, dim)``."""

    def to_btnh(x: jax.Array) -> jax.Array:  # (..., heads, seq, dim) → (batch, seq, heads, dim)
        x = x.reshape((-1,) + x.shape[-3:]) if x.ndim >= 3 else x[None, None]
        return jnp.swapaxes(x, 1, 2)

    local_window_size = None
    if window is not None:  # eligible windows are (left, 0) or causal: causal plus a left bound
        is_causal = True
        local_window_size = None if window[0] is None else (window[0], 0)
    output = jax.nn.dot_product_attention(
        to_btnh(query), to_btnh(key), to_btnh(value), scale=scale, is_causal=is_causal,
        local_window_size=local_window_size, implementation=implementation,
    )  # (batch, q_len, heads, v_dim)
    return jnp.swapaxes(output, 1, 2).reshape(query.shape[:-1] + (value.shape[-1],))


# ------------------------------------------------------------------------------------------
# Blocked: the custom VJP of forward.py's forward pass and backward.py's backward pass
# ------------------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocked_attention_lse(
    args: rules.Arguments,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    sinks: jax.Array | None,
    mod_arrays: tuple | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The output ``(..., heads, q_len, v_dim)`` in the compute dtype (``forward.py``;
    jax: a ``custom_vjp``, as autodiff through ``lax.map`` would store every block's weights,
    the whole ``(q_len, kv_len)`` matrix), with the ``(heads,)`` ``sinks`` (or None) joined to
    each row's denominator after the blocks (``_steps._with_sinks``), and the row log-sum-exp
    ``(..., heads, q_len, 1)`` the blocks compute anyway (``-inf``: no key nor sink); both
    differentiable. The VJP takes the lse's cotangent (``dS = P ⊙ (dP - rowsum(dO ⊙ O) +
    dlse)`` with ``P`` and ``O`` those of the rows with their sinks) and gives the sinks'
    gradient (``_steps._sinks_grad``), as numpy_attn's blocked VJP does. ``mod_arrays``: the
    ``_masking._Mods.arrays`` of the call (its ALiBi slopes and segment ids: no cotangent), or
    None."""
    return _blocked_attention_lse_fwd(args, query, key, value, mask, bias, sinks, mod_arrays)[0]


def _blocked_attention_lse_fwd(
    args: rules.Arguments,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    sinks: jax.Array | None,
    mod_arrays: tuple | None = None,
) -> tuple[tuple[jax.Array, jax.Array], tuple]:
    """The output and lse, and what the backward pass needs."""
    mods = _rebuilt(args, query, key, mod_arrays)
    output, lse = forward.blocked_forward(query, key, value, mask, bias, args, with_lse=True,
                                           mods=mods, blocks=_blocks())
    output, lse = _steps._with_sinks(output, lse, sinks)
    return (output, lse), (query, key, value, mask, bias, sinks, mod_arrays, output, lse)


def _blocked_attention_lse_bwd(args: rules.Arguments, residuals: tuple,
                               cotangents: tuple[jax.Array, jax.Array]) -> tuple:
    query, key, value, mask, bias, sinks, mod_arrays, output, lse = residuals
    grad_output, grad_lse = cotangents
    lse = jnp.where(lse == NEG_INF, jnp.inf, lse)  # no key nor sink: exp(s - lse) = 0
    grad_q, grad_k, grad_v, grad_bias = backward.blocked_attention_vjp(
        query, key, value, grad_output, mask, bias, args, output, lse, grad_lse,
        _rebuilt(args, query, key, mod_arrays), blocks=_blocks())
    grad_sinks = None
    if sinks is not None:  # d sink = sum exp(sink - lse) · (dlse - rowsum(dO ⊙ O))
        delta = (grad_output.astype(output.dtype) * output).sum(axis=-1, keepdims=True)
        grad_sinks = _steps._sinks_grad(sinks, lse, delta - grad_lse).astype(sinks.dtype)
    # mask: boolean; the slopes and ids of mod_arrays: constants and ints: no cotangent
    return grad_q, grad_k, grad_v, None, grad_bias, grad_sinks, None


_blocked_attention_lse.defvjp(_blocked_attention_lse_fwd, _blocked_attention_lse_bwd)


def _rebuilt(args: rules.Arguments, query: jax.Array, key: jax.Array, mod_arrays: tuple | None
             ) -> _masking._Mods | None:
    """The call's ``_masking._Mods`` rebuilt inside the custom VJP from its arrays (the callables
    and the chunk size are in ``args``)."""
    if mod_arrays is None:
        return None
    alibi, q_ids, kv_ids = mod_arrays
    return _masking._mods(_FN, args, query.shape, key.shape, alibi,
                         None if q_ids is None else (q_ids, kv_ids))


def _check_mods(mods: _masking._Mods, query: jax.Array, key: jax.Array) -> None:
    """What the mods return, on one block's shapes, before the custom VJP (whose messages
    would name ``_FN``): ``jax.eval_shape``, so nothing is computed."""
    rows, keys = min(BLOCK_Q, query.shape[-2]), key.shape[-2]
    scores = jax.ShapeDtypeStruct(query.shape[:-1] + (keys,), rules.compute_dtype(
        query.dtype.name))
    if mods.score_mod is not None:
        jax.eval_shape(lambda s: _masking._mods_scores(s[..., :rows, :], mods, 0, 0), scores)
    if mods.mask_mod is not None:
        jax.eval_shape(lambda: _masking._mods_allowed(mods, 0, rows, 0, keys))


def _causal_mask_mod(mods: _masking._Mods, args: rules.Arguments, q_len: int, kv_len: int
                     ) -> bool:
    """jax only: whether the call's one rule beyond the causal rule is a ``mask_mod`` whose
    values, known at trace time, are exactly the top-left causal triangle (row ``i`` sees the
    keys ``j <= i``, in every batch entry and head; with ``is_causal`` top-left, a superset of
    it). Then the call runs as ``is_causal=True`` without the mod: the causal path
    (``slicing._triangle``) skips the same tiles, in fewer, larger products than the mod's
    static segments (issue 24: a causal ``mask_mod`` at most 1.15× ``is_causal``). Evaluated
    ``MOD_CHECK_ENTRIES`` entries at a time, from the first rows (a mod that is not causal is
    mostly told at its first rows)."""
    if mods.mask_mod is None or mods.chunk_size is not None or mods.q_ids is not None or \
            mods.alibi is not None or mods.score_mod is not None or args.window is not None or \
            (args.is_causal and rules.causal_offset(args.causal_alignment, q_len, kv_len)):
        return False
    step = max(1, MOD_CHECK_ENTRIES // max(kv_len, 1))
    for q0 in range(0, q_len, step):
        rows = min(step, q_len - q0)
        with jax.ensure_compile_time_eval():
            allowed = _masking._mods_allowed(mods, q0, rows, 0, kv_len, ("mask_mod",))
        if isinstance(allowed, jax.core.Tracer):
            return False  # traced: unknown at trace time
        triangle = (q0 + np.arange(rows))[:, None] >= np.arange(kv_len)  # (rows, kv_len)
        allowed = np.broadcast_to(np.asarray(allowed), np.shape(allowed)[:-2] + triangle.shape)
        if not ((allowed | ~triangle) if args.is_causal else allowed == triangle).all():
            return False
    return True


def _blocks() -> tuple[int, int, int, int, int]:
    """``(BLOCK_Q, BLOCK_KV, SEGMENTS, MOD_SEGMENTS, BLOCK_SCORES)`` as they are now (read at
    each call, so a test that shrinks them shrinks the blocks of ``forward.py`` and
    ``backward.py``)."""
    return BLOCK_Q, BLOCK_KV, SEGMENTS, MOD_SEGMENTS, BLOCK_SCORES
