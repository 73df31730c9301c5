"""Exercise 12 of ``learn/``: absorb the weights (multi-head latent attention, decoding).

The learner writes ``absorbed_attention(q_nope, q_pe, latent, k_pe, w_uk, w_uv)``: MLA's
decoding form (DeepSeek-V2/V3, ``spec.LATENT_ABSORBED``). Each head's keys and values are
up-projections of one cached latent per token, ``k_nope = latent @ w_uk[h]`` and ``v = latent @
w_uv[h]``, plus a rotary key ``k_pe`` shared by every head; the naive form materialises them.
The absorbed form never does: ``q_nope · (c @ W_UK) = (q_nope @ W_UKᵀ) · c``, so ``W_UK`` is
folded into the query (``q_latent = q_nope @ w_uk[h]ᵀ``, ``kv_lora_rank`` dims), attention runs
over the latent itself, and ``W_UV`` is applied once to the weighted sum of latents
(``(weights @ c) @ w_uv[h]``). The softmax scale stays the naive one, ``1 / sqrt(qk_nope_head_dim
+ qk_rope_head_dim)``, whatever width the absorbed query has.

The expected value is the naive form in float64, written here (``naive64``: K and V
materialised per head, then softmax attention), not the backends' ``MultiHeadLatentAttention``;
``tests/test_learn.py`` checks it against numpy_attn's module (naive and absorbed) on the
same weights. The baseline error ``e`` is the larger of the naive and the absorbed form's
float32 error (they sum in different orders).

The checks are adversarial. The first is a square toy (``kv_lora_rank = qk_nope_head_dim =
v_head_dim``) so that the mistakes which change a shape in real sizes still have the right one
and are named by their values: ``W_UK`` not folded (the query compared with the latent as it
is), ``W_UK`` transposed, ``W_UV`` forgotten or transposed, the two up-projections swapped,
one head's weights for every head, the scale of the latent's width (``1/sqrt(kv_lora_rank)``).
The second decodes one token in DeepSeek's proportions scaled down (``kv_lora_rank`` twice
``qk_nope_head_dim``), where the absorbed key's width ``kv_lora_rank + qk_rope_head_dim`` gives
another scale than the naive ``qk_nope_head_dim + qk_rope_head_dim`` (in the toy the two
agree); the third has two batch axes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .exercise_kit import Check, Exercise, Mistake, f32, f64, floor, measured, one, rng_for, swap

NUMBER = 12


def _softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def naive64(q_nope: np.ndarray, q_pe: np.ndarray, latent: np.ndarray, k_pe: np.ndarray,
            w_uk: np.ndarray, w_uv: np.ndarray) -> np.ndarray:
    """MLA's naive form (the expected value, in the dtype of its arguments): per head,
    ``K = [latent @ w_uk[h] ; k_pe]`` and ``V = latent @ w_uv[h]`` materialised, then
    ``softmax([q_nope ; q_pe] @ Kᵀ / sqrt(d_n + d_r)) @ V``, no mask.

    Args:
      q_nope: ``(..., H, q_len, d_n)``; q_pe: ``(..., H, q_len, d_r)`` (rotated).
      latent: ``(..., kv_len, r)``; k_pe: ``(..., kv_len, d_r)`` (rotated, one for all heads).
      w_uk: ``(H, r, d_n)``; w_uv: ``(H, r, d_v)``.

    Returns:
      ``(..., H, q_len, d_v)``.
    """
    c = latent[..., None, :, :]  # (..., 1, kv_len, r)
    k_nope = c @ w_uk  # (..., H, kv_len, d_n): every head's keys, materialised
    value = c @ w_uv  # (..., H, kv_len, d_v)
    k_rope = np.broadcast_to(k_pe[..., None, :, :], k_nope.shape[:-1] + k_pe.shape[-1:])
    key = np.concatenate([k_nope, k_rope], axis=-1)
    query = np.concatenate([q_nope, q_pe], axis=-1)
    scale = 1.0 / math.sqrt(query.shape[-1])
    return _softmax(query @ swap(key) * scale) @ value


def absorbed64(q_nope: np.ndarray, q_pe: np.ndarray, latent: np.ndarray, k_pe: np.ndarray,
               w_uk: np.ndarray, w_uv: np.ndarray, *, query_weight: str = "w_uk",
               output_weight: str = "w_uv", scale_dim: int | None = None,
               one_head: str = "") -> np.ndarray:
    """MLA's absorbed form (in the dtype of its arguments), or one of its classic mistakes.

    Args: as ``naive64``, and
      query_weight: what the query is mapped with: "w_uk" (``q_nope @ w_ukᵀ``, right),
        "w_uk_transposed" (``q_nope @ w_uk``, needs ``d_n == r``), "none" (``q_nope`` against
        the latent's first ``d_n`` dims), "w_uv" (``q_nope @ w_uvᵀ``: the projections swapped).
      output_weight: what the weighted latent is mapped with: "w_uv" (right),
        "w_uv_transposed", "none" (the latent context returned), "w_uk" (swapped).
      scale_dim: the width whose ``1/sqrt`` scales the scores (None: ``d_n + d_r``).
      one_head: "w_uk", "w_uv" or "both": head 0's weights for every head.

    Returns:
      ``(..., H, q_len, d_v)`` (``d_n`` or ``r`` wide where a mistake makes it so).
    """
    heads = w_uk.shape[0]
    if one_head in ("w_uk", "both"):
        w_uk = np.repeat(w_uk[:1], heads, axis=0)
    if one_head in ("w_uv", "both"):
        w_uv = np.repeat(w_uv[:1], heads, axis=0)
    c = latent[..., None, :, :]  # (..., 1, kv_len, r)
    d_n = q_nope.shape[-1]
    if query_weight == "none":
        q_latent, c_keys = q_nope, c[..., :d_n]
    else:
        weight = {"w_uk": swap(w_uk), "w_uk_transposed": w_uk, "w_uv": swap(w_uv)}[query_weight]
        q_latent, c_keys = q_nope @ weight, c  # (..., H, q_len, r)
    scale = 1.0 / math.sqrt(scale_dim or d_n + q_pe.shape[-1])
    scores = (q_latent @ swap(c_keys) + q_pe @ swap(k_pe[..., None, :, :])) * scale
    context = _softmax(scores) @ c  # (..., H, q_len, r): the weighted sum of latents
    if output_weight == "none":
        return context
    return context @ {"w_uv": w_uv, "w_uv_transposed": swap(w_uv), "w_uk": w_uk}[output_weight]


def _check(name: str, rng: np.random.Generator, batch: tuple[int, ...], heads: int, q_len: int,
           kv_len: int, r: int, d_n: int, d_r: int, d_v: int, hint: str = "") -> Check:
    """A check of seeded float32 inputs: queries and latents of unit size, up-projections
    ``N(0, 1/r)`` (so each key and value element is of unit size, as after training); the
    expected value the naive form in float64, the baseline the larger float32 error of the
    naive and the absorbed form."""
    args = (f32(rng.standard_normal(batch + (heads, q_len, d_n))),
            f32(rng.standard_normal(batch + (heads, q_len, d_r))),
            f32(rng.standard_normal(batch + (kv_len, r))),
            f32(rng.standard_normal(batch + (kv_len, d_r))),
            f32(rng.standard_normal((heads, r, d_n)) / math.sqrt(r)),
            f32(rng.standard_normal((heads, r, d_v)) / math.sqrt(r)))
    expected = naive64(*(f64(a) for a in args))
    baseline = max(measured(naive64, *args), measured(absorbed64, *args), floor(expected))
    return Check(name, args, expected, baseline, hint)


def _absorb_checks() -> list[Check]:
    rng = rng_for(NUMBER)
    heads_hint = ("latent and k_pe have no heads axis: latent[..., None, :, :] broadcasts "
                  "against every head; w_uk[h] and w_uv[h] are head h's")
    return [
        _check("a square toy: 2 heads, kv_lora_rank = qk_nope_head_dim = v_head_dim = 4, "
               "qk_rope_head_dim 2, 3 queries over 5 cached tokens", rng, (), 2, 3, 5, 4, 4, 2,
               4),
        _check("decoding one token, DeepSeek's proportions scaled down: batch 2, 4 heads, "
               "kv_lora_rank 16, qk_nope_head_dim 8, qk_rope_head_dim 4, v_head_dim 6, 9 cached "
               "tokens", rng, (2,), 4, 1, 9, 16, 8, 4, 6, heads_hint),
        _check("two batch axes (2, 3): 3 heads, 2 queries over 7 cached tokens, kv_lora_rank "
               "12, qk_nope_head_dim 6, qk_rope_head_dim 2, v_head_dim 5", rng, (2, 3), 3, 2, 7,
               12, 6, 2, 5, heads_hint),
    ]


def _variant(**options: Any) -> Any:
    return one(lambda *a: absorbed64(*a, **options))


def _scale_variants(q_nope: np.ndarray, q_pe: np.ndarray, latent: np.ndarray, *rest: Any
                    ) -> list[np.ndarray]:
    r, d_r = latent.shape[-1], q_pe.shape[-1]
    return [*_variant(scale_dim=r)(q_nope, q_pe, latent, *rest),
            *_variant(scale_dim=r + d_r)(q_nope, q_pe, latent, *rest)]


ABSORB = Exercise(NUMBER, "absorb", "absorbed_attention",
                  "absorb the weights: MLA's decoding form over the latent cache",
                  _absorb_checks, (
    Mistake("uk_not_folded", "W_UK is not folded into the query: q_nope was compared with the "
            "latent as it is, but the latent is not in the keys' space",
            "q_nope · (c @ W_UK) = (q_nope @ W_UKᵀ) · c: map the query to latent space first, "
            "q_latent = q_nope @ w_uk.mT (…, heads, q_len, kv_lora_rank)",
            _variant(query_weight="none")),
    Mistake("uk_transposed", "W_UK is transposed: q_nope @ w_uk maps the query the wrong way "
            "(w_uk[h] is (kv_lora_rank, qk_nope_head_dim): latent → keys)",
            "the query goes back through W_UK: q_latent = q_nope @ w_uk.mT (in the sizes of a "
            "real model the transposed product fails on its shapes)",
            _variant(query_weight="w_uk_transposed")),
    Mistake("uv_forgotten", "W_UV is never applied: you returned the weighted sum of latents, "
            "which is in latent space, not the values' space",
            "the values are latent @ W_UV: apply W_UV once, after the weighted sum, "
            "(weights @ c) @ w_uv", _variant(output_weight="none")),
    Mistake("uv_transposed", "W_UV is transposed: the weighted latent goes through w_uv.mT "
            "instead of w_uv (kv_lora_rank → v_head_dim)",
            "context = (weights @ c) @ w_uv[h]: (…, q_len, kv_lora_rank) @ (kv_lora_rank, "
            "v_head_dim)", _variant(output_weight="w_uv_transposed")),
    Mistake("swapped", "W_UK and W_UV swapped places: W_UV was folded into the query and W_UK "
            "applied to the output",
            "keys come from W_UK (fold it into the query), values from W_UV (apply it after "
            "the weighted sum): kv_b_proj holds W_UK in its first qk_nope_head_dim rows per "
            "head", _variant(query_weight="w_uv", output_weight="w_uk")),
    Mistake("latent_scale", "the softmax scale is 1/sqrt of the latent's width (kv_lora_rank, "
            "or kv_lora_rank + qk_rope_head_dim: the absorbed key's width), not the naive "
            "1/sqrt(qk_nope_head_dim + qk_rope_head_dim)",
            "absorbing changes where the products are summed, not the scores: keep scale = 1 "
            "/ sqrt(qk_nope_head_dim + qk_rope_head_dim) (sdpa's default scale over the "
            "absorbed query is the wrong one)", _scale_variants),
    Mistake("one_head", "one head's weights serve every head: head 0's W_UK or W_UV (the "
            "heads mixed)", "head h folds w_uk[h] into its own query and applies its own "
            "w_uv[h]: q_nope @ w_uk.mT broadcasts the heads axis of both",
            lambda *a: [*_variant(one_head="w_uk")(*a), *_variant(one_head="w_uv")(*a),
                        *_variant(one_head="both")(*a)]),
), "q_latent = q_nope @ w_uk.mT; scores = (q_latent @ cᵀ + q_pe @ k_peᵀ) / sqrt(qk_nope_head_dim "
   "+ qk_rope_head_dim) with c = latent[..., None, :, :]; output = (softmax(scores) @ c) @ w_uv")


__all__ = ["ABSORB", "NUMBER", "absorbed64", "naive64"]
