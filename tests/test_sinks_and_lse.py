"""Attention sinks and the row log-sum-exp (``spec.SINKS``, ``spec.LOG_SUM_EXP``) in every
backend, on every path: the explicit steps, the fast paths, the tiles and the VJPs.

Expected values: the float64 reference under the harness's tolerance rule (``sinks_inputs``),
and gradients also central finite differences in float64. The planted bugs (a sink that carries
a value, an lse in log2) are small wrong functions that the same assertions reject. Merging
partial results: ``tests/test_merge_attention.py``.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from numerics import finite_differences
from sinks_inputs import (
    CASES,
    GRAD_CASES,
    GRAD_LSE,
    GRAD_OUT,
    MASK,
    SINKS,
    K,
    Q,
    V,
    as_float64,
    assert_close,
    call,
    expected_values,
    to_backend,
)

from conformance.cases import reference
from conformance.running import backends

# ------------------------------------------------------------------------------------------
# Forward and gradients against the float64 reference
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["numpy", pytest.param("jax", marks=pytest.mark.slow),
                                     "torch"], indirect=True)  # jax: a compile per case
def test_output_weights_and_lse_match_the_reference(backend, dtype, case):
    values, base, ref = expected_values(dtype, case)
    output, weights, lse = call(backend, "scaled_dot_product_attention", dtype, case,
                                 return_weights=True, return_lse=True)
    masked = np.isneginf(ref.masked_scores)
    empty = np.broadcast_to(masked.all(-1, keepdims=True), ref.output.shape)
    assert_close("output", backend.to_numpy(output), values, base, dtype, "input", empty)
    assert_close("weights", backend.to_numpy(weights), values, base, dtype, "input", masked)
    assert_close("lse", backend.to_numpy(lse), values, base, dtype, "compute")
    alone = call(backend, "scaled_dot_product_attention", dtype, case)  # output only
    assert_close("output", backend.to_numpy(alone), values, base, dtype, "input", empty)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(("backend", "case"), [  # jax's softcapped VJP compiles: slow
    pytest.param(name, case, marks=pytest.mark.slow)
    if (name, case) == ("jax", "causal_bottom_right_softcap") else (name, case)
    for name in backends.SPEC_BACKENDS for case in GRAD_CASES], indirect=["backend"])
def test_gradients_match_the_reference(backend, dtype, case):
    values, base, _ = expected_values(dtype, case, grads=True)
    grads = call(backend, "scaled_dot_product_attention_vjp", dtype, case, GRAD_OUT)
    names = ("query", "key", "value", "bias") + (("sinks",) if CASES[case][1] else ())
    assert len(grads) == len(names)  # grad_sinks: a fifth element with sinks only
    for name, grad in zip(names, grads, strict=True):
        if grad is not None:
            assert_close(f"grad_{name}", backend.to_numpy(grad), values, base, dtype, "input")


def test_bfloat16_computes_in_float32(backend):
    values, base, _ = expected_values("bfloat16", "mask_bias")
    output, lse = call(backend, "scaled_dot_product_attention", "bfloat16", "mask_bias",
                        return_lse=True)
    assert_close("output", backend.to_numpy(output), values, base, "bfloat16", "input")
    assert_close("lse", backend.to_numpy(lse), values, base, "bfloat16", "compute")


def test_two_d_inputs_take_one_sink(backend):
    q, k, v, sink = Q[0, 0], K[0, 0], V[0, 0], SINKS[:1]
    ref = reference.attention(q, k, v, sinks=sink)
    output, lse = backend.module.scaled_dot_product_attention(
        *(backend.asarray(x) for x in (q, k, v)), sinks=backend.asarray(sink), return_lse=True)
    assert backend.to_numpy(lse).shape == (5,)
    np.testing.assert_allclose(backend.to_numpy(output), ref.output, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(backend.to_numpy(lse), ref.lse, rtol=1e-12, atol=1e-12)


# Finite differences of the float64 reference itself: (1, 2, 3, 4) queries, one kv head,
# query 1 fully masked.
_F = np.random.default_rng(5)
FD = {"query": _F.standard_normal((1, 2, 3, 4)), "key": _F.standard_normal((1, 1, 4, 4)),
      "value": _F.standard_normal((1, 1, 4, 3)), "bias": _F.standard_normal((2, 3, 4)),
      "sinks": _F.standard_normal(2)}
FD_MASK = np.ones((1, 1, 3, 4), bool)
FD_MASK[..., 1, :] = False
FD_OUT, FD_LSE = _F.standard_normal((1, 2, 3, 3)), _F.standard_normal((1, 2, 3))


def _fd_grads(with_lse: bool) -> dict[str, np.ndarray]:
    arrays = {n: x.copy() for n, x in FD.items()}

    def loss() -> float:
        steps = reference.attention(arrays["query"], arrays["key"], arrays["value"],
                                    bias=arrays["bias"], sinks=arrays["sinks"], mask=FD_MASK,
                                    is_causal=True, causal_alignment="bottom_right")
        lse = np.where(np.isfinite(steps.lse), steps.lse, 0.0)
        return float((steps.output * FD_OUT).sum() + with_lse * (lse * FD_LSE).sum())

    return {n: finite_differences(loss, x) for n, x in arrays.items()}


@pytest.mark.slow
@pytest.mark.parametrize("with_lse", [False, True], ids=["output", "output_and_lse"])
def test_gradients_equal_finite_differences(backend, with_lse):
    """Every gradient, dsinks included, against central differences (float64); with the lse's
    cotangent too in jax_attn and torch_attn (autodiff through ``return_lse``)."""
    fd = _fd_grads(with_lse)
    arrays = {n: backend.asarray(x) for n, x in FD.items()}
    options = {"mask": backend.asarray(FD_MASK), "is_causal": True,
               "causal_alignment": "bottom_right"}
    if not with_lse:
        grads = backend.module.scaled_dot_product_attention_vjp(
            arrays["query"], arrays["key"], arrays["value"], backend.asarray(FD_OUT),
            bias=arrays["bias"], sinks=arrays["sinks"], **options)
        got = dict(zip(FD, grads, strict=True))
    elif backend.name == "jax":
        import jax

        def loss(q, k, v, b, s):
            out, lse = backend.module.scaled_dot_product_attention(
                q, k, v, bias=b, sinks=s, return_lse=True, **options)
            return (out * FD_OUT).sum() + (lse * FD_LSE).sum()

        got = dict(zip(FD, jax.grad(loss, argnums=tuple(range(5)))(*arrays.values()),
                       strict=True))
    elif backend.name == "torch":
        leaves = [a.requires_grad_(True) for a in arrays.values()]
        out, lse = backend.module.scaled_dot_product_attention(
            *leaves[:3], bias=leaves[3], sinks=leaves[4], return_lse=True, **options)
        ((out * backend.asarray(FD_OUT)).sum() + (lse * backend.asarray(FD_LSE)).sum()).backward()
        got = {n: t.grad for n, t in zip(FD, leaves, strict=True)}
    else:
        pytest.skip("numpy_attn's VJP takes no lse cotangent (merge_attention_vjp does)")
    for name, expected in fd.items():
        np.testing.assert_allclose(as_float64(backend, got[name]), expected, rtol=1e-6, atol=1e-8,
                                   err_msg=name)


# ------------------------------------------------------------------------------------------
# The fast paths and the tiles: the lse they compute anyway, the sinks joined at the end
# ------------------------------------------------------------------------------------------

SMALL_BLOCKS = {  # every backend's fast path taken by the small shapes, blocks of 2-3 rows
    "numpy": {"MIN_SCORES": 0, "MIN_Q_LEN": 1, "BLOCK_Q": 2, "BLOCK_KV": 3,
              "BLOCK_Q_BACKWARD": 2},
    "jax": {"MIN_SCORES": 0, "MIN_Q_LEN": 2, "BLOCK_Q": 2, "BLOCK_KV": 3, "BLOCK_SCORES": 0},
    "torch": {"MIN_SCORES": 0, "MIN_Q_LEN": 1, "BLOCK_Q": 2, "BLOCK_KV": 3},
}
BLOCKED = {"numpy": ("_fast.forward", "blocked_attention"),
           "jax": ("_fast", "_blocked_attention_lse"),
           "torch": ("_fast", "blocked_attention")}  # what runs the blocks (sinks or lse)


@pytest.fixture
def fast_path(backend, monkeypatch):
    """The backend's blocked fast path with small blocks; the list of its calls."""
    fast = backend.module._fast
    for name, value in SMALL_BLOCKS[backend.name].items():
        monkeypatch.setattr(fast, name, value)
    where, name = BLOCKED[backend.name]
    where = functools.reduce(getattr, where.split("."), backend.module)  # e.g. _fast.forward
    calls, real = [], getattr(where, name)

    def spy(*args, **kwargs):
        calls.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(where, name, spy)
    return calls


