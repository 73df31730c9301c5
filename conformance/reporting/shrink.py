"""The smallest failing case: shrink a failing cell's features and shapes, print it as code.

``shrink(backend, exp, steps, status, reason)`` starts from a failing sdpa cell and tries, one
at a time, to drop a feature (bias, mask, dropout, soft-capping, scale, window, the causal rule,
bottom-right alignment, non-finite values, a value head_dim other than the query's), to shrink
an axis (batch, heads, q_len, kv_len, head_dim — with value's when they are equal — v_dim) or
to use a wider dtype; it keeps every change after which the same steps still fail the same way
(same status, and the diagnosis ``reason`` among the candidate's), until no change helps. A
feature the failure does not need is thus gone from the smallest case (a custom-scale bug
shrinks to value's head_dim equal to the query's, not to a red-herring ``v_dim``). Every try is a
fresh ``expected_for`` (the float64 reference of the smaller inputs) and ``runner.run_cell``,
the same rule as the report. A wider dtype casts every floating array, bfloat16 (ml_dtypes,
NumPy kind "V") too, so the case's dtype is always the dtype its arrays have.
``reproducer(backend, exp, step)`` prints the result as a short script that calls the module and
prints its result next to the float64 reference; for a checked module it first puts the folder
the module imports from on ``sys.path`` (``running.backends.import_folder``), so it runs from
any folder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..cases.catalogue import CaseData, cast
from ..cases.dtypes import DTYPES
from ..cases.expected import Expected, expected_for
from ..running.backends import Backend, load_lines
from ..running.runner import run_cell
from ..running.steps import STEPS, Execution

#: At most this many candidate cases are tried per shrink.
MAX_TRIES = 150
#: Score-shaped arrays: broadcastable to ``(..., heads, q_len, kv_len)``.
_SCORE_ARRAYS = ("mask", "bias", "dropout_mask")

Edit = Callable[[dict[str, np.ndarray], dict[str, Any]],
                "tuple[dict[str, np.ndarray], dict[str, Any]] | None"]


def _drop(*names: str) -> Edit:
    def edit(a: dict, o: dict) -> tuple[dict, dict] | None:
        if not any(n in a or o.get(n) not in (None, False, 0.0) for n in names):
            return None
        return ({k: v for k, v in a.items() if k not in names},
                {k: v for k, v in o.items() if k not in names})

    return edit


def _top_left(a: dict, o: dict) -> tuple[dict, dict] | None:
    if o.get("causal_alignment") != "bottom_right":
        return None
    return a, {k: v for k, v in o.items() if k != "causal_alignment"}


def _floating(x: np.ndarray) -> bool:
    """A floating array: NumPy's kind "f", or ml_dtypes' bfloat16 (kind "V")."""
    return x.dtype.kind == "f" or x.dtype.name in DTYPES


def _finite(a: dict, o: dict) -> tuple[dict, dict] | None:
    bad = [n for n, x in a.items() if _floating(x)
           and not np.isfinite(x.astype(np.float64)).all()]
    if not bad:
        return None
    return {n: np.where(np.isfinite(x.astype(np.float64)), x, 0).astype(x.dtype)
            if n in bad else x for n, x in a.items()}, o


def _same_v_dim(a: dict, o: dict) -> tuple[dict, dict] | None:
    """value's head_dim made the query's: the longer of the two cut to the shorter."""
    q, v = a["query"], a["value"]
    if q.shape[-1] == v.shape[-1]:
        return None
    n = min(q.shape[-1], v.shape[-1])
    return {name: _cut(x, 1, n) if name in ("query", "key", "value") else x
            for name, x in a.items()}, o


FEATURE_EDITS: tuple[Edit, ...] = (
    _drop("bias"), _drop("mask", "kv_lengths"), _drop("dropout_mask", "dropout_p"),
    _drop("softcap"), _drop("scale"), _drop("window"), _drop("is_causal"), _top_left, _finite,
    _same_v_dim, _drop("sinks"),
)


def _cut(x: np.ndarray, from_end: int, n: int, tail: bool = False) -> np.ndarray:
    """``x`` with axis ``-from_end`` cut to its first (``tail``: last) ``n`` entries, where it
    is longer."""
    if from_end < 1 or x.ndim < from_end or x.shape[-from_end] <= n:
        return x
    index = [slice(None)] * x.ndim
    index[-from_end] = slice(x.shape[-from_end] - n, None) if tail else slice(0, n)
    return np.ascontiguousarray(x[tuple(index)])


def _sizes(size: int) -> list[int]:
    return sorted({n for n in (1, size // 2, size - 1) if 1 <= n < size})


def _axis_edits(a: dict[str, np.ndarray]) -> Iterator[Edit]:
    """Every shrink of one axis of an sdpa case, smallest first."""
    q, k, v = a["query"], a["key"], a["value"]

    def edits(per_array: dict[str, tuple[int, int]], lengths: int | None = None
              ) -> Iterator[Edit]:
        for tail in (False, True):  # keep the first entries, or the last ones
            def apply(arrays: dict, o: dict, tail: bool = tail) -> tuple[dict, dict]:
                out = {n: _cut(x, *per_array[n], tail) if n in per_array else x
                       for n, x in arrays.items()}
                if lengths is not None and "kv_lengths" in out:
                    out["kv_lengths"] = np.minimum(out["kv_lengths"], lengths)
                return out, o

            yield apply

    for b in range(q.ndim - 3):  # batch axes: their first entry only
        from_end = q.ndim - b
        if q.shape[b] > 1:
            cut = {n: (from_end, 1) for n in ("query", "key", "value", *_SCORE_ARRAYS)}
            cut["kv_lengths"] = (from_end - 3, 1)
            yield from edits(cut)
    if q.ndim >= 3:  # heads: keep whole groups of query heads over their key/value head
        heads, kv_heads = q.shape[-3], k.shape[-3]
        group = heads // kv_heads
        options = {(1, 1)} if heads > 1 else set()
        options |= {(n * group, n) for n in _sizes(kv_heads)}
        for h, kh in sorted(options):
            yield from edits({"query": (3, h), "key": (3, kh), "value": (3, kh), "sinks": (1, h),
                        **{n: (3, h) for n in _SCORE_ARRAYS}})
    for n in _sizes(q.shape[-2]):
        yield from edits({"query": (2, n), **{s: (2, n) for s in _SCORE_ARRAYS}})
    for n in _sizes(k.shape[-2]):
        yield from edits({"key": (2, n), "value": (2, n), **{s: (1, n) for s in _SCORE_ARRAYS}},
                         n)
    same = v.shape[-1] == q.shape[-1]  # shrink them together: no v_dim appears on the way
    for n in _sizes(q.shape[-1]):
        yield from edits({"query": (1, n), "key": (1, n), **({"value": (1, n)} if same else {})})
    for n in _sizes(v.shape[-1]) if not same else ():  # v_dim only where the failure has one
        yield from edits({"value": (1, n)})


def _cast_all(a: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Every floating array of ``a`` (bfloat16 too) in ``dtype``; bool and int ones as they
    are."""
    return {n: cast(x.astype(np.float64), dtype) if _floating(x) else x for n, x in a.items()}


