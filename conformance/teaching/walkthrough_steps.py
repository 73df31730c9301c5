"""The walkthrough's content: the seed article's example computed in each backend and in float64.

``run_backend(name)`` redoes every step of the article (``docs/seed_article.md``) in one backend
(numpy_attn and jax_attn load the article's weights from ``seed_example``; torch_attn draws them
itself with ``torch.manual_seed(123)``, as the article does); ``expected_values`` gives the
float64 value of every step and the error ``e`` of a naive float32 pipeline on the same inputs
(``conformance.cases.naive``), so each step is judged by the harness's rule (``compare``).
``SECTIONS`` lists the printed steps in the article's order; ``conformance.teaching.walkthrough``
prints them. Heavy frameworks are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cases import reference
from ..cases.expected import baseline_error
from ..cases.naive import EXACT, Precision, naive_attention
from ..running import backends
from ..spec import seed_example

BACKENDS = backends.SPEC_BACKENDS
TOKENS = seed_example.SENTENCE.split()
DTYPE = "float32"


def _f32(x: Any) -> np.ndarray:
    return np.array(x, dtype=np.float32)


def article_inputs() -> dict[str, np.ndarray]:
    """The article's float32 inputs, from ``seed_example``: embedding, weights, second input."""
    inputs = {"embedding": _f32(seed_example.EMBEDDING)}
    for name, w in seed_example.self_attention_weights().items():
        inputs[name] = _f32(w)
    for name, w in seed_example.wrapper_weights().items():
        inputs[name] = _f32(w)
    inputs["x_2"] = _f32(seed_example.cross_second_input())
    return inputs


def _torch_draws() -> dict[str, Any]:
    """Embedding, weights and the cross-attention input as torch draws them under seed 123."""
    import torch

    import torch_attn

    drawn: dict[str, Any] = {}
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # leave the global RNG alone
        torch.manual_seed(123)
        embed = torch.nn.Embedding(50_000, 3)
        drawn["embedding"] = embed(torch.tensor(seed_example.TOKEN_IDS)).detach()
        torch.manual_seed(123)
        drawn["SelfAttention"] = torch_attn.SelfAttention(3, 2, 4)
        torch.manual_seed(123)
        drawn["MultiHeadAttentionWrapper"] = torch_attn.MultiHeadAttentionWrapper(3, 2, 1, 4)
        torch.manual_seed(123)
        drawn["CrossAttention"] = torch_attn.CrossAttention(3, 2, 4)
        drawn["x_2"] = torch.rand(8, 3)
        torch.manual_seed(123)
        drawn["CausalSelfAttention"] = torch_attn.CausalSelfAttention(3, 2, 4)
    return drawn


def run_backend(name: str) -> dict[str, np.ndarray]:
    """Every step of the example in backend ``name``; values as NumPy arrays."""
    b = backends.get(name)
    f = b.module
    inputs = article_inputs()
    out: dict[str, np.ndarray] = {}
    if name == "torch":
        import torch

        drawn = _torch_draws()
        sa_weights = drawn["SelfAttention"].export_weights()
        x = drawn["embedding"]
        W = {n: getattr(drawn["SelfAttention"], n).detach() for n in sa_weights}
        x_2 = drawn["x_2"]
        modules = {n: drawn[n] for n in ("SelfAttention", "MultiHeadAttentionWrapper",
                                         "CrossAttention", "CausalSelfAttention")}
        for n, w in drawn["MultiHeadAttentionWrapper"].export_weights().items():
            out[n] = w
        grad_off: Any = torch.no_grad()
    else:
        import contextlib

        x = b.asarray(inputs["embedding"])
        W = {n: b.asarray(inputs[n]) for n in ("W_query", "W_key", "W_value")}
        x_2 = b.asarray(inputs["x_2"])
        sa = {n: inputs[n] for n in ("W_query", "W_key", "W_value")}
        wrapper = {n: w for n, w in inputs.items() if n.startswith("heads.")}
        modules = {
            "SelfAttention": f.SelfAttention(3, 2, 4, rng=b.rng(0)).load_weights(sa),
            "MultiHeadAttentionWrapper":
                f.MultiHeadAttentionWrapper(3, 2, 1, 4, rng=b.rng(0)).load_weights(wrapper),
            "CrossAttention": f.CrossAttention(3, 2, 4, rng=b.rng(0)).load_weights(sa),
            "CausalSelfAttention":
                f.CausalSelfAttention(3, 2, 4, rng=b.rng(0)).load_weights(sa),
        }
        for n, w in wrapper.items():
            out[n] = w
        grad_off = contextlib.nullcontext()
    with grad_off:
        queries, keys, values = x @ W["W_query"], x @ W["W_key"], x @ W["W_value"]
        omega = f.attention_scores(queries, keys, scale=1.0)
        scores = f.attention_scores(queries, keys)  # scale = d_out_kq ** -0.5
        weights = f.attention_weights(scores)
        context = f.attention_output(weights, values)
        masked = f.mask_scores(scores, is_causal=True)
        steps = {
            "embedding": x, **W, "queries": queries, "keys": keys, "values": values,
            "omega": omega, "weights": weights, "context": context,
            "self_attention": modules["SelfAttention"].forward(x),
            "multi_head_wrapper": modules["MultiHeadAttentionWrapper"].forward(x),
            "x_2": x_2,
            "cross_attention": modules["CrossAttention"].forward(x, x_2),
            "renormalized": f.renormalized_causal_weights(weights),
            "masked_scores": masked,
            "causal_weights": f.attention_weights(masked),
            "causal_module": modules["CausalSelfAttention"].forward(x),
        }
        for n, value in steps.items():
            out[n] = b.to_numpy(value)
    return out


