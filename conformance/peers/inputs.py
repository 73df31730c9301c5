"""A case's inputs in the shapes and conventions the peers' frameworks take.

Every peer (``conformance.peers``) starts here: ``need`` turns what a framework cannot express
into ``NotApplicable`` (the report's "n/a"), ``sdpa_case`` keeps the cases a kernel can take at
all, and ``four_d`` gives the case's arrays as ``(batch, heads, seq, head_dim)`` with the
boolean mask already joined with the causal rule and the window when the framework takes only
an explicit mask. Nothing here imports a framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..expected import Expected
from ..results import NotApplicable


def need(condition: bool, reason: str) -> None:
    """Raise ``NotApplicable(reason)`` unless ``condition``."""
    if not condition:
        raise NotApplicable(reason)


#: What a peer lacks for a case kind other than ``sdpa`` (its cells are n/a).
_KINDS = {"module": "has no equivalent of the spec's modules",
          "merge": "is compared on single attention calls only, not on merging partial results",
          "paged": "is compared on single attention calls only, not on a paged KV cache"}


def sdpa_case(exp: Expected, peer: str, *, softcap: bool = False, sinks: bool = False
              ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The case's arrays and options, for a kernel named ``peer``; modules, merge cases, a
    given dropout keep-mask and (unless ``softcap``) soft-capping and (unless ``sinks``)
    attention sinks are n/a: a peer that takes sinks passes ``sinks=True`` and reads
    ``a["sinks"]`` itself."""
    need(exp.kind == "sdpa", f"{peer} {_KINDS.get(exp.kind, 'takes sdpa cases only')}")
    a, o = exp.data.arrays, exp.data.options
    need(softcap or o.get("softcap") is None, f"{peer} has no soft-capping")
    need(sinks or a.get("sinks") is None, f"{peer} has no attention sinks")
    need(not o.get("dropout_p"), f"{peer} cannot take a given dropout keep-mask")
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


def btnh(x: np.ndarray) -> np.ndarray:
    """``(..., heads, seq, dim)`` → ``(..., seq, heads, dim)`` (and back: the same swap)."""
    return np.swapaxes(x, -2, -3)


__all__ = ["FourD", "btnh", "four_d", "need", "sdpa_case", "structure"]
