"""The fast paths of torch_attn: torch's fused ``scaled_dot_product_attention`` (SDPA,
``sdpa.py``), and the tiles of ``_tiles.py`` for what SDPA cannot skip.

``use_fast_path`` is the one selection rule (its numbers are
``attention_rules.FAST_PATHS["torch_attn"]``; ``"sdpa"`` has none: SDPA is as fast as the
explicit steps at every size). The explicit steps of ``functional.py`` run instead when no fast
path can follow the spec:

* ``return_weights=True``: neither returns the weights;
* ``dropout_p > 0``: SDPA draws its own keep-mask, not one from ``rng``/``dropout_mask``;
* ``softcap`` on small inputs: SDPA has no soft-capping (it would have to come before the bias);
* an empty axis (``q_len``, ``kv_len``, ``head_dim``, ``v_dim`` or a batch axis of size 0);
* ``sinks`` or ``return_lse`` on small inputs: SDPA has neither (large inputs take the tiles,
  ``"blocked"``, which keep the lse anyway; the sinks join each row's denominator after them);
* a NaN or an infinity in ``query`` or ``key`` (one sum over each, ``_finite``): SDPA adds
  the mask to the scores instead of replacing them, so a NaN or infinite key at a masked
  position spreads NaN to rows that do not attend it (``NaN + -inf = NaN``), and a row whose
  allowed scores are all ``-inf`` gives NaN, not 0 (torch 2.13, CPU). The spec's IEEE rule
  (``spec.NON_FINITE``) is what the explicit steps compute;
* a ``score_mod`` that captures a tensor requiring grad, under grad mode
  (``_masking._mods_capture_grads``): the tiles' ``BlockwiseFunction`` returns gradients for
  its inputs only, so the captured tensor would get none; the steps give it its gradient
  (``spec.SCORE_MOD``), holding ``(..., heads, q_len, kv_len)`` scores for autograd.

``"blocked"``: a soft-cap, a window, or the causal rule bottom-right with ``q_len != kv_len``
(SDPA's ``is_causal`` is top-left) are beyond SDPA's own options. ``_tiles.BlockwiseFunction``
(``blocked_attention``) computes them in ``(BLOCK_Q, BLOCK_KV)`` tiles with the online softmax,
never computes a tile that the causal rule or the window mask entirely, and recomputes each tile
in its backward pass from the saved log-sum-exp, so neither pass holds more than a few tiles.
The boolean mask and the bias are sliced per tile (a masked score is replaced by ``-inf``, as in
the steps). It runs from ``MIN_SCORES`` score entries and ``MIN_Q_LEN`` queries:

* with a soft-cap always: the explicit steps keep several ``(..., heads, q_len, kv_len)``
  arrays for autograd (forward + backward at 4,096 tokens, 8 heads: 2.1 GiB of extra memory
  against 0.1 GiB for the tiles; times in ``benchmarks/torch_beyond_sdpa.py``);
* for a window or bottom-right alone only when the tiles to compute are at most
  ``MAX_TILE_FRACTION`` of the score matrix: SDPA (given the band as a boolean mask, or
  bottom-right alone as ``sdpa.py`` says) computes every entry but about three times as fast
  per entry as the tiles (no score matrix either).

``"sdpa_blocks"``: chunks, ALiBi, segment ids or ``mask_mod`` (``spec.MASKS_AND_MODS``) without
``score_mod``, from ``MIN_SCORES`` and ``MIN_Q_LEN``: SDPA per run of query rows that see the
same keys, against only those keys (``sdpa.py``, which says how; the runs and their parts of
keys: ``blocks.py``). With ``score_mod`` (or a soft-cap) the tiles of ``"blocked"`` run
instead, without the tiles the rules empty, ``score_mod`` differentiated per tile by autograd.

Everything else takes SDPA whole, ``"sdpa"`` (``sdpa.py``: one call with one mask).

Gradients: autograd, nothing written by hand: the blocked path is ``BlockwiseFunction``, a
``torch.autograd.Function`` whose backward recomputes each tile from the saved log-sum-exp
(``_tiles.backward_tiles``), and SDPA, whole or per block, has torch's own backward. So
torch_attn needs no ``fast_attention_vjp`` (the function numpy_attn writes by hand) and no
``blocked_attention_vjp``.
"""

