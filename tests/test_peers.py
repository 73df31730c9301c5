"""The frameworks' kernels as peer columns, and their known differences as tested hypotheses.

Each peer runs a few cells, and each cell must be classified exactly as pinned here: ``ok`` (the
peer's output agrees with the float64 reference within the spec's tolerance), ``known`` with the
named entries of ``spec.KNOWN_DIFFERENCES`` (the peer failed the spec and matches the
alternative semantics the entries name, within the tolerance: the real frameworks check each
alternative), or ``n/a`` (the framework cannot express the case). The pinned cells cover each
peer's main difference and one thing it cannot express; then every case in float32 must be ok,
n/a or a documented known difference. A missing package makes a column missing with its install
command, never an error. A Keras peer's worker process ends with its test (one at a time).

Fake peers (``numpy_attn`` standing in for a framework, under a real peer's name so its entries
apply) pin the classification itself: a peer that gives an entry's alternative is ``known``
with its distance, one that breaks it is ``unexpected`` with both distances, a raise is known
only when an entry names that exception, several differences in one cell are all named.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Callable

import numpy as np
import pytest
from harness_helpers import _expected

import numpy_attn
from conformance import peers, spec
from conformance.cases import catalogue as cases
from conformance.cases.dtypes import DTYPES
from conformance.cases.expected import Expected
from conformance.comparing.results import Column, RunResult
from conformance.diagnosing import alternatives
from conformance.peers import keras_ops
from conformance.reporting import json_report, markdown, sections
from conformance.running import keras_worker, runner
from conformance.running.workers import decode, encode

INSTALL = "pip install -e '.[peers]'"

#: peer → {(case, dtype): status, or ("known", the shorts of the entries that explain it)}.
PINNED = {
    "keras[numpy]": {("self", "float32"): "ok", ("gqa", "float32"): ("known", ("GQA error",)),
                     ("self", "float64"): ("known", ("float32",)), ("window", "float32"): "n/a"},
    "keras[jax]": {("gqa", "float32"): "ok", ("v_dim", "float32"): ("known", ("v_dim error",)),
                   ("causal_bottom_right", "float32"): ("known", ("top-left",))},
    "keras[torch]": {("gqa", "float32"): "ok",
                     ("mask_and_bias", "float32"): ("known", ("bias+mask error",)),
                     ("fully_masked_rows", "float16"): ("known", ("unmasked rows",)),
                     ("fully_masked_rows", "bfloat16"): ("known", ("mean of V",))},
    "flax.nnx": {("gqa", "float32"): "ok", ("padding", "float32"): ("known", ("mean of V",)),
                 ("scale", "float32"): "n/a"},
    "transformers.eager": {("causal_bottom_right", "float32"): "ok", ("window", "float32"): "ok",
                           ("fully_masked_rows", "float64"): ("known", ("NaN rows",
                                                                        "f32 softmax")),
                           ("fully_masked_rows", "float32"): ("known", ("mean of V",)),
                           ("softcap", "float32"): "n/a"},
    "transformers.sdpa": {("causal_bottom_right", "float32"): "ok",
                          ("single_query_causal", "float32"): "ok", ("gqa", "float32"): "ok",
                          ("nan_query", "float32"): ("known", ("NaN row → 0",))},
    "torch.MHA": {("fully_masked_rows", "float32"): ("known", ("NaN rows", "NaN all heads")),
                  ("nan_key_masked", "float32"): ("known", ("NaN all heads",
                                                            "masked NaN spreads"))},
    "torch.MHA[sdpa]": {("fully_masked_rows", "float32"): "ok",
                        ("nan_query", "float32"): ("known", ("NaN all heads", "NaN row → 0"))},
    # the row log-sum-exp (jax.nn's return_residual, FlexAttention's AuxRequest) and sinks
    "jax.nn": {("causal_top_left", "float32"): "ok",
               ("padding", "float32"): ("known", ("mean of V", "lse fill")),
               ("self", "bfloat16"): ("known", ("lse in input dtype",)),
               ("sinks_window", "float32"): "n/a"},
    "torch.flex": {("fully_masked_rows", "float32"): "ok", ("softcap", "bfloat16"): "ok",
                   ("causal_bottom_right", "float64"): "ok",
                   ("inf_key", "float32"): ("known", ("lse +inf",)),
                   ("sinks_window", "float32"): "n/a"},
    "transformers.gpt_oss": {("sinks_fully_masked_rows", "float32"): "ok",
                             ("sinks_bottom_right_q_longer", "float64"): "ok",
                             ("sinks_gqa_kv_lengths", "bfloat16"): "ok", ("self", "float32"): "n/a",
                             ("sinks_causal_softcap", "float32"): "n/a"},
    "onnxruntime": {("causal_bottom_right", "float32"): "ok", ("softcap", "float32"): "ok",
                    ("fully_masked_rows", "float32"): "ok", ("window", "float32"): "ok",
                    ("window_causal_bottom_right", "float16"): "ok",
                    ("kv_lengths", "float32"): ("known", ("mask shape error",)),
                    ("self", "float64"): ("known", ("f32 scale",)),
                    ("self", "bfloat16"): ("known", ("no bf16 kernel",))},
}


@pytest.fixture(autouse=True)
def _one_keras_worker_at_a_time():
    """End the Keras workers a test started (about 0.4 GB each): each keras peer's test starts
    its own and ends it, so the run never holds all three."""
    yield
    keras_worker.close_workers()


@pytest.mark.parametrize("name", [  # Keras starts a worker per backend, torch.flex compiles
    pytest.param(n, marks=pytest.mark.slow) if n.startswith("keras") or n == "torch.flex" else n
    for n in sorted(p.name for p in peers.PEERS)])
def test_peer_column_is_pinned_and_differs_only_where_known(name: str) -> None:
    """The peer's pinned cells exactly as pinned (a known cell verified against its
    alternative); then every case in float32: ok, n/a, or a documented known difference."""
    peer = peers.get(name)
    if not peer.available():
        pytest.skip(f"{name} needs {', '.join((peer.framework, *peer.requires))}: {peer.install}")
    for (case, dtype), want in PINNED.get(name, {}).items():
        cell = runner.run_peer_cell(peer, _expected(case, dtype))
        got = (cell.status, cell.alternatives) if isinstance(want, tuple) else cell.status
        assert got == want, f"{name} on {case} {dtype}: {cell.status}: {cell.detail}"
        if cell.status == "known":  # verified: the peer matches the alternative
            assert cell.alternative_ratio is not None and cell.alternative_ratio <= 1.0
    for case in cases.CASE_NAMES:
        cell = runner.run_peer_cell(peer, _expected(case, "float32"))
        assert cell.status in ("ok", "n/a", "known"), f"{name} on {case}: {cell.detail}"


def test_every_new_peer_is_a_column() -> None:
    names = {p.name for p in peers.PEERS}
    assert set(PINNED) <= names


def test_a_peer_without_its_package_is_missing_not_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default run (peers on) lists a peer whose package is absent as missing, with its
    install command, and runs the rest."""
    ghost = peers.Peer("ghost.attention", "numpy", INSTALL, peers.PEERS[0].compute,
                       ("no_such_package_for_this_test",))
    monkeypatch.setattr(peers, "PEERS", (ghost,))
    assert not ghost.available()
    result = runner.run(["numpy"], ["self"], ["float32"], peers=True, check_errors=False,
                        hypothesis=0, progress=False, profile="full")  # every peer
    assert [c.name for c in result.columns] == ["numpy"]
    assert result.missing == {"ghost.attention": INSTALL}
    assert [c.status for c in result.cells] == ["ok"]


