"""The HTML report's pictures: the run's plots as base64 PNG ``data:`` URIs.

``embed(result)`` draws exactly what ``--plot DIR`` draws (``plots.write_plots``: one heatmap
of the float64 attention weights per case, one error-vs-dtype plot per column, the tolerance
as a line at 1) into a temporary folder and reads the files back, so the page and ``--plot``
never disagree. Without matplotlib (an optional package: ``pip install matplotlib``) the page
has no pictures and says so, with the install command; the report itself does not need them.
The teaching pictures (``python -m conformance pictures``: one per mask type, the same for
every run) are not embedded: they are in docs/images/ and would add about 0.4 MB to every page.

Each picture is stored with a palette of at most 256 colours (``small_png``; Pillow, which
matplotlib needs, does it): the plots hold few colours, so it looks the same and takes about a
quarter of matplotlib's full-colour PNG (the default run's 64 pictures: 1.07 MB of PNG before,
0.31 MB after).
"""

from __future__ import annotations

import base64
import importlib.util
import io
import tempfile
from pathlib import Path
from typing import Any

from ...comparing.results import RunResult, error_text
from ..plots import write_plots

#: What the page says when matplotlib is missing.
NO_MATPLOTLIB = ("no pictures: matplotlib is not installed (pip install matplotlib draws the "
                 "weights heatmaps and the error-vs-tolerance plots into this page)")


#: At most this many colours in an embedded picture (a PNG palette holds 256).
COLOURS = 256
#: ``PIL.Image.Quantize.FASTOCTREE`` (named so from Pillow 9.1): keeps a plot's few colours.
_FAST_OCTREE = 2


def small_png(path: str | Path) -> bytes:
    """The PNG at ``path`` with a palette of at most ``COLOURS`` colours, or the file's own bytes
    where that is no smaller."""
    from PIL import Image  # matplotlib's own dependency

    original = Path(path).read_bytes()
    with Image.open(io.BytesIO(original)) as image:
        palette = image.convert("RGB").quantize(colors=COLOURS, method=_FAST_OCTREE)
    out = io.BytesIO()
    palette.save(out, format="PNG", optimize=True)
    return min(out.getvalue(), original, key=len)


def data_uri(path: str | Path) -> str:
    """A PNG file as a ``data:image/png;base64,…`` URI (``small_png``'s bytes)."""
    return "data:image/png;base64," + base64.b64encode(small_png(path)).decode("ascii")


def embed(result: RunResult) -> dict[str, Any]:
    """``{"available": True, "weights": {case: uri}, "errors": {column: uri}, "other": {file:
    uri}}``, or ``{"available": False, "note": why}`` without matplotlib or when drawing fails
    (the failure's first line, never a traceback)."""
    if importlib.util.find_spec("matplotlib") is None:
        return {"available": False, "note": NO_MATPLOTLIB}
    cases = {case for case, _ in result.rows}
    columns = {c.name.replace("/", "_"): c.name for c in result.columns}
    out: dict[str, Any] = {"available": True, "weights": {}, "errors": {}, "other": {}}
    with tempfile.TemporaryDirectory(prefix="conformance-html-") as tmp:
        try:
            written = write_plots(result, tmp)
        except Exception as exc:  # noqa: BLE001 - the page is still useful without them
            return {"available": False, "note": f"no pictures: drawing them failed: "
                                                 f"{error_text(exc)}"}
        order = {f"errors_{name}": i for i, name in enumerate(columns)}  # the columns' order
        for path in sorted((Path(p) for p in written), key=lambda p: (order.get(p.stem, -1),
                                                                       p.name)):
            stem = path.stem
            if stem.startswith("weights_") and stem[len("weights_"):] in cases:
                out["weights"][stem[len("weights_"):]] = data_uri(path)
            elif stem.startswith("errors_") and stem[len("errors_"):] in columns:
                out["errors"][columns[stem[len("errors_"):]]] = data_uri(path)
            else:
                out["other"][path.name] = data_uri(path)
    return out


__all__ = ["COLOURS", "NO_MATPLOTLIB", "data_uri", "embed", "small_png"]