from __future__ import annotations

import torch

import attention_rules as rules

from .._masking import _Mods, _mods_capture_grads, _plan_with_mods
from .._steps import _with_sinks
from .._tiles import BlockwiseFunction
from .sdpa import _sdpa_attention, _sdpa_blocks

_BLOCKED = rules.FAST_PATHS["torch_attn"]["blocked"]
MIN_SCORES = _BLOCKED["min_scores"]  # below this many score entries SDPA / the steps are as fast
MIN_Q_LEN = _BLOCKED["min_q_len"]  # few queries (decoding): SDPA with a small mask is faster
BLOCK_Q = _BLOCKED["block_q"]  # query rows per tile
BLOCK_KV = 512  # keys per tile; 256 × 512 beat 512 × 1024 and 128 × 512 (2,048 tokens, fwd+bwd)
MAX_TILE_FRACTION = _BLOCKED["max_tile_fraction"]  # window / bottom-right: tiles vs SDPA + mask


# ------------------------------------------------------------------------------------------
# The selection rule
# ------------------------------------------------------------------------------------------


def use_fast_path(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    args: rules.Arguments,
) -> str | None:
    """The fast path for these validated inputs (``"sdpa"``, ``"blocked"``), or None for the
    steps."""
    if args.return_weights or args.dropout_p > 0.0:
        return None  # no fast path returns the weights; SDPA draws its own keep-mask
    shapes = tuple(query.shape), tuple(key.shape), tuple(value.shape)
    if rules.has_empty_axis(*shapes):
        return None  # empty axes are not worth a kernel
    if not _finite(query, key):
        return None  # NaN/inf: SDPA adds the mask instead of replacing masked scores
    if _mods_capture_grads(args):
        return None  # a captured tensor's gradient: plain autograd through the steps
    if args.has_sinks or args.return_lse:  # SDPA has neither: the tiles, or the steps
        return "blocked" if rules.large_enough(*shapes, MIN_SCORES, MIN_Q_LEN) else None
    if args.has_mods:  # large inputs: SDPA by blocks of queries, or the tiles for score_mod
        if not rules.large_enough(*shapes, MIN_SCORES, MIN_Q_LEN):
            return None
        return "blocked" if args.score_mod is not None or args.softcap is not None or \
            args.scale <= 0.0 else "sdpa_blocks"
    if _beyond_sdpa(query.shape[-2], key.shape[-2], args) and rules.large_enough(
        *shapes, MIN_SCORES, MIN_Q_LEN
    ) and _tiles_pay(query.shape[-2], key.shape[-2], args):
        return "blocked"
    if args.softcap is not None:
        return None  # SDPA has no softcap
    if args.scale <= 0.0:  # -0.0 too: SDPA scales the masked -inf (0·-inf = NaN, -c·-inf = +inf)
        return None
    return "sdpa"


def _tiles_pay(q_len: int, kv_len: int, args: rules.Arguments) -> bool:
    """Whether the tiles beat the alternative: always with a soft-cap (the explicit steps),
    else (SDPA with the band as a mask) when they compute at most ``MAX_TILE_FRACTION`` of it."""
    if args.softcap is not None:
        return True
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
    plan = rules.plan(q_len, kv_len, BLOCK_Q, BLOCK_KV, lo, hi)
    computed = sum((q1 - q0) * (k1 - k0) for q0, q1, blocks in plan for k0, k1, _ in blocks)
    return computed <= MAX_TILE_FRACTION * q_len * kv_len


