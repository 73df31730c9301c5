"""``python -m conformance exercise N --backend B [--file F]``: grade a learner's exercise.

The exercises (``exercise_catalogue``) build attention from the seed article, one function
each; ``learn/<backend>/exNN_*.py`` holds the stubs, ``learn/solutions/`` the answers. Grading
calls the learner's function on every check's inputs (float32, as the backend's arrays),
compares the result with its float64 expected value under the harness's one tolerance rule
(``compare.compare``) and, at the first failing check, says why in plain words: a mistake of the
exercise's list ("you forgot the scale", "you flipped the mask", "a fully masked row gives
NaN"), else the harness's own diagnosis (``diagnose.diagnose``) where the check is a piece of
the spec's pipeline, else what went wrong (NaN, the worst element) — always with a hint.

A learner's file is untrusted input: a missing file or an uninstalled framework is one line and
exit code 2 (``UsageError``); everything the file itself does — a syntax error, an import
error, an exception (with the file's line), ``None`` or a tuple returned, another framework's
array (NumPy inside a JAX exercise breaks ``jax.jit``), a wrong shape, NaN — is a verdict, exit
code 1, never a traceback. The command grades in a child process with a time limit
(``--timeout``, default 120 s), so an endless loop or a crash of the interpreter is a verdict
too; the learner's own ``print`` output passes through. ``grade`` runs in this process (tests).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from ..comparing import compare
from ..diagnosing import diagnose
from ..reporting.textwidth import add_width_argument, columns, fit, resolve_width
from ..running import backends
from ..usage import INSTALL, UsageError, at_least
from .exercise_catalogue import EXERCISES
from .exercise_kit import DTYPE, TYPE_NAMES, Check, Exercise, is_native, to_backend, to_numpy

BACKENDS = {"numpy": "pip install numpy", "jax": INSTALL["jax"], "torch": INSTALL["torch"]}
FRAMEWORK = {"numpy": "numpy", "jax": "jax", "torch": "torch"}
LEARN = Path(__file__).resolve().parents[2] / "learn"
TIMEOUT_S = 120.0

SWAP_HINT = "check which operand needs its last two axes swapped"
#: Exceptions whose message has a standard remedy: (words of the message, hint).
EXCEPTION_HINTS = (
    ("immutable", "JAX arrays are immutable: x.at[i].set(v) returns a changed copy"),
    ("shapes cannot be multiplied", SWAP_HINT), ("matmul: Input operand", SWAP_HINT),
    ("dot_general requires contracting dimensions", SWAP_HINT),
    ("Tracer", "a traced value was used where Python needs a concrete one: use jnp.where "
     "instead of if, and shapes instead of values"),
    ("keepdim", "torch spells it keepdim=True, NumPy and JAX keepdims=True"),
)


@dataclass
class Verdict:
    """The grade of one file: ``diagnosis`` is a short key (``"ok"``, a mistake's key,
    ``"not_implemented"``, ``"exception"``, ``"shape"``, ``"nan"``, ``"values"``, …)."""

    exercise: int
    backend: str
    file: str
    passed: bool
    diagnosis: str
    says: str = ""
    hint: str = ""
    check: str = ""
    detail: str = ""
    passed_checks: list[str] = field(default_factory=list)

    def text(self, width: int | None = None) -> str:
        """The verdict as the command prints it, each line within ``width`` (None: as long as
        it is): a longer one wrapped at spaces (``textwidth.fit``)."""
        ex = exercise(self.exercise)
        lines = [f"exercise {ex.number}: {ex.title} · {self.backend} · {self.file}"]
        lines += [f"  ✓ {name}" for name in self.passed_checks]
        if self.passed:
            lines.append(f"PASS: {ex.function} matches the float64 reference on every check "
                         f"({len(self.passed_checks)})")
        else:
            if self.check:
                lines.append(f"  ✗ {self.check}")
            lines.append(f"FAIL: {self.says}")
            lines += [f"  {line}" for line in self.detail.splitlines() if line]
            if self.hint:
                lines.append(f"  hint: {self.hint}")
        return fit("\n".join(lines), width)


def exercise(key: int | str) -> Exercise:
    """An exercise by number (1–10) or slug (``softmax``); ``UsageError`` otherwise."""
    for ex in EXERCISES:
        if str(key) in (str(ex.number), ex.slug, ex.stem):
            return ex
    raise UsageError(f"unknown exercise {key!r}; expected 1–{len(EXERCISES)} or one of "
                     f"{', '.join(e.slug for e in EXERCISES)} (see --list)")


def stub_path(ex: Exercise, backend: str, solution: bool = False) -> Path:
    """``learn/<backend>/exNN_slug.py`` (``learn/solutions/<backend>/…`` with ``solution``)."""
    return (LEARN / "solutions" if solution else LEARN) / backend / f"{ex.stem}.py"


# --------------------------------------------------------------------------- loading


def _where(exc: BaseException, path: Path) -> str:
    """``line N: code`` of the innermost frame in the learner's file, or ""."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if Path(f.filename).resolve() == path.resolve()]
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f"line {exc.lineno}: {(exc.text or '').strip()}"
    return f"line {frames[-1].lineno}: {frames[-1].line}" if frames else ""


