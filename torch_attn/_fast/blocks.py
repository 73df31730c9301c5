"""The blocks of ``"sdpa_blocks"`` (torch only), ``sdpa.py``'s route for chunks, ALiBi,
segment ids and ``mask_mod``: the runs of query rows that see the same keys and the parts of
those keys (``_sdpa_runs``, from the statuses and triangles of ``_masking._mods_plan``), and the
autograd Function that computes several parts with torch's private CPU kernel and merges them
by their log-sum-exp (``_FlashParts``, ``spec.MERGING``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

import attention_rules as rules

from .._steps import NEG_INF

# ------------------------------------------------------------------------------------------
# Runs of query rows that see the same keys, and the parts of their keys
# ------------------------------------------------------------------------------------------


def _sdpa_runs(statuses: np.ndarray, tri: np.ndarray | None, block_q: int, block_kv: int,
               q_len: int, kv_len: int, split: bool) -> list[tuple[int, int, list]]:
    """torch only: ``sdpa._sdpa_blocks``' runs of query rows, ``(r0, r1, parts)``, from the
    statuses of its ``(block_q, block_kv)`` tiles (``_mods_plan``; ``tri`` its triangles or
    None); ``parts``: the keys the rows see, ``[(k0, k1, kind)]`` in order, kind ``"all"``
    (every row sees every key), ``"causal"`` (the top-left triangle from ``k0``), ``"mask"``
    (some rows see some keys) or ``"none"`` (no row sees a key; never first or last). A block of
    rows joins the run before it when both see the same first and last key (the statuses
    combined: a tile stays ``ALL`` or ``NONE`` only where it is in both), or when both are
    ``"all"`` keys from the same first key and then a causal triangle on the same diagonal that
    the run's triangle continues (the run then is ``"all"`` keys and one larger triangle: with
    ``split`` only, else only without ``"all"`` keys, which one unmasked call must otherwise
    compute)."""
    runs: list[list] = []  # [r0, r1, statuses row, parts]
    for r, row in enumerate(statuses):
        r0, r1 = r * block_q, min((r + 1) * block_q, q_len)
        parts = _run_parts(row, None if tri is None else tri[r], block_kv, kv_len)
        if runs and not parts and not runs[-1][3]:  # rows that see no key: one run of 0
            runs[-1][1] = r1
            continue
        if runs and parts and runs[-1][3]:
            last = runs[-1]
            joined = _join_triangles(last[0], last[1], last[3], r0, parts, split)
            if joined is not None:
                last[1], last[3] = r1, joined
                last[2] = row.copy()
                last[2][joined[-1][0] // block_kv : joined[-1][1] // block_kv] = rules.SOME
                continue
            if (last[3][0][0], last[3][-1][1]) == (parts[0][0], parts[-1][1]):
                last[1], last[2] = r1, np.where(last[2] == row, row, rules.SOME)
                last[3] = _run_parts(last[2], None, block_kv, kv_len)
                continue
        runs.append([r0, r1, row, parts])
    return [(r0, r1, parts) for r0, r1, _, parts in runs]


def _run_parts(row: np.ndarray, tri: np.ndarray | None, block_kv: int, kv_len: int) -> list:
    """torch only: a row of tile statuses as ``_sdpa_runs``' parts (``tri``: its triangles)."""
    seen = np.flatnonzero(row)
    if not seen.size:
        return []
    cols = np.arange(int(seen[0]), int(seen[-1]) + 1)
    starts = cols[np.r_[True, row[cols[1:]] != row[cols[:-1]]]]  # runs of one status
    kinds = {rules.ALL: "all", rules.SOME: "mask", rules.NONE: "none"}
    return [(int(a) * block_kv, min(int(b) * block_kv, kv_len), "causal" if row[a] ==
             rules.SOME and tri is not None and tri[a] else kinds[int(row[a])])
            for a, b in zip(starts, np.r_[starts[1:], cols[-1] + 1], strict=True)]


