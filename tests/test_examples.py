"""The examples run, and say what they claim."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_curves_coincide_across_backends():
    train = _load("train_reverse")
    curves = train.run(steps=25)
    reference = np.array(curves["numpy_attn"])
    assert reference[-1] < 0.8 * reference[0], "the NumPy backward must make the loss fall"
    for name, curve in curves.items():
        np.testing.assert_allclose(curve, reference, rtol=1e-9, err_msg=name)


def test_wrong_attention_fails_exactly_the_cases_its_readme_names():
    """examples/README.md: FAIL on every case with a mask and every bottom-right case."""
    from conformance import cases, runner

    result = runner.run(["examples.wrong_attention"], None, ["float32"], peers=False,
                        check_errors=False, hypothesis=0)
    failed = {cell.case for cell in result.cells if cell.status != "ok"}
    sdpa = [case for case in cases.CASES if case.kind == "sdpa"]
    with_mask = {case.name for case in sdpa if "mask" in case.data().arrays}
    bottom_right = {case.name for case in sdpa
                    if case.data().options.get("causal_alignment") == "bottom_right"}
    assert failed == with_mask | bottom_right
    details = " ".join(cell.detail for cell in result.cells)
    assert "mask polarity flipped" in details and "wrong causal alignment" in details
