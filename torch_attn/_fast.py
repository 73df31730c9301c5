"""The fast path of torch_attn: torch's fused ``scaled_dot_product_attention`` (SDPA).

``use_fast_path`` is the one selection rule (``attention_rules.FAST_PATHS["torch_attn"]``
has no numbers: SDPA is as fast as the explicit steps at every size). The explicit steps of
``functional.py`` run instead when SDPA cannot follow the spec:

* ``return_weights=True``: SDPA does not return the weights;
* ``dropout_p > 0``: SDPA draws its own keep-mask, not one from ``rng``/``dropout_mask``;
* ``softcap``: SDPA has no soft-capping (it would have to come before the bias);
* an empty axis (``q_len``, ``kv_len``, ``head_dim``, ``v_dim`` or a batch axis of size 0);
* a NaN or an infinity in ``query`` or ``key`` (one sum over each, ``_finite``): SDPA adds
  the mask to the scores instead of replacing them, so a NaN or infinite key at a masked
  position spreads NaN to rows that do not attend it (``NaN + -inf = NaN``), and a row whose
  allowed scores are all ``-inf`` gives NaN, not 0 (torch 2.13, CPU). The spec's IEEE rule
  (``spec.NON_FINITE``) is what the explicit steps compute.

Everything else takes SDPA (``fast_attention``): the boolean mask, the causal rule in both
alignments and the window become ONE explicit boolean ``attn_mask`` (SDPA's own ``is_causal``
only when ``q_len == kv_len`` with nothing else to combine, where both alignments coincide); a
bias becomes one float ``attn_mask``, ``-inf`` where not allowed; grouped-query heads go
through ``enable_gqa``; ``v_dim != head_dim`` and 2-D inputs are supported; float16/bfloat16
are given to SDPA as float32 copies (the spec's float32 weighted sum: SDPA's half kernels
round the weights to the half type before ``weights @ value``). Fully masked rows: on the CPU
SDPA gives output and gradient exactly 0 (torch >= 2.13, checked by the tests); on other
devices they are given every key for the kernel and their output is zeroed afterwards, so no
kernel meets an empty row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import attention_rules as rules

from . import functional  # the steps the fast path must equal, and reuses

NEG_INF = float("-inf")

# CPU SDPA gives fully masked rows an output and a gradient of exactly 0 (checked on torch 2.13
# by tests/test_torch_specific.py); other devices and older versions are not relied upon.
CPU_SDPA_ZEROES_MASKED_ROWS = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


def use_fast_path(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    args: rules.Arguments,
) -> str | None:
    """The fast path for these validated inputs (``"sdpa"``), or None for the steps."""
    if args.return_weights or args.dropout_p > 0.0 or args.softcap is not None:
        return None  # SDPA returns no weights, draws its own keep-mask, has no softcap
    if rules.has_empty_axis(tuple(query.shape), tuple(key.shape), tuple(value.shape)):
        return None  # empty axes are not worth a kernel
    if not _finite(query, key):
        return None  # NaN/inf: SDPA adds the mask instead of replacing masked scores
    return "sdpa"


def _finite(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether query and key hold no NaN and no infinity: one sum each, no temporary (40 times
    faster than ``isfinite(x).all()``). NaN and ±inf always reach a sum (``inf - inf = NaN``);
    a sum that overflows on huge finite values only sends the call to the explicit steps."""
    accumulate = torch.float64 if query.dtype == torch.float64 else torch.float32
    total = query.sum(dtype=accumulate) + key.sum(dtype=accumulate)
    return bool(torch.isfinite(total))


def fast_attention(
    path: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    args: rules.Arguments,
) -> torch.Tensor:
    """``scaled_dot_product_attention``'s output on the path ``use_fast_path`` chose."""
    return _sdpa_attention(
        query, key, value, mask, bias, args.is_causal, args.causal_alignment, args.window,
        args.scale,
    )


def _sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    scale: float,
) -> torch.Tensor:
    """The whole pipeline in one SDPA call, in the input dtype (``torch.compile``-able)."""
    dtype = query.dtype
    query = functional._to_compute(query)
    key, value = functional._to_compute(key), functional._to_compute(value)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    sdpa_causal = is_causal and q_len == kv_len and mask is None and bias is None
    sdpa_causal = sdpa_causal and window is None  # top-left = bottom-right when q_len == kv_len
    attn_mask = None
    if not sdpa_causal:
        attn_mask = functional._allowed(
            q_len, kv_len, mask, is_causal, causal_alignment, window, query.device
        )
    if bias is not None:  # one float mask: bias where allowed, -inf elsewhere
        float_mask = bias.to(query.device, query.dtype)
        attn_mask = float_mask if attn_mask is None else float_mask.masked_fill(~attn_mask, NEG_INF)
    row_ok = None
    if attn_mask is not None and not (query.device.type == "cpu" and CPU_SDPA_ZEROES_MASKED_ROWS):
        allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > NEG_INF
        row_ok = allowed.any(dim=-1, keepdim=True)  # (..., q_len, 1): the row keeps a key
        if attn_mask.dtype == torch.bool:
            attn_mask = attn_mask | ~row_ok  # a fully masked row attends everything...
        else:
            attn_mask = torch.where(row_ok, attn_mask, 0.0)
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, is_causal=sdpa_causal, scale=scale,
        enable_gqa=functional._groups(query.shape, key.shape) > 1,
    )  # (..., heads, q_len, v_dim)
    if row_ok is not None:
        output = torch.where(row_ok, output, 0.0)  # ...and is zeroed here, gradient 0 too
    return output.to(dtype)
