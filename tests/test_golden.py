"""Golden folders are untrusted input: every malformed, stale, escaping or crafted folder is a
one-line ``GoldenError`` (exit code 2), never a traceback, never a silent pass.

Each test starts from a small real export (case ``self`` in float32) copied into ``tmp_path`` and
breaks it the way a careless or hostile sender could; the manifest is re-hashed where the point
is that checksums alone do not help.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from numpy.lib import format as npy_format
from subprocesses import timeout

import conformance
from conformance import golden

ROOT = Path(conformance.__file__).resolve().parents[1]  # the checkout whose package is tested
NAME = "self__float32.npz"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("export") / "golden"
    golden.export(folder, ["self"], ["float32"])
    return folder


@pytest.fixture
def gold(exported: Path, tmp_path: Path) -> Path:
    """A fresh copy of the real export: ``manifest.json`` and ``self__float32.npz``."""
    folder = tmp_path / "golden"
    shutil.copytree(exported, folder)
    return folder


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _manifest(folder: Path) -> dict:
    return json.loads((folder / golden.MANIFEST).read_text())


def _write_manifest(folder: Path, manifest: object) -> None:
    (folder / golden.MANIFEST).write_text(json.dumps(manifest))


def _rehash(folder: Path) -> None:
    """Make the manifest agree with the files again (a tamperer can always do that)."""
    manifest = _manifest(folder)
    manifest["files"] = {n: _sha(folder / n) for n in manifest["files"]}
    _write_manifest(folder, manifest)


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _rewrite(folder: Path, change: Callable[[dict[str, np.ndarray]], None]) -> Path:
    """Change the arrays of the golden file, write it back (pickles allowed) and re-hash."""
    path = folder / NAME
    arrays = _arrays(path)
    change(arrays)
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    _rehash(folder)
    return path


def _set_meta(arrays: dict[str, np.ndarray], **changes: object) -> None:
    meta = json.loads(str(arrays["meta"]))
    meta.update(changes)
    arrays["meta"] = np.array(json.dumps(meta))


def _cli_process(*args: str) -> subprocess.CompletedProcess:
    """``python -m conformance ARGS`` in a fresh interpreter."""
    return subprocess.run([sys.executable, "-m", "conformance", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout(120))


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The command line's ``main(ARGS)`` in this process, as ``_cli_process`` sees it: its exit
    code, what it printed, and an exception that escapes it as a traceback with exit code 1
    (the interpreter's behaviour). ``test_a_case_pattern_that_selects_nothing...`` runs the
    real process, so a difference between the two would show there."""
    import contextlib
    import traceback

    from conformance.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 1
        except Exception:  # noqa: BLE001 - what the interpreter would print, and exit 1
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit code 2, no traceback, exactly one line ``error: ...`` containing every needle."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------ selection


@pytest.mark.slow
def test_a_case_pattern_that_selects_nothing_exits_2_naming_the_cases(gold: Path) -> None:
    line = _assert_one_line_error(
        _cli_process("check", str(gold), "--backend", "numpy", "--case", "slef"), "slef", "self")
    assert "PASS" not in line


def test_a_dtype_that_selects_nothing_is_an_error(gold: Path) -> None:
    with pytest.raises(golden.GoldenError, match="float16.*self"):
        golden.check(gold, ["numpy"], None, ["float16"])
    with pytest.raises(golden.GoldenError, match="selects no file"):
        golden.check(gold, ["numpy"], ["self"], ["bfloat16"])


# ------------------------------------------------------------------------------ the manifest


@pytest.mark.parametrize(("manifest", "match"), [
    ({"format": 2, "files": {}}, "lists no files"),
    ({"format": 2}, 'no "files"'),
    ([{"format": 2, "files": {NAME: "0" * 64}}], "not a JSON object"),
    ({"format": 2, "files": [NAME]}, '"files" is not an object'),
    ({"format": 2, "files": {NAME: 12}}, "SHA-256"),
    ({"format": 2, "files": {NAME: "ABC"}}, "SHA-256"),
    ({"format": 2, "files": {NAME: "A" * 64}}, "SHA-256"),
], ids=["empty", "no-files", "list", "files-list", "digest-int", "digest-short", "digest-upper"])
def test_a_malformed_manifest_is_a_golden_error(gold: Path, manifest: object, match: str) -> None:
    _write_manifest(gold, manifest)
    with pytest.raises(golden.GoldenError, match=match):
        golden.check(gold, ["numpy"])


