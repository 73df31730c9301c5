"""``python -m conformance walkthrough``: the seed article's worked example, step by step.

The article (``docs/seed_article.md``) builds self-attention from a 6-token sentence, 3-d
embeddings and tiny weights, and prints every intermediate. This command redoes each step in
every requested backend, prints the values side by side and marks, per row and per step, whether
each backend agrees with a float64 computation within the spec's float32 tolerance
(``spec.TOLERANCES``: ``|x - ref| <= atol + rtol·|ref| + k·e``, ``e`` the error of a naive
float32 pipeline on the same inputs, as in the conformance harness). It also checks every number
the article prints, and says where the article's own numbers are inconsistent
(``seed_example.ARTICLE_INCONSISTENT``).

Weights: numpy_attn and jax_attn load the article's weights from ``seed_example``; torch_attn
draws them itself with ``torch.manual_seed(123)`` and the module constructor, as the article does,
and the walkthrough shows that the bits are identical. No jit: every JAX call runs eagerly.

Everything heavy is imported inside the functions (``import conformance`` stays NumPy-only).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import backends, harness, reference, seed_example, spec
from .seed_example import ARTICLE, ARTICLE_INCONSISTENT

BACKENDS = backends.SPEC_BACKENDS
TOKENS = seed_example.SENTENCE.split()
DTYPE = "float32"


# ------------------------------------------------------------------------------ the example


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


def pipeline(r: Callable[[np.ndarray], np.ndarray], attend: Callable[..., reference.Steps]
             ) -> dict[str, np.ndarray]:
    """Every step in float64 (``r`` the identity) or with every intermediate rounded by ``r``."""
    a = {n: np.asarray(v, np.float64) for n, v in article_inputs().items()}
    x = a["embedding"]
    q, k, v = r(x @ a["W_query"]), r(x @ a["W_key"]), r(x @ a["W_value"])
    plain, causal = attend(q, k, v), attend(q, k, v, is_causal=True)
    heads = []
    for h in range(4):
        qh, kh, vh = (r(x @ a[f"heads.{h}.W_{n}"]) for n in ("query", "key", "value"))
        heads.append(attend(qh, kh, vh).output)
    x_2 = a["x_2"]
    cross = attend(q, r(x_2 @ a["W_key"]), r(x_2 @ a["W_value"]))
    zeroed = r(plain.weights * np.tril(np.ones((6, 6))))
    return {
        **a, "queries": q, "keys": k, "values": v,
        "omega": attend(q, k, v, scale=1.0).scores,
        "weights": plain.weights, "context": plain.output, "self_attention": plain.output,
        "multi_head_wrapper": np.concatenate(heads, axis=-1),
        "cross_attention": cross.output,
        "renormalized": r(zeroed / r(zeroed.sum(-1, keepdims=True))),
        "masked_scores": causal.masked_scores, "causal_weights": causal.weights,
        "causal_module": causal.output,
    }


def expected_values() -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The float64 value of every step and the baseline error ``e`` of a naive float32 one."""

    def exact(q: np.ndarray, k: np.ndarray, v: np.ndarray, **o: Any) -> reference.Steps:
        return reference.attention(q, k, v, **o)

    r32 = harness.rounder(DTYPE)

    def naive(q: np.ndarray, k: np.ndarray, v: np.ndarray, **o: Any) -> reference.Steps:
        return harness.naive_attention({"query": q, "key": k, "value": v}, o, r32)

    with np.errstate(all="ignore"):
        ref = pipeline(lambda z: z, exact)
        low = pipeline(r32, naive)
    return ref, {n: harness._baseline_error(low[n], ref[n], r32) for n in ref}


# ------------------------------------------------------------------------------ the steps


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


_UPPER = np.triu(np.ones((6, 6), bool), 1)

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
             article="attn_scores", inconsistent=[("omega_3", 2)],
             notes=["row i: how much query i 'likes' key j; ω₃ is the row of 'short,'"]),
    ]),
    ("5. 计算归一化注意力权重 · scaled softmax", [
        Step("weights", "attention weights = softmax(ω / √d_k), d_k = 2",
             "attention_weights(attention_scores(queries, keys))", TOKENS, TOKENS,
             article="attn_weights", inconsistent=[("attention_weights_3", 2)],
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
             article="causal_weights", zeros=_UPPER),
        Step("masked_scores", "method 2: −inf above the diagonal before the softmax",
             "mask_scores(attention_scores(queries, keys), is_causal=True)", TOKENS, TOKENS,
             notes=["the article masks ω and divides by √2 afterwards: the same, "
                    "as −inf/√2 = −inf"]),
        Step("causal_weights", "softmax of the masked scores",
             "attention_weights(masked)", TOKENS, TOKENS, article="causal_weights", zeros=_UPPER,
             notes=["equal to method 1 (a row that keeps no key would give 0 in both)"]),
        Step("causal_module", "CausalSelfAttention(3, 2, 4).forward(x)",
             "causal weights @ values (the article stops at the weights)", TOKENS),
    ]),
]


# ------------------------------------------------------------------------------ printing


