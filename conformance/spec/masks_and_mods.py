"""Chunked local attention, ALiBi, segment ids, score_mod and mask_mod.

Five more arguments of ``scaled_dot_product_attention``, its VJP, ``blockwise_attention`` and its
VJP, in every backend: ``chunk_size`` (Llama 4's chunked local attention), ``alibi_slopes``
(ALiBi, flash-attention's convention), ``segment_ids`` (packed documents), and FlexAttention's
callables ``score_mod`` and ``mask_mod``. Each backend's ``masks`` module has ready-made mods,
each equal to a dedicated argument (``READY_MADE_MODS``).
"""

from __future__ import annotations

#: Where the new steps sit in the pipeline, in words.
PIPELINE_WITH_MODS = (
    "scores = (query @ keyᵀ) · scale → soft-cap → + bias → + ALiBi → score_mod → masking → "
    "softmax (with the sinks) → dropout → @ value. Masking replaces by -inf every position "
    "that is not allowed, a position being allowed when the boolean mask, the causal rule, the "
    "window, the chunk rule, the segment ids and mask_mod all allow it (AND). ALiBi comes after "
    "the soft-cap, as in flash-attention (its kernel caps, then adds the ALiBi bias); the bias "
    "and ALiBi are both added, so their order does not matter; score_mod sees the score after "
    "all of them and before masking, so it may rewrite any of them. The sink logits are none "
    "of these: neither biased, nor modified by score_mod, nor masked. The lse (return_lse) is "
    "that of the scores after every step here."
)

#: Chunked local attention (``chunk_size``), in words.
CHUNKED = (
    "chunk_size=C (a positive int, or None): Llama 4's chunked local attention. Query i sits "
    "at key position p = i + offset, the offset of the causal rule (0 for causal_alignment="
    "'top_left', kv_len - q_len for 'bottom_right'); it may attend key j only if p // C == "
    "j // C (floor division: the chunks [0, C), [C, 2C), ...; a negative position is in no "
    "key's chunk, so its row is fully masked). It combines with is_causal (Llama 4 uses both) "
    "and with every other rule by AND. C >= kv_len with q_len == kv_len changes nothing. Not a "
    "positive int: ValueError (scaled_dot_product_attention: chunk_size must be a positive int "
    "(keys per chunk) or None; got chunk_size=0). In jax_attn chunk_size is static."
)

#: ALiBi (``alibi_slopes``), in words.
ALIBI = (
    "alibi_slopes: one slope per query head, shape (heads,) ((1,) for 2-D inputs), floating "
    "point; flash-attention's alibi_slopes convention. The bias -slope_h · |i + offset - j| is "
    "added to the score of query i and key j in head h, with the offset of the causal rule, "
    "after the scale and the soft-cap (PIPELINE_WITH_MODS): the bias is 0 at the query's own "
    "position and falls with the distance on both sides (positive slopes: nearer keys weigh "
    "more). With causal_alignment='bottom_right' this is exactly flash-attention's formula, "
    "-alibi_slope · |i + seqlen_k - seqlen_q - j| (its causal rule is bottom-right too); with "
    "the default 'top_left' and q_len != kv_len the positions are this project's top-left ones, "
    "the same as those of is_causal and window. flash-attention's causal kernel adds "
    "+slope · j instead, which differs by slope · (i + offset) per row: equal weights and "
    "outputs, an lse larger by that constant. Computed in the compute dtype (the distance is "
    "exact). Query heads sharing a kv head keep their own slope. The slopes are constants: no "
    "gradient reaches them (the VJPs return none for them). Wrong dtype: TypeError; wrong "
    "shape: ValueError (scaled_dot_product_attention: alibi_slopes must have shape (heads,) = "
    "(4,), one slope per query head; got alibi_slopes.shape=(3,)). ALiBi's slopes for 8 heads "
    "are 2^-1, 2^-2, ..., 2^-8 (geometric, 2^(-8/heads) apart)."
)

