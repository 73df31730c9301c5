"""A golden folder: ``export`` writes the files and ``manifest.json``; ``verify`` checks the
manifest and every file's checksum before anything is parsed; ``check`` runs the loaded
expectations through the runner."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Any

from .. import spec
from ..cases import catalogue as cases_mod
from ..cases.dtypes import DTYPES
from ..cases.expected import Expected, expected
from ..comparing.results import RunResult
from ..running import runner
from .files import FORMAT, MAX_FILE_BYTES, READABLE_FORMATS, GoldenError, parse, save
from .untrusted import read_file

MANIFEST = "manifest.json"
#: Largest ``manifest.json`` read (a full export's is about 15 KiB).
MAX_MANIFEST_BYTES = 4 * 2**20
_DIGEST = re.compile(r"[0-9a-f]{64}")


def _sha256(path: Path) -> str:
    return hashlib.sha256(read_file(path, MAX_FILE_BYTES, error=GoldenError)).hexdigest()


def export(directory: str | Path, case_patterns: list[str] | None = None,
           dtypes: list[str] | None = None) -> list[Path]:
    """Write every selected case × dtype and the manifest into ``directory`` (created; an
    existing one must hold no manifest or ``.npz``); returns the files written."""
    out = Path(directory)
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise GoldenError(f"{out} exists and is not a directory; export into a new or "
                              f"empty directory")
        try:
            old = sorted(p.name for p in out.iterdir()
                         if p.name == MANIFEST or p.suffix == ".npz")
        except OSError as exc:
            raise GoldenError(f"{out} cannot be listed ({exc.strerror or exc})") from exc
        if old:
            raise GoldenError(f"{out} already holds golden files ({', '.join(old[:3])}"
                              f"{', ...' if len(old) > 3 else ''}); export into a new or empty "
                              f"directory")
    unknown = [d for d in dtypes or () if d not in DTYPES]
    if unknown:
        raise GoldenError(f"unknown dtype {', '.join(unknown)}; known: {', '.join(DTYPES)}")
    selected = cases_mod.select(case_patterns)
    files, digests = [], {}
    try:
        out.mkdir(parents=True, exist_ok=True)
        for case in selected:
            for dtype in dtypes or DTYPES:
                path = out / f"{case.name}__{dtype}.npz"
                save(expected(case, dtype), path)
                files.append(path)
                digests[path.name] = _sha256(path)
        manifest = {"format": FORMAT,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "tolerances": spec.TOLERANCES, "files": digests}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    except OSError as exc:
        raise GoldenError(f"cannot write golden files to {out} ({exc})") from exc
    return files


def _check_name(name: Any, where: Path) -> None:
    """GoldenError unless ``name`` is a plain ``<case>__<dtype>.npz`` file name."""
    rule = "entries must be plain file names <case>__<dtype>.npz inside the folder"
    if not isinstance(name, str):
        raise GoldenError(f"{where}: entry {name!r} is not a file name; {rule}")
    problem = None
    seps = {"/", "\\", os.sep, os.altsep} - {None}
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        problem = "is an absolute path"
    elif any(s in name for s in seps):
        problem = "contains a path separator"
    elif ".." in name:
        problem = "contains '..'"
    elif not name.endswith(".npz"):
        problem = "is not a .npz file"
    else:
        case, sep, dtype = name[:-4].rpartition("__")
        if not sep or case not in cases_mod.CASE_NAMES or dtype not in DTYPES:
            problem = "names no known case and dtype"
    if problem:
        raise GoldenError(f"{where}: entry {name!r} {problem}; {rule}")


def _manifest(root: Path) -> dict[str, str]:
    """The manifest's ``files`` (name → SHA-256), every entry validated and stat'ed before any
    of them is read, and no unlisted ``.npz`` beside them."""
    manifest_path = root / MANIFEST
    if not root.is_dir():
        raise GoldenError(f"{root} is not a directory; write one with "
                          f"`python -m conformance export {root}`")
    if not manifest_path.is_symlink() and not manifest_path.exists():
        raise GoldenError(f"{root} has no {MANIFEST}; write one with "
                          f"`python -m conformance export {root}`")
    text = read_file(manifest_path, MAX_MANIFEST_BYTES, error=GoldenError)
    try:
        manifest = json.loads(text.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, nesting
        raise GoldenError(f"{manifest_path} is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict):
        raise GoldenError(f"{manifest_path} is not a JSON object")
    if manifest.get("format") not in READABLE_FORMATS:
        raise GoldenError(f"{manifest_path}: format {manifest.get('format')!r}, expected one of "
                          f"{READABLE_FORMATS}")
    files = manifest.get("files")
    if "files" not in manifest:
        raise GoldenError(f"{manifest_path} has no \"files\"")
    if not isinstance(files, dict):
        raise GoldenError(f"{manifest_path}: \"files\" is not an object of file name → SHA-256")
    if not files:
        raise GoldenError(f"{manifest_path} lists no files")
    for name, digest in files.items():
        _check_name(name, manifest_path)
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise GoldenError(f"{manifest_path}: the checksum of {name} is not a SHA-256 "
                              f"(64 lowercase hex digits)")
    for name in files:
        path = root / name
        try:
            st = path.lstat()
        except FileNotFoundError:
            raise GoldenError(f"{path} is listed in {MANIFEST} but missing") from None
        except OSError as exc:
            raise GoldenError(f"{path} cannot be read ({exc.strerror or exc})") from exc
        if stat.S_ISLNK(st.st_mode):
            raise GoldenError(f"{path} is a symlink; golden files must be plain files")
        if not stat.S_ISREG(st.st_mode):
            raise GoldenError(f"{path} is not a regular file")
        if st.st_size > MAX_FILE_BYTES:
            raise GoldenError(f"{path} is {st.st_size} bytes, over the limit of "
                              f"{MAX_FILE_BYTES}")
    try:
        unlisted = sorted(p.name for p in root.iterdir()
                          if p.suffix == ".npz" and p.name not in files)
    except OSError as exc:
        raise GoldenError(f"{root} cannot be listed ({exc.strerror or exc})") from exc
    if unlisted:
        raise GoldenError(f"{root}: not listed in {MANIFEST}: {', '.join(unlisted)} (a stale or "
                          f"planted file? remove it or export afresh)")
    return files


def _verified(root: Path) -> dict[str, str]:
    """``_manifest(root)``, after checking every listed file's SHA-256."""
    files = _manifest(root)
    for name, digest in files.items():
        if _sha256(root / name) != digest:
            raise GoldenError(f"{root / name}: checksum differs from {MANIFEST} (file altered?)")
    return files


