"""torch's FlexAttention as a peer (column ``torch.flex``), with the row log-sum-exp.

``torch.nn.attention.flex_attention.flex_attention(query, key, value, score_mod, block_mask,
scale, enable_gqa, return_aux=AuxRequest(lse=True))``, called eagerly on the CPU (torch 2.13:
without ``torch.compile`` it traces the mods with dynamo and runs its unfused reference
implementation, and warns so; compiling needs Inductor and a C++ toolchain). It gives the
``output`` and the ``lse`` steps (``return_lse=True`` is deprecated in favour of
``return_aux``). The eager implementation computes the scores in float32 (float64 for float64
inputs), evaluates ``score_mod`` and ``mask_mod`` on every position (the block mask's sparsity
only matters to compiled kernels, so block-sparse kernel bugs cannot show here), gives a fully
masked row output 0 and lse ``-inf``, and returns the lse in that working precision: all as the
spec (``spec.KNOWN_DIFFERENCES`` has one entry, the lse of a ``+inf`` score).

The case maps onto FlexAttention's two hooks, written as its users write them (``mask_mod
(b, h, q_idx, kv_idx)``, ``score_mod(score, b, h, q_idx, kv_idx)`` on index tensors): the
boolean mask, the causal rule in the case's alignment and the window become one table that a
``mask_mod`` reads; the chunk rule (``(q_idx + offset) // C == kv_idx // C``), the segment ids
(``q_ids[b, q_idx] == kv_ids[b, kv_idx]``, FlexAttention's document mask) and the case's
``mask_mod`` (``cases.mods``' registry, each rewritten here in torch from its definition,
not taken from the harness) are ANDed with it (``create_block_mask``); soft-capping, the bias,
ALiBi (``score - slope[h] · |q_idx + offset - kv_idx|``) and the case's ``score_mod`` become one
``score_mod`` in the spec's order (``spec.PIPELINE_WITH_MODS``), after the scale FlexAttention
applies itself. Grouped-query heads take ``enable_gqa=True``. 2-D and 3-D inputs get leading
axes of 1.

A packed batch (the ``varlen`` cases) is FlexAttention's document mask over the packed tokens:
batch 1, ``(1, heads, total, dim)``, a ``mask_mod`` that allows query token ``q`` and key token
``k`` of the same sequence with the key in use (``seqused_k``) and inside the sequence's
bottom-right ``window_size``, giving ``varlen_output`` and ``varlen_lse``.

Not expressible (n/a): attention sinks (FlexAttention has none: a ``score_mod`` sees one key's
score at a time and cannot add a column to the softmax), a given dropout keep-mask, more than
one batch axis, a paged (``block_table``) packed batch and a mod this adapter has no torch form
of.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from ..cases.expected import Expected
from ..running import backends
from .inputs import four_d, need, sdpa_case

Rule = Callable[..., Any]


def _full(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``x`` broadcast to ``shape``, as a contiguous array (FlexAttention's hooks index it)."""
    return np.ascontiguousarray(np.broadcast_to(x, shape))


def _case_mask_mod(option: dict[str, Any], a: dict[str, np.ndarray],
                   target: tuple[int, ...]) -> Rule:
    """The case's ``mask_mod`` (a name of ``conformance.cases.mods.MASK_MODS``) written in torch."""
    t = backends.torch_asarray
    name, off = option.get("name"), option.get("offset", 0)
    if name == "causal":
        return lambda b, h, q, k: q + off >= k
    if name == "sliding_window":
        left, right = option["left"], option["right"]

        def window(b: Any, h: Any, q: Any, k: Any) -> Any:
            d = k - q - off
            ok = d >= -left if left is not None else d == d
            return ok & (d <= right) if right is not None else ok

        return window
    if name == "prefix_lm":
        prefix = option["prefix_length"]
        return lambda b, h, q, k: (k < prefix) | (q + off >= k)
    if name == "document":
        q_ids = t(_full(a["mod_q_ids"], (target[0], target[2])))  # (B, Tq)
        kv_ids = t(_full(a["mod_kv_ids"], (target[0], target[3])))  # (B, Tk)
        return lambda b, h, q, k: q_ids[b, q] == kv_ids[b, k]
    if name == "table":
        table = t(_full(np.asarray(a["mod_table"], bool), target))  # (B, H, Tq, Tk)
        return lambda b, h, q, k: table[b, h, q, k]
    need(False, f"the torch.flex adapter has no FlexAttention form of mask_mod {name!r}")
    raise AssertionError  # unreachable: need raised


