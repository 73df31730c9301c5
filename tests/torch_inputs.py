"""Shared inputs of the torch_attn tests (``tests/test_torch_*.py``) and their float64
reference, numpy_attn: an independent implementation, never torch_attn itself."""

from __future__ import annotations

import numpy as np
import torch

import numpy_attn

F64 = torch.float64


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



__all__ = ["F64", "_numpy_ref", "_qkv"]
