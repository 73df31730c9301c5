"""Exercises 7–10 of ``learn/``: padding and empty rows, heads, and one backward pass.

``exercise_catalogue`` lists all ten; these four go past the article's single-head pipeline:
a boolean padding mask whose fully masked rows must give 0 (the spec's rule), the article's
multi-head wrapper fused into one projection, grouped-query heads, and softmax's Jacobian.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..spec import seed_example
from .exercise_kit import (
    Check,
    Exercise,
    Mistake,
    article,
    either_empty_row,
    f32,
    formula_check,
    masked_softmax,
    module_check,
    normal,
    one,
    product_scores,
    rng_for,
    sdpa_check,
    softmax64,
)

NO_SCALE = "you forgot the scale: the scores were not divided by √d_k"
NO_SCALE_HINT = "divide q @ kᵀ by √d_k, d_k = query.shape[-1], before the mask and the softmax"

# ---------------------------------------------------------------- 7: padding, empty rows


def _padding_checks() -> list[Check]:
    rng = rng_for(7)
    q, k, v = normal(rng, 2, 4, 8), normal(rng, 2, 5, 8), normal(rng, 2, 5, 6)
    keys_kept = np.arange(5)[None, :] < np.array([5, 3])[:, None]  # (batch, kv_len)
    queries_kept = np.arange(4)[None, :] < np.array([4, 2])[:, None]  # (batch, q_len)
    cases = [("padding: 2 sequences of 5 and 3 keys, every query keeps a key",
              keys_kept[:, None, :]),
             ("padded queries too: sequence 1's queries 2 and 3 keep no key",
              keys_kept[:, None, :] & queries_kept[:, :, None])]
    return [sdpa_check(name, {"query": q, "key": k, "value": v, "mask": m}, {}, "output",
                       (q, k, v, m), "mask is True where the query may attend the key")
            for name, m in cases]


def _attend(fill: str = "-inf", flip: bool = False, use_mask: bool = True,
            scaled: bool = True) -> Any:
    def compute(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray
                ) -> list[np.ndarray]:
        q, k, v = (x.astype(np.float64) for x in (q, k, v))
        s = product_scores(q, k, q.shape[-1] ** -0.5 if scaled else 1.0)
        allowed = np.broadcast_to(~mask if flip else mask, s.shape) if use_mask else s == s
        if fill == "nan":
            return [masked_softmax(s, allowed, "nan") @ v]
        if fill == "finite":
            return [softmax64(np.where(allowed, s, -1e9)) @ v]
        with np.errstate(all="ignore"):
            return [w @ v for w in either_empty_row(s, allowed)]
    return compute


PADDING = Exercise(7, "padding", "padded_attention",
                   "padding masks and fully masked rows", _padding_checks, (
    Mistake("flipped", "you flipped the mask: True was read as 'masked out'",
            "True means 'may attend' (as torch SDPA and jax.nn; the opposite of "
            "torch.nn.MultiheadAttention): where(mask, scores, -inf)", _attend(flip=True)),
    Mistake("no_scale", NO_SCALE, NO_SCALE_HINT, _attend(scaled=False)),
    Mistake("ignored", "the mask is ignored", "put -inf where mask is False, before the softmax",
            _attend(use_mask=False)),
    Mistake("nan_rows", "a fully masked row gives NaN: its row max is -inf, and -inf - (-inf) "
            "is NaN (0 / 0 after exp)",
            "where a row's max is -inf use 0 instead (every exp is then 0), and divide by 1 "
            "where the row sum is 0: that row's weights and output become exactly 0",
            _attend(fill="nan")),
    Mistake("mean_of_value", "a fully masked row gives the mean of value: a large finite "
            "negative fill (-1e9, finfo.min) makes its weights uniform; the answer is 0",
            "mask with -inf and guard the empty row (row max -inf → 0, row sum 0 → 1)",
            _attend(fill="finite")),
), "scores / √d_k, -inf where mask is False, a softmax whose empty rows are 0, @ value")


# ---------------------------------------------------------------- 8: multi-head, fused


def _mha(x: np.ndarray, wq: np.ndarray, wk: np.ndarray, wv: np.ndarray, heads: int,
         split: str = "heads", width_scale: bool = False, scaled: bool = True) -> np.ndarray:
    """Float64 multi-head attention: ``split="heads"`` (right), ``"reshape"`` (a reshape
    without the transpose) or ``"none"`` (one head over the whole width)."""
    q, k, v = x @ wq, x @ wk, x @ wv  # (..., T, H·d)
    if split == "none":
        return softmax64(product_scores(q, k, q.shape[-1] ** -0.5)) @ v
    t = x.shape[-2]

    def part(y: np.ndarray) -> np.ndarray:
        d = y.shape[-1] // heads
        if split == "reshape":
            return y.reshape(y.shape[:-2] + (heads, t, d))
        return np.swapaxes(y.reshape(y.shape[:-1] + (heads, d)), -2, -3)

    qh, kh, vh = part(q), part(k), part(v)
    width = q.shape[-1] if width_scale else qh.shape[-1]
    out = softmax64(product_scores(qh, kh, width ** -0.5 if scaled else 1.0)) @ vh
    if split == "reshape":
        return out.reshape(out.shape[:-3] + (t, -1))
    return np.swapaxes(out, -2, -3).reshape(out.shape[:-3] + (t, -1))


def _mha_checks() -> list[Check]:
    rng = rng_for(8)
    heads = seed_example.wrapper_weights()
    stacked = [f32(np.hstack([heads[f"heads.{h}.W_{n}"] for h in range(4)]))
               for n in ("query", "key", "value")]
    batch = (normal(rng, 2, 5, 6), normal(rng, 6, 12), normal(rng, 6, 12), normal(rng, 6, 6))
    checks = []
    for name, (x, wq, wk, wv), h in (
            ("the article's MultiHeadAttentionWrapper(3, 2, 1, num_heads=4), weights stacked",
             (article()["x"], *stacked), 4),
            ("a batch: 2 × 5 tokens, d_in 6, 3 heads, d_k 4, d_v 2", batch, 3)):
        arrays = {"x": x}
        for n, w in zip(("query", "key", "value"), (wq, wk, wv), strict=True):
            for i, part in enumerate(np.split(w, h, axis=-1)):
                arrays[f"w:heads.{i}.W_{n}"] = part
        checks.append(module_check(name, arrays, {"module": "MultiHeadAttentionWrapper",
                                                  "init": {"num_heads": h}},
                                   (x, wq, wk, wv, h), "the result is (..., T, num_heads·d_v)"))
    return checks


MULTI_HEAD = Exercise(8, "multi_head", "multi_head_attention",
                      "multi-head attention with stacked weights", _mha_checks, (
    Mistake("no_scale", NO_SCALE, "each head divides its scores by its own √d_k, d_k = "
            "w_query.shape[-1] // num_heads", one(lambda *a: _mha(*a, scaled=False))),
    Mistake("width_scale", "you scaled by the width of all heads together, √(num_heads·d_k)",
            "each head divides by its own √d_k, d_k = w_query.shape[-1] // num_heads",
            one(lambda *a: _mha(*a, width_scale=True))),
    Mistake("reshape_only", "the heads were split with a reshape alone: (T, H·d) → (H, T, d) "
            "mixes tokens into heads",
            "reshape to (..., T, H, d), then swap the T and H axes (and back to merge)",
            one(lambda *a: _mha(*a, split="reshape"))),
    Mistake("one_head", "the heads were not split: one attention over the whole width",
            "head h uses columns h·d_k … (h+1)·d_k of w_query and w_key (h·d_v … of w_value)",
            lambda *a: [*one(lambda *b: _mha(*b, split="none"))(*a)]),
), "project once, split the columns into heads, attend per head, concatenate the heads")


# ---------------------------------------------------------------- 9: grouped-query


def _gqa_checks() -> list[Check]:
    rng = rng_for(9)
    cases = [("4 query heads share 2 key/value heads: 5 queries, 6 keys",
              (normal(rng, 4, 5, 8), normal(rng, 2, 6, 8), normal(rng, 2, 6, 3))),
             ("a batch: 2 × 6 query heads over 2 kv heads",
              (normal(rng, 2, 6, 3, 4), normal(rng, 2, 2, 4, 4), normal(rng, 2, 2, 4, 5)))]
    return [sdpa_check(name, {"query": q, "key": k, "value": v}, {}, "output", (q, k, v),
                       "query (..., heads, T, d), key and value (..., kv_heads, S, d)")
            for name, (q, k, v) in cases]


def _modulo(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    reps = [1] * k.ndim
    reps[-3] = q.shape[-3] // k.shape[-3]
    k, v = np.tile(k, reps), np.tile(v, reps)
    return softmax64(product_scores(q, k, q.shape[-1] ** -0.5)) @ v


def _unscaled_gqa(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    group = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    return softmax64(product_scores(q, k)) @ v


GQA = Exercise(9, "gqa", "grouped_query_attention", "grouped-query attention", _gqa_checks, (
    Mistake("modulo", "query head h used kv head h % kv_heads (a tile)",
            "consecutive query heads share a kv head: h // (heads // kv_heads); repeat each kv "
            "head (np.repeat, torch.repeat_interleave, jnp.repeat), do not tile",
            one(_modulo)),
    Mistake("no_scale", NO_SCALE, NO_SCALE_HINT, one(_unscaled_gqa)),
), "repeat each key/value head heads // kv_heads times along the head axis, then attend")


# ---------------------------------------------------------------- 10: softmax's gradient


def _jacobian_vjp(w: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``g`` through the softmax's Jacobian ``diag(w) − w wᵀ``, built explicitly per row."""
    n = w.shape[-1]
    jacobian = np.einsum("...k,kl->...kl", w, np.eye(n)) - np.einsum("...k,...l->...kl", w, w)
    return np.einsum("...kl,...l->...k", jacobian, g)


