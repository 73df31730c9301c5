"""Checking a module of the user's: the contract (``conformance.running.plugins``), the focused
verdict (``conformance.reporting.terminal``, ``conformance.reporting.shrink``), and the command line
on a NumPy-only machine.

* a module defining ``scaled_dot_product_attention`` alone passes with a short report that
  lists what it does not provide once; declared-unsupported features and
  ``NotImplementedError`` are unsupported, not failed; ``LAYOUT = "bshd"`` is transposed;
* a wrong module's first line names the bug; each group of failures comes with the smallest
  failing case as a script that runs; ``--verbose`` prints every cell; golden ``check`` too;
* a module whose import fails shows the real traceback, exit code 2;
* with torch, jax, matplotlib and hypothesis blocked, every command works or says in one line
  what to install, before doing any work (exit code 2).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
from subprocesses import timeout

import numpy_attn
from conformance import golden
from conformance.__main__ import main
from conformance.cases import catalogue as cases
from conformance.comparing.results import Cell, Column, RunResult
from conformance.reporting import json_report, terminal
from conformance.running import backends, plugins, runner

ROOT = Path(__file__).resolve().parents[1]
#: Property examples where Hypothesis is installed (its absence is tested below).
EXAMPLES = 20 if importlib.util.find_spec("hypothesis") else 0


def _module(name: str, **attrs: object) -> backends.Backend:
    """A registered checked module holding ``attrs`` (``backends.load(name)`` finds it)."""
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    return backends.register(backends.from_module(module, name=name))


@pytest.fixture
def registered():  # noqa: ANN201 - yields a function
    names: list[str] = []

    def make(name: str, **attrs: object) -> backends.Backend:
        names.append(name)
        return _module(name, **attrs)

    yield make
    for name in names:
        backends.unregister(name)


@pytest.mark.slow
def test_sdpa_only_passes_with_a_short_report(tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    code = main(["--backend", "examples.sdpa_only", "--full", "--hypothesis", str(EXAMPLES),
                 "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert code == 0, out
    assert lines[0].startswith("PASS: examples.sdpa_only") and lines[-1].startswith("PASS:")
    # a row per case in the table (those it declares unsupported too), 22 lines around it
    assert len(lines) <= len(cases.CASES) + 22, f"{len(lines)} lines"
    assert out.count("not provided (optional): causal_mask") == 1
    assert [line for line in lines if "FAIL" in line or "error:" in line] == [
        next(line for line in lines if "FAIL f16: fails in float16" in line)]  # the legend
    for feature in ("mask", "bottom_right", "grouped_query", "float16", "return_weights"):
        assert feature in out.split("features checked:")[1].split("declared")[0]
    plugin = json.loads((tmp_path / "r.json").read_text())["plugins"]["examples.sdpa_only"]
    assert plugin["layout"] == "bhsd" and plugin["unsupported"] == [
        "alibi", "chunked", "mask_mod", "score_mod", "segments"]  # examples/sdpa_only.py
    assert plugin["not_provided"][:2] == ["causal_mask", "sliding_window_mask"]


def test_unsupported_and_not_implemented_are_not_failures(registered) -> None:  # noqa: ANN001
    def sdpa(q, k, v, *, window=None, **kw):  # noqa: ANN001, ANN202
        if window is not None:
            raise NotImplementedError("no sliding window")
        return numpy_attn.scaled_dot_product_attention(q, k, v, **kw)

    registered("fake_partial", scaled_dot_product_attention=sdpa,
               UNSUPPORTED={"softcap", "float16"})
    result = runner.run(["fake_partial"], ["self", "softcap", "window", "gqa"],
                        ["float32", "float16"], check_errors=False, hypothesis=EXAMPLES)
    status = {(c.case, c.dtype): c.status for c in result.cells}
    assert status == {
        ("self", "float32"): "ok", ("gqa", "float32"): "ok",
        ("softcap", "float32"): "unsupported", ("window", "float32"): "unsupported",
        **{(case, "float16"): "unsupported" for case in ("self", "softcap", "window", "gqa")},
    }
    assert result.ok and (result.properties is None) == (EXAMPLES == 0)
    assert result.properties is None or result.properties.passed
    text = terminal.text(result)
    assert text.startswith("PASS: fake_partial")
    assert "declared unsupported: softcap, float16" in text
    assert "raised NotImplementedError: 1 case: window" in text
    checked = text.split("features checked:")[1].split("\n  declared")[0]
    assert "grouped_query" in checked and "softcap" not in checked and "float16" not in checked


def _swap(x: np.ndarray) -> np.ndarray:
    return x if x.ndim < 3 else np.swapaxes(x, -3, -2)


def _seq_first_sdpa(q, k, v, **kw):  # noqa: ANN001, ANN202
    """numpy_attn on (..., seq, heads, dim) inputs; fails on anything else."""
    result = numpy_attn.scaled_dot_product_attention(_swap(q), _swap(k), _swap(v), **kw)
    if isinstance(result, tuple):
        return _swap(result[0]), result[1]
    return _swap(result)


def test_bshd_layout_is_transposed_for_the_module(registered) -> None:  # noqa: ANN001
    cases = ["gqa", "three_d_gqa_causal", "two_d", "cross"]
    registered("fake_bshd", scaled_dot_product_attention=_seq_first_sdpa, LAYOUT="bshd")
    good = runner.run(["fake_bshd"], cases, ["float32"], check_errors=False, hypothesis=0)
    assert {c.case: c.status for c in good.cells} == dict.fromkeys(cases, "ok")
    registered("fake_bshd_undeclared", scaled_dot_product_attention=_seq_first_sdpa)
    bad = runner.run(["fake_bshd_undeclared"], cases, ["float32"], check_errors=False,
                     hypothesis=0)  # the same function without LAYOUT: 3-D and 4-D cases fail
    assert {c.case for c in bad.cells if c.status != "ok"} == {"gqa", "three_d_gqa_causal",
                                                               "cross"}


def _reproducers(out: str) -> list[str]:
    """The runnable scripts of a focused report."""
    blocks = out.split("runnable:\n")[1:]
    return [textwrap.dedent("\n".join(line for line in block.split("\n   rerun:")[0]
                                      .splitlines())) for block in blocks]


@pytest.mark.slow
def test_wrong_module_verdict_names_the_bug_with_a_runnable_smallest_case(
        capsys: pytest.CaptureFixture) -> None:
    args = ["--backend", "examples.wrong_attention", "--dtype", "float32", "--no-errors"]
    assert main(args) == 1
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("FAIL: examples.wrong_attention:")
    assert "wrong causal alignment" in first and "mask polarity flipped" in first
    # nan_key_masked, the merge cases, combined_masked_dropout and the top-left pairs case too
    assert "1. mask · examples.wrong_attention: 11 cases" in out
    assert "2. causal, bottom_right · examples.wrong_attention" in out
    assert "query (1, 1, 1, 1)" in out  # shrunk from (2, 4, 5, 8)
    scripts = _reproducers(out)
    assert len(scripts) == 3  # and the pairs case with both bugs at once (no diagnosis)
    for script in scripts:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(script, "<reproducer>", "exec"), {})
        actual, expected = (line.split(":", 1)[1] for line in printed.getvalue().splitlines())
        assert actual.strip() != expected.strip(), script  # it reproduces the difference
    assert "examples.wrong_attention · padding · float32" not in out  # every cell: --verbose
    assert main([*args, "--verbose"]) == 1
    verbose = capsys.readouterr().out
    assert "FAIL: examples.wrong_attention · padding · float32" in verbose
    assert "not provided" not in verbose.split("examples.wrong_attention (layout")[1]


def test_golden_check_gives_the_same_focused_verdict(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    golden.export(tmp_path, ["mask_and_bias", "causal_bottom_right", "gqa"], ["float32"])
    assert main(["check", str(tmp_path), "--backend", "examples.sdpa_only"]) == 0
    assert capsys.readouterr().out.startswith("PASS: examples.sdpa_only")
    assert main(["check", str(tmp_path), "--backend", "examples.wrong_attention"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL: examples.wrong_attention: wrong causal alignment")
    assert "smallest failing case" in out
    assert f"python -m conformance check {tmp_path} --backend examples.wrong_attention" in \
        " ".join(out.replace("\\\n", "").split())  # a long command is broken with \\


def test_broken_modules_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "broken_attention.py").write_text("import nonexistent_dependency_xyz\n")
    (tmp_path / "no_sdpa_attention.py").write_text("def attention_scores(q, k): pass\n")
    (tmp_path / "odd_attention.py").write_text(
        "UNSUPPORTED = {'softcap', 'flash'}\ndef scaled_dot_product_attention(q, k, v): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["--backend", "broken_attention", "--case", "self"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "broken_attention.py" in err
    assert "No module named 'nonexistent_dependency_xyz'" in err
    assert err.strip().splitlines()[-1] == "error: importing 'broken_attention' failed " \
                                          "(traceback above)"
    assert main(["--backend", "no_sdpa_attention", "--case", "self"]) == 2
    assert "defines no scaled_dot_product_attention" in capsys.readouterr().err
    assert main(["--backend", "odd_attention", "--case", "self"]) == 2
    err = capsys.readouterr().err
    assert "UNSUPPORTED names flash" in err and err.count("\n") == 1


def test_json_keeps_the_counts_of_every_peer_column() -> None:
    """Generic over whatever peers exist: one entry per peer column, ok/known/n/a/unexpected."""
    statuses = ["ok", "known", "n/a", "FAIL", "error", "ok"]
    cells = [Cell(f"case{i}", "float32", "some.peer", status=s, spec_backend=False)
             for i, s in enumerate(statuses)]
    data = json_report.to_dict(RunResult([Column("some.peer", "peer")], cells, {}, []))
    assert data["peers"] == {"some.peer": {"ok": 2, "known": 1, "n/a": 1, "unexpected": 2}}


def test_features_name_only_spec_features() -> None:
    from conformance import spec
    from conformance.cases import catalogue as cases

    for case in cases.CASES:
        data = case.data()
        used = plugins.features(data.arrays, data.options, "float32", data.finite)
        assert used <= set(spec.PLUGIN_FEATURES), case.name
    bottom_right = cases.get("causal_bottom_right").data()
    assert {"causal", "bottom_right", "float32"} <= plugins.features(
        bottom_right.arrays, bottom_right.options, "float32")


# ------------------------------------------------------------------------------ NumPy only

_BLOCKED = ("torch", "jax", "jaxlib", "matplotlib", "hypothesis", "keras", "flax",
            "transformers", "onnx", "onnxruntime")
_SHIM = f"""
import contextlib, io, json, sys
for name in {_BLOCKED!r}:
    sys.modules[name] = None  # import name -> ImportError; find_spec(name) -> None
