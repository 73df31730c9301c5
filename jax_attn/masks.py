"""Boolean mask builders. True means "may attend" everywhere in this project."""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attention_rules as rules
from attention_rules import ready_mods

from ._arrays import _check_device, _dtype_name, _place
from ._masking import _in_band


def causal_mask(q_len: int, kv_len: int, *, offset: int = 0, device: Any = None) -> jax.Array:
    """Boolean causal mask: query ``i`` may attend key ``j`` iff ``j <= i + offset``.

    Args:
      q_len: number of queries.
      kv_len: number of keys.
      offset: 0 for top-left alignment, ``kv_len - q_len`` for bottom-right.
      device: ``None`` (JAX's default), a ``jax.Device`` or a platform name such as ``"cpu"``.

    Returns:
      ``(q_len, kv_len)`` bool, True = may attend.
    """
    fn = "causal_mask"
    q_len = rules.check_int(fn, "q_len", q_len)
    kv_len = rules.check_int(fn, "kv_len", kv_len)
    offset = rules.check_int(fn, "offset", offset, minimum=None)
    device = _check_device(fn, device)
    return _place(_in_band(0, q_len, 0, kv_len, -math.inf, offset), device)  # j - i <= offset


def sliding_window_mask(
    q_len: int, kv_len: int, window: tuple, *, offset: int = 0, device: Any = None
) -> jax.Array:
    """Boolean local-attention mask: ``i + offset - left <= j <= i + offset + right``.

    Args:
      q_len: number of queries.
      kv_len: number of keys.
      window: ``(left, right)``, non-negative ints, ``None`` for unbounded.
      offset: alignment offset, as in ``causal_mask``.
      device: ``None`` (JAX's default), a ``jax.Device`` or a platform name such as ``"cpu"``.

    Returns:
      ``(q_len, kv_len)`` bool, True = may attend.
    """
    fn = "sliding_window_mask"
    q_len = rules.check_int(fn, "q_len", q_len)
    kv_len = rules.check_int(fn, "kv_len", kv_len)
    offset = rules.check_int(fn, "offset", offset, minimum=None)
    left, right = rules.check_window(fn, window)
    device = _check_device(fn, device)
    lo = -math.inf if left is None else offset - left  # the band of j - i
    hi = math.inf if right is None else offset + right
    return _place(_in_band(0, q_len, 0, kv_len, lo, hi), device)  # (q_len, kv_len)


def _lengths(fn: str, name: str, lengths: Any, max_len: int) -> jax.Array:
    # Dtype and rank are checked on the input as given (before JAX's x64 canonicalisation), so
    # messages match numpy_attn; the range is checked only on concrete values (not under jit).
    dtype = _dtype_name(lengths)
    lengths = jnp.asarray(lengths)
    rules.check_lengths_1d(fn, name, (lengths.shape, dtype))
    if not isinstance(lengths, jax.core.Tracer):
        rules.check_lengths(fn, name, np.asarray(lengths).tolist(), max_len)
    return lengths


def padding_mask(
    kv_lengths: Any,
    kv_len: int,
    *,
    q_lengths: Any = None,
    q_len: int | None = None,
    device: Any = None,
) -> jax.Array:
    """Boolean padding mask from per-sequence lengths.

    ``kv_lengths`` and ``q_lengths`` may be traced (under ``jax.jit``); their range is then not
    checked, and a length outside ``[0, kv_len]`` acts as if clipped to it.

    Args:
      kv_lengths: ``(batch,)`` ints in ``[0, kv_len]``; key ``j`` of sequence ``b`` is allowed
        iff ``j < kv_lengths[b]``.
      kv_len: padded key length.
      q_lengths: optional ``(batch,)`` ints; query ``i`` of sequence ``b`` attends only if
        ``i < q_lengths[b]`` (a padded query's output is 0).
      q_len: padded query length, required with ``q_lengths``.
      device: ``None`` (JAX's default), a ``jax.Device`` or a platform name such as ``"cpu"``.

    Returns:
      ``(batch, 1, 1, kv_len)`` bool, or ``(batch, 1, q_len, kv_len)`` with ``q_lengths``.
    """
    fn = "padding_mask"
    kv_len = rules.check_int(fn, "kv_len", kv_len)
    device = _check_device(fn, device)
    kv_lengths = _lengths(fn, "kv_lengths", kv_lengths, kv_len)
    key_ok = jnp.arange(kv_len, dtype=jnp.int32) < kv_lengths[:, None]  # (batch, kv_len)
    mask = key_ok[:, None, None, :]  # (batch, 1, 1, kv_len)
    if q_lengths is None:
        return _place(mask, device)
    if q_len is None:
        raise ValueError(f"{fn}: q_lengths needs q_len; got q_len=None")
    q_len = rules.check_int(fn, "q_len", q_len)
    q_lengths = _lengths(fn, "q_lengths", q_lengths, q_len)
    if q_lengths.shape != kv_lengths.shape:
        raise ValueError(
            f"{fn}: q_lengths and kv_lengths must have the same batch; "
            f"got q_lengths.shape={q_lengths.shape}, kv_lengths.shape={kv_lengths.shape}"
        )
    query_ok = jnp.arange(q_len, dtype=jnp.int32) < q_lengths[:, None]  # (batch, q_len)
    return _place(mask & query_ok[:, None, :, None], device)  # (batch, 1, q_len, kv_len)


