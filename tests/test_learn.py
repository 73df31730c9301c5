"""``learn/``: the graded exercises, their grader (``python -m conformance exercise``) and the
"read the code" page.

Every solution passes in every installed backend; every untouched stub fails with the diagnosis
it is written to show; every mistake the grader knows is recognised when planted (NumPy, and
the flipped mask and the missing scale in every backend); a learner's file is untrusted input;
the grader's expected values agree with the article's printed numbers and with a finite
difference. Shapes are the exercises' own (small), so JAX compiles only a few dozen tiny ops.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from conformance.__main__ import main
from conformance.spec import seed_example
from conformance.teaching import exercises
from conformance.teaching.exercise_catalogue import EXERCISES

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = [b for b in exercises.BACKENDS if importlib.util.find_spec(b) is not None]

#: The diagnosis each untouched stub shows; the others raise NotImplementedError.
STUB_SHOWS = {2: "no_scale", 3: "overflow", 7: "nan_rows"}

#: One mistaken NumPy answer for every mistake the grader knows: (exercise, key) → body.
_SOFTMAX = "e = np.exp(m - m.max(-1, keepdims=True))\n    return e / e.sum(-1, keepdims=True)"
_ATTEND = _SOFTMAX + " @ v"  # softmax(m) @ v
_SCORES = "s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])\n    "
_HEADS = ("q, k, v = x @ wq, x @ wk, x @ wv\n"
          "    def split(y):\n        {split}\n"
          "    q, k, v = split(q), split(k), split(v)\n"
          "    m = q @ np.swapaxes(k, -1, -2) / math.sqrt({width})\n"
          "    e = np.exp(m - m.max(-1, keepdims=True))\n"
          "    o = e / e.sum(-1, keepdims=True) @ v\n    {merge}")
_RIGHT_SPLIT = "return np.swapaxes(y.reshape(y.shape[:-1] + (h, -1)), -2, -3)"
_RIGHT_MERGE = "return np.swapaxes(o, -2, -3).reshape(o.shape[:-3] + (o.shape[-2], -1))"
MISTAKES = {
    (1, "transposed"): ("attention_scores(q, k)", "return k @ np.swapaxes(q, -1, -2)"),
    (1, "scaled"): ("attention_scores(q, k)", _SCORES + "return s"),
    (2, "divided_by_d"): ("scaled_scores(q, k)", "return q @ np.swapaxes(k, -1, -2) / q.shape[-1]"),
    (2, "times_sqrt_d"): ("scaled_scores(q, k)",
                          "return q @ np.swapaxes(k, -1, -2) * math.sqrt(q.shape[-1])"),
    (2, "sequence_length"): ("scaled_scores(q, k)",
                             "return q @ np.swapaxes(k, -1, -2) / math.sqrt(k.shape[-2])"),
    (3, "shift_mean"): ("softmax(m)", _SOFTMAX.replace("m.max(-1, keepdims=True)",
                                                       "m.mean(-1, keepdims=True)")),
    (3, "shift_min"): ("softmax(m)", _SOFTMAX.replace("m.max(-1, keepdims=True)",
                                                      "m.min(-1, keepdims=True)")),
    (3, "shift_first"): ("softmax(m)", _SOFTMAX.replace("m.max(-1, keepdims=True)", "m[..., :1]")),
    (3, "global_max"): ("softmax(m)", _SOFTMAX.replace("m.max(-1, keepdims=True)", "m.max()")),
    (3, "wrong_axis"): ("softmax(m)", _SOFTMAX.replace("-1", "-2")),
    (3, "no_keepdims"): ("softmax(m)", _SOFTMAX.replace("e.sum(-1, keepdims=True)", "e.sum(-1)")),
    (3, "whole_array"): ("softmax(m)", _SOFTMAX.replace("(-1, keepdims=True)", "()")),
    (4, "transposed_weights"): ("context_vectors(w, v)", "return np.swapaxes(w, -1, -2) @ v"),
    (5, "flipped"): ("causal_weights_renormalised(w)",
                     "m = w * np.triu(np.ones(w.shape[-2:]), 1)\n    return m / m.sum(-1, "
                     "keepdims=True)"),
    (5, "diagonal_hidden"): ("causal_weights_renormalised(w)",
                             "m = w * np.tril(np.ones(w.shape[-2:]), -1)\n    return m / "
                             "m.sum(-1, keepdims=True)"),
    (5, "no_mask"): ("causal_weights_renormalised(w)", "return w / w.sum(-1, keepdims=True)"),
    (5, "not_renormalised"): ("causal_weights_renormalised(w)",
                              "return w * np.tril(np.ones(w.shape[-2:]))"),
    (5, "no_keepdims"): ("causal_weights_renormalised(w)",
                         "m = w * np.tril(np.ones(w.shape[-2:]))\n    return m / m.sum(-1)"),
    (6, "flipped"): ("causal_attention_weights(s)",
                     "m = np.where(np.tril(np.ones(s.shape[-2:], bool)), -np.inf, s)\n    "
                     + _SOFTMAX),
    (6, "diagonal_hidden"): ("causal_attention_weights(s)",
                             "m = np.where(np.triu(np.ones(s.shape[-2:], bool)), -np.inf, s)\n"
                             "    " + _SOFTMAX),
    (6, "no_mask"): ("causal_attention_weights(s)", "m = s\n    " + _SOFTMAX),
    (6, "zero_fill"): ("causal_attention_weights(s)",
                       "m = np.where(np.triu(np.ones(s.shape[-2:], bool), 1), 0.0, s)\n    "
                       + _SOFTMAX),
    (6, "after_softmax"): ("causal_attention_weights(s)",
                           "m = s\n    e = np.exp(m - m.max(-1, keepdims=True))\n    return "
                           "e / e.sum(-1, keepdims=True) * np.tril(np.ones(s.shape[-2:]))"),
    (7, "flipped"): ("padded_attention(q, k, v, mask)",
                     _SCORES + "m = np.where(mask, -np.inf, s)\n    r = m.max(-1, keepdims=True)"
                     "\n    e = np.exp(m - np.where(r == -np.inf, 0, r))\n    t = e.sum(-1, "
                     "keepdims=True)\n    return e / np.where(t == 0, 1, t) @ v"),
    (7, "no_scale"): ("padded_attention(q, k, v, mask)",
                      "s = q @ np.swapaxes(k, -1, -2)\n    m = np.where(mask, s, -np.inf)\n"
                      "    r = m.max(-1, keepdims=True)\n    e = np.exp(m - np.where(r == -np.inf"
                      ", 0, r))\n    t = e.sum(-1, keepdims=True)\n    return e / np.where(t == "
                      "0, 1, t) @ v"),
    (7, "ignored"): ("padded_attention(q, k, v, mask)", _SCORES + "m = s\n    " + _ATTEND),
    (7, "mean_of_value"): ("padded_attention(q, k, v, mask)",
                           _SCORES + "m = np.where(mask, s, -1e9)\n    " + _ATTEND),
    (8, "no_scale"): ("multi_head_attention(x, wq, wk, wv, h)", _HEADS.format(
        split=_RIGHT_SPLIT, width="1", merge=_RIGHT_MERGE)),
    (8, "width_scale"): ("multi_head_attention(x, wq, wk, wv, h)", _HEADS.format(
        split=_RIGHT_SPLIT, width="q.shape[-1] * h", merge=_RIGHT_MERGE)),
    (8, "reshape_only"): ("multi_head_attention(x, wq, wk, wv, h)", _HEADS.format(
        split="return y.reshape(y.shape[:-2] + (h, y.shape[-2], -1))", width="q.shape[-1]",
        merge="return o.reshape(o.shape[:-3] + (o.shape[-2], -1))")),
    (8, "one_head"): ("multi_head_attention(x, wq, wk, wv, h)",
                      "q, k, v = x @ wq, x @ wk, x @ wv\n    " + _SCORES + "m = s\n    "
                      + _ATTEND),
    (9, "modulo"): ("grouped_query_attention(q, k, v)",
                    "r = [1] * k.ndim\n    r[-3] = q.shape[-3] // k.shape[-3]\n    k, v = "
                    "np.tile(k, r), np.tile(v, r)\n    " + _SCORES + "m = s\n    " + _ATTEND),
    (9, "no_scale"): ("grouped_query_attention(q, k, v)",
                      "g = q.shape[-3] // k.shape[-3]\n    k, v = np.repeat(k, g, -3), "
                      "np.repeat(v, g, -3)\n    m = q @ np.swapaxes(k, -1, -2)\n    " + _ATTEND),
    (10, "elementwise"): ("softmax_backward(w, g)", "return w * g"),
    (10, "identity"): ("softmax_backward(w, g)", "return g.copy()"),
    (10, "sign"): ("softmax_backward(w, g)", "return w * (g + (g * w).sum(-1, keepdims=True))"),
    (10, "wrong_axis"): ("softmax_backward(w, g)",
                         "return w * (g - (g * w).sum(-2, keepdims=True))"),
}
#: Exercise 11's answer (half layout), and one edit of it per mistake: key → (old, new).
_ROPE = ("h = r // 2\n"
         "    inv = 1.0 / theta ** (np.arange(h) * 2.0 / r)\n"
         "    a = np.asarray(p)[..., None, :, None] * inv\n"
         "    c, s = np.cos(a), np.sin(a)\n"
         "    x1, x2 = x[..., :h], x[..., h:r]\n"
         "    o = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)\n"
         "    return np.concatenate([o, x[..., r:]], -1)")
_ROPE_EDITS = {
    "interleaved": [("x[..., :h], x[..., h:r]", "x[..., 0:r:2], x[..., 1:r:2]"),
                    ("np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)",
                     "np.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).reshape(x[..., :r].shape)")],
    "backwards": [("x1 * c - x2 * s, x2 * c + x1 * s", "x1 * c + x2 * s, x2 * c - x1 * s")],
    "off_by_one": [("np.asarray(p)", "(np.asarray(p) + 1)")],
    "index": [("np.asarray(p)", "np.arange(x.shape[-2])")],
    "all_dims": [("h = r // 2", "r = x.shape[-1]\n    h = r // 2")],
    "exponent_head_dim": [("* 2.0 / r)", "* 2.0 / x.shape[-1])")],
    "no_minus": [("x1 * c - x2 * s", "x1 * c + x2 * s")],
}


def _rope_answer(edits: list[tuple[str, str]]) -> str:
    body = _ROPE
    for old, new in edits:
        assert old in body, old
        body = body.replace(old, new)
    return body


MISTAKES.update({(11, key): ("rotary_embedding(x, p, theta, r)", _rope_answer(edits))
                 for key, edits in _ROPE_EDITS.items()})
#: Exercise 12's answer (the absorbed form), and one edit of it per mistake: key → edits.
_ABSORB = ("ql = q @ np.swapaxes(wk, -1, -2)\n"
           "    c, kr = lat[..., None, :, :], kp[..., None, :, :]\n"
           "    s = (ql @ np.swapaxes(c, -1, -2) + qp @ np.swapaxes(kr, -1, -2))"
           " / math.sqrt(q.shape[-1] + qp.shape[-1])\n"
           "    e = np.exp(s - s.max(-1, keepdims=True))\n"
           "    return e / e.sum(-1, keepdims=True) @ c @ wv")
_ABSORB_EDITS = {
    "uk_not_folded": [("ql = q @ np.swapaxes(wk, -1, -2)", "ql = q")],
    "uk_transposed": [("ql = q @ np.swapaxes(wk, -1, -2)", "ql = q @ wk")],
    "uv_forgotten": [("@ c @ wv", "@ c")],
    "uv_transposed": [("@ c @ wv", "@ c @ np.swapaxes(wv, -1, -2)")],
    "swapped": [("np.swapaxes(wk, -1, -2)", "np.swapaxes(wv, -1, -2)"), ("@ c @ wv", "@ c @ wk")],
    "latent_scale": [("math.sqrt(q.shape[-1] + qp.shape[-1])", "math.sqrt(lat.shape[-1])")],
    "one_head": [("np.swapaxes(wk, -1, -2)", "np.swapaxes(wk[:1], -1, -2)")],
}


def _edited(body: str, edits: list[tuple[str, str]]) -> str:
    for old, new in edits:
        assert old in body, old
        body = body.replace(old, new)
    return body


MISTAKES.update({(12, key): ("absorbed_attention(q, qp, lat, kp, wk, wv)",
                             _edited(_ABSORB, edits))
                 for key, edits in _ABSORB_EDITS.items()})


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(text, encoding="utf-8")
    return path


def _numpy_answer(tmp_path: Path, number: int, key: str) -> Path:
    signature, body = MISTAKES[(number, key)]
    return _write(tmp_path, f"ex{number}_{key}",
                  f"import math\n\nimport numpy as np\n\n\ndef {signature}:\n    {body}\n")


@pytest.mark.parametrize("backend", [  # jax: every exercise's programs compiled
    pytest.param(name, marks=pytest.mark.slow) if name == "jax" else name
    for name in exercises.BACKENDS])
def test_every_solution_passes_and_every_stub_shows_its_diagnosis(backend):
    if backend not in INSTALLED:
        pytest.skip(f"{backend} not installed ({exercises.BACKENDS[backend]})")
    for ex in EXERCISES:
        solved = exercises.grade(ex.number, backend, exercises.stub_path(ex, backend, True),
                                 isolated=False)
        assert solved.passed and solved.passed_checks == [c.name for c in ex.checks], \
            solved.text()
        stub = exercises.grade(ex.number, backend, exercises.stub_path(ex, backend),
                               isolated=False)
        assert not stub.passed, stub.text()
        assert stub.diagnosis == STUB_SHOWS.get(ex.number, "not_implemented"), stub.text()
        text = exercises.stub_path(ex, backend).read_text(encoding="utf-8")
        assert f"python -m conformance exercise {ex.number} --backend {backend}" in text
        assert f"def {ex.function}(" in text


def test_every_known_mistake_is_recognised_when_planted(tmp_path):
    """Each entry of every exercise's mistake list is reachable, on the check that shows it."""
    known = {(ex.number, m.key) for ex in EXERCISES for m in ex.mistakes}
    assert known == set(MISTAKES) | set(STUB_SHOWS.items())  # the stubs show the other three
    for number, key in sorted(MISTAKES):
        verdict = exercises.grade(number, "numpy", _numpy_answer(tmp_path, number, key),
                                  isolated=False)
        assert not verdict.passed and verdict.diagnosis == key, verdict.text()
        assert verdict.hint and verdict.check and "worst at" in verdict.detail, verdict.text()


