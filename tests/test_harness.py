"""The conformance harness, tested by running it.

* Every installed backend × every case × every dtype goes through ``runner.run_cell``, the code
  the CLI uses; every peer differs only where ``spec.KNOWN_DIFFERENCES`` says so.
* Every backend adapter hands its backend exactly the seeded inputs, bit for bit.
* Meta-tests plant classic bugs in a fake backend (numpy_attn with one flaw) and check that the
  harness fails exactly the cases that expose each bug and names the bug; the non-finite cases
  catch a NaN that vanishes and a masked NaN that spreads.
* Golden vectors round-trip through the runner; the CLI's exit codes (2 only for a mistake in the
  command, a traceback for a bug); the legend; a closed pipe.
* The property checks apply the harness's rule, find a planted bug and print a runnable
  reproducer; the default run includes them.
* ``conformance`` imports run one way, use no other module's private names, and import no
  framework.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import numpy_attn
from conformance import (
    backends,
    cases,
    expected,
    golden,
    peers,
    properties,
    report,
    results,
    runner,
    seed_example,
    spec,
)
from conformance.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "conformance"
NON_FINITE = [c.name for c in cases.CASES if not c.data().finite]
NEEDS_HYPOTHESIS = "needs hypothesis: pip install -e '.[test]'"


@functools.cache
def _expected(case: str, dtype: str) -> expected.Expected:
    return expected.expected(cases.get(case), dtype)


# ------------------------------------------------------------------------------ full grid


@pytest.mark.parametrize("dtype", backends.DTYPES)
@pytest.mark.parametrize("case", cases.CASE_NAMES)
def test_backend_conforms(backend: backends.Backend, case: str, dtype: str) -> None:
    cell = runner.run_cell(backend, _expected(case, dtype))
    assert cell.status == "ok", f"{cell.detail}\nrerun: {cell.rerun}"
    assert cell.ratio is not None and cell.ratio <= 1.0


def test_peers_differ_only_where_known() -> None:
    """Every peer cell passes, is n/a, or is a documented known difference (float32 subset)."""
    available = [p for p in peers.PEERS if p.available()]
    if not available:
        pytest.skip("no framework installed for the peers")
    for case in cases.CASE_NAMES:
        for peer in available:
            cell = runner.run_peer_cell(peer, _expected(case, "float32"))
            assert cell.status in ("ok", "n/a", "known"), f"{peer.name} on {case}: {cell.detail}"


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


def _composed(softmax, masking=numpy_attn.mask_scores):  # noqa: ANN001, ANN202
    """attention_weights, mask_scores and a scaled_dot_product_attention built on a given
    softmax and a given masking of the scores."""

    def weights(scores):  # noqa: ANN001, ANN202
        return softmax(np.asarray(scores).astype(np.float32 if scores.dtype != np.float64
                                                 else np.float64))

    def sdpa(q, k, v, *, mask=None, bias=None, is_causal=False, causal_alignment="top_left",
             window=None, scale=None, softcap=None, dropout_p=0.0, dropout_mask=None, rng=None,
             return_weights=False):  # noqa: ANN001, ANN202
        s = numpy_attn.attention_scores(q, k, scale=scale, softcap=softcap)
        s = masking(s, mask=mask, bias=bias, is_causal=is_causal,
                    causal_alignment=causal_alignment, window=window)
        w = weights(s)
        kept = numpy_attn.apply_dropout(w, dropout_p, dropout_mask=dropout_mask) if dropout_p else w
        out = numpy_attn.attention_output(kept, v).astype(q.dtype)
        return (out, w.astype(q.dtype)) if return_weights else out

    return {"attention_weights": weights, "mask_scores": masking,
            "scaled_dot_product_attention": sdpa}


def _softmax_no_max(s: np.ndarray) -> np.ndarray:
    e = np.exp(s)
    return e / e.sum(-1, keepdims=True)


def _softmax_nan_rows(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _softmax_nan_to_zero(s: np.ndarray) -> np.ndarray:
    """A kernel that treats a row without a finite maximum like a fully masked row."""
    w = numpy_attn.attention_weights(s)
    return np.where(np.isnan(w).any(-1, keepdims=True), 0, w).astype(w.dtype)


def _mask_by_adding(scores, *, mask=None, **kw):  # noqa: ANN001, ANN202
    """Masks by adding -inf (NaN + -inf stays NaN) instead of replacing the score."""
    if mask is None:
        return numpy_attn.mask_scores(scores, **kw)
    out = numpy_attn.mask_scores(scores, **kw)
    return out + np.where(np.asarray(mask), 0, -np.inf).astype(out.dtype)


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
    "nan_row_gives_zero": (_composed(_softmax_nan_to_zero), {"nan_query", "inf_key"},
                           {"self", "nan_value", "nan_key_masked", "padding"},
                           "treated like a fully masked row"),
    "masking_adds_minus_inf": (_composed(numpy_attn.attention_weights, _mask_by_adding),
                               {"nan_key_masked"}, {"self", "padding", "nan_query"},
                               "masking must replace a masked score by -inf"),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bug_is_caught_and_named(bug: str) -> None:
    overrides, must_fail, must_pass, words = PLANTED[bug]
    fake = _fake(f"fake_{bug}", **overrides)
    for dtype in ("float64", "float32"):
        cells = {c: runner.run_cell(fake, _expected(c, dtype)) for c in must_fail | must_pass}
        failed = {c for c, cell in cells.items() if cell.status != "ok"}
        assert failed == must_fail, f"{bug} {dtype}: failed {sorted(failed)}"
        for c in must_fail:
            assert words in cells[c].detail, f"{bug} {dtype} {c}: {cells[c].detail}"
            assert f"--case {c} --dtype {dtype} --backend fake_{bug}" in cells[c].rerun


def test_report_names_failing_cases_and_exit_code(capsys: pytest.CaptureFixture) -> None:
    code = main(["--backend", "examples.wrong_attention", "--dtype", "float32", "--no-errors",
                 "--verbose"])
    out = capsys.readouterr().out
    assert code == 1
    for case in ("padding", "mask_and_bias", "causal_bottom_right"):
        assert f"examples.wrong_attention · {case} · float32" in out
    assert "mask polarity flipped" in out and "wrong causal alignment" in out
    assert "python -m conformance --case padding --dtype float32 --backend " \
           "examples.wrong_attention" in out
    assert out.strip().splitlines()[-1].startswith("FAIL:")


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


# ------------------------------------------------------------------------------ CLI


def test_cli_pass_json_markdown_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib: pip install matplotlib")
    code = main(["run", "--backend", "numpy", "--case", "causal_*", "--case", "seed_example",
                 "--dtype", "float32", "--dtype", "float16", "--json", str(tmp_path / "r.json"),
                 "--markdown", str(tmp_path / "r.md"), "--plot", str(tmp_path / "plots")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ok " in out and out.strip().splitlines()[-1].startswith("PASS:")
    assert report.legend().splitlines()[0] in out  # the number after ok/FAIL is explained
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["ok"] and len(data["cells"]) == 10
    assert "| causal_top_left | float32 |" in (tmp_path / "r.md").read_text()
    assert (tmp_path / "plots" / "weights_seed_example.png").is_file()
    assert (tmp_path / "plots" / "errors_numpy.png").is_file()


def test_cli_usage_errors_exit_2_with_one_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["--case", "no_such_case", "--backend", "numpy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no case matches no_such_case") and err.count("\n") == 1
    assert main(["--backend", "no_such_module_xyz", "--case", "self"]) == 2
    err = capsys.readouterr().err
    assert "no_such_module_xyz" in err and "install" in err


def test_cli_internal_faults_are_not_user_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyError inside the harness is a bug: it propagates (a traceback, exit 1)."""

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("masked_scores")

    monkeypatch.setattr(runner, "run", broken)
    with pytest.raises(KeyError, match="masked_scores"):
        main(["--backend", "numpy", "--case", "self"])


