"""The examples run, and say what they claim."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_curves_coincide_across_backends():
    for framework, pin in (("jax", "jax"), ("torch", "torch==2.13.0")):
        pytest.importorskip(framework, reason=f"needs {framework}: pip install {pin}")
    train = _load("train_reverse")
    curves = train.run(steps=25)
    reference = np.array(curves["numpy_attn"])
    assert reference[-1] < 0.8 * reference[0], "the NumPy backward must make the loss fall"
    for name, curve in curves.items():
        np.testing.assert_allclose(curve, reference, rtol=1e-9, err_msg=name)


def test_the_trained_weights_are_the_reversal_and_plot_where_git_ignores_them(tmp_path):
    """``--plot-weights``: after training (NumPy, the hand-written backward) each head puts most
    of query i's weight on key T-1-i; before training no head does."""
    train = _load("train_reverse")
    initial = train.initial_weights()
    _, module = train.train_numpy_module(train.batches(120), initial)
    weights = train.attention_of(module)
    assert weights.shape == (train.HEADS, train.LENGTH, train.LENGTH)
    assert (train.anti_diagonal_share(weights) > 0.75).all(), train.anti_diagonal_share(weights)
    _, untrained = train.train_numpy_module([], initial)
    assert (train.anti_diagonal_share(train.attention_of(untrained)) < 0.4).all()
    defaults = train.parser().parse_args(["--plot", "--plot-weights"])
    ignored = (EXAMPLES.parent / ".gitignore").read_text(encoding="utf-8").splitlines()
    for path in (defaults.plot, defaults.plot_weights):
        assert path.parts[0] == "out" and "/out/" in ignored
    pytest.importorskip("matplotlib", reason="needs matplotlib: pip install matplotlib")
    train.plot_weights(weights, tmp_path / "nested" / "weights.png")
    assert (tmp_path / "nested" / "weights.png").read_bytes().startswith(b"\x89PNG")


#: examples/README.md: the cells where wrong_attention.py fails, in every dtype.
WRONG_ATTENTION_FAILS = {
    "mask polarity flipped": ("padding", "mask_and_bias", "fully_masked_rows", "kv_lengths",
                              "nan_key_masked",  # the NaN that spreads is a symptom of it
                              "sinks_gqa_kv_lengths", "sinks_fully_masked_rows",
                              "merge_empty_split_sinks_gqa", "merge_four_splits_huge",
                              "combined_masked_dropout", "combined_pairs_masked_dropout_top_left"),
    "wrong causal alignment": ("causal_bottom_right", "causal_bottom_right_q_longer",
                               "window_causal_bottom_right", "single_query_causal",
                               "sinks_bottom_right_q_longer", "chunked_causal_bottom_right",
                               "alibi_causal_bottom_right", "segment_ids_bottom_right",
                               "combined_order_of_steps"),
}
#: examples/README.md: the cells with a mask and a bottom-right causal rule fail with both bugs
#: at once, which no diagnosis (each tries one bug) names.
WRONG_ATTENTION_FAILS_UNNAMED = ("combined_pairs_masked_dropout_bottom_right",)


@pytest.mark.slow
def test_wrong_attention_fails_exactly_the_cells_its_readme_names():
    """Every other cell (case × dtype) passes, so an unrelated failure breaks this test."""
    from conformance.running import backends, runner

    result = runner.run(["examples.wrong_attention"], None, None, peers=False,
                        check_errors=True, hypothesis=0, profile="full")
    failed = {(c.case, c.dtype) for c in result.cells if c.status != "ok"}
    expected = {(case, dtype)
                for cases in (*WRONG_ATTENTION_FAILS.values(), WRONG_ATTENTION_FAILS_UNNAMED)
                for case in cases for dtype in backends.DTYPES}
    assert failed == expected
    assert all(c.status == "FAIL" for c in result.cells if (c.case, c.dtype) in failed)
    for reason, cases in WRONG_ATTENTION_FAILS.items():
        for cell in result.cells:
            if cell.case in cases:
                assert cell.reasons[0].startswith(reason), (cell.case, cell.reasons)
    assert all(not c.reasons for c in result.cells if c.case in WRONG_ATTENTION_FAILS_UNNAMED)
    assert all(e.passed for e in result.errors) and result.errors  # bad inputs: all right
    readme = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    for reason, cases in WRONG_ATTENTION_FAILS.items():
        assert reason in readme and all(f"`{case}`" in readme for case in cases)
    assert all(f"`{case}`" in readme for case in WRONG_ATTENTION_FAILS_UNNAMED)


def _bshd_wrapper_run():  # noqa: ANN202
    """The harness on examples.bshd_wrapper: the module runs in the harness's worker process."""
    from conformance.running import runner

    cases = ["three_d_gqa_causal", "fully_masked_rows", "softcap"]  # 3-D, 4-D, unsupported
    return runner.run(["examples.bshd_wrapper"], cases, ["float32"], peers=False,
                      check_errors=False, hypothesis=0)


@pytest.mark.slow
def test_bshd_wrapper_checks_jax_nn_in_its_layout():
    pytest.importorskip("jax", reason="needs jax: pip install jax")
    result = _bshd_wrapper_run()
    assert result.ok
    assert {c.case: c.status for c in result.cells} == {
        "three_d_gqa_causal": "ok", "fully_masked_rows": "ok", "softcap": "unsupported"}