def verify(directory: str | Path) -> list[Path]:
    """The manifest's files, after validating the manifest (see the module docstring) and
    checking each file's SHA-256 (GoldenError otherwise)."""
    root = Path(directory)
    return [root / name for name in _verified(root)]


def _load_listed(path: Path, digest: str) -> Expected:
    """A verified file, re-hashed from the very bytes parsed; ``meta`` must match its name."""
    data = read_file(path, MAX_FILE_BYTES, error=GoldenError)
    if hashlib.sha256(data).hexdigest() != digest:
        raise GoldenError(f"{path}: checksum differs from {MANIFEST} (file altered?)")
    exp = parse(data, str(path))
    case, _, dtype = path.stem.rpartition("__")
    if (exp.case, exp.dtype) != (case, dtype):
        raise GoldenError(f"{path}: holds case {exp.case} in {exp.dtype}, not what its name says")
    return exp


def check(directory: str | Path, backend_names: list[str],
          case_patterns: list[str] | None = None,
          dtypes: list[str] | None = None,
          timeout: float = runner.DEFAULT_TIMEOUT_S) -> RunResult:
    """Check implementations against a golden directory; the same report as a normal run.
    Every selected file is loaded and checked before any backend runs; a selection that matches
    no file is a GoldenError naming what the folder holds. ``timeout``: seconds per call of a
    checked module (``runner.run``)."""
    columns, missing = runner.resolve_backends(backend_names, timeout)
    columns = [c for c in columns if c.backend is not None]
    root = Path(directory)
    digests = _verified(root)
    available = [(p.stem.rpartition("__")[0], p.stem.rpartition("__")[2])
                 for p in map(Path, digests)]
    selected = [root / f"{case}__{dtype}.npz" for case, dtype in available
                if (not case_patterns or any(fnmatch.fnmatchcase(case, p) for p in case_patterns))
                and (not dtypes or dtype in dtypes)]
    if not selected:
        asked = " ".join([*(f"--case {p}" for p in case_patterns or ()),
                          *(f"--dtype {d}" for d in dtypes or ())])
        cases_here = sorted({c for c, _ in available})
        dtypes_here = [d for d in DTYPES if any(d == x for _, x in available)]
        raise GoldenError(f"{asked} selects no file of {root}; it holds cases "
                          f"{', '.join(cases_here)} in {', '.join(dtypes_here)}")
    loaded = [_load_listed(p, digests[p.name]) for p in selected]

    def rerun(case: str, dtype: str, column: str) -> str:
        return (f"python -m conformance check {directory} --backend {column} --case {case} "
                f"--dtype {dtype}")

    return runner.run_expectations(columns, loaded, missing, total=len(selected), rerun=rerun,
                                   timeout=timeout)
