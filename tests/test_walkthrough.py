"""``python -m conformance walkthrough`` and ``python -m conformance pictures``."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from conformance.__main__ import main
from conformance.comparing import compare
from conformance.running import backends
from conformance.spec import seed_example
from conformance.spec.seed_example import ARTICLE_INCONSISTENT
from conformance.teaching import walkthrough, walkthrough_steps

INSTALLED = [n for n in backends.SPEC_BACKENDS if backends.get(n).available()]


# One walkthrough (``printed``) for the module's tests: they share a pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("walkthrough")


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
    flat = " ".join(text.split())  # the wrapped lines joined
    for key, entry in ARTICLE_INCONSISTENT.items():
        assert f"why ({key})" in text
        if "claim" in entry:  # a claim of the text: the claim and the numbers against it
            assert f"the article says “{entry['claim']}”; its own numbers:" in flat, key
            for name, value in entry["contradicted_by"].items():
                assert f"{name}: {value:g}" in flat, (key, name)
        else:
            assert f"{entry['printed'][0]:.4f}" in text
    assert seed_example.CODE_SENTENCE in text and seed_example.SENTENCE in text
    assert "-0.2627" in text  # the one printed value that is a rounding off


def test_the_claims_the_articles_numbers_contradict_are_recomputed():
    """The three claims of ``ARTICLE_INCONSISTENT``: every contradicting number recomputed here
    in plain float64 NumPy from the article's embedding and weights — the article's own code for
    the −inf method (all of ω, then masked_fill, then the softmax) — equals the entry's and
    what the walkthrough prints (``claim_numbers`` of its float64 pipeline)."""
    x = np.array(seed_example.EMBEDDING, np.float64)
    w = {n: np.array(a, np.float64) for n, a in seed_example.self_attention_weights().items()}
    omega = (x @ w["W_query"]) @ (x @ w["W_key"]).T  # every score, as the article's code
    scaled = omega / np.sqrt(2)
    weights = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    upper = np.triu(np.ones((6, 6), bool), 1)  # the article's mask: j > i
    masked = np.where(upper, -np.inf, omega)  # masked_fill overwrites what was computed
    exponentiated = np.exp(masked - masked.max(axis=1, keepdims=True))  # softmax: every entry
    recomputed = {
        "lowest_score_3": {"lowest input": int(omega[2].argmin()) + 1,
                           "lowest score": round(float(omega[2].min()), 4)},
        "attends_most_to_itself": {
            "queries attending most to themselves": sum(int(weights[i].argmax()) == i
                                                        for i in range(6)),
            "queries": 6},
        "masking_skips_positions": {
            "masked positions": int(upper.sum()),
            "their scores computed anyway": int(np.isfinite(omega[upper]).sum()),
            "entries the softmax exponentiates": int(exponentiated.size)},
    }
    for key, numbers in recomputed.items():
        assert ARTICLE_INCONSISTENT[key]["contradicted_by"] == numbers, key
    assert walkthrough_steps.claim_numbers(walkthrough.expected_values()[0]) == recomputed
    printed_score, printed_input = ARTICLE_INCONSISTENT["lowest_score_3"]["printed"]
    assert (printed_input, printed_score) != (recomputed["lowest_score_3"]["lowest input"],
                                              recomputed["lowest_score_3"]["lowest score"])
    assert recomputed["attends_most_to_itself"]["queries attending most to themselves"] < 6
    assert recomputed["masking_skips_positions"]["their scores computed anyway"] > 0


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


@pytest.mark.slow
def test_pictures_command_writes_every_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from conformance.teaching import pictures

    assert main(["pictures", str(tmp_path)]) == 0
    for name in pictures.PICTURES:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and 10_000 < len(data) < 80_000, name
    assert len(capsys.readouterr().out.splitlines()) == len(pictures.PICTURES)


@pytest.mark.slow
def test_pictures_say_what_they_show_on_the_image():
    """Every picture with a masked cell carries the legend "white = masked" on the image; the
    grouped-query and window pictures say they are causal."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from conformance.teaching import pictures

    for name in pictures.PICTURES:
        if name in pictures.DIAGRAMS:  # no weights: tests/test_learn.py checks rope_pairs.png
            continue
        fig = pictures.draw(name)
        legends = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
        has_masked = any(np.ma.getmaskarray(ax.images[0].get_array()).any()
                         for ax in fig.axes if ax.images)
        assert has_masked == (name != "cross.png"), name
        assert legends == ([pictures.MASKED_LEGEND] if has_masked else []), name
        assert "white = masked" in pictures.MASKED_LEGEND
        title = fig.get_suptitle()
        if name in ("gqa.png", "window.png", "sinks.png", "alibi.png"):
            assert "causal" in title, (name, title)
        plt.close(fig)