def test_a_manifest_without_files_exits_2_on_the_command_line(gold: Path) -> None:
    _write_manifest(gold, {"format": 2, "tolerances": {}})
    _assert_one_line_error(_cli("check", str(gold), "--backend", "numpy"), "manifest.json",
                           "files")


# ------------------------------------------------------------------------------ paths


def _outside_copy(gold: Path) -> Path:
    """A valid golden file next to (outside) the golden folder."""
    outside = gold.parent / "outside.npz"
    shutil.copy(gold / NAME, outside)
    return outside


@pytest.mark.parametrize("kind", ["parent", "absolute", "passwd", "not-a-case", "not-npz"])
def test_manifest_entries_must_be_plain_names_inside_the_folder(gold: Path, kind: str) -> None:
    outside = _outside_copy(gold)
    name = {"parent": "../outside.npz", "absolute": str(outside),
            "passwd": "../../../../etc/passwd", "not-a-case": "other.npz",
            "not-npz": "self__float32.zip"}[kind]
    if kind == "not-a-case":
        shutil.copy(outside, gold / name)
    digest = _sha(outside) if kind != "passwd" else "0" * 64
    _write_manifest(gold, {"format": 2, "files": {name: digest}})
    with pytest.raises(golden.GoldenError, match="entries must be plain file names") as info:
        golden.check(gold, ["numpy"])
    assert name in str(info.value)


def test_the_whole_manifest_is_validated_before_any_file_is_read(gold: Path) -> None:
    (gold / NAME).unlink()  # the first entry would fail too, but only once files are read
    _write_manifest(gold, {"format": 2, "files": {NAME: "0" * 64, "../x.npz": "0" * 64}})
    with pytest.raises(golden.GoldenError, match="path separator") as info:
        golden.verify(gold)
    assert "'../x.npz'" in str(info.value) and "missing" not in str(info.value)


def test_a_symlinked_golden_file_is_refused_unread(gold: Path) -> None:
    outside = _outside_copy(gold)
    (gold / NAME).unlink()
    os.symlink(outside, gold / NAME)
    _rehash(gold)  # the symlink's target hashes right
    _assert_one_line_error(_cli("check", str(gold), "--backend", "numpy"), NAME, "symlink")


def test_an_unlisted_npz_in_the_folder_is_reported(gold: Path) -> None:
    shutil.copy(gold / NAME, gold / "planted__float32.npz")
    with pytest.raises(golden.GoldenError, match=r"not listed in manifest\.json: "
                                                 r"planted__float32\.npz"):
        golden.check(gold, ["numpy"])


def test_a_file_whose_meta_contradicts_its_name_is_refused(gold: Path) -> None:
    (gold / NAME).rename(gold / "cross__float32.npz")
    _write_manifest(gold, {"format": 2, "files": {
        "cross__float32.npz": _sha(gold / "cross__float32.npz")}})
    with pytest.raises(golden.GoldenError, match="cross__float32.npz.*not what its name says"):
        golden.check(gold, ["numpy"])