def test_worker_messages_keep_dtype_and_bits() -> None:
    import ml_dtypes

    arrays = {"q": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
              "b": (np.arange(4) / 3).astype(ml_dtypes.bfloat16),
              "m": np.array([[True, False]])}
    back, header = decode(encode((arrays, {"is_causal": True, "scale": 0.25})))
    assert header == {"is_causal": True, "scale": 0.25}
    for name, x in arrays.items():
        assert back[name].dtype == x.dtype and back[name].shape == x.shape
        assert back[name].tobytes() == x.tobytes()


def test_a_keras_worker_that_cannot_start_is_unexpected_once() -> None:
    if importlib.util.find_spec("keras") is None:  # importing needs KERAS_BACKEND: find it
        pytest.skip(f"needs keras: {INSTALL}")
    bogus = peers.Peer("keras[bogus]", "keras", INSTALL,
                       functools.partial(keras_ops.keras_attention, "bogus"))
    try:
        first = runner.run_peer_cell(bogus, _expected("self", "float32"))
        assert first.status == "unexpected"
        assert "cannot import Keras" in first.detail and "bogus" in first.detail
        failed = keras_worker._WORKERS["bogus"]
        second = runner.run_peer_cell(bogus, _expected("cross", "float32"))
        assert second.status == "unexpected" and keras_worker._WORKERS["bogus"] is failed
    finally:
        keras_worker._WORKERS.pop("bogus", None)


