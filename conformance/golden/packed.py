"""What a golden file holds for packed batches, chunks, ALiBi, segment ids and the mods, and
how ``files`` checks it when reading a file back.

Written (``tables``): a mod as the arrays a kernel author can use without the harness,
``table:mask_mod`` (bool, the scores' shape ``(batch, heads, q_len, kv_len)``: the mask_mod
evaluated everywhere) and ``table:score_mod`` (float64, the same shape: an additive score mod's
bias; the ``softcap`` score mod is its cap, in ``meta``'s options). The inputs themselves are
``in:`` arrays like any other: a varlen case's ``cu_seq_q``, ``cu_seq_k`` (and ``seqused_k``),
``alibi_slopes``, ``q_segment_ids``/``kv_segment_ids``, the mods' ``mod_*`` arrays.

Read back (``check_option``, ``check_inputs``, ``check_tables``): a mod option names a mod of
the registry with its parameters (``mods.check_option``); a varlen case's options are ints and
a ``window_size`` pair, its offsets ``(N + 1,)`` ints that start at 0, never decrease and end at
the tokens given (``seqused_k`` within each sequence), its arrays tokens-first; slopes, segment
ids and mod arrays have the dtype and shape their rule needs; the tables equal the tabulation
of the file's own inputs. Anything else is the caller's ``GoldenError``, one line, before any
backend runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..cases import mods
from ..cases.inputs import CaseData

#: Option keys of a varlen case.
VARLEN_OPTIONS = frozenset({"max_q", "max_k", "window_size", "enable_gqa", "scale", "softcap"})
#: Largest offset or length a varlen file may declare (its arrays are far smaller).
MAX_TOKENS = 2**31 - 1


def _int(x: Any, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= MAX_TOKENS


def check_option(name: str, value: Any) -> bool | None:
    """Whether ``value`` is valid for the option ``name`` of these cases; None for an option
    they do not define (``files`` checks the others). Raises ``mods.ModError`` for a mod that
    is not registered or has the wrong parameters."""
    if name in ("mask_mod", "score_mod"):
        mods.check_option(name, value)
        return True
    if name == "window_size":
        return isinstance(value, list) and len(value) == 2 and all(_int(v, -1) for v in value)
    if name in ("max_q", "max_k", "chunk_size"):
        return _int(value, 1 if name == "chunk_size" else 0)
    if name == "enable_gqa":
        return isinstance(value, bool)
    return None


def _offsets(x: np.ndarray | None, total: int) -> bool:
    return (x is not None and x.ndim == 1 and x.dtype.kind in "iu" and len(x) >= 1
            and int(x[0]) == 0 and bool(np.all(np.diff(x.astype(np.int64)) >= 0))
            and int(x[-1]) == total)


def _check_varlen(data: CaseData) -> str:
    a, o = data.arrays, data.options
    q, k, v = (a.get(n) for n in ("query", "key", "value"))
    if q is None or k is None or v is None or q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or \
            k.shape[:2] != v.shape[:2] or q.shape[-1] != k.shape[-1]:
        return "query, key and value must be tokens first, (total, heads, dim)"
    cu_q, cu_k = a.get("cu_seq_q"), a.get("cu_seq_k")
    if not (_offsets(cu_q, q.shape[0]) and _offsets(cu_k, k.shape[0]) and len(cu_q) == len(
            cu_k)):
        return "cu_seq_q and cu_seq_k must be (N + 1,) ints from 0 to the tokens, non-decreasing"
    longest = {"max_q": np.diff(cu_q.astype(np.int64)), "max_k": np.diff(cu_k.astype(np.int64))}
    if any(not _int(o.get(n)) or o[n] < int(x.max(initial=0)) for n, x in longest.items()):
        return "max_q and max_k must be ints at least the longest sequence"
    used = a.get("seqused_k")
    if used is not None and (used.shape != (len(cu_k) - 1,) or used.dtype.kind not in "iu" or
                             not bool(np.all((used >= 0) & (used <= longest["max_k"])))):
        return "seqused_k must be (N,) ints within each sequence's keys"
    return ""


def _check_sdpa(data: CaseData) -> str:
    a, o = data.arrays, data.options
    q, k = a.get("query"), a.get("key")
    if q is None or k is None or q.ndim != 4:
        return "" if not mods.uses_mods(data) else "these cases are 4-D (batch, heads, seq, dim)"
    batch, heads, q_len = q.shape[:3]
    kv_len = k.shape[-2]
    shapes = {"alibi_slopes": ((heads,), "f"), "mod_slopes": ((heads,), "f"),
              "q_segment_ids": ((batch, q_len), "iu"), "mod_q_ids": ((batch, q_len), "iu"),
              "kv_segment_ids": ((batch, kv_len), "iu"), "mod_kv_ids": ((batch, kv_len), "iu"),
              "mod_table": ((batch, heads, q_len, kv_len), "b")}
    for name, (shape, kinds) in shapes.items():
        x = a.get(name)
        if x is not None and (x.shape != shape or (x.dtype.kind not in kinds and not (
                kinds == "f" and x.dtype.name == "bfloat16"))):
            return f"{name} must be {shape} ({kinds}); got {x.dtype} {x.shape}"
    if ("q_segment_ids" in a) != ("kv_segment_ids" in a):
        return "q_segment_ids and kv_segment_ids come together"
    for kind in ("mask_mod", "score_mod"):
        if o.get(kind) is not None:
            try:
                mods.check_option(kind, o[kind], a)
            except mods.ModError as exc:
                return str(exc)
    return ""


def check_inputs(kind: str, data: CaseData) -> str:
    """"" when a case's inputs and options are what a varlen case or an sdpa case with these
    rules needs, else what is wrong (one line)."""
    return _check_varlen(data) if kind == "varlen" else _check_sdpa(data)


def tables(kind: str, data: CaseData) -> dict[str, np.ndarray]:
    """``table:mask_mod`` and ``table:score_mod`` of an sdpa case with mods (see the module
    docstring); empty otherwise."""
    if kind != "sdpa" or not any(data.options.get(n) is not None for n in ("mask_mod",
                                                                           "score_mod")):
        return {}
    tab = mods.tabulate(data)
    out = {}
    if tab.mask is not None:
        out["table:mask_mod"] = np.ascontiguousarray(tab.mask)
    if tab.bias is not None:
        out["table:score_mod"] = np.ascontiguousarray(tab.bias, np.float64)
    return out


def check_tables(found: dict[str, np.ndarray], kind: str, data: CaseData) -> str:
    """"" when the ``table:`` arrays of a file are exactly the tabulation of its own inputs."""
    want = tables(kind, data)
    for name in sorted(set(found) | set(want)):
        if name not in want:
            return f"{name} belongs to no mod of this case"
        if name not in found:
            return f"{name} is missing (the case has that mod)"
        if found[name].dtype != want[name].dtype or not np.array_equal(found[name], want[name]):
            return f"{name} is not the tabulation of the file's own mod"
    return ""


__all__ = ["MAX_TOKENS", "VARLEN_OPTIONS", "check_inputs", "check_option", "check_tables",
           "tables"]
