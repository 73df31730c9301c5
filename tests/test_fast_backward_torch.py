"""torch_attn's fast paths, forward and backward, against the float64 reference.

What SDPA cannot skip (a soft-cap, a window, the causal rule bottom-right with q_len != kv_len)
runs, for large inputs, on ``_tiles.BlockwiseFunction`` (``_fast.use_fast_path`` returns
``"blocked"``); the rest runs on SDPA. Here the selection numbers are patched down so the
harness's small cases (``conformance.cases``, some with an option added) take the blocked path
and are cut into tiles of ``cases.BLOCKWISE_TILES`` that do not divide their lengths. Expected
values, exact zeros and gradients come from ``conformance.cases.expected`` (the float64
``conformance.cases.reference`` and its VJP, against the case's seeded ``grad_output``), judged by
the harness's one tolerance rule (``conformance.comparing.compare``); never from torch_attn itself.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="pip install torch==2.13.0")

import attention_rules  # noqa: E402
import torch_attn  # noqa: E402
from conformance import spec  # noqa: E402
from conformance.cases import catalogue as cases  # noqa: E402
from conformance.cases import expected  # noqa: E402
from conformance.cases.naive import Precision, naive_attention_vjp  # noqa: E402
from conformance.comparing import compare  # noqa: E402
from conformance.running import backends  # noqa: E402
from torch_attn import _fast  # noqa: E402

F64 = torch.float64
GRADS = ("query", "key", "value", "bias")
TORCH = backends.get("torch")  # NumPy <-> torch, bfloat16 included, as the harness converts


@pytest.fixture
def small_tiles(monkeypatch):
    """Every input takes the blocked path, in the harness's small tiles (2 queries, 3 keys)."""
    monkeypatch.setattr(_fast, "MAX_TILE_FRACTION", 1.0)
    monkeypatch.setattr(_fast, "MIN_SCORES", 1)
    monkeypatch.setattr(_fast, "MIN_Q_LEN", 1)
    monkeypatch.setattr(_fast, "BLOCK_Q", cases.BLOCKWISE_TILES["block_q"])
    monkeypatch.setattr(_fast, "BLOCK_KV", cases.BLOCKWISE_TILES["block_kv"])


def _tensors(shape_q, shape_kv, seed, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(shape_q, generator=gen, dtype=F64).to(dtype)
    k = torch.randn(shape_kv, generator=gen, dtype=F64).to(dtype)
    v = torch.randn(shape_kv[:-1] + (5,), generator=gen, dtype=F64).to(dtype)  # v_dim 5
    g = torch.randn(shape_q[:-1] + (5,), generator=gen, dtype=F64).to(dtype)
    return q, k, v, g


def _forward_and_grads(q, k, v, g, bias=None, **kw):
    """Output and the gradients of ``(output * g).sum()`` w.r.t. q, k, v (and bias)."""
    inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    if bias is not None:
        inputs.append(bias.detach().clone().requires_grad_(True))
    out = torch_attn.scaled_dot_product_attention(
        *inputs[:3], bias=inputs[3] if bias is not None else None, **kw
    )
    if isinstance(out, tuple):
        out = out[0]
    grads = torch.autograd.grad(out, inputs, grad_outputs=g)
    return out.detach(), grads


def _path(q, k, v, mask=None, bias=None, **kw):
    info = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in (q, k, v)]
    extra = {} if bias is None else {"bias": (tuple(bias.shape), "float64")}
    if mask is not None:
        extra["mask"] = (tuple(mask.shape), "bool")
    args = attention_rules.attention_arguments("test", *info, **extra, **kw)
    return _fast.use_fast_path(q, k, v, mask, bias, args)


def _expected(data, dtype):
    """``expected.expected_for`` with gradients; where an input is not finite (a ``-inf`` bias
    emptying rows) the harness compares no gradient, so they are added here from the float64
    reference VJP and the naive baseline, as ``expected.expected_for`` computes them."""
    exp = expected.expected_for(data, "sdpa", dtype)
    if "grad_query" not in exp.values:
        p = Precision(dtype)
        with np.errstate(all="ignore"):
            ref = expected.reference_attention_vjp(exp.data.arrays, exp.data.options)
            naive = naive_attention_vjp(exp.data.arrays, exp.data.options, p)
        for name in GRADS:
            if getattr(ref, name) is not None:
                exp.values[f"grad_{name}"] = getattr(ref, name)
                exp.baseline[f"grad_{name}"] = expected.baseline_error(getattr(naive, name),
                                                                       getattr(ref, name), p)
        empty = np.isneginf(exp.values["masked_scores"]).all(-1, keepdims=True)  # (..., q, 1)
        exp.zeros["grad_query"] = np.broadcast_to(empty, exp.values["grad_query"].shape)
    return exp