def _autodiff(backend, fn, case, **kwargs):
    """jax_attn, torch_attn: the output, the lse and, by autodiff through ``return_lse``, the
    gradients of ``sum(dO ⊙ O) + sum(dlse ⊙ lse)`` (float64; one trace in JAX)."""
    options, with_sinks = CASES[case]
    arrays = {"query": Q, "key": K, "value": V, "bias": options.get("bias"),
              "sinks": SINKS if with_sinks else None}
    names = [n for n, x in arrays.items() if x is not None]
    static = {n: v for n, v in options.items() if n not in ("mask", "bias")}
    if options.get("mask") is not None and not fn.startswith("blockwise"):
        static["mask"] = backend.asarray(options["mask"])

    def forward(*xs):
        return getattr(backend.module, fn)(*xs[:3], **dict(zip(names[3:], xs[3:], strict=True)),
                                           return_lse=True, **static, **kwargs)

    leaves = [backend.asarray(arrays[n]) for n in names]
    if backend.name == "jax":
        import jax

        (output, lse), pullback = jax.vjp(forward, *leaves)
        grads = pullback((backend.asarray(GRAD_OUT), backend.asarray(GRAD_LSE)))
    else:
        leaves = [x.requires_grad_(True) for x in leaves]
        output, lse = forward(*leaves)
        ((output * backend.asarray(GRAD_OUT)).sum() + (lse * backend.asarray(GRAD_LSE)).sum()
         ).backward()
        grads = [x.grad for x in leaves]
    return output, lse, dict(zip(names, grads, strict=True))


