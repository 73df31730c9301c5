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
