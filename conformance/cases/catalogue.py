"""Named, seeded conformance cases: identical inputs for every implementation of the spec.

A case is a name, a one-line description and a ``build(rng)`` that draws its float64 inputs from
NumPy's seeded generator (the seed is derived from the name, so a case's data never depends on
which other cases run). ``prepare_inputs(case, dtype)`` casts those inputs once to the dtype
under test; every backend then receives exactly the same bits.

Seven kinds of case exist (``conformance.cases.inputs`` builds the inputs of the newer ones;
``conformance.cases.packed`` holds the cases of chunks, ALiBi, segment ids, mods and varlen):

``sdpa``
  inputs of ``scaled_dot_product_attention``: arrays ``query``, ``key``, ``value`` and optional
  ``mask``, ``bias``, ``dropout_mask``, ``sinks`` ``(heads,)``; scalar options ``is_causal``,
  ``causal_alignment``, ``window``, ``scale``, ``softcap``, ``dropout_p``. Every sdpa case also
  compares the row log-sum-exp (``return_lse=True``), and with ``sinks`` their gradient.
``merge``
  an sdpa problem (no causal rule or window: its structure is an explicit ``mask``) whose keys
  ``key_part`` splits into ``options["parts"]`` disjoint sets, one possibly empty: each part is
  computed by the implementation's own ``scaled_dot_product_attention(..., return_lse=True)``
  (without the sinks) and merged by its ``merge_attention`` (with them), which must equal the
  attention over every key.
``paged``
  ``paged_attention`` over a shuffled pool of pages (``case_inputs.paged``), and the same keys
  appended to the implementation's own ``PagedKVCache`` (after a freed sequence, whose pages it
  reuses): both equal the contiguous attention (``case_inputs.contiguous``).
``varlen``
  ``varlen_attention`` on a packed batch (tokens first, ``cu_seq_q``/``cu_seq_k`` offsets,
  options ``max_q``, ``max_k``, ``window_size``, ``enable_gqa``): each sequence's bottom-right
  attention; sdpa cases may also carry ``chunk_size``, ``alibi_slopes``, segment ids and mods
  (``cases_packed``).
``module``
  a spec module (``options["module"]``) with constructor arguments ``options["init"]``, weights
  (arrays named ``w:<weight name>``) loaded into every backend, and forward inputs ``x``
  (and ``context``/``x_2``, ``mask``), with forward options ``options["forward"]``; with
  ``options["decode"]`` (chunk sizes) the module also decodes ``x`` with a KV cache, which
  must equal the causal forward pass.
``rotary``
  ``rotary_embedding`` of ``x`` at integer ``positions`` (and its VJP, and ``rope_frequencies``
  of the case's scaling method): ``conformance.cases.rotary``.
``quantized``
  ``quantize_kv`` / ``dequantize_kv`` of ``x`` by a scheme, or a ``QuantizedKVCache`` taking
  appends and attending after each: ``conformance.cases.quantized``. (The module case of
  ``MultiHeadLatentAttention`` is a ``module`` case: ``conformance.cases.latent``.)

sdpa cases without a general boolean mask and without dropout also run ``blockwise_attention``
(and its VJP) with small tiles (``BLOCKWISE_TILES``) that do not divide the lengths;
``kv_lengths`` (an int array) gives it the padding that the case's ``mask`` gives
``scaled_dot_product_attention``. Sinks are drawn in [-2, 4) and cast to the case's dtype like
every floating input (GPT-OSS keeps them in the model's dtype).

Non-finite inputs (``nan_*``, ``inf_key``) follow the spec's IEEE rule: a NaN in a query row
makes that output row NaN; a NaN or +Inf in key ``j`` makes every row that attends ``j`` NaN,
while masking replaces a masked score by ``-inf``, so a NaN key at a masked position reaches
nothing; a NaN value row reaches every output row with a non-zero weight on it. The reference
(``conformance.cases.reference``) and the naive baseline compute these in plain IEEE float64; the
comparison requires NaN exactly where the reference is NaN, and accepts any value where the rule
leaves the result unspecified (an output row whose weight on a NaN value row is zero: ``0·NaN``
is NaN in a plain matrix product, while a blocked kernel may never read that tile; the weights of
masked positions in a NaN row). **Gradients are not compared on these cases** (``CaseData.finite``
is False): the spec's NaN rule covers the forward pipeline only.

To add a case, append a ``Case`` to ``CASES`` with a builder (``_sdpa(arrays_fn, **options)`` or
``_module(...)``); every backend, dtype, step and peer then runs it. Most sdpa cases share one
shape (batch 2, heads 4, q_len 5, kv_len 7, head_dim 8) so JAX compiles few programs.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

import numpy as np

from ..spec import seed_example
from ..usage import UsageError
from .combined import COMBINED_CASES
from .dtypes import DTYPES, numpy_dtype
from .inputs import (
    BLOCKWISE_TILES,
    SDPA_ARRAYS,
    SDPA_OPTIONS,
    TK,
    TQ,
    B,
    Case,
    CaseData,
    D,
    H,
    fully_masked_mask,
    huge_causal,
    paged,
    qkv,
    random_split,
    sdpa_arrays,
    sdpa_options,
    with_sinks,
)
from .inputs import normal as _normal
from .latent import LATENT_CASES
from .packed import PACKED_CASES
from .quantized import QUANTIZED_CASES
from .rotary import ROTARY_CASES


def cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """Floating arrays to ``dtype`` (bfloat16 via ml_dtypes); bool and int arrays unchanged."""
    x = np.asarray(x)
    return x.astype(numpy_dtype(dtype)) if x.dtype.kind == "f" else x


def prepare_inputs(case: Case, dtype: str) -> CaseData:
    """The case's inputs in ``dtype``: the exact bits every backend receives."""
    data = case.data()
    return CaseData({n: cast(a, dtype) for n, a in data.arrays.items()}, dict(data.options))


