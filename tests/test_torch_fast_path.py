"""torch_attn's SDPA fast path: it equals the explicit steps and numpy_attn in float64, the
selection rules, one mask and SDPA's own ``is_causal`` only top-left, no score-sized mask for
bottom-right causal, fully masked rows and non-finite inputs as the spec says, half precision
(correctly rounded float32 compute) and torch.compile.

Expected values come from ``conformance.cases.reference`` under the harness's tolerance rule
(``tests/numerics.py``) or from ``numpy_attn`` in float64; never from torch_attn itself.

The last section (tests from mutation testing, docs/mutation.md) shrinks the blocks to 8 rows and
8 keys: ``"sdpa_blocks"`` (runs of rows with a mask, a bias, chunks or ALiBi; torch's CPU kernel
per part of keys for unbatched and 2-D inputs; causal in half precision, either alignment),
``"blocked"`` tiles with a mask and a bias of lower rank, and the route for devices whose SDPA
gives NaN to a row without a key: outputs, lse and gradients against the float64 reference.
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
from conformance.cases import reference  # noqa: E402
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


@pytest.mark.slow
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


# ------------------------------------------------------------------------------------------
# "sdpa_blocks" (runs of rows, parts of keys) and "blocked" tiles with masks, biases and mods,
# and rows without a key on devices whose SDPA gives them NaN: blocks of 8 rows and 8 keys
# ------------------------------------------------------------------------------------------


def _t(x: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x)).to(dtype)


@pytest.fixture
def small_blocks(monkeypatch):
    """``"sdpa_blocks"`` and ``"blocked"`` from any size, in blocks of 8 rows and 8 keys."""
    for name, value in (("SDPA_ROWS", 8), ("SDPA_KEYS", 8)):
        monkeypatch.setattr(_fast.sdpa, name, value)
    for name, value in (("BLOCK_Q", 8), ("BLOCK_KV", 8), ("MIN_SCORES", 0), ("MIN_Q_LEN", 1)):
        monkeypatch.setattr(_fast, name, value)


def _spy(monkeypatch, module, name) -> list:
    """The positional arguments of every call of ``module.name``."""
    calls, original = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(a) or original(*a, **k))
    return calls


_I, _J = np.arange(48)[:, None], np.arange(48)
#: keys 0-7 and the 17 up to the query's own; head 1's query 40 sees no key
SINKS_WINDOW = np.broadcast_to((_J < 8) | ((_I - 16 <= _J) & (_J <= _I)), (4, 48, 48)).copy()
SINKS_WINDOW[1, 40] = False


@pytest.mark.parametrize(("q_shape", "kv_shape"), [((4, 48, 8), (2, 48, 8)), ((48, 8), (48, 8))])
def test_parts_of_keys_of_unbatched_inputs_with_the_causal_band(small_blocks, monkeypatch,
                                                                q_shape, kv_shape):
    """torch's CPU kernel per part of keys for unbatched 3-D (per-head rules, grouped heads)
    and 2-D inputs, the causal band finite (so the ``"mask"`` parts intersect it with the
    rules), with a scale: the reference's output and gradients (``reference.attention_vjp``)."""
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal(s) for s in (q_shape, kv_shape, kv_shape, q_shape))
    table = SINKS_WINDOW if len(q_shape) == 3 else SINKS_WINDOW[0]
    tab = torch.from_numpy(table)
    mod = (lambda b, h, i, j: tab[h, i, j]) if table.ndim == 3 else (lambda b, h, i, j: tab[i, j])
    parts = _spy(monkeypatch, _fast.sdpa, "_flash_parts")
    inputs = [_t(x).requires_grad_() for x in (q, k, v)]
    out = torch_attn.scaled_dot_product_attention(*inputs, mask_mod=mod, is_causal=True,
                                                  scale=0.3)
    out.backward(_t(g))
    assert any(kind == "mask" for call in parts for _, _, kind in call[5])
    want = reference.attention_vjp(q, k, v, g, mask=table, is_causal=True, scale=0.3)
    np.testing.assert_allclose(out.detach().numpy(), reference.attention(
        q, k, v, mask=table, is_causal=True, scale=0.3).output, rtol=1e-5, atol=1e-5)
    for x, grad in zip(inputs, (want.query, want.key, want.value), strict=True):
        np.testing.assert_allclose(x.grad.numpy(), grad, rtol=1e-4, atol=1e-5)


def _nan_where_no_key(monkeypatch) -> list:
    """SDPA as on devices that give NaN, not 0, to a row whose every key is masked (torch
    2.13's CPU kernel gives 0): the path for those devices, checked on the CPU."""
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def kernel(query, key, value, attn_mask=None, **kwargs):
        out = sdpa(query, key, value, attn_mask=attn_mask, **kwargs)
        if attn_mask is None:
            return out
        allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > -torch.inf
        calls.append(bool((~allowed.any(-1)).any()))
        return torch.where(allowed.any(-1, keepdim=True), out, torch.nan)

    monkeypatch.setattr(_fast.sdpa, "CPU_SDPA_ZEROES_MASKED_ROWS", False)
    monkeypatch.setattr(_fast.sdpa.F, "scaled_dot_product_attention", kernel)
    return calls


