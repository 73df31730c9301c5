"""The HTML report (``conformance/reporting/html``), opened in a real headless browser.

One cheap real run — numpy, ``examples.wrong_attention``, a module whose every call raises a
message made of markup, and the peer ``torch.sdpa``; four cases in float32 and float16 — has
ok, FAIL, error, known and n/a cells. A made-up run as wide as the full run (``--full``: its 18
columns, every case of the catalogue, 4 dtypes) checks the layout and the page's size. Each
page is loaded from the file in Chromium, driven by
Playwright (``executable_path``: the system's Chromium; no browser is downloaded). The tests
skip, saying why, without Playwright or a Chromium — and fail instead where
``CONFORMANCE_REQUIRE_BROWSER`` is set, as CI (``.ci/run``) does after installing both. A
screenshot of the page lands in ``artifacts/`` (ignored by git; CI keeps it).
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shutil
import types
from pathlib import Path

import numpy as np
import pytest

from conformance import spec
from conformance.__main__ import main
from conformance.cases import catalogue
from conformance.comparing.compare import StepResult
from conformance.comparing.results import Cell, Column, RunResult, rerun_command
from conformance.diagnosing.diagnose import short
from conformance.reporting import groups, sections
from conformance.reporting.html import page, pictures, render, write
from conformance.reporting.plots import write_plots
from conformance.running import backends, runner
from conformance.spec import seed_example

# One run and one browser for the module: its tests share a pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("html_report")

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
#: A plugin's error message is untrusted input: markup that would run if it reached the page.
PAYLOAD = "</script><script>alert(1)</script><img src=x onerror=alert(2)> &amp; done"
EVIL = "evil_markup"
CASES = ["self", "padding", "causal_bottom_right", "softcap"]
DTYPES = ["float32", "float16"]
#: The full run's columns (``--full``, docs/checking.md, HTML report): 3 backends, 15 peers.
FULL_RUN_COLUMNS = ("numpy", "jax", "torch", "torch.sdpa", "torch.MHA", "torch.MHA[sdpa]",
                    "torch.flex", "jax.nn", "jax.nn[lengths]", "keras[numpy]", "keras[jax]",
                    "keras[torch]", "flax.nnx", "transformers.eager", "transformers.sdpa",
                    "transformers.gpt_oss", "onnxruntime", "onnxruntime[nonpad]")
#: The steps a backend cell of the full run compares (10 of its sdpa cases' 14); a peer's.
STEPS = ("scores", "masked_scores", "weights", "output", "output_weights", "grad_query",
         "grad_key", "grad_value", "lse", "blockwise_output")
PEER_STEPS = ("output", "lse")


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _raises(query, key, value, **options):  # noqa: ANN001, ANN202 - the plugin's signature
    raise RuntimeError(PAYLOAD)


@pytest.fixture(scope="module")
def result():  # noqa: ANN201
    pytest.importorskip("torch", reason="the peer column torch.sdpa needs torch")
    module = types.ModuleType(EVIL)
    module.scaled_dot_product_attention = _raises
    backends.register(backends.from_module(module, name=EVIL))
    try:
        yield runner.run(["numpy", "examples.wrong_attention", EVIL, "torch.sdpa"], CASES, DTYPES,
                         hypothesis=0, check_errors=False, progress=False)
    finally:
        backends.unregister(EVIL)


def wide_result() -> RunResult:
    """A made-up passing run shaped like the full run: ``FULL_RUN_COLUMNS``, every case
    of the catalogue in 4 dtypes; a backend cell compares ``STEPS``, a peer's cells are in turn
    ok, known (its lse over the tolerance) and n/a (one reason per peer), and compare
    ``PEER_STEPS``."""
    rng = np.random.default_rng(0)
    dtypes = ["float64", "float32", "bfloat16", "float16"]
    names = [c.name for c in catalogue.CASES]
    columns = [Column(n, "backend" if i < 3 else "peer") for i, n in enumerate(FULL_RUN_COLUMNS)]

    def steps(names: tuple[str, ...], known: bool) -> list[StepResult]:
        out = []
        for step in names:
            actual = float(rng.normal())
            over = known and step == "lse"
            out.append(StepResult(step, float(rng.uniform(1.5, 9) if over else rng.uniform()),
                                  not over, tuple(int(i) for i in rng.integers(0, 8, 4)),
                                  actual, actual + float(rng.normal()) * 1e-7,
                                  float(rng.uniform()) * 1e-6,
                                  "must be NaN (the spec's IEEE rule)" if over else ""))
        return out

    cells = []
    for case in names:
        for dtype in dtypes:
            for i, col in enumerate(columns):
                status = "ok" if col.kind == "backend" else ("ok", "known", "n/a")[i % 3]
                cells.append(Cell(
                    case, dtype, col.name, status=status,
                    ratio=None if status == "n/a" else float(rng.uniform()),
                    steps=[] if status == "n/a" else steps(
                        STEPS if col.kind == "backend" else PEER_STEPS, status == "known"),
                    detail=f"{col.name} cannot express the case" if status == "n/a" else "",
                    spec_backend=col.kind == "backend",
                    rerun=rerun_command(case, dtype, col.name),
                    alternatives=("lse +inf",) if status == "known" else (),
                    alternative_ratio=0.03 if status == "known" else None))
    return RunResult(columns, cells, {}, [(c, d) for c in names for d in dtypes])


def _missing(reason: str) -> None:
    """Skip, or fail where CI requires the browser (``.ci/run`` sets the variable)."""
    if os.environ.get("CONFORMANCE_REQUIRE_BROWSER"):
        pytest.fail(f"CONFORMANCE_REQUIRE_BROWSER is set, but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():  # noqa: ANN201
    if importlib.util.find_spec("playwright") is None:
        _missing("the browser test needs Playwright: pip install playwright "
                 "(requirements-test.txt)")
    executable = _chromium()
    if executable is None:
        _missing("the browser test needs Chromium: apt-get install -y chromium (.ci/run "
                 "installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable)
        try:
            yield browser
        finally:
            browser.close()


class Loaded:
    """A page opened from a file, with what it logged, requested and popped up."""

    def __init__(self, browser, path: Path) -> None:  # noqa: ANN001
        self.problems: list[str] = []  # console errors, page errors, dialogs
        self.requests: list[str] = []
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.page.set_default_timeout(10_000)
        self.page.on("console", lambda m: m.type == "error" and self.problems.append(m.text))
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("dialog", lambda d: (self.problems.append(f"dialog: {d.message}"),
                                          d.dismiss()))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(path.as_uri())

    def visible(self) -> int:
        """How many grid cells a reader sees."""
        return self.page.evaluate("""[...document.querySelectorAll('#grid td.cell')].filter(
            (e) => e.offsetParent !== null && getComputedStyle(e).visibility !== 'hidden'
            && getComputedStyle(e.parentElement).display !== 'none').length""")

    def click(self, column: str, case: str, dtype: str) -> str:
        """Click the cell of (column, case, dtype) by its tooltip; the detail panel's text."""
        self.page.locator(f'#grid td.cell[title^="{column} · {case} · {dtype}:"]').click()
        return self.page.locator("#detail").inner_text()


