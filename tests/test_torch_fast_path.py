"""torch_attn's SDPA fast path: it equals the explicit steps and numpy_attn in float64, the
selection rules, one mask and SDPA's own ``is_causal`` only top-left, no score-sized mask for
bottom-right causal, fully masked rows and non-finite inputs as the spec says, half precision
(correctly rounded float32 compute) and torch.compile.

Expected values come from ``conformance.cases.reference`` under the harness's tolerance rule
(``tests/numerics.py``) or from ``numpy_attn`` in float64; never from torch_attn itself.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from numerics import assert_conforms, expected_values  # noqa: E402
from torch.nn.attention.bias import CausalBias  # noqa: E402
from torch.utils._python_dispatch import (  # noqa: E402
    TorchDispatchMode,
    _disable_current_modes,
)
from torch_inputs import F64, _numpy_ref, _qkv  # noqa: E402

import attention_rules  # noqa: E402
import torch_attn  # noqa: E402
from torch_attn import _fast  # noqa: E402

# ------------------------------------------------------------------------------------------
# The fast path
# ------------------------------------------------------------------------------------------

FAST_CASES = [
    # (shape_q, shape_kv, v_dim, kwargs)
    ((5, 4), (7, 4), None, {}),
    ((5, 4), (7, 4), 3, {"is_causal": True}),
    ((2, 6, 8), (2, 6, 8), None, {"is_causal": True}),  # SDPA's own is_causal
    ((2, 6, 8), (2, 9, 8), None, {"is_causal": True}),
    ((2, 6, 8), (2, 4, 8), 5, {"is_causal": True, "causal_alignment": "bottom_right"}),
    ((2, 4, 6, 8), (2, 2, 9, 8), None, {"window": (2, 1), "causal_alignment": "bottom_right"}),
    ((2, 4, 6, 8), (2, 1, 9, 8), 6, {"is_causal": True, "mask": "padding", "bias": True}),
    ((2, 4, 6, 8), (2, 4, 6, 8), None, {"mask": "padding", "scale": 0.3}),
    ((2, 4, 6, 8), (2, 2, 6, 8), None, {"bias": True, "window": (1, 1)}),
]


def _selected(q, k, v, softcap=None, dropout_p=0.0, return_weights=False):
    """What ``_fast.use_fast_path`` selects for these tensors (no mask, no bias)."""
    info = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in (q, k, v)]
    args = attention_rules.attention_arguments(
        "test", *info, softcap=softcap, dropout_p=dropout_p, return_weights=return_weights,
        dropout_mask=None if dropout_p == 0 else ((), "bool"),
    )
    return _fast.use_fast_path(q, k, v, None, None, args)


def _fast_kwargs(shape_q, shape_kv, kw, dtype):
    kw = dict(kw)
    target = shape_q[:-1] + (shape_kv[-2],)
    g = torch.Generator().manual_seed(7)
    if kw.get("mask") == "padding":  # sequence 0 keeps no key at all: fully masked rows
        kw["mask"] = torch_attn.padding_mask(torch.tensor([0, 5]), shape_kv[-2])
    if kw.get("bias"):
        kw["bias"] = torch.randn(target, generator=g, dtype=F64).to(dtype)
    return kw


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("case", range(len(FAST_CASES)))
def test_fast_path_matches_explicit_path_and_reference(case, dtype):
    shape_q, shape_kv, v_dim, kw = FAST_CASES[case]
    q, k, v = _qkv(shape_q, shape_kv, v_dim, dtype=dtype, seed=case)
    kw = _fast_kwargs(shape_q, shape_kv, kw, dtype)
    assert _selected(q, k, v) == "sdpa"
    fast = torch_attn.scaled_dot_product_attention(q, k, v, **kw)
    explicit, _ = torch_attn.scaled_dot_product_attention(q, k, v, return_weights=True, **kw)
    assert fast.dtype == dtype
    # each path against the float64 reference, under the harness's tolerance rule
    arrays = {n: t.numpy() for n, t in {"query": q, "key": k, "value": v, **kw}.items()
              if isinstance(t, torch.Tensor)}
    options = {n: x for n, x in kw.items() if not isinstance(x, torch.Tensor)}
    name = str(dtype).removeprefix("torch.")
    exp = expected_values(arrays, name, **options)
    assert_conforms(exp, "output", fast.numpy(), f"SDPA path, case {case}")
    assert_conforms(exp, "output", explicit.numpy(), f"explicit path, case {case}")


def test_fast_path_selection_rules():
    q, k, v = _qkv((2, 3, 4), (2, 5, 4), dtype=torch.bfloat16)
    assert _selected(q, k, v) == "sdpa"  # half dtypes, as float32 copies
    assert _selected(q, k, v, return_weights=True) is None  # SDPA returns no weights
    assert _selected(q, k, v, dropout_p=0.1) is None  # dropout: our rng, not SDPA's
    assert _selected(q, k, v, softcap=2.0) is None  # softcap
    empty_kv = k[..., :0, :]
    assert _selected(q, empty_kv, v[..., :0, :]) is None  # kv_len == 0
    assert _selected(q[..., :0], k[..., :0], v) is None  # head_dim == 0
    for bad in (float("nan"), float("inf"), float("-inf")):  # non-finite query or key
        q_bad, k_bad = q.clone(), k.clone()
        q_bad[0, 1, 2] = bad
        k_bad[1, 4, 0] = bad
        assert _selected(q_bad, k, v) is None and _selected(q, k_bad, v) is None
    v_nan = v.clone()
    v_nan[0, 0, 0] = float("nan")
    assert _selected(q, k, v_nan) == "sdpa"  # SDPA gives NaN wherever the weight is non-zero


def test_fast_path_calls_sdpa_with_one_mask_and_is_causal_only_when_top_left(monkeypatch):
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return sdpa(*args, **kwargs)

    # sdpa.py's F only: torch's causal_lower_right dispatches on torch.nn.functional's own SDPA
    monkeypatch.setattr(_fast.sdpa, "F", types.SimpleNamespace(scaled_dot_product_attention=spy))
    q, k, v = _qkv((1, 4, 3, 8), (1, 2, 5, 8))
    torch_attn.scaled_dot_product_attention(q, k, v, is_causal=True)  # top-left: SDPA's own
    assert calls[-1]["is_causal"] is True and calls[-1]["attn_mask"] is None
    torch_attn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                            causal_alignment="bottom_right")
    assert calls[-1].get("is_causal", False) is False
    assert isinstance(calls[-1]["attn_mask"], CausalBias)  # causal_lower_right: no mask of ours
    assert calls[-1]["enable_gqa"] is True
    torch_attn.scaled_dot_product_attention(torch.cat([q, q], dim=-2), k, v, is_causal=True,
                                            causal_alignment="bottom_right")  # q_len > kv_len
    assert calls[-1]["is_causal"] is True and calls[-1].get("attn_mask") is None  # a square
    torch_attn.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert calls[-1]["is_causal"] is True and calls[-1]["attn_mask"] is None
    torch_attn.scaled_dot_product_attention(q, q, q, is_causal=True, mask=torch.ones(3, 3) > 0)
    assert calls[-1]["is_causal"] is False and calls[-1]["attn_mask"].shape == (3, 3)
    torch_attn.scaled_dot_product_attention(q, k, v, return_weights=True)
    assert len(calls) == 5  # the explicit path does not call SDPA


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("shape_q, shape_kv", [
    ((2, 4, 96, 8), (2, 2, 40, 8)),  # q_len > kv_len: the first 56 queries see no key
    ((2, 4, 40, 8), (2, 2, 96, 8)),  # q_len < kv_len
    ((96, 8), (40, 8)),  # 2-D
])
def test_bottom_right_causal_fast_path_builds_no_score_sized_mask(
    shape_q, shape_kv, dtype, monkeypatch
):
    """Bottom-right causal alone takes SDPA without a ``(q_len, kv_len)`` mask of ours: every
    tensor that an operator returns, forward and backward, is recorded (a dispatch mode sees
    each aten call, torch's own Python code included). ``q_len < kv_len`` on the CPU: torch
    2.13 has no lower-right kernel there, so ``causal_lower_right`` builds its own boolean
    (``CausalBias._materialize``) and SDPA its float copy: the only ones allowed."""
    q_len, kv_len = shape_q[-2], shape_kv[-2]
    q, k, v = _qkv(shape_q, shape_kv, dtype=dtype, seed=13, grad=True)
    kw = {"is_causal": True, "causal_alignment": "bottom_right"}
    assert _selected(q, k, v) == "sdpa"
    made = []
    real = _fast.sdpa.causal_lower_right

    def outside_the_mode(*size):  # an empty tensor subclass: torch makes none under a mode
        with _disable_current_modes():
            return real(*size)

    monkeypatch.setattr(_fast.sdpa, "causal_lower_right", outside_the_mode)

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made.extend((func, tuple(t.shape)) for t in torch.utils._pytree.tree_leaves(out)
                        if isinstance(t, torch.Tensor))
            return out

    with Record():
        out = torch_attn.scaled_dot_product_attention(q, k, v, **kw)
        out.sum().backward()
    score_sized = [func for func, shape in made if shape[-2:] == (q_len, kv_len)]
    # torch's own: CausalBias._materialize (ones, tril) and CPU SDPA's float copy of it (where)
    torch_owns = {torch.ops.aten.ones.default, torch.ops.aten.tril.default,
                  torch.ops.aten.where.self}
    if q_len < kv_len and q.device.type == "cpu":
        score_sized = [f for f in score_sized if f not in torch_owns]
    assert not score_sized, score_sized
    ref = _numpy_ref(q, k, v, **kw)  # float64
    tol = {"atol": 1e-12, "rtol": 1e-10} if dtype == F64 else {"atol": 2e-6, "rtol": 2e-5}
    torch.testing.assert_close(out.detach().double(), ref, **tol)
    if q_len > kv_len:  # rows without a key: output and gradient exactly 0
        empty = q_len - kv_len
        assert not out[..., :empty, :].any() and not q.grad[..., :empty, :].any()


def test_sdpa_on_cpu_zeroes_fully_masked_rows():
    """What the fast path relies on for CPU (torch 2.13): output and gradient exactly 0 for
    a fully masked row, with a boolean and with an additive -inf mask, 2-D and 4-D."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    allowed = torch.ones(3, 5, dtype=torch.bool)
    allowed[1] = False
    additive = torch.zeros(3, 5).masked_fill(~allowed, float("-inf"))
    for shape_q, shape_kv in [((3, 4), (5, 4)), ((2, 2, 3, 4), (2, 2, 5, 4))]:
        for attn_mask in (allowed, additive):
            q, k, v = _qkv(shape_q, shape_kv, dtype=torch.float32, grad=True)
            out = sdpa(q, k, v, attn_mask=attn_mask)
            out.sum().backward()
            assert torch.equal(out[..., 1, :], torch.zeros_like(out[..., 1, :]))
            assert torch.equal(q.grad[..., 1, :], torch.zeros_like(q.grad[..., 1, :]))
            assert not any(t.grad.isnan().any() for t in (q, k, v))


def test_sdpa_is_causal_is_top_left():
    """Why bottom-right alignment is always an explicit mask: SDPA's is_causal is top-left."""
    q, k, v = _qkv((1, 1, 3, 4), (1, 1, 5, 4))
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = _numpy_ref(q, k, v, is_causal=True, causal_alignment="top_left")
    torch.testing.assert_close(got, ref)


def test_non_cpu_route_zeroes_rows_itself(monkeypatch):
    """The route taken off the CPU (rows given every key, output zeroed), exercised here."""
    monkeypatch.setattr(_fast.sdpa, "CPU_SDPA_ZEROES_MASKED_ROWS", False)
    q, k, v = _qkv((2, 4, 6, 8), (2, 2, 9, 8), grad=True)
    mask = torch_attn.padding_mask(torch.tensor([0, 7]), 9)
    bias = torch.randn(2, 4, 6, 9, dtype=F64)
    for kw in ({"mask": mask}, {"mask": mask, "bias": bias, "is_causal": True}):
        out = torch_attn.scaled_dot_product_attention(q, k, v, **kw)
        torch.testing.assert_close(out, _numpy_ref(q, k, v, **kw), atol=1e-12, rtol=1e-10)
        q.grad = None
        out.sum().backward()
        assert torch.equal(q.grad[0], torch.zeros_like(q.grad[0]))


def test_sdpa_spreads_masked_nan_keys_so_non_finite_inputs_take_the_steps():
    """What SDPA does with NaN and infinities (torch 2.13, CPU), and why ``use_fast_path``
    checks ``isfinite``: the spec's rule (``spec.NON_FINITE``) needs the explicit steps."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k, v = _qkv((1, 1, 3, 4), (1, 1, 4, 4), v_dim=2, dtype=torch.float32, seed=3)
    causal = torch.ones(3, 4, dtype=torch.bool).tril()  # rows 0 and 1 do not attend key 2
    k_nan = k.clone()
    k_nan[0, 0, 2, 0] = float("nan")
    assert sdpa(q, k_nan, v, attn_mask=causal).isnan().all()  # SDPA: every row NaN
    ours = torch_attn.scaled_dot_product_attention(q, k_nan, v, mask=causal)
    assert not ours[0, 0, :2].isnan().any() and ours[0, 0, 2].isnan().all()  # the spec
    # -inf in query row 1: scores -inf at the allowed keys 0-1, +inf at the masked keys 2-3;
    # SDPA adds the mask (+inf - inf = NaN), the spec masks: a fully masked row, exactly 0
    k_signs, q_minf = k.clone(), q.clone()
    k_signs[0, 0, :, 0] = torch.tensor([1.0, 2.0, -1.0, -2.0])
    q_minf[0, 0, 1, 0] = float("-inf")
    assert sdpa(q_minf, k_signs, v, attn_mask=causal)[0, 0, 1].isnan().all()
    ours = torch_attn.scaled_dot_product_attention(q_minf, k_signs, v, mask=causal)
    assert torch.equal(ours[0, 0, 1], torch.zeros(2))
    # a NaN query row is NaN in both
    q_nan = q.clone()
    q_nan[0, 0, 1, 0] = float("nan")
    assert sdpa(q_nan, k, v)[0, 0, 1].isnan().all()
    out = torch_attn.scaled_dot_product_attention(q_nan, k, v)
    assert out[0, 0, 1].isnan().all() and not out[0, 0, [0, 2]].isnan().any()


@pytest.mark.parametrize("where", ["query", "key", "value"])
def test_non_finite_inputs_equal_numpy_attn(where, path):
    q, k, v = _qkv((2, 2, 5, 4), (2, 2, 6, 4), v_dim=3, dtype=F64, seed=9)
    tensor = {"query": q, "key": k, "value": v}[where]
    tensor[1, 0, 3, 1] = float("nan")
    tensor[0, 1, 2, 0] = float("inf")
    mask = torch.rand(5, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    for kw in ({}, {"is_causal": True}, {"mask": mask, "window": (2, 1)}):
        out = torch_attn.scaled_dot_product_attention(q, k, v, **kw)
        with np.errstate(invalid="ignore"):
            expected = _numpy_ref(q, k, v, **kw)
        nan = expected.isnan()
        if where == "value":  # rows with weight 0 on the bad value row are unspecified
            assert out[nan.all(-1, keepdim=True).expand_as(out)].isnan().all()
            continue
        assert torch.equal(out.isnan(), nan), kw
        torch.testing.assert_close(out[~nan], expected[~nan])


# ------------------------------------------------------------------------------------------
# Half precision
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes(dtype, path):
    q, k, v = _qkv((2, 2, 16, 8), (2, 2, 24, 8), dtype=dtype, seed=11)
    kw = {"is_causal": True, "causal_alignment": "bottom_right"}
    out = torch_attn.scaled_dot_product_attention(q, k, v, **kw)
    assert out.dtype == dtype
    ref = _numpy_ref(q, k, v, **kw)  # float64 from the same (rounded) inputs
    # float32 compute: the only error left is the final rounding to the half type
    correctly_rounded = (out == ref.to(dtype)).double().mean().item()
    assert correctly_rounded > 0.98
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    torch.testing.assert_close(out.double(), ref, atol=1e-3, rtol=ulp)
    assert torch_attn.attention_scores(q, k).dtype == torch.float32


# ------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------


def test_torch_compile():
    # aot_eager: inductor's first C++ build takes ~16 s on two cores (0.4 s with aot_eager)
    torch._dynamo.reset()
    q, k, v = _qkv((1, 2, 3, 4), (1, 2, 5, 4))
    mask = torch.tensor([True, False, True, True, True])[None].expand(3, 5).clone()
    mask[1] = False
    eager = torch_attn.scaled_dot_product_attention(q, k, v, mask=mask, is_causal=True)
    fast = torch.compile(_fast.sdpa._sdpa_attention, backend="aot_eager", fullgraph=True)
    out = fast(q, k, v, mask, None, True, "top_left", None, 0.5)
    torch.testing.assert_close(out, eager)
    assert torch.equal(out[..., 1, :], torch.zeros_like(out[..., 1, :]))
    whole = torch.compile(torch_attn.scaled_dot_product_attention, backend="aot_eager")
    got, weights = whole(q, k, v, mask=mask, is_causal=True, softcap=3.0, return_weights=True)
    ref = _numpy_ref(q, k, v, mask=mask, is_causal=True, softcap=3.0)
    torch.testing.assert_close(got, ref)
    assert torch.equal(weights[..., 1, :], torch.zeros_like(weights[..., 1, :]))


@pytest.mark.parametrize("scale", [0.0, -0.0, -0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_zero_and_negative_scales_with_a_mask_give_numbers(scale, dtype):
    """torch's SDPA multiplies the masked ``-inf`` by the scale (NaN rows for 0, ``+inf`` for a
    negative scale); the spec masks after scaling, so every row is a number."""
    q, k, v = _qkv((2, 3, 9, 8), (2, 3, 9, 8), dtype=dtype)
    mask = torch.rand(2, 1, 9, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    for kw in ({"is_causal": True}, {"mask": mask}):
        out = torch_attn.scaled_dot_product_attention(q, k, v, scale=scale, **kw)
        want = _numpy_ref(q, k, v, scale=scale, **kw)
        assert not out.isnan().any(), (scale, kw.keys())
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