def _check_paths(backend, case, fn, vjp, **kwargs):
    """Output, lse and gradients (dsinks; the lse's cotangent in jax/torch) of one path."""
    options, with_sinks = CASES[case]
    values, base, ref = expected_values("float64", case, grads=True)
    empty = np.broadcast_to(np.isneginf(ref.masked_scores).all(-1, keepdims=True),
                            ref.output.shape)
    if backend.name == "numpy":  # the hand-written VJP takes no lse cotangent
        output, lse = call(backend, fn, "float64", case, return_lse=True, **kwargs)
        names = ("query", "key", "value", "bias") + (("sinks",) if with_sinks else ())
        grads = dict(zip(names, call(backend, vjp, "float64", case, GRAD_OUT, **kwargs),
                         strict=True))
    else:  # autodiff through return_lse: the expected gradients take dlse too
        output, lse, grads = _autodiff(backend, fn, case, **kwargs)
        expect = reference.attention_vjp(Q, K, V, GRAD_OUT, grad_lse=GRAD_LSE,
                                         sinks=SINKS if with_sinks else None, **options)
        values.update({f"grad_{n}": getattr(expect, n) for n in grads})
    assert_close("output", backend.to_numpy(output), values, base, "float64", "input", empty)
    assert_close("lse", backend.to_numpy(lse), values, base, "float64", "compute")
    for name, grad in grads.items():
        if grad is not None:
            assert_close(f"grad_{name}", as_float64(backend, grad), values, base, "float64")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mask_bias", "causal_top_left", "window_no_sinks"])
def test_the_fast_paths_return_the_lse_and_join_the_sinks(backend, fast_path, case):
    _check_paths(backend, case, "scaled_dot_product_attention",
                 "scaled_dot_product_attention_vjp")
    assert fast_path, "the fast path did not run"


@pytest.mark.parametrize("case", ["causal_bottom_right_softcap", "window_no_sinks"])
def test_blockwise_attention_returns_the_lse_and_joins_the_sinks(backend, case):
    _check_paths(backend, case, "blockwise_attention", "blockwise_attention_vjp", block_q=2,
                 block_kv=3)