@pytest.fixture(scope="module")
def loaded(result, browser, tmp_path_factory):  # noqa: ANN001, ANN201
    path = write(result, tmp_path_factory.mktemp("html") / "report.html")
    loaded = Loaded(browser, path)
    yield loaded
    loaded.click("examples.wrong_attention", "padding", "float32")  # a reproducer in the picture
    ARTIFACTS.mkdir(exist_ok=True)
    loaded.page.screenshot(path=str(ARTIFACTS / "html_report.png"), full_page=True)
    loaded.page.close()


def _cell(result, column: str, case: str, dtype: str):  # noqa: ANN001, ANN202
    return next(c for c in result.cells if (c.column, c.case, c.dtype) == (column, case, dtype))


def test_the_data_blob_cannot_end_its_script_element() -> None:
    data = {"message": PAYLOAD, "nested": [{"why": "a <!-- b ]]> c \u2028 d"}]}
    text = page.blob(data)
    assert "</" not in text and "<!--" not in text and "]]>" not in text and "\u2028" not in text
    assert json.loads(text) == data


def test_the_assets_are_package_data() -> None:
    """The page's CSS and JS travel in the wheel (pyproject's package-data lists them)."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib: Python 3.11+")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assets = data["tool"]["setuptools"]["package-data"]["conformance.reporting.html"]
    assert sorted(assets) == sorted(page.ASSETS)
    assert all(page.asset(name) for name in page.ASSETS)


@pytest.mark.slow
def test_the_page_loads_without_errors_and_fetches_nothing(result, loaded) -> None:  # noqa: ANN001
    assert loaded.problems == []
    # the plugin's markup is shown as text, and no element came from it
    assert f"RuntimeError: {PAYLOAD}" in loaded.click(EVIL, "self", "float32")
    assert loaded.page.evaluate("document.scripts.length") == 2
    assert loaded.page.evaluate("document.querySelectorAll('img[src=\"x\"]').length") == 0
    assert loaded.problems == []
    assert loaded.requests == [loaded.page.url]  # the file itself: no CDN, font or server


@pytest.mark.slow
def test_the_grid_has_one_cell_per_result(result, loaded) -> None:  # noqa: ANN001
    titles = loaded.page.locator("#grid td.cell").evaluate_all("(es) => es.map((e) => e.title)")
    assert len(titles) == len(result.cells) == 4 * len(CASES) * len(DTYPES)
    assert {t.split(": ")[0] + ": " + t.split(": ")[1].split(" ")[0] for t in titles} == {
        f"{c.column} · {c.case} · {c.dtype}: {c.status}" for c in result.cells}
    assert {c.status for c in result.cells} >= {"ok", "FAIL", "error", "known", "n/a"}
    assert loaded.visible() == len(result.cells)


@pytest.mark.slow
def test_the_filters_hide_and_show_cells(result, loaded) -> None:  # noqa: ANN001
    page = loaded.page

    def toggle(kind: str, value: str) -> int:
        page.locator(f'#filters input[data-filter="{kind}"][value="{value}"]').click()
        return loaded.visible()

    assert toggle("status", "ok") == sum(c.status != "ok" for c in result.cells)
    assert toggle("status", "ok") == len(result.cells)
    column = [c.name for c in result.columns].index("torch.sdpa")
    assert toggle("column", str(column)) == sum(c.column != "torch.sdpa" for c in result.cells)
    assert toggle("column", str(column)) == len(result.cells)
    assert toggle("dtype", str(DTYPES.index("float16"))) == sum(
        c.dtype != "float16" for c in result.cells)
    assert toggle("dtype", str(DTYPES.index("float16"))) == len(result.cells)
    page.locator("#case-filter").fill("PADD")
    assert loaded.visible() == sum(c.case == "padding" for c in result.cells)
    page.locator("#only-failing").click()  # and the case filter still holds
    assert loaded.visible() == sum(c.case == "padding" and c.status in ("FAIL", "error")
                                   for c in result.cells)
    page.locator("#reset").click()
    assert loaded.visible() == len(result.cells)
    assert page.locator("#shown").inner_text() == f"{len(result.cells)} of {len(result.cells)} " \
                                                  "cells shown"


@pytest.mark.slow
def test_a_cell_shows_its_steps_against_the_tolerance(result, loaded) -> None:  # noqa: ANN001
    cell = _cell(result, "numpy", "padding", "float32")
    loaded.click("numpy", "padding", "float32")
    rows = loaded.page.locator("#detail table.steps tr:has(td.mono)").evaluate_all(
        "(rs) => rs.map((r) => [...r.cells].map((c) => c.innerText.trim()))")
    assert [r[0] for r in rows] == [s.step for s in cell.steps]
    for row, step in zip(rows, cell.steps, strict=True):
        assert float(row[1]) == pytest.approx(step.ratio, abs=0.006)  # shown with 2 decimals
        assert row[2] == str([int(i) for i in step.index])  # where
        for shown, value in zip(row[3:6], (step.actual, step.expected, step.bound), strict=True):
            assert float(shown) == pytest.approx(value, rel=1e-3)


@pytest.mark.slow
def test_a_failing_cell_shows_its_reproducer_and_rerun(result, loaded) -> None:  # noqa: ANN001
    text = loaded.click("examples.wrong_attention", "padding", "float32")
    assert "mask polarity flipped" in text
    assert rerun_command("padding", "float32", "examples.wrong_attention") in text
    code = loaded.page.locator("#detail .reproducer pre").inner_text()
    assert "attn = backends.load('examples.wrong_attention')" in code
    assert "mask = np.array(" in code  # the bug needs a mask: the smallest case keeps it
    namespace: dict = {}
    exec(compile(code, "reproducer", "exec"), namespace)  # the script runs and shows the bug
    assert not np.allclose(namespace["actual"], namespace["expected"], equal_nan=True)


@pytest.mark.slow
def test_a_known_cell_shows_its_alternative_and_distance(result, loaded) -> None:  # noqa: ANN001
    cell = _cell(result, "torch.sdpa", "causal_bottom_right", "float32")
    assert cell.status == "known"
    entry = next(e for e in spec.KNOWN_DIFFERENCES["torch.sdpa"] if e["alternative"] == "top_left")
    text = loaded.click("torch.sdpa", "causal_bottom_right", "float32")
    distance = loaded.page.locator("#detail .distance").first.inner_text()
    assert float(distance) == pytest.approx(cell.alternative_ratio, abs=0.006)
    for part in (entry["differs"], entry["why"], spec.KNOWN_ALTERNATIVES["top_left"]):
        assert part in text
    na = _cell(result, "torch.sdpa", "softcap", "float16")
    assert na.status == "n/a" and na.detail in loaded.click("torch.sdpa", "softcap", "float16")


#: What a header cell of the grid shows of itself: its box, and whether its text is clipped.
HEADERS = """() => [...document.querySelectorAll('#grid thead th')].map((th) => {
    const box = th.getBoundingClientRect();
    return {text: th.innerText, title: th.title, left: box.left, right: box.right,
            clipped: th.scrollWidth > th.clientWidth || th.scrollHeight > th.clientHeight};
})"""


@pytest.mark.slow
def test_every_column_of_a_full_run_fits_1400_px(browser, tmp_path) -> None:  # noqa: ANN001
    """At 1,400 px every column of a run as wide as the full run (18 columns, 4 dtypes) is on
    screen without scrolling sideways, no header is clipped, and each column's full name is
    its header's tooltip and in the key list."""
    wide = Loaded(browser, write(wide_result(), tmp_path / "wide.html", with_pictures=False))
    page, width = wide.page, 1400
    assert page.evaluate("document.documentElement.clientWidth") <= width
    heads = page.evaluate(HEADERS)
    assert len(heads) == 1 + len(FULL_RUN_COLUMNS) * 5  # case, per column its key and 4 dtypes
    outside = [h["title"] or h["text"] for h in heads if h["left"] < 0 or h["right"] > width]
    assert outside == []
    assert [h["title"] or h["text"] for h in heads if h["clipped"]] == []
    assert page.evaluate("""() => { const wrap = document.querySelector('.grid-wrap');
        return wrap.scrollWidth <= wrap.clientWidth
            && document.documentElement.scrollWidth <= document.documentElement.clientWidth; }""")
    last = page.locator("#grid td.cell").last.bounding_box()  # onnxruntime[nonpad], float16
    assert last["x"] + last["width"] <= width
    keys = {h["title"]: h["text"] for h in heads if h["title"].endswith(")")}
    assert list(keys) == [f"{n} ({'backend' if i < 3 else 'peer'})"
                          for i, n in enumerate(FULL_RUN_COLUMNS)]
    listed = page.locator("#column-keys").inner_text()
    for title, key in keys.items():
        assert len(key) <= 4 and f"{key} {title.rsplit(' (', 1)[0]}" in listed
    assert page.locator("#diagnosis").count() == 0  # a passing run's banner has no diagnosis
    assert wide.problems == []
    page.close()


