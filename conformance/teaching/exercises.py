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
code 1, never a traceback. The learner's function runs in a child process
(``exercise_child``) with a time limit (``--timeout``, default 120 s): it gets the checks'
inputs only and sends back what the function returned; the expected values are computed and
compared here, so the file can neither read them nor write its own verdict, and an endless
loop, a crash of the interpreter or a missing or malformed answer is a verdict too. A file that
imports the project's own attention (``exercise_child.FORBIDDEN``) fails with ``library``:
every exercise is to write the math. The learner's own ``print`` output passes through.
``grade(..., isolated=False)`` calls the function in this process (the tests of trusted files).
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
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from ..comparing import compare
from ..diagnosing import diagnose
from ..reporting.textwidth import add_width_argument, columns, fit, resolve_width
from ..running import backends
from ..usage import INSTALL, UsageError, at_least
from . import exercise_child
from .exercise_catalogue import EXERCISES
from .exercise_kit import DTYPE, TYPE_NAMES, Check, Exercise

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
    """An exercise by number (1–12) or slug (``softmax``); ``UsageError`` otherwise."""
    for ex in EXERCISES:
        if str(key) in (str(ex.number), ex.slug, ex.stem):
            return ex
    raise UsageError(f"unknown exercise {key!r}; expected 1–{len(EXERCISES)} or one of "
                     f"{', '.join(e.slug for e in EXERCISES)} (see --list)")


def stub_path(ex: Exercise, backend: str, solution: bool = False) -> Path:
    """``learn/<backend>/exNN_slug.py`` (``learn/solutions/<backend>/…`` with ``solution``)."""
    return (LEARN / "solutions" if solution else LEARN) / backend / f"{ex.stem}.py"


# --------------------------------------------------------------------------- verdicts


def _exception_verdict(base: Verdict, raised: dict[str, Any], check: Check | None,
                       during: str) -> Verdict:
    """The verdict on an exception the learner's code raised (``raised``: the child's
    description, ``exercise_child._raised``)."""
    kind, text = str(raised.get("type", "Exception")), str(raised.get("message", ""))
    message = f"{kind}: {(text.strip().splitlines() or [''])[0]}"
    hint = next((h for key, h in EXCEPTION_HINTS if key in text), "")
    if kind == "ModuleNotFoundError" and raised.get("module"):
        hint = f"{raised['module']} is not installed here: pip install {raised['module']}"
    hints = [h for h in (hint, check.hint if check else "") if h]
    return _fail(base, "exception", f"your {during} raised {kind}",
                 "; ".join(dict.fromkeys(hints)), check,
                 "\n".join(p for p in (str(raised.get("where") or ""), message[:400]) if p))


def _fail(base: Verdict, key: str, says: str, hint: str, check: Check | None,
          detail: str = "") -> Verdict:
    return Verdict(base.exercise, base.backend, base.file, False, key, says, hint,
                   check.name if check else "", detail, list(base.passed_checks))


def load(path: Path) -> ModuleType:
    """The learner's file as a fresh module (its folder on ``sys.path`` while it imports)."""
    if importlib.util.spec_from_file_location("_learner", path) is None:
        raise UsageError(f"--file {path}: not a Python file")
    return exercise_child.load(path)


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


def grade(number: int | str, backend: str, path: str | Path, *, isolated: bool = True,
          timeout: float = TIMEOUT_S) -> Verdict:
    """Grade the learner's ``path`` for exercise ``number`` in ``backend``.

    ``isolated`` (the default, and the command's way): the learner's function runs in a child
    process (``exercise_child``) stopped after ``timeout`` seconds, which sees the checks'
    inputs only and sends back what the function returned; the expected values stay in this
    process, which compares. ``isolated=False`` calls the function in this process (the tests
    of trusted files, for speed): its file could read the expected values there, and its
    imports of the project's own attention are not watched."""
    ex, path = exercise(number), Path(path)
    check_usage(ex, backend, path)
    base = Verdict(ex.number, backend, str(path), False, "")
    inputs = [c.args for c in ex.checks]
    if isolated:
        answer = _run_child(ex, backend, path, inputs, timeout, base)
        if isinstance(answer, Verdict):
            return answer
    else:
        if backend == "jax":  # the harness's compilation cache: a regrade compiles nothing
            backends.jax_prepare()
        answer = exercise_child.run(path, ex.function, backend, [list(a) for a in inputs])
    return _judge(ex, path, answer, base)