@pytest.mark.slow
@pytest.mark.parametrize("route", ["explicit", "fast"])
def test_a_fully_masked_row_puts_its_weight_on_the_sink(backend, route, request):
    """Output 0; lse = the sink exactly (-inf without one); a sink of -inf is no sink; the
    row's query gradient is exactly 0 and every gradient finite."""
    if route == "fast":
        request.getfixturevalue("fast_path")
    call = backend.module.scaled_dot_product_attention
    q, k, v, mask = (to_backend(backend, x, "float32") for x in (Q, K, V, MASK))
    results = {}
    for name, sinks in (("sinks", SINKS), ("none", None), ("minus_inf", np.full(4, -np.inf))):
        sinks = to_backend(backend, sinks, "float32")
        output, lse = call(q, k, v, mask=mask, sinks=sinks, return_lse=True)
        results[name] = backend.to_numpy(output), backend.to_numpy(lse)
        assert not np.any(results[name][0][0, :, 2]), name  # exactly 0
    np.testing.assert_array_equal(results["sinks"][1][0, :, 2], SINKS.astype(np.float32))
    np.testing.assert_array_equal(results["none"][1][0, :, 2], -np.inf)
    for got, want in zip(results["minus_inf"], results["none"], strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)
    grads = backend.module.scaled_dot_product_attention_vjp(
        q, k, v, to_backend(backend, GRAD_OUT, "float32"), mask=mask,
        sinks=to_backend(backend, SINKS, "float32"))
    assert all(np.isfinite(backend.to_numpy(g)).all() for g in grads if g is not None)
    assert not np.any(backend.to_numpy(grads[0])[0, :, 2])


# ------------------------------------------------------------------------------------------
# Planted bugs: the assertions above reject them
# ------------------------------------------------------------------------------------------


def _sink_with_a_value(sinks, output, lse):
    """Wrong: the sink as a key whose value is 1 (it joins the numerator, not only the sum)."""
    return output + np.exp(sinks[:, None] - lse)[..., None]


def _lse_in_log2(lse):
    """Wrong: the log-sum-exp in base 2 (some kernels keep log2 internally)."""
    return lse / math.log(2.0)


@pytest.mark.parametrize("bug", ["sink_with_a_value", "lse_in_log2"])
def test_planted_bugs_fail_the_same_assertions(bug):
    numpy_backend, dtype = backends.get("numpy"), "float32"
    values, base, _ = expected_values(dtype, "mask_bias")
    output, lse = call(numpy_backend, "scaled_dot_product_attention", dtype, "mask_bias",
                       return_lse=True)
    assert_close("output", output, values, base, dtype, "input")  # the real ones pass
    assert_close("lse", lse, values, base, dtype, "compute")
    with pytest.raises(AssertionError):
        if bug == "sink_with_a_value":
            wrong = _sink_with_a_value(SINKS, output, lse).astype(np.float32)
            assert_close("output", wrong, values, base, dtype, "input")
        else:
            assert_close("lse", _lse_in_log2(lse), values, base, dtype, "compute")


# ------------------------------------------------------------------------------------------
# Bad inputs: the same exception type and words in every backend
# ------------------------------------------------------------------------------------------

