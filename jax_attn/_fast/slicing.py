"""The blocked fast path's slicing, shared by its forward (``forward.py``) and backward
(``backward.py``) passes: the pieces and halves of the causal triangle, the (batch, kv head)
items and their grown blocks, the rows and columns of a mask or bias, and the blocks that
``lax.map`` and ``lax.scan`` walk. Shapes only: the steps themselves are ``_steps.py``'s and
the mods ``_masking.py``'s.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

import attention_rules as rules


def _triangle(q_len: int, kv_len: int, args: rules.Arguments, block_q: int
              ) -> tuple[int, int, int, int, int]:
    """The pieces of the causal rule (``forward._causal_forward``): the diagonal
    triangle's first row ``i0``, first key ``c0`` and side ``n``, how many times it is halved
    (``depth``: leaves of at most ``block_q`` rows) and its side padded to ``leaf · 2^depth``."""
    offset = int(rules.band(q_len, kv_len, True, args.causal_alignment, None)[1])
    i0, c0 = max(0, -offset), max(0, offset)
    n = min(q_len - i0, kv_len - c0)
    depth = max(0, math.ceil(math.log2(n / block_q)))
    return i0, c0, n, depth, -(-n // 2**depth) * 2**depth


def _halves(x: jax.Array, parts: int, size: int, lower: bool | None) -> jax.Array:
    """``(..., side, d)`` cut into ``parts`` chunks (each two halves of ``size`` rows when
    ``lower`` is not None: the lower or the upper one) → ``(parts, ..., size, d)``."""
    if lower is None:
        x = x.reshape(x.shape[:-2] + (parts, size, x.shape[-1]))
    else:
        x = x.reshape(x.shape[:-2] + (parts, 2, size, x.shape[-1]))[..., int(lower), :, :]
    return jnp.moveaxis(x, -3, 0)


def _unhalves(x: jax.Array, halves: bool, fill: float, lower: bool = True) -> jax.Array:
    """Undo ``_halves``: ``(parts, ..., size, d)`` → ``(..., side, d)``; with ``halves`` the
    other half of each chunk (the upper one for ``lower``) filled with ``fill`` (what adds
    nothing)."""
    x = jnp.moveaxis(x, 0, -3)  # (..., parts, size, d)
    if halves:
        other = jnp.full_like(x, fill)
        x = jnp.stack([other, x] if lower else [x, other], axis=-3)  # (..., parts, 2, size, d)
    return x.reshape(x.shape[:-4 if halves else -3] + (-1, x.shape[-1]))


def _pad_rows(x: jax.Array, size: int) -> jax.Array:
    """Zero rows appended up to ``size`` rows."""
    pad = [(0, 0)] * (x.ndim - 2) + [(0, size - x.shape[-2]), (0, 0)]
    return jnp.pad(x, pad) if size > x.shape[-2] else x


def _items(query: jax.Array, key: jax.Array, mask: jax.Array | None,
           bias: jax.Array | None) -> int:
    """How many (batch, kv head) items the blocked path takes one at a time: the product of
    the key's leading axes; 1 (all heads at once) for 2-D inputs, or when the mask or the bias
    varies along a batch or head axis (each item would need its own slice of it)."""
    if query.ndim < 3 or any(x is not None and math.prod(x.shape[:-2]) != 1 for x in (mask, bias)):
        return 1
    return math.prod(key.shape[:-2])


def _grown(blocks: tuple[int, int, int, int, int], heads: int, kv_len: int
           ) -> tuple[int, int, int, int, int]:
    """``blocks`` with ``BLOCK_Q`` doubled, at most twice, while a block's scores (``heads`` ×
    rows × ``kv_len`` entries, ``heads`` the leading axes of one block) stay within
    ``BLOCK_SCORES`` (``blocks[4]``). One head of 2,048 keys takes 256 rows, of 4,096 keys
    128: larger products for XLA's threads, scores that stay in the cache
    (``benchmarks/RESULTS.md``)."""
    rows = blocks[0]
    for _ in range(2):
        if heads * 2 * rows * kv_len > blocks[4]:
            break
        rows *= 2
    return (rows,) + tuple(blocks[1:])


def _item_blocks(query: jax.Array, key: jax.Array, mask: jax.Array | None,
                 bias: jax.Array | None, args: rules.Arguments,
                 blocks: tuple[int, int, int, int, int]
                 ) -> tuple[int, tuple[int, int, int, int, int]]:
    """The blocked path's items (``_items``) and its ``blocks``, ``BLOCK_Q`` grown for the heads
    of one block (an item's query heads, or every leading axis when there is one item) — the
    same for the forward pass and the VJP, so the mods' tiles agree. A window keeps
    ``BLOCK_Q`` rows: its segments are cut along the blocks."""
    items = _items(query, key, mask, bias)
    if args.window is not None:
        return items, blocks
    heads = query.shape[-3] // key.shape[-3] if items > 1 else math.prod(query.shape[:-2])
    return items, _grown(blocks, heads, key.shape[-2])


def _to_items(x: jax.Array, items: int) -> jax.Array:
    """``(..., kv_heads · groups, T, d)`` → ``(items, groups, T, d)``: one item per (batch,
    kv head), with its query heads (``_arrays._group_heads``' order)."""
    return x.reshape((items, -1) + x.shape[-2:])


def _squeeze(x: jax.Array | None) -> jax.Array | None:
    """A mask or bias without its leading size-1 axes: at most ``(q_len, kv_len)``."""
    return None if x is None else x.reshape(x.shape[-2:])


def _rows(x: jax.Array | None, i0: Any, n: int) -> jax.Array | None:
    """Rows ``i0 : i0 + n`` of a mask or bias whose query axis is not broadcast."""
    if x is None or x.ndim < 2 or x.shape[-2] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, i0, n, axis=x.ndim - 2)


def _cols(x: jax.Array | None, k0: Any, n: int) -> jax.Array | None:
    """Columns ``k0 : k0 + n`` of a mask or bias whose key axis is not broadcast."""
    if x is None or x.shape[-1] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, k0, n, axis=x.ndim - 1)


def _blocks(x: jax.Array, size: int) -> jax.Array:
    """``(..., n · size, d)`` → ``(n, ..., size, d)``: the blocks along the first axis, for
    ``lax.map`` and ``lax.scan``."""
    x = x.reshape(x.shape[:-2] + (-1, size, x.shape[-1]))
    return jnp.moveaxis(x, -3, 0)


def _unblock(x: jax.Array) -> jax.Array:
    """``(n, ..., block, d)`` → ``(..., n · block, d)``: undo ``_blocks``."""
    x = jnp.moveaxis(x, 0, -3)
    return x.reshape(x.shape[:-3] + (-1, x.shape[-1]))
