"""The peers of issue 24: packed batches, chunked attention, ALiBi, segment ids and mods.

``torch.flex`` takes every new sdpa case (chunks, ALiBi, segment ids, the registry's mods, each
written in torch by the adapter) and the packed cases as a document mask; ``jax.nn[lengths]`` and
``onnxruntime[nonpad]`` take padding as lengths and the packed cases as a padded batch
(``conformance.cases.varlen_padding``). Each new path is pinned against the float64 reference
(``ok``) or a verified known difference, every other peer is ``n/a`` on what it cannot express
(never silently wrong), and planted bugs in the real adapters (ALiBi's sign, offsets off by one, key
lengths off by one, queries not aligned) turn their cells ``unexpected``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import numpy_attn
from conformance import peers
from conformance.cases import catalogue as cases
from conformance.cases import inputs as case_inputs
from conformance.cases import varlen_padding
from conformance.cases.expected import Expected, expected, expected_for
from conformance.cases.inputs import CaseData
from conformance.diagnosing import alternatives
from conformance.peers import inputs, jax_nn, onnx_attention, torch_flex
from conformance.running import runner

#: peer → {(case, dtype): status, or ("known", the shorts of the entries that explain it)}.
PINNED = {
    "torch.flex": {("alibi_causal_bottom_right", "float32"): "ok",
                   ("chunked_causal_bottom_right", "bfloat16"): "ok",
                   ("mask_mod_random", "float16"): "ok",
                   ("mods_window_softcap", "float32"): "ok",
                   ("varlen_causal_gqa", "float32"): "ok",
                   ("varlen_window_sinks", "float32"): "n/a"},
    "jax.nn[lengths]": {("nan_key_masked", "float32"): "ok",
                        ("kv_lengths", "float32"): ("known", ("mean of V", "lse fill")),
                        ("padding", "float16"): ("known", ("lse in input dtype",)),
                        ("varlen_causal_gqa", "float32"): ("known", ("top-left", "lse fill")),
                        ("self", "float32"): "n/a", ("alibi_gqa", "float32"): "n/a"},
    "onnxruntime[nonpad]": {("kv_lengths", "float32"): "ok",
                            ("varlen_causal_gqa", "float16"): "ok",
                            ("varlen_causal_gqa", "float64"): ("known", ("f32 scale",)),
                            ("varlen_causal_gqa", "bfloat16"): ("known", ("no bf16 kernel",)),
                            ("padding", "float32"): "n/a"},
}


@functools.cache
def _expected(case: str, dtype: str) -> Expected:
    return expected(cases.get(case), dtype)


def _peer(name: str) -> peers.Peer:
    peer = peers.get(name)
    if not peer.available():
        pytest.skip(f"{name} needs {', '.join((peer.framework, *peer.requires))}: {peer.install}")
    return peer


def _status(cell: runner.Cell, want: object) -> object:
    return (cell.status, cell.alternatives) if isinstance(want, tuple) else cell.status


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PINNED))
def test_new_peer_paths_meet_the_reference_or_a_verified_difference(name: str) -> None:
    peer = _peer(name)
    for (case, dtype), want in PINNED[name].items():
        cell = runner.run_peer_cell(peer, _expected(case, dtype))
        assert _status(cell, want) == want, f"{name} on {case} {dtype}: {cell.status}: " \
                                            f"{cell.detail}"
        if cell.status == "ok":  # compared, every step within the tolerance
            assert cell.steps and cell.ratio is not None and cell.ratio <= 1.0
        if cell.status == "known":
            assert cell.alternative_ratio is not None and cell.alternative_ratio <= 1.0


def _local_varlen(q_lens: tuple[int, ...], k_lens: tuple[int, ...],
                  **options: object) -> Expected:
    """A float32 packed batch no case has, 4 over 2 heads, ``options`` over causal."""
    arrays = case_inputs.varlen(q_lens, k_lens, 2, seqused_k=options.pop("seqused_k", None))(
        np.random.default_rng(7))
    data = CaseData({n: cases.cast(a, "float32") for n, a in arrays.items()},
                    {"max_q": max(q_lens), "max_k": max(k_lens), "window_size": (-1, 0),
                     "enable_gqa": True, **options})
    return expected_for(data, "varlen", "float32", "local_varlen", gradients=False)


@pytest.mark.slow
def test_the_packed_paths_meet_the_reference_where_no_case_reaches() -> None:
    """A window with seqused_k and soft-capping (no case has them without sinks):
    FlexAttention's document mask and ONNX's opset-25 window behind nonpad_kv_seqlen; jax.nn's
    lengths where every sequence has as many queries as keys (top-left is bottom-right)."""
    window = _local_varlen((3, 2, 4), (5, 2, 6), seqused_k=(4, 2, 5), window_size=(2, 1),
                           softcap=2.5)
    square = _local_varlen((3, 1, 4), (3, 1, 4))
    for name, exp in (("torch.flex", window), ("onnxruntime[nonpad]", window),
                      ("jax.nn[lengths]", square)):
        cell = runner.run_peer_cell(_peer(name), exp)
        assert cell.status == "ok", f"{name}: {cell.detail}"
        assert "varlen_output" in {s.step for s in cell.steps}


@pytest.mark.parametrize("name", ["torch.sdpa", "jax.nn", "onnxruntime", "keras[numpy]"])
def test_a_peer_without_the_new_arguments_is_na_not_silently_wrong(name: str) -> None:
    """A framework without chunks, ALiBi, segment ids or mods would ignore them: n/a, naming
    what it lacks (before, such cells ran without them and came out unexpected)."""
    peer = _peer(name)
    for case, lacks in (("chunked_causal_bottom_right", "chunk_size"),
                        ("alibi_gqa", "alibi_slopes"), ("segment_ids_bottom_right", "segment ids"),
                        ("mask_mod_document", "mask_mod"), ("varlen_causal_gqa", "packed")):
        cell = runner.run_peer_cell(peer, _expected(case, "float32"))
        assert (cell.status, lacks in cell.detail) == ("n/a", True), (case, cell.detail)


# ------------------------------------------------------------------------------ planted bugs


def _unexpected(name: str, case: str, dtype: str = "float32",
                exp: Expected | None = None) -> runner.Cell:
    cell = runner.run_peer_cell(_peer(name), exp or _expected(case, dtype))
    assert cell.status == "unexpected", f"{name} on {case}: {cell.status}: {cell.detail}"
    return cell


@pytest.mark.slow
def test_flex_with_alibi_sign_flipped_or_offsets_off_by_one_is_unexpected(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slopes = torch_flex._slopes
    monkeypatch.setattr(torch_flex, "_slopes", lambda s, w: -slopes(s, w))
    _unexpected("torch.flex", "alibi_causal_bottom_right")
    monkeypatch.undo()
    tokens = torch_flex._tokens
    monkeypatch.setattr(torch_flex, "_tokens", lambda cu: tokens(np.minimum(
        np.asarray(cu) + (np.arange(len(cu)) > 0), cu[-1])))  # every offset one token late
    _unexpected("torch.flex", "varlen_causal_gqa")


def test_jax_lengths_off_by_one_is_unexpected(monkeypatch: pytest.MonkeyPatch) -> None:
    lengths = inputs.padding_lengths

    def short(mask: np.ndarray, q_len: int, kv_len: int) -> tuple:
        q_lengths, kv_lengths = lengths(mask, q_len, kv_len)
        return q_lengths, np.maximum(kv_lengths - 1, 0).astype(np.int32)

    monkeypatch.setattr(jax_nn, "padding_lengths", short)
    cell = _unexpected("jax.nn[lengths]", "kv_lengths")
    assert cell.alternatives  # the closest combination is named, and is not close enough
    assert cell.alternative_ratio is not None and cell.alternative_ratio > 1.0


def test_onnx_queries_left_aligned_behind_nonpad_is_unexpected(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """nonpad_kv_seqlen aligns the causal rule to the last valid key: queries left-aligned in
    the padded block would see the wrong keys."""
    unpack = varlen_padding.unpack
    monkeypatch.setattr(onnx_attention.varlen_padding, "unpack",
                        lambda a, right_align_queries=False: unpack(a))
    _unexpected("onnxruntime[nonpad]", "varlen_causal_gqa")


def test_a_difference_is_known_only_for_the_peer_whose_entry_names_it() -> None:
    """jax.nn[lengths]'s top-left packed batch is unexpected under FlexAttention's name (no
    entry of torch.flex explains it); an lse in log2 under jax.nn[lengths]'s is unexpected,
    the spec's own values are ok."""
    lengths = _peer("jax.nn[lengths]")
    exp = _expected("varlen_causal_gqa", "float32")
    as_flex = peers.Peer("torch.flex", "jax", "pip install jax", lengths.compute)
    assert runner.run_peer_cell(as_flex, exp).status == "unexpected"

    def spec_values(e: Expected, log2: bool = False) -> dict[str, np.ndarray]:
        a, o = e.data.arrays, e.data.options
        out, lse = numpy_attn.varlen_attention(
            a["query"], a["key"], a["value"], a["cu_seq_q"], a["cu_seq_k"], o["max_q"],
            o["max_k"], window_size=o["window_size"], enable_gqa=o["enable_gqa"],
            return_lse=True)
        return {"varlen_output": np.asarray(out), "varlen_lse": np.asarray(lse) / (
            np.log(2) if log2 else 1)}

    fake = peers.Peer("jax.nn[lengths]", "numpy", "", spec_values)
    assert runner.run_peer_cell(fake, exp).status == "ok"
    log2 = peers.Peer("jax.nn[lengths]", "numpy", "", functools.partial(spec_values, log2=True))
    assert runner.run_peer_cell(log2, exp).status == "unexpected"