def _background(page, selector: str) -> str:  # noqa: ANN001
    return page.locator(selector).first.evaluate("(e) => getComputedStyle(e).backgroundColor")


@pytest.mark.slow
def test_a_known_difference_is_not_shaded_as_a_failure(result, loaded) -> None:  # noqa: ANN001
    """A known cell has its own colour in the grid, and in its detail the step its known
    difference explains (over the spec's tolerance) is not shaded as a FAIL cell's failed
    step is."""
    page = loaded.page
    grid = {s: _background(page, f'#grid td.cell[data-status="{s}"]')
            for s in ("ok", "known", "FAIL", "error", "n/a")}
    assert len(set(grid.values())) == len(grid), grid

    def over(column: str, case: str, dtype: str) -> str:
        cell = _cell(result, column, case, dtype)
        step = next(s.step for s in cell.steps if not s.passed)
        loaded.click(column, case, dtype)
        row = page.locator("#detail table.steps tr").filter(
            has=page.locator(f'td.mono:text-is("{step}")'))
        return row.first.evaluate("(e) => getComputedStyle(e.cells[0]).backgroundColor")

    known = over("torch.sdpa", "causal_bottom_right", "float32")
    failed = over("examples.wrong_attention", "padding", "float32")
    passed = _background(page, "#detail table.steps tr:not(.failed) td")
    assert len({known, failed, passed}) == 3, (known, failed, passed)


