"""The HTML report's teaching panel: the seed article's example with each step's numbers.

``example()`` is the article's worked example (``docs/seed_article.md``: 6 tokens, the
embedding and ``W_query``/``W_key`` of ``spec.seed_example``) computed by the float64
reference (``conformance.cases.reference``), as plain data for the page: for every query and key
the unnormalised score ``ω = q·k``, the scaled score ``ω/√d_k`` and the softmax weight, and
the same for the causal weights (the −inf method: the masked score is ``"-inf"``). The page
draws both weight matrices and shows a cell's three numbers when the pointer is over it (or
the cell has the keyboard's focus), so a reader sees how each weight came to be.

Choices the issue leaves open: the panel is on every page, whatever the run checked (it is
the same 2 × 36 cells, about 4 kB); the values keep ``data.number``'s 6 significant digits;
tokens and queries are counted from 1 in the text, as the article counts them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...cases import reference
from ...spec import seed_example


def example(number: Callable[[float], Any]) -> dict[str, Any]:
    """``{"tokens": [6 words], "d_k": 2, "plain": {...}, "causal": {...}}``; each of ``plain``
    and ``causal`` holds ``title`` and three 6×6 matrices (query × key): ``scores`` (ω),
    ``scaled`` (ω/√d_k, ``"-inf"`` where the causal rule masks) and ``weights``, each value
    written by ``number`` (``data.number``: JSON-ready, ``-inf`` as a string)."""

    def _rounded(matrix: np.ndarray) -> list[list[Any]]:
        return [[number(v) for v in row] for row in matrix]

    x = np.array(seed_example.EMBEDDING, np.float64)  # (6, 3)
    w = {n: np.array(a, np.float64) for n, a in seed_example.self_attention_weights().items()}
    q, k, v = x @ w["W_query"], x @ w["W_key"], x @ w["W_value"]  # (6, 2), (6, 2), (6, 4)
    omega = reference.attention(q, k, v, scale=1.0).scores  # (6, 6): q·k, unscaled
    parts = {}
    for name, title, causal in (("plain", "softmax(ω / √2)", False),
                                ("causal", "causal: −inf above the diagonal, then softmax",
                                 True)):
        steps = reference.attention(q, k, v, is_causal=causal)  # scale d_k ** -0.5
        parts[name] = {"title": title, "scores": _rounded(omega),
                       "scaled": _rounded(steps.masked_scores),
                       "weights": _rounded(steps.weights)}
    return {"tokens": seed_example.SENTENCE.split(), "d_k": int(q.shape[-1]), **parts}


__all__ = ["example"]
