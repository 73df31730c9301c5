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

They share the common shape (batch 2, heads 4, q_len 5, kv_len 7, head_dim 8).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .inputs import TK, TQ, B, Case, CaseData, H, fully_masked_mask, qkv, sink_logits
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
)

__all__ = ["COMBINED_CASES", "V_DIM"]
