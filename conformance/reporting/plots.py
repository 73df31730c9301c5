"""``--plot DIR``: the pictures of a run, as PNG files (matplotlib, imported on first use).

``write_plots(result, directory)`` draws one attention-weight heatmap per case (its first batch
and head, from the most precise dtype the run has) and one error-vs-dtype plot per column (the
worst error / tolerance of each compared step, on a log scale, with the tolerance line).
``--plot DIR`` and the HTML page's pictures (``html.pictures``) call it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ..comparing.results import RunResult


def write_plots(result: RunResult, directory: str | Path) -> list[Path]:
    """``--plot DIR``: attention-weight heatmaps per case, error-vs-dtype per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    order = ["float64", "float32", "bfloat16", "float16"]
    best: dict[str, Any] = {}
    for (case, dtype), exp in result.expectations.items():
        if "output_weights" in exp.values and (
                case not in best or order.index(dtype) < order.index(best[case].dtype)):
            best[case] = exp
    for case, exp in best.items():
        w = exp.values["output_weights"]
        w2 = w.reshape((-1,) + w.shape[-2:])[0]  # first batch and head
        fig, ax = plt.subplots(figsize=(4, 3.4))
        im = ax.imshow(w2, vmin=0, vmax=1, cmap="viridis")
        ax.set_title(f"{case}\nweights, first batch/head", fontsize=9)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        path = out / f"weights_{case}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    dtypes = sorted({c.dtype for c in result.cells}, key=order.index)
    for col in result.columns:
        fig, ax = plt.subplots(figsize=(5, 3.4))
        for step in ("scores", "masked_scores", "weights", "output", "output_weights"):
            ys = []
            for d in dtypes:
                vals = [s.ratio for c in result.cells if c.column == col.name and c.dtype == d
                        for s in c.steps if s.step == step and not s.error
                        and math.isfinite(s.ratio)]
                ys.append(max(vals) if vals else np.nan)
            if not all(np.isnan(ys)):
                ax.plot(dtypes, np.maximum(ys, 1e-6), marker="o", label=step)
        ax.axhline(1.0, color="red", linestyle="--", linewidth=1, label="tolerance")
        ax.set_yscale("log")
        ax.set_ylabel("worst error / tolerance")
        ax.set_title(f"{col.name}: error vs dtype (all cases)", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"errors_{col.name.replace('/', '_')}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written