def test_cli_list_into_a_closed_pipe_exits_quietly() -> None:
    proc = subprocess.run(f"{sys.executable} -m conformance --list | head -1", shell=True,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.startswith("self "), proc.stdout
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_default_run_holds_cells_errors_and_properties(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad-input and property checks run from the runner and land in the same RunResult."""
    pytest.importorskip("hypothesis", reason=NEEDS_HYPOTHESIS)
    asked = []

    def fake_properties(backend_list: list, n: int) -> results.PropertyResult:
        asked.append(n)
        return results.PropertyResult(n, [results.BackendProperties(b.name, n)
                                          for b in backend_list])

    monkeypatch.setattr(properties, "run", fake_properties)
    result = runner.run(["numpy"], peers=False)  # no --case, no --dtype: a full run
    assert asked == [runner.DEFAULT_PROPERTY_EXAMPLES]
    assert result.ok and result.errors and result.properties is not None
    assert len(result.cells) == len(cases.CASES) * len(backends.DTYPES)
    text = report.text(result)
    assert "errors: " in text and "hypothesis · numpy: ok" in text
    assert runner.run(["numpy"], ["self"], peers=False).properties is None  # a selection: off


# ------------------------------------------------------------------------------ structure


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(encoding="utf-8")) for p in PACKAGE.glob("*.py")}


def _imports(tree: ast.Module, known: set[str]) -> tuple[set[str], list[str], dict[str, str]]:
    """Modules of the package a module imports (anywhere in it), the private names it imports
    from them, and its aliases for them."""
    deps, private, aliases = set(), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 0 and base.startswith("conformance"):
                base = base.removeprefix("conformance").lstrip(".")
            elif node.level != 1:
                continue
            if base:
                deps.add(base.split(".")[0])
                private += [a.name for a in node.names if a.name.startswith("_")]
            for alias in node.names:
                if not base and alias.name in known:
                    deps.add(alias.name)
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("conformance."):
                    deps.add(alias.name.split(".")[1])
    return deps, private, aliases


def test_conformance_imports_run_one_way_and_use_no_private_names() -> None:
    trees = _modules()
    known = set(trees)
    graph = {}
    for name, tree in trees.items():
        deps, private, aliases = _imports(tree, known)
        assert not private, f"{name} imports private names {private}"
        graph[name] = deps - {name, "__init__"}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                raise AssertionError(f"{name} uses {node.value.id}.{node.attr}")
    order: list[str] = []
    while graph:  # peel modules whose imports are all placed: fails on a circle
        ready = sorted(n for n, deps in graph.items() if deps <= set(order))
        assert ready, f"import circle among {sorted(graph)}"
        order += ready
        for n in ready:
            del graph[n]
    assert order.index("spec") < order.index("cases") < order.index("expected")
    assert order.index("compare") < order.index("results") < order.index("runner")
    assert order.index("report") < order.index("__main__")


def test_harness_files_stay_small() -> None:
    """A newcomer reads one concern per file; data (the spec, the case catalogue) may be long."""
    data = {"spec.py": None, "cases.py": 450}
    for path in PACKAGE.glob("*.py"):
        limit = data.get(path.name, 400)
        lines = len(path.read_text(encoding="utf-8").splitlines())
        assert limit is None or lines <= limit, f"{path.name}: {lines} lines"


def test_harness_imports_no_framework() -> None:
    """Every module of the package imports (the walkthrough and pictures too) without pulling
    in a framework; a NumPy-only run stays NumPy-only."""
    modules = ", ".join(f"conformance.{p.stem}" for p in sorted(PACKAGE.glob("*.py"))
                        if p.stem != "__init__")
    code = (f"import sys; import {modules}; "
            "from conformance.__main__ import main; "
            "main(['--backend', 'numpy', '--case', 'self', '--dtype', 'float32', '--no-peers']); "
            "bad = [m for m in ('jax', 'torch', 'matplotlib', 'hypothesis') "
            "if sys.modules.get(m) is not None]; "
            "print(bad); sys.exit(len(bad))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------ golden


def test_golden_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    files = golden.export(tmp_path, ["mask_and_bias", "gqa", "module_multihead_attention",
                                     "window_causal_bottom_right", "nan_value_causal"], None)
    assert len(files) == 20
    with np.load(files[0], allow_pickle=False) as z:  # no pickles anywhere
        assert "meta" in z.files
    loaded = golden.load(tmp_path / "gqa__bfloat16.npz")
    fresh = _expected("gqa", "bfloat16")
    assert loaded.data.arrays["query"].tobytes() == fresh.data.arrays["query"].tobytes()
    nan_case = golden.load(tmp_path / "nan_value_causal__float32.npz")
    np.testing.assert_array_equal(nan_case.unspecified["output"],
                                  _expected("nan_value_causal", "float32").unspecified["output"])
    assert main(["check", str(tmp_path), "--backend", "numpy"]) == 0
    assert "check " + str(tmp_path) not in capsys.readouterr().out  # nothing to rerun
    assert main(["check", str(tmp_path), "--backend", "examples.wrong_attention"]) == 1
    out = capsys.readouterr().out
    assert "mask polarity flipped" in out
    assert f"python -m conformance check {tmp_path} --backend examples.wrong_attention" in out
    victim = tmp_path / "gqa__float32.npz"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(golden.GoldenError, match="checksum"):
        golden.verify(tmp_path)
    assert main(["check", str(tmp_path), "--backend", "numpy"]) == 2


# ------------------------------------------------------------------------------ properties


def test_properties_pass_on_numpy() -> None:
    pytest.importorskip("hypothesis", reason=NEEDS_HYPOTHESIS)
    result = properties.run([backends.get("numpy")], 40)
    assert result.passed, result.text()
    assert result.backends[0].examples >= 40


def test_properties_apply_the_harness_rule() -> None:
    """A property example's ratio is the harness's ``compare`` ratio on the same example."""
    numpy_backend = backends.get("numpy")
    layout = next(lay for lay in properties.LAYOUTS if lay.causal)  # no permutation check
    problem = properties.Problem(layout, "float32", 10.0, False, 7)
    a, o = problem.arrays()
    exp = expected.expected_for(cases.CaseData(a, o), "sdpa", "float32", gradients=False)
    cell = runner.run_cell(numpy_backend, exp, steps=["output", "output_weights"])
    assert properties.check_problem(numpy_backend, problem) == pytest.approx(cell.ratio)


def test_properties_shrink_a_planted_bug_to_runnable_code(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("hypothesis", reason=NEEDS_HYPOTHESIS)
    fake = backends.register(_fake("fake_mask_polarity_prop", **_wrap(_flip_mask)))
    try:  # registered, so the reproducer's backends.load finds it
        result = properties.run([fake], 60)
        assert not result.passed
        code = result.backends[0].reproducer
        assert "scaled_dot_product_attention(" in code and "mask" in code
        exec(compile(code, "<reproducer>", "exec"), {})  # runs as printed
        assert "output - reference" in capsys.readouterr().out
    finally:
        backends.unregister(fake.name)
