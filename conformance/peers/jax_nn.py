"""``jax.nn.dot_product_attention`` as peers: columns ``jax.nn`` and ``jax.nn[lengths]``.

Called as models call it: under ``jax.jit``, with ``implementation=None`` (on CPU the XLA path;
cuDNN needs a GPU). Layout ``(batch, seq, heads, head_dim)`` (BTNH); the boolean mask (True =
may attend) and ``bias`` broadcast to the scores; ``is_causal`` and ``local_window_size`` as
given (both aligned top-left). Not expressible (n/a): ``v_dim != head_dim``, more than one
batch axis, soft-capping, attention sinks, a given dropout keep-mask, chunks, ALiBi, segment
ids and score/mask mods (jax.nn has none of them).

``jax.nn`` passes the case's boolean mask as ``mask``. ``jax.nn[lengths]`` is the other way
users pad: ``query_seq_lengths`` / ``key_value_seq_lengths`` (int32, ``(batch,)``), a separate
code path (the padded query rows' outputs are multiplied by 0 afterwards). It takes the cases
whose boolean mask is exactly a padding mask (``inputs.padding_lengths``: a prefix of keys, and
of queries where the mask has a query axis; any other case is n/a) and the packed (``varlen``)
cases, unpacked into a padded batch (``conformance.cases.varlen_padding``, sequences left-aligned)
with their lengths: ``window_size (-1, 0)`` becomes ``is_causal=True`` and any other window
``local_window_size``, aligned top-left where each sequence's rule is bottom-right (they differ
for a sequence with ``q_len != kv_len``); ``enable_gqa`` is implied by the heads.

Both are called with ``return_residual=True``, so they also give the ``lse`` step: jax 0.10.2's
residual is ``logsumexp`` (natural log) of the masked float32 logits, shape ``(batch, q_len,
heads)`` (BTN, transposed here to the spec's ``(batch, heads, q_len)``), cast to the *key's*
dtype and under ``stop_gradient``. The output is the same with or without the residual.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..cases import varlen_padding
from ..cases.expected import Expected
from ..running import backends
from .inputs import need, padding_lengths, padding_reason, sdpa_case

PEER = "jax.nn.dot_product_attention"


@functools.cache
def _jax_nn_compiled() -> Callable[..., Any]:
    """``jax.nn.dot_product_attention`` under ``jax.jit``: one program per case and dtype
    (eagerly, every primitive is a program of its own). Eager where jit fails: float16 on CPU,
    whose jitted dot products XLA rejects."""
    import jax

    return jax.jit(jax.nn.dot_product_attention,
                   static_argnames=("is_causal", "scale", "local_window_size", "return_residual"))


def _call(q: np.ndarray, k: np.ndarray, v: np.ndarray, kwargs: dict[str, Any]
          ) -> tuple[np.ndarray, np.ndarray]:
    """jax.nn on ``(..., heads, seq, dim)`` NumPy inputs (3-D or 4-D): ``(output (..., heads,
    q_len, dim), lse (..., heads, q_len))``, in the spec's layout."""
    backends.jax_prepare()
    import jax

    def btnh(x: np.ndarray) -> Any:  # (..., N, T, H) → (..., T, N, H)
        return jax.device_put(np.swapaxes(x, -2, -3))  # no compiled copy (backends.py)

    kwargs = {**kwargs, "return_residual": True}  # the row log-sum-exp: (..., q_len, heads)
    try:
        out, lse = _jax_nn_compiled()(btnh(q), btnh(k), btnh(v), **kwargs)
    except ValueError:  # jitted float16 on CPU: "precision 'F16_F16_F32' is not supported"
        out, lse = jax.nn.dot_product_attention(btnh(q), btnh(k), btnh(v), **kwargs)
    return np.swapaxes(np.asarray(out), -2, -3), np.swapaxes(np.asarray(lse), -1, -2)


def _window(window: tuple | None, big: int) -> dict[str, Any]:
    """The spec's ``window`` (None = unbounded side) as ``local_window_size``."""
    if window is None:
        return {}
    left, right = window
    return {"local_window_size": (big if left is None else left, big if right is None else right)}


