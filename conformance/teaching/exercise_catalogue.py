"""The twelve graded exercises of ``learn/``, in order: attention built up from the seed article.

=====  ======================================  ================================================
  1    ``attention_scores(queries, keys)``      ω = queries @ keysᵀ (batched: swap two axes)
  2    ``scaled_scores(queries, keys)``         ω / √d_k
  3    ``softmax(scores)``                      a softmax that does not overflow
  4    ``context_vectors(weights, values)``     weights @ values
  5    ``causal_weights_renormalised(w)``       the article's first causal method
  6    ``causal_attention_weights(scores)``     its second: −inf above the diagonal, softmax
  7    ``padded_attention(q, k, v, mask)``      True = may attend; an empty row gives 0
  8    ``multi_head_attention(x, W…, heads)``   the wrapper's heads, fused into one product
  9    ``grouped_query_attention(q, k, v)``     query head h uses kv head h // group
 10    ``softmax_backward(weights, grad)``      one backward pass: softmax's Jacobian
 11    ``rotary_embedding(x, positions, …)``    RoPE: pairs (i, i + r/2) turn by p · θ^(−2i/r)
 12    ``absorbed_attention(q_nope, …)``        MLA decoding: W_UK into the query, W_UV after
=====  ======================================  ================================================

Each exercise's checks start from the article's numbers where it has them (the article prints
ω, the weights, both causal results and the wrapper's output), then a batched case; its mistakes
are the classic ones (``exercise_kit.Mistake``). The inputs of every check are fixed (seeded),
so a grade is repeatable.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from .exercise_catalogue_absorb import ABSORB
from .exercise_catalogue_heads import GQA, MULTI_HEAD, PADDING, SOFTMAX_BACKWARD
from .exercise_catalogue_rope import ROPE
from .exercise_kit import (
    Check,
    Exercise,
    Mistake,
    article,
    band,
    either_empty_row,
    f32,
    formula_check,
    identity_keys,
    magnitude,
    normal,
    one,
    product_scores,
    rng_for,
    sdpa_check,
    softmax64,
    swap,
)

BATCHED_T = ("`.T` reverses every axis of a batched array; swap only the last two: "
             "np.swapaxes(keys, -1, -2), jnp.swapaxes(keys, -1, -2), keys.transpose(-1, -2)")

# ---------------------------------------------------------------- 1, 2: scores and scaling


def _score_checks(number: int, scaled: bool) -> list[Check]:
    a, rng = article(), rng_for(number)
    d = 16 if scaled else 5
    q, k = normal(rng, 2, 3, 4, d), normal(rng, 2, 3, 7, d)
    cases = [("the article's sentence: queries and keys 6 × 2 (d_k = 2)", a["queries"],
              a["keys"], ""),
             (f"a batch: 2 sequences × 3 heads, 4 queries, 7 keys, d_k = {d}", q, k, BATCHED_T)]
    checks = []
    for name, q, k, hint in cases:
        scale = q.shape[-1] ** -0.5 if scaled else 1.0
        v = np.ones(k.shape[:-1] + (1,))
        checks.append(sdpa_check(name, {"query": q, "key": k, "value": v}, {"scale": scale},
                                 "scores", (q, k), hint, magnitude(q, k, scale)))
    return checks


def _scaled_by(fn: Any) -> Any:
    return one(lambda q, k: product_scores(q, k) * fn(q, k))


SCORES = Exercise(1, "scores", "attention_scores", "unnormalised attention scores ω",
                  lambda: _score_checks(1, scaled=False), (
    Mistake("transposed", "your result is transposed: it is keys @ queriesᵀ",
            "row i holds query i's score against every key: queries @ keysᵀ",
            one(lambda q, k: k @ swap(q))),
    Mistake("scaled", "you scaled the scores: exercise 1 asks for the raw ω",
            "return queries @ keysᵀ as it is; exercise 2 divides by √d_k",
            _scaled_by(lambda q, k: q.shape[-1] ** -0.5)),
), "ω[i, j] = queries[i] · keys[j]: one matrix product, with the keys' last two axes swapped")

SCALING = Exercise(2, "scaling", "scaled_scores", "scaled scores ω / √d_k",
                   lambda: _score_checks(2, scaled=True), (
    Mistake("no_scale", "you forgot the scale: these are the raw scores ω",
            "divide by √d_k, the square root of the last axis of queries (d_k = "
            "queries.shape[-1]): the variance of a dot product grows with d_k",
            one(product_scores)),
    Mistake("divided_by_d", "you divided by d_k (or scaled queries and keys both by 1/√d_k)",
            "divide the scores once by √d_k, not by d_k",
            _scaled_by(lambda q, k: 1 / q.shape[-1])),
    Mistake("times_sqrt_d", "you multiplied by √d_k", "divide by √d_k: scores / d_k ** 0.5",
            _scaled_by(lambda q, k: q.shape[-1] ** 0.5)),
    Mistake("sequence_length", "you scaled by the number of keys (or queries), not by d_k",
            "d_k is the size of each query and key vector: queries.shape[-1]",
            lambda q, k: [*one(lambda q, k: product_scores(q, k) * k.shape[-2] ** -0.5)(q, k),
                          *one(lambda q, k: product_scores(q, k) * q.shape[-2] ** -0.5)(q, k)]),
), "scaled_scores = (queries @ keysᵀ) / √d_k with d_k = queries.shape[-1]")


# ---------------------------------------------------------------- 3: a stable softmax


def _softmax_checks() -> list[Check]:
    a, rng = article(), rng_for(3)
    big = np.stack([1000 + 3 * rng.standard_normal(5), -1000 + 3 * rng.standard_normal(5),
                    rng.standard_normal(5)])
    cases = [("the article's scaled scores ω / √2 (6 × 6)",
              f32(a["queries"].astype(np.float64) @ a["keys"].T.astype(np.float64) / 2 ** 0.5),
              ""),
             ("a batch: 2 × 3 heads, 4 queries, 7 keys", normal(rng, 2, 3, 4, 7, scale=3.0), ""),
             ("large scores: rows near +1000 and −1000", f32(big),
              "float32's exp overflows to inf above 88.7 and underflows to 0 below −103.9")]
    checks = [sdpa_check(name, identity_keys(s), {"scale": 1.0}, "weights", (s,), hint,
                         np.abs(s)) for name, s, hint in cases]
    spans = f32(SPANNING_ROWS)
    wide = sdpa_check("rows spanning −1000 … 1000 within the row (the first score the least)",
                      identity_keys(spans), {"scale": 1.0}, "weights", (spans,),
                      "only each row's maximum keeps every exponent ≤ 0", np.abs(spans))
    return [*checks, replace(wide, mistake=SPANNING)]


#: Rows whose scores span −1000 … 1000 within the row: subtracting anything but the row's
#: maximum (its mean, minimum or first score) leaves an exponent far above float32's 88.7 and
#: float64's 709.8; clipping the scores ties the largest ones. Row 0 starts with its minimum,
#: row 1 with its maximum (a shift by the first score passes it, by the minimum does not), row 2
#: lies wholly near −1000 (exp without a shift is 0 / 0), row 3 near +1000.
SPANNING_ROWS = (
    (-1000.0, -500.0, 0.0, 500.0, 1000.0, 999.0, 998.0, -999.0),
    (1000.0, 999.0, -1000.0, -1000.0, -1000.0, -1000.0, -1000.0, -1000.0),
    (-1000.0, -1001.0, -1002.0, -1003.0, -1004.0, -1005.0, -1006.0, -1007.0),
    (1000.0, 1000.5, 1001.0, 999.0, 998.5, 1000.25, 997.0, 1001.5),
)
SPANNING = Mistake("spanning", "your softmax is wrong on rows that span −1000 … 1000: a clip, "
                   "float64 or a shift by anything but each row's maximum does not keep exp in "
                   "range (float64's exp overflows above 709.8 too)",
                   "subtract each row's maximum: every exponent is then ≤ 0 and the largest is "
                   "exp(0) = 1, whatever the row's span", lambda *a: [])


def _shifted(shift_of: Any) -> Any:
    """A softmax shifted by ``shift_of(s)`` (keepdims) in float32 and in float64: a learner's
    overflow shows in the dtype it computes in."""
    def compute(s: np.ndarray) -> list[np.ndarray]:
        with np.errstate(all="ignore"):
            return [_exp_over(x, shift_of(x)).astype(np.float64)
                    for x in (s.astype(np.float32), s.astype(np.float64))]
    return compute


def _exp_over(s: np.ndarray, shift: np.ndarray | float, axis: int = -1,
              keepdims: bool = True) -> np.ndarray:
    e = np.exp(s - shift)
    total = e.sum(axis, keepdims=True) if keepdims else e.sum(axis)[..., None, :]
    return e / total


SOFTMAX = Exercise(3, "softmax", "softmax", "a softmax that does not overflow", _softmax_checks, (
    Mistake("overflow", "the softmax overflows: exp of a large score is inf (of a very negative "
            "one, 0), so the row becomes inf / inf or 0 / 0 = NaN",
            "subtract each row's maximum before exp: softmax(s) = softmax(s − max(s)), so the "
            "largest exponent is exp(0) = 1", one(lambda s: _exp_over(s, 0.0))),
    Mistake("shift_mean", "you subtracted each row's mean, not its maximum: in a row that "
            "spans −1000 … 1000 the largest exponent is still about 1000, and exp overflows",
            "subtract each row's maximum (keepdims): every exponent is then ≤ 0",
            _shifted(lambda s: s.mean(-1, keepdims=True))),
    Mistake("shift_min", "you subtracted each row's minimum, not its maximum: every exponent "
            "is then ≥ 0, the largest the row's whole span, and exp overflows",
            "subtract each row's maximum (keepdims): every exponent is then ≤ 0",
            _shifted(lambda s: s.min(-1, keepdims=True))),
    Mistake("shift_first", "you subtracted each row's first score, not its maximum: where the "
            "first score is not the largest, exp still overflows",
            "subtract each row's maximum (keepdims), whatever its position",
            _shifted(lambda s: s[..., :1])),
    Mistake("global_max", "you subtracted the maximum of the whole array, not of each row: a "
            "row far below it underflows to 0 / 0",
            "take the maximum over the last axis, keeping it: s.max(-1, keepdims=True), "
            "s.amax(dim=-1, keepdim=True), jnp.max(s, axis=-1, keepdims=True)",
            one(lambda s: _exp_over(s, s.max()))),
    Mistake("wrong_axis", "you normalised the columns: each column sums to 1, each row must",
            "sum over the last axis (-1), the keys", one(lambda s: _exp_over(
                s, s.max(-2, keepdims=True), axis=-2))),
    Mistake("no_keepdims", "the row sums lost their axis: element [i, j] was divided by row j's "
            "sum", "keep the summed axis: e.sum(-1, keepdims=True) (torch: keepdim=True)",
            one(lambda s: _exp_over(s, s.max(-1, keepdims=True), keepdims=False))),
    Mistake("whole_array", "you normalised by the sum of the whole array, not of each row",
            "sum over the last axis only", one(lambda s: np.exp(s - s.max()) / np.exp(
                s - s.max()).sum())),
), "softmax(s)[i, j] = exp(s[i, j] − m[i]) / Σ_k exp(s[i, k] − m[i]), m[i] = max_k s[i, k]")


# ---------------------------------------------------------------- 4: context vectors


def _context_checks() -> list[Check]:
    a, rng = article(), rng_for(4)
    w = f32(softmax64(rng.standard_normal((2, 3, 5, 7)) * 2))
    cases = [("the article: softmax(ω / √2) (6 × 6) and values (6 × 4)", a["weights"],
              a["values"], ""),
             ("the article's cross-attention: 6 queries over 8 keys", a["cross_weights"],
              a["cross_values"], "weights are (q_len, kv_len), values (kv_len, d_v)"),
             ("a batch: 2 × 3 heads, 5 queries, 7 keys, d_v = 4", w, normal(rng, 2, 3, 7, 4),
              "")]
    return [formula_check(name, lambda w, v: w @ v, (w, v), magnitude(w, swap(v)), hint)
            for name, w, v, hint in cases]


CONTEXT = Exercise(4, "context", "context_vectors", "context vectors", _context_checks, (
    Mistake("transposed_weights", "you used the transposed weights: column i, not row i, "
            "mixed the values", "context[i] = Σ_j weights[i, j] · values[j]: weights @ values",
            one(lambda w, v: swap(w) @ v)),
), "each context vector is a weighted sum of the value rows: weights @ values")


# ---------------------------------------------------------------- 5, 6: causal, both ways


def _renormalise(w: np.ndarray, allowed: np.ndarray) -> list[np.ndarray]:
    kept = w * allowed
    total = kept.sum(-1, keepdims=True)
    with np.errstate(all="ignore"):
        return [kept / np.where(total == 0, 1.0, total), kept / total]


def _causal_renormalised_checks() -> list[Check]:
    a, rng = article(), rng_for(5)
    w = f32(softmax64(rng.standard_normal((2, 3, 5, 5)) * 2))
    cases = [("the article: softmax(ω / √2), 6 × 6", a["weights"]),
             ("a batch: 2 × 3 heads, 5 tokens", w)]
    return [formula_check(name, lambda w: _renormalise(w, band(w, hi=0))[0], (w,),
                          w.shape[-1] * np.abs(w), zeros=~band(w, hi=0))
            for name, w in cases]


def _causal_mistakes(renormalise: bool) -> tuple[Mistake, ...]:
    def apply(allowed_of: Any) -> Any:
        def compute(x: np.ndarray) -> list[np.ndarray]:
            x = x.astype(np.float64)
            allowed = allowed_of(x)
            return _renormalise(x, allowed) if renormalise else either_empty_row(x, allowed)
        return compute

    hide = ("keep key j for query i when j <= i: tril(ones(T, T)) keeps, triu(ones(T, T), "
            "diagonal=1) marks what to hide (np., torch., jnp.)")
    return (
        Mistake("flipped", "you flipped the mask: the future kept its weight, the past lost it",
                hide, lambda x: [*apply(lambda s: band(s, lo=1))(x),
                                 *apply(lambda s: band(s, lo=0))(x)]),
        Mistake("diagonal_hidden", "you hid the diagonal too: a token may attend to itself",
                "tril keeps the diagonal (k = 0); triu(…, diagonal=1) hides only j > i",
                apply(lambda s: band(s, hi=-1))),
        Mistake("no_mask", "nothing was masked: query i still sees the keys after it", hide,
                one(lambda x: x if renormalise else softmax64(x))),
    )


CAUSAL_RENORMALISED = Exercise(
    5, "causal_renormalise", "causal_weights_renormalised",
    "causal weights, the article's first method: zero the future, renormalise",
    _causal_renormalised_checks, (
        *_causal_mistakes(renormalise=True),
        Mistake("not_renormalised", "the rows no longer sum to 1",
                "after zeroing the future, divide each row by its own sum (keepdims)",
                one(lambda w: w * band(w, hi=0))),
        Mistake("no_keepdims", "the row sums lost their axis: element [i, j] was divided by "
                "row j's sum", "keep the summed axis: sum(-1, keepdims=True)",
                one(lambda w: (w * band(w, hi=0)) / (w * band(w, hi=0)).sum(-1)[..., None, :])),
    ), "multiply by tril(ones(T, T)), then divide each row by its sum")


def _causal_mask_checks() -> list[Check]:
    a, rng = article(), rng_for(6)
    s = f32(a["queries"].astype(np.float64) @ a["keys"].T.astype(np.float64) / 2 ** 0.5)
    cases = [("the article's scaled scores ω / √2 (6 × 6)", s),
             ("a batch: 2 × 2 heads, 5 tokens", normal(rng, 2, 2, 5, 5, scale=2.0))]
    return [sdpa_check(name, identity_keys(s), {"scale": 1.0, "is_causal": True}, "weights",
                       (s,), "", np.abs(s)) for name, s in cases]


CAUSAL_MASK = Exercise(
    6, "causal_mask", "causal_attention_weights",
    "causal weights, the article's second method: −inf above the diagonal, then softmax",
    _causal_mask_checks, (
        *_causal_mistakes(renormalise=False),
        Mistake("zero_fill", "the future's scores were set to 0, and exp(0) = 1: masked keys "
                "still get weight", "fill with -inf, whose exp is exactly 0",
                one(lambda s: softmax64(np.where(band(s, hi=0), s, 0.0)))),
        Mistake("after_softmax", "you zeroed the weights after the softmax, so the rows no "
                "longer sum to 1", "mask the scores before the softmax",
                one(lambda s: softmax64(s) * band(s, hi=0))),
    ), "where(j > i, -inf, scores), then the softmax of exercise 3")


EXERCISES: tuple[Exercise, ...] = (SCORES, SCALING, SOFTMAX, CONTEXT, CAUSAL_RENORMALISED,
                                   CAUSAL_MASK, PADDING, MULTI_HEAD, GQA, SOFTMAX_BACKWARD,
                                   ROPE, ABSORB)

__all__ = ["EXERCISES"]