#: Segment ids (``segment_ids``), in words.
SEGMENT_IDS = (
    "segment_ids: integer ids of each query and each key's segment (document); query i may "
    "attend key j only if their ids are equal, so packed documents never see each other. "
    "Either a pair (query_segment_ids, kv_segment_ids) shaped (..., q_len) and (..., kv_len), "
    "... the batch axes of the inputs (size-1 or missing batch axes broadcast; (q_len,) for "
    "2-D and 3-D inputs), or one array when queries and keys share positions (q_len == kv_len, "
    "self-attention over a packed sequence). Equality is all there is: no id is special. A "
    "padding query given the same id as padding keys attends them (its row is not 0); give "
    "padding queries an id that no key has (e.g. -1 for queries, -2 for keys) to make their "
    "rows fully masked, hence 0. Combines with is_causal, window and chunk_size by AND (the "
    "causal rule still uses positions in the whole packed sequence). Not integers: TypeError; "
    "wrong shape, one array with q_len != kv_len, or a list or tuple that is not a pair: "
    "ValueError. In jax_attn the ids may be traced."
)

#: ``score_mod``, in words.
SCORE_MOD = (
    "score_mod(score, batch, head, q_idx, kv_idx) -> score: FlexAttention's score_mod, a "
    "callable of the backend's array operations, applied elementwise after ALiBi and before "
    "masking (PIPELINE_WITH_MODS). score is the scores (or a tile of them) in the compute "
    "dtype; batch, head, q_idx, kv_idx are integer arrays that broadcast against it "
    "(MOD_INDICES). It must return floating-point scores broadcastable to score (TypeError / "
    "ValueError otherwise) and compute each entry from that entry's score and indices only: "
    "the blocked paths call it tile by tile (numpy_attn from its worker threads, so it must "
    "not keep state). Its result at a masked position is replaced by "
    "-inf. Gradients flow through it with respect to score: by autodiff in jax_attn (the "
    "callable is a static argument: it works under jit, vmap and grad) and torch_attn "
    "(autograd); numpy_attn's hand-written VJPs need its derivative, a method "
    "derivative(score, batch, head, q_idx, kv_idx) -> d score_mod / d score, which the "
    "ready-made score mods have; for a callable without one they raise NotImplementedError "
    "naming the ways out (a ready-made mod, a derivative method, jax_attn or torch_attn). "
    "Arrays the callable captures (closure cells, defaults, a callable object's attributes) "
    "get their gradients, FlexAttention's rule, at every size: in torch_attn a captured "
    "tensor that requires grad under grad mode, in jax_attn a captured tracer (under jit "
    "every array passed in is one), sends the call past the fast paths, whose custom "
    "gradients know only their inputs, to the explicit steps differentiated by autodiff: the "
    "same results within the tolerance rule, holding O(q_len · kv_len) scores per head. A "
    "mask_mod's arrays get none (its result is boolean), so it keeps the fast paths. The "
    "ready-made mods' arrays are constants by design (they "
    "are not inspected, and no gradient reaches them on any path: torch_attn detaches them, "
    "jax_attn stops their gradient; give a learned table by a callable of your own, or the "
    "bias argument). numpy_attn has no autodiff: it cannot differentiate an arbitrary callable, "
    "so its VJPs return no gradient for captured arrays. blockwise_attention's custom "
    "gradient is its tiles' alone: torch_attn's raises NotImplementedError for a captured "
    "tensor that requires grad under grad mode, and jax_attn's custom_vjp cannot close over "
    "a differentiated tracer (jax raises UnexpectedTracerError). Not callable: TypeError. "
    "A dtype trap of torch (FlexAttention "
    "shares it): an integer index tensor times a Python float is computed in torch's default "
    "dtype, float32, so a float64 score_mod loses precision in that term silently; multiply by "
    "a tensor of the score's dtype, or cast the indices first (score.new_tensor(q_idx)). The "
    "ready-made mods multiply the indices by arrays of the score's dtype."
)

#: ``mask_mod``, in words.
MASK_MOD = (
    "mask_mod(batch, head, q_idx, kv_idx) -> bool: FlexAttention's mask_mod; True = may "
    "attend, ANDed with every other rule. The indices are as for score_mod (MOD_INDICES); it "
    "must return booleans broadcastable to the scores (TypeError / ValueError otherwise). The "
    "blocked paths (the fast paths and blockwise_attention) evaluate it tile by tile on the "
    "tile's indices and skip every tile where it allows nothing (TILE_SKIPPING): a causal "
    "mask_mod skips the tiles is_causal skips. Not callable: TypeError."
)