def _case(name, dtype="float64", **extra):
    """The case's inputs in ``dtype``, with ``extra`` options, and their expected values."""
    data = cases.prepare_inputs(cases.get(name), dtype)
    data.options.update(extra)
    return _expected(data, dtype)


def _torch_inputs(exp):
    """(q, k, v, grad_output, bias or None, keyword arguments) as tensors."""
    a = {n: TORCH.asarray(x) for n, x in exp.data.arrays.items()}
    kw = cases.sdpa_options(exp.data.options)
    if "mask" in a:
        kw["mask"] = a["mask"]
    return a["query"], a["key"], a["value"], a["grad_output"], a.get("bias"), kw


def _assert_conforms(exp, out, grads, what=""):
    """Output and gradients under the harness's rule, in the input dtype; exact zeros included."""
    results = [compare.compare_step(exp, "output", TORCH.to_numpy(out), "input")]
    for name, grad in zip(GRADS, grads, strict=False):
        results.append(compare.compare_step(exp, f"grad_{name}", TORCH.to_numpy(grad), "input"))
    for res in results:
        assert res.passed, (
            f"{res.step}: {res.ratio:.3g} × tolerance at {res.index} (got {res.actual}, "
            f"expected {res.expected}, bound {res.bound}) {res.note} [torch_attn vs float64 "
            f"reference, case={exp.case}, dtype={exp.dtype}{what}]")


# (case, options added to it): each beyond SDPA
BLOCKED_CASES = [
    ("causal_bottom_right", {}),
    ("causal_bottom_right_q_longer", {}),  # rows 0-1 keep no key
    ("window", {}),
    ("window_causal_bottom_right", {}),
    ("softcap", {}),
    ("single_query_causal", {}),
    ("gqa", {"softcap": 2.5}),  # grouped-query heads
    ("two_d", {"is_causal": True, "causal_alignment": "bottom_right"}),
    ("mask_and_bias", {"softcap": 3.0}),
    ("kv_lengths", {"softcap": 3.0}),  # sequence 1 keeps no key
    ("mqa", {"window": (None, 2), "scale": 0.4}),
]


@pytest.mark.parametrize("case", range(len(BLOCKED_CASES)))
def test_blocked_path_matches_reference_with_gradients(case, small_tiles):
    name, extra = BLOCKED_CASES[case]
    exp = _case(name, **extra)
    q, k, v, g, bias, kw = _torch_inputs(exp)
    assert _path(q, k, v, bias=bias, **kw) == "blocked"
    out, grads = _forward_and_grads(q, k, v, g, bias=bias, **kw)
    assert out.dtype == F64
    _assert_conforms(exp, out, grads, f", options+={extra}")
    assert not any(t.isnan().any() for t in (out, *grads))


def test_blocked_path_keeps_no_score_matrix_for_autograd(small_tiles):
    """What autograd saves for the backward pass: no tensor of ``q_len × kv_len`` entries on
    the blocked path (the explicit steps save several)."""
    q, k, v, g = _tensors((1, 2, 64, 8), (1, 2, 64, 8), seed=1)

    def largest_saved(**kw):
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = torch_attn.scaled_dot_product_attention(*inputs, **kw)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(g)
        return max(sizes)

    scores = 2 * 64 * 64  # (heads, q_len, kv_len)
    assert largest_saved(softcap=3.0) <= q.numel()  # inputs, output and lse only
    assert largest_saved(softcap=3.0, return_weights=True) >= scores


def test_selection_rule_sends_only_what_sdpa_cannot_skip_to_the_blocks():
    big = torch.zeros(1, 1, 4096, 4)  # 4096 × 4096 score entries
    assert _path(big, big, big, softcap=2.0) == "blocked"
    assert _path(big, big, big, window=(64, 0)) == "blocked"  # about a fifth of the tiles
    assert _path(big, big, big, window=(2048, 2048)) == "sdpa"  # most tiles: SDPA and a mask
    short = big[..., :1024, :]  # bottom-right, 4096 queries, 1024 keys: 3072 rows keep none
    assert _path(big, short, short, is_causal=True, causal_alignment="bottom_right") == "blocked"
    assert _path(short, big, big, is_causal=True, causal_alignment="bottom_right") == "sdpa"
    assert _path(big, big, big, is_causal=True, causal_alignment="bottom_right") == "sdpa"
    assert _path(big, short, short, is_causal=True) == "sdpa"  # top-left: SDPA's is_causal
    assert _path(big, big, big, bias=torch.zeros(4096, 4096, dtype=F64)) == "sdpa"
    small = big[..., :32, :]  # below MIN_SCORES: softcap takes the steps, the rest SDPA
    assert _path(small, small, small, softcap=2.0) is None
    assert _path(small, small, small, window=(4, 0)) == "sdpa"
    decode = big[..., :1, :]  # one query (decoding): below MIN_Q_LEN
    assert _path(decode, big, big, window=(64, 0)) == "sdpa"
    nan_q = big.clone()
    nan_q[0, 0, 5, 0] = float("nan")  # non-finite: the steps, the spec's IEEE rule
    assert _path(nan_q, big, big, softcap=2.0) is None