@pytest.mark.slow
def test_the_fail_banner_names_each_diagnosis_and_its_rerun(result, loaded) -> None:  # noqa: ANN001
    """The banner of a failing run names each group of failing cells by its diagnosis, as the
    terminal report groups them (``groups.groups``), with a rerun command of one of its cells;
    its button opens that cell."""
    page = loaded.page
    banner = page.locator("#banner").inner_text()
    assert banner.startswith(sections.summary(result).split(";")[0])
    found = groups.groups(result)
    assert len(found) >= 2
    items = page.locator("#diagnosis li[data-group]").all_inner_texts()
    assert len(items) == len(found)
    for item, ((column, _, reason), cells) in zip(items, found.items(), strict=True):
        assert item.startswith(short(reason)) and column in item
        assert any(c.rerun in item for c in cells)
    assert "mask polarity flipped" in banner  # the planted bug of examples.wrong_attention
    assert rerun_command("padding", "float32", "examples.wrong_attention") in banner
    page.locator("#diagnosis li", has_text="mask polarity flipped").locator("button").click()
    assert "examples.wrong_attention · padding" in page.locator("#detail h2").inner_text()
    page.keyboard.press("Escape")
    assert page.locator("#detail").is_hidden()


def test_the_page_of_a_full_run_is_small() -> None:
    """The page of a run shaped like the full run, pictures left out: 1.1 MB, where it
    took 2.5 MB when each step named its fields and each cell carried its own strings
    (docs/checking.md, HTML report)."""
    html = render(wide_result(), with_pictures=False)
    assert len(html.encode("utf-8")) < 1_500_000
    blob = json.loads(re.search(r'id="report-data">(.*?)</script>', html, re.S).group(1))
    assert len(blob["texts"]) < 100  # a peer's n/a reason, a step's name: each once
    assert all("rerun" not in c for c in blob["cells"])  # each is data.RERUN filled in


