"""Golden vectors: the cases with their inputs and float64 expected values, as ``.npz`` files.

``export(DIR)`` writes one ``<case>__<dtype>.npz`` per case and dtype, plus ``manifest.json``
(SHA-256 of every file, the tolerances, the format version). Each file holds:

* ``in:<name>``: the inputs exactly as backends receive them (bfloat16 stored as its uint16 bits;
  ``meta`` records each input's dtype);
* ``expected:<step>``: the float64 reference value of every step;
* ``baseline:<step>``: the measured error of the naive implementation in that dtype;
* ``zeros:<step>``: positions that must be exactly 0;
* ``any:<step>``: positions where the spec's NaN rule allows any value (format 2);
* ``meta``: JSON (case, dtype, kind, scalar options, input dtypes).

Everything loads with ``numpy.load(..., allow_pickle=False)``. ``check(DIR, backends)`` verifies
the checksums and runs the loaded expectations through the runner (``runner.run_expectations``),
exactly as ``python -m conformance run`` does, needing nothing but NumPy and the implementation
under test.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import time
from pathlib import Path

import numpy as np

from . import cases as cases_mod
from . import runner, spec
from .backends import BFLOAT16, DTYPES
from .cases import CaseData
from .expected import Expected, expected
from .results import RunResult
from .usage import UsageError

FORMAT = 2
READABLE_FORMATS = (1, 2)  # format 1: no ``any:`` arrays
MANIFEST = "manifest.json"


class GoldenError(UsageError):
    """A golden directory that is missing, incomplete or altered."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _store(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype == BFLOAT16 else x


def _restore(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.view(BFLOAT16) if dtype == "bfloat16" else x.astype(np.dtype(dtype), copy=False)


def save(exp: Expected, path: str | Path) -> None:
    """One case × dtype to ``path`` (.npz, no pickles)."""
    arrays: dict[str, np.ndarray] = {}
    input_dtypes = {}
    for name, x in exp.data.arrays.items():
        arrays[f"in:{name}"] = _store(x)
        input_dtypes[name] = np.asarray(x).dtype.name
    for step, value in exp.values.items():
        arrays[f"expected:{step}"] = np.asarray(value, np.float64)
        arrays[f"baseline:{step}"] = np.asarray(exp.baseline[step], np.float64)
    for step, zeros in exp.zeros.items():
        arrays[f"zeros:{step}"] = np.ascontiguousarray(zeros)
    for step, free in exp.unspecified.items():
        arrays[f"any:{step}"] = np.ascontiguousarray(free)
    meta = {"case": exp.case, "dtype": exp.dtype, "kind": exp.kind,
            "options": exp.data.options, "input_dtypes": input_dtypes, "format": FORMAT}
    arrays["meta"] = np.array(json.dumps(meta))
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def load(path: str | Path) -> Expected:
    """A file written by ``save`` (``allow_pickle=False``)."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        data = CaseData({}, dict(meta["options"]))
        values, baseline, zeros, unspecified = {}, {}, {}, {}
        for key in z.files:
            kind, _, name = key.partition(":")
            if kind == "in":
                data.arrays[name] = _restore(z[key], meta["input_dtypes"][name])
            elif kind == "expected":
                values[name] = z[key]
            elif kind == "baseline":
                baseline[name] = float(z[key])
            elif kind == "zeros":
                zeros[name] = z[key]
            elif kind == "any":
                unspecified[name] = z[key]
    if data.options.get("window") is not None:
        data.options["window"] = tuple(data.options["window"])
    return Expected(meta["case"], meta["kind"], meta["dtype"], data, values, baseline, zeros,
                    unspecified)


def export(directory: str | Path, case_patterns: list[str] | None = None,
           dtypes: list[str] | None = None) -> list[Path]:
    """Write every selected case × dtype and the manifest; returns the files written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    files, digests = [], {}
    for case in cases_mod.select(case_patterns):
        for dtype in dtypes or DTYPES:
            path = out / f"{case.name}__{dtype}.npz"
            save(expected(case, dtype), path)
            files.append(path)
            digests[path.name] = _sha256(path)
    manifest = {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "tolerances": spec.TOLERANCES, "files": digests}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return files


def verify(directory: str | Path) -> list[Path]:
    """The manifest's files, after checking each one's SHA-256 (GoldenError otherwise)."""
    root = Path(directory)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise GoldenError(f"{root} has no {MANIFEST}; write one with "
                          f"`python -m conformance export {root}`")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        raise GoldenError(f"{manifest_path} is not valid JSON ({exc})") from exc
    if manifest.get("format") not in READABLE_FORMATS:
        raise GoldenError(f"{manifest_path}: format {manifest.get('format')}, expected one of "
                          f"{READABLE_FORMATS}")
    paths = []
    for name, digest in manifest["files"].items():
        path = root / name
        if not path.is_file():
            raise GoldenError(f"{path} is listed in {MANIFEST} but missing")
        if _sha256(path) != digest:
            raise GoldenError(f"{path}: checksum differs from {MANIFEST} (file altered?)")
        paths.append(path)
    return paths


def check(directory: str | Path, backend_names: list[str],
          case_patterns: list[str] | None = None,
          dtypes: list[str] | None = None) -> RunResult:
    """Check implementations against a golden directory; the same report as a normal run."""
    columns, missing = runner.resolve_backends(backend_names)
    columns = [c for c in columns if c.backend is not None]
    selected = []
    for path in verify(directory):
        case, _, dtype = path.stem.rpartition("__")
        if case_patterns and not any(fnmatch.fnmatchcase(case, p) for p in case_patterns):
            continue
        if dtypes and dtype not in dtypes:
            continue
        selected.append(path)

    def rerun(case: str, dtype: str, column: str) -> str:
        return (f"python -m conformance check {directory} --backend {column} --case {case} "
                f"--dtype {dtype}")

    return runner.run_expectations(columns, (load(p) for p in selected), missing,
                                   total=len(selected), rerun=rerun)


__all__ = ["GoldenError", "check", "export", "load", "save", "verify"]