def _run_child(ex: Exercise, backend: str, path: Path, inputs: list[tuple[Any, ...]],
               timeout: float, base: Verdict) -> tuple[dict[str, Any], dict] | Verdict:
    """The learner's answer from a child process, or the verdict when none came back."""
    env = dict(os.environ)
    if backend == "jax":  # the harness's compilation cache and float64, as in this process
        env.update({**backends.jax_cache_env(), "JAX_ENABLE_X64": "1"})
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        manifest = exercise_child.write_inputs(folder, path.resolve(), ex.function, backend,
                                               inputs)
        command = [sys.executable, str(Path(exercise_child.__file__).resolve()), str(manifest)]
        try:
            done = subprocess.run(command, env=env, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return _fail(base, "timeout", f"grading stopped after {timeout:g} s",
                         "an endless loop? (or a much larger computation than the checks "
                         "need; --timeout S allows more seconds)", None)
        try:
            answer = json.loads((folder / exercise_child.ANSWER).read_text(encoding="utf-8"))
            with np.load(folder / exercise_child.RESULTS, allow_pickle=False) as stored:
                results = {name: stored[name] for name in stored.files}
            _validate(answer, results, len(inputs))
        except FileNotFoundError:
            return _fail(base, "crashed", f"the grading process ended without an answer (exit "
                         f"code {done.returncode})", "does your file call os._exit, or crash "
                         "the interpreter?", None)
        except (ValueError, TypeError, KeyError, OSError) as exc:
            return _fail(base, "malformed", "the grading process's answer could not be read "
                         f"(exit code {done.returncode})", "does your file write to the "
                         "grader's files? Only what your function returns is graded", None,
                         f"{type(exc).__name__}: {str(exc)[:200]}")
    return answer, results


def _validate(answer: Any, results: dict[str, np.ndarray], n_checks: int) -> None:
    """``ValueError`` unless ``answer`` has the form ``exercise_child.main`` writes."""
    outcome = (dict, type(None))
    if not (isinstance(answer, dict) and isinstance(answer.get("load"), outcome)
            and isinstance(answer.get("checks"), list)
            and all(isinstance(c, dict) for c in answer["checks"])
            and isinstance(answer.get("forbidden", []), list)):
        raise ValueError("not the answer's form")
    if answer["load"] is None and len(answer["checks"]) != n_checks:
        raise ValueError(f"{len(answer['checks'])} outcomes for {n_checks} checks")
    for i, c in enumerate(answer["checks"]):
        if c.get("status") == "ok" and str(i) not in results:
            raise ValueError(f"no result for check {i}")


def _judge(ex: Exercise, path: Path, answer: tuple[dict[str, Any], dict[str, np.ndarray]],
           base: Verdict) -> Verdict:
    """The verdict on the learner's answer: what each call gave, compared here."""
    outcomes, results = answer
    forbidden = [str(name) for name in outcomes.get("forbidden", [])]
    if forbidden:
        return _fail(base, "library", f"{path.name} imports {', '.join(forbidden)}, this "
                     "project's own attention: every exercise is to write the math yourself",
                     f"use only {FRAMEWORK[base.backend]}'s array operations (the stubs' "
                     "imports are enough)", None)
    loaded = outcomes["load"]
    if loaded is not None:
        if loaded.get("status") == "missing_function":
            return _fail(base, "missing_function", f"{path.name} defines no function "
                         f"{ex.function}", f"define {ex.function}(...) as the stub does", None)
        return _exception_verdict(base, loaded, None, "file")
    for i, check in enumerate(ex.checks):
        failed = _grade_check(ex, base.backend, check, outcomes["checks"][i],
                              results.get(str(i)), base)
        if failed is not None:
            return failed
        base.passed_checks.append(check.name)
    base.passed, base.diagnosis = True, "ok"
    return base


def _grade_check(ex: Exercise, backend: str, check: Check, outcome: dict[str, Any],
                 actual: np.ndarray | None, base: Verdict) -> Verdict | None:
    """None when the check passes, else the verdict."""
    status = outcome.get("status")
    if status == "not_implemented":
        return _fail(base, "not_implemented", f"{ex.function} is not written yet (it raises "
                     "NotImplementedError)", ex.hint, check)
    if status == "exception":
        return _exception_verdict(base, outcome, check, ex.function)
    if status == "none":
        return _fail(base, "none", f"{ex.function} returned None", "did you forget `return`?",
                     check)
    if status == "sequence":
        return _fail(base, "type", f"{ex.function} returned a {outcome.get('type')}",
                     "return one array", check)
    if status == "foreign":
        return _fail(base, "type", f"{ex.function} returned a {outcome.get('type')}",
                     f"return {TYPE_NAMES[backend]}", check)
    if status == "convert":
        return _exception_verdict(base, outcome, check, "result")
    if status != "ok" or actual is None:
        return _fail(base, "malformed", f"no result for this check (status {status!r})",
                     "only what your function returns is graded", check)
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
    if check.mistake is not None:
        named = check.mistake
        return _fail(base, named.key, named.says, named.hint, check, _worst(res))
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
    p.add_argument("number", nargs="?",
                   help=f"the exercise: 1–{len(EXERCISES)} or its name (see --list)")
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
        raise UsageError(f"exercise: give its number (1–{len(EXERCISES)}) or --list")
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
    """``grade`` with the learner's function in a child process stopped after ``timeout``
    seconds; the verdict names the file as the working directory sees it."""
    verdict = grade(number, backend, path, isolated=True, timeout=timeout)
    verdict.file = _shown(path)
    return verdict


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it."""
    relative = os.path.relpath(path.resolve())
    return str(path) if relative.startswith("..") else relative


__all__ = ["BACKENDS", "EXERCISES", "Verdict", "add_arguments", "check_usage", "exercise",
           "grade", "listing", "load", "main", "run_isolated", "stub_path"]