# ------------------------------------------------------------------------------ hypotheses


def _numpy_peer(name: str, compute: Callable[[Expected], dict[str, np.ndarray]]) -> peers.Peer:
    """A fake peer called ``name`` (so that name's entries apply) computed by ``compute``."""
    return peers.Peer(name, "numpy", INSTALL, compute)


def _attend(exp: Expected, *, in_float32: bool = False, drop_bias: bool = False,
            **options: object) -> np.ndarray:
    """``numpy_attn`` on the case (an implementation independent of the harness' reference):
    its inputs rounded to float32 first with ``in_float32`` (float64 results), without its bias
    with ``drop_bias``, ``options`` over the case's."""
    arrays = cases.sdpa_arrays(exp.data.arrays)
    if in_float32:
        arrays = {n: x.astype(np.float32) if x.dtype.kind == "f" else x
                  for n, x in arrays.items()}
    if drop_bias:
        arrays.pop("bias", None)
    out = numpy_attn.scaled_dot_product_attention(
        **arrays, **{**cases.sdpa_options(exp.data.options), **options})
    return np.asarray(out).astype(exp.data.arrays["query"].dtype)


def test_a_peer_that_gives_the_alternative_is_known_with_its_distance(tmp_path) -> None:
    """A fake jax.nn that aligns causal masks top-left (numpy_attn told so) is known, and the
    distance to the alternative is in the cell's text, the JSON and the Markdown."""
    peer = _numpy_peer("jax.nn", lambda e: {"output": _attend(e, causal_alignment="top_left")})
    cell = runner.run_peer_cell(peer, _expected("causal_bottom_right", "float32"))
    assert cell.status == "known" and cell.alternatives == ("top-left",)
    assert cell.ratio > 1e3 and 0.0 <= cell.alternative_ratio <= 1.0  # far from the spec
    text = f"known: top-left ({cell.alternative_ratio:.2f})"
    assert sections.cell_text(cell) == text
    result = RunResult([Column("jax.nn", "peer", peer=peer)], [cell], {},
                       [(cell.case, cell.dtype)])
    data = json_report.to_dict(result)["cells"][0]
    assert data["alternatives"] == ["top-left"]
    assert data["alternative_ratio"] == cell.alternative_ratio
    markdown.write_markdown(result, tmp_path / "report.md")
    assert f"| {text} |" in (tmp_path / "report.md").read_text()


