"""The exercise grader cannot be fooled: adversarial learner files (``learn/``'s grader).

A softmax that overflows on rows spanning ±1000 fails exercise 3 with its mistake named; a
missing √d_k is named in the exercises past 2; a file that calls the project's own attention,
reads the expected values from the grader's frames or writes the grader's files does not pass,
and a malformed answer is a verdict, never a traceback. Each grades in a child process (the
grader's own way), so the tests are ``slow``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from subprocesses import timeout

from conformance.teaching import exercises

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

_SOFTMAX = "import numpy as np\n\n\ndef softmax(s):\n    {body}\n"
#: Wrong softmaxes that pass rows near ±1000 spanning only a few units: name → (body, diagnosis).
WRONG_SOFTMAX = {
    "row mean": ("e = np.exp(s - s.mean(-1, keepdims=True))\n"
                 "    return e / e.sum(-1, keepdims=True)", "shift_mean"),
    "row min": ("e = np.exp(s - s.min(-1, keepdims=True))\n"
                "    return e / e.sum(-1, keepdims=True)", "shift_min"),
    "first element": ("e = np.exp(s - s[..., :1])\n    return e / e.sum(-1, keepdims=True)",
                      "shift_first"),
    "float64 row mean": ("x = s.astype(np.float64)\n"
                         "    e = np.exp(x - x.mean(-1, keepdims=True))\n"
                         "    return (e / e.sum(-1, keepdims=True)).astype(np.float32)",
                         "shift_mean"),
    "float64, mean, clip": ("x = s.astype(np.float64)\n"
                            "    e = np.exp(np.clip(x - x.mean(-1, keepdims=True), -700, 700))\n"
                            "    return (e / e.sum(-1, keepdims=True)).astype(np.float32)",
                            "spanning"),
    "float64, first, clip": ("x = s.astype(np.float64)\n"
                             "    e = np.exp(np.clip(x - x[..., :1], -700, 700))\n"
                             "    return (e / e.sum(-1, keepdims=True)).astype(np.float32)",
                             "spanning"),
}


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name.replace(' ', '_').replace(',', '')}.py"
    path.write_text(text, encoding="utf-8")
    return path


def _grade(number: int, path: Path, backend: str = "numpy") -> exercises.Verdict:
    return exercises.run_isolated(number, backend, path, timeout(120))


@pytest.mark.parametrize("name", WRONG_SOFTMAX)
def test_a_softmax_that_overflows_on_a_wide_row_fails_with_its_mistake_named(name, tmp_path):
    body, diagnosis = WRONG_SOFTMAX[name]
    verdict = _grade(3, _write(tmp_path, name, _SOFTMAX.format(body=body)))
    assert not verdict.passed, verdict.text()
    assert verdict.diagnosis == diagnosis, verdict.text()
    assert "−1000 … 1000" in verdict.check and verdict.hint, verdict.text()


def test_the_real_softmax_passes_the_wide_rows():
    solution = exercises.stub_path(exercises.exercise(3), "numpy", solution=True)
    verdict = _grade(3, solution)
    assert verdict.passed and len(verdict.passed_checks) == 4, verdict.text()


def test_padded_attention_without_the_scale_is_named(tmp_path):
    ex = exercises.exercise(7)
    text = exercises.stub_path(ex, "numpy", solution=True).read_text(encoding="utf-8")
    assert " / math.sqrt(query.shape[-1])" in text
    verdict = _grade(7, _write(tmp_path, "unscaled", text.replace(
        " / math.sqrt(query.shape[-1])", "")))
    assert verdict.diagnosis == "no_scale", verdict.text()
    assert "FAIL: you forgot the scale" in verdict.text()


CALLS_THE_LIBRARY = f"""import sys
sys.path.insert(0, {str(ROOT)!r})
from numpy_attn.functional import scaled_dot_product_attention


def padded_attention(query, key, value, mask):
    return scaled_dot_product_attention(query, key, value, attn_mask=mask)
"""

READS_THE_GRADERS_FRAMES = """import sys


def context_vectors(weights, values):
    frame = sys._getframe(1)
    while frame is not None:
        check = frame.f_locals.get("check")
        if check is not None and hasattr(check, "expected"):
            return check.expected.astype("float32")
        frame = frame.f_back
    return None
"""

#: Files that write what the grader reads (any file beside the paths the child was given).
_WRITES = """import atexit, os, sys


def context_vectors(weights, values):
    return weights @ values + 1


def _write():
    folders = {{os.path.dirname(os.path.abspath(a)) for a in sys.argv[1:]}}
    for folder in folders:
        targets = [os.path.join(folder, n) for n in os.listdir(folder)] + sys.argv[1:]
        for target in targets:
            with open(target, "w") as f:
                f.write({content!r})


