"""torch_attn's fast paths, forward and backward, against the explicit steps in float64.

What SDPA cannot skip (a soft-cap, a window, the causal rule bottom-right with q_len != kv_len)
runs, for large inputs, on ``blockwise._BlockwiseAttention`` (``_fast.use_fast_path`` returns
``"blocked"``); the rest runs on SDPA. Here the selection numbers are patched down so small
inputs take the blocked path and are cut into several tiles; the expected values are the
explicit steps (``return_weights=True`` always runs them) differentiated by autograd, an
independent computation that materialises the whole score matrix.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="pip install torch==2.13.0")

import attention_rules  # noqa: E402
import torch_attn  # noqa: E402
from torch_attn import _fast  # noqa: E402

F64 = torch.float64
TOL = {"atol": 1e-12, "rtol": 1e-10}


@pytest.fixture
def small_tiles(monkeypatch):
    """Every input takes the blocked path, in tiles of 8 queries by 16 keys."""
    monkeypatch.setattr(_fast, "MAX_TILE_FRACTION", 1.0)
    monkeypatch.setattr(_fast, "MIN_SCORES", 1)
    monkeypatch.setattr(_fast, "MIN_Q_LEN", 1)
    monkeypatch.setattr(_fast, "BLOCK_Q", 8)
    monkeypatch.setattr(_fast, "BLOCK_KV", 16)


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


# (query shape, key shape, options, whether some rows are fully masked): each beyond SDPA
BLOCKED_CASES = [
    ((2, 4, 37, 8), (2, 2, 29, 8), {"softcap": 2.5}, False),  # grouped-query heads
    ((2, 2, 37, 8), (2, 2, 45, 8), {"softcap": 4.0, "is_causal": True}, False),
    ((2, 2, 40, 8), (2, 2, 40, 8), {"window": (5, 3)}, False),
    ((1, 3, 33, 8), (1, 3, 50, 8), {"window": (7, 0), "causal_alignment": "bottom_right"}, False),
    ((2, 2, 30, 8), (2, 2, 47, 8), {"is_causal": True, "causal_alignment": "bottom_right"}, False),
    ((33, 8), (21, 8), {"is_causal": True, "causal_alignment": "bottom_right"}, True),  # 2-D
    ((2, 2, 30, 8), (2, 1, 40, 8), {"softcap": 3.0, "mask": "padding", "bias": "random"}, True),
    ((2, 2, 30, 8), (2, 2, 40, 8), {"window": (None, 2), "bias": "empty rows", "scale": 0.4},
     True),
]


def _options(options, shape_q, shape_kv):
    """The keyword arguments (a padding mask whose sequence 0 keeps no key) and the bias
    ``(heads, q_len, kv_len)`` (``"empty rows"``: query 3 of every head keeps no key)."""
    kw = dict(options)
    kind = kw.pop("bias", None)
    if kw.get("mask") == "padding":
        kw["mask"] = torch_attn.padding_mask(torch.tensor([0, shape_kv[-2] - 3]), shape_kv[-2])
    if kind is None:
        return kw, None
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(shape_q[-3:-1] + (shape_kv[-2],), generator=gen, dtype=F64)
    if kind == "empty rows":
        bias[..., 3, :] = float("-inf")
        bias[0, 7, ::2] = float("-inf")  # and half the keys of one row
    return kw, bias


@pytest.mark.parametrize("case", range(len(BLOCKED_CASES)))
def test_blocked_path_equals_explicit_steps_with_gradients(case, small_tiles):
    shape_q, shape_kv, options, has_empty_rows = BLOCKED_CASES[case]
    q, k, v, g = _tensors(shape_q, shape_kv, seed=case)
    kw, bias = _options(options, shape_q, shape_kv)
    assert _path(q, k, v, bias=bias, **kw) == "blocked"
    out, grads = _forward_and_grads(q, k, v, g, bias=bias, **kw)
    ref_out, ref_grads = _forward_and_grads(q, k, v, g, bias=bias, return_weights=True, **kw)
    assert out.dtype == F64 and out.shape == ref_out.shape
    torch.testing.assert_close(out, ref_out, **TOL)
    names = ("query", "key", "value", "bias")[: 3 if bias is None else 4]
    for name, got, expected in zip(names, grads, ref_grads, strict=True):
        torch.testing.assert_close(got, expected, **TOL, msg=lambda m, n=name: f"grad {n}: {m}")
    # fully masked rows: output and query gradient exactly 0; no NaN anywhere
    empty = ref_out.eq(0).all(dim=-1)  # (..., q_len)
    assert bool(empty.any()) == has_empty_rows
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.equal(grads[0][empty], torch.zeros_like(grads[0][empty]))
    if options.get("bias") == "empty rows":  # and the bias gradient of the empty rows
        assert torch.equal(grads[3][..., 3, :], torch.zeros_like(grads[3][..., 3, :]))
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


@pytest.mark.parametrize("q_len,kv_len", [(7, 12), (12, 7)])
def test_sdpa_is_causal_top_left_gradients_equal_explicit_steps(q_len, kv_len):
    """Top-left causal with q_len != kv_len runs on SDPA's own ``is_causal``."""
    q, k, v, g = _tensors((2, 3, q_len, 8), (2, 3, kv_len, 8), seed=3)
    assert _path(q, k, v, is_causal=True) == "sdpa"
    out, grads = _forward_and_grads(q, k, v, g, is_causal=True)
    ref_out, ref_grads = _forward_and_grads(q, k, v, g, is_causal=True, return_weights=True)
    torch.testing.assert_close(out, ref_out, **TOL)
    for got, expected in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_path_keeps_the_input_dtype(dtype, small_tiles):
    q, k, v, g = _tensors((1, 2, 20, 8), (1, 2, 26, 8), seed=4, dtype=dtype)
    kw = {"softcap": 3.0, "is_causal": True, "causal_alignment": "bottom_right"}
    out, grads = _forward_and_grads(q, k, v, g, **kw)
    ref_out, ref_grads = _forward_and_grads(*(t.double() for t in (q, k, v, g)),
                                            return_weights=True, **kw)
    assert out.dtype == dtype and all(t.dtype == dtype for t in grads)
    tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.double(), ref_out, **tol)
    for got, expected in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), expected, **tol)