@pytest.mark.slow
def test_the_pictures_are_embedded_or_the_page_says_why(result, loaded, browser, tmp_path,
                                                        monkeypatch) -> None:  # noqa: ANN001
    if importlib.util.find_spec("matplotlib") is not None:
        loaded.click("numpy", "self", "float32")
        assert loaded.page.locator("#detail img.picture").get_attribute("src").startswith(
            "data:image/png;base64,")
        assert loaded.page.locator("#pictures img").count() == len(result.columns)
        # each picture is embedded with a palette: under half of matplotlib's PNG (about a
        # quarter), looking the same (a mean difference under 3 of 255 per channel)
        from PIL import Image

        drawn = write_plots(result, tmp_path / "plots")
        small = [pictures.small_png(path) for path in drawn]
        assert sum(map(len, small)) < sum(path.stat().st_size for path in drawn) / 2
        for path, png in zip(drawn, small, strict=True):
            before = np.asarray(Image.open(path).convert("RGB"), np.float64)
            after = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), np.float64)
            assert before.shape == after.shape and np.abs(before - after).mean() < 3
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    bare = Loaded(browser, write(result, tmp_path / "bare.html"))
    assert bare.page.locator("#no-pictures").inner_text() == pictures.NO_MATPLOTLIB
    assert bare.problems == []
    bare.page.close()