def pipeline(p: Precision, attend: Callable[..., reference.Steps]) -> dict[str, np.ndarray]:
    """Every step in float64 (``p`` is ``EXACT``) or as a naive implementation in ``p.dtype``."""
    a = {n: np.asarray(v, np.float64) for n, v in article_inputs().items()}
    x = a["embedding"]
    q, k, v = p.matmul(x, a["W_query"]), p.matmul(x, a["W_key"]), p.matmul(x, a["W_value"])
    plain, causal = attend(q, k, v), attend(q, k, v, is_causal=True)
    heads = []
    for h in range(4):
        qh, kh, vh = (p.matmul(x, a[f"heads.{h}.W_{n}"]) for n in ("query", "key", "value"))
        heads.append(attend(qh, kh, vh).output)
    x_2 = a["x_2"]
    cross = attend(q, p.matmul(x_2, a["W_key"]), p.matmul(x_2, a["W_value"]))
    zeroed = p.round(plain.weights * np.tril(np.ones((6, 6))))
    return {
        **a, "queries": q, "keys": k, "values": v,
        "omega": attend(q, k, v, scale=1.0).scores,
        "weights": plain.weights, "context": plain.output, "self_attention": plain.output,
        "multi_head_wrapper": np.concatenate(heads, axis=-1),
        "cross_attention": cross.output,
        "renormalized": p.round(zeroed / p.sum(zeroed)),
        "masked_scores": causal.masked_scores, "causal_weights": causal.weights,
        "causal_module": causal.output,
    }


def expected_values() -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The float64 value of every step and the baseline error ``e`` of a naive float32 one."""

    def exact(q: np.ndarray, k: np.ndarray, v: np.ndarray, **o: Any) -> reference.Steps:
        return reference.attention(q, k, v, **o)

    p32 = Precision(DTYPE)

    def naive(q: np.ndarray, k: np.ndarray, v: np.ndarray, **o: Any) -> reference.Steps:
        return naive_attention({"query": q, "key": k, "value": v}, o, p32)

    with np.errstate(all="ignore"):
        ref = pipeline(EXACT, exact)
        low = pipeline(p32, naive)
    return ref, {n: baseline_error(low[n], ref[n], p32) for n in ref}


@dataclass
class Step:
    """One printed step of the walkthrough."""

    key: str  # name in run_backend / pipeline
    heading: str
    call: str
    rows: list[str]
    cols: list[str] | None = None
    article: str | None = None  # key in ARTICLE
    zeros: np.ndarray | None = None  # positions that must be exactly 0
    notes: list[str] = field(default_factory=list)
    inconsistent: list[tuple[str, int | None]] = field(default_factory=list)  # (key, row)
    claims: list[str] = field(default_factory=list)  # keys of claims in ARTICLE_INCONSISTENT


def claim_numbers(expected: dict[str, np.ndarray]) -> dict[str, dict[str, float | int]]:
    """The numbers that contradict the article's claims (``ARTICLE_INCONSISTENT`` entries with
    a ``"claim"``), recomputed from the float64 steps (``expected_values()[0]``): query 3's
    lowest score and its input (from 1), how many queries attend most to themselves, and how
    many masked positions the article's −inf method computes and exponentiates anyway."""
    omega, weights, masked = expected["omega"], expected["weights"], expected["masked_scores"]
    lowest = int(np.argmin(omega[2]))  # query 3 ('short,'): row index 2
    is_masked = np.isneginf(masked)
    return {
        "lowest_score_3": {"lowest input": lowest + 1,
                           "lowest score": round(float(omega[2, lowest]), 4)},
        "attends_most_to_itself": {
            "queries attending most to themselves": int(
                (weights.argmax(axis=-1) == np.arange(len(weights))).sum()),
            "queries": len(weights)},
        "masking_skips_positions": {  # ω is computed in full before masked_fill overwrites it
            "masked positions": int(is_masked.sum()),
            "their scores computed anyway": int((is_masked & np.isfinite(omega)).sum()),
            "entries the softmax exponentiates": int(masked.size)},
    }


UPPER = np.triu(np.ones((6, 6), bool), 1)

