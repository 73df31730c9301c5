"""The conformance command line: pass with JSON, Markdown and plots; exit code 2 only for a
mistake in the command, a traceback for a bug; a closed pipe; the default run holds cells,
errors and properties; golden vectors round-trip through ``export`` and ``check`` (a corrupted
file is refused).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness_helpers import NEEDS_HYPOTHESIS, _expected
from subprocesses import timeout

from conformance import golden
from conformance.__main__ import main
from conformance.cases import catalogue as cases
from conformance.comparing import results
from conformance.reporting import overview, sections
from conformance.running import backends, profiles, properties, runner

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ CLI


@pytest.mark.slow
def test_cli_pass_json_markdown_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib: pip install matplotlib")
    code = main(["run", "--backend", "numpy", "--case", "causal_*", "--case", "seed_example",
                 "--dtype", "float32", "--dtype", "float16", "--json", str(tmp_path / "r.json"),
                 "--markdown", str(tmp_path / "r.md"), "--plot", str(tmp_path / "plots")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ok " in out and out.strip().splitlines()[-1].startswith("PASS:")
    assert "r = worst |actual - expected| / bound" in " ".join(out.split())  # r is explained
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


def test_exit_0_needs_something_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture) -> None:
    """A run that checks nothing is exit 2 with a one-line reason, never a PASS; counts below
    their minimum are usage errors in every subcommand; a golden selection of nothing is 2."""
    (tmp_path / "declines_all.py").write_text(
        "UNSUPPORTED = ('float64', 'float32', 'bfloat16', 'float16')\n"
        "def scaled_dot_product_attention(query, key, value, **kwargs):\n"
        "    raise NotImplementedError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--backend", "declines_all", "--case", "self", "--dtype", "float32"]
    assert main([*argv, "--no-errors"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: nothing was checked") and err.count("\n") == 1
    assert main(["--backend", "numpy", "--case", "self", "--dtype", "float32",
                 "--no-errors"]) == 0
    for argv in (["repeat", "--threads", "0"], ["repeat", "--rounds", "0"],
                 ["context-parallel", "--world-size", "0"], ["--hypothesis", "-1"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2, argv
        assert "below the minimum" in capsys.readouterr().err
    golden.export(tmp_path / "g", ["self"], ["float32"])
    assert main(["check", str(tmp_path / "g"), "--backend", "numpy", "--case", "slef"]) == 2
    assert "selects no file" in capsys.readouterr().err


def test_cli_internal_faults_are_not_user_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyError inside the harness is a bug: it propagates (a traceback, exit 1)."""

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("masked_scores")

    monkeypatch.setattr(runner, "run", broken)
    with pytest.raises(KeyError, match="masked_scores"):
        main(["--backend", "numpy", "--case", "self"])


@pytest.mark.slow
def test_cli_list_into_a_closed_pipe_exits_quietly() -> None:
    proc = subprocess.run(f"{sys.executable} -m conformance --list | head -1", shell=True,
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout(120))
    assert proc.stdout.startswith("self "), proc.stdout
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_default_run_holds_cells_errors_and_properties(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad-input and property checks run from the runner and land in the same RunResult."""
    pytest.importorskip("hypothesis", reason=NEEDS_HYPOTHESIS)
    asked = []

    def fake_properties(backend_list: list, n: int) -> results.PropertyResult:
        asked.append(n)
        return results.PropertyResult(n, [results.BackendProperties(b.name, n)
                                          for b in backend_list])

    monkeypatch.setattr(properties, "run", fake_properties)
    result = runner.run(["numpy"], peers=False, profile="full")  # no --case, no --dtype
    assert asked == [profiles.FULL_PROPERTY_EXAMPLES]
    assert result.ok and result.errors and result.properties is not None
    assert len(result.cells) == len(cases.CASES) * len(backends.DTYPES)
    text = overview.full(result)
    assert "errors: " in text and "hypothesis · numpy: ok" in text
    assert runner.run(["numpy"], ["self"], peers=False).properties is None  # a selection: off


# ------------------------------------------------------------------------------ golden


@pytest.mark.slow
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
    assert f"python -m conformance check {tmp_path} --backend examples.wrong_attention" in \
        " ".join(out.replace("\\\n", "").split())  # a long command is broken with \\
    victim = tmp_path / "gqa__float32.npz"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(golden.GoldenError, match="checksum"):
        golden.verify(tmp_path)
    assert main(["check", str(tmp_path), "--backend", "numpy"]) == 2


def test_a_peers_only_run_says_so_instead_of_counting_no_backend_cells() -> None:
    """``--backend torch.sdpa`` alone: the summary names the run as peers only (the peers
    never decide the verdict), not "0/0 backend cells pass"."""
    pytest.importorskip("torch", reason="needs torch: pip install -r requirements-test.txt")
    from conformance.running import runner

    result = runner.run(["torch.sdpa"], ["self"], ["float32"], hypothesis=0, progress=False)
    line = sections.summary(result)
    assert "0/0 backend cells" not in line, line
    assert "no backend column (peers only" in line and "peers: 1 ok" in line, line
