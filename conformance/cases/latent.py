"""The module case of multi-head latent attention (``spec.LATENT_ATTENTION``,
``spec.LATENT_ABSORBED``, ``spec.LATENT_CACHE``) and its expected values from this file's own
float64 MLA, written from the spec's formulas (never from a backend).

The case is a ``module`` case (``options["module"] == "MultiHeadLatentAttention"``): ``x (...,
seq, d_model)``, the weights ``w:<name>`` in transformers' DeepSeek-V3 names drawn from a
seeded generator in float64 (``load_weights`` gets them cast to the dtype), the forward options
(``is_causal``) and the decoding chunks. Its steps:

* ``output``: ``forward(x, is_causal=True)``, the naive form;
* ``latent_absorbed_output``: ``forward(x, is_causal=True, absorbed=True)``: equal to it;
* ``decode_output``: ``decode`` chunk by chunk from a latent cache (the later chunks at an
  offset): equal to the causal forward;
* ``grad_weights``: ``parameter_gradients(x, grad_output, is_causal=True)``, every weight's
  gradient of the naive form against the seeded ``grad_output`` that ``expected`` adds
  (``cases.latent_grads``, the chain rule over ``Parts``).

``mla`` computes either form with every intermediate rounded by a ``Precision`` (float64: the
expected values; the dtype: the naive baseline that scales the tolerance) and replays the
mistakes ``diagnosing.latent`` names: the rope over every dim of q and k (``rope_all``), the
absorbed query without ``W_UK`` (``no_fold``), the values read from the latent's last
``kv_lora_rank`` dims (``last_slice``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import reference
from .inputs import Case, CaseData
from .naive import EXACT, Precision, naive_attention
from .rotary import default_inv_freq, naive_rotate, rotate

#: The compared steps of the MLA case besides ``output`` and ``decode_output``.
LATENT_STEPS = ("latent_absorbed_output",)
MODULE = "MultiHeadLatentAttention"
#: The sizes of the case: qk_nope_head_dim equals kv_lora_rank, so an absorbed query that
#: forgets ``W_UK`` still has the latent's width (the silent form of that mistake).
INIT = {"d_model": 16, "num_heads": 2, "q_lora_rank": 6, "kv_lora_rank": 8,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}
#: The default rope of the module: interleaved pairs, theta 10000.
THETA = 10000.0
RMS_EPS = 1e-6


def is_latent(data: CaseData) -> bool:
    """True for the MLA module case."""
    return data.options.get("module") == MODULE


def weight_shapes(init: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Each weight's shape, ``(out, in)`` or ``(dim,)``, from ``spec.LATENT_ATTENTION``."""
    h, d, r = init["num_heads"], init["d_model"], init["kv_lora_rank"]
    dn, dr, dv = init["qk_nope_head_dim"], init["qk_rope_head_dim"], init["v_head_dim"]
    shapes: dict[str, tuple[int, ...]] = {}
    if init.get("q_lora_rank") is None:
        shapes["q_proj.weight"] = (h * (dn + dr), d)
    else:
        rq = init["q_lora_rank"]
        shapes.update({"q_a_proj.weight": (rq, d), "q_a_layernorm.weight": (rq,),
                       "q_b_proj.weight": (h * (dn + dr), rq)})
    shapes.update({"kv_a_proj_with_mqa.weight": (r + dr, d), "kv_a_layernorm.weight": (r,),
                   "kv_b_proj.weight": (h * (dn + dv), r), "o_proj.weight": (d, h * dv)})
    return shapes


