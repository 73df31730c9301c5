"""Counted nouns in the reports' sentences: ``plural(1, "case")`` is "1 case", never "1 cases"
or "1 case(s)". Standard library only.
"""

from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``n`` and ``noun``, in the plural when ``n`` is not 1: ``plural(1, "case")`` "1 case",
    ``plural(2, "case")`` "2 cases", ``plural(0, "entry", "entries")`` "0 entries" (``nouns``:
    the plural where adding "s" is wrong)."""
    return f"{n} {noun}" if n == 1 else f"{n} {nouns or noun + 's'}"


__all__ = ["plural"]
