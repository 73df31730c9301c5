"""The HTML report's one file: the page's shell, its inline CSS and JS, and the data blob.

``render(data)`` puts ``data.page_data``'s dict into a ``<script type="application/json">``
element and the two assets of this package (``page.css``, ``page.js``: vanilla CSS and JS,
no library) inline; the script builds the whole page from the blob, inserting every string
as text (``textContent``), never as markup. Two guards keep an untrusted string — a plugin's
error message such as ``</script><script>alert(1)</script>`` — inert:

* ``blob`` escapes ``<``, ``>``, ``&`` (and U+2028/U+2029) inside the JSON as ``\\u003c`` …,
  so no string can end the data element; the text still reads the same once parsed;
* a Content-Security-Policy lets only this page's own script and style run (by their SHA-256
  hashes) and loads nothing from anywhere (``default-src 'none'``; images only as ``data:``
  URIs): the file works offline, with no server, CDN or web font, and a browser that met an
  injected script would refuse to run it.
"""

from __future__ import annotations

import base64
import hashlib
import json
from importlib import resources
from typing import Any

#: The assets, next to this file (package data of ``conformance.reporting.html``).
ASSETS = ("page.css", "page.js")

_SHELL = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; \
style-src {style_hash}; script-src {script_hash}; base-uri 'none'; form-action 'none'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="python -m conformance --html">
<link rel="icon" href="data:,">
<title>Conformance report</title>
<style>{css}</style>
</head>
<body>
<noscript><p>This report is drawn by its inline script: allow JavaScript for this file. Its data
is the JSON in the element with id "report-data" of the page's source.</p></noscript>
<main id="app"></main>
<script type="application/json" id="report-data">{blob}</script>
<script>{js}</script>
</body>
</html>
"""

_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
            "\u2029": "\\u2029"}


def asset(name: str) -> str:
    """The text of one of ``ASSETS``."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def blob(data: dict[str, Any]) -> str:
    """``data`` as JSON that is safe inside a ``<script>`` element: no ``</``, ``<!--`` or
    ``]]>`` can appear (``<``, ``>``, ``&`` are ``\\u`` escapes inside strings, where they alone
    can occur); ``json.loads`` of it gives ``data`` back. NaN and infinity are errors
    (``data.number`` turns them into strings first)."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for char, escape in _ESCAPES.items():
        text = text.replace(char, escape)
    return text


def csp_hash(text: str) -> str:
    """The CSP source expression ``'sha256-…'`` that allows exactly this inline text."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return "'sha256-" + base64.b64encode(digest).decode("ascii") + "'"


def render(data: dict[str, Any]) -> str:
    """The whole page, one self-contained HTML document."""
    css, js = (asset(name) for name in ASSETS)
    for name, text, end in (("page.css", css, "</style"), ("page.js", js, "</script")):
        if end in text.lower():  # would end its element early: a bug of the asset
            raise ValueError(f"{name} contains {end!r}")
    return _SHELL.format(style_hash=csp_hash(css), script_hash=csp_hash(js), css=css, js=js,
                         blob=blob(data))


__all__ = ["ASSETS", "asset", "blob", "csp_hash", "render"]