def shrink(backend: Backend, exp: Expected, steps: list[str], status: str = "FAIL",
           reason: str = "") -> Expected:
    """The smallest variant of ``exp`` on which ``steps`` still give ``status`` (and a
    diagnosis containing the start of ``reason``); ``exp`` itself when nothing smaller fails."""
    if exp.kind != "sdpa":
        return exp
    gradients = any("grad" in s for s in steps)
    key = reason[:40]
    tries = 0

    def fails(arrays: dict, options: dict, dtype: str) -> Expected | None:
        nonlocal tries
        tries += 1
        try:
            with np.errstate(all="ignore"):
                candidate = expected_for(CaseData(arrays, options), "sdpa", dtype, exp.case,
                                         gradients=gradients)
        except Exception:  # noqa: BLE001 - inputs the spec rejects are no smaller case
            return None
        if any(s not in candidate.values for s in steps):
            return None
        cell = run_cell(backend, candidate, steps=steps)
        if cell.status != status or (key and not any(key in r for r in cell.reasons)):
            return None
        return candidate

    best = exp
    arrays = {n: x for n, x in exp.data.arrays.items() if n != "grad_output"}
    options = dict(exp.data.options)
    improved = True
    while improved and tries < MAX_TRIES:
        improved = False
        edits = [*FEATURE_EDITS, *_axis_edits(arrays)]
        dtypes = [d for d in ("float64", "float32") if d != best.dtype]
        for edit in edits:
            changed = edit(arrays, options)
            if changed is None:
                continue
            found = fails(*changed, best.dtype)
            if found is not None:
                best, (arrays, options), improved = found, changed, True
                break
            if tries >= MAX_TRIES:
                break
        if not improved:
            for dtype in dtypes:
                found = fails(_cast_all(arrays, dtype), options, dtype)
                if found is not None:
                    best, arrays, improved = found, _cast_all(arrays, dtype), True
                    break
    return best


