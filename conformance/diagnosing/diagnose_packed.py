"""The planted mistakes of packed batches, chunked attention, ALiBi, segment ids and the mods,
for ``conformance.diagnosing.diagnose``.

``PACKED_HYPOTHESES`` join ``diagnose.HYPOTHESES`` (a change of an sdpa case's inputs or options
that makes the float64 reference commit the mistake): ALiBi's sign flipped (``+slope · |i +
offset - j|``), the chunk boundary shifted by one position (``(p ± 1) // C == (j ± 1) // C``:
chunks ``[C - 1, 2C - 1)`` or ``[1, C + 1)``…, or on the query side alone, the shifted rule
replayed as a ``table`` mask mod so that the blocked steps have a replay too), and each rule
ignored (ALiBi, the chunk rule, the segment ids, ``mask_mod`` — by a blocked path that does not
evaluate it on its tiles, say — and ``score_mod``). ``varlen_mistakes`` replays a varlen case
aligned top-left (``top_left_varlen``) and with its offsets off by one (``cu_seq_q`` or
``cu_seq_k`` with every inner offset moved by ±1: a sequence that starts one token early or
late). ``score_mod_after_mask`` replays a ``score_mod`` applied after the masking (to every
position, so that the mod sees ``-inf`` and a soft-cap turns it finite again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..cases import mods, reference
from ..cases.expected import Expected, reference_attention, varlen_values
from ..cases.inputs import CaseData, varlen_pieces
from ..comparing.compare import compare


def _without(*names: str) -> Callable[[dict, dict], Any]:
    """The case without the arrays or options ``names`` (None when it has none of them)."""
    def hypothesis(a: dict, o: dict) -> Any:
        if not any(n in a or o.get(n) is not None for n in names):
            return None
        return ({k: v for k, v in a.items() if k not in names},
                {k: v for k, v in o.items() if k not in names})

    return hypothesis


def _alibi_flipped(a: dict, o: dict) -> Any:
    if "alibi_slopes" not in a:
        return None
    return {**a, "alibi_slopes": -np.asarray(a["alibi_slopes"])}, o


def _chunk_shifted(shift: int, query_only: bool = False) -> Callable[[dict, dict], Any]:
    """The chunk rule with both positions (``query_only``: the query's alone) moved by
    ``shift``, as a table mask mod."""
    def hypothesis(a: dict, o: dict) -> Any:
        chunk = o.get("chunk_size")
        if chunk is None or o.get("mask_mod") is not None:
            return None
        q_len, kv_len = a["query"].shape[-2], a["key"].shape[-2]
        offset = kv_len - q_len if o.get("causal_alignment") == "bottom_right" else 0
        p = np.arange(q_len)[:, None] + offset + shift
        j = np.arange(kv_len)[None, :] + (0 if query_only else shift)
        table = (p // chunk == j // chunk) & (p >= shift)
        options = {k: v for k, v in o.items() if k != "chunk_size"}
        return {**a, "mod_table": table[None, None]}, {**options, "mask_mod": {"name": "table"}}

    return hypothesis


_CHUNK_SHIFTED = ("the chunk boundary is shifted by one position: query position p (i + offset) "
                  "and key j share a chunk when (p ± 1) // C == (j ± 1) // C; the spec's chunks "
                  "are [0, C), [C, 2C), ... (p // C == j // C)")

_CHUNK_SHIFTED_QUERY = ("the chunk boundary is shifted by one position on the query side only: "
                        "query position p (i + offset) and key j share a chunk when (p ± 1) // C "
                        "== j // C; the spec's chunks are [0, C), [C, 2C), ... for both (p // C "
                        "== j // C)")

PACKED_HYPOTHESES = (
    ("ALiBi's sign is flipped: the bias is +slope · |i + offset - j| (nearer keys weigh less); "
     "the spec adds -slope · |i + offset - j|, flash-attention's alibi_slopes convention",
     _alibi_flipped),
    ("ALiBi is ignored", _without("alibi_slopes")),
    (_CHUNK_SHIFTED, _chunk_shifted(1)),
    (_CHUNK_SHIFTED, _chunk_shifted(-1)),
    (_CHUNK_SHIFTED_QUERY, _chunk_shifted(1, query_only=True)),
    (_CHUNK_SHIFTED_QUERY, _chunk_shifted(-1, query_only=True)),
    ("the chunk rule is ignored", _without("chunk_size")),
    ("the segment ids are ignored", _without("q_segment_ids", "kv_segment_ids")),
    ("the mask_mod is ignored (a blocked path must evaluate it on every tile it computes)",
     _without("mask_mod")),
    ("the score_mod is ignored", _without("score_mod")),
)


#: The masking rules of ``reference.attention``: those the score_mod comes before.
_RULES = ("mask", "is_causal", "window", "chunk_size", "segment_ids", "mask_mod")
#: The steps ``score_mod_after_mask`` replays: the result of every rule and mod.
_AFTER_MASK_STEPS = {"output": "output", "output_weights": "weights", "lse": "lse",
                     "blockwise_output": "output", "blockwise_lse": "lse"}

SCORE_MOD_AFTER_MASK = ("score_mod is applied after the masking: the spec applies it before, "
                        "and masked positions stay -inf (a mod applied to every position sees "
                        "-inf and may make it finite again: softcap(-inf) is -softcap)")


def score_mod_after_mask(exp: Expected, step: str, actual: np.ndarray) -> str:
    """``SCORE_MOD_AFTER_MASK`` when the float64 reference with the masking first (every rule:
    the masked positions ``-inf``) and then ``score_mod`` on every position reproduces the
    result."""
    if exp.kind != "sdpa" or exp.data.options.get("score_mod") is None or \
            step not in _AFTER_MASK_STEPS:
        return ""
    a = {k: v for k, v in exp.data.arrays.items() if k != "grad_output"}
    kwargs = mods.sdpa_kwargs(a, exp.data.options)
    score_mod = kwargs.pop("score_mod")
    with np.errstate(all="ignore"):
        q, k, v = a["query"], a["key"], a["value"]
        allowed = ~np.isneginf(reference.attention(q, k, v, **kwargs).masked_scores)

        def late(score: np.ndarray, *grid: np.ndarray) -> np.ndarray:
            return score_mod(np.where(allowed, score, -np.inf), *grid)

        free = {n: x for n, x in kwargs.items() if n not in _RULES}
        steps = reference.attention(q, k, v, score_mod=late, **free)
    alt = getattr(steps, _AFTER_MASK_STEPS[step])
    if alt.shape != exp.values[step].shape or np.array_equal(alt, exp.values[step],
                                                             equal_nan=True):
        return ""
    res = compare(step, actual, alt, exp.baseline[step], exp.dtype,
                  unspecified=exp.unspecified.get(step))
    return SCORE_MOD_AFTER_MASK if res.passed else ""


def shifted_offsets(cu_seq: np.ndarray, shift: int) -> np.ndarray:
    """``cu_seq`` with every inner offset moved by ``shift``, kept in ``[0, total]`` and
    non-decreasing (still valid offsets)."""
    out = np.asarray(cu_seq).astype(np.int64).copy()
    out[1:-1] = np.clip(out[1:-1] + shift, 0, out[-1])
    return np.maximum.accumulate(out).astype(np.asarray(cu_seq).dtype)


def top_left_varlen(data: CaseData) -> dict[str, np.ndarray]:
    """A varlen case's ``varlen_output`` and ``varlen_lse`` in float64 with every sequence's
    causal rule and window aligned top-left (the mistake; the spec aligns bottom-right)."""
    a = data.arrays
    q, v = a["query"], a["value"]
    out = {"varlen_output": np.zeros(q.shape[:-1] + v.shape[-1:]),
           "varlen_lse": np.full(q.shape[1::-1], -np.inf)}
    with np.errstate(all="ignore"):
        for piece in varlen_pieces(a, data.options):
            arrays = {n: x for n, x in piece.arrays.items() if n != "grad_output"}
            steps = reference_attention(arrays, {**piece.options,
                                                 "causal_alignment": "top_left"})
            out["varlen_output"][piece.q] = np.swapaxes(steps.output, 0, 1)
            out["varlen_lse"][:, piece.q] = steps.lse
    return out


def varlen_mistakes(exp: Expected, step: str, actual: np.ndarray) -> str:
    """A varlen case's result that top-left alignment (the case asking bottom-right) or offsets
    off by one (``cu_seq_q`` or ``cu_seq_k``, every inner offset ±1) reproduce."""
    if exp.kind != "varlen":
        return ""
    data = CaseData(exp.data.arrays, exp.data.options)
    if step in ("varlen_output", "varlen_lse") and exp.data.options.get("window_size") \
            not in (None, (-1, -1), [-1, -1]):
        alt = top_left_varlen(data)[step]
        if not np.array_equal(alt, exp.values[step], equal_nan=True) and \
                compare(step, actual, alt, exp.baseline[step], exp.dtype).passed:
            return ("wrong causal alignment in the packed batch: each sequence is aligned "
                    "top-left (offset 0); varlen_attention aligns each sequence bottom-right, "
                    "offset k_len - q_len of its own lengths (flash-attention's convention)")
    for name in ("cu_seq_q", "cu_seq_k"):
        for shift in (1, -1):
            moved = shifted_offsets(data.arrays[name], shift)
            if np.array_equal(moved, data.arrays[name]):
                continue
            with np.errstate(all="ignore"):
                alt = varlen_values(data, exp.dtype, **{name: moved}).get(step)
            if alt is None or np.array_equal(alt, exp.values[step], equal_nan=True):
                continue
            if compare(step, actual, alt, exp.baseline[step], exp.dtype).passed:
                return (f"the offsets are off by one: the result matches {name} with every "
                        f"inner offset {shift:+d} (sequence i holds tokens cu_seq[i]:"
                        f"cu_seq[i + 1], the offsets starting at 0)")
    return ""


__all__ = ["PACKED_HYPOTHESES", "SCORE_MOD_AFTER_MASK", "score_mod_after_mask", "shifted_offsets",
           "top_left_varlen", "varlen_mistakes"]