def test_a_file_over_the_size_limit_is_refused_before_hashing(gold: Path,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    monkeypatch.setattr(golden.folders, "MAX_FILE_BYTES", 1000)
    monkeypatch.setattr(golden.folders, "_sha256", lambda path: pytest.fail(f"hashed {path}"))
    with pytest.raises(golden.GoldenError, match=f"{NAME} is .* bytes, over the limit of 1000"):
        golden.verify(gold)


# ------------------------------------------------------------------------------ file structure


def test_stripped_expected_values_exit_2_instead_of_passing(gold: Path) -> None:
    _rewrite(gold, lambda a: [a.pop(k) for k in list(a) if k.split(":")[0] in
                              ("expected", "baseline", "zeros", "any")])
    _assert_one_line_error(_cli("check", str(gold), "--backend", "numpy"), NAME, "expected")


def _drop(key: str) -> Callable[[dict[str, np.ndarray]], None]:
    return lambda a: a.pop(key)


def _put(key: str, value: np.ndarray) -> Callable[[dict[str, np.ndarray]], None]:
    return lambda a: a.__setitem__(key, value)


def _meta(**changes: object) -> Callable[[dict[str, np.ndarray]], None]:
    return lambda a: _set_meta(a, **changes)


def _rename(old: str, new: str) -> Callable[[dict[str, np.ndarray]], None]:
    return lambda a: a.__setitem__(new, a.pop(old))


def _unknown_step(a: dict[str, np.ndarray]) -> None:
    a["expected:bogus"] = a.pop("expected:output")
    a["baseline:bogus"] = a.pop("baseline:output")
    a.pop("zeros:output", None)


STRUCTURE = {
    "no-meta": (_drop("meta"), "no meta"),
    "meta-not-json": (_put("meta", np.array("{not json")), "meta is not valid JSON"),
    "meta-list": (_put("meta", np.array("[1, 2]")), "not a JSON object"),
    "meta-no-case": (lambda a: _set_meta(a, case=None), "valid 'case'"),
    "meta-format": (_meta(format=99), "format 99"),
    "unknown-case": (_meta(case="no_such_case"), "unknown case"),
    "unknown-dtype": (_meta(dtype="float128"), "unknown dtype"),
    "wrong-kind": (_meta(kind="module"), "kind"),
    "foreign-option": (_meta(options={"module": "os"}), "not options of a sdpa case"),
    "missing-input": (_drop("in:query"), "'query' named in meta"),
    "input-dtype": (lambda a: a.__setitem__("in:query", a["in:query"].astype(np.float64)),
                    "in:query is float64, meta declares float32"),
    "no-baseline": (_drop("baseline:output"), "expected:output has no baseline:output"),
    "baseline-alone": (_drop("expected:scores"), "baseline:scores has no expected:scores"),
    "unexpected-array": (_rename("expected:scores", "unrelated:scores"), "unexpected array"),
    "zeros-shape": (_put("zeros:weights", np.zeros(3, bool)), "zeros:weights is bool"),
    "zeros-dtype": (lambda a: a.__setitem__("zeros:weights", a["zeros:weights"].astype(float)),
                    "zeros:weights is float64"),
    "unknown-step": (_unknown_step, "expected:bogus is not a step"),
    "object-array": (_put("in:query", np.array([{"a": 1}], dtype=object)), "object array"),
}


@pytest.mark.parametrize("kind", list(STRUCTURE))
def test_load_checks_the_structure_of_a_file(gold: Path, kind: str) -> None:
    change, match = STRUCTURE[kind]
    path = _rewrite(gold, change)
    with pytest.raises(golden.GoldenError, match=match) as info:
        golden.load(path)
    assert NAME in str(info.value)
    with pytest.raises(golden.GoldenError):  # and check, after the (matching) checksums
        golden.check(gold, ["numpy"])


def _replace_member(path: Path, member: str, data: bytes) -> None:
    with zipfile.ZipFile(path) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    members[member] = data
    with zipfile.ZipFile(path, "w") as z:
        for name, content in members.items():
            z.writestr(name, content)


def _npy_header(shape: tuple[int, ...], descr: str = "<f8") -> bytes:
    buf = io.BytesIO()
    npy_format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False,
                                            "shape": shape})
    return buf.getvalue()


