"""The teaching material's diagrams (``conformance.teaching.pictures``' ``DIAGRAMS``): each
shows the numbers it says, computed independently here, and the committed PNG is linked from
the page that explains it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_rope_picture_shows_the_pairs_and_angles_it_says():
    """rope_pairs.png: the pairs read off numpy_attn are Meta's (2i, 2i+1) and rotate_half's
    (i, i + d/2), pair 0 turning fastest; the angles are p · θ^(−2i/d) (written out here); the
    committed PNG is a PNG under 80 kB, drawn (a figure with the three panels), and linked
    from the section of docs/backend_differences.md that explains it."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from conformance.teaching import pictures

    d = pictures.ROPE_HEAD_DIM
    assert pictures.rope_pairs("interleaved") == [(2 * i, 2 * i + 1) for i in range(d // 2)]
    assert pictures.rope_pairs("half") == [(i, i + d // 2) for i in range(d // 2)]
    positions, angles = pictures.rope_angles()
    expected = positions * pictures.ROPE_THETA ** (-2.0 * np.arange(d // 2)[:, None] / d)
    np.testing.assert_allclose(angles, expected, rtol=1e-14)
    fig = pictures.draw("rope_pairs.png")
    assert len(fig.axes) == 3 and "RoPE" in fig.get_suptitle()
    drawn = [line.get_ydata() for line in fig.axes[2].get_lines()[: d // 2]]
    np.testing.assert_allclose(drawn, angles, rtol=1e-14)
    plt.close(fig)
    data = (ROOT / "docs" / "images" / "rope_pairs.png").read_bytes()
    assert data.startswith(b"\x89PNG") and 10_000 < len(data) < 80_000
    page = (ROOT / "docs" / "backend_differences.md").read_text(encoding="utf-8")
    section = page.split("## 19. Same weights, two RoPE layouts")[1].split("\n## ")[0]
    assert "images/rope_pairs.png" in section
    for cited in ("transformers#25199", "flash-attention#288", "keras-hub#1416", "unsloth#837",
                  "candle#3948"):
        assert cited in section, cited


def test_the_cache_picture_is_the_projects_own_caches_bytes_per_token():
    """kv_cache_per_token.png's bytes per token per layer: the configs' formula equals the
    numbers written out here and what the project's own caches hold per position (numpy_attn's
    ``KVCache`` buffers in bfloat16; ``QuantizedKVCache.nbytes`` with the latent as its keys
    and values, halved, int4 codes packed two per byte; ``attention_rules``'
    ``bytes_per_token``); the figure draws those bars; the committed PNG is a PNG under 80 kB;
    docs/paged_decoding.md shows it with the table of the same numbers."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import numpy_attn
    from attention_rules import quantizing
    from conformance.teaching import kv_cache_sizes, pictures

    models = kv_cache_sizes.MODELS
    sizes = [kv_cache_sizes.bytes_per_token(m) for m in models]
    # 2 · kv_heads · head_dim · 2 bytes; 128 heads · (192 + 128) · 2; (512 + 64) · 2, · 1,
    # · ½ + 9 scales · 4
    assert sizes == [2 * 32 * 128 * 2, 2 * 8 * 128 * 2, 2 * 1 * 64 * 2, 128 * 320 * 2,
                     576 * 2, 576 * 1, 576 / 2 + 9 * 4]
    assert [m.kind for m in models] == ["MHA", "GQA", "MQA", "MLA naive", "MLA", "MLA", "MLA"]

    def per_position(make):  # bytes held by a cache of 2 positions less one of 1
        return make(2) - make(1)

    for m, size in zip(models, sizes, strict=True):
        if m.bits == 16:  # a KVCache: keys (kv_heads, head_dim), values (kv_heads, v_dim)
            heads, k_dim, v_dim = ((1, m.kv_lora_rank + m.rope_dim, 0) if m.kind == "MLA" else
                                   (m.kv_heads, m.head_dim, m.v_head_dim or m.head_dim))

            def held(n, heads=heads, k_dim=k_dim, v_dim=v_dim):
                c = numpy_attn.KVCache.empty((1,), heads, n, k_dim, v_dim, dtype="bfloat16")
                return c.key_buffer.nbytes + c.value_buffer.nbytes

            assert per_position(held) == size, m
            continue
        scheme = quantizing.KVQuantization("int4" if m.bits == 4 else "float8_e4m3")
        dims = m.kv_lora_rank + m.rope_dim

        def held(n, scheme=scheme, dims=dims):  # the latent as keys and as values: 2 stores
            return numpy_attn.QuantizedKVCache.empty((1,), 1, n, dims, scheme=scheme,
                                                     dtype="bfloat16").nbytes

        unpacked = dims / 2 if m.bits == 4 else 0  # int4 stored one code per byte
        assert per_position(held) / 2 - unpacked == size, m
        assert quantizing.bytes_per_token(scheme, 1, dims) == size, m
    fig = pictures.draw("kv_cache_per_token.png")
    bars = [p.get_width() for p in fig.axes[0].patches]
    assert bars == sizes and "quantised MLA" in fig.get_suptitle()
    plt.close(fig)
    data = (ROOT / "docs" / "images" / "kv_cache_per_token.png").read_bytes()
    assert data.startswith(b"\x89PNG") and 10_000 < len(data) < 80_000
    page = (ROOT / "docs" / "paged_decoding.md").read_text(encoding="utf-8")
    section = page.split("## The cache per token")[1].split("\n## ")[0]
    assert "images/kv_cache_per_token.png" in section and kv_cache_sizes.table() in section
    for words in ("**naive**", "**absorbed**", "exercise 12"):
        assert words in section, words


def test_the_cache_tables_sizes_read_in_the_unit_a_reader_expects():
    """Bytes below 1 KiB, KiB from 1,024, MiB from 1,048,576 (the table's ``_size``)."""
    from conformance.teaching import kv_cache_sizes

    size = kv_cache_sizes._size
    assert [size(576), size(1023), size(1024), size(16384), size(1024 * 1024 - 1),
            size(1024 * 1024), size(3 * 1024 * 1024)] == [
        "576 B", "1023 B", "1 KiB", "16 KiB", "1.02e+03 KiB", "1 MiB", "3 MiB"]
