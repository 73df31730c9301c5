"""The conformance harness, tested by running it.

* Every installed backend × every case × every dtype goes through ``harness.run_cell``, the code
  the CLI uses (the full grid: ~340 cells per backend, a few seconds each with JAX compiled).
* Meta-tests plant classic bugs in a fake backend (numpy_attn with one flaw) and check that the
  harness fails exactly the cases that expose each bug and names the bug.
* Golden vectors round-trip; the CLI's exit codes; the property mode finds a planted bug and
  prints a runnable reproducer; the harness imports no framework at import time.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import numpy_attn
from conformance import backends, cases, golden, harness, peers, properties, seed_example, spec
from conformance.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def _expected(case: str, dtype: str) -> harness.Expected:
    return harness.expected(cases.get(case), dtype)


# ------------------------------------------------------------------------------ full grid


@pytest.mark.parametrize("dtype", backends.DTYPES)
@pytest.mark.parametrize("case", cases.CASE_NAMES)
def test_backend_conforms(backend: backends.Backend, case: str, dtype: str) -> None:
    cell = harness.run_cell(backend, _expected(case, dtype))
    assert cell.status == "ok", f"{cell.detail}\nrerun: {cell.rerun}"
    assert cell.ratio is not None and cell.ratio <= 1.0


def test_peers_differ_only_where_known() -> None:
    """Every peer cell passes, is n/a, or is a documented known difference (float32 subset)."""
    available = [p for p in peers.PEERS if p.available()]
    if not available:
        pytest.skip("no framework installed for the peers")
    for case in cases.CASE_NAMES:
        for peer in available:
            cell = peer.run_cell(_expected(case, "float32"))
            if cell.status in ("FAIL", "error"):
                assert harness.known_difference(peer.name, case, "float32") is not None, (
                    f"{peer.name} on {case}: {cell.detail}")


def test_known_differences_are_well_formed() -> None:
    for peer, entries in spec.KNOWN_DIFFERENCES.items():
        assert peer in {p.name for p in peers.PEERS}
        for entry in entries:
            assert {"cases", "differs", "why"} <= set(entry)
            patterns = [entry["cases"]] if isinstance(entry["cases"], str) else entry["cases"]
            assert all(cases.select([p]) for p in patterns)


def test_seed_example_reproduces_the_article() -> None:
    exp = _expected("seed_example", "float64")
    np.testing.assert_allclose(exp.values["weights"], seed_example.ARTICLE["attn_weights"],
                               atol=6e-5)
    module = _expected("module_self_attention", "float32")
    np.testing.assert_allclose(module.values["output"], seed_example.ARTICLE["self_attention"],
                               atol=6e-5)


def test_inputs_are_identical_across_backends_and_seeded() -> None:
    a = cases.prepare_inputs(cases.get("mask_and_bias"), "bfloat16")
    b = cases.prepare_inputs(cases.get("mask_and_bias"), "bfloat16")
    for name in a.arrays:
        assert a.arrays[name].tobytes() == b.arrays[name].tobytes()
    assert a.arrays["query"].dtype == backends.numpy_dtype("bfloat16")


# ------------------------------------------------------------------------------ planted bugs


def _fake(name: str, **overrides: object) -> backends.Backend:
    module = types.ModuleType(name)
    for fn in spec.FUNCTIONS + spec.MODULES:
        if hasattr(numpy_attn, fn):
            setattr(module, fn, getattr(numpy_attn, fn))
    for key, value in overrides.items():
        setattr(module, key, value)
    return backends.from_module(module, name=name)


def _wrap(transform):  # noqa: ANN001, ANN202 - test helper
    """mask_scores and scaled_dot_product_attention with kwargs transformed."""

    def mask_scores(scores, **kw):  # noqa: ANN001, ANN202
        return numpy_attn.mask_scores(scores, **transform(kw))

    def sdpa(q, k, v, **kw):  # noqa: ANN001, ANN202
        return numpy_attn.scaled_dot_product_attention(q, k, v, **transform(kw))

    return {"mask_scores": mask_scores, "scaled_dot_product_attention": sdpa}


def _flip_mask(kw: dict) -> dict:
    if kw.get("mask") is not None:
        kw["mask"] = ~np.asarray(kw["mask"])
    return kw


def _top_left(kw: dict) -> dict:
    kw["causal_alignment"] = "top_left"
    return kw


def _composed(softmax):  # noqa: ANN001, ANN202
    """attention_weights and a scaled_dot_product_attention built on a given softmax."""

    def weights(scores):  # noqa: ANN001, ANN202
        return softmax(np.asarray(scores).astype(np.float32 if scores.dtype != np.float64
                                                 else np.float64))

    def sdpa(q, k, v, *, mask=None, bias=None, is_causal=False, causal_alignment="top_left",
             window=None, scale=None, softcap=None, dropout_p=0.0, dropout_mask=None, rng=None,
             return_weights=False):  # noqa: ANN001, ANN202
        s = numpy_attn.attention_scores(q, k, scale=scale, softcap=softcap)
        s = numpy_attn.mask_scores(s, mask=mask, bias=bias, is_causal=is_causal,
                                   causal_alignment=causal_alignment, window=window)
        w = weights(s)
        kept = numpy_attn.apply_dropout(w, dropout_p, dropout_mask=dropout_mask) if dropout_p else w
        out = numpy_attn.attention_output(kept, v).astype(q.dtype)
        return (out, w.astype(q.dtype)) if return_weights else out

    return {"attention_weights": weights, "scaled_dot_product_attention": sdpa}


def _softmax_no_max(s: np.ndarray) -> np.ndarray:
    e = np.exp(s)
    return e / e.sum(-1, keepdims=True)


def _softmax_nan_rows(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _tile_heads(q: np.ndarray, kv: np.ndarray) -> np.ndarray:
    if q.ndim < 3 or kv.shape[-3] == q.shape[-3]:
        return kv
    reps = [1] * kv.ndim
    reps[-3] = q.shape[-3] // kv.shape[-3]
    return np.tile(kv, reps)  # query head h meets kv head h % kv_heads


def _gqa_modulo() -> dict:
    def scores(q, k, **kw):  # noqa: ANN001, ANN202
        return numpy_attn.attention_scores(q, _tile_heads(q, k), **kw)

    def output(w, v):  # noqa: ANN001, ANN202
        return numpy_attn.attention_output(w, _tile_heads(w, v))

    def sdpa(q, k, v, **kw):  # noqa: ANN001, ANN202
        return numpy_attn.scaled_dot_product_attention(q, _tile_heads(q, k), _tile_heads(q, v),
                                                       **kw)

    return {"attention_scores": scores, "attention_output": output,
            "scaled_dot_product_attention": sdpa}


PLANTED = {
    # bug: (overrides, cases that must fail, cases that must pass, words of the diagnosis)
    "mask_polarity": (_wrap(_flip_mask), {"padding", "mask_and_bias", "fully_masked_rows"},
                      {"self", "causal_bottom_right", "gqa"}, "mask polarity flipped"),
    "top_left_for_bottom_right": (
        _wrap(_top_left),
        {"causal_bottom_right", "causal_bottom_right_q_longer", "window_causal_bottom_right"},
        {"causal_top_left", "causal_top_left_q_longer", "mask_and_bias"},
        "wrong causal alignment"),
    "softmax_without_max": (_composed(_softmax_no_max), {"huge_logits"},
                            {"self", "bias", "gqa"}, "overflows"),
    "nan_on_empty_rows": (_composed(_softmax_nan_rows),
                          {"fully_masked_rows", "padding", "causal_bottom_right_q_longer"},
                          {"self", "huge_logits", "causal_top_left"}, "NaN"),
    "gqa_modulo": (_gqa_modulo(), {"gqa", "three_d_gqa_causal"}, {"mqa", "self", "padding"},
                   "grouped-query mapping"),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bug_is_caught_and_named(bug: str) -> None:
    overrides, must_fail, must_pass, words = PLANTED[bug]
    fake = _fake(f"fake_{bug}", **overrides)
    for dtype in ("float64", "float32"):
        cells = {c: harness.run_cell(fake, _expected(c, dtype)) for c in must_fail | must_pass}
        failed = {c for c, cell in cells.items() if cell.status != "ok"}
        assert failed == must_fail, f"{bug} {dtype}: failed {sorted(failed)}"
        for c in must_fail:
            assert words in cells[c].detail, f"{bug} {dtype} {c}: {cells[c].detail}"
            assert f"--case {c} --dtype {dtype} --backend fake_{bug}" in cells[c].rerun


def test_report_names_failing_cases_and_exit_code(capsys: pytest.CaptureFixture) -> None:
    code = main(["--backend", "examples.wrong_attention", "--dtype", "float32", "--no-errors"])
    out = capsys.readouterr().out
    assert code == 1
    for case in ("padding", "mask_and_bias", "causal_bottom_right"):
        assert f"examples.wrong_attention · {case} · float32" in out
    assert "mask polarity flipped" in out and "wrong causal alignment" in out
    assert "python -m conformance --case padding --dtype float32 --backend " \
           "examples.wrong_attention" in out
    assert out.strip().splitlines()[-1].startswith("FAIL:")


# ------------------------------------------------------------------------------ CLI


def test_cli_pass_json_markdown_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["run", "--backend", "numpy", "--case", "causal_*", "--case", "seed_example",
                 "--dtype", "float32", "--dtype", "float16", "--json", str(tmp_path / "r.json"),
                 "--markdown", str(tmp_path / "r.md"), "--plot", str(tmp_path / "plots")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ok " in out and out.strip().splitlines()[-1].startswith("PASS:")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["ok"] and len(data["cells"]) == 10
    assert "| causal_top_left | float32 |" in (tmp_path / "r.md").read_text()
    assert (tmp_path / "plots" / "weights_seed_example.png").is_file()
    assert (tmp_path / "plots" / "errors_numpy.png").is_file()


def test_cli_unknown_case_and_missing_backend(capsys: pytest.CaptureFixture) -> None:
    assert main(["--case", "no_such_case", "--backend", "numpy"]) == 2
    assert main(["--backend", "no_such_module_xyz", "--case", "self"]) == 2
    err = capsys.readouterr().err
    assert "no_such_module_xyz" in err and "install" in err


def test_harness_imports_no_framework() -> None:
    code = ("import sys; import conformance.__main__, conformance.harness, conformance.report, "
            "conformance.peers, conformance.golden, conformance.errors, conformance.properties; "
            "from conformance.__main__ import main; "
            "main(['--backend', 'numpy', '--case', 'self', '--dtype', 'float32', '--no-peers']); "
            "bad = [m for m in ('jax', 'torch', 'matplotlib', 'hypothesis') if m in sys.modules]; "
            "sys.exit(len(bad))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------ golden


def test_golden_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    files = golden.export(tmp_path, ["mask_and_bias", "gqa", "module_multihead_attention",
                                     "window_causal_bottom_right"], None)
    assert len(files) == 16
    with np.load(files[0], allow_pickle=False) as z:  # no pickles anywhere
        assert "meta" in z.files
    loaded = golden.load(tmp_path / "gqa__bfloat16.npz")
    fresh = _expected("gqa", "bfloat16")
    assert loaded.data.arrays["query"].tobytes() == fresh.data.arrays["query"].tobytes()
    assert main(["check", str(tmp_path), "--backend", "numpy"]) == 0
    assert main(["check", str(tmp_path), "--backend", "examples.wrong_attention"]) == 1
    assert "mask polarity flipped" in capsys.readouterr().out
    victim = tmp_path / "gqa__float32.npz"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(golden.GoldenError, match="checksum"):
        golden.verify(tmp_path)
    assert main(["check", str(tmp_path), "--backend", "numpy"]) == 2


# ------------------------------------------------------------------------------ properties


def test_properties_pass_on_numpy() -> None:
    result = properties.run([backends.get("numpy")], 40)
    assert result.passed, result.text()
    assert result.backends[0].examples >= 40


def test_properties_shrink_a_planted_bug_to_runnable_code(capsys: pytest.CaptureFixture) -> None:
    fake = _fake("fake_mask_polarity_prop", **_wrap(_flip_mask))
    backends._CACHE[fake.name] = fake  # so the reproducer's backends.load finds it
    try:
        result = properties.run([fake], 60)
        assert not result.passed
        code = result.backends[0].reproducer
        assert "scaled_dot_product_attention(" in code and "mask" in code
        exec(compile(code, "<reproducer>", "exec"), {})  # runs as printed
        assert "output - reference" in capsys.readouterr().out
    finally:
        backends._CACHE.pop(fake.name, None)
