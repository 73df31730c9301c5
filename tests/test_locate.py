"""``conformance.locate`` and ``python -m conformance locate``: planted bugs are found at
their stage, with the right verdict on positions and a shrunk input; agreeing blocks part
nowhere; bad input gets a verdict, never a traceback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import conformance
import numpy_attn
from conformance.__main__ import main
from conformance.locating import LocateInputs
from conformance.locating.locate import position_verdict

D_MODEL, HEADS = 16, 4


def _block(layout: str = "half", seed: int = 0, **kwargs):
    rope = numpy_attn.RoPE(layout=layout)
    return numpy_attn.MultiHeadAttention(D_MODEL, HEADS, rope=rope,
                                         rng=np.random.default_rng(seed), **kwargs)


class _Planted:
    """A block that wraps the spec's module and plants one bug in its stages."""

    def __init__(self, bug: str) -> None:
        self.inner, self.bug, self.d_model = _block(), bug, D_MODEL

    def export_weights(self) -> dict:
        return self.inner.export_weights()

    def load_weights(self, weights: dict) -> _Planted:
        self.inner.load_weights(weights)
        return self

    def stages(self, x, *, positions=None, is_causal=False) -> dict:
        if self.bug == "mask_off_by_one" and is_causal:  # query i also sees key i + 1
            seq = np.shape(x)[-2]
            mask = np.tril(np.ones((seq, seq), bool), k=1)
            return self.inner.stages(x, positions=positions, mask=mask)
        stages = self.inner.stages(x, positions=positions, is_causal=is_causal)
        if self.bug == "transposed_o_proj":
            context = stages["context"]  # (batch, heads, seq, head_dim)
            merged = np.swapaxes(context, 1, 2).reshape(context.shape[0], context.shape[2], -1)
            stages["output"] = merged @ self.inner.W_out.T + self.inner.b_out
        return stages


def test_a_swapped_layout_parts_at_the_rotated_queries_and_grows_with_position():
    result = conformance.locate(_block("half"), _block("interleaved", seed=1))
    assert result.first == "rotated_q"
    assert result.verdict == "grows with position"
    rotated = result.stage("rotated_q")
    assert rotated.per_position[0] <= 1.0  # position 0: no rotation in either layout
    assert min(rotated.per_position[1:]) > 1.0
    assert [s.passed for s in result.stages[:3]] == [True, True, True]  # the projections agree
    assert result.shrunk["seq"] == 2 and result.shrunk["batch"] == 1
    assert result.exit_code == 1


def test_a_transposed_output_projection_parts_at_the_output_everywhere():
    result = conformance.locate(_block(), _Planted("transposed_o_proj"))
    assert result.first == "output"
    assert result.verdict == "everywhere"
    assert all(s.passed for s in result.stages if s.stage != "output")
    assert result.shrunk["seq"] == 1


def test_a_causal_mask_off_by_one_parts_at_the_scores():
    result = conformance.locate(_block(), _Planted("mask_off_by_one"), {"seq": 8})
    assert result.first in ("scores", "weights")
    assert result.verdict == "at positions 0-6"  # the last query has no key i + 1
    assert result.stage("rotated_k").passed
    assert result.shrunk["seq"] == 2


class _ShiftedPositions(_Planted):
    """The spec's module with every position one later: q·k is unchanged (RoPE is relative),
    so only the rotated stages show it."""

    def stages(self, x, *, positions=None, is_causal=False) -> dict:
        seq = np.shape(x)[-2]
        positions = np.arange(seq) if positions is None else np.asarray(positions)
        return self.inner.stages(x, positions=positions + 1, is_causal=is_causal)


class _NoAttentionFactor(_Planted):
    """YaRN's frequencies without its attention factor (cos and sin not scaled)."""

    def __init__(self, scaling: dict) -> None:
        super().__init__("none")
        self.inner = numpy_attn.MultiHeadAttention(
            D_MODEL, HEADS, rope=numpy_attn.RoPE(scaling=scaling), rng=np.random.default_rng(0))
        self.scaling = scaling

    def stages(self, x, *, positions=None, is_causal=False) -> dict:
        stages = self.inner.stages(x, positions=positions, is_causal=is_causal)
        _, factor = numpy_attn.rope_frequencies(D_MODEL // HEADS, scaling=self.scaling)
        stages["rotated_q"] = stages["rotated_q"] / factor  # the rotated dims, all of them here
        stages["rotated_k"] = stages["rotated_k"] / factor
        return stages


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}