# ------------------------------------------------------------------------------ padded batches


@pytest.mark.parametrize("case", ["varlen_causal_gqa", "varlen_window_sinks"])
def test_the_padded_batch_has_the_packed_batchs_values(case: str) -> None:
    """The alternatives compute a varlen cell on its padded batch (lengths and the
    per-sequence bottom-right rule as a mask); with no alternative it equals the harness's
    reference, computed one sequence at a time (sinks included)."""
    exp = _expected(case, "float64")
    hyp = alternatives.hypothesis(exp, [])
    for step in ("varlen_output", "varlen_lse"):
        np.testing.assert_allclose(hyp.values[step], exp.values[step], rtol=1e-12, atol=1e-12)
    p = varlen_padding.unpack(exp.data.arrays, right_align_queries=True)
    np.testing.assert_array_equal(varlen_padding.repack(p.query, p), exp.data.arrays["query"])


def test_a_sinks_hypothesis_keeps_the_sinks() -> None:
    """The alternatives' output is that of the weights with the sink in each denominator
    (``output_weights``): with no alternative it is the reference's output."""
    exp = _expected("sinks_causal_softcap", "float64")
    hyp = alternatives.hypothesis(exp, [])
    np.testing.assert_allclose(hyp.values["output"], exp.values["output"], atol=1e-12)


def test_padding_lengths_reads_only_padding_masks() -> None:
    padding = inputs.padding_lengths(_expected("padding", "float32").data.arrays["mask"], 5, 7)
    assert [x.tolist() for x in padding] == [[5, 2], [3, 7]]
    q_lengths, kv_lengths = inputs.padding_lengths(
        _expected("kv_lengths", "float32").data.arrays["mask"], 5, 7)
    assert q_lengths is None and kv_lengths.tolist() == [4, 0]
    random = _expected("fully_masked_rows", "float32").data.arrays["mask"]
    assert inputs.padding_lengths(random, 5, 7) is None
    per_head = np.ones((2, 4, 1, 7), bool)
    per_head[0, 1, 0, 3:] = False  # one head padded differently
    assert inputs.padding_lengths(per_head, 5, 7) is None
    assert inputs.padding_lengths(None, 5, 7) is None
