"""torch_attn under autograd, on the fast path and on the explicit steps (the ``path``
fixture): ``torch.autograd.gradcheck`` in float64 (causal both alignments, window, softcap,
GQA, 2-D, dropout with a keep-mask), and fully masked rows with exactly 0 output and gradient
(the other rows' output and gradients against the float64 reference VJP).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from numerics import assert_matches_reference, assert_vjp_matches_reference  # noqa: E402
from torch_inputs import F64, _qkv  # noqa: E402

import torch_attn  # noqa: E402

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
    """Output and gradients against the float64 reference (its VJP) under the harness's
    tolerance rule, which holds the fully masked row's output and query gradient to exactly 0;
    the bias gradient is exactly 0 there too."""
    q, k, v = _qkv((2, 4, 3), (2, 5, 3), dtype=dtype, grad=True, seed=5)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1] = False  # row 1 fully masked by the mask; rows 0-1 by the bottom-right window too
    bias = torch.randn(2, 4, 5, dtype=dtype).requires_grad_(True) if with_bias else None
    options = {"window": (0, None), "causal_alignment": "bottom_right", "is_causal": True}
    out = torch_attn.scaled_dot_product_attention(q, k, v, mask=mask, bias=bias, **options)
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    out.sum().backward()
    arrays = {"query": q, "key": k, "value": v, "mask": mask, "bias": bias,
              "grad_output": torch.ones_like(out)}
    arrays = {n: None if x is None else x.detach().numpy() for n, x in arrays.items()}
    name = str(dtype).removeprefix("torch.")
    assert_matches_reference(out.detach().numpy(), arrays, name, what=path, **options)
    grads = [t.grad.numpy() for t in (q, k, v) + ((bias,) if with_bias else ())]
    assert_vjp_matches_reference(grads, arrays, name, what=path, **options)
    if with_bias:  # masked positions receive exactly 0
        assert torch.equal(bias.grad[:, 1], torch.zeros_like(bias.grad[:, 1]))
