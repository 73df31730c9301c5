"""The cases of packed batches, chunked attention, ALiBi, segment ids and the mods (issue 24),
appended to ``conformance.cases.CASES``.

sdpa cases (``cases``' kinds) with the arguments of ``spec.PIPELINE_WITH_MODS``: option
``chunk_size``; arrays ``alibi_slopes (heads,)`` (cast to the case's dtype) and the pair
``q_segment_ids (batch, q_len)`` / ``kv_segment_ids (batch, kv_len)`` (int64, passed as
``segment_ids=(q_ids, kv_ids)``); options ``mask_mod`` / ``score_mod`` naming a mod of
``conformance.cases.mods`` (its arrays ``mod_*`` among the inputs). They share the common shape
(batch 2, heads 4, q_len 5, kv_len 7, head_dim 8), so that JAX compiles few programs, and the
causal ones are bottom-right (offset 2), where chunks, ALiBi's distance and the mods' offset
all move with the alignment. The slopes are ALiBi's for 4 heads, 2^-2, 2^-4, 2^-6, 2^-8, times
4 so that the bias matters at these lengths.

``varlen`` cases (a new kind): a packed batch for ``varlen_attention`` (``spec.VARLEN``):
``query (total_q, heads, head_dim)``, ``key``/``value (total_k, kv_heads, ·)``, ``cu_seq_q`` /
``cu_seq_k (N + 1,)`` int32 offsets, optional ``seqused_k (N,)`` and ``sinks (heads,)``;
options ``max_q``, ``max_k``, ``window_size`` and ``enable_gqa``. Their expected values are the
float64 attention of one sequence at a time, bottom-right aligned
(``case_inputs.varlen_pieces``), and the gradients those of ``varlen_attention_vjp``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .inputs import TK, TQ, B, Case, CaseData, H, qkv, varlen

#: ALiBi's slopes for 4 heads, times 4 (the cases' sequences are short).
SLOPES = 4.0 * 2.0 ** -np.arange(2, 10, 2)
#: The bottom-right offset of the common shape, q_len 5 over kv_len 7.
OFFSET = TK - TQ


def _sdpa(arrays_fn: Callable[[np.random.Generator], dict[str, np.ndarray]],
          **options: Any) -> Callable[[np.random.Generator], CaseData]:
    def build(rng: np.random.Generator) -> CaseData:
        return CaseData(arrays_fn(rng), dict(options))

    return build


def _plus(extra: dict[str, Any] | Callable[[np.random.Generator], dict[str, Any]],
          **qkv_kw: Any) -> Callable[[np.random.Generator], dict[str, np.ndarray]]:
    """``qkv(rng, **qkv_kw)`` and ``extra`` (arrays, or a function of the generator)."""
    def arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
        base = qkv(rng, **qkv_kw)
        more = extra(rng) if callable(extra) else extra
        return {**base, **{k: np.array(v) for k, v in more.items()}}

    return arrays


def _documents() -> dict[str, np.ndarray]:
    """Packed documents over the 7 keys of each sequence; the queries are the last 5 tokens
    (bottom-right), query 1 of sequence 1 padding (id -1, no key has it: a fully masked row)."""
    kv_ids = np.array([[0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 0, 1, 1, 1]])
    q_ids = kv_ids[:, OFFSET:].copy()
    q_ids[1, 1] = -1
    return {"q_segment_ids": q_ids, "kv_segment_ids": kv_ids}


def _mod_ids(rng: np.random.Generator) -> dict[str, np.ndarray]:
    ids = _documents()
    return {"mod_q_ids": ids["q_segment_ids"], "mod_kv_ids": ids["kv_segment_ids"]}


def _random_table(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A random per-element mask ``(B, H, TQ, TK)``: ~40 % masked, one fully masked row."""
    table = rng.random((B, H, TQ, TK)) < 0.6
    table[1, 2, 3] = False
    return {"mod_table": table}


def _scaled(factor: float, **extra: Any) -> Callable[[np.random.Generator], dict[str, Any]]:
    def arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
        base = qkv(rng)
        return {**base, "query": base["query"] * factor, "key": base["key"] * factor, **extra}

    return arrays