def _backward_checks() -> list[Check]:
    a, rng = article(), rng_for(10)
    causal = f32(masked_softmax(rng.standard_normal((2, 5, 5)) * 2, np.tril(np.ones((5, 5),
                                                                                    bool))))
    cases = [("the article's weights softmax(ω / √2) and a random upstream gradient",
              a["weights"], normal(rng, 6, 6)),
             ("causal weights (zeros above the diagonal), batch of 2", causal,
              normal(rng, 2, 5, 5))]
    return [formula_check(name, _jacobian_vjp, (w, g),
                          np.abs(w) * (np.abs(g) + (np.abs(g * w)).sum(-1, keepdims=True)),
                          "return dL/dscores, shaped like weights", zeros=w == 0)
            for name, w, g in cases]


def _coupled(w: np.ndarray, g: np.ndarray, sign: float = -1.0, axis: int = -1) -> np.ndarray:
    return w * (g + sign * (g * w).sum(axis, keepdims=True))


SOFTMAX_BACKWARD = Exercise(10, "softmax_backward", "softmax_backward",
                            "one backward pass: the gradient through the softmax",
                            _backward_checks, (
    Mistake("elementwise", "you dropped the coupling term: w ⊙ g treats the softmax as if "
            "each weight depended on its own score only",
            "∂w_i/∂s_k = w_i (δ_ik − w_k), so dL/ds = w ⊙ (g − Σ_k g_k w_k), per row",
            one(lambda w, g: w * g)),
    Mistake("identity", "you returned the upstream gradient unchanged",
            "the softmax has a Jacobian, diag(w) − w wᵀ: dL/ds = w ⊙ (g − Σ_k g_k w_k)",
            one(lambda w, g: g)),
    Mistake("sign", "the coupling term has the wrong sign", "dL/ds = w ⊙ (g − Σ_k g_k w_k)",
            one(lambda w, g: _coupled(w, g, sign=1.0))),
    Mistake("wrong_axis", "you summed g ⊙ w over the wrong axis", "sum over the last axis, the "
            "keys of each row", one(lambda w, g: _coupled(w, g, axis=-2))),
), "dL/ds = w ⊙ (g − Σ_k g_k w_k): the row's weighted mean of g, subtracted")


__all__ = ["GQA", "MULTI_HEAD", "PADDING", "SOFTMAX_BACKWARD"]