def test_a_broken_peer_is_unexpected_not_known() -> None:
    """A fake jax.nn that attends in float32 (its real difference) but drops the bias in float64
    is unexpected on the bias case in float64, with both distances; where it does not break
    the alternative it stays known, and where it meets the spec it is ok."""
    def compute(exp: Expected) -> dict[str, np.ndarray]:
        return {"output": _attend(exp, in_float32=True, drop_bias=exp.dtype == "float64")}

    peer = _numpy_peer("jax.nn", compute)
    broken = runner.run_peer_cell(peer, _expected("bias", "float64"))
    assert broken.status == "unexpected", broken.detail
    assert broken.alternatives == ("f32 softmax",)
    assert broken.ratio > 1.0 and broken.alternative_ratio > 1.0
    assert "f32 softmax" in broken.detail and not broken.failed  # peers never fail the run
    assert re.fullmatch(r"unexp\. (inf|\S+)/(inf|\S+)", sections.cell_text(broken))
    assert runner.run_peer_cell(peer, _expected("self", "float64")).status == "known"
    assert runner.run_peer_cell(peer, _expected("bias", "float32")).status == "ok"
    zeros = _numpy_peer("jax.nn", lambda e: {"output": 0 * _attend(e)})  # covered, but wrong
    cell = runner.run_peer_cell(zeros, _expected("causal_bottom_right", "float32"))
    assert cell.status == "unexpected" and cell.alternatives == ("top-left",)
    assert cell.alternative_ratio > 1.0


def test_a_raise_is_known_only_when_an_entry_names_it() -> None:
    """A fake keras[jax] raising on every float64 call: known where an entry says it raises that
    error (v_dim: TypeError 'cannot reshape array'), unexpected elsewhere (self: its entry
    says float32 results, not an exception) and for another exception type."""
    def raising(kind: type[Exception]) -> Callable[[Expected], dict[str, np.ndarray]]:
        def compute(exp: Expected) -> dict[str, np.ndarray]:
            if exp.dtype == "float64":
                raise kind("cannot reshape array of shape (2, 5, 4, 1, 3) into shape (2, 5, 4, 8)")
            return {"output": _attend(exp)}
        return compute

    peer = _numpy_peer("keras[jax]", raising(TypeError))
    known = runner.run_peer_cell(peer, _expected("v_dim", "float64"))
    assert (known.status, known.alternatives, known.alternative_ratio) == (
        "known", ("v_dim error",), 0.0)
    other = runner.run_peer_cell(peer, _expected("self", "float64"))
    assert other.status == "unexpected" and "raised TypeError" in other.detail
    assert sections.cell_text(other) == "unexp. raised/-"
    wrong = runner.run_peer_cell(_numpy_peer("keras[jax]", raising(ValueError)),
                                 _expected("v_dim", "float64"))
    assert wrong.status == "unexpected" and "expected TypeError" in wrong.detail
    assert runner.run_peer_cell(peer, _expected("self", "float32")).status == "ok"


def test_several_differences_in_one_cell_are_all_named() -> None:
    """A fake jax.nn aligned top-left and computed in float32 is known on a bottom-right case in
    float64 only through both of its entries, and the cell names both."""
    peer = _numpy_peer("jax.nn", lambda e: {"output": _attend(e, in_float32=True,
                                                              causal_alignment="top_left")})
    cell = runner.run_peer_cell(peer, _expected("causal_bottom_right", "float64"))
    assert cell.status == "known" and cell.alternatives == ("top-left", "f32 softmax")
    assert cell.detail == f"top-left + f32 softmax ({cell.alternative_ratio:.2f})"
    exp = _expected("causal_bottom_right", "float64")
    for alone in ("top_left", "float32_softmax"):  # neither entry explains it alone
        steps = alternatives.check(alternatives.hypothesis(exp, [alone]), peer.compute(exp))
        assert not all(s.passed for s in steps), alone


def test_known_differences_name_cases_and_alternatives_no_catch_all() -> None:
    """Every entry lists existing case names (no patterns, no "*"), valid dtypes, and an
    alternative the harness computes; a "raises" entry names the exception and its message."""
    names = set(cases.CASE_NAMES)
    computed = set(alternatives.ORDER) | {"raises"}
    assert set(spec.KNOWN_ALTERNATIVES) == computed
    for peer, entries in spec.KNOWN_DIFFERENCES.items():
        for entry in entries:
            where = f"{peer}: {entry.get('short')}"
            assert entry["cases"] and set(entry["cases"]) <= names, where
            assert not any(re.search(r"[*?\[]", c) for c in entry["cases"]), where
            assert set(entry.get("dtypes", DTYPES)) <= set(DTYPES), where
            assert entry["alternative"] in computed, where
            if entry["alternative"] == "raises":
                assert {"type", "match"} <= set(entry["raises"]), where
                re.compile(entry["raises"]["match"])


