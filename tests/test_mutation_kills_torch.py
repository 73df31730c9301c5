"""Tests that kill the mutants of torch_attn's fast paths and decoding kernels (docs/mutation.md).

mutmut 3.8.1 on ``torch_attn/_fast.py``, ``torch_attn/_blocked.py`` (both now in
``torch_attn/_fast/``) and ``torch_attn/paged.py`` (seeded samples of their mutants) left these
behaviours untested: each test below fails under at least one surviving mutant. The expected values
come from the float64 ``conformance.cases.reference`` (``attention``, ``attention_vjp``) on the same
rounded inputs, never from torch_attn against itself. Tiny shapes: the whole file runs in about a
second.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="pip install torch==2.13.0")

from paged_helpers import far_apart_rows, paged_inputs  # noqa: E402

import torch_attn  # noqa: E402
from conformance.cases import reference  # noqa: E402
from torch_attn import _fast, paged  # noqa: E402


def _t(x: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x)).to(dtype)


# ------------------------------------------------------------------------------------------
# torch_attn/paged.py: split-KV decoding and the paged kernel
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "lse_dtype", "tol"), [
    (torch.float16, torch.float32, 2e-3), (torch.bfloat16, torch.float32, 1.6e-2),
    (torch.float64, torch.float64, 1e-12),
])
def test_split_kv_computes_in_the_compute_dtype(dtype, lse_dtype, tol):
    """A half query over a half cache: the scores, softmax and lse in float32 (the lse
    returned in it), the output in the query's dtype; float64 stays float64 (exact to 1e-12)."""
    rng = np.random.default_rng(7)
    query = rng.standard_normal((2, 1, 2))
    key, value = rng.standard_normal((1, 7, 2)), rng.standard_normal((1, 7, 3))
    output, lse = paged.split_kv_attention(_t(query, dtype), _t(key, dtype), _t(value, dtype), 3)
    assert (output.dtype, lse.dtype) == (dtype, lse_dtype)
    rounded = [_t(x, dtype).double().numpy() for x in (query, key, value)]
    expected = reference.attention(*rounded, is_causal=True, causal_alignment="bottom_right")
    np.testing.assert_allclose(output.double().numpy(), expected.output, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse.numpy(), expected.lse, rtol=tol, atol=tol)


def test_paged_cache_constructor_names_each_bad_argument():
    bad = [({"num_blocks": 0}, ValueError, "num_blocks must be an int >= 1; got num_blocks=0"),
           ({"block_size": 0}, ValueError, "block_size must be an int >= 1; got block_size=0"),
           ({"kv_heads": 0}, ValueError, "kv_heads must be an int >= 1; got kv_heads=0"),
           ({"head_dim": -1}, ValueError, "head_dim must be an int >= 0; got head_dim=-1"),
           ({"v_dim": -1}, ValueError, "v_dim must be an int >= 0; got v_dim=-1"),
           ({"dtype": torch.int32}, TypeError,
            "dtype must be float16, bfloat16, float32 or float64; got dtype.dtype=int32")]
    for kwargs, error, message in bad:
        given = {"num_blocks": 1, "block_size": 1, "kv_heads": 1, "head_dim": 2, **kwargs}
        with pytest.raises(error) as raised:
            torch_attn.PagedKVCache(**given)
        assert str(raised.value) == f"PagedKVCache: {message}"


def test_the_smallest_paged_cache_its_dtypes_and_tables():
    """One page of one position and one kv head is a cache; ``v_dim`` defaults to
    ``head_dim``; ``"bfloat16"`` and a ``torch.dtype`` name the dtype; ``tables`` gives int32
    on the pages' device, ``-1`` past a sequence's last page."""
    cache = torch_attn.PagedKVCache(1, 1, 1, 2, 3)
    assert cache.key_pages.shape == (1, 1, 1, 2) and cache.value_pages.shape == (1, 1, 1, 3)
    assert cache.key_pages.dtype == torch.float32 and not cache.key_pages.any()
    assert torch_attn.PagedKVCache(2, 3, 1, 4).value_pages.shape == (2, 3, 1, 4)
    for name in ("bfloat16", torch.bfloat16):
        half = torch_attn.PagedKVCache(1, 1, 1, 2, dtype=name)
        assert half.key_pages.dtype == half.value_pages.dtype == torch.bfloat16
    cache.append(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 3))
    table, lens = cache.tables()
    assert (table.dtype, lens.dtype) == (torch.int32, torch.int32)
    assert table.tolist() == [[0]] and lens.tolist() == [1]
    query = torch.ones(1, 2, 1, 2)  # a pool of one page: its one key and value
    expected = reference.attention(query[0].numpy(), np.ones((1, 1, 2)), np.ones((1, 1, 3)))
    np.testing.assert_allclose(cache.attend(query)[0].numpy(), expected.output, rtol=1e-6)
    wide = torch_attn.PagedKVCache(4, 2, 1, 2)
    wide.append(torch.ones(2, 1, 3, 2), torch.ones(2, 1, 3, 2))
    wide.append(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), seqs=[1])
    table, lens = wide.tables([1, 0])
    assert table.tolist() == [[2, 3], [0, 1]] and lens.tolist() == [4, 3]
    assert wide.free(0).num_free_blocks == 2 and wide.seq_len(0) == 0 and wide.seq_len(1) == 4