def _exception_verdict(base: Verdict, exc: BaseException, path: Path, check: Check | None,
                       during: str) -> Verdict:
    message = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    hint = next((h for key, h in EXCEPTION_HINTS if key in str(exc)), "")
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        hint = f"{exc.name} is not installed here: pip install {exc.name}"
    hints = [h for h in (hint, check.hint if check else "") if h]
    return _fail(base, "exception", f"your {during} raised {type(exc).__name__}",
                 "; ".join(dict.fromkeys(hints)), check,
                 "\n".join(p for p in (_where(exc, path), message[:400]) if p))


def _fail(base: Verdict, key: str, says: str, hint: str, check: Check | None,
          detail: str = "") -> Verdict:
    return Verdict(base.exercise, base.backend, base.file, False, key, says, hint,
                   check.name if check else "", detail, list(base.passed_checks))


def load(path: Path) -> ModuleType:
    """The learner's file as a fresh module (its folder on ``sys.path`` while it imports)."""
    name = f"_learner_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"--file {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
        sys.modules.pop(name, None)
    return module


# --------------------------------------------------------------------------- grading


def check_usage(ex: Exercise, backend: str, path: Path) -> None:
    """The command's mistakes, before any work: an unknown backend, its framework missing,
    a file that does not exist (``UsageError``)."""
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if importlib.util.find_spec(FRAMEWORK[backend]) is None:
        raise UsageError(f"exercise --backend {backend} needs {FRAMEWORK[backend]}; install: "
                         f"{BACKENDS[backend]}")
    if not path.is_file():
        raise UsageError(f"--file {path}: no such file")


def grade(number: int | str, backend: str, path: str | Path) -> Verdict:
    """Grade the learner's ``path`` for exercise ``number`` in ``backend``, in this process."""
    ex, path = exercise(number), Path(path)
    check_usage(ex, backend, path)
    base = Verdict(ex.number, backend, str(path), False, "")
    if backend == "jax":  # the harness's persistent compilation cache: a regrade compiles nothing
        backends.jax_prepare()
    try:
        with np.errstate(all="ignore"):
            module = load(path)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the learner's file: any error
        return _exception_verdict(base, exc, path, None, "file")
    fn = getattr(module, ex.function, None)
    if not callable(fn):
        return _fail(base, "missing_function", f"{path.name} defines no function "
                     f"{ex.function}", f"define {ex.function}(...) as the stub does", None)
    for check in ex.checks:
        failed = _grade_check(ex, backend, fn, check, base, path)
        if failed is not None:
            return failed
        base.passed_checks.append(check.name)
    base.passed, base.diagnosis = True, "ok"
    return base


def _grade_check(ex: Exercise, backend: str, fn: Any, check: Check, base: Verdict,
                 path: Path) -> Verdict | None:
    """None when the check passes, else the verdict."""
    try:
        with np.errstate(all="ignore"):
            result = fn(*(to_backend(backend, a) for a in check.args))
    except NotImplementedError:
        return _fail(base, "not_implemented", f"{ex.function} is not written yet (it raises "
                     "NotImplementedError)", ex.hint, check)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the learner's code: any error
        return _exception_verdict(base, exc, path, check, ex.function)
    if result is None:
        return _fail(base, "none", f"{ex.function} returned None", "did you forget `return`?",
                     check)
    if isinstance(result, tuple | list):
        return _fail(base, "type", f"{ex.function} returned a {type(result).__name__}",
                     "return one array", check)
    if not is_native(backend, result):
        return _fail(base, "type", f"{ex.function} returned a {type(result).__module__}."
                     f"{type(result).__name__}", f"return {TYPE_NAMES[backend]}", check)
    try:
        actual = to_numpy(result)
    except Exception as exc:  # noqa: BLE001 - an array-like that does not convert
        return _exception_verdict(base, exc, path, check, "result")
    if actual.dtype.kind != "f":
        return _fail(base, "dtype", f"{ex.function} returned {actual.dtype} values",
                     "return floating-point values", check)
    expected = check.expected
    if actual.shape != expected.shape:
        hint = ("your shape is the transpose of the expected one"
                if actual.shape == expected.shape[:-2] + expected.shape[-2:][::-1]
                else check.hint or ex.hint)
        return _fail(base, "shape", f"{ex.function} returned shape {actual.shape}, expected "
                     f"{expected.shape}", hint, check)
    res = compare.compare(ex.function, actual, expected, check.baseline, DTYPE, check.zeros)
    if res.passed:
        return None
    return _explain(ex, check, actual.astype(np.float64), res, base)


def _matches(ex: Exercise, check: Check, actual: np.ndarray, alt: np.ndarray) -> bool:
    """The learner's result is the mistake's (within tolerance, NaN where it is NaN), and the
    mistake is visible on this check (its result fails the check)."""
    if alt.shape != actual.shape:
        return False
    mine = compare.compare(ex.function, actual, alt, check.baseline, DTYPE)
    shows = compare.compare(ex.function, alt, check.expected, check.baseline, DTYPE, check.zeros)
    return mine.passed and not shows.passed


def _explain(ex: Exercise, check: Check, actual: np.ndarray, res: compare.StepResult,
             base: Verdict) -> Verdict:
    args = [a.copy() if isinstance(a, np.ndarray) else a for a in check.args]
    for mistake in ex.mistakes:
        if any(_matches(ex, check, actual, alt) for alt in mistake.compute(*args)):
            return _fail(base, mistake.key, mistake.says, mistake.hint, check, _worst(res))
    with contextlib.suppress(Exception):  # the harness's diagnoses, where the check is sdpa
        reasons = diagnose.diagnose(check.exp, check.step, actual) if check.exp else ""
        if reasons:
            return _fail(base, "harness", reasons, ex.hint, check, _worst(res))
    finite = np.isfinite(check.expected)
    if (~np.isfinite(actual) & finite).any():
        return _fail(base, "nan", "NaN or inf where the answer is finite", ex.hint, check,
                     _worst(res))
    return _fail(base, "values", "wrong values", ex.hint, check, _worst(res))


def _worst(res: compare.StepResult) -> str:
    if res.index is None:
        return res.note
    where = f"[{', '.join(map(str, res.index))}]"
    line = (f"worst at {where}: yours {res.actual:.6g}, expected {res.expected:.6g} "
            f"(tolerance {res.bound:.2g})")
    return f"{line}; {res.note}" if res.note else line


# --------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``exercise`` subcommand's arguments."""
    p.add_argument("number", nargs="?", help="the exercise: 1–10 or its name (see --list)")
    p.add_argument("--backend", default="numpy", choices=list(BACKENDS),
                   help="the framework your file uses (default numpy)")
    p.add_argument("--file", metavar="PATH",
                   help="your file (default: the stub, learn/<backend>/exNN_*.py)")
    p.add_argument("--timeout", type=at_least(1), default=TIMEOUT_S, metavar="S",
                   help=f"seconds before grading stops (default {TIMEOUT_S:.0f})")
    p.add_argument("--list", action="store_true", help="list the exercises and their files")
    add_width_argument(p, "feedback lines")


def listing(width: int | None = None) -> str:
    """``--list``: number, function, title and stub of every exercise, each line within
    ``width`` (None: as long as it is; a title that does not fit goes on a line of its own)."""
    rows = []
    for ex in EXERCISES:
        head = f"{ex.number:>2}  {ex.slug:<19} {ex.function + '()':<30}"
        row = f"{head} {ex.title}"
        rows += [row] if width is None or columns(row) <= width else [head.rstrip(),
                                                                       f"    {ex.title}"]
    return fit("\n".join([*rows, "", "stubs: learn/{numpy,jax,torch}/exNN_<name>.py; "
                           "solutions: learn/solutions/; grade: python -m conformance exercise N "
                           "--backend B --file F"]), width)


def main(args: argparse.Namespace) -> int:
    """``python -m conformance exercise``: 0 pass, 1 fail, 2 for a mistake in the command."""
    width = resolve_width(args.width)
    if args.list:
        print(listing(width))
        return 0
    if args.number is None:
        raise UsageError("exercise: give its number (1–10) or --list")
    ex = exercise(args.number)
    path = Path(args.file) if args.file else stub_path(ex, args.backend)
    if not args.file and not LEARN.is_dir():
        raise UsageError("the stubs live in the repository's learn/ folder, which an installed "
                         "package does not have: pass --file YOUR_FILE")
    check_usage(ex, args.backend, path)
    verdict = run_isolated(ex.number, args.backend, path, float(args.timeout))
    print(verdict.text(width))
    return 0 if verdict.passed else 1


def run_isolated(number: int, backend: str, path: Path, timeout: float) -> Verdict:
    """``grade`` in a child process, stopped after ``timeout`` seconds."""
    base = Verdict(number, backend, str(path), False, "")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "verdict.json"
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        command = [sys.executable, "-m", "conformance.teaching.exercises", str(number), backend,
                   str(path.resolve()), str(out)]
        try:
            done = subprocess.run(command, env=env, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return _fail(base, "timeout", f"grading stopped after {timeout:g} s",
                         "an endless loop? (or a much larger computation than the checks need)",
                         None)
        if not out.is_file():
            return _fail(base, "crashed", f"the grading process ended without a verdict (exit "
                         f"code {done.returncode})", "does your file call os._exit, or crash "
                         "the interpreter?", None)
        verdict = Verdict(**json.loads(out.read_text(encoding="utf-8")))
        verdict.file = _shown(path)
        return verdict


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it."""
    relative = os.path.relpath(path.resolve())
    return str(path) if relative.startswith("..") else relative


def _worker(argv: list[str]) -> int:
    number, backend, path, out = argv
    try:
        verdict = grade(number, backend, path)
    except UsageError as exc:
        verdict = Verdict(int(number), backend, path, False, "usage", str(exc))
    with contextlib.suppress(OSError):
        sys.stdout.flush()
    Path(out).write_text(json.dumps(asdict(verdict)), encoding="utf-8")
    return 0


__all__ = ["BACKENDS", "EXERCISES", "Verdict", "add_arguments", "check_usage", "exercise",
           "grade", "listing", "load", "main", "run_isolated", "stub_path"]

if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