atexit.register(_write)
"""
WRITES_A_VERDICT = _WRITES.format(content='{"exercise": 4, "backend": "numpy", "file": "x", '
                                  '"passed": true, "diagnosis": "ok", "load": null, '
                                  '"checks": []}')
WRITES_GARBAGE = _WRITES.format(content="not json {")


def test_a_file_that_calls_the_projects_attention_fails_with_library(tmp_path):
    verdict = _grade(7, _write(tmp_path, "library", CALLS_THE_LIBRARY))
    assert not verdict.passed and verdict.diagnosis == "library", verdict.text()
    assert "imports numpy_attn" in verdict.text() and "write the math" in verdict.text()


def test_a_file_cannot_read_the_expected_values_from_the_graders_frames(tmp_path):
    verdict = _grade(4, _write(tmp_path, "frames", READS_THE_GRADERS_FRAMES))
    assert not verdict.passed, verdict.text()


@pytest.mark.parametrize("text", [WRITES_A_VERDICT, WRITES_GARBAGE], ids=["verdict", "garbage"])
def test_a_file_that_writes_the_graders_files_gets_a_verdict_not_a_pass(text, tmp_path):
    verdict = _grade(4, _write(tmp_path, "writes", text))
    assert not verdict.passed and verdict.diagnosis == "malformed", verdict.text()
    assert "could not be read" in verdict.text()


def test_a_child_that_ends_without_an_answer_is_a_verdict(tmp_path):
    text = "import os\n\n\ndef context_vectors(w, v):\n    os._exit(0)\n"
    verdict = _grade(4, _write(tmp_path, "exits", text))
    assert not verdict.passed and verdict.diagnosis == "crashed", verdict.text()


#: Exercise 11's answer with one classic mistake planted, the same edit in every backend's
#: solution: the mistake's key → (text of the answer, its replacement).
ROPE_PLANTED = {
    "interleaved": ("x[..., :half], x[..., half:rotary_dim]",
                    "x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]"),
    "backwards": ("x1 * cos - x2 * sin, x2 * cos + x1 * sin",
                  "x1 * cos + x2 * sin, x2 * cos - x1 * sin"),
    "off_by_one": ("* inv_freq  # (..., 1, seq, r/2)", "* inv_freq + inv_freq"),
    "all_dims": ("half = rotary_dim // 2", "rotary_dim = x.shape[-1]\n    half = rotary_dim // 2"),
    "exponent_head_dim": ("2.0 / rotary_dim", "2.0 / x.shape[-1]"),
}


@pytest.mark.parametrize("backend", ["numpy", "jax", "torch"])
def test_the_rope_exercises_mistakes_are_named_in_every_backend(backend, tmp_path):
    """The layout swapped (pairs (2i, 2i+1), written back as halves as transformers'
    DeepSeek-V3 apply_rotary_pos_emb_interleave does), the sine's sign flipped, positions off
    by one, every dim rotated and the exponent over head_dim: each named, in a child process."""
    pytest.importorskip(backend)
    ex = exercises.exercise("rope")
    text = exercises.stub_path(ex, backend, solution=True).read_text(encoding="utf-8")
    for key, (old, new) in ROPE_PLANTED.items():
        assert old in text, (backend, old)
        verdict = _grade(11, _write(tmp_path, f"{backend}_{key}", text.replace(old, new)),
                         backend)
        assert not verdict.passed and verdict.diagnosis == key, verdict.text()
        says = next(m.says for m in ex.mistakes if m.key == key)
        assert f"FAIL: {says.split(':')[0]}" in verdict.text() and verdict.hint, verdict.text()


#: Exercise 12's answer with one classic mistake planted, the same edits in every backend's
#: solution: the mistake's key → [(text of the answer, its replacement), …].
ABSORB_PLANTED = {
    "uk_not_folded": [("q_nope @ w_uk.mT  #", "q_nope  #")],
    "uk_transposed": [("q_nope @ w_uk.mT", "q_nope @ w_uk")],
    "uv_forgotten": [("return context_latent @ w_uv", "return context_latent")],
    "uv_transposed": [("return context_latent @ w_uv", "return context_latent @ w_uv.mT")],
    "swapped": [("q_nope @ w_uk.mT", "q_nope @ w_uv.mT"),
                ("return context_latent @ w_uv", "return context_latent @ w_uk")],
    # sdpa's default scale over the absorbed query: right in the square toy, named on check 2
    "latent_scale": [("q_nope.shape[-1] + q_pe.shape[-1]", "latent.shape[-1] + q_pe.shape[-1]")],
    "one_head": [("return context_latent @ w_uv", "return context_latent @ w_uv[:1]")],
}


@pytest.mark.parametrize("backend", ["numpy", "jax", "torch"])
def test_the_absorb_exercises_mistakes_are_named_in_every_backend(backend, tmp_path):
    """W_UK not folded or transposed, W_UV forgotten or transposed, the two swapped, the
    absorbed key's width as the softmax scale, one head's W_UV for every head: each named, in
    a child process; the scale mistake passes the square toy (where r + d_r = d_n + d_r) and
    is named on the next check."""
    pytest.importorskip(backend)
    ex = exercises.exercise("absorb")
    text = exercises.stub_path(ex, backend, solution=True).read_text(encoding="utf-8")
    for key, edits in ABSORB_PLANTED.items():
        planted = text
        for old, new in edits:
            assert planted.count(old) == 1, (backend, old)
            planted = planted.replace(old, new)
        verdict = _grade(12, _write(tmp_path, f"{backend}_{key}", planted), backend)
        assert not verdict.passed and verdict.diagnosis == key, verdict.text()
        says = next(m.says for m in ex.mistakes if m.key == key)
        assert f"FAIL: {says.split(':')[0]}" in verdict.text() and verdict.hint, verdict.text()
        first = ex.checks[0].name
        assert (first in verdict.passed_checks) == (key == "latent_scale"), verdict.text()