_O = [np.zeros((2, 4, 5, 3), np.float32) for _ in range(2)]
_L = [np.zeros((2, 4, 5), np.float32) for _ in range(2)]
_q32, _k32, _v32, _g32 = (x.astype(np.float32) for x in (Q, K, V, GRAD_OUT))
SDPA, MERGE = "scaled_dot_product_attention", "merge_attention"
BAD = {  # name: (function, args, kwargs, exception, names the message must hold)
    "sinks_shape": (SDPA, (_q32, _k32, _v32), {"sinks": np.zeros(3, np.float32)},
                    "ValueError", ("sinks", "(4,)")),
    "sinks_per_kv_head_2d": (SDPA, (_q32, _k32, _v32), {"sinks": np.zeros((1, 4), np.float32)},
                             "ValueError", ("sinks",)),
    "sinks_int": (SDPA, (_q32, _k32, _v32), {"sinks": np.zeros(4, np.int32)}, "TypeError",
                  ("sinks", "int32")),
    "sinks_python_list": (SDPA, (_q32, _k32, _v32), {"sinks": [0.0] * 4}, "TypeError",
                          ("sinks", "list")),
    "return_lse_int": (SDPA, (_q32, _k32, _v32), {"return_lse": 1}, "TypeError",
                       ("return_lse",)),
    "vjp_sinks_shape": ("scaled_dot_product_attention_vjp", (_q32, _k32, _v32, _g32),
                        {"sinks": np.zeros(2, np.float32)}, "ValueError", ("sinks",)),
    "blockwise_sinks_int": ("blockwise_attention", (_q32, _k32, _v32),
                            {"sinks": np.zeros(4, np.int64)}, "TypeError", ("sinks",)),
    "blockwise_vjp_sinks_shape": ("blockwise_attention_vjp", (_q32, _k32, _v32, _g32),
                                  {"sinks": np.zeros(5, np.float32)}, "ValueError", ("sinks",)),
    "merge_not_a_list": (MERGE, (np.stack(_O), _L), {}, "TypeError", ("outputs.shape",)),
    "merge_empty": (MERGE, ([], []), {}, "ValueError", ("outputs",)),
    "merge_lengths": (MERGE, (_O, _L[:1]), {}, "ValueError", ("outputs", "lses")),
    "merge_shapes": (MERGE, ([_O[0], _O[1][..., :2]], _L), {}, "ValueError", ("outputs[1]",)),
    "merge_lse_shape": (MERGE, (_O, [_L[0], _L[1][..., :4]]), {}, "ValueError", ("lses[1]",)),
    "merge_dtypes": (MERGE, ([_O[0], _O[1].astype(np.float64)], _L), {}, "TypeError",
                     ("outputs[0]", "outputs[1]")),
    "merge_lse_int": (MERGE, (_O, [_L[0], _L[1].astype(np.int32)]), {}, "TypeError",
                      ("lses[1]",)),
    "merge_python_list_part": (MERGE, ([_O[0], [[0.0]]], _L), {}, "TypeError", ("outputs[1]",)),
    "merge_sinks_shape": (MERGE, (_O, _L), {"sinks": np.zeros(2, np.float32)}, "ValueError",
                          ("sinks",)),
    "merge_vjp_grad_lse_shape": ("merge_attention_vjp", (_O, _L, _O[0]),
                                 {"grad_lse": _L[0][..., :3]}, "ValueError", ("grad_lse",)),
}


def _raised(backend, name):
    fn, args, kwargs, _, _ = BAD[name]

    def convert(x):
        if isinstance(x, np.ndarray):
            return backend.asarray(x)
        return [convert(e) for e in x] if isinstance(x, list) and x and \
            isinstance(x[0], np.ndarray) else x

    with pytest.raises((TypeError, ValueError)) as info:
        getattr(backend.module, fn)(*map(convert, args),
                                    **{k: convert(v) for k, v in kwargs.items()})
    return info.value


@pytest.mark.parametrize("name", BAD)
def test_bad_sinks_and_merges_raise_the_same_error_everywhere(backend, name):
    fn, _, _, exception, names = BAD[name]
    error = _raised(backend, name)
    assert type(error).__name__ == exception, str(error)
    assert str(error).startswith(f"{fn}: ") and all(n in str(error) for n in names), str(error)
    assert str(error) == str(_raised(backends.get("numpy"), name))


def test_torch_never_hands_sinks_or_the_lse_to_sdpa(monkeypatch):
    """SDPA has neither: small inputs take the explicit steps, large ones the tiles."""
    torch = pytest.importorskip("torch", reason="pip install torch==2.13.0")
    torch_attn = backends.get("torch").module
    from torch_attn import _fast

    def refused(*args, **kwargs):
        raise AssertionError("SDPA was called")

    monkeypatch.setattr(_fast.sdpa.F, "scaled_dot_product_attention", refused)
    q, k, v, sinks = (torch.from_numpy(x) for x in (Q, K, V, SINKS))
    with pytest.raises(AssertionError, match="SDPA was called"):  # the spy works
        torch_attn.scaled_dot_product_attention(q, k, v)
    for route in ("explicit", "tiles"):
        if route == "tiles":  # these shapes are large enough for the tiles now
            monkeypatch.setattr(_fast, "MIN_SCORES", 0)
            monkeypatch.setattr(_fast, "MIN_Q_LEN", 1)
        torch_attn.scaled_dot_product_attention(q, k, v, sinks=sinks)
        torch_attn.scaled_dot_product_attention(q, k, v, return_lse=True)