def _paged_inputs(dtype: torch.dtype = torch.float32) -> dict:
    """``paged_helpers.paged_inputs`` (one sequence of 3 positions on page 1
    of a pool of 2 pages of 4 positions; 2 query heads over 1 kv head) as torch tensors in
    ``dtype``, with its float64 keys and values. (``test_mutation_kills_decoding``'s tests of
    the arguments given as lists and of the cache's errors cover torch_attn too.)"""
    args = paged_inputs(np.float64)
    out = {name: torch.from_numpy(args[name]) for name in ("block_table", "seq_lens")}
    out.update({name: _t(args[name], dtype) for name in ("query", "key_pages", "value_pages")})
    return {**out, "keys": args["keys"], "values": args["values"]}


@pytest.mark.parametrize(("dtype", "lse_dtype", "tol"), [
    (torch.float16, torch.float32, 2e-3), (torch.float64, torch.float64, 1e-12),
])
def test_paged_attention_computes_in_the_compute_dtype(dtype, lse_dtype, tol):
    """The paged kernel: output in the query's dtype, lse in the compute dtype, against the
    reference on the same (rounded) inputs; with sinks too."""
    args = _paged_inputs(dtype)
    keys, values = args.pop("keys"), args.pop("values")
    keys, values = (_t(x, dtype).double().numpy() for x in (keys, values))
    sinks = torch.tensor([0.5, -1.0], dtype=dtype)
    for given in (None, sinks):
        output, lse = torch_attn.paged_attention(**args, sinks=given, return_lse=True)
        assert (output.dtype, lse.dtype) == (dtype, lse_dtype)
        expected = reference.attention(
            args["query"][0].double().numpy(), keys, values, is_causal=True,
            causal_alignment="bottom_right", sinks=None if given is None else given.double())
        np.testing.assert_allclose(output[0].double().numpy(), expected.output, rtol=tol,
                                   atol=tol)
        np.testing.assert_allclose(lse[0].numpy(), expected.lse, rtol=tol, atol=tol)


def test_paged_attention_over_sequences_without_keys():
    """``seq_lens`` 0: no chunk at all; rows give 0 and lse -inf, or the sink's logit."""
    args = _paged_inputs()
    del args["keys"], args["values"]
    args["seq_lens"] = torch.tensor([0], dtype=torch.int32)
    for given in (None, np.array([0.5, -1.0])):
        sinks = None if given is None else _t(given)
        output, lse = torch_attn.paged_attention(**args, sinks=sinks, return_lse=True)
        expected = reference.attention(args["query"][0].numpy(), np.zeros((1, 0, 2)),
                                       np.zeros((1, 0, 3)), sinks=given)
        np.testing.assert_array_equal(output[0].numpy(), expected.output)
        np.testing.assert_array_equal(lse[0].numpy(), expected.lse)


def test_each_row_is_shifted_by_its_own_largest_score():
    """Two query heads of one kv head whose largest scores are hundreds apart: each row
    subtracts its own largest score, on both kernels, outside autograd and inside it (one
    shift for the chunk would underflow the small row's exponentials to 0 in float32)."""
    query, key, value, expected = far_apart_rows()
    f32 = [_t(x) for x in (query, key, value)]
    cache = torch_attn.PagedKVCache(2, 4, 1, 4, 2)
    cache.append(f32[1][None], f32[2][None])
    for grad in (False, True):  # torch.softmax, and (autograd recording) the shifted exp
        q = f32[0].clone().requires_grad_(grad)
        output, lse = paged.split_kv_attention(q, *f32[1:], 4)
        np.testing.assert_allclose(output.detach().numpy(), expected.output, rtol=1e-4,
                                   atol=1e-5)
        np.testing.assert_allclose(lse.detach().numpy(), expected.lse, rtol=1e-5, atol=1e-4)
        output, lse = cache.attend(q[None], return_lse=True)
        np.testing.assert_allclose(output[0].detach().numpy(), expected.output, rtol=1e-4,
                                   atol=1e-5)
        np.testing.assert_allclose(lse[0].detach().numpy(), expected.lse, rtol=1e-5, atol=1e-4)


