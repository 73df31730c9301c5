"""Render ``conformance/spec.py`` as Markdown (``docs/spec.md``), so the two never drift.

``python -m conformance spec`` prints it; ``python -m conformance spec --write`` rewrites
``docs/spec.md``; a test fails when the file differs from what this renders.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
from pathlib import Path

from . import spec

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "spec.md"


def _signature(obj: object, name: str) -> str:
    return f"{name}{inspect.signature(obj)}"  # type: ignore[arg-type]


def _doc(obj: object) -> str:
    return inspect.cleandoc(obj.__doc__ or "")


def _constant(name: str, value: object) -> str:
    if isinstance(value, str):
        return f"### `{name}`\n\n{value}\n"
    return f"### `{name}`\n\n```json\n{json.dumps(value, indent=2, ensure_ascii=False)}\n```\n"


#: Public names of ``spec`` that are not rules to print: they index the sections below.
STRUCTURE = ("FUNCTIONS", "MODULES", "MODULE_METHODS", "CLASSES", "DECODING_MODULES",
             "MASKED_SCORE")


def constants() -> list[str]:
    """Every public constant of ``spec`` (an upper-case name) except the lists that index the
    sections (``STRUCTURE``), so a new rule is never left out of the document: those the spec
    defines in their order, then those it imports (``FAST_PATHS``)."""
    tree = ast.parse(Path(inspect.getfile(spec)).read_text(encoding="utf-8"))
    defined = [t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
               if isinstance(t, ast.Name)]
    public = [name for name, value in vars(spec).items()
              if name.isupper() and not name.startswith("_") and name not in STRUCTURE
              and isinstance(value, (str, dict, tuple, list))]
    return ([n for n in defined if n in public]
            + [n for n in public if n not in defined])


def render() -> str:
    """The whole spec as Markdown."""
    parts = [
        "# Specification",
        "",
        "<!-- Generated from conformance/spec.py by `python -m conformance spec --write`. "
        "Do not edit by hand. -->",
        "",
        _doc(spec),
        "",
        "## Semantic constants",
        "",
    ]
    for name in constants():
        parts.append(_constant(name, getattr(spec, name)))
    parts += ["## Functions", ""]
    for name in spec.FUNCTIONS:
        fn = getattr(spec, name)
        parts += [f"### `{name}`", "", "```python", _signature(fn, name), "```", "", _doc(fn), ""]
    parts += ["## Modules", ""]
    for name in spec.MODULES:
        cls = getattr(spec, name)
        parts += [f"### `{name}`", "", _doc(cls), "", "```python"]
        parts.append(_signature(cls.__init__, f"{name}.__init__"))
        for method in spec.MODULE_METHODS:
            parts.append(_signature(getattr(cls, method), f"{name}.{method}"))
        parts += ["```", ""]
        forward_doc = _doc(cls.forward)
        if forward_doc:
            parts += [f"`forward`: {forward_doc}", ""]
    decode = spec.DecodingModule.decode
    parts += ["### `decode`", "", f"Method of {', '.join(spec.DECODING_MODULES)}.", "",
              "```python", _signature(decode, "decode"), "```", "", _doc(decode), ""]
    parts += ["## Classes", ""]
    for name in spec.CLASSES:
        cls = getattr(spec, name)
        parts += [f"### `{name}`", "", _doc(cls), "", "```python"]
        methods = [m for m, v in vars(cls).items() if not m.startswith("_")]
        for method in methods:
            parts.append(_signature(getattr(cls, method), f"{name}.{method}"))
        parts += ["```", ""]
        for method in methods:
            parts += [f"`{method}`: {_doc(getattr(cls, method))}", ""]
    return "\n".join(parts).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """``spec [--write]``: print the spec as Markdown, or write docs/spec.md."""
    parser = argparse.ArgumentParser(prog="python -m conformance spec", description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"write {DOC_PATH}")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
        DOC_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {DOC_PATH}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