@pytest.mark.slow
def test_the_articles_weights_show_each_steps_numbers_on_hover(loaded) -> None:  # noqa: ANN001
    """The seed article's example on the page: pointing at query 3 ('short,') → key 2 ('is')
    shows its score ω = q·k, ω/√2 and its softmax weight, each equal to a float64 computation
    made here from ``seed_example``; a cell the causal rule masks shows −inf and weight 0."""
    x = np.array(seed_example.EMBEDDING, np.float64)
    w = {n: np.array(a, np.float64) for n, a in seed_example.self_attention_weights().items()}
    omega = (x @ w["W_query"]) @ (x @ w["W_key"]).T  # (6, 6)
    scaled = omega / np.sqrt(2)
    weights = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    page = loaded.page
    numbers = re.compile(r"ω = q·k = (\S+); ω/√2 = (\S+ ?\S*); weight = (\S+)$")
    cell = page.locator('#article table[data-part="plain"] td[data-row="2"][data-col="1"]')
    cell.hover()
    text = page.locator("#article-tip").inner_text()
    assert "query 3 'short,' → key 2 'is'" in text and text == cell.get_attribute("title")
    shown = [float(v) for v in numbers.search(text).groups()]
    assert shown == pytest.approx([omega[2, 1], scaled[2, 1], weights[2, 1]], rel=1e-5)
    page.locator('#article table[data-part="causal"] td[data-row="0"][data-col="3"]').hover()
    masked = numbers.search(page.locator("#article-tip").inner_text()).groups()
    assert float(masked[0]) == pytest.approx(omega[0, 3], rel=1e-5)
    assert masked[1:] == ("−inf (masked)", "0")
    assert loaded.problems == []


@pytest.mark.slow
def test_html_on_run_and_check(tmp_path, capsys) -> None:  # noqa: ANN001
    target = tmp_path / "run.html"
    assert main(["--backend", "numpy", "--case", "self", "--dtype", "float32", "--no-errors",
                 "--html", str(target)]) == 0
    text = target.read_text(encoding="utf-8")
    assert "default-src 'none'" in text and 'id="report-data"' in text
    assert not re.search(r"(?:src|href)\s*=\s*\"(?!data:)", text)  # nothing fetched from outside
    assert main(["export", str(tmp_path / "golden"), "--case", "self", "--dtype", "float32"]) == 0
    checked = tmp_path / "check.html"
    assert main(["check", str(tmp_path / "golden"), "--backend", "numpy", "--html",
                 str(checked)]) == 0
    data = json.loads(re.search(r'id="report-data">(.*?)</script>', checked.read_text(
        encoding="utf-8"), re.S).group(1))
    assert [c["name"] for c in data["columns"]] == ["numpy"] and data["ok"] is True
    capsys.readouterr()
    missing = tmp_path / "no such folder" / "r.html"
    assert main(["--backend", "numpy", "--case", "self", "--html", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --html ") and "does not exist" in err and "\n" not in err