def test_a_chunk_with_rows_without_a_key():
    """Three query rows over 9 keys in chunks of 4: rows 0 and 1 may not see key 8, so the
    last chunk has rows without a key (weights 0 and lse -inf there, not NaN), and the merged
    result is the reference's; outside autograd (the in-place branch) and inside it."""
    rng = np.random.default_rng(12)
    query, key, value = (rng.standard_normal((1, n, 2)) for n in (3, 9, 9))
    expected = reference.attention(query, key, value, is_causal=True,
                                   causal_alignment="bottom_right")
    for grad in (False, True):
        inputs = [_t(x).requires_grad_(grad) for x in (query, key, value)]
        output, lse = paged.split_kv_attention(*inputs, 4)
        np.testing.assert_allclose(output.detach().numpy(), expected.output, rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(lse.detach().numpy(), expected.lse, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# torch_attn/_fast/sdpa.py: "sdpa_blocks" (runs of rows, parts of keys), rows without a key
# ------------------------------------------------------------------------------------------


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


def test_attend_defaults_to_the_first_batch_sequences_and_differentiates_rows():
    """``attend(query)`` with batch 1 over a cache of two sequences reads sequence 0 only;
    three query rows (the causal rule masks part of the chunk) with autograd recording:
    the reference's output and the query's gradient."""
    rng = np.random.default_rng(4)
    keys, values = rng.standard_normal((2, 1, 7, 2)), rng.standard_normal((2, 1, 7, 3))
    cache = torch_attn.PagedKVCache(6, 4, 1, 2, 3)
    cache.append(_t(keys), _t(values))
    query, grad = rng.standard_normal((1, 2, 3, 2)), rng.standard_normal((1, 2, 3, 3))
    q = _t(query).requires_grad_()
    output = cache.attend(q)
    output.backward(_t(grad))
    options = {"is_causal": True, "causal_alignment": "bottom_right"}
    want = reference.attention(query[0], keys[0], values[0], **options).output
    np.testing.assert_allclose(output[0].detach().numpy(), want, rtol=1e-5, atol=1e-6)
    grads = reference.attention_vjp(query[0], keys[0], values[0], grad[0], **options)
    np.testing.assert_allclose(q.grad[0].numpy(), grads.query, rtol=1e-4, atol=1e-5)


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


# ------------------------------------------------------------------------------------------
# torch_attn/kv_cache.py: which kernel a decoding step takes
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [16, 17])
def test_a_decoding_step_over_a_cache_with_sinks_either_side_of_max_q_len(monkeypatch, rows):
    """Five cached positions, then a step of ``rows`` query rows with sinks: up to
    ``SPLIT_KV["max_q_len"]`` (16) rows torch_attn's split kernel runs (the module docstring),
    beyond it ``scaled_dot_product_attention``; both causal bottom-right with the sinks, as
    the float64 reference."""
    from torch_attn import kv_cache

    rng = np.random.default_rng(17)
    q = rng.standard_normal((1, 4, rows, 8))
    k, v = rng.standard_normal((1, 2, 5 + rows, 8)), rng.standard_normal((1, 2, 5 + rows, 3))
    sinks = np.array([0.5, -1.0, 2.0, 0.0])
    calls = []
    split = kv_cache.split_kv_attention
    monkeypatch.setattr(kv_cache, "split_kv_attention",
                        lambda *a, **o: calls.append(a[0].shape[-2]) or split(*a, **o))
    _, cache = kv_cache.decode_step(_t(q[..., :5, :]), _t(k[..., :5, :]), _t(v[..., :5, :]),
                                    None, 5 + rows)
    calls.clear()
    with torch.no_grad():
        out, _ = kv_cache.decode_step(_t(q), _t(k[..., 5:, :]), _t(v[..., 5:, :]), cache, None,
                                      sinks=_t(sinks))
    assert calls == ([rows] if rows <= 16 else [])
    expected = reference.attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                   sinks=sinks)
    np.testing.assert_allclose(out.numpy(), expected.output, rtol=1e-5, atol=1e-5)


def test_a_decoding_step_of_no_query_rows_gives_an_empty_output():
    """Zero query rows (the split kernel cannot take them): an empty output, no error."""
    from torch_attn import kv_cache

    out, cache = kv_cache.decode_step(torch.zeros(1, 4, 0, 8), torch.ones(1, 2, 3, 8),
                                      torch.ones(1, 2, 3, 3), None, 3)
    assert out.shape == (1, 4, 0, 3) and cache.length == 3