SECTIONS: list[tuple[str, list[Step]]] = [
    ("1. 嵌入输入句子 · embedding the sentence", [
        Step("embedding", "embedded_sentence = embed(sentence_int)", "x = embedding (6×3)", TOKENS,
             article="embedding",
             notes=["numpy/jax: seed_example.EMBEDDING; torch: torch.manual_seed(123); "
                    "torch.nn.Embedding(50_000, 3)(torch.tensor(token_ids))"]),
    ]),
    ("2. 定义权重矩阵 · the weight matrices W_query, W_key, W_value", [
        Step("W_query", "W_query (d × d_q = 3×2)", "torch.rand(3, 2) under torch.manual_seed(123)",
             ["d0", "d1", "d2"]),
        Step("W_key", "W_key (3×2)", "the next torch.rand(3, 2)", ["d0", "d1", "d2"]),
        Step("W_value", "W_value (3×4)", "the next torch.rand(3, 4)", ["d0", "d1", "d2"]),
    ]),
    ("3. 查询、键和值 · projections: queries, keys, values", [
        Step("queries", "queries = x @ W_query", "x @ W_query  (6×2)", TOKENS),
        Step("keys", "keys = x @ W_key", "x @ W_key  (6×2)", TOKENS),
        Step("values", "values = x @ W_value", "x @ W_value  (6×4)", TOKENS),
    ]),
    ("4. 计算非归一化注意力权重 · unnormalised attention scores ω", [
        Step("omega", "ω = queries @ keysᵀ (no scaling)",
             "attention_scores(queries, keys, scale=1.0)", TOKENS, TOKENS,
             article="attn_scores", inconsistent=[("omega_3", 2)], claims=["lowest_score_3"],
             notes=["row i: how much query i 'likes' key j; ω₃ is the row of 'short,'"]),
    ]),
    ("5. 计算归一化注意力权重 · scaled softmax", [
        Step("weights", "attention weights = softmax(ω / √d_k), d_k = 2",
             "attention_weights(attention_scores(queries, keys))", TOKENS, TOKENS,
             article="attn_weights", inconsistent=[("attention_weights_3", 2)],
             claims=["attends_most_to_itself"],
             notes=["every row sums to 1"]),
    ]),
    ("6. 计算上下文向量 · context vectors", [
        Step("context", "context = weights @ values",
             "attention_output(weights, values)", TOKENS,
             article="self_attention", inconsistent=[("context_vector_3", 2)]),
    ]),
    ("7. 自注意力模块 · the SelfAttention module", [
        Step("self_attention", "SelfAttention(3, 2, 4).forward(x)",
             "the same steps inside the module", TOKENS,
             article="self_attention", inconsistent=[("second_row_claim", 1)]),
    ]),
    ("8. 多头注意力 · the multi-head wrapper", [
        Step("multi_head_wrapper", "MultiHeadAttentionWrapper(3, 2, 1, num_heads=4).forward(x)",
             "4 SelfAttention heads with d_out_v = 1, concatenated", TOKENS,
             article="multi_head_wrapper",
             notes=["numpy/jax: seed_example.wrapper_weights(); torch: torch.manual_seed(123) "
                    "then the constructor draws the 4 heads in order"]),
    ]),
    ("9. 交叉注意力 · cross-attention", [
        Step("x_2", "second_input = torch.rand(8, 3)", "drawn right after CrossAttention(3, 2, 4)",
             [f"x₂[{i}]" for i in range(8)],
             notes=["numpy/jax: seed_example.cross_second_input()"]),
        Step("cross_attention", "CrossAttention(3, 2, 4).forward(x, second_input)",
             "queries from x (6 tokens), keys and values from second_input (8 rows)", TOKENS,
             article="cross_attention"),
    ]),
    ("10. 因果自注意力 · causal self-attention, two ways", [
        Step("renormalized", "method 1: zero the weights above the diagonal, renormalise rows",
             "renormalized_causal_weights(weights)", TOKENS, TOKENS,
             article="causal_weights", zeros=UPPER),
        Step("masked_scores", "method 2: −inf above the diagonal before the softmax",
             "mask_scores(attention_scores(queries, keys), is_causal=True)", TOKENS, TOKENS,
             claims=["masking_skips_positions"],
             notes=["the article masks ω and divides by √2 afterwards: the same, "
                    "as −inf/√2 = −inf"]),
        Step("causal_weights", "softmax of the masked scores",
             "attention_weights(masked)", TOKENS, TOKENS, article="causal_weights", zeros=UPPER,
             notes=["equal to method 1 (a row that keeps no key would give 0 in both)"]),
        Step("causal_module", "CausalSelfAttention(3, 2, 4).forward(x)",
             "causal weights @ values (the article stops at the weights)", TOKENS),
    ]),
]


__all__ = ["BACKENDS", "DTYPE", "SECTIONS", "TOKENS", "Step", "article_inputs", "claim_numbers",
           "expected_values", "pipeline", "run_backend"]