def _marks() -> tuple[str, str]:
    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "✓✗ω√−₂".encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return "ok", "XX"
    return "✓", "✗"


def _fmt(v: float) -> str:
    if np.isneginf(v):
        return "-inf"
    if np.isnan(v):
        return "nan"
    return f"{v:.4f}"


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, max(width, 60), initial_indent="      ",
                         subsequent_indent="      ")


def _row_text(values: np.ndarray, width: int = 8) -> str:
    return "".join(_fmt(v).rjust(width) for v in values)


def _ratio(step: Step, actual: np.ndarray, expected: np.ndarray, baseline: float,
           zeros: np.ndarray | None) -> float:
    return harness.compare(step.key, actual, expected, baseline, DTYPE, zeros).ratio


def _article_check(got: np.ndarray, printed: np.ndarray) -> tuple[int, float]:
    """How many of the printed numbers the result rounds to (±1 in the 4th decimal)."""
    diff = np.abs(np.round(got.astype(np.float64), 4) - printed)
    return int((diff <= 1.5e-4).sum()), float(diff.max())


def render_step(step: Step, results: dict[str, np.ndarray], expected: np.ndarray,
                baseline: float, width: int) -> list[str]:
    """The lines of one step: values per backend side by side (or interleaved), marks."""
    ok, bad = _marks()
    names = list(results)
    lines = [f"  ▸ {step.heading}", f"    {step.call}"]
    for note in step.notes:
        lines += [("    · " + t[6:]) if k == 0 else t
                  for k, t in enumerate(_wrap(note, width))]
    label_w = max(len(r) for r in step.rows) + 5
    ncols = expected.shape[-1]
    block_w = 8 * ncols + 3
    zeros = step.zeros
    row_ratio = {n: [_ratio(step, results[n][i], expected[i], baseline,
                            None if zeros is None else zeros[i])
                     for i in range(expected.shape[0])] for n in names}
    side_by_side = label_w + block_w * max(len(names), 1) <= width
    if side_by_side:
        head = " " * label_w + "".join(n.center(block_w) for n in names)
        lines.append(head.rstrip())
        if step.cols:
            cols = "".join(c[:7].rjust(8) for c in step.cols) + "   "
            lines.append((" " * label_w + cols * len(names)).rstrip())
        for i, row in enumerate(step.rows):
            text = "    " + row.ljust(label_w - 4)
            for n in names:
                mark = ok if row_ratio[n][i] <= 1 else bad
                text += _row_text(results[n][i]) + " " + mark.ljust(2)
            lines.append(text.rstrip())
    else:
        name_w = max(len(n) for n in names) + 2
        if step.cols:
            lines.append(" " * (label_w + name_w) + "".join(c[:7].rjust(8) for c in step.cols))
        for i, row in enumerate(step.rows):
            for j, n in enumerate(names):
                mark = ok if row_ratio[n][i] <= 1 else bad
                label = ("    " + row).ljust(label_w) if j == 0 else " " * label_w
                lines.append(label + n.ljust(name_w) + _row_text(results[n][i]) + " " + mark)
    tol = spec.TOLERANCES[DTYPE]
    parts = []
    for n in names:
        worst = _ratio(step, results[n], expected, baseline, zeros)
        parts.append(f"{n} {ok if worst <= 1 else bad} {worst:.2g}")
    lines.append(f"    vs float64 (|Δ| ≤ {tol['atol']:g} + {tol['k']:g}·{baseline:.1e}, "
                 f"worst |Δ|/bound): " + ", ".join(parts))
    if step.article:
        printed = np.array(ARTICLE[step.article], np.float64)
        parts, off = [], []
        for n in names:
            good, _ = _article_check(results[n], printed)
            parts.append(f"{n} {ok if good == printed.size else bad} {good}/{printed.size}")
            rounded = np.round(results[n].astype(np.float64), 4)
            for i, j in np.argwhere(np.abs(rounded - printed) > 5e-5):
                off.append((int(i), int(j)))
        lines.append("    the article prints these numbers (4 decimals): " + ", ".join(parts))
        for i, j in sorted(set(off)):
            got = {n: f"{results[n][i, j]:.6f}" for n in names}
            lines += _wrap(f"note: row {step.rows[i]!r}, column {j} is printed "
                           f"{printed[i, j]:.4f}; float64 gives {expected[i, j]:.8f}, float32 here "
                           + ", ".join(f"{n} {v}" for n, v in got.items())
                           + " (one unit in the 4th decimal, allowed)", width)
    for key, row in step.inconsistent:
        entry = ARTICLE_INCONSISTENT[key]
        vec = "[" + ", ".join(f"{v:.4f}" for v in entry["printed"]) + "]"
        here = "[" + ", ".join(f"{v:.4f}" for v in expected[row]) + "]"
        if np.allclose(entry["printed"], expected[row], atol=1.5e-4):
            lines.append(f"    {bad} the article's remark on row {step.rows[row]!r} {vec}: "
                         f"the row is right, the remark is not")
        else:
            lines.append(f"    {bad} the article prints {vec} for query 3 ({step.rows[row]!r}); "
                         f"its own setup gives {here}")
        lines += _wrap(f"why ({key}): {entry['why']}", width)
    return lines