def _varlen(q_lens: tuple[int, ...], k_lens: tuple[int, ...], window_size: tuple[int, int],
            kv_heads: int = H, seqused_k: tuple[int, ...] | None = None, sinks: bool = False,
            **options: Any) -> Callable[[np.random.Generator], CaseData]:
    """A varlen case: max_q/max_k the longest sequences, enable_gqa where kv_heads < H."""
    arrays = varlen(q_lens, k_lens, kv_heads, seqused_k, sinks)

    def build(rng: np.random.Generator) -> CaseData:
        return CaseData(arrays(rng), {"max_q": max(q_lens), "max_k": max(k_lens),
                                      "window_size": window_size,
                                      "enable_gqa": kv_heads != H, **options})

    return build


def _causal_mod(offset: int = OFFSET) -> dict[str, Any]:
    return {"name": "causal", "offset": offset}


PACKED_CASES: tuple[Case, ...] = (
    Case("chunked_causal_bottom_right",
         "chunk_size 3, causal, bottom-right: query i at position i + 2, chunks [0,3) [3,6) [6,7)",
         _sdpa(_plus({}), chunk_size=3, is_causal=True, causal_alignment="bottom_right")),
    Case("alibi_gqa", "ALiBi slopes 2^-0..2^-6, top-left, no causal rule, 4 over 2 heads",
         _sdpa(_plus({"alibi_slopes": SLOPES}, kv_heads=2))),
    Case("alibi_causal_bottom_right",
         "ALiBi with causal bottom-right: flash-attention's -slope * |i + k_len - q_len - j|",
         _sdpa(_plus({"alibi_slopes": SLOPES}), is_causal=True, causal_alignment="bottom_right")),
    Case("segment_ids_bottom_right",
         "packed documents: segment id pairs, causal bottom-right, a padding query (id -1)",
         _sdpa(_plus(_documents()), is_causal=True, causal_alignment="bottom_right")),
    Case("mods_causal_alibi",
         "mask_mod causal and score_mod ALiBi, offset 2: equal alibi_causal_bottom_right",
         _sdpa(_plus({"mod_slopes": SLOPES}), mask_mod=_causal_mod(),
               score_mod={"name": "alibi", "offset": OFFSET})),
    Case("mods_window_softcap", "mask_mod sliding window (2, 1) and score_mod soft-cap 2.5",
         _sdpa(_scaled(5.0 ** 0.5), mask_mod={"name": "sliding_window", "left": 2, "right": 1,
                                              "offset": 0},
               score_mod={"name": "softcap", "softcap": 2.5})),
    Case("mask_mod_prefix_lm", "mask_mod prefix-LM: keys 0-4 seen by all, causal (offset 2) after",
         _sdpa(_plus({}), mask_mod={"name": "prefix_lm", "prefix_length": 5, "offset": OFFSET})),
    Case("mask_mod_document", "mask_mod document ids (the segment_ids case's, padding query too)",
         _sdpa(_plus(_mod_ids), mask_mod={"name": "document"})),
    Case("mask_mod_random",
         "mask_mod from a random per-element table, a fully masked row, 4 over 2 heads",
         _sdpa(_plus(_random_table, kv_heads=2), mask_mod={"name": "table"})),
    Case("varlen_causal_gqa",
         "packed: q lengths 3 0 1 4 2 over k lengths 5 3 1 2 0, causal (-1, 0), 4 over 2 heads",
         _varlen((3, 0, 1, 4, 2), (5, 3, 1, 2, 0), (-1, 0), kv_heads=2), kind="varlen"),
    Case("varlen_window_sinks",
         "packed: window (2, 0), seqused_k 5 3 4 of 6 3 6 keys, sinks, softcap 2.5",
         _varlen((4, 1, 6), (6, 3, 6), (2, 0), seqused_k=(5, 3, 4), sinks=True, softcap=2.5),
         kind="varlen"),
)

__all__ = ["OFFSET", "PACKED_CASES", "SLOPES"]