class Parts:
    """One forward's intermediates in float64 (rounded by ``p``); ``cases.latent_grads`` runs
    the backward pass over them."""

    def __init__(self, data: CaseData, p: Precision) -> None:
        o, a = data.options["init"], data.arrays
        self.p, self.o = p, o
        self.w = {n[2:]: np.asarray(x).astype(np.float64) for n, x in a.items()
                  if n.startswith("w:")}
        x = np.asarray(a["x"]).astype(np.float64)
        self.h, self.r = o["num_heads"], o["kv_lora_rank"]
        self.dn, self.dr = o["qk_nope_head_dim"], o["qk_rope_head_dim"]
        self.dv = o["v_head_dim"]
        self.x, self.positions = x, np.arange(x.shape[-2])
        self.options = {"is_causal": bool(data.options["forward"].get("is_causal", False)),
                        "scale": self.scale}
        if "q_proj.weight" in self.w:
            q = self.linear(x, "q_proj.weight")
        else:
            self.q_a = self.linear(x, "q_a_proj.weight")  # (..., S, q_lora_rank)
            self.q_normed = self.rms(self.q_a, "q_a_layernorm.weight")
            q = self.linear(self.q_normed, "q_b_proj.weight")
        q = self.heads(q)  # (..., H, S, dn + dr)
        self.kv_a = kv_a = self.linear(x, "kv_a_proj_with_mqa.weight")  # (..., S, r + dr)
        self.c = self.rms(kv_a[..., : self.r], "kv_a_layernorm.weight")[..., None, :, :]
        k_pe = kv_a[..., None, :, self.r:]  # (..., 1, S, dr)
        self.q_raw, self.k_pe_raw = q, k_pe
        self.q_nope, self.q_pe = q[..., : self.dn], self.rotate(q[..., self.dn:])
        self.k_pe = self.rotate(k_pe)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        """``x @ W^T`` (``W (out, in)``)."""
        return self.p.matmul(x, self.w[name].T)

    def heads(self, t: np.ndarray) -> np.ndarray:
        """``(..., S, H * d)`` → ``(..., H, S, d)``."""
        return np.swapaxes(t.reshape(t.shape[:-1] + (self.h, -1)), -2, -3)

    @staticmethod
    def merge(t: np.ndarray) -> np.ndarray:
        """``(..., H, S, d)`` → ``(..., S, H * d)``."""
        merged = np.swapaxes(t, -2, -3)
        return merged.reshape(merged.shape[:-2] + (-1,))

    def rms(self, t: np.ndarray, name: str) -> np.ndarray:
        """``g · t / sqrt(mean(t²) + eps)``, normalised in the compute dtype, rounded, then the
        gain."""
        acc = self.p.accumulate
        tc = t.astype(acc)
        normed = tc / np.sqrt(np.mean(tc * tc, axis=-1, keepdims=True) + acc.type(RMS_EPS))
        return self.p.round(self.w[name] * self.p.round(normed))

    def rotate(self, t: np.ndarray, inverse: bool = False) -> np.ndarray:
        """The rope (interleaved pairs, theta 10000) over all of ``t``'s last axis
        ``(..., S, d)``; ``inverse``: by ``-angle``, its transpose (the VJP)."""
        inv = default_inv_freq(t.shape[-1], THETA)
        if self.p.dtype == "float64":
            return rotate(t, self.positions, inv, "interleaved", inverse=inverse)
        return naive_rotate(t, self.positions, inv, "interleaved", None, 1.0, self.p.dtype,
                            inverse=inverse)

    def naive_qkv(self, rope_all: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The naive form's query, key ``(..., H, S, dn + dr)`` and value ``(..., H, S, dv)``:
        the latent projected up per head, ``k_pe`` broadcast to every head; ``rope_all``:
        every dim of q and k rotated, at the frequencies of qk_head_dim (a mistake)."""
        kv = self.heads(self.linear(self.c[..., 0, :, :], "kv_b_proj.weight"))
        k_nope, value = kv[..., : self.dn], kv[..., self.dn:]
        k_pe = np.broadcast_to(self.k_pe_raw if rope_all else self.k_pe,
                               k_nope.shape[:-1] + (self.dr,))
        if rope_all:
            return (self.rotate(self.q_raw),
                    self.rotate(np.concatenate([k_nope, k_pe], axis=-1)), value)
        query = np.concatenate([self.q_nope, self.q_pe], axis=-1)
        return query, np.concatenate([k_nope, k_pe], axis=-1), value

    def attend(self, query: np.ndarray, key: np.ndarray, value: np.ndarray) -> reference.Steps:
        """The attention at the forward options: the float64 reference, or the naive one
        rounded by ``p``."""
        if self.p.dtype == "float64":
            return reference.attention(query, key, value, **self.options)
        return naive_attention({"query": query, "key": key, "value": value}, self.options,
                               self.p)

    @property
    def scale(self) -> float:
        """``qk_head_dim ** -0.5`` (the default rope has no YaRN mscale)."""
        return (self.dn + self.dr) ** -0.5


def mla(data: CaseData, p: Precision = EXACT, *, absorbed: bool = False, rope_all: bool = False,
        no_fold: bool = False, last_slice: bool = False) -> np.ndarray:
    """The MLA forward of the case (its forward options), ``(..., seq, d_model)``; ``absorbed``:
    the absorbed form; the keywords replay mistakes (see the module docstring)."""
    parts = Parts(data, p)
    h, dn, r, dv = parts.h, parts.dn, parts.r, parts.dv
    w_b = parts.w["kv_b_proj.weight"].reshape(h, dn + dv, r)
    if not absorbed:
        context = parts.attend(*parts.naive_qkv(rope_all)).output
    else:
        q_lat = parts.q_nope if no_fold else p.round(np.einsum(
            "...hsn,hnr->...hsr", parts.q_nope.astype(p.accumulate), w_b[:, :dn].astype(
                p.accumulate)))
        query = np.concatenate([q_lat, parts.q_pe], axis=-1)
        key = np.concatenate([parts.c, parts.k_pe], axis=-1)  # (..., 1, S, r + dr)
        value = key[..., -r:] if last_slice else key[..., :r]
        latent = parts.attend(query, key, value).output
        context = p.round(np.einsum("...hsr,hvr->...hsv", latent.astype(p.accumulate),
                                    w_b[:, dn:].astype(p.accumulate)))
    return parts.linear(parts.merge(context), "o_proj.weight")


def values(data: CaseData, dtype: str, naive: bool = False) -> dict[str, np.ndarray]:
    """The MLA case's steps: ``output`` (naive form), ``latent_absorbed_output`` (absorbed
    form) and ``decode_output`` (decoding runs the absorbed form, equal to the causal forward);
    ``naive``: each form with every intermediate rounded to ``dtype``."""
    p = Precision(dtype) if naive else EXACT
    out = {"output": mla(data, p), "latent_absorbed_output": mla(data, p, absorbed=True)}
    if data.options.get("decode"):
        out["decode_output"] = out["latent_absorbed_output"]
    return out


def _latent_arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``x (2, 5, 16)`` and the weights: projections normal / sqrt(fan_in), RMSNorm gains
    about 1."""
    arrays = {"x": rng.standard_normal((2, 5, INIT["d_model"]))}
    for name, shape in weight_shapes(INIT).items():
        if len(shape) == 1:
            arrays[f"w:{name}"] = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            arrays[f"w:{name}"] = rng.standard_normal(shape) / np.sqrt(shape[1])
    return arrays


def _latent_case(rng: np.random.Generator) -> CaseData:
    return CaseData(_latent_arrays(rng), {"module": MODULE, "init": dict(INIT),
                                          "forward": {"is_causal": True}, "decode": (3, 1, 1)})


LATENT_CASES: tuple[Case, ...] = (
    Case("mla_naive_absorbed_decode",
         "MultiHeadLatentAttention (q_lora_rank 6, kv_lora_rank 8, rope dims 4): causal forward "
         "naive and absorbed, decoding 3 + 1 + 1 tokens from a latent cache",
         _latent_case, kind="module"),
)

__all__ = ["INIT", "LATENT_CASES", "LATENT_STEPS", "MODULE", "Parts", "is_latent", "mla",
           "values", "weight_shapes"]