def _identity_lines(results: dict[str, dict[str, np.ndarray]]) -> list[str]:
    """torch drew its weights itself: are they the bits seed_example holds?"""
    if "torch" not in results:
        return []
    ok, bad = _marks()
    inputs = article_inputs()
    names = ["embedding", "W_query", "W_key", "W_value", "x_2",
             *(n for n in inputs if n.startswith("heads."))]
    same = [n for n in names if np.array_equal(results["torch"][n], inputs[n])]
    differ = [n for n in names if n not in same]
    mark = ok if not differ else bad
    text = (f"  {mark} torch drew the embedding, SelfAttention/CrossAttention weights, the 4 "
            f"wrapper heads and second_input itself (torch.manual_seed(123) + constructors): "
            f"{len(same)}/{len(names)} arrays bit-identical to seed_example")
    lines = [text]
    if differ:
        lines.append(f"    differ: {', '.join(differ)}")
    return lines


def walkthrough(names: list[str], width: int) -> tuple[list[str], bool]:
    """The printed lines and whether every available backend agreed everywhere."""
    ok, bad = _marks()
    lines = ["Attention, step by step: the seed article's worked example "
             "(docs/seed_article.md)", ""]
    results: dict[str, dict[str, np.ndarray]] = {}
    for n in names:
        b = backends.get(n)
        if not b.available():
            lines.append(f"  {n}: not installed — {b.install}")
            continue
        try:
            results[n] = run_backend(n)
        except Exception as exc:  # noqa: BLE001 - a failing backend is a result
            lines.append(f"  {n}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    expected, baseline = expected_values()
    dc = seed_example.DICTIONARY
    code_words = seed_example.CODE_SENTENCE.split()
    code_dc = {w: i for i, w in enumerate(sorted(code_words))}
    tol = spec.TOLERANCES[DTYPE]
    lines += [
        f"backends: {', '.join(results) or 'none'}; dtype {DTYPE}; each compared with a float64 "
        f"computation on the same inputs",
        f"mark {ok}: |x − float64| ≤ atol + k·e (spec.TOLERANCES['float32']: atol "
        f"{tol['atol']:g}, k {tol['k']:g}; e = error of a naive float32 pipeline)",
        "",
        "═" * 78,
        "0. 句子与字典 · the sentence, the dictionary, the token ids",
        "═" * 78,
        f"  the article's code:  sentence = {seed_example.CODE_SENTENCE!r}",
        f"    dc = {code_dc}",
        f"    sentence_int = {[code_dc[w] for w in code_words]}",
        f"  {bad} but every number the article prints comes from "
        f"{seed_example.SENTENCE!r}:",
        f"    dc = {dc}",
        f"    sentence_int = {seed_example.TOKEN_IDS}",
        "    (the code's sentence gives other ids, so its embedding rows would be permuted)",
        "",
    ]
    lines += _identity_lines(results)
    all_ok = bool(results)
    for title, steps in SECTIONS:
        lines += ["═" * 78, title, "═" * 78]
        for step in steps:
            shown = {n: r[step.key] for n, r in results.items()}
            if not shown:
                continue
            lines += render_step(step, shown, expected[step.key], baseline[step.key], width)
            lines.append("")
            for n in shown:
                worst = _ratio(step, shown[n], expected[step.key], baseline[step.key],
                               step.zeros)
                all_ok &= worst <= 1
    if results:
        one = next(iter(results.values()))
        gap = float(np.abs(one["renormalized"].astype(np.float64)
                           - one["causal_weights"]).max())
        lines.append(f"  the two causal methods differ by at most {gap:.1e} "
                     f"({next(iter(results))}, float32)")
    summary = ok if all_ok else bad
    lines += ["", f"{summary} every step of every backend "
              f"{'agrees' if all_ok else 'does NOT agree'} with float64 within spec.TOLERANCES"
              f"['float32']; article inconsistencies: {', '.join(ARTICLE_INCONSISTENT)} "
              f"(docs/seed_article.md)"]
    return lines, all_ok


# ------------------------------------------------------------------------------ CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m conformance walkthrough``."""
    p.add_argument("--backend", action="append", choices=[*BACKENDS, "all"],
                   help="numpy, jax, torch or all (repeatable; default: all)")
    p.add_argument("--width", type=int, default=None,
                   help="line width: backends side by side when they fit, else one line each "
                        "(default: the terminal's width)")


def main(args: argparse.Namespace) -> int:
    """Print the walkthrough; exit code 0 when every available backend agrees everywhere."""
    chosen = args.backend or ["all"]
    names = list(BACKENDS) if "all" in chosen else list(dict.fromkeys(chosen))
    width = args.width or shutil.get_terminal_size((120, 24)).columns
    lines, all_ok = walkthrough(names, width)
    text = "\n".join(lines)
    try:
        print(text)
    except UnicodeEncodeError:  # a terminal without UTF-8
        print(text.encode("ascii", "replace").decode("ascii"))
    return 0 if all_ok else 1


__all__ = ["add_arguments", "expected_values", "main", "run_backend", "walkthrough"]
