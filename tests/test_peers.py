"""The ecosystem's kernels as peer columns: Keras 3 on three backends, Flax NNX, transformers'
attention functions and onnxruntime's ``Attention`` node.

Each peer runs a few cells, and each cell must be classified exactly as pinned here: ``ok`` (the
peer's output agrees with the float64 reference within the spec's tolerance), ``known`` with the
named entry of ``spec.KNOWN_DIFFERENCES`` (the peer's output failed the comparison, and the
difference is documented), or ``n/a`` (the framework cannot express the case). The pinned cells
cover each peer's main difference and one thing it cannot express. A missing package makes a
column missing with its install command, never an error.
"""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest

from conformance import peers, runner
from conformance.expected import expected
from conformance.peers import keras_ops
from conformance.peers.keras_worker import decode, encode

INSTALL = "pip install -e '.[peers]'"

#: peer → {(case, dtype): status, or (status "known", the entry's short)}.
PINNED = {
    "keras[numpy]": {("self", "float32"): "ok", ("gqa", "float32"): ("known", "GQA error"),
                     ("self", "float64"): ("known", "float32"), ("window", "float32"): "n/a"},
    "keras[jax]": {("gqa", "float32"): "ok", ("v_dim", "float32"): ("known", "v_dim error"),
                   ("causal_bottom_right", "float32"): ("known", "top-left")},
    "keras[torch]": {("gqa", "float32"): "ok",
                     ("mask_and_bias", "float32"): ("known", "bias+mask error"),
                     ("fully_masked_rows", "float16"): ("known", "rounded rows")},
    "flax.nnx": {("gqa", "float32"): "ok", ("padding", "float32"): ("known", "mean of V"),
                 ("scale", "float32"): "n/a"},
    "transformers.eager": {("causal_bottom_right", "float32"): "ok", ("window", "float32"): "ok",
                           ("fully_masked_rows", "float64"): ("known", "NaN rows"),
                           ("fully_masked_rows", "float32"): ("known", "mean of V"),
                           ("softcap", "float32"): "n/a"},
    "transformers.sdpa": {("causal_bottom_right", "float32"): "ok",
                          ("single_query_causal", "float32"): "ok", ("gqa", "float32"): "ok",
                          ("nan_query", "float32"): ("known", "NaN row → 0")},
    "onnxruntime": {("causal_bottom_right", "float32"): "ok", ("softcap", "float32"): "ok",
                    ("fully_masked_rows", "float32"): "ok",
                    ("kv_lengths", "float32"): ("known", "mask shape error"),
                    ("self", "float64"): ("known", "f32 inside"), ("self", "bfloat16"): "n/a"},
}


@functools.cache
def _expected(case: str, dtype: str):
    from conformance import cases

    return expected(cases.get(case), dtype)


@pytest.mark.parametrize("name", sorted(PINNED))
def test_peer_column_classifies_cells_as_pinned(name: str) -> None:
    peer = peers.get(name)
    if not peer.available():
        pytest.skip(f"{name} needs {', '.join((peer.framework, *peer.requires))}: {peer.install}")
    for (case, dtype), want in PINNED[name].items():
        cell = runner.run_peer_cell(peer, _expected(case, dtype))
        got = (cell.status, cell.detail) if isinstance(want, tuple) else cell.status
        assert got == want, f"{name} on {case} {dtype}: {cell.status}: {cell.detail}"


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
                        hypothesis=0, progress=False)
    assert [c.name for c in result.columns] == ["numpy"]
    assert result.missing == {"ghost.attention": INSTALL}
    assert [c.status for c in result.cells] == ["ok"]


def test_worker_messages_keep_dtype_and_bits() -> None:
    import ml_dtypes

    arrays = {"q": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
              "b": (np.arange(4) / 3).astype(ml_dtypes.bfloat16),
              "m": np.array([[True, False]])}
    back, header = decode(encode(arrays, {"is_causal": True, "scale": 0.25}))
    assert header == {"is_causal": True, "scale": 0.25}
    for name, x in arrays.items():
        assert back[name].dtype == x.dtype and back[name].shape == x.shape
        assert back[name].tobytes() == x.tobytes()


def test_a_keras_worker_that_cannot_start_is_an_error_cell_once() -> None:
    if importlib.util.find_spec("keras") is None:  # importing needs KERAS_BACKEND: find it
        pytest.skip(f"needs keras: {INSTALL}")
    bogus = peers.Peer("keras[bogus]", "keras", INSTALL,
                       functools.partial(keras_ops.keras_attention, "bogus"))
    try:
        first = runner.run_peer_cell(bogus, _expected("self", "float32"))
        assert first.status == "error"
        assert "cannot import Keras" in first.detail and "bogus" in first.detail
        failed = keras_ops._WORKERS["bogus"]
        second = runner.run_peer_cell(bogus, _expected("cross", "float32"))
        assert second.status == "error" and keras_ops._WORKERS["bogus"] is failed  # no restart
    finally:
        keras_ops._WORKERS.pop("bogus", None)
