"""The blocked fast path of torch_attn, forward: ``fast_attention``'s ``"blocked"`` path,
``blockwise.BlockwiseFunction`` over the tiles of ``(BLOCK_Q, BLOCK_KV)`` (``_fast.py`` selects
the path, says why, and passes its block sizes, ``blocks``, at each call). Its backward pass is
the Function's own (``_tiles.backward_tiles``): ``_blocked_vjp.py`` has nothing to add.
"""

from __future__ import annotations

import torch

import attention_rules as rules

from ._core import _Mods
from ._extras import _plan_with_mods, _with_sinks
from .blockwise import BlockwiseFunction

# ------------------------------------------------------------------------------------------
# The blocked forward pass
# ------------------------------------------------------------------------------------------


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
    """The pipeline in tiles (``blockwise.BlockwiseFunction``), in the input dtype; autograd
    sees one node whose backward recomputes the tiles, and the ``(heads,)`` ``sinks`` joined
    after it; with ``args.return_lse`` also the lse ``(..., heads, q_len)`` (compute dtype).
    ``mods``: per tile, the tiles they mask entirely left out. ``blocks``: ``(BLOCK_Q,
    BLOCK_KV)``, ``_fast.py``'s."""
    BLOCK_Q, BLOCK_KV = blocks  # _fast.py's, read at each call
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