#: The index arguments of the mods.
MOD_INDICES = (
    "batch: the flat (row-major) index over the leading batch axes, shaped (..., 1, 1, 1) "
    "(a 0-d 0 without batch axes); head: the query head, shaped (heads, 1, 1) (a 0-d 0 for "
    "2-D inputs); q_idx: the query row 0 ... q_len - 1, shaped (q_len, 1); kv_idx: the key "
    "0 ... kv_len - 1, shaped (kv_len,). They broadcast to the scores' shape (numpy_attn: "
    "NumPy int64 arrays; jax_attn: jax int32 arrays, traced under jit; torch_attn: int64 "
    "tensors on the inputs' device). On a tile, the tile's rows and keys (and the blocked "
    "paths may pass one batch entry or head as a 0-d array). The indices are raw positions: "
    "no alignment offset is added (the ready-made mods take an offset)."
)

#: Which tiles the blocked paths skip.
TILE_SKIPPING = (
    "Every blocked path (numpy_attn's and jax_attn's blocked fast paths and their VJPs, "
    "torch_attn's fast paths for these arguments, and blockwise_attention with its VJP in all "
    "three) skips the tiles that the causal rule, the window, the chunk rule, the segment ids "
    "or mask_mod leave without any allowed position: they are neither computed nor masked. "
    "The chunk rule is arithmetic (attention_rules.chunk_status); segment ids and mask_mod are "
    "evaluated tile by tile on the tile's indices. jax_attn decides at trace time: it skips by "
    "segment ids only when they are concrete, and by mask_mod when its result does not depend "
    "on traced values (else it masks those tiles instead of skipping them)."
)

#: The ready-made mods of each backend's ``masks`` module, and the argument each equals.
READY_MADE_MODS = {
    "causal_mod(offset=0)": "mask_mod: q_idx + offset >= kv_idx; equals is_causal=True with "
                            "causal_offset's offset",
    "sliding_window_mod(window, offset=0)": "mask_mod: equals window=(left, right)",
    "chunked_mod(chunk_size, offset=0)": "mask_mod: equals chunk_size (without is_causal)",
    "prefix_lm_mod(prefix_length, offset=0)": "mask_mod: kv_idx < prefix_length or causal; "
                                              "equals the boolean mask of both",
    "document_mod(segment_ids)": "mask_mod over one array or a pair of ids, indexed by batch "
                                 "and position; equals segment_ids",
    "and_masks(*mask_mods) / or_masks(*mask_mods)": "mask_mod: the AND / OR of mask_mods",
    "alibi_mod(slopes, offset=0)": "score_mod: score - slopes[head] · |q_idx + offset - "
                                   "kv_idx|; equals alibi_slopes (derivative 1)",
    "softcap_mod(softcap)": "score_mod: softcap · tanh(score / softcap); equals softcap "
                            "without a bias or ALiBi (derivative 1 - tanh²)",
    "relative_bias_mod(table, offset=0)": "score_mod: score + table[head, clip(kv_idx - q_idx "
                                          "- offset, -m, m) + m] for a (heads, 2m + 1) table; "
                                          "equals bias= its tabulation (derivative 1)",
}

#: Error rules of these arguments, as ``ERRORS`` (the same type and message in every backend).
MASKS_AND_MODS_ERRORS = {
    "chunk_size not a positive int, alibi_slopes not shaped (heads,), segment_ids not shaped "
    "like the batch axes and the sequence (or one array with q_len != kv_len, or a list or "
    "tuple that is not a pair), or a mod returning an array that does not broadcast to the "
    "scores": "ValueError",
    "alibi_slopes not floating point, segment_ids not integers, score_mod or mask_mod not "
    "callable, or a mod returning the wrong dtype": "TypeError",
    "numpy_attn's VJPs given a score_mod without a derivative method": "NotImplementedError",
    "torch_attn's blockwise_attention given a score_mod that captures a tensor requiring "
    "grad, under grad mode": "NotImplementedError",
}