def _drawn(name: str) -> list[np.ndarray]:
    """The arrays picture ``name`` shows, panel by panel (masked cells as 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from conformance.teaching import pictures

    fig = pictures.draw(name)
    arrays = [np.ma.filled(ax.images[0].get_array(), 0.0) for ax in fig.axes if ax.images]
    plt.close(fig)
    return arrays


def test_the_feature_pictures_show_what_they_say():
    """sinks.png, packed.png, chunked.png and alibi.png draw what their titles say, checked
    against independent float64 computations: the sink column is 1 − the row's weights (the
    float64 reference's) and takes all of a fully masked row; the packed batch's weights are
    block-diagonal over ``cu_seq`` (then causal within each block); the chunked weights keep
    ``i // 4 == j // 4`` (and ``j <= i``); ALiBi's are ``softmax(−slope·(i − j))`` over
    ``j <= i``. Each picture is linked from the doc that explains its feature."""
    pytest.importorskip("matplotlib")
    from conformance.cases import reference
    from conformance.teaching import pictures

    plain, with_sink = _drawn("sinks.png")
    row = pictures.SINK_EMPTY_ROW
    assert np.all(plain[row] == 0) and with_sink.shape == (6, 7)
    assert np.all(with_sink[row, :6] == 0) and with_sink[row, 6] == pytest.approx(1.0)
    np.testing.assert_allclose(with_sink.sum(axis=1), 1.0, atol=1e-12)
    rng = np.random.default_rng(2)  # sink_weights' inputs, through the float64 reference
    q, k, v = (rng.standard_normal((1, 6, 8)) for _ in range(3))
    mask = np.ones((6, 6), bool)
    mask[row] = False
    ref = reference.attention(q, k, v, mask=mask, is_causal=True,
                              sinks=np.array([pictures.SINK_LOGIT])).weights[0]
    np.testing.assert_allclose(with_sink[:, :6], ref, atol=1e-12)
    np.testing.assert_allclose(with_sink[:, 6], 1.0 - ref.sum(axis=1), atol=1e-12)

    i, j = np.arange(10)[:, None], np.arange(10)
    sequence = np.repeat(np.arange(3), np.diff(pictures.PACKED_CU_SEQ))  # token → sequence
    block = sequence[:, None] == sequence[None, :]
    for drawn, allowed in zip(_drawn("packed.png"), (block, block & (j <= i)), strict=True):
        assert np.array_equal(drawn > 0, allowed)
        np.testing.assert_allclose(drawn.sum(axis=1), 1.0, atol=1e-12)

    i, j = np.arange(12)[:, None], np.arange(12)
    chunk = i // 4 == j // 4
    for drawn, allowed in zip(_drawn("chunked.png"), (chunk, chunk & (j <= i)), strict=True):
        assert np.array_equal(drawn > 0, allowed)

    i, j = np.arange(10)[:, None], np.arange(10)
    for drawn, slope in zip(_drawn("alibi.png"), pictures.ALIBI_SLOPES, strict=True):
        expected = np.where(j <= i, np.exp(-slope * (i - j)), 0.0)
        np.testing.assert_allclose(drawn, expected / expected.sum(axis=1, keepdims=True),
                                   atol=1e-12)

    docs = Path(__file__).resolve().parent.parent / "docs"
    differences = (docs / "backend_differences.md").read_text(encoding="utf-8")
    sections = {n: differences.split(f"## {n}. ")[1].split("\n## ")[0] for n in (15, 16, 17)}
    assert "images/sinks.png" in sections[15] and "images/packed.png" in sections[16]
    assert "images/chunked.png" in sections[17] and "images/alibi.png" in sections[17]
    assert "images/sinks.png" in (docs / "paged_decoding.md").read_text(encoding="utf-8")


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