# ------------------------------------------------------------------------------ code


#: The positional arguments' names, per function (default: query, key, value, grad_output).
_ARGUMENTS = {"attention_scores": ("query", "key"), "mask_scores": ("scores",),
              "attention_weights": ("scores",)}


def _literal(name: str, x: np.ndarray) -> str:
    x = np.asarray(x)
    if x.dtype == np.bool_:
        return f"{name} = np.array({x.tolist()!r}, dtype=bool)"
    if x.dtype.kind in "iu":
        return f"{name} = np.array({x.tolist()!r})"
    return f"{name} = np.array({x.astype(np.float64).tolist()!r}).astype(dtype)"


def shape_text(exp: Expected) -> str:
    """``query (1, 1, 1, 2), key (1, 1, 2, 1) …``: the shapes of a case's main arrays."""
    return ", ".join(f"{n} {tuple(np.shape(exp.data.arrays[n]))}"
                     for n in ("query", "key", "value", "mask", "bias")
                     if n in exp.data.arrays)


def reproducer(backend: Backend, exp: Expected, step: str, why: str = "") -> str:
    """A short script: the call behind ``step`` on ``exp``'s inputs, its result and the
    float64 reference printed side by side."""
    exe = Execution(backend, exp)
    call = STEPS[step].calls(exe)[0]
    names = _ARGUMENTS.get(call.fn, ("query", "key", "value", "grad_output"))[:len(call.args)]
    returns_tuple = call.fn not in ("scaled_dot_product_attention", "blockwise_attention") or bool(
        call.kwargs.get("return_weights") or call.kwargs.get("return_lse"))
    pick = STEPS[step].pick if returns_tuple else None
    lines = [f"# {backend.name}: {step} of case {exp.case} (shrunk), {exp.dtype}"
             + (f": {why}" if why else ""),
             "import numpy as np",
             "from numpy import inf, nan  # noqa: F401",
             "from conformance.running import backends",
             *load_lines(backend, "attn"),
             f"dtype = backends.numpy_dtype({exp.dtype!r})"]
    lines += [_literal(n, x) for n, x in zip(names, call.args, strict=True)]
    arrays = {k: v for k, v in call.kwargs.items() if isinstance(v, np.ndarray)}
    lines += [_literal(n, x) for n, x in arrays.items()]
    pairs = {k: v for k, v in call.kwargs.items()  # segment_ids=(q_ids, kv_ids)
             if isinstance(v, tuple) and v and all(isinstance(x, np.ndarray) for x in v)}
    lines += [_literal(f"{k}_{i}", x) for k, v in pairs.items() for i, x in enumerate(v)]
    args = [f"attn.asarray({n})" for n in names]
    args += [f"{k}=attn.asarray({k})" for k in arrays]
    args += [f"{k}=(" + ", ".join(f"attn.asarray({k}_{i})" for i in range(len(v))) + ")"
             for k, v in pairs.items()]
    args += [f"{k}={v!r}" for k, v in call.kwargs.items() if k not in arrays and k not in pairs]
    lines += [f"result = attn.module.{call.fn}(" + ", ".join(args) + ")",
              "actual = attn.to_numpy(result" + (f"[{pick}]" if pick is not None else "") + ")",
              f"expected = np.array({np.asarray(exp.values[step], np.float64).tolist()!r})"
              "  # float64 reference",
              f"print('{step}:  ', actual.astype(np.float64).round(6).tolist())",
              "print('expected:', expected.round(6).tolist())"]
    return "\n".join(lines)


__all__ = ["FEATURE_EDITS", "MAX_TRIES", "reproducer",
           "shape_text", "shrink"]
