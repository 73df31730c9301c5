"""PyTorch-specific behaviour of torch_attn: seed reproduction, autograd, the SDPA fast path,
nn.MultiheadAttention interop, half precision, torch.compile, nn.Module behaviour, and error
messages identical to numpy_attn's.

Expected values come from independent computations: the article's printed numbers, the seed
stream in ``conformance.seed_example``, ``torch.autograd.gradcheck``, ``numpy_attn`` in float64,
and ``torch.nn.MultiheadAttention``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attention_rules  # noqa: E402
import numpy_attn  # noqa: E402
import torch_attn  # noqa: E402
from conformance import seed_example  # noqa: E402
from torch_attn import _fast  # noqa: E402

F64 = torch.float64


def _t(x, dtype=torch.float32):
    return torch.tensor(np.asarray(x), dtype=dtype)


def _qkv(shape_q, shape_kv, v_dim=None, dtype=F64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    v_shape = shape_kv[:-1] + ((v_dim or shape_kv[-1]),)
    tensors = [torch.randn(s, generator=g, dtype=F64) for s in (shape_q, shape_kv, v_shape)]
    return [t.to(dtype).requires_grad_(grad) for t in tensors]


def _numpy_ref(q, k, v, **kw):
    """numpy_attn in float64: the independent reference."""
    conv = {n: (x.detach().double().numpy() if isinstance(x, torch.Tensor) and x.is_floating_point()
                else x.numpy() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    args = [x.detach().double().numpy() for x in (q, k, v)]
    return torch.from_numpy(np.asarray(numpy_attn.scaled_dot_product_attention(*args, **conv)))


# ------------------------------------------------------------------------------------------
# The article's numbers under torch.manual_seed(123)
# ------------------------------------------------------------------------------------------

# The article prints 4 decimals; its row 3, column 3 (-0.2627) is -0.26264992 in float64 from
# the article's own weights, so the printed numbers are matched to 1e-4, not 5e-5.
ARTICLE_ATOL = 1e-4


def test_self_attention_reproduces_the_article():
    torch.manual_seed(123)
    module = torch_attn.SelfAttention(3, 2, 4)
    for name, expected in seed_example.self_attention_weights().items():
        assert torch.equal(getattr(module, name).detach(), _t(expected)), name
    out = module(_t(seed_example.EMBEDDING))
    np.testing.assert_allclose(
        out.detach().numpy(), seed_example.ARTICLE["self_attention"], atol=ARTICLE_ATOL, rtol=0
    )


def test_generator_gives_the_same_weights_as_the_global_seed():
    module = torch_attn.SelfAttention(3, 2, 4, rng=torch.Generator().manual_seed(123))
    for name, expected in seed_example.self_attention_weights().items():
        assert torch.equal(getattr(module, name).detach(), _t(expected)), name


def test_wrapper_reproduces_the_article():
    torch.manual_seed(123)
    module = torch_attn.MultiHeadAttentionWrapper(3, 2, 1, 4)
    exported = module.export_weights()
    for name, expected in seed_example.wrapper_weights().items():
        assert np.array_equal(exported[name], np.asarray(expected, np.float32)), name
    out = module(_t(seed_example.EMBEDDING))
    np.testing.assert_allclose(
        out.detach().numpy(), seed_example.ARTICLE["multi_head_wrapper"], atol=ARTICLE_ATOL, rtol=0
    )


def test_cross_attention_reproduces_the_article():
    torch.manual_seed(123)
    module = torch_attn.CrossAttention(3, 2, 4)
    x_2 = torch.rand(8, 3)
    for name, expected in seed_example.self_attention_weights().items():
        assert torch.equal(getattr(module, name).detach(), _t(expected)), name
    assert torch.equal(x_2, _t(seed_example.cross_second_input()))
    out = module(_t(seed_example.EMBEDDING), x_2)
    np.testing.assert_allclose(
        out.detach().numpy(), seed_example.ARTICLE["cross_attention"], atol=ARTICLE_ATOL, rtol=0
    )


def test_article_steps_scores_weights_and_both_causal_methods():
    torch.manual_seed(123)
    module = torch_attn.SelfAttention(3, 2, 4)
    x = _t(seed_example.EMBEDDING)
    queries, keys = (x @ module.W_query).detach(), (x @ module.W_key).detach()
    omega = torch_attn.attention_scores(queries, keys, scale=1.0)
    weights = torch_attn.attention_weights(omega / 2**0.5)
    masked = torch_attn.mask_scores(omega / 2**0.5, is_causal=True)
    article = seed_example.ARTICLE
    for got, name in [
        (omega, "attn_scores"),
        (weights, "attn_weights"),
        (torch_attn.attention_weights(masked), "causal_weights"),
        (torch_attn.renormalized_causal_weights(weights), "causal_weights"),
    ]:
        np.testing.assert_allclose(got.numpy(), article[name], atol=ARTICLE_ATOL, rtol=0)


# ------------------------------------------------------------------------------------------
# Autograd
# ------------------------------------------------------------------------------------------

GRAD_CASES = {
    "causal_top_left": ((1, 2, 3, 4), (1, 2, 5, 4), {"is_causal": True}),
    "causal_bottom_right": (
        (2, 5, 3), (2, 3, 3), {"is_causal": True, "causal_alignment": "bottom_right"}
    ),
    "window": ((2, 4, 3), (2, 6, 3), {"window": (1, 2), "causal_alignment": "bottom_right"}),
    "softcap": ((2, 3, 4), (2, 4, 4), {"softcap": 1.5}),
    "gqa": ((1, 4, 3, 2), (1, 2, 4, 2), {"is_causal": True}),
    "two_d": ((3, 4), (5, 4), {}),
}


@pytest.fixture(params=["fast", "explicit"])
def path(request, monkeypatch):
    if request.param == "explicit":
        monkeypatch.setattr(_fast, "use_fast_path", lambda *args, **kwargs: None)
    return request.param


@pytest.mark.parametrize("case", sorted(GRAD_CASES))
def test_gradcheck(case, path):
    shape_q, shape_kv, kw = GRAD_CASES[case]
    q, k, v = _qkv(shape_q, shape_kv, grad=True, seed=1)
    target = shape_q[:-1] + (shape_kv[-2],)
    bias = torch.randn(target, dtype=F64, generator=torch.Generator().manual_seed(2))
    bias.requires_grad_(True)

    def fn(q, k, v, bias):
        return torch_attn.scaled_dot_product_attention(q, k, v, bias=bias, **kw)

    assert torch.autograd.gradcheck(fn, (q, k, v, bias))


def test_gradcheck_dropout_with_keep_mask():
    q, k, v = _qkv((2, 3, 4), (2, 5, 4), grad=True, seed=3)
    keep = torch.rand((2, 3, 5), generator=torch.Generator().manual_seed(4)) >= 0.3

    def fn(q, k, v):
        return torch_attn.scaled_dot_product_attention(
            q, k, v, dropout_p=0.3, dropout_mask=keep, is_causal=True
        )

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fully_masked_rows_have_zero_output_and_gradient(path, dtype, with_bias):
    q, k, v = _qkv((2, 4, 3), (2, 5, 3), dtype=dtype, grad=True, seed=5)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1] = False  # row 1 fully masked by the mask; rows 0-1 by the bottom-right window too
    bias = torch.randn(2, 4, 5, dtype=dtype).requires_grad_(True) if with_bias else None
    out = torch_attn.scaled_dot_product_attention(
        q, k, v, mask=mask, bias=bias, window=(0, None), causal_alignment="bottom_right",
        is_causal=True,
    )
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    out.sum().backward()
    for t in (q, k, v) + ((bias,) if with_bias else ()):
        assert not t.grad.isnan().any()
    assert torch.equal(q.grad[:, 1], torch.zeros_like(q.grad[:, 1]))
    if with_bias:  # masked positions receive exactly 0
        assert torch.equal(bias.grad[:, 1], torch.zeros_like(bias.grad[:, 1]))


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
    ref = _numpy_ref(q, k, v, **kw)
    tol = {"atol": 1e-12, "rtol": 1e-10} if dtype == F64 else {"atol": 2e-6, "rtol": 2e-5}
    assert fast.dtype == dtype and fast.shape == ref.shape
    torch.testing.assert_close(fast.double(), ref, **tol)
    torch.testing.assert_close(explicit.double(), ref, **tol)


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

    monkeypatch.setattr(_fast.F, "scaled_dot_product_attention", spy)
    q, k, v = _qkv((1, 4, 3, 8), (1, 2, 5, 8))
    torch_attn.scaled_dot_product_attention(q, k, v, is_causal=True)  # top-left: SDPA's own
    assert calls[-1]["is_causal"] is True and calls[-1]["attn_mask"] is None
    torch_attn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                            causal_alignment="bottom_right")
    assert calls[-1]["is_causal"] is False and calls[-1]["attn_mask"].dtype == torch.bool
    assert calls[-1]["enable_gqa"] is True
    torch_attn.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert calls[-1]["is_causal"] is True and calls[-1]["attn_mask"] is None
    torch_attn.scaled_dot_product_attention(q, q, q, is_causal=True, mask=torch.ones(3, 3) > 0)
    assert calls[-1]["is_causal"] is False and calls[-1]["attn_mask"].shape == (3, 3)
    torch_attn.scaled_dot_product_attention(q, k, v, return_weights=True)
    assert len(calls) == 4  # the explicit path does not call SDPA


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
    monkeypatch.setattr(_fast, "CPU_SDPA_ZEROES_MASKED_ROWS", False)
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
    fast = torch.compile(_fast._sdpa_attention, backend="aot_eager", fullgraph=True)
    out = fast(q, k, v, mask, None, True, "top_left", None, 0.5)
    torch.testing.assert_close(out, eager)
    assert torch.equal(out[..., 1, :], torch.zeros_like(out[..., 1, :]))
    whole = torch.compile(torch_attn.scaled_dot_product_attention, backend="aot_eager")
    got, weights = whole(q, k, v, mask=mask, is_causal=True, softcap=3.0, return_weights=True)
    ref = _numpy_ref(q, k, v, mask=mask, is_causal=True, softcap=3.0)
    torch.testing.assert_close(got, ref)
    assert torch.equal(weights[..., 1, :], torch.zeros_like(weights[..., 1, :]))


# ------------------------------------------------------------------------------------------
# Dropout, modules, state_dict
# ------------------------------------------------------------------------------------------


def test_dropout_statistics_and_generator():
    weights = torch.full((200, 100), 0.25)
    out = torch_attn.apply_dropout(weights, 0.4, rng=torch.Generator().manual_seed(0))
    kept = out != 0
    assert torch.all(out[kept] == 0.25 / 0.6)
    assert abs(kept.double().mean().item() - 0.6) < 0.01
    again = torch_attn.apply_dropout(weights, 0.4, rng=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    torch.manual_seed(1)
    first = torch_attn.apply_dropout(weights, 0.4)
    torch.manual_seed(1)
    assert torch.equal(first, torch_attn.apply_dropout(weights, 0.4))


def test_modules_train_eval_dropout():
    torch.manual_seed(0)
    module = torch_attn.CausalSelfAttention(4, 3, 5, dropout_p=0.5)
    plain = torch_attn.CausalSelfAttention(4, 3, 5).load_weights(module.export_weights())
    x = torch.randn(2, 6, 4)
    trained = module(x, rng=torch.Generator().manual_seed(3))
    assert not torch.allclose(trained, plain(x))
    assert torch.equal(trained, module(x, rng=torch.Generator().manual_seed(3)))
    module.eval()
    torch.testing.assert_close(module(x), plain(x))
    mha = torch_attn.MultiHeadAttention(8, 2, dropout_p=0.5)
    y = torch.randn(2, 5, 8)
    assert not torch.allclose(mha(y, rng=torch.Generator().manual_seed(0)), mha.eval()(y))
    torch.testing.assert_close(mha(y), mha(y))


def test_parameters_state_dict_and_load_weights():
    torch.manual_seed(0)
    mha = torch_attn.MultiHeadAttention(8, 4, num_kv_heads=2)
    names = {n for n, _ in mha.named_parameters()}
    assert names == set(mha.export_weights()) == set(mha.state_dict())
    assert all(isinstance(p, torch.nn.Parameter) for p in mha.parameters())
    w_query = mha.W_query
    exported = {n: a.astype(np.float64) + 0.5 for n, a in mha.export_weights().items()}
    assert mha.load_weights(exported) is mha and mha.W_query is w_query  # in place
    assert mha.W_query.dtype == F64  # the arrays' dtype
    other = torch_attn.MultiHeadAttention(8, 4, num_kv_heads=2).double()
    other.load_state_dict(mha.state_dict())
    x = torch.randn(2, 5, 8, dtype=F64)
    torch.testing.assert_close(other(x), mha(x))
    ref = numpy_attn.MultiHeadAttention(8, 4, num_kv_heads=2).load_weights(exported)
    torch.testing.assert_close(mha(x), torch.from_numpy(ref(x.numpy())).double())
    # Xavier uniform: bound sqrt(6 / (fan_in + fan_out)) = sqrt(6 / 16); zero biases
    fresh = torch_attn.MultiHeadAttention(8, 4)
    assert fresh.W_query.abs().max() <= (6 / 16) ** 0.5 and not fresh.b_out.any()
    bf16 = torch_attn.SelfAttention(3, 2, 4).to(torch.bfloat16).export_weights()
    assert bf16["W_query"].dtype.name == "bfloat16"


# ------------------------------------------------------------------------------------------
# torch.nn.MultiheadAttention interop
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_multihead_attention_interop(bias):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True, bias=bias)
    if bias:
        with torch.no_grad():
            mha.in_proj_bias.normal_()
            mha.out_proj.bias.normal_()
    weights = torch_attn.weights_from_torch_multihead(mha)
    ours = torch_attn.MultiHeadAttention(8, 2, bias=bias).load_weights(weights)
    x = torch.randn(3, 5, 8)
    key_padding_mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4])
    expected, _ = mha(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)
    got = ours(x, mask=~key_padding_mask[:, None, None, :])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)  # True = masked out, in torch
    expected, _ = mha(x, x, x, attn_mask=causal, need_weights=False)
    torch.testing.assert_close(ours(x, is_causal=True), expected, atol=1e-5, rtol=1e-5)
    in_numpy = numpy_attn.MultiHeadAttention(8, 2, bias=bias).load_weights(weights)
    got_numpy = in_numpy(x.numpy(), is_causal=True)
    np.testing.assert_allclose(got_numpy, expected.detach().numpy(), atol=1e-5)


# ------------------------------------------------------------------------------------------
# Devices and mask builders
# ------------------------------------------------------------------------------------------


def test_masks_are_built_on_the_requested_device():
    assert torch_attn.causal_mask(3, 4, device="meta").device.type == "meta"
    assert torch_attn.sliding_window_mask(3, 4, (1, 1), device="meta").device.type == "meta"
    lengths = torch.tensor([1, 3])
    mask = torch_attn.padding_mask(lengths, 4, q_lengths=[2, 1], q_len=3)
    np.testing.assert_array_equal(
        mask.numpy(), numpy_attn.padding_mask(np.array([1, 3]), 4, q_lengths=[2, 1], q_len=3)
    )


# ------------------------------------------------------------------------------------------
# Errors: same type and message as numpy_attn
# ------------------------------------------------------------------------------------------

def _a(*shape, dtype="float32"):
    return np.zeros(shape, dtype=dtype)


Q, K, V = _a(2, 4, 6, 8), _a(2, 4, 6, 8), _a(2, 4, 6, 8)
SDPA = "scaled_dot_product_attention"
BAD_INPUTS = [
    (SDPA, (_a(8), _a(8), _a(8)), {}),
    (SDPA, (_a(6, 8), K, V), {}),
    (SDPA, (Q, K, _a(2, 4, 5, 8)), {}),
    (SDPA, (Q, _a(2, 4, 6, 7), V), {}),
    (SDPA, (Q, _a(3, 4, 6, 8), _a(3, 4, 6, 8)), {}),
    (SDPA, (Q, _a(2, 3, 6, 8), _a(2, 3, 6, 8)), {}),
    (SDPA, (Q, K, _a(2, 2, 6, 8)), {}),
    (SDPA, (Q, K, V), {"mask": np.ones((5, 6), bool)}),
    (SDPA, (Q, K, V), {"mask": _a(6, 6)}),
    (SDPA, (Q, K, V), {"bias": np.zeros((6, 6), np.int64)}),
    (SDPA, (Q, K, V), {"bias": _a(3, 6, 6)}),
    (SDPA, (_a(6, 8, dtype="int64"), K, V), {}),
    (SDPA, (Q, K.astype(np.float64), V), {}),
    (SDPA, (Q, K, V.astype(np.complex64)), {}),
    (SDPA, (Q, K, V), {"window": (-1, 2)}),
    (SDPA, (Q, K, V), {"window": (1,)}),
    (SDPA, (Q, K, V), {"causal_alignment": "centre"}),
    (SDPA, (Q, K, V), {"dropout_p": 1.0}),
    (SDPA, (Q, K, V), {"dropout_p": -0.1}),
    (SDPA, (Q, K, V), {"dropout_mask": np.ones((6, 6), bool)}),
    (SDPA, (Q, K, V), {"dropout_p": 0.5, "dropout_mask": _a(6, 6)}),
    (SDPA, (Q, K, V), {"dropout_p": 0.5, "dropout_mask": np.ones((7, 6), bool)}),
    (SDPA, (Q, K, V), {"softcap": 0.0}),
    (SDPA, (Q, K, V), {"softcap": float("inf")}),
    (SDPA, (Q, K, V), {"scale": float("nan")}),
    ("attention_scores", (Q, _a(2, 4, 6, 7)), {}),
    ("attention_scores", (Q, K), {"softcap": -1}),
    ("mask_scores", (_a(6),), {}),
    ("mask_scores", (_a(6, 6),), {"mask": np.ones((6, 6), np.int64)}),
    ("mask_scores", (_a(6, 6),), {"window": "ab"}),
    ("attention_weights", (_a(6, dtype="int32"),), {}),
    ("apply_dropout", (_a(6, 6), 1.5), {}),
    ("apply_dropout", (_a(6, 6), 0.5), {"dropout_mask": np.ones((2, 6, 6), bool)}),
    ("attention_output", (_a(4, 6, 5), _a(4, 6, 8)), {}),
    ("attention_output", (_a(4, 6, 6), _a(3, 6, 8)), {}),
    ("renormalized_causal_weights", (_a(6, 6),), {"causal_alignment": "left"}),
    ("causal_mask", (-1, 3), {}),
    ("causal_mask", (3, 2.5), {}),
    ("sliding_window_mask", (3, 4, (None, -2)), {}),
    ("padding_mask", (np.array([1, 5]), 4), {}),
    ("padding_mask", (np.array([1.0, 2.0]), 4), {}),
    ("padding_mask", (np.array([1, 2]), 4), {"q_lengths": np.array([1, 2])}),
    ("padding_mask", (np.array([1, 2]), 4), {"q_lengths": np.array([1, 2, 3]), "q_len": 3}),
    ("combine_masks", (np.ones((2, 3), bool), _a(2, 3)), {}),
    ("combine_masks", (np.ones((2, 3), bool), np.ones((4, 3), bool)), {}),
]


def _to_torch(x):
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def _raised(fn):
    with pytest.raises((TypeError, ValueError)) as info:
        fn()
    return info.type, str(info.value)


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)))
def test_bad_inputs_raise_like_numpy_attn(case):
    name, args, kwargs = BAD_INPUTS[case]
    expected = _raised(lambda: getattr(numpy_attn, name)(*args, **kwargs))
    t_args = [_to_torch(a) for a in args]
    t_kwargs = {n: _to_torch(x) for n, x in kwargs.items()}
    got = _raised(lambda: getattr(torch_attn, name)(*t_args, **t_kwargs))
    assert got == expected
    assert "torch." not in got[1]


def test_example_message_of_the_brief():
    with pytest.raises(ValueError) as info:
        torch_attn.scaled_dot_product_attention(
            torch.zeros(2, 4, 6, 8), torch.zeros(2, 4, 6, 8), torch.zeros(2, 4, 5, 8)
        )
    assert str(info.value) == (
        "scaled_dot_product_attention: key and value must have the same kv_len; "
        "got key.shape=(2, 4, 6, 8), value.shape=(2, 4, 5, 8)"
    )


@pytest.mark.parametrize(
    "build",
    [
        lambda m: m.MultiHeadAttention(10, 3),
        lambda m: m.MultiHeadAttention(8, 4, num_kv_heads=3),
        lambda m: m.CausalSelfAttention(3, 2, 4, dropout_p=1.5),
        lambda m: m.SelfAttention(3, 2, 4).load_weights({"W_query": np.zeros((3, 2))}),
        lambda m: m.SelfAttention(3, 2, 4).load_weights(
            {"W_query": np.zeros((3, 2)), "W_key": np.zeros((3, 2)), "W_value": np.zeros((3, 5))}
        ),
    ],
)
def test_module_errors_like_numpy_attn(build):
    assert _raised(lambda: build(torch_attn)) == _raised(lambda: build(numpy_attn))
