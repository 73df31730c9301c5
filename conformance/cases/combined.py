"""Cases where features meet: several arguments of ``spec.PIPELINE_WITH_MODS`` in one call,
appended to ``conformance.cases.CASES``.

A single-feature case cannot see the order of two steps: ALiBi added before the soft-cap
instead of after it, a ``score_mod`` applied before the bias, a negative segment id taken for
padding all pass every case that uses one feature at a time. These cases put the features
together, at magnitudes where each step's order changes the result: the soft-cap saturates,
and the bias, ALiBi and an additive ``score_mod`` (an ALiBi of other slopes) each move scores
by about one, so adding any of them before the soft-cap instead of after it changes the
weights. They are also what the quick profile (``running.profiles``)
runs first: one row that uses many features costs JAX one program, where one row per
feature costs one each.

The ``combined_pairs_*`` cases complete the pairwise coverage: every pair of features of
``running.profiles.PAIR_FEATURES`` that the spec lets meet meets in one case at least
(``profiles.uncovered_pairs``). They were chosen greedily, each a valid call with many rules at
once, loose enough that every masking rule still removes some keys and leaves most rows some: one
without a boolean mask or dropout (so the blockwise steps run it), and one per causal alignment
with both (a call has one alignment, and both disable the blockwise steps).

They share the common shape (batch 2, heads 4, q_len 5, kv_len 7, head_dim 8), but for
``combined_long_keys``: one head, 3 queries over 384 keys, where a softmax sum or a weighted
sum accumulated in float16 instead of the compute dtype (float32) fails the float16 row, which
the common shape's 7 keys cannot show.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .inputs import TK, TQ, B, Case, CaseData, D, H, fully_masked_mask, qkv, sink_logits
from .packed import OFFSET, SLOPES

#: The value feature size of the combined cases (not head_dim: v_dim is used too).
V_DIM = 6


def _order_of_steps(rng: np.random.Generator) -> CaseData:
    base = qkv(rng, kv_heads=2, v_dim=V_DIM)
    arrays = {**base, "query": base["query"] * 5.0 ** 0.5, "key": base["key"] * 5.0 ** 0.5,
              "bias": rng.standard_normal((1, H, TQ, TK)), "alibi_slopes": SLOPES,
              "mod_slopes": SLOPES[::-1] / 2, "sinks": sink_logits(rng)}
    options: dict[str, Any] = {
        "scale": 0.5, "softcap": 2.5, "is_causal": True, "causal_alignment": "bottom_right",
        "window": (4, None), "score_mod": {"name": "alibi", "offset": OFFSET}}
    return CaseData(arrays, options)


def _documents_in_chunks(rng: np.random.Generator) -> CaseData:
    """Segment ids where -1 is an ordinary id (queries and keys share it), a query whose id no
    key has (a fully masked row), chunks of 4, causal top-left and a sliding-window
    ``mask_mod`` (3 keys back), over one kv head."""
    kv_ids = np.array([[-1, -1, 0, 0, 0, 1, 1], [2, 2, 2, -5, -5, -5, 3]])
    q_ids = kv_ids[:, :TQ].copy()
    q_ids[0, 2] = 9  # no key has id 9
    arrays = {**qkv(rng, kv_heads=1), "q_segment_ids": q_ids, "kv_segment_ids": kv_ids}
    window = {"name": "sliding_window", "left": 3, "right": 0, "offset": 0}
    return CaseData(arrays, {"is_causal": True, "chunk_size": 4, "mask_mod": window})


def _masked_dropout(rng: np.random.Generator) -> CaseData:
    arrays = {**qkv(rng), "mask": fully_masked_mask(rng), "bias": rng.standard_normal((H, TQ, TK)),
              "dropout_mask": rng.random((B, H, TQ, TK)) >= 0.3, "sinks": sink_logits(rng)}
    return CaseData(arrays, {"dropout_p": 0.3, "scale": 0.7})


def _mostly_true(rng: np.random.Generator, p: float = 0.8) -> np.ndarray:
    """A random boolean ``(B, H, TQ, TK)``, each entry True with probability ``p``."""
    return rng.random((B, H, TQ, TK)) < p


def _pairs(rng: np.random.Generator, kv_heads: int, offset: int,
           kv_ids: list[list[int]]) -> dict[str, np.ndarray]:
    """The arrays every ``combined_pairs_*`` case has: scores x5 (the soft-cap saturates),
    ALiBi and an ALiBi ``score_mod`` of other slopes, segment ids (the queries' those of their
    key positions, query i at i + ``offset``) and a ``mask_mod`` table, v_dim 6."""
    base = qkv(rng, kv_heads=kv_heads, v_dim=V_DIM)
    ids = np.array(kv_ids)
    return {**base, "query": base["query"] * 5.0 ** 0.5, "key": base["key"] * 5.0 ** 0.5,
            "alibi_slopes": SLOPES, "mod_slopes": SLOPES[::-1] / 2,
            "q_segment_ids": ids[:, offset:offset + TQ], "kv_segment_ids": ids,
            "mod_table": _mostly_true(rng, 0.85)}


def _pairs_blockwise(rng: np.random.Generator) -> CaseData:
    """The blockwise pairs; its ``mask_mod`` a sliding window (4 keys back, 1 ahead), not the
    table: jax_attn evaluates a mask_mod at trace time, tile by tile, and a table's gathers
    there cost the quick profile, which runs this case, about 40 small programs more."""
    arrays = {**_pairs(rng, 2, 0, [[0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1]]),
              "bias": rng.standard_normal((1, H, TQ, TK)), "sinks": sink_logits(rng)}
    del arrays["mod_table"]
    options: dict[str, Any] = {
        "scale": 0.6, "softcap": 2.5, "is_causal": True, "window": (2, None), "chunk_size": 4,
        "score_mod": {"name": "alibi", "offset": 0},
        "mask_mod": {"name": "sliding_window", "left": 4, "right": 1, "offset": 0}}
    return CaseData(arrays, options)


def _pairs_masked_dropout(offset: int) -> Callable[[np.random.Generator], CaseData]:
    alignment = "bottom_right" if offset else "top_left"

    def build(rng: np.random.Generator) -> CaseData:
        arrays = {**_pairs(rng, 1 if offset else 2, offset,
                           [[0, 0, 0, 1, 1, 1, 1], [3, 3, 5, 5, 5, 5, 5]]),
                  "bias": rng.standard_normal((H, TQ, TK)), "mask": _mostly_true(rng),
                  "dropout_mask": rng.random((B, H, TQ, TK)) >= 0.25}
        options: dict[str, Any] = {
            "scale": 0.8, "softcap": 3.0, "is_causal": True, "causal_alignment": alignment,
            "window": (3, None), "dropout_p": 0.25,
            "score_mod": {"name": "alibi", "offset": offset}, "mask_mod": {"name": "table"}}
        if offset:  # chunks of 5 bite bottom-right only (top-left, queries 0-4 share one)
            options["chunk_size"] = 5
        return CaseData(arrays, options)
    return build


#: The key axis of ``combined_long_keys``: long enough that a row sum and a weighted sum
#: accumulated in float16 drift past the tolerance (spec.COMPUTE_DTYPE: float32 for half
#: inputs), short enough to stay a small program.
LONG_KV = 384


def _long_keys(rng: np.random.Generator) -> CaseData:
    """One sequence, one head, 3 queries over ``LONG_KV`` keys: small scores (the weights near
    uniform, so the row sum reaches hundreds, where float16 steps are 0.25) and values of
    mean 1 (outputs about 1, whose running sum in float16 rounds at every key), a bias."""
    base = {"query": rng.standard_normal((1, 1, 3, D)) * 0.3,
            "key": rng.standard_normal((1, 1, LONG_KV, D)),
            "value": rng.standard_normal((1, 1, LONG_KV, D)) * 0.5 + 1.0}
    return CaseData({**base, "bias": rng.standard_normal((1, 1, 3, LONG_KV)) * 0.2})


COMBINED_CASES: tuple[Case, ...] = (
    Case("combined_order_of_steps",
         "soft-cap 2.5, then bias, ALiBi and an ALiBi score_mod (the spec's order), scale 0.5, "
         "sinks, window (4, None) with causal bottom-right, 4 over 2 heads, v_dim 6",
         _order_of_steps),
    Case("combined_documents_in_chunks",
         "segment ids with negative ids (no id is special) and a query no key shares, chunks of "
         "4, causal top-left and a sliding-window mask_mod, 4 heads over 1",
         _documents_in_chunks),
    Case("combined_masked_dropout",
         "a boolean mask with fully masked rows and a fully masked head, a bias, sinks, dropout "
         "0.3 with a keep-mask (after the softmax with the sinks), scale 0.7",
         _masked_dropout),
    Case("combined_pairs_blockwise",
         "causal top-left, window (2, None), chunks of 4, segment ids, a sliding-window "
         "mask_mod, soft-cap 2.5, bias, ALiBi and an ALiBi score_mod, sinks, scale 0.6, 4 over "
         "2 heads, v_dim 6 (blockwise too)",
         _pairs_blockwise),
    Case("combined_pairs_masked_dropout_top_left",
         "a boolean mask and dropout 0.25 with causal top-left, window (3, None), segment ids, "
         "a mask_mod table, soft-cap 3, bias, ALiBi and an ALiBi score_mod, scale 0.8, "
         "4 over 2 heads, v_dim 6",
         _pairs_masked_dropout(0)),
    Case("combined_pairs_masked_dropout_bottom_right",
         "a boolean mask and dropout 0.25 with causal bottom-right, window (3, None), chunks of "
         "5, segment ids, a mask_mod table, soft-cap 3, bias, ALiBi and an ALiBi score_mod, "
         "scale 0.8, 4 over 1 head, v_dim 6",
         _pairs_masked_dropout(TK - TQ)),
    Case("combined_long_keys",
         f"{LONG_KV} keys, 3 queries, one head: near-uniform weights over values of mean 1, a "
         "bias (sums over the keys must be accumulated in the compute dtype: float32 for half "
         "inputs)",
         _long_keys),
)

__all__ = ["COMBINED_CASES", "V_DIM"]
