"""The learner's side of grading an exercise: call the learner's function, send back its results.

``python -m conformance exercise`` runs this file as a script in a child process
(``python exercise_child.py MANIFEST``): the manifest names the learner's file, the function,
the backend and the folder holding each check's inputs (``inputs.npz``); the child writes what
each call gave (``answer.json``, and ``results.npz`` for the arrays) and nothing else. It never
sees an expected value: they are computed, and compared, in the grader's process only, which
reads the answer as untrusted data (a missing or malformed answer is a verdict there). So a
learner's file cannot read the expected values from the grader's frames, nor write its own
verdict.

This file imports only the standard library and NumPy (the backend's framework when a check
needs it), never ``conformance``, so that the learner's process holds none of the harness.
Every exercise is about writing the math, so a learner's file may not use the project's own
attention: importing ``conformance`` or a backend package (``FORBIDDEN``) is recorded, by an
audit hook that sees every import and cannot be removed, and by ``sys.modules`` after the calls;
the grader turns it into the verdict ``library``. The frameworks' own functions
(``torch.softmax``) are not forbidden.

``run`` is the same work in the calling process (the tests of trusted files use it, for speed);
there the forbidden imports are not watched.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np

#: The project's own packages: a learner's file that imports one does not write the math.
FORBIDDEN = ("conformance", "numpy_attn", "jax_attn", "torch_attn")
ANSWER, RESULTS, INPUTS, MANIFEST = "answer.json", "results.npz", "inputs.npz", "manifest.json"
MESSAGE_CHARS = 2000


# --------------------------------------------------------------------------- the backends' arrays


def to_backend(backend: str, x: Any) -> Any:
    """A check's argument for ``backend``: a NumPy array as a fresh array of the backend
    (``"numpy"``, ``"jax"``, ``"torch"``); a scalar as it is."""
    if not isinstance(x, np.ndarray):
        return x
    if backend == "jax":
        import jax.numpy as jnp

        return jnp.asarray(x)
    if backend == "torch":
        import torch

        return torch.from_numpy(x.copy())
    return x.copy()


def is_native(backend: str, x: Any) -> bool:
    """``x`` is the backend's own array type (a NumPy array, a ``jax.Array``, a tensor)."""
    if backend == "torch":
        import torch

        return isinstance(x, torch.Tensor)
    if backend == "jax":
        import jax

        return isinstance(x, jax.Array)
    return isinstance(x, np.ndarray | np.generic)


def to_numpy(x: Any) -> np.ndarray:
    """A result as a NumPy array (a tensor detached and on the CPU; bfloat16 as float32)."""
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu()
        return np.asarray(x.float() if str(x.dtype) == "torch.bfloat16" else x)
    return np.asarray(x)


# --------------------------------------------------------------------------- calling


def _where(exc: BaseException, path: Path) -> str:
    """``line N: code`` of the innermost frame in the learner's file, or ""."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if Path(f.filename).resolve() == path.resolve()]
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f"line {exc.lineno}: {(exc.text or '').strip()}"
    return f"line {frames[-1].lineno}: {frames[-1].line}" if frames else ""


def _raised(exc: BaseException, path: Path) -> dict[str, Any]:
    return {"status": "exception", "type": type(exc).__name__,
            "message": str(exc)[:MESSAGE_CHARS], "where": _where(exc, path),
            "module": getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None}


def load(path: Path) -> Any:
    """The learner's file as a fresh module (its folder on ``sys.path`` while it imports)."""
    name = f"_learner_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
        sys.modules.pop(name, None)
    return module


def _call(fn: Any, backend: str, args: list[Any], path: Path) -> tuple[dict[str, Any], Any]:
    """What one call gave: its outcome and, where it returned an array, the array."""
    try:
        with np.errstate(all="ignore"):
            result = fn(*(to_backend(backend, a) for a in args))
    except NotImplementedError:
        return {"status": "not_implemented"}, None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the learner's code: any error
        return _raised(exc, path), None
    if result is None:
        return {"status": "none"}, None
    if isinstance(result, tuple | list):
        return {"status": "sequence", "type": type(result).__name__}, None
    if not is_native(backend, result):
        return {"status": "foreign", "type": f"{type(result).__module__}."
                f"{type(result).__name__}"}, None
    try:
        actual = to_numpy(result)
        if actual.dtype.kind not in "biufc":
            raise TypeError(f"an array of {actual.dtype}")
    except Exception as exc:  # noqa: BLE001 - an array-like that does not convert
        return {**_raised(exc, path), "status": "convert"}, None
    return {"status": "ok"}, np.ascontiguousarray(actual)


def run(path: Path, function: str, backend: str, checks: list[list[Any]]
        ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Load ``path`` and call its ``function`` on each check's arguments: the answer
    (``{"load": outcome or None, "checks": [outcome, …]}``) and the returned arrays by check
    (``"0"``, ``"1"``, …)."""
    try:
        with np.errstate(all="ignore"):
            module = load(path)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the learner's file: any error
        return {"load": _raised(exc, path), "checks": []}, {}
    fn = getattr(module, function, None)
    if not callable(fn):
        return {"load": {"status": "missing_function"}, "checks": []}, {}
    outcomes, results = [], {}
    for i, args in enumerate(checks):
        outcome, array = _call(fn, backend, args, path)
        outcomes.append(outcome)
        if array is not None:
            results[str(i)] = array
    return {"load": None, "checks": outcomes}, results


# --------------------------------------------------------------------------- the child process


def write_inputs(folder: Path, path: Path, function: str, backend: str,
                 checks: list[tuple[Any, ...]]) -> Path:
    """The manifest and inputs of a child's run in ``folder``; the manifest's path."""
    arrays, described = {}, []
    for i, args in enumerate(checks):
        row = []
        for j, a in enumerate(args):
            if isinstance(a, np.ndarray):
                arrays[f"{i}_{j}"] = a
                row.append({"array": f"{i}_{j}"})
            else:
                row.append({"value": a})
        described.append(row)
    np.savez(folder / INPUTS, **arrays)
    manifest = folder / MANIFEST
    manifest.write_text(json.dumps({"file": str(path), "function": function,
                                    "backend": backend, "checks": described}), encoding="utf-8")
    return manifest


def _watch_imports() -> set[str]:
    """The forbidden packages the process imports from now on (an audit hook, which stays)."""
    seen: set[str] = set()

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "import" and args and str(args[0]).split(".")[0] in FORBIDDEN:
            seen.add(str(args[0]).split(".")[0])

    sys.addaudithook(hook)
    return seen


def main(manifest_path: str) -> int:
    """The child: read the manifest, run the learner's function, write its answer."""
    folder = Path(manifest_path).parent
    manifest = json.loads(Path(manifest_path).read_text(encoding="utf-8"))
    with np.load(folder / INPUTS, allow_pickle=False) as stored:
        checks = [[stored[a["array"]] if "array" in a else a["value"] for a in row]
                  for row in manifest["checks"]]
    seen = _watch_imports()
    answer, results = run(Path(manifest["file"]), manifest["function"], manifest["backend"],
                          checks)
    seen |= {name.split(".")[0] for name in list(sys.modules)} & set(FORBIDDEN)
    answer["forbidden"] = sorted(seen)
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    np.savez(folder / RESULTS, **results)
    (folder / ANSWER).write_text(json.dumps(answer), encoding="utf-8")
    return 0


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # the script's folder: the harness's own modules stay out of reach
    sys.exit(main(sys.argv[1]))
