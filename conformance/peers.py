"""The frameworks' own attention kernels, as extra report columns ("peers").

Each peer is a thin adapter from a case's inputs to one framework function, changing only what
the framework's conventions require:

``torch.sdpa``
  ``torch.nn.functional.scaled_dot_product_attention``: same layout and mask polarity; a bias
  becomes a float ``attn_mask`` (bias, ``-inf`` where the boolean mask is False);
  ``enable_gqa=True`` for grouped-query cases; ``is_causal`` as given (torch is top-left only).
``torch.MHA``
  ``torch.nn.MultiheadAttention`` with identity projections, so it attends over the case's own
  query/key/value: heads merged into ``embed_dim``, the boolean mask inverted (its True means
  "masked out"), a causal case as the usual ``triu`` mask (top-left), key/value heads repeated
  for grouped-query cases, per-head weights with ``average_attn_weights=False``.
``jax.nn``
  ``jax.nn.dot_product_attention``: layout ``(batch, seq, heads, head_dim)`` (BTNH);
  ``is_causal`` and ``local_window_size`` as given (both aligned top-left).

The other ecosystems' kernels have a file each, with their adapters and what they cannot express:
``keras[numpy]``, ``keras[jax]``, ``keras[torch]`` (``peers_keras``: one worker process per Keras
backend), ``flax.nnx`` (``peers_flax``), ``transformers.eager`` and ``transformers.sdpa``
(``peers_transformers``), ``onnxruntime`` (``peers_onnx``). A peer whose packages are not
installed is reported as missing, with its install command, never as an error.

A peer is only an adapter: ``compute(exp)`` returns the steps it can give (``output``, sometimes
``output_weights``) as NumPy arrays, and ``runner.run_peer_cell`` compares them like a backend's.
A peer that cannot express a case raises ``NotApplicable`` (shown as "n/a"). Where a peer
differs from the spec on purpose, ``spec.KNOWN_DIFFERENCES`` says so and why; the report then
shows "known: …" instead of a failure. Peers never decide the exit code. To add a peer, write
its ``compute`` function and add a ``Peer`` to ``PEERS``.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import backends
from .expected import Expected
from .peer_inputs import need, sdpa_case
from .peers_flax import flax_nnx
from .peers_keras import keras_jax, keras_numpy, keras_torch
from .peers_onnx import onnxruntime_attention
from .peers_transformers import transformers_eager, transformers_sdpa
from .usage import UsageError

# ------------------------------------------------------------------------------ torch SDPA


def _torch_sdpa(exp: Expected) -> dict[str, np.ndarray]:
    import torch

    a, o = sdpa_case(exp, "torch SDPA")
    need(o.get("window") is None, "torch SDPA has no sliding window")
    t = backends.torch_asarray
    q, k, v = (t(a[n]) for n in ("query", "key", "value"))
    attn_mask = None
    if a.get("bias") is not None:
        bias = np.asarray(a["bias"])
        if a.get("mask") is not None:
            bias = np.where(np.asarray(a["mask"], bool), bias.astype(np.float64), -np.inf)
        attn_mask = t(np.asarray(bias).astype(a["query"].dtype))
    elif a.get("mask") is not None:
        attn_mask = t(np.asarray(a["mask"], bool))
    kwargs: dict[str, Any] = {"attn_mask": attn_mask, "is_causal": bool(o.get("is_causal"))}
    if o.get("scale") is not None:
        kwargs["scale"] = float(o["scale"])
    if q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        kwargs["enable_gqa"] = True
    with torch.no_grad():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    return {"output": backends.torch_to_numpy(out)}


# ------------------------------------------------------------------------------ torch MHA


def _torch_mha(exp: Expected) -> dict[str, np.ndarray]:
    import torch

    a, o = sdpa_case(exp, "torch.nn.MultiheadAttention")
    need(o.get("window") is None, "torch.nn.MultiheadAttention has no sliding window")
    need(o.get("scale") is None, "torch.nn.MultiheadAttention always scales by head_dim ** -0.5")
    q, k, v = (np.asarray(a[n]) for n in ("query", "key", "value"))
    need(v.shape[-1] == q.shape[-1], "torch.nn.MultiheadAttention needs v_dim == head_dim")
    if q.ndim == 2:
        q, k, v = q[None], k[None], v[None]  # one head
    need(q.ndim in (3, 4), "torch.nn.MultiheadAttention takes at most one batch axis")
    heads, q_len, head_dim = q.shape[-3:]
    kv_len = k.shape[-2]
    if k.shape[-3] != heads:  # grouped-query: repeat each key/value head
        k, v = (np.repeat(x, heads // k.shape[-3], axis=-3) for x in (k, v))
    embed = heads * head_dim

    def merge(x: np.ndarray) -> np.ndarray:  # (..., heads, T, D) → (..., T, heads·D)
        x = np.swapaxes(x, -2, -3)
        return x.reshape(x.shape[:-2] + (embed,))

    allowed = np.ones(q.shape[:-3] + (heads, q_len, kv_len), bool)
    if a.get("mask") is not None:
        mask = np.asarray(a["mask"], bool)
        allowed = allowed & (mask if mask.ndim >= 2 else mask[None])
    if o.get("is_causal"):  # the usual triu "subsequent" mask: top-left
        allowed = allowed & ~np.triu(np.ones((q_len, kv_len), bool), 1)
    attn_mask: Any = None
    if a.get("bias") is not None or not allowed.all():
        flat = allowed.reshape((-1, q_len, kv_len))  # (batch·heads, q_len, kv_len)
        if a.get("bias") is not None:
            bias = np.broadcast_to(np.asarray(a["bias"], np.float64), allowed.shape)
            float_mask = np.where(allowed, bias, -np.inf).reshape(flat.shape)
            attn_mask = backends.torch_asarray(float_mask.astype(a["query"].dtype))
        else:
            attn_mask = torch.from_numpy(~flat)  # MultiheadAttention: True = masked out
        if q.ndim == 3:
            attn_mask = attn_mask if attn_mask.shape[0] == heads else attn_mask[0]
    dtype = backends.torch_asarray(a["query"][..., :1]).dtype
    mha = torch.nn.MultiheadAttention(embed, heads, bias=False, batch_first=True, dtype=dtype)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.eye(embed, dtype=dtype).repeat(3, 1))
        mha.out_proj.weight.copy_(torch.eye(embed, dtype=dtype))
        mha.eval()
        t = backends.torch_asarray
        qm, km, vm = t(merge(q)), t(merge(k)), t(merge(v))
        out, weights = mha(qm, km, vm, attn_mask=attn_mask, need_weights=True,
                           average_attn_weights=False)
    out_np = backends.torch_to_numpy(out)  # (..., q_len, heads·D)
    out_np = np.swapaxes(out_np.reshape(out_np.shape[:-1] + (heads, head_dim)), -2, -3)
    w_np = backends.torch_to_numpy(weights)
    shape = exp.values["output"].shape
    return {"output": out_np.reshape(shape),
            "output_weights": w_np.reshape(exp.values["output_weights"].shape)}


# ------------------------------------------------------------------------------ jax.nn


@functools.cache
def _jax_nn_compiled() -> Callable[..., Any]:
    """``jax.nn.dot_product_attention`` under ``jax.jit``: one program per case and dtype
    (eagerly, every primitive is a program of its own). Eager where jit fails: float16 on CPU,
    whose jitted dot products XLA rejects."""
    import jax

    return jax.jit(jax.nn.dot_product_attention,
                   static_argnames=("is_causal", "scale", "local_window_size"))


def _jax_nn(exp: Expected) -> dict[str, np.ndarray]:
    backends.jax_prepare()
    import jax
    import jax.numpy as jnp

    a, o = sdpa_case(exp, "jax.nn.dot_product_attention")
    q, k, v = (np.asarray(a[n]) for n in ("query", "key", "value"))
    need(v.shape[-1] == q.shape[-1], "jax.nn.dot_product_attention needs v_dim == head_dim")
    squeeze = q.ndim == 2
    if squeeze:
        q, k, v = q[None], k[None], v[None]
    need(q.ndim in (3, 4), "jax.nn.dot_product_attention takes at most one batch axis")

    def btnh(x: np.ndarray) -> Any:  # (..., N, T, H) → (..., T, N, H)
        return jnp.asarray(np.swapaxes(x, -2, -3))

    target = q.shape[:-1] + (k.shape[-2],)  # (..., heads, q_len, kv_len)
    kwargs: dict[str, Any] = {"is_causal": bool(o.get("is_causal"))}
    if o.get("scale") is not None:
        kwargs["scale"] = float(o["scale"])
    if a.get("mask") is not None:
        kwargs["mask"] = jnp.asarray(np.broadcast_to(np.asarray(a["mask"], bool), target))
    if a.get("bias") is not None:
        kwargs["bias"] = jnp.asarray(np.broadcast_to(a["bias"], target))
    if o.get("window") is not None:
        left, right = o["window"]
        big = max(q.shape[-2], k.shape[-2])
        kwargs["local_window_size"] = (big if left is None else left,
                                       big if right is None else right)
    try:
        out = _jax_nn_compiled()(btnh(q), btnh(k), btnh(v), **kwargs)
    except ValueError:  # jitted float16 on CPU: "precision 'F16_F16_F32' is not supported"
        out = jax.nn.dot_product_attention(btnh(q), btnh(k), btnh(v), **kwargs)
    out_np = np.swapaxes(np.asarray(out), -2, -3)
    return {"output": out_np[0] if squeeze else out_np}


# ------------------------------------------------------------------------------ peers


@dataclass(frozen=True)
class Peer:
    """A framework kernel as a report column."""

    name: str
    framework: str  # the package it needs
    install: str
    compute: Callable[[Expected], dict[str, np.ndarray]]
    requires: tuple[str, ...] = ()  # further packages it needs

    def available(self) -> bool:
        """True when the framework and every package of ``requires`` are installed (found
        without importing them)."""
        return all(importlib.util.find_spec(name) is not None
                   for name in (self.framework, *self.requires))


_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
_PEERS_EXTRA = "pip install -e '.[peers]'"

PEERS: tuple[Peer, ...] = (
    Peer("torch.sdpa", "torch", _TORCH, _torch_sdpa),
    Peer("torch.MHA", "torch", _TORCH, _torch_mha),
    Peer("jax.nn", "jax", "pip install jax", _jax_nn),
    Peer("keras[numpy]", "keras", _PEERS_EXTRA, keras_numpy),
    Peer("keras[jax]", "keras", f"{_PEERS_EXTRA} jax", keras_jax, ("jax",)),
    Peer("keras[torch]", "keras", f"{_PEERS_EXTRA} and {_TORCH}", keras_torch, ("torch",)),
    Peer("flax.nnx", "flax", _PEERS_EXTRA, flax_nnx, ("jax",)),
    Peer("transformers.eager", "transformers", f"{_PEERS_EXTRA} and {_TORCH}",
         transformers_eager, ("torch",)),
    Peer("transformers.sdpa", "transformers", f"{_PEERS_EXTRA} and {_TORCH}",
         transformers_sdpa, ("torch",)),
    Peer("onnxruntime", "onnxruntime", _PEERS_EXTRA, onnxruntime_attention, ("onnx",)),
)


def get(name: str) -> Peer:
    """The peer called ``name``."""
    for peer in PEERS:
        if peer.name == name:
            return peer
    raise UsageError(f"unknown peer {name!r}; known: {', '.join(p.name for p in PEERS)}")
