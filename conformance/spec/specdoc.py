"""Render the spec (``conformance/spec/``) as Markdown (``docs/spec.md``), so the two never drift.

One section per chapter file, in the order of ``CHAPTERS``: its docstring's summary line is the
section's title and the rest its introduction, then every public name the file defines, in the
file's order (constants, stubs of functions, modules and classes), then those it imports
(``FAST_PATHS``). ``python -m conformance spec`` prints it; ``python -m conformance spec
--write`` rewrites ``docs/spec.md``; a test fails when the file differs from what this renders.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
import types
from pathlib import Path

from .. import spec
from . import (
    checking,
    concurrency,
    constants,
    context_parallel,
    decoding,
    extras,
    functions,
    known_differences,
    latent_attention,
    masks_and_mods,
    modules,
    quantized_cache,
    rotary,
    varlen,
)

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "spec.md"

#: The spec's chapters, one file each, in the document's order.
CHAPTERS = (constants, functions, masks_and_mods, varlen, rotary, modules, decoding,
            latent_attention, quantized_cache, concurrency, context_parallel, extras, checking,
            known_differences)

#: Public names of ``spec`` that are not rules to print: they index the sections below.
STRUCTURE = ("FUNCTIONS", "MODULES", "MODULE_METHODS", "CLASSES", "DECODING_MODULES",
             "MASKED_SCORE")


def _signature(obj: object, name: str) -> str:
    return f"{name}{inspect.signature(obj)}"  # type: ignore[arg-type]


def _doc(obj: object) -> str:
    return inspect.cleandoc(obj.__doc__ or "")


def _constant(name: str, value: object) -> str:
    if isinstance(value, str):
        return f"### `{name}`\n\n{value}\n"
    return f"### `{name}`\n\n```json\n{json.dumps(value, indent=2, ensure_ascii=False)}\n```\n"


def _is_rule(name: str) -> bool:
    """A constant to print: an upper-case public name of ``spec`` holding text or data."""
    value = getattr(spec, name, None)
    return (name.isupper() and not name.startswith("_") and name not in STRUCTURE
            and isinstance(value, (str, dict, tuple, list)))


def names(chapter: types.ModuleType) -> list[str]:
    """The public names ``chapter`` defines, in its order (constants, functions, classes), then
    the constants it imports (``FAST_PATHS``)."""
    tree = ast.parse(Path(inspect.getfile(chapter)).read_text(encoding="utf-8"))
    defined: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined += [t.id for t in targets if isinstance(t, ast.Name)]
    imported = [a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom)
                for a in node.names]
    return ([n for n in defined if not n.startswith("_")]
            + [n for n in imported if _is_rule(n)])


def constants() -> list[str]:
    """Every constant the document prints (not the indexes of ``STRUCTURE``), chapter by
    chapter, each chapter's in its order."""
    return [n for module in CHAPTERS for n in names(module) if _is_rule(n)]


def _function(name: str) -> list[str]:
    fn = getattr(spec, name)
    return [f"### `{name}`", "", "```python", _signature(fn, name), "```", "", _doc(fn), ""]


def _module(name: str) -> list[str]:
    cls = getattr(spec, name)
    parts = [f"### `{name}`", "", _doc(cls), "", "```python",
             _signature(cls.__init__, f"{name}.__init__")]
    parts += [_signature(getattr(cls, m), f"{name}.{m}") for m in spec.MODULE_METHODS]
    parts += ["```", ""]
    forward_doc = _doc(cls.forward)
    return parts + ([f"`forward`: {forward_doc}", ""] if forward_doc else [])


def _decode() -> list[str]:
    decode = spec.DecodingModule.decode
    return ["### `decode`", "", f"Method of {', '.join(spec.DECODING_MODULES)}.", "",
            "```python", _signature(decode, "decode"), "```", "", _doc(decode), ""]


def _class(name: str) -> list[str]:
    cls = getattr(spec, name)
    methods = [m for m in vars(cls) if not m.startswith("_")]
    parts = [f"### `{name}`", "", _doc(cls), "", "```python"]
    parts += [_signature(getattr(cls, m), f"{name}.{m}") for m in methods]
    parts += ["```", ""]
    for method in methods:
        parts += [f"`{method}`: {_doc(getattr(cls, method))}", ""]
    return parts


def _entry(name: str) -> list[str]:
    """One public name of the spec as Markdown (an index of ``STRUCTURE``: nothing)."""
    value = getattr(spec, name)
    if _is_rule(name):
        return [_constant(name, value)]
    if name in spec.MODULES:
        return _module(name)
    if name == "DecodingModule":
        return _decode()
    if inspect.isclass(value):
        return _class(name)
    if inspect.isfunction(value):
        return _function(name)
    return []


def chapter(module: types.ModuleType) -> list[str]:
    """One chapter: its title and introduction (its docstring), then its names."""
    title, _, intro = _doc(module).partition("\n")
    parts = [f"## {title.rstrip('.')}", ""]
    if intro.strip():
        parts += [intro.strip(), ""]
    for name in names(module):
        parts += _entry(name)
    return parts


def render() -> str:
    """The whole spec as Markdown; a public name of ``spec`` that no chapter holds is an error,
    so a new rule is never left out of the document."""
    printed = {n for module in CHAPTERS for n in names(module)}
    public = {n for n, v in vars(spec).items() if not n.startswith("_")
              and not isinstance(v, types.ModuleType) and n not in ("Any", "annotations")}
    missing = sorted(public - printed)
    if missing:
        raise RuntimeError(f"specdoc: {', '.join(missing)} in no chapter of CHAPTERS")
    parts = [
        "# Specification",
        "",
        "<!-- Generated from conformance/spec/ by `python -m conformance spec --write`. "
        "Do not edit by hand. -->",
        "",
        _doc(spec),
        "",
    ]
    for module in CHAPTERS:
        parts += chapter(module)
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
