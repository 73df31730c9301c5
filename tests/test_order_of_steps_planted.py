"""``combined_order_of_steps`` catches the order-of-operations bugs no other case caught: ALiBi
added before the soft-cap, the score_mod applied first (before the soft-cap, the bias and
ALiBi), and the bias added before the soft-cap.

Each planted module is the float64 reference pipeline (``reference.attention``) with the steps
before the masking done in its own order: the scores after scale, soft-cap, bias, ALiBi and
score_mod (in the order planted) are handed to the reference as a ``score_mod`` that returns
them, so masking, the softmax with sinks and the output are the reference's own. The module in
the spec's order passes the case, each planted order fails it with its own diagnosis
(``conformance.diagnosing.order_of_steps``), named in the verdict's headline, in every dtype.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from conformance import spec
from conformance.cases import reference
from conformance.diagnosing import diagnose
from conformance.reporting import terminal
from conformance.running import backends, runner

CASE = "combined_order_of_steps"
SPEC_ORDER = ("softcap", "bias", "alibi", "score_mod")


def _planted(order: tuple[str, ...]) -> Callable[..., Any]:
    """``scaled_dot_product_attention`` in float64 with the steps before masking in ``order``."""

    def scaled_dot_product_attention(
        query: Any, key: Any, value: Any, *, mask: Any = None, bias: Any = None,
        is_causal: bool = False, causal_alignment: str = "top_left", window: Any = None,
        scale: float | None = None, softcap: float | None = None, sinks: Any = None,
        alibi_slopes: Any = None, score_mod: Any = None, return_weights: bool = False,
        return_lse: bool = False, **rest: Any,
    ) -> Any:
        q, k, v = (np.asarray(x, dtype=np.float64) for x in (query, key, value))
        heads = q.shape[-3] if q.ndim >= 3 else 1
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        scores = np.einsum("...qd,...kd->...qk", q, reference.repeat_kv(k, heads)) * scale
        for step in order:
            if step == "softcap" and softcap is not None:
                scores = softcap * np.tanh(scores / softcap)
            elif step == "bias" and bias is not None:
                scores = scores + np.asarray(bias, dtype=np.float64)
            elif step == "alibi" and alibi_slopes is not None:
                scores = scores + reference.alibi_bias(alibi_slopes, scores.shape,
                                                       causal_alignment)
            elif step == "score_mod" and score_mod is not None:
                grid = reference.mod_indices(scores.shape)
                scores = np.broadcast_to(
                    np.asarray(score_mod(scores, *grid), dtype=np.float64), scores.shape)
        steps = reference.attention(
            q, k, v, mask=mask, is_causal=is_causal, causal_alignment=causal_alignment,
            window=window, scale=scale, sinks=sinks,
            score_mod=lambda s, *grid: np.broadcast_to(scores, np.shape(s)), **rest)
        dtype = np.asarray(query).dtype
        out: list[Any] = [steps.output.astype(dtype)]
        if return_weights:
            out.append(steps.weights.astype(dtype))
        if return_lse:
            out.append(steps.lse.astype(spec.COMPUTE_DTYPE[dtype.name]))
        return out[0] if len(out) == 1 else tuple(out)

    return scaled_dot_product_attention


PLANTED = {
    "alibi_before_softcap": ("alibi", "softcap", "bias", "score_mod"),
    "score_mod_first": ("score_mod", "softcap", "bias", "alibi"),
    "bias_before_softcap": ("bias", "softcap", "alibi", "score_mod"),
}

#: The name of the diagnosis each planted order must get (the words before its first colon),
#: as the spec's pipeline (spec.PIPELINE_WITH_MODS) names the steps moved.
DIAGNOSIS = {
    "alibi_before_softcap": "ALiBi added before the soft-cap",
    "score_mod_first": "score_mod applied before the soft-cap, the bias and ALiBi",
    "bias_before_softcap": "the bias added before the soft-cap",
}


def _run(name: str, order: tuple[str, ...], dtypes: tuple[str, ...] = ("float32",)) -> Any:
    """``runner.run`` of ``CASE`` in ``dtypes`` for a module with the steps in ``order``."""
    module = types.ModuleType(name)
    module.scaled_dot_product_attention = _planted(order)  # type: ignore[attr-defined]
    backends.register(backends.from_module(module, name=name))
    try:
        return runner.run([name], [CASE], list(dtypes), check_errors=False, hypothesis=0)
    finally:
        backends.unregister(name)


def _cell(name: str, order: tuple[str, ...]) -> Any:
    """The one cell of ``CASE`` in float32 for a module with the steps in ``order``."""
    (cell,) = [c for c in _run(name, order).cells if c.case == CASE]
    return cell


def _names(cell: Any) -> list[str]:
    """The names of the diagnoses of a cell (``diagnose.short``), in order."""
    return [diagnose.short(r) for reasons in cell.reasons for r in diagnose.split(reasons)]


def test_the_spec_order_passes_the_case() -> None:
    cell = _cell("planted_spec_order", SPEC_ORDER)
    assert cell.status == "ok", (cell.status, cell.detail)


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_each_planted_order_fails_the_case(bug: str) -> None:
    cell = _cell(f"planted_{bug}", PLANTED[bug])
    assert cell.status == "FAIL", (cell.status, cell.detail)


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_each_planted_order_fails_with_its_diagnosis(bug: str) -> None:
    """Every failing step of the float32 cell names the planted order, and nothing else."""
    cell = _cell(f"planted_{bug}", PLANTED[bug])
    assert _names(cell) == [DIAGNOSIS[bug]], cell.reasons
    failed = [s for s in cell.steps if not s.passed]
    assert failed and all(DIAGNOSIS[bug] in (s.note or "") for s in failed), failed


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_the_headline_names_each_planted_order_in_every_dtype(bug: str) -> None:
    """The verdict's first paragraph names the planted order alone, one group of the four dtypes'
    cells (in bfloat16 the looser tolerance also passes an ignored bias or ALiBi on a step: the
    name most cells share wins)."""
    result = _run(f"planted_{bug}", PLANTED[bug], ("float64", "float32", "float16", "bfloat16"))
    assert [c.status for c in result.cells] == ["FAIL"] * 4
    headline = " ".join(terminal.text(result).split("\n\n")[0].split())
    assert headline == f"FAIL: planted_{bug}: {DIAGNOSIS[bug]} (1 case)", headline
