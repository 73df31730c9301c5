"""Diagnoses at the seams of a checked module: what a failing cell's steps say beyond their
values, for ``reporting.groups``.

* ``cell_reasons(cell)``: a result of the wrong dtype (``compare``'s note "dtype float32, the
  spec requires float16") and a keyword the module does not take (the runner's hint "a module
  without return_lse declares it: UNSUPPORTED = {'lse', ...}"), each a diagnosis;
* ``swallowed(reason, fn)``: an "X is ignored" diagnosis of a function whose ``**options``
  swallows the keyword ``X`` becomes the fix: declare it in ``UNSUPPORTED``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

from ..comparing.results import Cell

_DTYPE = re.compile(r"dtype (\w+), the spec requires (\w+)")
_KEYWORD = re.compile(r"a module without (\w+) declares it: UNSUPPORTED = \{'(\w+)'")

#: The "X is ignored" diagnoses (``diagnose.HYPOTHESES``, by name) → (keyword, feature).
IGNORED = {
    "the mask is ignored": ("mask", "mask"),
    "the bias is ignored": ("bias", "bias"),
    "the custom scale is ignored (head_dim ** -0.5 used)": ("scale", "scale"),
    "soft-capping is skipped": ("softcap", "softcap"),
    "the dropout keep-mask is ignored": ("dropout_mask", "dropout"),
    "the window is ignored": ("window", "window"),
    "the causal rule is ignored": ("is_causal", "causal"),
    "the sinks are ignored": ("sinks", "sinks"),
    "ALiBi is ignored": ("alibi_slopes", "alibi"),
    "the chunk rule is ignored": ("chunk_size", "chunked"),
    "the segment ids are ignored": ("segment_ids", "segments"),
    "the mask_mod is ignored (a blocked path must evaluate it on every tile it computes)":
        ("mask_mod", "mask_mod"),
    "the mask_mod is ignored": ("mask_mod", "mask_mod"),
    "the score_mod is ignored": ("score_mod", "score_mod"),
}


def dtype_reason(step: str, got: str, want: str) -> str:
    """The diagnosis of a step returned in ``got`` where the spec requires ``want``."""
    return (f"wrong result dtype: {step} is {got}, the spec requires {want} (outputs and "
            f"gradients in the input dtype; scores, weights and lse in the compute dtype, "
            f"float32 for half inputs)")


def keyword_reason(keyword: str, feature: str) -> str:
    """The diagnosis of a call that fails on a keyword the module does not take."""
    return (f"the module does not take {keyword}, declare UNSUPPORTED = {{'{feature}'}}: a "
            f"module without a feature declares it and its cases are skipped "
            f"(docs/checking.md)")


def cell_reasons(cell: Cell) -> list[str]:
    """The diagnoses a failing cell's steps (notes and errors) and detail carry: a wrong
    result dtype, a keyword the module does not take; first found first, one per text."""
    out: list[str] = []
    texts = [(s.step, s.note or "", s.error or "") for s in cell.steps
             if s.error or not s.passed]
    texts.append(("", "", cell.detail if cell.status == "error" else ""))
    for step, note, error in texts:
        found = _KEYWORD.search(error) or _KEYWORD.search(note)
        if found:
            reason = keyword_reason(*found.groups())
            if reason not in out:
                out.append(reason)
        dtype = _DTYPE.search(note)
        if dtype and step:
            reason = dtype_reason(step, *dtype.groups())
            if reason not in out:
                out.append(reason)
    return out


def _takes_only_by_kwargs(fn: Callable[..., Any], keyword: str) -> str:
    """The name of ``fn``'s ``**kwargs`` when ``keyword`` reaches it only through them."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ""
    if keyword in params:
        return ""
    var = [p.name for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    return var[0] if var else ""


def swallowed(reason: str, fn: Callable[..., Any] | None) -> str:
    """``reason`` with the fix first when it says a keyword is ignored and ``fn`` takes that
    keyword only through ``**kwargs``: "your function accepts score_mod but ignores it ...:
    declare UNSUPPORTED = {'score_mod'}"; else ``reason`` unchanged."""
    name = reason.split(":")[0].split(";")[0].strip()
    if fn is None or name not in IGNORED:
        return reason
    keyword, feature = IGNORED[name]
    var = _takes_only_by_kwargs(fn, keyword)
    if not var:
        return reason
    return (f"your function accepts {keyword} but ignores it, declare UNSUPPORTED = "
            f"{{'{feature}'}}: its **{var} swallows {keyword}, and the result matches the "
            f"reference without it ({reason}); a function without a feature declares it "
            f"unsupported, or implements it")


__all__ = ["IGNORED", "cell_reasons", "dtype_reason", "keyword_reason", "swallowed"]
