"""``python -m conformance walkthrough`` and ``python -m conformance pictures``."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from conformance import backends, compare
from conformance.__main__ import main
from conformance.spec import seed_example
from conformance.spec.seed_example import ARTICLE_INCONSISTENT
from conformance.teaching import walkthrough

INSTALLED = [n for n in backends.SPEC_BACKENDS if backends.get(n).available()]


@pytest.fixture(scope="module")
def printed() -> tuple[str, bool]:
    lines, ok = walkthrough.walkthrough(INSTALLED, width=120)
    return "\n".join(lines), ok


def test_every_backend_agrees_and_reproduces_the_article(printed):
    text, ok = printed
    assert ok, text
    assert "✗ every step" not in text
    for name in INSTALLED:
        assert f"{name} ✓ 36/36" in text  # ω, weights and both causal methods: 36 numbers
        assert f"{name} ✓ 24/24" in text  # module outputs
    for heading in ("嵌入", "交叉注意力", "因果自注意力", "renormalized_causal_weights",
                    "mask_scores(attention_scores(queries, keys), is_causal=True)"):
        assert heading in text


def test_the_article_inconsistencies_are_pointed_out(printed):
    text, _ = printed
    for key, entry in ARTICLE_INCONSISTENT.items():
        assert f"why ({key})" in text
        assert f"{entry['printed'][0]:.4f}" in text
    assert seed_example.CODE_SENTENCE in text and seed_example.SENTENCE in text
    assert "-0.2627" in text  # the one printed value that is a rounding off


@pytest.mark.skipif("torch" not in INSTALLED,
                    reason="torch not installed (pip install torch==2.13.0)")
def test_torch_draws_the_article_weights_itself(printed):
    text, _ = printed
    assert "17/17 arrays bit-identical to seed_example" in text
    drawn = walkthrough.run_backend("torch")
    for name, value in walkthrough.article_inputs().items():
        np.testing.assert_array_equal(drawn[name], value, err_msg=name)


def test_values_match_the_float64_computation_in_numpy():
    got = walkthrough.run_backend("numpy")
    expected, baseline = walkthrough.expected_values()
    for name, value in expected.items():  # the harness's rule: spec.TOLERANCES["float32"]
        result = compare.compare(name, got[name], value, baseline[name], walkthrough.DTYPE)
        assert result.passed, (name, result)
    np.testing.assert_allclose(got["self_attention"], seed_example.ARTICLE["self_attention"],
                               atol=seed_example.PRINTED_ATOL_FLOAT32)


def test_narrow_and_wide_layouts_show_the_same_marks():
    narrow, ok_narrow = walkthrough.walkthrough(["numpy", "numpy"], width=60)
    wide, ok_wide = walkthrough.walkthrough(["numpy"], width=200)
    assert ok_narrow and ok_wide
    rows = re.compile(r"^\s+(Life|is|short,|eat|dessert|first)\s")
    one_each = [line for line in narrow if re.match(r"^\s+Life\s+numpy\s", line)]
    side_by_side = [line for line in wide if rows.match(line) and "numpy" not in line]
    assert one_each and side_by_side
    for lines in (narrow, wide):
        assert not [line for line in lines if rows.match(line) and "✗" in line]


def test_missing_backend_is_reported_with_its_install_command(monkeypatch, capsys):
    monkeypatch.setattr(backends.Backend, "available", lambda self: self.name == "numpy")
    assert main(["walkthrough", "--backend", "numpy", "--backend", "jax", "--width", "100"]) == 0
    out = capsys.readouterr().out
    assert "jax: not installed — pip install jax" in out
    assert "numpy ✓" in out


def test_pictures_command_writes_every_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from conformance.teaching import pictures

    assert main(["pictures", str(tmp_path)]) == 0
    for name in pictures.PICTURES:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000, name
    assert len(capsys.readouterr().out.splitlines()) == len(pictures.PICTURES)


def test_pictures_say_what_they_show_on_the_image():
    """Every picture with a masked cell carries the legend "white = masked" on the image; the
    grouped-query and window pictures say they are causal."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from conformance.teaching import pictures

    for name in pictures.PICTURES:
        fig = pictures.draw(name)
        legends = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
        has_masked = any(np.ma.getmaskarray(ax.images[0].get_array()).any()
                         for ax in fig.axes if ax.images)
        assert has_masked == (name != "cross.png"), name
        assert legends == ([pictures.MASKED_LEGEND] if has_masked else []), name
        assert "white = masked" in pictures.MASKED_LEGEND
        title = fig.get_suptitle()
        if name in ("gqa.png", "window.png"):
            assert "causal" in title, (name, title)
        plt.close(fig)


def _normal_ratios(line: str) -> str:
    """A walkthrough line with its worst-error ratios blanked (they depend on the BLAS)."""
    return re.sub(r"✓ \d+(\.\d+)?(e-?\d+)?", "✓ r", line.rstrip())


def test_the_readmes_walkthrough_excerpt_is_real_output():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    learn = readme.split("## Learn:")[1].split("\n## ")[0]
    excerpt = learn.split("```\n  ▸ ")[1].split("```")[0]
    lines, _ = walkthrough.walkthrough(INSTALLED, width=100)
    printed = [_normal_ratios(line) for line in lines]
    shown = ["  ▸ " + line for line in excerpt.splitlines()[:1]] + excerpt.splitlines()[1:]
    assert len(shown) >= 8
    for line in shown:
        if line.strip() == "...":
            continue
        wanted = _normal_ratios(line)
        if wanted.endswith("; ..."):  # cut short in the README
            assert any(p.startswith(wanted[:-4]) for p in printed), line
        elif set(INSTALLED) == set(backends.SPEC_BACKENDS) or not any(
                name in line for name in backends.SPEC_BACKENDS):
            assert wanted in printed, line


def test_the_seed_article_lists_what_the_articles_numbers_contradict():
    """docs/seed_article.md: three claims of the article, recomputed from its own matrices."""
    omega = np.array(seed_example.ARTICLE["attn_scores"])
    weights = np.array(seed_example.ARTICLE["attn_weights"])
    assert omega[2].argmin() == 1 and omega[2].argmax() == 2  # lowest: input 2; highest: itself
    tokens = seed_example.SENTENCE.split()
    favourite = [tokens[j] for j in weights.argmax(axis=1)]
    assert favourite == ["short,", "is", "short,", "is", "is", "short,"]  # itself: 2 of 6
    assert np.isfinite(omega).all() and np.triu(np.ones((6, 6)), 1).sum() == 15  # all computed
    doc = (Path(__file__).resolve().parent.parent / "docs" / "seed_article.md").read_text(
        encoding="utf-8")
    for claim in ("**Query 3's lowest score.**", "with input 2 (`is`, −1.3934)",
                  "**\"A query attends most to itself", "only 2 of the 6 queries",
                  "**\"Masking with −inf skips the masked positions.\"**", "all 36 scores"):
        assert claim in doc, claim


def test_the_renormalising_method_is_called_the_articles_first():
    """The article zeroes and renormalises first, masks with −inf second (its causal section)."""
    root = Path(__file__).resolve().parent.parent
    for path in ("numpy_attn/functional.py", "jax_attn/functional.py", "torch_attn/functional.py",
                 "conformance/spec/functions.py", "docs/spec.md"):
        text = (root / path).read_text(encoding="utf-8")
        assert "The article's first causal method: zero the weights above the diagonal" in text
        assert "second causal method: zero" not in text, path