@pytest.mark.parametrize("backend", exercises.BACKENDS)
def test_a_flipped_mask_and_a_missing_scale_are_named_in_every_backend(backend, tmp_path):
    if backend not in INSTALLED:
        pytest.skip(f"{backend} not installed ({exercises.BACKENDS[backend]})")
    for number, wrong, right in ((7, "~mask", "mask"), (2, "", " / math.sqrt(queries.shape[-1])")):
        ex = exercises.exercise(number)
        text = exercises.stub_path(ex, backend, solution=True).read_text(encoding="utf-8")
        if number == 7:  # the answer with its where/masked_fill condition flipped
            flipped = {"numpy": ("np.where(mask,", "np.where(~mask,"),
                       "jax": ("jnp.where(mask,", "jnp.where(~mask,"),
                       "torch": ("masked_fill(~mask,", "masked_fill(mask,")}[backend]
            assert flipped[0] in text
            text = text.replace(*flipped)
        else:
            assert right in text
            text = text.replace(right, wrong)
        verdict = exercises.grade(number, backend, _write(tmp_path, f"{backend}{number}", text),
                                  isolated=False)
        assert verdict.diagnosis == ("flipped" if number == 7 else "no_scale"), verdict.text()
        assert ("flipped the mask" if number == 7 else "forgot the scale") in verdict.text()