def _beyond_sdpa(q_len: int, kv_len: int, args: rules.Arguments) -> bool:
    """A soft-cap, a window, or a causal rule that SDPA's top-left ``is_causal`` is not."""
    offset = rules.causal_offset(args.causal_alignment, q_len, kv_len)
    return args.softcap is not None or args.window is not None or (args.is_causal and offset != 0)


def _finite(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether query and key hold no NaN and no infinity: one sum each, no temporary (40 times
    faster than ``isfinite(x).all()``). NaN and ±inf always reach a sum (``inf - inf = NaN``);
    a sum that overflows on huge finite values only sends the call to the explicit steps.

    On a GPU, ``bool`` waits for the device (one synchronisation per call). Repairing SDPA's
    output afterwards with tensor operations instead is not possible at the cost of a sum:
    whether a non-finite key's score for query ``i`` is NaN, ``+inf`` or ``-inf`` (row NaN, row
    NaN, or key ignored) depends on the pair, so the repair needs every such key against every
    query, and how many keys that is the host does not know without the same wait."""
    accumulate = torch.float64 if query.dtype == torch.float64 else torch.float32
    # detached: a check, not part of the graph autograd records
    total = query.detach().sum(dtype=accumulate) + key.detach().sum(dtype=accumulate)
    return bool(torch.isfinite(total))


# ------------------------------------------------------------------------------------------
# The entry, and the blocked path: the tiles as one autograd node
# ------------------------------------------------------------------------------------------


def fast_attention(
    path: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    args: rules.Arguments,
    sinks: torch.Tensor | None = None,
    mods: _Mods | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``scaled_dot_product_attention``'s output on the path ``use_fast_path`` chose (and with
    ``args.return_lse`` the row log-sum-exp: the tiles only, as with ``sinks``); ``mods``
    (chunks, ALiBi, segment ids, the mods) on ``"blocked"`` and ``"sdpa_blocks"``."""
    if path == "blocked":
        return blocked_attention(query, key, value, mask, bias, args, sinks, mods,
                                 blocks=(BLOCK_Q, BLOCK_KV))
    if path == "sdpa_blocks":
        return _sdpa_blocks(query, key, value, mask, bias, args, mods)
    return _sdpa_attention(
        query, key, value, mask, bias, args.is_causal, args.causal_alignment, args.window,
        args.scale,
    )


def blocked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    args: rules.Arguments,
    sinks: torch.Tensor | None = None,
    mods: _Mods | None = None,
    *,
    blocks: tuple[int, int],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The pipeline in tiles (``_tiles.BlockwiseFunction``), in the input dtype; autograd
    sees one node whose backward recomputes the tiles, and the ``(heads,)`` ``sinks`` joined
    after it; with ``args.return_lse`` also the lse ``(..., heads, q_len)`` (compute dtype).
    ``mods``: per tile, the tiles they mask entirely left out. ``blocks``: ``(BLOCK_Q,
    BLOCK_KV)``, as ``fast_attention`` reads them at each call."""
    BLOCK_Q, BLOCK_KV = blocks  # fast_attention's, read at each call
    q_len, kv_len = query.shape[-2], key.shape[-2]
    rank = len(args.scores_shape)  # mask and bias full rank, so tiles slice the last two axes
    if mask is not None:
        mask = mask.reshape((1,) * (rank - mask.ndim) + tuple(mask.shape))
    if bias is not None:
        bias = bias.reshape((1,) * (rank - bias.ndim) + tuple(bias.shape))
    lo, hi = rules.band(q_len, kv_len, args.is_causal, args.causal_alignment, args.window)
    plan = rules.plan(q_len, kv_len, BLOCK_Q, BLOCK_KV, lo, hi)  # masked tiles left out
    plan = _plan_with_mods(plan, mods, q_len, kv_len, BLOCK_Q, BLOCK_KV, lo, hi)
    config = (plan, lo, hi, args.scale, args.softcap)
    output, lse = _with_sinks(
        *BlockwiseFunction.apply(query, key, value, bias, mask, None, config, mods), sinks)
    output = output.to(query.dtype)
    return (output, lse[..., 0]) if args.return_lse else output