from conformance.__main__ import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    results.append({{"code": code, "out": out.getvalue(), "err": err.getvalue()}})
print(json.dumps(results))
"""


@pytest.mark.slow
def test_numpy_only_every_command_works_or_names_the_install(tmp_path: Path) -> None:
    gold, plots = tmp_path / "golden", tmp_path / "plots"
    commands = {
        "export": ["export", str(gold), "--case", "self", "--dtype", "float32"],
        "numpy": ["--backend", "numpy", "--case", "self", "--dtype", "float32"],
        "plugin": ["--backend", "examples.sdpa_only", "--case", "self", "--dtype", "float32"],
        "torch": ["--backend", "torch", "--case", "self"],
        "peer": ["--backend", "jax.nn", "--case", "self"],
        "hypothesis": ["--backend", "numpy", "--case", "self", "--hypothesis", "5"],
        "plot": ["--backend", "numpy", "--case", "self", "--plot", str(plots)],
        "walkthrough_torch": ["walkthrough", "--backend", "torch"],
        "check_jax": ["check", str(gold), "--backend", "jax"],
        "check_numpy": ["check", str(gold), "--backend", "numpy"],
        "pictures": ["pictures", str(plots)],
        "context_parallel": ["context-parallel"],
        "repeat_torch": ["repeat", "--backend", "torch"],
    }
    proc = subprocess.run([sys.executable, "-c", _SHIM, json.dumps(list(commands.values()))],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout(120))
    assert proc.returncode == 0, proc.stderr
    got = dict(zip(commands, json.loads(proc.stdout.splitlines()[-1]), strict=True))
    for name in ("export", "numpy", "plugin", "check_numpy"):
        assert got[name]["code"] == 0, (name, got[name])
    installs = {"torch": "pip install torch==2.13.0", "peer": "install",
                "hypothesis": "pip install hypothesis", "plot": "pip install matplotlib",
                "walkthrough_torch": "pip install torch==2.13.0", "check_jax": "pip install jax",
                "pictures": "pip install matplotlib", "context_parallel": "pip install jax",
                "repeat_torch": "pip install torch==2.13.0"}
    for name, install in installs.items():
        res = got[name]
        assert res["code"] == 2 and res["out"] == "", (name, res)  # before any work
        assert res["err"].startswith("error: ") and res["err"].count("\n") == 1, (name, res)
        assert install in res["err"], (name, res)
    assert "pip install torch\n" not in proc.stdout and not plots.exists()


def test_the_module_in_docs_checking_passes(registered) -> None:  # noqa: ANN001
    """The minimal module of docs/checking.md, run as the page says."""
    doc = (ROOT / "docs" / "checking.md").read_text(encoding="utf-8")
    code = doc.split("```python\n")[1].split("```")[0]
    namespace: dict[str, object] = {}
    exec(compile(code, "docs/checking.md", "exec"), namespace)
    registered("doc_attention", **{k: v for k, v in namespace.items()
                                   if k in ("LAYOUT", "UNSUPPORTED",
                                            "scaled_dot_product_attention")})
    cases = ["self", "cross", "scale", "huge_logits", "nan_query", "mask_and_bias", "gqa"]
    result = runner.run(["doc_attention"], cases, ["float32", "float16"], hypothesis=0)
    assert result.ok, terminal.text(result)
    assert {c.case for c in result.cells if c.status == "ok"} == {
        "self", "cross", "scale", "huge_logits", "nan_query"}
    for profile in ("quick", "full"):  # every case: nothing it swallows goes undeclared
        result = runner.run(["doc_attention"], profile=profile, hypothesis=0)
        assert result.ok, terminal.text(result)
        assert any(c.status == "ok" for c in result.cells)
