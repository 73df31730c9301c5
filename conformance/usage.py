"""Mistakes in calling the harness, as opposed to bugs in the harness or in a backend.

An unknown case pattern, an unknown backend name, a golden directory that is missing or altered:
``python -m conformance`` prints a ``UsageError`` as one line (``error: …``) and exits with code
2. Any other exception is a bug and surfaces as a traceback (exit code 1).
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable


class UsageError(Exception):
    """A mistake in how the harness was called: exit code 2 with a one-line message."""


def at_least(minimum: int) -> Callable[[str], int]:
    """An ``argparse`` type: an integer ``>= minimum`` (otherwise argparse's one-line error,
    exit code 2). The same rule for every subcommand's counts (threads, rounds, examples)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum, {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


#: How to install each optional package the harness uses, one command per package: the
#: frameworks of the spec backends (numpy_attn needs only NumPy) and of the peers, and the tools.
#: torch is the version requirements.txt pins; the others take the newest release.
INSTALL = {"jax": "pip install jax",
           "torch": "pip install torch==2.13.0",
           **{name: f"pip install {name}" for name in (
               "keras", "flax", "transformers", "onnx", "onnxruntime", "hypothesis",
               "matplotlib", "numpy", "ml_dtypes")}}


def require_frameworks(names: list[str] | tuple[str, ...], what: str, hint: str = "") -> None:
    """A ``UsageError`` naming the install command of each of ``names`` (``"jax"``,
    ``"torch"``) that is not installed, before any work; ``hint`` is added to the line."""
    missing = [n for n in names if n in INSTALL and importlib.util.find_spec(n) is None]
    if missing:
        installs = " and ".join(INSTALL[n] for n in missing)
        raise UsageError(f"{what} needs {', '.join(missing)}; install: {installs}"
                         + (f" ({hint})" if hint else ""))


def exit_code_of(main: Callable[[], int]) -> int:
    """``main()``, with a ``UsageError`` printed as one line and exit code 2 (for the
    subcommands that also run as ``python -m conformance.<name>``)."""
    import sys

    try:
        return main()
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