def _slopes(slopes: np.ndarray, working: Any) -> Any:
    """ALiBi's slopes ``(heads,)`` in FlexAttention's working precision (exact)."""
    import torch

    return torch.as_tensor(np.asarray(slopes).astype(np.float64)).to(working)


def _mask_rules(exp: Expected, mask: np.ndarray | None, target: tuple[int, ...]) -> list[Rule]:
    """The ``mask_mod`` rules of an sdpa case, to be ANDed: the joined table (boolean mask,
    causal rule, window), the chunks, the segment ids, the case's ``mask_mod``."""
    a, o = exp.data.arrays, exp.data.options
    t = backends.torch_asarray
    rules: list[Rule] = []
    if mask is not None:
        allowed = t(_full(mask, target))  # (B, H, Tq, Tk) bool
        rules.append(lambda b, h, q, k: allowed[b, h, q, k])
    off = target[3] - target[2] if o.get("causal_alignment") == "bottom_right" else 0
    chunk = o.get("chunk_size")
    if chunk is not None:
        rules.append(lambda b, h, q, k: (q + off >= 0) & ((q + off) // chunk == k // chunk))
    if "q_segment_ids" in a:
        q_ids = t(_full(a["q_segment_ids"], (target[0], target[2])))  # (B, Tq)
        kv_ids = t(_full(a["kv_segment_ids"], (target[0], target[3])))  # (B, Tk)
        rules.append(lambda b, h, q, k: q_ids[b, q] == kv_ids[b, k])
    if o.get("mask_mod") is not None:
        rules.append(_case_mask_mod(o["mask_mod"], a, target))
    return rules


def _score_rules(exp: Expected, bias: np.ndarray | None, target: tuple[int, ...],
                 working: Any) -> list[Rule]:
    """The ``score_mod`` rules of an sdpa case, to be chained in the spec's order: soft-cap,
    bias, ALiBi, the case's ``score_mod``."""
    import torch

    a, o = exp.data.arrays, exp.data.options
    rules: list[Rule] = []
    cap = o.get("softcap")
    if cap is not None:
        rules.append(lambda s, b, h, q, k: cap * torch.tanh(s / cap))
    if bias is not None:
        table = backends.torch_asarray(_full(bias, target))  # (B, H, Tq, Tk)
        rules.append(lambda s, b, h, q, k: s + table[b, h, q, k])
    off = target[3] - target[2] if o.get("causal_alignment") == "bottom_right" else 0
    if "alibi_slopes" in a:
        slopes = _slopes(a["alibi_slopes"], working)
        rules.append(lambda s, b, h, q, k: s - slopes[h] * (q + off - k).abs())
    mod = o.get("score_mod")
    if mod is not None:
        name = mod.get("name")
        if name == "alibi":
            mod_slopes, mod_off = _slopes(a["mod_slopes"], working), mod["offset"]
            rules.append(lambda s, b, h, q, k: s - mod_slopes[h] * (q + mod_off - k).abs())
        elif name == "softcap":
            mod_cap = float(mod["softcap"])
            rules.append(lambda s, b, h, q, k: mod_cap * torch.tanh(s / mod_cap))
        else:
            need(False, f"the torch.flex adapter has no FlexAttention form of score_mod {name!r}")
    return rules


def _all(rules: list[Rule]) -> Rule:
    """One ``mask_mod``: the AND of ``rules``."""
    def mask_mod(b: Any, h: Any, q: Any, k: Any) -> Any:
        allowed = rules[0](b, h, q, k)
        for rule in rules[1:]:
            allowed = allowed & rule(b, h, q, k)
        return allowed

    return mask_mod


def _chain(rules: list[Rule]) -> Rule:
    """One ``score_mod``: ``rules`` applied in order."""
    def score_mod(score: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
        for rule in rules:
            score = rule(score, b, h, q, k)
        return score

    return score_mod


def _flex(q: Any, k: Any, v: Any, mask_rules: list[Rule], score_rules: list[Rule],
          scale: float | None, grouped: bool) -> tuple[Any, Any]:
    """``flex_attention`` eagerly on 4-D tensors: ``(output (B, H, Tq, Dv), lse (B, H, Tq))``."""
    import torch
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    batch, heads, q_len = q.shape[:3]
    block_mask = None if not mask_rules else create_block_mask(
        _all(mask_rules), batch, heads, q_len, k.shape[2], device="cpu")
    kwargs: dict[str, Any] = {"block_mask": block_mask,
                              "score_mod": _chain(score_rules) if score_rules else None,
                              "enable_gqa": grouped, "return_aux": AuxRequest(lse=True)}
    if scale is not None:
        kwargs["scale"] = float(scale)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        out, aux = flex_attention(q, k, v, **kwargs)
    need(aux.lse is not None, "FlexAttention returned no lse")
    return out, aux.lse


def _working(dtype: Any) -> Any:
    """FlexAttention's eager working precision: float64 for float64 inputs, else float32."""
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def torch_flex(exp: Expected) -> dict[str, np.ndarray]:
    """The ``torch.flex`` peer: ``output (..., heads, q_len, v_dim)`` and ``lse (..., heads,
    q_len)`` from ``flex_attention(..., return_aux=AuxRequest(lse=True))``, eagerly; for a
    ``varlen`` case ``varlen_output (total_q, heads, v_dim)`` and ``varlen_lse (heads,
    total_q)`` (``torch_flex_varlen``)."""
    if exp.kind == "varlen":
        return torch_flex_varlen(exp)
    a, o = sdpa_case(exp, "FlexAttention", softcap=True, mods=True)
    x = four_d(exp, "FlexAttention", join_structure=True)  # mask: boolean mask, causal, window
    t = backends.torch_asarray
    q, k, v = t(x.query), t(x.key), t(x.value)
    target = (*x.query.shape[:3], x.key.shape[2])  # (B, H, Tq, Tk)
    out, lse = _flex(q, k, v, _mask_rules(exp, x.mask, target),
                     _score_rules(exp, x.bias, target, _working(q.dtype)), o.get("scale"),
                     x.grouped)
    lse_shape = x.output_shape[:-1]  # the spec's (..., heads, q_len)
    return {"output": backends.torch_to_numpy(out).reshape(x.output_shape),
            "lse": backends.torch_to_numpy(lse).reshape(lse_shape)}


def _tokens(cu_seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each packed token's sequence and position in it, from the ``(N + 1,)`` offsets."""
    cu = np.asarray(cu_seq, np.int64)
    seq = np.repeat(np.arange(len(cu) - 1), np.diff(cu))  # (total,)
    return seq, np.arange(int(cu[-1])) - cu[seq]


def torch_flex_varlen(exp: Expected) -> dict[str, np.ndarray]:
    """A packed batch through FlexAttention's document mask: ``varlen_output (total_q, heads,
    v_dim)`` and ``varlen_lse (heads, total_q)``. Sinks and ``block_table`` are n/a."""
    import torch

    a, o = exp.data.arrays, exp.data.options
    need(a.get("sinks") is None, "FlexAttention has no attention sinks")
    need(a.get("block_table") is None, "the torch.flex adapter does not gather paged keys")
    t = backends.torch_asarray
    q, k, v = (t(np.ascontiguousarray(np.swapaxes(a[n], 0, 1)))[None]
               for n in ("query", "key", "value"))  # (1, heads, total, dim)
    seq_q, pos_q = _tokens(a["cu_seq_q"])
    seq_k, pos_k = _tokens(a["cu_seq_k"])
    q_lens, k_lens = np.diff(a["cu_seq_q"]), np.diff(a["cu_seq_k"])
    used = np.asarray(a["seqused_k"]) if a.get("seqused_k") is not None else k_lens
    left, right = (int(w) for w in o.get("window_size", (-1, -1)))
    doc_q, doc_k, at_q, at_k = (torch.as_tensor(x.astype(np.int64))
                                for x in (seq_q, seq_k, pos_q, pos_k))
    in_use = torch.as_tensor(used.astype(np.int64))  # (N,)
    offset = torch.as_tensor((used - q_lens).astype(np.int64))  # (N,) bottom-right per sequence

    def document(b: Any, h: Any, qi: Any, ki: Any) -> Any:
        same = doc_q[qi] == doc_k[ki]
        d = at_k[ki] - at_q[qi] - offset[doc_q[qi]]  # key position - aligned query position
        ok = same & (at_k[ki] < in_use[doc_k[ki]])
        ok = ok & (d >= -left) if left >= 0 else ok
        return ok & (d <= right) if right >= 0 else ok

    score_rules: list[Rule] = []
    cap = o.get("softcap")
    if cap is not None:
        score_rules.append(lambda s, b, h, qi, ki: cap * torch.tanh(s / cap))
    out, lse = _flex(q, k, v, [document], score_rules, o.get("scale"),
                     bool(o.get("enable_gqa")))
    return {"varlen_output": np.swapaxes(backends.torch_to_numpy(out)[0], 0, 1),
            "varlen_lse": backends.torch_to_numpy(lse)[0]}


__all__ = ["torch_flex", "torch_flex_varlen"]