def combine_masks(*masks: Any) -> jax.Array | None:
    """AND of boolean masks, broadcast together; ``None`` entries are skipped.

    Args:
      masks: boolean arrays, mutually broadcastable (e.g. ``(q_len, kv_len)`` and
        ``(batch, 1, 1, kv_len)``).

    Returns:
      the broadcast AND, or ``None`` when every entry is ``None``.
    """
    fn = "combine_masks"
    given = [m for m in masks if m is not None]
    for index, m in enumerate(given):
        rules.check_bool(fn, f"masks[{index}]", _dtype_name(m))
    present = [jnp.asarray(m) for m in given]
    if not present:
        return None
    rules.check_masks_broadcast(fn, [tuple(m.shape) for m in present])
    return functools.reduce(operator.and_, present)  # the broadcast AND


# ------------------------------------------------------------------------------------------
# Ready-made mods (spec.READY_MADE_MODS), written once in attention_rules.ready_mods: the mask
# mods are imported as they are (operators only); the ones that hold an array or call a
# function get jax.numpy's here (traced under jit: the mods are static arguments)
# ------------------------------------------------------------------------------------------


def _to_bytes(ids: jax.Array) -> bytes | None:
    """The bytes of ``ids`` (or slopes, a table), a ready-made mod's key (its contents); None
    for a tracer (a mod made inside a traced function), which has no values to read."""
    if isinstance(ids, jax.core.Tracer):
        return None
    return np.asarray(ids).tobytes()


def _constant(x: Any) -> jax.Array:
    """A ready-made score mod's array (slopes, a table) cut from autodiff: a constant by design
    (``spec.SCORE_MOD``), on every path (a learned table: a callable of your own, or
    ``bias=``)."""
    return jax.lax.stop_gradient(jnp.asarray(x))


def document_mod(segment_ids: Any) -> MaskMod:
    """Equal segment ids only: ``segment_ids`` one array ``(..., seq)`` or a pair ``((...,
    q_len), (..., kv_len))`` as ``scaled_dot_product_attention``'s; ``(seq,)`` ids serve every
    batch entry. Equals ``segment_ids=``."""
    return ready_mods.document_mod(segment_ids, jnp.asarray, to_bytes=_to_bytes)


def alibi_mod(slopes: Any, offset: int = 0) -> ScoreMod:
    """``score - slopes[head] · |q_idx + offset - kv_idx|``: equals ``alibi_slopes=slopes``
    with ``offset`` the causal alignment's (derivative 1)."""
    return ready_mods.alibi_mod(_constant(slopes), offset, jnp.ones_like, to_bytes=_to_bytes)


def softcap_mod(softcap: float) -> ScoreMod:
    """``softcap · tanh(score / softcap)``: equals ``softcap=`` when there is no bias nor ALiBi
    (the dedicated soft-cap comes before them); derivative ``1 - tanh²``."""
    return ready_mods.softcap_mod(softcap, jnp.tanh, jnp.square)


def relative_bias_mod(table: Any, offset: int = 0) -> ScoreMod:
    """``score + table[head, clip(kv_idx - q_idx - offset, -m, m) + m]`` for a ``(heads,
    2m + 1)`` table (T5-like relative position bias, distances clipped at ``m``): equals
    ``bias=`` its tabulation (derivative 1)."""
    return ready_mods.relative_bias_mod(_constant(table), offset, jnp.clip, jnp.ones_like,
                                        to_bytes=_to_bytes)


# The mask mods use Python's operators only: the same objects in every backend
MaskMod, ScoreMod = ready_mods.MaskMod, ready_mods.ScoreMod
causal_mod, sliding_window_mod = ready_mods.causal_mod, ready_mods.sliding_window_mod
chunked_mod, prefix_lm_mod = ready_mods.chunked_mod, ready_mods.prefix_lm_mod
and_masks, or_masks = ready_mods.and_masks, ready_mods.or_masks