def _join_triangles(a0: int, a1: int, mine: list, b0: int, theirs: list, split: bool
                    ) -> list | None:
    """torch only: the parts of a run of rows ``a0:a1`` (``mine``) joined with the next block
    of rows from ``b0 == a1`` (``theirs``) when both are ``"all"`` keys from the same key and
    then a causal triangle, on the same diagonal (``r0 - k0`` of the triangle), and the run's
    triangle is at least as wide as its rows (its last row sees no key after it); else None."""
    forms = []
    for parts in (mine, theirs):
        if parts[-1][2] != "causal" or len(parts) > 2 or (len(parts) == 2 and
                                                           parts[0][2] != "all"):
            return None
        forms.append((parts[0][0], parts[-1][0], parts[-1][1]))  # first key, triangle, end
    (k0, p, e), (k0b, pb, eb) = forms
    if k0 != k0b or a0 - p != b0 - pb or a1 - a0 > e - p or eb < e or (k0 < p and not split):
        return None
    return ([(k0, p, "all")] if k0 < p else []) + [(p, eb, "causal")]


# ------------------------------------------------------------------------------------------
# torch only: SDPA's CPU kernel over parts of the keys, merged by their log-sum-exp
# ------------------------------------------------------------------------------------------


try:  # private: torch's fused CPU kernel returning each row's lse, and its backward pass
    _ATEN = torch.ops.aten
    _FLASH_CPU = _ATEN._scaled_dot_product_flash_attention_for_cpu.default
    _FLASH_CPU_BACKWARD = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward.default
except (AttributeError, RuntimeError):  # another torch: sdpa.py takes one masked call instead
    _FLASH_CPU = _FLASH_CPU_BACKWARD = None


class _FlashParts(torch.autograd.Function):
    """torch only: attention of ``query (B, H, rows, D)`` over disjoint parts of ``key`` and
    ``value`` ``(B, H, S, D)`` (``parts``: ``[(k0, k1, is_causal, float mask or None)]``,
    masks ``(rows, k1 - k0)`` or ``(B, H, rows, k1 - k0)``, ``-inf`` where not allowed), one
    call of SDPA's fused CPU kernel each, merged by their log-sum-exp (``spec.MERGING``):
    output ``(B, H, rows, D)``. Backward: the kernel's backward pass per part, given the MERGED
    output and lse (flash attention's split backward: ``P = exp(s - lse)`` is then each key's
    final weight, ``rowsum(dO · O)`` the whole row's), gives that part's exact dK, dV and its
    share of dQ. A row with no key in any part gives 0, gradient 0."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                parts: list, scale: float) -> torch.Tensor:
        """The merged output ``(B, H, rows, D)``."""
        outs, lses = [], []
        for k0, k1, causal, mask in parts:
            out, lse = _FLASH_CPU(query, key[:, :, k0:k1], value[:, :, k0:k1], 0.0, causal,
                                  attn_mask=mask, scale=scale)  # (B, H, rows, D), (B, H, rows)
            if mask is not None:  # the kernel's lse of a row without a key is 0: -inf here
                lse = lse.masked_fill(~(mask > NEG_INF).any(dim=-1), NEG_INF)
            outs.append(out)
            lses.append(lse)
        row_max = functools.reduce(torch.maximum, lses)
        shift = torch.where(row_max == NEG_INF, 0.0, row_max)
        scales = [torch.exp(lse - shift) for lse in lses]  # small: (B, H, rows)
        total = functools.reduce(torch.add, scales)
        empty = total == 0.0  # no key in any part
        safe = torch.where(empty, 1.0, total)
        output = outs[0] * (scales[0] / safe)[..., None]
        for out, a in zip(outs[1:], scales[1:], strict=True):
            output.addcmul_(out, (a / safe)[..., None])
        # the backward's lse: the kernel's own 0 for a row without a key (exp(-inf - 0) = 0)
        lse = torch.where(empty, 0.0, shift + torch.log(safe))
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.parts, ctx.scale = parts, scale
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        """dQ, dK, dV from each part's backward pass with the merged output and lse."""
        query, key, value, output, lse = ctx.saved_tensors
        grad = grad.contiguous()
        grad_q, grad_k, grad_v = None, torch.zeros_like(key), torch.zeros_like(value)
        for k0, k1, causal, mask in ctx.parts:
            gq, gk, gv = _FLASH_CPU_BACKWARD(grad, query, key[:, :, k0:k1], value[:, :, k0:k1],
                                             output, lse, 0.0, causal, attn_mask=mask,
                                             scale=ctx.scale)
            grad_q = gq if grad_q is None else grad_q.add_(gq)
            grad_k[:, :, k0:k1] = gk
            grad_v[:, :, k0:k1] = gv
        return grad_q, grad_k, grad_v, None, None
