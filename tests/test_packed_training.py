"""A packed-batch training step through ``varlen_attention`` equals the padded batch's step
(``examples/packed_training.py``, documented in docs/integrations.md).

The example runs one tiny causal language model (2 blocks, grouped-query attention, learned
positions restarting per sequence; weights drawn in float64) on 5 sequences of lengths 7, 3, 12,
1 and 9, padded (torch's own ``scaled_dot_product_attention`` with a boolean mask: the
independent reference) and packed (``torch_attn.varlen_attention`` with ``window_size=(-1,
0)``; ``jax_attn.varlen_attention`` under ``jax.value_and_grad`` in float64). The loss and every
parameter's gradient must pass the spec's tolerance rule against the padded float64 step; the
planted bug (offsets off by one) must fail it. JAX runs in float64 only here (one compile; the
example's ``main`` runs float32 too).

Why an example and not a test alone: packing a batch for training (offsets, positions that
restart per sequence, which predictions to keep) is what a reader wants to copy, and the script
prints the comparison; the test runs the same ``run()``, so what the docs claim stays checked.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch: pip install torch==2.13.0")

ROOT = Path(__file__).resolve().parent.parent


def _load():
    path = ROOT / "examples" / "packed_training.py"
    spec = importlib.util.spec_from_file_location("packed_training", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# One run of the example (``result``) for the module's tests: they share a pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("packed_training")


@pytest.fixture(scope="module")
def example():
    return _load()


@pytest.fixture(scope="module")
def result(example):
    jax_dtypes = ("float64",) if importlib.util.find_spec("jax") else ()
    return example.run(jax_dtypes=jax_dtypes)


def test_the_packed_step_equals_the_padded_step(example, result):
    assert (result["tokens"], result["padded_positions"], result["predictions"]) == (32, 60, 27)
    worst = result["worst"]
    expected = {"packed float64", "packed float32", "planted: offsets off by one"}
    if importlib.util.find_spec("jax"):
        expected.add("jax packed float64")
    assert set(worst) == expected
    for label, ratio in worst.items():
        if not label.startswith("planted"):
            assert ratio <= 1.0, (label, ratio)
    # float32's k·e: e is the padded float32 step's own error, small (the same weights)
    assert 0 < result["baseline_error"] < 1e-5
    assert result["losses"]["padded float64"] == pytest.approx(5.0207520240855, abs=1e-12)


def test_offsets_off_by_one_fail(result):
    """The planted control: one sequence boundary moved by one token changes the loss and the
    gradients far beyond the float64 bound (the check is not vacuous)."""
    assert result["worst"]["planted: offsets off by one"] > 1e6
    losses = result["losses"]
    assert abs(losses["planted: offsets off by one"] - losses["padded float64"]) > 1e-3


def test_the_script_prints_a_verdict_and_exits_nonzero_on_a_miss(example, result,
                                                                  monkeypatch, capsys):
    monkeypatch.setattr(example, "run", lambda jax_dtypes: result)
    assert example.main(["--no-jax"]) == 0
    out = capsys.readouterr().out
    assert "32 tokens packed (60 padded), 27 predictions" in out
    assert out.count("✓") == len(result["worst"]) and "✓ caught" in out
    missed = {**result, "worst": {**result["worst"], "planted: offsets off by one": 0.5}}
    monkeypatch.setattr(example, "run", lambda jax_dtypes: missed)
    assert example.main([]) == 1
    assert "✗ NOT caught" in capsys.readouterr().out
    failing = {**result, "worst": {**result["worst"], "packed float32": 1.5}}
    monkeypatch.setattr(example, "run", lambda jax_dtypes: failing)
    assert example.main([]) == 1


def test_the_documented_snippet_prints_what_the_docs_say():
    """The packed-training snippet of docs/integrations.md, run here, prints its documented
    text."""
    from test_docs import check_snippets_in_process

    check_snippets_in_process(ROOT / "docs" / "integrations.md", "varlen_attention")