# ------------------------------------------------------------------------------ builders


def _sdpa(arrays_fn: Callable[[np.random.Generator], dict[str, np.ndarray]],
          **options: Any) -> Callable[[np.random.Generator], CaseData]:
    """A builder: arrays from ``arrays_fn(rng)``, fixed scalar options."""

    def build(rng: np.random.Generator) -> CaseData:
        return CaseData(arrays_fn(rng), dict(options))

    return build


def _with(extra: Callable[[np.random.Generator, dict[str, np.ndarray]], dict[str, np.ndarray]],
          **qkv_kw: Any) -> Callable[[np.random.Generator], dict[str, np.ndarray]]:
    def arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
        base = qkv(rng, **qkv_kw)
        base.update(extra(rng, base))
        return base

    return arrays


def _padding(rng: np.random.Generator, base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    kv_lengths, q_lengths = np.array([3, 7]), np.array([5, 2])  # sequence 1: 3 padded queries
    key_ok = np.arange(TK) < kv_lengths[:, None]  # (batch, kv_len)
    query_ok = np.arange(TQ) < q_lengths[:, None]  # (batch, q_len)
    return {"mask": key_ok[:, None, None, :] & query_ok[:, None, :, None]}  # (B, 1, TQ, TK)


def _fully_masked(rng: np.random.Generator, base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"mask": fully_masked_mask(rng)}  # a row, a query in every head, a whole head


def _two_d(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"query": _normal(rng, TQ, D), "key": _normal(rng, TK, D), "value": _normal(rng, TK, D)}


def _three_d(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"query": _normal(rng, H, TQ, D), "key": _normal(rng, 2, TK, D),
            "value": _normal(rng, 2, TK, D)}


def _seed_projections(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The article's queries, keys and values: embedding @ W, W from torch.manual_seed(123)."""
    x = np.array(seed_example.EMBEDDING)  # (6, 3) exact float32 values
    w = {n: np.array(a) for n, a in seed_example.self_attention_weights().items()}
    return {"query": x @ w["W_query"], "key": x @ w["W_key"], "value": x @ w["W_value"]}


def _module(module: str, init: dict[str, Any], arrays_fn: Callable[[np.random.Generator], dict],
            forward: dict[str, Any] | None = None, decode: tuple[int, ...] | None = None
            ) -> Callable[[np.random.Generator], CaseData]:
    """A module case; ``decode`` (chunk sizes) also decodes ``x`` chunk by chunk."""

    def build(rng: np.random.Generator) -> CaseData:
        options = {"module": module, "init": init, "forward": dict(forward or {})}
        if decode:
            options["decode"] = decode
        return CaseData(arrays_fn(rng), options)

    return build


def _weights(weights: dict[str, Any]) -> dict[str, np.ndarray]:
    return {f"w:{n}": np.array(a, dtype=np.float64) for n, a in weights.items()}


def _seed_self(rng: np.random.Generator) -> dict[str, np.ndarray]:
    weights = _weights(seed_example.self_attention_weights())
    return {"x": np.array(seed_example.EMBEDDING), **weights}


def _seed_wrapper(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"x": np.array(seed_example.EMBEDDING), **_weights(seed_example.wrapper_weights())}


def _seed_cross(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"x_1": np.array(seed_example.EMBEDDING),
            "x_2": np.array(seed_example.cross_second_input()),
            **_weights(seed_example.self_attention_weights())}


def _mha(rng: np.random.Generator) -> dict[str, np.ndarray]:
    d_model, heads, kv_heads = 16, 4, 2
    head_dim = d_model // heads
    shapes = {
        "W_query": (d_model, heads * head_dim), "W_key": (d_model, kv_heads * head_dim),
        "W_value": (d_model, kv_heads * head_dim), "W_out": (heads * head_dim, d_model),
        "b_query": (heads * head_dim,), "b_key": (kv_heads * head_dim,),
        "b_value": (kv_heads * head_dim,), "b_out": (d_model,),
    }
    arrays = {f"w:{n}": rng.uniform(-0.5, 0.5, s) for n, s in shapes.items()}
    arrays["x"] = _normal(rng, B, TQ, d_model)
    arrays["context"] = _normal(rng, B, TK, d_model)
    arrays["mask"] = (np.arange(TK) < np.array([4, 7])[:, None])[:, None, None, :]
    return arrays


def _noop(rng: np.random.Generator, base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {}


def _self(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return qkv(rng, q_len=TQ, kv_len=TQ)


def _q_longer(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return qkv(rng, q_len=TK, kv_len=TQ)


def _scaled(factor: float) -> Callable[[np.random.Generator], dict[str, np.ndarray]]:
    def arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
        base = qkv(rng)
        return {**base, "query": base["query"] * factor, "key": base["key"] * factor}

    return arrays


def _kv_lengths(rng: np.random.Generator, base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    kv_lengths = np.array([4, 0])  # sequence 1 has no key at all: every row fully masked
    key_ok = np.arange(TK) < kv_lengths[:, None]  # (batch, kv_len)
    return {"kv_lengths": kv_lengths, "mask": key_ok[:, None, None, :]}  # (B, 1, 1, TK)


def _length_one(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return qkv(rng, q_len=1, kv_len=1)


def _single_query(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return qkv(rng, q_len=1, kv_len=TK)


def _mha_self(rng: np.random.Generator) -> dict[str, np.ndarray]:
    arrays = _mha(rng)
    del arrays["context"], arrays["mask"]
    arrays["x"] = _normal(rng, B, 6, 16)
    return arrays


def _dropout(rng: np.random.Generator, base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"dropout_mask": rng.random((B, H, TQ, TK)) >= 0.3}


def _nan_query(rng: np.random.Generator) -> dict[str, np.ndarray]:
    arrays = qkv(rng)
    arrays["query"][0, 1, 2, 3] = np.nan  # one component of query 2, batch 0, head 1
    return arrays


def _nan_key_masked(rng: np.random.Generator) -> dict[str, np.ndarray]:
    arrays = qkv(rng)
    kv_lengths = np.array([7, 5])  # sequence 1: keys 5 and 6 are padding
    arrays["key"][1, 2, 6, 0] = np.nan  # a padded key: masked, so it must reach nothing
    arrays["kv_lengths"] = kv_lengths
    arrays["mask"] = (np.arange(TK) < kv_lengths[:, None])[:, None, None, :]  # (B, 1, 1, TK)
    return arrays


def _inf_key(rng: np.random.Generator) -> dict[str, np.ndarray]:
    arrays = qkv(rng)
    arrays["key"][0, 0, 0, 0] = np.inf  # key 0, which every causal row attends
    arrays["query"][0, 0, :, 0] = np.abs(arrays["query"][0, 0, :, 0]) + 0.5  # score +inf, not -inf
    return arrays


def _nan_value(row: int) -> Callable[[np.random.Generator], dict[str, np.ndarray]]:
    def arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
        base = qkv(rng)
        base["value"][1, 0, row, 2] = np.nan  # one component of value row ``row``, head 0
        return base

    return arrays


def _merge(arrays_fn: Callable[[np.random.Generator], dict[str, np.ndarray]], parts: int,
           empty: bool = False, **options: Any) -> Callable[[np.random.Generator], CaseData]:
    """A merge case: ``arrays_fn``'s arrays, the keys split into ``parts`` random sets (one
    of them empty with ``empty``: ``key_part``), fixed scalar options."""

    def build(rng: np.random.Generator) -> CaseData:
        arrays = arrays_fn(rng)
        arrays["key_part"] = random_split(rng, arrays["key"].shape[-2], parts, empty)
        return CaseData(arrays, {"parts": parts, **options})

    return build


CASES: tuple[Case, ...] = (
    Case("self", "self-attention, q_len = kv_len = 5", _sdpa(_self)),
    Case("cross", "cross-attention, q_len 5 != kv_len 7", _sdpa(_with(_noop))),
    Case("causal_top_left", "causal, top-left, q_len 5 < kv_len 7",
         _sdpa(_with(_noop), is_causal=True)),
    Case("causal_bottom_right", "causal, bottom-right (offset 2), q_len 5 < kv_len 7",
         _sdpa(_with(_noop), is_causal=True, causal_alignment="bottom_right")),
    Case("causal_top_left_q_longer", "causal, top-left, q_len 7 > kv_len 5",
         _sdpa(_q_longer, is_causal=True)),
    Case("causal_bottom_right_q_longer",
         "causal, bottom-right (offset -2), q_len 7 > kv_len 5: rows 0-1 fully masked",
         _sdpa(_q_longer, is_causal=True, causal_alignment="bottom_right")),
    Case("padding", "padding mask from lengths: kv_lengths [3, 7], q_lengths [5, 2]",
         _sdpa(_with(_padding))),
    Case("window", "sliding window (2, 1), top-left", _sdpa(_with(_noop), window=(2, 1))),
    Case("window_causal_bottom_right", "window (3, None) with causal, bottom-right",
         _sdpa(_with(_noop), window=(3, None), is_causal=True, causal_alignment="bottom_right")),
    Case("bias", "additive float bias (1, heads, q_len, kv_len)",
         _sdpa(_with(lambda r, b: {"bias": _normal(r, 1, H, TQ, TK)}))),
    Case("mask_and_bias", "boolean mask (batch, 1, q_len, kv_len) and bias (heads, q_len, kv_len)",
         _sdpa(_with(lambda r, b: {"mask": r.random((B, 1, TQ, TK)) < 0.7,
                                   "bias": _normal(r, H, TQ, TK)}))),
    Case("softcap", "soft-capping 2.5 of scores 5x larger than usual",
         _sdpa(_scaled(5.0 ** 0.5), softcap=2.5)),
    Case("gqa", "grouped-query: 4 query heads over 2 key/value heads",
         _sdpa(lambda r: qkv(r, kv_heads=2))),
    Case("mqa", "multi-query: 4 query heads over 1 key/value head",
         _sdpa(lambda r: qkv(r, kv_heads=1))),
    Case("v_dim", "value head_dim 3 != query head_dim 8", _sdpa(lambda r: qkv(r, v_dim=3))),
    Case("scale", "scale override 0.3", _sdpa(_with(_noop), scale=0.3)),
    Case("dropout_mask", "dropout 0.3 with a given keep-mask",
         _sdpa(_with(_dropout), dropout_p=0.3)),
    Case("fully_masked_rows", "random mask with fully masked rows and a fully masked head",
         _sdpa(_with(_fully_masked))),
    Case("huge_logits", "logits up to ~1e4 (inputs x30, scale 1): softmax must subtract the max",
         _sdpa(_scaled(30.0), scale=1.0)),
    Case("kv_lengths", "padding from kv_lengths [4, 0]: sequence 1 has no key (blockwise too)",
         _sdpa(_with(_kv_lengths))),
    Case("length_one", "q_len = kv_len = 1", _sdpa(_length_one)),
    Case("single_query_causal", "one query over 7 keys, causal bottom-right (a decoding step)",
         _sdpa(_single_query, is_causal=True, causal_alignment="bottom_right")),
    Case("two_d", "2-D inputs (seq, head_dim), as in the seed article", _sdpa(_two_d)),
    Case("three_d_gqa_causal", "3-D inputs (heads, seq, head_dim), 4 over 2 heads, causal",
         _sdpa(_three_d, is_causal=True)),
    Case("nan_query", "a NaN in one query row: that output row is NaN, every other row finite",
         _sdpa(_nan_query)),
    Case("nan_key_masked", "a NaN key at a padded (masked) position: every row stays finite",
         _sdpa(_nan_key_masked)),
    Case("inf_key", "+Inf in key 0, which every causal row attends (scores +inf): those rows NaN",
         _sdpa(_inf_key, is_causal=True)),
    Case("nan_value", "a NaN in value row 2, which every row attends: that column NaN",
         _sdpa(_nan_value(2))),
    Case("nan_value_causal",
         "a NaN in value row 2 with a causal mask: rows 2-4 NaN, rows 0-1 (weight 0) unspecified",
         _sdpa(_nan_value(2), is_causal=True)),
    Case("seed_example", "the seed article's q, k, v: embedding @ W (6 tokens, d_kq 2, d_v 4)",
         _sdpa(_seed_projections)),
    Case("seed_example_causal", "the seed article's causal weights (6 tokens)",
         _sdpa(_seed_projections, is_causal=True)),
    Case("sinks_gqa_kv_lengths",
         "sinks, 4 over 2 heads, kv_lengths [4, 0]: sequence 1 gives all its weight to the sinks",
         _sdpa(with_sinks(_with(_kv_lengths, kv_heads=2)))),
    Case("sinks_fully_masked_rows",
         "sinks with fully masked rows and a fully masked head: output 0, lse = the sink",
         _sdpa(with_sinks(_with(_fully_masked)))),
    Case("sinks_causal_softcap",
         "sinks, causal top-left, soft-cap 2.5 (the sink itself is neither scaled nor capped)",
         _sdpa(with_sinks(_scaled(5.0 ** 0.5)), is_causal=True, softcap=2.5)),
    Case("sinks_bottom_right_q_longer",
         "sinks, causal bottom-right, q_len 7 > kv_len 5: rows 0-1 see only their sink",
         _sdpa(with_sinks(_q_longer), is_causal=True, causal_alignment="bottom_right")),
    Case("sinks_window", "sinks with a sliding window (2, 1), top-left",
         _sdpa(with_sinks(_with(_noop)), window=(2, 1))),
    Case("merge_two_splits", "merge_attention of 2 random splits of the 7 keys",
         _merge(qkv, 2), kind="merge"),
    Case("merge_empty_split_sinks_gqa",
         "3 random splits, one empty; sinks, 4 over 2 heads, fully masked rows and head",
         _merge(with_sinks(_with(_fully_masked, kv_heads=2)), 3, empty=True), kind="merge"),
    Case("merge_four_splits_huge",
         "4 splits of a bottom-right causal mask (rows 0-1 empty), logits ~1e4: exp(lse) overflows",
         _merge(huge_causal, 4, scale=1.0), kind="merge"),
    Case("paged_decode_gqa",
         "paged_attention: 3 sequences of 7, 0 and 4 keys in shuffled pages of 3, 4 over 2 heads",
         _sdpa(paged((7, 0, 4), q_len=1, block_size=3, num_blocks=8)), kind="paged"),
    Case("paged_two_queries_sinks",
         "paged_attention, 2 queries per sequence (5, 1, 7 keys: one sees none), sinks, cap 2.5",
         _sdpa(with_sinks(paged((5, 1, 7), q_len=2, block_size=3, num_blocks=9)), softcap=2.5),
         kind="paged"),
    Case("module_self_attention", "SelfAttention(3, 2, 4) with the article's weights",
         _module("SelfAttention", {"d_in": 3, "d_out_kq": 2, "d_out_v": 4}, _seed_self),
         kind="module"),
    Case("module_causal_self_attention", "CausalSelfAttention(3, 2, 4), eval mode",
         _module("CausalSelfAttention", {"d_in": 3, "d_out_kq": 2, "d_out_v": 4}, _seed_self),
         kind="module"),
    Case("module_cross_attention", "CrossAttention(3, 2, 4) over the article's second input",
         _module("CrossAttention", {"d_in": 3, "d_out_kq": 2, "d_out_v": 4}, _seed_cross),
         kind="module"),
    Case("module_multihead_wrapper", "MultiHeadAttentionWrapper(3, 2, 1, num_heads=4)",
         _module("MultiHeadAttentionWrapper",
                 {"d_in": 3, "d_out_kq": 2, "d_out_v": 1, "num_heads": 4}, _seed_wrapper),
         kind="module"),
    Case("module_multihead_attention",
         "MultiHeadAttention(16, 4 heads, 2 kv heads, bias) cross-attention with padding mask",
         _module("MultiHeadAttention", {"d_model": 16, "num_heads": 4, "num_kv_heads": 2},
                 _mha, {"return_weights": True}),
         kind="module"),
    Case("module_causal_decode",
         "CausalSelfAttention(3, 2, 4) decoding the article's 6 tokens one by one",
         _module("CausalSelfAttention", {"d_in": 3, "d_out_kq": 2, "d_out_v": 4}, _seed_self,
                 decode=(1, 1, 1, 1, 1, 1)),
         kind="module"),
    Case("module_multihead_decode",
         "MultiHeadAttention(16, 4 heads, 2 kv heads) causal, decoded in chunks of 1, 2, 3",
         _module("MultiHeadAttention", {"d_model": 16, "num_heads": 4, "num_kv_heads": 2},
                 _mha_self, {"is_causal": True}, decode=(1, 2, 3)),
         kind="module"),
) + PACKED_CASES + COMBINED_CASES + ROTARY_CASES + QUANTIZED_CASES + LATENT_CASES
# chunks, ALiBi, segments, mods, varlen; features together; the rotary position embedding
# (``cases.rotary``); quantised KV caches (``cases.quantized``); MLA (``cases.latent``)

CASE_NAMES = tuple(c.name for c in CASES)


def get(name: str) -> Case:
    """The case called ``name`` (``UsageError`` with the known names otherwise)."""
    for case in CASES:
        if case.name == name:
            return case
    raise UsageError(f"unknown case {name!r}; known cases: {', '.join(CASE_NAMES)}")


def select(patterns: list[str] | None = None) -> list[Case]:
    """Cases whose name matches any glob pattern (all cases for None/empty)."""
    if not patterns:
        return list(CASES)
    chosen = [c for c in CASES if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]
    if not chosen:
        raise UsageError(f"no case matches {' '.join(patterns)}; known cases: "
                         f"{', '.join(CASE_NAMES)}")
    return chosen


__all__ = ["BLOCKWISE_TILES", "CASES", "CASE_NAMES", "DTYPES", "SDPA_ARRAYS", "SDPA_OPTIONS",
           "Case", "CaseData", "cast", "get", "prepare_inputs", "sdpa_arrays", "sdpa_options",
           "select"]
