"""A case's inputs in the shapes and conventions the peers' frameworks take.

Every peer (``conformance.peers``) starts here: ``need`` turns what a framework cannot express
into ``NotApplicable`` (the report's "n/a"), ``sdpa_case`` keeps the cases a kernel can take at
all, and ``four_d`` gives the case's arrays as ``(batch, heads, seq, head_dim)`` with the
boolean mask already joined with the causal rule and the window when the framework takes only
an explicit mask; ``padding_lengths`` reads a padding mask back as lengths, for the frameworks
that take padding that way (a packed batch's padded form is ``conformance.cases.varlen_padding``).
Nothing here imports a framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cases.expected import Expected
from ..cases.mods import MOD_INPUTS, MOD_OPTIONS
from ..comparing.results import NotApplicable


def need(condition: bool, reason: str) -> None:
    """Raise ``NotApplicable(reason)`` unless ``condition``."""
    if not condition:
        raise NotApplicable(reason)


#: What a peer lacks for a case kind other than ``sdpa`` (its cells are n/a).
_KINDS = {"module": "has no equivalent of the spec's modules",
          "varlen": "takes no packed batch of variable-length sequences (torch.flex, "
                    "jax.nn[lengths] and onnxruntime[nonpad] unpack one)",
          "merge": "is compared on single attention calls only, not on merging partial results",
          "paged": "is compared on single attention calls only, not on a paged KV cache",
          "rotary": "has no rotary embedding (the transformers.rope columns compare it)"}


#: What a framework lacks for each argument of ``spec.PIPELINE_WITH_MODS`` (the inputs and
#: options of ``conformance.cases.mods``); one that is not listed here is named as it is.
_MOD_LACKS = {"chunk_size": "chunked local attention (chunk_size)",
              "alibi_slopes": "ALiBi (alibi_slopes)", "q_segment_ids": "segment ids",
              "kv_segment_ids": "segment ids", "mask_mod": "mask_mod or score_mod callables",
              "score_mod": "mask_mod or score_mod callables"}


def mod_features(exp: Expected) -> list[str]:
    """The arguments of ``spec.PIPELINE_WITH_MODS`` that ``exp``'s case uses (``conformance.
    mods.MOD_OPTIONS`` and ``MOD_INPUTS``), in that order."""
    a, o = exp.data.arrays, exp.data.options
    return [n for n in MOD_OPTIONS if o.get(n) is not None] + [n for n in MOD_INPUTS if n in a]


def sdpa_case(exp: Expected, peer: str, *, softcap: bool = False, sinks: bool = False,
              mods: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The case's arrays and options, for a kernel named ``peer``; modules, merge, paged and
    packed (varlen) cases, a given dropout keep-mask and (unless ``softcap``) soft-capping,
    (unless ``sinks``) attention sinks and (unless ``mods``) chunks, ALiBi, segment ids and
    score/mask mods are n/a: a peer that takes sinks passes ``sinks=True`` and reads
    ``a["sinks"]`` itself, one that takes the mods ``mods=True`` and reads them itself (a
    framework without them would silently ignore them, so they are n/a, never dropped)."""
    need(exp.kind == "sdpa", f"{peer} {_KINDS.get(exp.kind, 'takes sdpa cases only')}")
    a, o = exp.data.arrays, exp.data.options
    need(softcap or o.get("softcap") is None, f"{peer} has no soft-capping")
    need(sinks or a.get("sinks") is None, f"{peer} has no attention sinks")
    need(not o.get("dropout_p"), f"{peer} cannot take a given dropout keep-mask")
    lacks = dict.fromkeys(_MOD_LACKS.get(n, n) for n in mod_features(exp))
    need(mods or not lacks, f"{peer} has no {', '.join(lacks)}")
    return a, o


def structure(q_len: int, kv_len: int, options: dict[str, Any]) -> np.ndarray:
    """``(q_len, kv_len)`` bool: True where the case's causal rule and window allow a key.

    Key ``j`` is allowed for query ``i`` when ``j - i - offset`` lies in ``[-left, right]``
    (causal: ``right = 0``); ``offset`` is 0 top-left and ``kv_len - q_len`` bottom-right.
    """
    offset = kv_len - q_len if options.get("causal_alignment") == "bottom_right" else 0
    rel = np.arange(kv_len)[None, :] - np.arange(q_len)[:, None] - offset  # (q_len, kv_len)
    allowed = np.ones((q_len, kv_len), bool)
    if options.get("is_causal"):
        allowed &= rel <= 0
    if options.get("window") is not None:
        left, right = options["window"]
        if left is not None:
            allowed &= rel >= -left
        if right is not None:
            allowed &= rel <= right
    return allowed


