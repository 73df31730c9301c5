"""``--json FILE``: the report as JSON (``to_dict``: every cell and step, the baselines, bad
inputs, property checks, the missing packages and the summary line; ``inf`` as "inf", NaN as
null).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from .. import spec
from ..comparing.results import RunResult
from .sections import peer_counts, summary


def _jsonable(x: Any) -> Any:
    if isinstance(x, float):
        return None if math.isnan(x) else ("inf" if math.isinf(x) else x)
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (np.integer, np.floating)):
        return _jsonable(x.item())
    return x


def to_dict(result: RunResult) -> dict[str, Any]:
    """The full report as plain data."""
    return _jsonable({
        "ok": result.ok,
        "seconds": result.seconds,
        "columns": [{"name": c.name, "kind": c.kind} for c in result.columns],
        "peers": {c.name: peer_counts([x for x in result.cells if x.column == c.name])
                  for c in result.columns if c.kind == "peer"},
        "plugins": {c.name: {"layout": c.backend.contract.layout,
                             "unsupported": sorted(c.backend.contract.unsupported),
                             "not_provided": list(c.backend.contract.not_provided)}
                    for c in result.columns
                    if c.backend is not None and c.backend.contract is not None},
        "missing": result.missing,
        "notes": result.notes,
        "tolerances": spec.TOLERANCES,
        "cells": [{
            "case": c.case, "dtype": c.dtype, "column": c.column, "status": c.status,
            "ratio": c.ratio, "detail": c.detail, "spec_backend": c.spec_backend,
            "rerun": c.rerun, "skipped": list(c.skipped), "features": sorted(c.features),
            "alternatives": list(c.alternatives), "alternative_ratio": c.alternative_ratio,
            "steps": [{
                "step": s.step, "ratio": s.ratio, "passed": s.passed,
                "index": list(s.index) if s.index is not None else None,
                "actual": s.actual, "expected": s.expected, "tolerance": s.bound,
                "note": s.note, "error": s.error,
            } for s in c.steps],
        } for c in result.cells],
        "baseline_errors": {f"{case}/{dtype}": exp.baseline
                            for (case, dtype), exp in result.expectations.items()},
        "errors": [vars(e) for e in result.errors],
        "properties": result.properties.to_dict() if result.properties is not None else None,
        "summary": summary(result),
    })


def write_json(result: RunResult, path: str | Path) -> None:
    """``--json FILE``."""
    Path(path).write_text(json.dumps(to_dict(result), indent=1) + "\n")


__all__ = ["to_dict", "write_json"]