# ------------------------------------------------------------------------------ lse and sinks


def _attend_lse(exp: Expected, **options: object) -> tuple[np.ndarray, np.ndarray]:
    """``numpy_attn`` with ``return_lse=True`` on the case (sinks included): the output in the
    input dtype, the lse in the compute dtype."""
    out, lse = numpy_attn.scaled_dot_product_attention(
        **cases.sdpa_arrays(exp.data.arrays),
        **{**cases.sdpa_options(exp.data.options), **options}, return_lse=True)
    return np.asarray(out).astype(exp.data.arrays["query"].dtype), np.asarray(lse)


def test_an_lse_in_log2_is_unexpected_a_fill_is_known_only_where_listed() -> None:
    """Fake peers that return the lse: in log2 (a planted bug: no entry explains it) is
    unexpected under FlexAttention's name; jax.nn's finite fill for a fully masked row is known
    where its entry lists the case, and the same fill is unexpected under FlexAttention's name
    (its kernel gives -inf there); a correct lse is ok."""
    def log2(exp: Expected) -> dict[str, np.ndarray]:
        out, lse = _attend_lse(exp)
        return {"output": out, "lse": (lse / np.log(2)).astype(lse.dtype)}

    def fill(exp: Expected) -> dict[str, np.ndarray]:
        out, lse = _attend_lse(exp)
        fill = np.float32(-0.7) * np.finfo(np.float32).max
        return {"output": out, "lse": np.where(np.isneginf(lse), fill, lse).astype(lse.dtype)}

    exp = _expected("causal_top_left", "float32")
    correct = _numpy_peer("torch.flex", lambda e: dict(zip(("output", "lse"), _attend_lse(e),
                                                           strict=True)))
    assert runner.run_peer_cell(correct, exp).status == "ok"
    cell = runner.run_peer_cell(_numpy_peer("torch.flex", log2), exp)
    assert cell.status == "unexpected" and "lse" in cell.detail, cell.detail
    empty = _expected("fully_masked_rows", "float32")
    known = runner.run_peer_cell(_numpy_peer("jax.nn", fill), empty)
    assert (known.status, known.alternatives) == ("known", ("lse fill",)), known.detail
    assert runner.run_peer_cell(_numpy_peer("torch.flex", fill), empty).status == "unexpected"


def test_a_gpt_oss_peer_that_drops_the_sinks_or_adds_them_to_the_numerator_is_unexpected() -> None:
    """The sinks cases tell a kernel that ignores the sinks, or puts the sink in the numerator
    (a key of value 1), from GPT-OSS's own (ok on the same cell)."""
    exp = _expected("sinks_fully_masked_rows", "float32")
    real = peers.get("transformers.gpt_oss")
    if real.available():
        assert runner.run_peer_cell(real, exp).status == "ok"

    def dropped(e: Expected) -> dict[str, np.ndarray]:
        arrays = {n: x for n, x in cases.sdpa_arrays(e.data.arrays).items() if n != "sinks"}
        return {"output": np.asarray(numpy_attn.scaled_dot_product_attention(
            **arrays, **cases.sdpa_options(e.data.options))).astype(np.float32)}

    def numerator(e: Expected) -> dict[str, np.ndarray]:
        out, lse = _attend_lse(e)
        sinks = np.asarray(e.data.arrays["sinks"], np.float64)[:, None]  # (heads, 1)
        share = np.exp(sinks - lse.astype(np.float64))  # the sink's weight in each row
        return {"output": (out + share[..., None]).astype(np.float32)}  # its value taken as 1

    for compute in (dropped, numerator):
        cell = runner.run_peer_cell(_numpy_peer("transformers.gpt_oss", compute), exp)
        assert cell.status == "unexpected", compute.__name__
        assert "no entry of spec.KNOWN_DIFFERENCES covers it" in cell.detail