@dataclass
class FourD:
    """A case's arrays as 4-D ``(batch, heads, seq, dim)``; 2-D and 3-D inputs get leading
    axes of 1 (``output_shape`` undoes that)."""

    query: np.ndarray  # (B, H, Tq, D)
    key: np.ndarray  # (B, Hkv, Tk, D)
    value: np.ndarray  # (B, Hkv, Tk, Dv)
    mask: np.ndarray | None  # (B|1, H|1, Tq, Tk) bool, True = may attend
    bias: np.ndarray | None  # (B|1, H|1, Tq, Tk), the input dtype
    output_shape: tuple[int, ...]  # the spec's output shape for the original inputs

    @property
    def grouped(self) -> bool:
        """True when there are fewer key/value heads than query heads."""
        return self.key.shape[1] != self.query.shape[1]


def _lift(x: np.ndarray | None) -> np.ndarray | None:
    """``x`` as 4-D: the leading axes of 1 that broadcasting implies."""
    return None if x is None else np.asarray(x).reshape((1,) * (4 - np.ndim(x)) + np.shape(x))


def four_d(exp: Expected, peer: str, *, join_structure: bool = False) -> FourD:
    """The case as 4-D arrays for ``peer`` (at most one batch axis; n/a otherwise).

    ``join_structure``: join the causal rule and the window (``structure``) into ``mask``, for
    frameworks that take only an explicit mask; else ``mask`` is the case's boolean mask alone.
    """
    a, o = exp.data.arrays, exp.data.options
    q, k, v = (np.asarray(a[n]) for n in ("query", "key", "value"))
    need(q.ndim <= 4, f"{peer} takes at most one batch axis")
    mask = None if a.get("mask") is None else np.asarray(a["mask"], bool)
    if join_structure and (o.get("is_causal") or o.get("window") is not None):
        allowed = structure(q.shape[-2], k.shape[-2], o)
        mask = allowed if mask is None else mask & allowed
    query, key, value, mask4, bias4 = (_lift(x) for x in (q, k, v, mask, a.get("bias")))
    return FourD(query, key, value, mask4, bias4, exp.values["output"].shape)


def padding_reason(peer: str, mask: np.ndarray | None, what: str) -> str:
    """Why ``peer``, which takes padding as lengths, cannot take a case: it has no mask, or its
    mask is not ``what``."""
    return (f"{peer} takes padding masks as lengths; the case has no mask" if mask is None
            else f"{peer} takes {what} only, as lengths; the case's mask is another")


def padding_lengths(mask: np.ndarray | None, q_len: int, kv_len: int
                    ) -> tuple[np.ndarray | None, np.ndarray] | None:
    """The lengths of a boolean mask that is exactly a padding mask, or None.

    ``mask`` broadcasts to ``(batch, 1, q_len | 1, kv_len)`` (the same for every head) and each
    batch entry allows a prefix of the keys, for a prefix of the queries when it has a query
    axis. Returns ``(q_lengths (batch,) or None without a query axis, kv_lengths (batch,))``
    (int32); a row of a batch entry with no key at all is a padded query only when the mask
    has a query axis.
    """
    if mask is None or np.ndim(mask) != 4 or np.shape(mask)[1] != 1:
        return None
    m = np.asarray(mask, bool)[:, 0]  # (batch, q_len | 1, kv_len)
    if m.shape[-1] != kv_len or m.shape[-2] not in (1, q_len):
        return None
    kv_lengths = m.any(-2).sum(-1)  # (batch,) keys some query sees
    q_lengths = m.any(-1).sum(-1) if m.shape[-2] == q_len and q_len > 1 else None
    keys = np.arange(kv_len) < kv_lengths[:, None]  # (batch, kv_len)
    rows = (np.ones(m.shape[:-1], bool) if q_lengths is None
            else np.arange(q_len) < q_lengths[:, None])  # (batch, q_len | 1)
    if not np.array_equal(m, rows[:, :, None] & keys[:, None, :]):
        return None
    return (None if q_lengths is None else q_lengths.astype(np.int32),
            kv_lengths.astype(np.int32))


def btnh(x: np.ndarray) -> np.ndarray:
    """``(..., heads, seq, dim)`` → ``(..., seq, heads, dim)`` (and back: the same swap)."""
    return np.swapaxes(x, -2, -3)


__all__ = ["FourD", "btnh", "four_d", "mod_features", "need", "padding_lengths", "padding_reason",
           "sdpa_case",
           "structure"]