@pytest.mark.parametrize(("planted", "verdict"), [
    ("theta", "grows with position"),  # position 0 is never rotated
    ("rotary_dim", "grows with position"),
    ("positions", "everywhere"),  # position 0 moves to 1
    ("attention_factor", "everywhere"),  # cos and sin scaled at every position, 0 included
])
def test_each_planted_rope_mistake_parts_at_the_rotated_queries(planted, verdict):
    """The mistakes the harness's diagnoses name (conformance/diagnosing/rotary.py), found
    by stage: the base theta wrong, rotary_dim ignored, positions off by one, the attention
    factor forgotten. The projections agree in each; the rotation is where they part."""
    reference = _block()
    if planted == "theta":
        wrong = numpy_attn.MultiHeadAttention(D_MODEL, HEADS, rope=numpy_attn.RoPE(
            theta=500000.0), rng=np.random.default_rng(0))
    elif planted == "rotary_dim":  # the spec's rope rotates 2 of 4 dims, the wrong one all 4
        reference = numpy_attn.MultiHeadAttention(D_MODEL, HEADS, rope=numpy_attn.RoPE(
            rotary_dim=2), rng=np.random.default_rng(0))
        wrong = _block()
    elif planted == "positions":
        wrong = _ShiftedPositions("none")
    else:
        reference = _NoAttentionFactor(YARN).inner
        wrong = _NoAttentionFactor(YARN)
    result = conformance.locate(reference, wrong)
    assert [s.passed for s in result.stages[:3]] == [True, True, True], result.text()
    assert result.first == "rotated_q", result.text()
    assert result.verdict == verdict, result.text()


def test_numpy_and_torch_agree_at_every_stage():
    torch_attn = pytest.importorskip("torch_attn")
    b = torch_attn.MultiHeadAttention(D_MODEL, HEADS, rope=torch_attn.RoPE())
    result = conformance.locate(_block(), b, LocateInputs(positions=np.arange(16) + 40))
    assert result.agree and result.first is None and result.exit_code == 0
    assert [s.stage for s in result.stages] == list(conformance.locating.STAGES)
    assert "weights: A's, copied into both" in result.notes
    assert "they agree at every stage" in result.text()


@pytest.mark.slow
def test_the_project_and_transformers_llama_attention_agree_with_copied_weights():
    pytest.importorskip("transformers")
    torch_attn = pytest.importorskip("torch_attn")
    from conformance.locating.cli import llama_attention

    layer = llama_attention(D_MODEL, HEADS, 10000.0, seed=3)
    ours = torch_attn.MultiHeadAttention(D_MODEL, HEADS, bias=False, rope=torch_attn.RoPE())
    for a, b in ((ours, layer), (layer, ours)):
        result = conformance.locate(a, b, {"positions": np.arange(16) + 5})
        assert result.agree, result.text()
    # In float64, transformers still computes the angles in float32: a known difference,
    # found where it starts.
    result = conformance.locate(layer, ours, {"dtype": "float64"})
    assert result.first == "rotated_q" and result.verdict == "grows with position"


@pytest.mark.slow
def test_jax_agrees_with_numpy():
    jax = pytest.importorskip("jax")
    jax_attn = pytest.importorskip("jax_attn")
    b = jax_attn.MultiHeadAttention(D_MODEL, HEADS, rope=jax_attn.RoPE(), rng=jax.random.key(0))
    assert conformance.locate(_block(), b, {"seq": 8}).agree


def test_bad_input_gets_a_verdict_not_a_traceback():
    nothing = conformance.locate(_block(), object())
    assert nothing.exit_code == 2 and "is not an attention block" in nothing.problem
    wider = numpy_attn.MultiHeadAttention(32, HEADS, rng=np.random.default_rng(0))
    mismatch = conformance.locate(_block(), wider)
    assert mismatch.exit_code == 2 and "d_model differ: A 16, B 32" in mismatch.problem

    class Raises:
        d_model = D_MODEL

        def stages(self, x, *, positions=None, is_causal=False):
            raise RuntimeError("boom")

    raised = conformance.locate(_block(), Raises())
    assert raised.exit_code == 2 and "raised RuntimeError: boom" in raised.problem
    assert "cannot compare" in raised.text()
    assert conformance.locate(_block(), _block(), {"dtype": "int8"}).exit_code == 2


def test_position_verdicts():
    assert position_verdict([0.5, 3.0, 4.0, 5.0]) == ("grows with position", [1, 2, 3])
    assert position_verdict([2.0, 2.0, 2.0]) == ("everywhere", [0, 1, 2])
    assert position_verdict([0.1, 8.0, 0.2, 7.0, 0.3]) == ("at positions 1, 3", [1, 3])
    assert position_verdict([0.1, 8.0, 9.0, 0.2]) == ("at positions 1-2", [1, 2])
    assert position_verdict([0.1, 0.2]) == ("", [])


def test_the_command_line(tmp_path, capsys):
    assert main(["locate", "numpy", "numpy", "--seq", "6"]) == 0
    assert main(["locate", "numpy", "numpy", "--layout-b", "interleaved", "--seq", "6"]) == 1
    out = capsys.readouterr().out
    assert "they part first at 'rotated_q': grows with position" in out
    assert "shrunk input: batch 1 (row 0), seq 2" in out
    plugin = tmp_path / "planted.py"
    here = str(Path(__file__).parent)
    plugin.write_text(f"import sys\nsys.path.insert(0, {here!r})\n"
                      "from test_locate import _Planted\n"
                      "def block():\n    return _Planted('transposed_o_proj')\n")
    assert main(["locate", "numpy", f"{plugin}:block", "--d-model", "16"]) == 1
    assert "they part first at 'output': everywhere" in capsys.readouterr().out
    assert main(["locate", "numpy", "no_such_block"]) == 2
    assert main(["locate", "numpy", f"{plugin}:missing"]) == 2
    assert "no callable 'missing'" in capsys.readouterr().err