def test_a_huge_declared_shape_is_refused_before_allocating(gold: Path) -> None:
    _replace_member(gold / NAME, "in:query.npy", _npy_header((2**20, 2**20)))
    _rehash(gold)
    _assert_one_line_error(_cli("check", str(gold), "--backend", "numpy"), NAME, "in:query",
                           "over the limit")
    path = gold / NAME  # just over the per-array limit: refused from the header, unread
    _replace_member(path, "in:query.npy", _npy_header((golden.MAX_ARRAY_BYTES // 8 + 1,)))
    with pytest.raises(golden.GoldenError, match="over the limit"):
        golden.load(path)


def test_the_arrays_of_a_file_are_limited_in_total(gold: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(golden.untrusted, "MAX_LOADED_BYTES", 1000)
    with pytest.raises(golden.GoldenError, match=f"{NAME}: its arrays declare more than 1000"):
        golden.load(gold / NAME)


@pytest.mark.parametrize("kind", ["truncated", "pickle", "object-array", "truncated-member"])
def test_tampered_files_exit_2_with_one_line(gold: Path, kind: str) -> None:
    path = gold / NAME
    if kind == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind == "pickle":
        path.write_bytes(pickle.dumps({"meta": "not an npz"}))
    elif kind == "object-array":
        arrays = _arrays(path)
        arrays["in:key"] = np.array([None, 1], dtype=object)
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    else:  # a header declaring more data than the member holds
        _replace_member(path, "in:query.npy", _npy_header((4, 4)) + b"\0" * 10)
    _rehash(gold)
    _assert_one_line_error(_cli("check", str(gold), "--backend", "numpy"), NAME)


# ------------------------------------------------------------------------------ export


def test_export_refuses_a_file_and_an_earlier_export(tmp_path: Path, gold: Path) -> None:
    target = tmp_path / "a_file"
    target.write_text("not a folder\n")
    _assert_one_line_error(_cli("export", str(target), "--case", "self", "--dtype", "float32"),
                           str(target), "not a directory")
    assert target.read_text() == "not a folder\n"
    before = {p.name: p.read_bytes() for p in gold.iterdir()}
    with pytest.raises(golden.GoldenError, match="already holds golden files"):
        golden.export(gold, ["self"], ["float64"])
    assert {p.name: p.read_bytes() for p in gold.iterdir()} == before  # nothing overwritten
    (gold / golden.MANIFEST).unlink()  # a stray .npz alone also counts
    with pytest.raises(golden.GoldenError, match="already holds golden files"):
        golden.export(gold, ["self"], ["float32"])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert [p.name for p in golden.export(empty, ["self"], ["float32"])] == [NAME]
    assert golden.check(empty, ["numpy"]).ok


# ------------------------------------------------------------------------------ new kinds

NEW_KINDS = ["sinks_window", "merge_empty_split_sinks_gqa", "paged_two_queries_sinks"]


@pytest.fixture(scope="module")
def new_kinds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("export") / "new_kinds"
    golden.export(folder, NEW_KINDS, ["bfloat16"])
    return folder


def test_golden_files_carry_sinks_lse_merge_splits_and_pages(new_kinds: Path) -> None:
    """The inputs (sinks, the merge's split, the pages and their table) and the expected values
    of the new steps are exported, and a module passes the folder as it passes the cases."""
    files = {case: _arrays(new_kinds / f"{case}__bfloat16.npz") for case in NEW_KINDS}
    sinks = files["sinks_window"]
    assert sinks["in:sinks"].shape == (4,) and sinks["in:sinks"].dtype == np.uint16  # bf16 bits
    assert {"expected:lse", "expected:blockwise_lse", "expected:grad_sinks"} <= set(sinks)
    merge = files["merge_empty_split_sinks_gqa"]
    assert merge["in:key_part"].dtype == np.int64 and len(set(merge["in:key_part"])) == 2
    assert json.loads(str(merge["meta"]))["options"] == {"parts": 3}  # one part empty
    assert {"expected:merge_output", "expected:merge_lse", "zeros:merge_output"} <= set(merge)
    pages = files["paged_two_queries_sinks"]
    assert {"in:key_pages", "in:value_pages", "in:block_table", "in:seq_lens", "in:sinks",
            "expected:paged_output", "expected:paged_lse", "expected:paged_cache_output"
            } <= set(pages)
    result = golden.check(new_kinds, ["numpy"])
    assert result.ok and {c.status for c in result.cells} == {"ok"}
    steps = {s.step for c in result.cells for s in c.steps}
    assert {"lse", "grad_sinks", "merge_output", "merge_lse", "paged_output",
            "paged_cache_output"} <= steps


@pytest.mark.parametrize(("case", "array", "bad", "match"), [
    ("merge_empty_split_sinks_gqa", "in:key_part", np.full(7, 3), "key_part"),
    ("merge_empty_split_sinks_gqa", "in:key_part", np.zeros(6, np.int64), "key_part"),
    ("paged_two_queries_sinks", "in:seq_lens", np.array([5, 1, 10**12]), "paged cache"),
    ("paged_two_queries_sinks", "in:block_table", np.full((3, 3), 9), "paged cache"),
], ids=["part-out-of-range", "part-per-key", "huge-seq-len", "page-out-of-range"])
def test_a_crafted_split_or_page_table_is_refused(new_kinds: Path, tmp_path: Path, case: str,
                                                  array: str, bad: np.ndarray,
                                                  match: str) -> None:
    """A split or a page table that would make the harness loop forever or read out of range
    is a one-line GoldenError, before any backend runs."""
    folder = tmp_path / "golden"
    shutil.copytree(new_kinds, folder)
    path = folder / f"{case}__bfloat16.npz"
    arrays = _arrays(path)
    arrays[array] = bad
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    _rehash(folder)
    with pytest.raises(golden.GoldenError, match=match):
        golden.check(folder, ["numpy"], [case])


def test_a_merge_case_with_too_many_parts_is_refused(new_kinds: Path, tmp_path: Path) -> None:
    folder = tmp_path / "golden"
    shutil.copytree(new_kinds, folder)
    path = folder / "merge_empty_split_sinks_gqa__bfloat16.npz"
    arrays = _arrays(path)
    _set_meta(arrays, options={"parts": 10**9})
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    _rehash(folder)
    _assert_one_line_error(_cli("check", str(folder), "--backend", "numpy"), "parts")