UNTRUSTED = {  # exercise 4, context_vectors(w, v): name → (file, diagnosis, words of the verdict)
    "syntax": ("def context_vectors(w, v)\n    return w @ v\n", "exception", "SyntaxError"),
    "import": ("import not_a_module_anywhere\n", "exception", "pip install not_a_module"),
    "raises": ("def context_vectors(w, v):\n    return w[99]\n", "exception",
               "line 2: return w[99]"),
    "exit": ("import sys\nsys.exit(3)\n", "exception", "SystemExit"),
    "none": ("def context_vectors(w, v):\n    w @ v\n", "none", "forget `return`"),
    "tuple": ("def context_vectors(w, v):\n    return w, v\n", "type", "returned a tuple"),
    "list": ("def context_vectors(w, v):\n    return (w @ v).tolist()\n", "type",
             "returned a list"),
    "shape": ("def context_vectors(w, v):\n    return (w @ v)[..., :2]\n", "shape",
              "returned shape (6, 2), expected (6, 4)"),
    "transposed": ("def context_vectors(w, v):\n    return (w @ v).swapaxes(-1, -2)\n", "shape",
                   "the transpose of the expected one"),
    "bools": ("def context_vectors(w, v):\n    return w @ v > 0\n", "dtype", "bool values"),
    "nan": ("import numpy as np\n\ndef context_vectors(w, v):\n    return w @ v * np.nan\n",
            "nan", "NaN or inf where the answer is finite"),
    "wrong": ("def context_vectors(w, v):\n    return w @ v + 1\n", "values", "FAIL: wrong values"),
    "missing": ("def context_vector(w, v):\n    return w @ v\n", "missing_function",
                "defines no function context_vectors"),
}


