"""The teaching commands fit the report's width: ``python -m conformance walkthrough`` and
``python -m conformance exercise`` print no line wider than ``--width`` (100 by default, never
wider than the terminal; a CJK character takes two columns), and wrapping never cuts a number.
"""

from __future__ import annotations

import re

import pytest

from conformance.__main__ import main
from conformance.reporting.textwidth import DEFAULT_WIDTH, MIN_WIDTH, columns
from conformance.running import backends
from conformance.teaching import exercises, walkthrough
from conformance.teaching.exercise_catalogue import EXERCISES

#: A number as the walkthrough prints it: 0.0613, -1.7589, 2.7e-08, 0.35.
NUMBER = re.compile(r"-?\d*\.\d+(?:e[-+]\d+)?")


def _too_wide(text: str, width: int) -> list[str]:
    return [line for line in text.split("\n") if columns(line) > width]


def test_the_walkthrough_fits_the_default_width_and_the_narrowest(capsys):
    """Every backend (a missing one is its install line); the default width from the command
    line, then ``MIN_WIDTH``: the same numbers, none cut, the tables in panels of columns."""
    main(["walkthrough"])  # stdout is no terminal here: DEFAULT_WIDTH
    wide = capsys.readouterr().out
    lines, _ = walkthrough.walkthrough(list(backends.SPEC_BACKENDS), MIN_WIDTH)
    narrow = "\n".join(lines)
    assert not _too_wide(wide, DEFAULT_WIDTH)
    assert not _too_wide(narrow, MIN_WIDTH)
    assert "0. 句子与字典 · the sentence, the dictionary, the token ids" in wide
    assert sorted(NUMBER.findall(narrow)) == sorted(NUMBER.findall(wide))  # no number cut
    assert "columns 1–2 of 6" in narrow and "columns 1–" not in wide


@pytest.mark.slow  # every exercise graded twice in a fresh interpreter
@pytest.mark.parametrize("width", [DEFAULT_WIDTH, MIN_WIDTH])
def test_exercise_feedback_fits_the_width(width):
    """Every exercise, its solution (a pass) and its stub (a fail: not written yet, or the
    diagnosis the stub is written to show, with its worst element and hint)."""
    shown = set()
    for ex in EXERCISES:
        for solution in (True, False):
            verdict = exercises.grade(ex.number, "numpy",
                                      exercises.stub_path(ex, "numpy", solution))
            assert verdict.passed == solution
            text = verdict.text(width)
            assert not _too_wide(text, width), text
            shown |= {line.split(":")[0].strip() for line in text.split("\n")}
    assert {"PASS", "FAIL", "hint", "worst at [1, 2, 0]"} <= shown
    assert not _too_wide(exercises.listing(width), width)


@pytest.mark.slow
def test_the_exercise_command_fits_its_width(capsys):
    """The command (grading in a child process): ``--width``, and the default width."""
    assert main(["exercise", "7", "--backend", "numpy", "--width", "60"]) == 1
    failed = capsys.readouterr().out
    assert "FAIL: a fully masked row gives NaN" in failed and not _too_wide(failed, 60)
    solution = str(exercises.stub_path(EXERCISES[5], "numpy", solution=True))
    assert main(["exercise", "6", "--backend", "numpy", "--file", solution]) == 0
    passed = capsys.readouterr().out
    assert "PASS" in passed and not _too_wide(passed, DEFAULT_WIDTH)
