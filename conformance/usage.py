"""Mistakes in calling the harness, as opposed to bugs in the harness or in a backend.

An unknown case pattern, an unknown backend name, a golden directory that is missing or altered:
``python -m conformance`` prints a ``UsageError`` as one line (``error: …``) and exits with code
2. Any other exception is a bug and surfaces as a traceback (exit code 1).
"""

from __future__ import annotations


class UsageError(Exception):
    """A mistake in how the harness was called: exit code 2 with a one-line message."""