def _mask_bias_inputs():
    """(1, 2, 24, 4) queries over one kv head; a (24, 24) boolean mask whose row 5 keeps no
    key; a per-head (2, 24, 24) bias; the gradient of the output."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s) for s in ((1, 2, 24, 4), (1, 1, 24, 4), (1, 1, 24, 3)))
    mask = rng.random((24, 24)) < 0.7
    mask[5] = False
    return q, k, v, mask, rng.standard_normal((2, 24, 24)), rng.standard_normal((1, 2, 24, 3))


@pytest.mark.parametrize("nan_kernel", [False, True])
def test_runs_of_rows_with_a_mask_a_bias_and_mods(small_blocks, monkeypatch, nan_kernel):
    """``"sdpa_blocks"`` with a boolean mask and a bias (one float mask per run, the mask and
    bias sliced to the run's rows and keys), chunks (and a scale) or ALiBi as the mods; and
    with a kernel that gives NaN to rows without a key (row 5), which the path for such
    devices gives every key and zeroes: the reference's output and gradients."""
    q, k, v, mask, bias, g = _mask_bias_inputs()
    calls = _nan_where_no_key(monkeypatch) if nan_kernel else []
    runs = _spy(monkeypatch, _fast.sdpa, "_sdpa_run")
    for mods in ({"chunk_size": 8, "scale": 0.3}, {"alibi_slopes": np.array([0.5, 0.25]),
                                         "is_causal": True}):
        runs.clear()
        inputs = [_t(x).requires_grad_() for x in (q, k, v)]
        given = {n: _t(x) if isinstance(x, np.ndarray) else x for n, x in mods.items()}
        out = torch_attn.scaled_dot_product_attention(
            *inputs, mask=torch.from_numpy(mask), bias=_t(bias), **given)
        out.backward(_t(g))
        assert len(runs) > 1
        want = reference.attention_vjp(q, k, v, g, mask=mask, bias=bias, **mods)
        np.testing.assert_allclose(out.detach().numpy(), reference.attention(
            q, k, v, mask=mask, bias=bias, **mods).output, rtol=1e-5, atol=1e-5)
        for x, grad in zip(inputs, (want.query, want.key, want.value), strict=True):
            np.testing.assert_allclose(x.grad.numpy(), grad, rtol=1e-4, atol=1e-5)
    assert not any(calls)  # the kernel never met a row without a key


def test_one_sdpa_call_with_rows_without_a_key_on_other_devices(monkeypatch):
    """``"sdpa"`` (small inputs) with a mask, and with a bias, where row 5 keeps no key, on a
    kernel that gives such rows NaN: every key given to the kernel there, the row zeroed."""
    q, k, v, mask, bias, g = _mask_bias_inputs()
    calls = _nan_where_no_key(monkeypatch)
    for options in ({"mask": mask}, {"mask": mask, "bias": bias}):
        inputs = [_t(x).requires_grad_() for x in (q, k, v)]
        given = {n: torch.from_numpy(x) if x.dtype == bool else _t(x) for n, x in options.items()}
        out = torch_attn.scaled_dot_product_attention(*inputs, **given)
        out.backward(_t(g))
        want = reference.attention_vjp(q, k, v, g, **options)
        np.testing.assert_allclose(out.detach().numpy(), reference.attention(
            q, k, v, **options).output, rtol=1e-5, atol=1e-5)
        for x, grad in zip(inputs, (want.query, want.key, want.value), strict=True):
            np.testing.assert_allclose(x.grad.numpy(), grad, rtol=1e-4, atol=1e-5)
    assert calls and not any(calls)


def test_runs_of_rows_causal_in_half_either_alignment(small_blocks):
    """``"sdpa_blocks"`` with chunks and the causal rule, 16 queries over 24 keys, float16,
    bottom-right and top-left (where the band's offset is 0, not 8): the output in float16,
    the reference's on the rounded inputs; and the plain ``"sdpa"`` call on them."""
    rng = np.random.default_rng(6)
    q, k, v = (_t(rng.standard_normal(s), torch.float16)
               for s in ((1, 2, 16, 4), (1, 1, 24, 4), (1, 1, 24, 4)))
    for alignment in ("bottom_right", "top_left"):
        out = torch_attn.scaled_dot_product_attention(q, k, v, chunk_size=8, is_causal=True,
                                                      causal_alignment=alignment)
        assert out.dtype == torch.float16
        want = reference.attention(*(x.double().numpy() for x in (q, k, v)), chunk_size=8,
                                   is_causal=True, causal_alignment=alignment).output
        np.testing.assert_allclose(out.double().numpy(), want, rtol=2e-3, atol=2e-3)
    plain = torch_attn.scaled_dot_product_attention(q, k, v)  # "sdpa", in float32
    assert plain.dtype == torch.float16
    want = reference.attention(*(x.double().numpy() for x in (q, k, v))).output
    np.testing.assert_allclose(plain.double().numpy(), want, rtol=2e-3, atol=2e-3)


def test_tiles_with_a_mask_and_a_bias_of_lower_rank(small_blocks):
    """``"blocked"`` (a soft-cap) with a (24, 24) mask and a per-head (2, 24, 24) bias, sinks
    and the lse: the reference's output, lse and gradients (the sinks' too)."""
    q, k, v, mask, bias, g = _mask_bias_inputs()
    sinks = np.array([0.5, -1.0])
    inputs = [_t(x).requires_grad_() for x in (q, k, v, sinks)]
    out, lse = torch_attn.scaled_dot_product_attention(
        *inputs[:3], mask=torch.from_numpy(mask), bias=_t(bias), softcap=5.0,
        sinks=inputs[3], return_lse=True)
    out.backward(_t(g))
    options = {"mask": mask, "bias": bias, "softcap": 5.0, "sinks": sinks}
    want = reference.attention(q, k, v, **options)
    np.testing.assert_allclose(out.detach().numpy(), want.output, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse.detach().numpy(), want.lse, rtol=1e-5, atol=1e-5)
    grads = reference.attention_vjp(q, k, v, g, **options)
    for x, grad in zip(inputs, (grads.query, grads.key, grads.value, grads.sinks), strict=True):
        np.testing.assert_allclose(x.grad.numpy(), grad, rtol=1e-4, atol=1e-5)
