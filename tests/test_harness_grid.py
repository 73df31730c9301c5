"""The conformance harness run on every backend, and the inputs and expected values it uses.

* Every installed backend × every case × every dtype goes through ``runner.run_cell``, the code
  the CLI uses; the entries of ``spec.KNOWN_DIFFERENCES`` are well formed (every
  peer differs only where they say: ``tests/test_peers.py``).
* The seed example reproduces the article; every backend adapter hands its backend exactly the
  seeded inputs, bit for bit.
* The non-finite cases follow the spec's IEEE rule in the float64 reference and the naive
  baseline (NaN where, and what is unspecified).
"""

from __future__ import annotations

import numpy as np
import pytest
from harness_helpers import _expected

from conformance import peers, spec
from conformance.cases import catalogue as cases
from conformance.cases import expected
from conformance.running import backends, runner
from conformance.spec import seed_example

NON_FINITE = [c.name for c in cases.CASES if not c.data().finite]


# ------------------------------------------------------------------------------ full grid


@pytest.mark.parametrize("dtype", backends.DTYPES)
@pytest.mark.parametrize("case", cases.CASE_NAMES)
@pytest.mark.parametrize("backend", [  # the JAX column lowers a program per step: slow
    pytest.param(name, marks=pytest.mark.slow) if name == "jax" else name
    for name in backends.SPEC_BACKENDS], indirect=True)
def test_backend_conforms(backend: backends.Backend, case: str, dtype: str) -> None:
    cell = runner.run_cell(backend, _expected(case, dtype))
    assert cell.status == "ok", f"{cell.detail}\nrerun: {cell.rerun}"
    assert cell.ratio is not None and cell.ratio <= 1.0


def test_known_differences_are_well_formed() -> None:
    for peer, entries in spec.KNOWN_DIFFERENCES.items():
        assert peer in {p.name for p in peers.PEERS}
        shorts = [entry.get("short", entry["differs"]) for entry in entries]
        assert len(set(shorts)) == len(shorts), peer  # the report finds an entry by its short
        for entry in entries:
            assert {"cases", "differs", "why"} <= set(entry)
            patterns = [entry["cases"]] if isinstance(entry["cases"], str) else entry["cases"]
            assert all(cases.select([p]) for p in patterns)


def test_seed_example_reproduces_the_article() -> None:
    exp = _expected("seed_example", "float64")
    np.testing.assert_allclose(exp.values["weights"], seed_example.ARTICLE["attn_weights"],
                               atol=seed_example.PRINTED_ATOL)
    module = _expected("module_self_attention", "float32")
    np.testing.assert_allclose(module.values["output"], seed_example.ARTICLE["self_attention"],
                               atol=seed_example.PRINTED_ATOL)


def test_every_backend_receives_the_seeded_inputs_bit_for_bit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each installed adapter is spied on while a case runs: the arrays its backend receives,
    read back, are the case's seeded inputs, bit for bit and dtype for dtype."""
    case, dtype = cases.get("mask_and_bias"), "bfloat16"
    seeded = cases.prepare_inputs(case, dtype)
    assert seeded.arrays["query"].dtype == backends.numpy_dtype("bfloat16")
    again = cases.prepare_inputs(case, dtype)  # the seed comes from the name: same bits again
    assert all(again.arrays[n].tobytes() == a.tobytes() for n, a in seeded.arrays.items())
    installed = [backends.get(n) for n in backends.SPEC_BACKENDS if backends.get(n).available()]
    received: dict[str, set[tuple[str, bytes]]] = {}
    for backend in installed:
        seen: list[object] = []
        convert = backend.asarray
        monkeypatch.setattr(backend, "asarray", lambda x, c=convert, s=seen: s.append(c(x))
                            or s[-1])
        cell = runner.run_cell(backend, expected.expected(case, dtype))
        monkeypatch.undo()
        assert cell.status == "ok", cell.detail
        got = {(np.asarray(x).dtype.name, np.asarray(x).tobytes())
               for x in map(backend.to_numpy, seen)}
        for name in ("query", "key", "value", "mask", "bias"):
            x = seeded.arrays[name]
            assert (x.dtype.name, x.tobytes()) in got, f"{backend.name} never received {name}"
        received[backend.name] = got
    assert len({frozenset(g) for g in received.values()}) == 1, "backends received different bits"


# ------------------------------------------------------------------------------ NaN and Inf


def test_non_finite_cases_follow_the_ieee_rule_in_the_reference() -> None:
    """Where the reference (float64) and the naive baseline put NaN, and what is unspecified."""
    nan_rows = {name: np.isnan(_expected(name, "float32").values["output"]).any(-1)
                for name in NON_FINITE}
    query = np.zeros((2, 4, 5), bool)
    query[0, 1, 2] = True  # the NaN query row, nothing else
    np.testing.assert_array_equal(nan_rows["nan_query"], query)
    assert not nan_rows["nan_key_masked"].any()  # masked: reaches nothing
    inf = np.zeros((2, 4, 5), bool)
    inf[0, 0] = True  # every causal row of head 0 attends key 0, whose scores are +inf
    np.testing.assert_array_equal(nan_rows["inf_key"], inf)
    exp = _expected("nan_value_causal", "float32")
    unspecified = exp.unspecified["output"]
    assert unspecified[1, 0, :2, 2].all() and unspecified.sum() == 2  # rows 0-1 skip key 2
    assert np.isnan(exp.values["output"][1, 0, 2:, 2]).all()
    for name in NON_FINITE:
        for dtype in backends.DTYPES:
            exp = _expected(name, dtype)
            naive = expected.pipeline(exp.data, "sdpa", dtype, naive=True)
            for step in ("scores", "masked_scores", "weights", "output"):
                free = exp.unspecified.get(step, np.zeros(exp.values[step].shape, bool))
                np.testing.assert_array_equal(np.isnan(naive[step]) & ~free,
                                              np.isnan(exp.values[step]) & ~free,
                                              err_msg=f"{name} {dtype} {step}")
            assert not set(expected.GRAD_STEPS) & set(exp.values), name  # no gradients here