def test_blocked_path_on_each_side_of_the_documented_thresholds():
    """The unpatched rule at ``spec.FAST_PATHS``' numbers (docs/spec.md): with a soft-cap
    (which only the tiles or the steps compute), at least ``min_q_len`` queries and
    ``min_scores`` score entries (all heads counted) take the tiles; one query or one key
    fewer takes the steps."""
    numbers = spec.FAST_PATHS["torch_attn"]["blocked"]
    min_q, min_scores = numbers["min_q_len"], numbers["min_scores"]
    kv = min_scores // min_q
    assert kv * min_q == min_scores  # the shapes below sit exactly on the threshold

    def path(q_len, kv_len, heads=1):
        q, k = torch.zeros(1, heads, q_len, 4), torch.zeros(1, heads, kv_len, 4)
        return _path(q, k, k, softcap=2.0)

    assert path(min_q, kv) == "blocked"
    assert path(min_q, kv - 1) is None
    assert path(min_q - 1, 2 * kv) is None
    assert path(min_q, kv // 2, heads=2) == "blocked"
    assert path(min_q, kv // 2 - 1, heads=2) is None


@pytest.mark.parametrize("case", ["causal_top_left", "causal_top_left_q_longer"])
def test_sdpa_is_causal_top_left_gradients_match_reference(case):
    """Top-left causal with q_len != kv_len runs on SDPA's own ``is_causal``."""
    exp = _case(case)
    q, k, v, g, _, kw = _torch_inputs(exp)
    assert _path(q, k, v, **kw) == "sdpa"
    out, grads = _forward_and_grads(q, k, v, g, **kw)
    _assert_conforms(exp, out, grads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocked_path_keeps_the_input_dtype(dtype, small_tiles):
    exp = _case("causal_bottom_right", dtype, softcap=3.0)
    q, k, v, g, _, kw = _torch_inputs(exp)
    out, grads = _forward_and_grads(q, k, v, g, **kw)
    assert out.dtype == q.dtype and all(t.dtype == q.dtype for t in grads)
    _assert_conforms(exp, out, grads)


@pytest.mark.parametrize("cpu_zeroes_rows", [True, False])
@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"mask": "padding"}])
def test_sdpa_bias_with_empty_rows_gradients_match_reference(kw, cpu_zeroes_rows,
                                                              monkeypatch):
    """A bias that empties rows (``-inf``) stays on SDPA, which zeroes such rows on the CPU;
    on other devices ``_sdpa_attention`` gives them every key and zeroes them itself (the
    route ``CPU_SDPA_ZEROES_MASKED_ROWS = False`` takes here)."""
    monkeypatch.setattr(_fast.sdpa, "CPU_SDPA_ZEROES_MASKED_ROWS", cpu_zeroes_rows)
    data = cases.prepare_inputs(cases.get("cross"), "float64")  # (2, 4, 5 over 7, 8)
    bias = np.random.default_rng(5).standard_normal((cases.H, cases.TQ, cases.TK))
    bias[..., 3, :] = -np.inf  # query 3 of every head keeps no key
    bias[0, 1, ::2] = -np.inf  # and half the keys of one row
    data.arrays["bias"] = bias
    if kw.get("mask") == "padding":  # sequence 0 keeps no key
        data.arrays["mask"] = (np.arange(cases.TK) < np.array([0, 4])[:, None])[:, None, None]
    data.options.update({k: v for k, v in kw.items() if k != "mask"})
    exp = _expected(data, "float64")
    q, k, v, g, bias, kw = _torch_inputs(exp)
    assert _path(q, k, v, bias=bias, **kw) == "sdpa"
    out, grads = _forward_and_grads(q, k, v, g, bias=bias, **kw)
    _assert_conforms(exp, out, grads)
    for zero in (out[..., 3, :], grads[0][..., 3, :], grads[3][..., 3, :]):  # the empty row
        assert torch.equal(zero, torch.zeros_like(zero))