@pytest.mark.parametrize("cpu_zeroes_rows", [True, False])
@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"mask": "padding"}])
def test_sdpa_bias_with_empty_rows_gradients_equal_explicit_steps(kw, cpu_zeroes_rows,
                                                                  monkeypatch):
    """A bias that empties rows (``-inf``) stays on SDPA, which zeroes such rows on the CPU;
    on other devices ``_sdpa_attention`` gives them every key and zeroes them itself (the
    route ``CPU_SDPA_ZEROES_MASKED_ROWS = False`` takes here)."""
    monkeypatch.setattr(_fast, "CPU_SDPA_ZEROES_MASKED_ROWS", cpu_zeroes_rows)
    shape_q, shape_kv = (2, 2, 12, 8), (2, 2, 15, 8)
    q, k, v, g = _tensors(shape_q, shape_kv, seed=6)
    kw, bias = _options({**kw, "bias": "empty rows"}, shape_q, shape_kv)
    assert _path(q, k, v, bias=bias, **kw) == "sdpa"
    out, grads = _forward_and_grads(q, k, v, g, bias=bias, **kw)
    ref_out, ref_grads = _forward_and_grads(q, k, v, g, bias=bias, return_weights=True, **kw)
    torch.testing.assert_close(out, ref_out, **TOL)
    for got, expected in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, expected, **TOL)
    for zero in (out[..., 3, :], grads[0][..., 3, :], grads[3][..., 3, :]):  # the empty row
        assert torch.equal(zero, torch.zeros_like(zero))