def _sdpa(exp: Expected, lengths: bool) -> dict[str, np.ndarray]:
    """An sdpa case through jax.nn, its mask as ``mask`` or (``lengths``) as the lengths."""
    a, o = sdpa_case(exp, PEER)
    q, k, v = (np.asarray(a[n]) for n in ("query", "key", "value"))
    need(v.shape[-1] == q.shape[-1], f"{PEER} needs v_dim == head_dim")
    squeeze = q.ndim == 2
    if squeeze:
        q, k, v = q[None], k[None], v[None]
    need(q.ndim in (3, 4), f"{PEER} takes at most one batch axis")
    target = q.shape[:-1] + (k.shape[-2],)  # (..., heads, q_len, kv_len)
    kwargs: dict[str, Any] = {"is_causal": bool(o.get("is_causal"))}
    if o.get("scale") is not None:
        kwargs["scale"] = float(o["scale"])
    mask = None if a.get("mask") is None else np.asarray(a["mask"], bool)
    if lengths:
        found = padding_lengths(mask, q.shape[-2], k.shape[-2]) if q.ndim == 4 else None
        need(found is not None, padding_reason("jax.nn[lengths]", mask, "padding masks (a "
                                               "prefix of keys and of queries per sequence)"))
        q_lengths, kv_lengths = found
        kwargs["key_value_seq_lengths"] = kv_lengths
        if q_lengths is not None:
            kwargs["query_seq_lengths"] = q_lengths
    elif mask is not None:
        kwargs["mask"] = np.broadcast_to(mask, target)
    if a.get("bias") is not None:
        kwargs["bias"] = np.broadcast_to(a["bias"], target)
    kwargs.update(_window(o.get("window"), max(q.shape[-2], k.shape[-2])))
    out, lse = _call(q, k, v, kwargs)
    if squeeze:
        return {"output": out[0], "lse": lse[0]}  # 2-D inputs: lse (q_len,)
    return {"output": out, "lse": lse}


def jax_nn(exp: Expected) -> dict[str, np.ndarray]:
    """The ``jax.nn`` peer: ``output (..., heads, q_len, head_dim)`` and ``lse (..., heads,
    q_len)`` from ``jax.nn.dot_product_attention(..., return_residual=True)`` (jitted)."""
    return _sdpa(exp, lengths=False)


def jax_nn_lengths(exp: Expected) -> dict[str, np.ndarray]:
    """The ``jax.nn[lengths]`` peer: an sdpa case with a padding mask given as
    ``query_seq_lengths`` / ``key_value_seq_lengths`` (``output``, ``lse``), or a packed
    batch, padded (``varlen_output (total_q, heads, dim)``, ``varlen_lse (heads, total_q)``)."""
    if exp.kind != "varlen":
        return _sdpa(exp, lengths=True)
    a, o = exp.data.arrays, exp.data.options
    need(a.get("sinks") is None, f"{PEER} has no attention sinks")
    need(o.get("softcap") is None, f"{PEER} has no soft-capping")
    need(a.get("block_table") is None, "the jax.nn[lengths] adapter does not gather paged keys")
    need(a["value"].shape[-1] == a["query"].shape[-1], f"{PEER} needs v_dim == head_dim")
    p = varlen_padding.unpack(a)
    left, right = (int(w) for w in o.get("window_size", (-1, -1)))
    kwargs: dict[str, Any] = {"is_causal": (left, right) == (-1, 0),
                              "query_seq_lengths": p.q_lengths.astype(np.int32),
                              "key_value_seq_lengths": p.kv_lengths.astype(np.int32)}
    if not kwargs["is_causal"] and (left, right) != (-1, -1):
        kwargs.update(_window((None if left < 0 else left, None if right < 0 else right),
                              max(p.max_q, p.key.shape[2])))
    if o.get("scale") is not None:
        kwargs["scale"] = float(o["scale"])
    out, lse = _call(p.query, p.key, p.value, kwargs)
    return {"varlen_output": varlen_padding.repack(out, p),
            "varlen_lse": varlen_padding.repack_lse(lse, p)}


__all__ = ["PEER", "jax_nn", "jax_nn_lengths"]