def test_a_learners_file_is_untrusted_input(tmp_path):
    """Every failure of the file itself is a verdict with its reason, never an exception."""
    for name, (text, diagnosis, says) in UNTRUSTED.items():
        verdict = exercises.grade("context", "numpy", _write(tmp_path, name, text),
                                  isolated=False)
        assert not verdict.passed and verdict.diagnosis == diagnosis, (name, verdict.text())
        assert says in verdict.text(), (name, verdict.text())
    if "jax" in INSTALLED:  # NumPy inside a JAX exercise: works eagerly, fails under jax.jit
        numpy_in_jax = _write(tmp_path, "np_in_jax", "import numpy as np\n\ndef softmax(s):\n"
                              "    e = np.exp(s - np.max(s, -1, keepdims=True))\n"
                              "    return e / e.sum(-1, keepdims=True)\n")
        verdict = exercises.grade("softmax", "jax", numpy_in_jax, isolated=False)
        assert verdict.diagnosis == "type" and "jax.numpy, not numpy" in verdict.text()


@pytest.mark.slow
def test_the_command_grades_in_a_child_process_with_a_time_limit(tmp_path, capsys):
    assert main(["exercise", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(f"{ex.function}()" in listed for ex in EXERCISES)
    solution = str(exercises.stub_path(EXERCISES[2], "numpy", solution=True))
    assert main(["exercise", "3", "--backend", "numpy", "--file", solution]) == 0
    assert "PASS: softmax matches the float64 reference on every check (4)" in \
        capsys.readouterr().out
    endless = _write(tmp_path, "endless", "def softmax(s):\n    while True:\n        pass\n")
    assert main(["exercise", "softmax", "--file", str(endless), "--timeout", "1"]) == 1
    assert "grading stopped after 1 s" in capsys.readouterr().out
    for argv, error in ((["exercise", "13"], "unknown exercise '13'"),
                        (["exercise", "3", "--file", str(tmp_path / "nope.py")], "no such file"),
                        (["exercise"], "give its number")):
        assert main(argv) == 2
        assert error in capsys.readouterr().err


def test_a_missing_framework_is_one_line_with_its_install_command(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    assert main(["exercise", "1", "--backend", "torch"]) == 2
    assert "needs torch; install: pip install torch==2.13.0" in capsys.readouterr().err


def test_the_graders_expected_values_are_the_articles_printed_numbers():
    """The checks built from the article give what it prints (4 decimals), computed
    independently of the grader's pipeline by the article's own code."""
    printed = seed_example.ARTICLE
    first = {ex.number: ex.checks[0].expected for ex in EXERCISES}
    atol = seed_example.PRINTED_ATOL
    np.testing.assert_allclose(first[1], printed["attn_scores"], atol=atol)
    np.testing.assert_allclose(first[3], printed["attn_weights"], atol=atol)
    np.testing.assert_allclose(first[4], printed["self_attention"], atol=atol)
    np.testing.assert_allclose(exercises.exercise(4).checks[1].expected,
                               printed["cross_attention"], atol=atol)
    np.testing.assert_allclose(first[5], printed["causal_weights"], atol=atol)
    np.testing.assert_allclose(first[6], printed["causal_weights"], atol=atol)
    np.testing.assert_allclose(first[8], printed["multi_head_wrapper"], atol=atol)


def test_the_softmax_gradient_check_agrees_with_a_finite_difference():
    for check in exercises.exercise("softmax_backward").checks:
        w, g = (a.astype(np.float64) for a in check.args)
        scores = np.log(np.where(w > 0, w, 1.0))  # softmax(scores) = w where w > 0
        allowed = w > 0

        def loss(s, scores=scores, g=g, allowed=allowed):
            e = np.where(allowed, np.exp(s - s.max(-1, keepdims=True)), 0.0)
            return float((g * e / e.sum(-1, keepdims=True)).sum())

        numeric = np.zeros_like(scores)
        for index in np.ndindex(scores.shape):
            step = np.zeros_like(scores)
            step[index] = 1e-6
            numeric[index] = (loss(scores + step) - loss(scores - step)) / 2e-6
        np.testing.assert_allclose(check.expected, np.where(allowed, numeric, 0.0), atol=1e-8)


def test_read_the_code_quotes_the_source_as_it_is():
    """Each quoted block of docs/read_the_code.md names its file and is a verbatim excerpt."""
    page = (ROOT / "docs" / "read_the_code.md").read_text(encoding="utf-8")
    quotes = re.findall(r"`([\w/]+\.py)`[^\n]*:\n\n```python\n(.*?)```", page, re.S)
    files = {path for path, _ in quotes}
    assert {"examples/sdpa_only.py", "numpy_attn/_steps.py", "jax_attn/_steps.py",
            "torch_attn/_steps.py"} <= files
    assert len(quotes) >= 7
    for path, block in quotes:
        assert block in (ROOT / path).read_text(encoding="utf-8"), f"{path} no longer has:\n{block}"
    table = page.split("| step | NumPy | JAX | PyTorch |")[1].split("\n\n")[0]
    rows = [row.split(" | ")[1:] for row in table.splitlines()[2:]]
    assert len(rows) >= 6
    for row in rows:  # the side-by-side table: each cell's code is in that backend's rooms
        for backend, cell in zip(("numpy_attn", "jax_attn", "torch_attn"), row, strict=True):
            source = "".join(path.read_text(encoding="utf-8")
                             for path in sorted((ROOT / backend).glob("_*.py")))
            for code in re.findall(r"`([^`]+)`", cell):
                assert code in source, f"{backend}'s private rooms no longer have {code!r}"


def test_every_exercise_has_a_stub_and_a_solution_per_backend():
    for folder in exercises.BACKENDS:
        stubs = sorted(p.name for p in (ROOT / "learn" / folder).glob("*.py"))
        solutions = sorted(p.name for p in (ROOT / "learn" / "solutions" / folder).glob("*.py"))
        assert stubs == solutions == [f"{ex.stem}.py" for ex in EXERCISES]


def test_the_rope_checks_are_the_rotation_and_position_zero_alone_cannot_pass(tmp_path):
    """Exercise 11's expected values are the rotation written as complex numbers here (each
    pair ``x[i] + i·x[i + r/2]`` times ``e^{i·p·θ^(−2i/r)}``) and numpy_attn's
    ``rotary_embedding`` in float64; every check has tokens past position 0, where a turn by 0
    hides every layout and direction: an answer that does not rotate at all fails."""
    import numpy_attn

    ex = exercises.exercise("rope")
    for check in ex.checks:
        x, positions, theta, r = check.args
        x = x.astype(np.float64)
        half = r // 2
        turn = np.exp(1j * positions[..., None, :, None] * theta ** (-2.0 * np.arange(half) / r))
        z = (x[..., :half] + 1j * x[..., half:r]) * turn
        complex_form = np.concatenate([z.real, z.imag, x[..., r:]], axis=-1)
        np.testing.assert_allclose(check.expected, complex_form, rtol=0, atol=1e-12)
        library = numpy_attn.rotary_embedding(x, positions, theta=theta, rotary_dim=r)
        np.testing.assert_allclose(check.expected, library, rtol=0, atol=1e-12)
        assert (positions != 0).sum() >= positions.size // 2, check.name
    still = exercises.grade("rope", "numpy", _write(
        tmp_path, "no_turn", "def rotary_embedding(x, p, theta, r):\n    return x.copy()\n"),
        isolated=False)
    assert not still.passed and still.check == ex.checks[0].name, still.text()
    first = ex.checks[0]  # positions 0 … 5: the layouts and directions agree at 0 only
    for key in ("interleaved", "backwards", "no_minus"):
        mistake = next(m for m in ex.mistakes if m.key == key)
        wrong = mistake.compute(*first.args)[0]
        np.testing.assert_array_equal(wrong[..., 0, :], first.expected[..., 0, :])
        assert np.abs(wrong[..., 1:, :] - first.expected[..., 1:, :]).max() > 0.1, key



def test_the_absorb_checks_are_the_projects_mla_on_its_own_weights():
    """Exercise 12's expected value (``naive64``: K and V materialised, float64) is what
    numpy_attn's ``MultiHeadLatentAttention`` computes, naive and absorbed, when the exercise's
    inputs are read off the module: its projections' q_nope, q_pe, latent and k_pe, and
    ``w_uk``, ``w_uv`` cut from ``kv_b_proj.weight`` as the stubs say (transformers' layout, head
    h's rows ``[w_uk[h]ᵀ ; w_uv[h]ᵀ]``), then ``o_proj``. On every check, the expected value
    is also numpy_attn's ``scaled_dot_product_attention`` over the latent as one kv head (the
    absorbed form as MQA: keys ``[c ; k_pe]``, values their first kv_lora_rank dims)."""
    import numpy_attn
    from conformance.teaching.exercise_catalogue_absorb import naive64

    heads, r, d_n, d_r, d_v, d_model, seq = 4, 16, 8, 4, 6, 32, 5
    mla = numpy_attn.MultiHeadLatentAttention(
        d_model, heads, kv_lora_rank=r, qk_nope_head_dim=d_n, qk_rope_head_dim=d_r,
        v_head_dim=d_v, rng=np.random.default_rng(12))
    weights = {n: w.astype(np.float64) for n, w in mla.export_weights().items()}
    mla.load_weights(weights)
    x = np.random.default_rng(1).standard_normal((2, seq, d_model))
    stages = mla._stages(x, np.arange(seq))
    per_head = weights["kv_b_proj.weight"].reshape(heads, d_n + d_v, r)
    w_uk, w_uv = np.swapaxes(per_head[:, :d_n], -1, -2), np.swapaxes(per_head[:, d_n:], -1, -2)
    context = naive64(stages["q_nope"], stages["q_pe"], stages["c"][..., 0, :, :],
                      stages["k_pe"][..., 0, :, :], w_uk, w_uv)  # (2, heads, seq, d_v)
    out = np.swapaxes(context, -2, -3).reshape(2, seq, heads * d_v) @ weights["o_proj.weight"].T
    for absorbed in (False, True):
        np.testing.assert_allclose(mla.forward(x, absorbed=absorbed), out, rtol=0, atol=1e-12)
    for check in exercises.exercise("absorb").checks:
        q_nope, q_pe, latent, k_pe, w_uk, w_uv = (a.astype(np.float64) for a in check.args)
        keys = np.concatenate([latent, k_pe], axis=-1)[..., None, :, :]  # one kv head
        query = np.concatenate([q_nope @ np.swapaxes(w_uk, -1, -2), q_pe], axis=-1)
        width = q_nope.shape[-1] + q_pe.shape[-1]
        context = numpy_attn.scaled_dot_product_attention(
            query, keys, keys[..., : latent.shape[-1]], scale=width ** -0.5)
        np.testing.assert_allclose(check.expected, context @ w_uv, rtol=0, atol=1e-12)
