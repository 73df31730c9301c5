"""``python -m conformance pictures DIR``: attention-weight heatmaps, one PNG per mask type.

Every picture is computed with numpy_attn (the spec's pipeline) and drawn with matplotlib,
imported lazily with the Agg backend. Rows are queries, columns keys; a white cell is a masked
position (weight exactly 0), a fully masked row is white from end to end — and every picture
with a masked cell says so in a legend on the image itself, so it reads without this text.
Titles say what is drawn (the causal rule included: ``gqa.png`` is causal).

Issue 23's and 24's features have a picture each, computed with numpy_attn's public API:
``sinks.png`` (the sink as one more softmax column, ``exp(sink − lse)``, beside the weights;
a fully masked row puts all its weight on it), ``packed.png`` (``varlen_attention``'s weights
over a packed batch, read through identity values: block-diagonal, then causal within each
sequence), ``chunked.png`` (``chunk_size``, alone and with ``is_causal``) and ``alibi.png``
(``alibi_slopes`` with every score 0, so the picture is ALiBi's bias alone). Issue 41's
``rope_pairs.png`` is a diagram (``DIAGRAMS``), not weights: the pairs of RoPE's two layouts and
each pair's angle against the position, both read off numpy_attn's ``rotary_embedding``.
Issue 42's ``kv_cache_per_token.png`` is a diagram too: the bytes one token costs in one
layer's KV cache for MHA, GQA, MQA, MLA and quantised MLA, from real models' configs
(``kv_cache_sizes``). Each PNG stays under 80 kB (100 dpi).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from ..spec import seed_example
from . import kv_cache_sizes

#: file name → title; the order of ``write``.
PICTURES = {
    "walkthrough.png": "the article's sentence: softmax(ω/√2) and causal weights",
    "causal.png": "causal masks with q_len 6 < kv_len 10: the two alignments",
    "padding.png": "padding: kv_lengths [10, 6], q_lengths [10, 7]",
    "window.png": "sliding windows over 12 tokens: (2, 1), and (2, 0) with the causal rule",
    "cross.png": "cross-attention: 6 queries over 8 keys",
    "gqa.png": "grouped-query attention, causal: 4 query heads share 2 key/value heads",
    "sinks.png": "attention sinks, causal: the sink is one more softmax column that carries "
                 "no value",
    "packed.png": "a packed batch: 3 sequences of 3, 5 and 2 tokens in one row of 10 "
                  "(cu_seq [0, 3, 8, 10])",
    "chunked.png": "chunked local attention (Llama 4) over 12 tokens, chunk_size=4",
    "alibi.png": "ALiBi over 10 tokens, causal, with equal scores: the bias −slope·(i − j) "
                 "alone",
    "rope_pairs.png": "RoPE, head_dim 8, θ = 10000: which dims turn together, and by what angle",
    "kv_cache_per_token.png": kv_cache_sizes.TITLE,
}
#: Pictures that are diagrams, not attention weights: no weights colour bar, no masked cells.
DIAGRAMS = ("rope_pairs.png", "kv_cache_per_token.png")
#: ``rope_pairs.png``: the head size, the base and the positions of its angle panel.
ROPE_HEAD_DIM, ROPE_THETA, ROPE_POSITIONS = 8, 10000.0, 48

#: ``packed.png``'s sequences: cumulative offsets into the 10 packed tokens.
PACKED_CU_SEQ = (0, 3, 8, 10)
#: ``alibi.png``'s slopes, one panel each.
ALIBI_SLOPES = (1.0, 0.25)
#: ``sinks.png``: the sink's logit, and the query whose every key is masked.
SINK_LOGIT, SINK_EMPTY_ROW = 1.0, 3


#: The legend of every picture with a masked cell.
MASKED_LEGEND = "white = masked (weight exactly 0)"


def _weights(q_len: int, kv_len: int, heads: int = 1, kv_heads: int = 1, seed: int = 0,
             **options: Any) -> np.ndarray:
    import numpy_attn as na

    rng = np.random.default_rng(seed)
    q = rng.standard_normal((heads, q_len, 8))
    k = rng.standard_normal((kv_heads, kv_len, 8))
    v = rng.standard_normal((kv_heads, kv_len, 8))
    _, w = na.scaled_dot_product_attention(q, k, v, return_weights=True, **options)
    return w


def _article_weights() -> tuple[np.ndarray, np.ndarray]:
    import numpy_attn as na

    x = np.array(seed_example.EMBEDDING, np.float64)
    w = {n: np.array(a, np.float64) for n, a in seed_example.self_attention_weights().items()}
    scores = na.attention_scores(x @ w["W_query"], x @ w["W_key"])
    return na.attention_weights(scores), na.attention_weights(na.mask_scores(scores,
                                                                             is_causal=True))


def sink_weights() -> tuple[np.ndarray, np.ndarray]:
    """``sinks.png``'s numbers: causal weights over 6 keys whose query ``SINK_EMPTY_ROW`` may
    attend no key, without a sink ``(6, 6)`` and with one, ``(6, 6 + 1)``: the last column is
    the sink's share of the softmax, ``exp(sink − lse)`` (``return_lse``; it joins the
    denominator, not the output)."""
    import numpy_attn as na

    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 6, 8)) for _ in range(3))  # (heads, seq, head_dim)
    mask = np.ones((6, 6), bool)
    mask[SINK_EMPTY_ROW] = False
    options = {"mask": mask, "is_causal": True, "return_weights": True}
    _, plain = na.scaled_dot_product_attention(q, k, v, **options)
    sinks = np.array([SINK_LOGIT])  # one logit per head
    _, w, lse = na.scaled_dot_product_attention(q, k, v, sinks=sinks, return_lse=True,
                                                **options)
    sink = np.exp(sinks[:, None] - lse)[..., None]  # (heads, q_len, 1)
    return plain[0], np.concatenate([w, sink], axis=-1)[0]


def packed_weights(window_size: tuple[int, int] = (-1, -1)) -> np.ndarray:
    """``packed.png``'s numbers: ``varlen_attention``'s weights over the 10 packed tokens of
    ``PACKED_CU_SEQ``, ``(10, 10)``, read through identity values (``value[t] = e_t``, so each
    output row is its query's weight row over every packed key)."""
    import numpy_attn as na

    cu_seq = np.array(PACKED_CU_SEQ, np.int32)
    total, longest = int(cu_seq[-1]), int(np.diff(cu_seq).max())
    rng = np.random.default_rng(4)
    q, k = (rng.standard_normal((total, 1, 8)) for _ in range(2))  # (tokens, heads, dim)
    identity = np.eye(total)[:, None, :]  # (tokens, 1, tokens)
    out = na.varlen_attention(q, k, identity, cu_seq, cu_seq, longest, longest,
                              window_size=window_size)
    return out[:, 0, :]


def alibi_weights() -> np.ndarray:
    """``alibi.png``'s numbers: causal weights over 10 tokens with every score 0 (``q = 0``), so
    only ALiBi's bias shapes them, one head per slope of ``ALIBI_SLOPES``: ``(2, 10, 10)``."""
    import numpy_attn as na

    q = np.zeros((len(ALIBI_SLOPES), 10, 8))
    k = v = np.random.default_rng(5).standard_normal((len(ALIBI_SLOPES), 10, 8))
    _, w = na.scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True,
                                           alibi_slopes=np.array(ALIBI_SLOPES))
    return w


def rope_pairs(layout: str, head_dim: int = ROPE_HEAD_DIM) -> list[tuple[int, int]]:
    """``rope_pairs.png``'s pairs, read off numpy_attn's ``rotary_embedding``: dim ``j`` alone
    (a one-hot ``x``) turned at position 1 spills into exactly one other dim, its partner;
    ``(first, second)`` per pair, in the order of the frequencies (pair 0 turns fastest)."""
    import numpy_attn as na

    turned = na.rotary_embedding(np.eye(head_dim)[None], np.ones(head_dim, np.int64),
                                 theta=ROPE_THETA, layout=layout)[0]  # row j: e_j turned
    partners = [int(np.flatnonzero((np.abs(row) > 1e-12) & (np.arange(head_dim) != j))[0])
                for j, row in enumerate(turned)]
    # the dim that goes first has +sin in its partner: out[b] = x[b] cos + x[a] sin
    pairs = sorted({(j, b) for j, b in enumerate(partners) if turned[j, b] > 0},
                   key=lambda ab: -abs(turned[ab[0], ab[1]]))
    return pairs


def rope_angles(head_dim: int = ROPE_HEAD_DIM) -> tuple[np.ndarray, np.ndarray]:
    """``rope_pairs.png``'s angle panel: positions ``1 … 10**5`` (log-spaced, ``(n,)``) and the
    angle of each pair there, ``p · θ^(−2i/head_dim)`` radians, ``(head_dim/2, n)``, with the
    frequencies of numpy_attn's ``rope_frequencies``."""
    import numpy_attn as na

    inv_freq, _ = na.rope_frequencies(head_dim, theta=ROPE_THETA)
    positions = np.logspace(0, 5, 41)
    return positions, inv_freq[:, None] * positions


def _draw_rope() -> Any:
    """``rope_pairs.png``: the pairs of both layouts (arcs over the dims, one colour per pair,
    its frequency named) and ``cos`` of each pair's angle over the positions."""
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(10.0, 3.9), layout="constrained")
    grid = fig.add_gridspec(2, 2, width_ratios=(1.0, 1.15))
    colours = plt.get_cmap("tab10").colors
    for row, (layout, label) in enumerate((
            ("interleaved", "interleaved: pairs (2i, 2i+1) — Meta's Llama code, GPT-J"),
            ("half", "half: pairs (i, i + d/2) — transformers' rotate_half, GPT-NeoX"))):
        ax = fig.add_subplot(grid[row, 0])
        for i, (a, b) in enumerate(rope_pairs(layout)):
            for dim in (a, b):
                ax.add_patch(plt.Rectangle((dim - 0.4, -0.4), 0.8, 0.8, color=colours[i]))
            t = np.linspace(0, np.pi, 40)
            height = 0.45 + 0.18 * (b - a)
            ax.plot(a + (b - a) * (1 - np.cos(t)) / 2, 0.4 + height * np.sin(t),
                    color=colours[i], linewidth=2)
            ax.text((a + b) / 2, 0.45 + height, f"pair {i}", ha="center", va="bottom",
                    fontsize=8, color=colours[i])
        for dim in range(ROPE_HEAD_DIM):
            ax.text(dim, 0, str(dim), ha="center", va="center", color="white", fontsize=10)
        ax.set_xlim(-0.6, ROPE_HEAD_DIM - 0.4)
        ax.set_ylim(-0.6, 2.0)
        ax.set_axis_off()
        ax.set_title(label, fontsize=10)
    ax = fig.add_subplot(grid[:, 1])
    positions, angles = rope_angles()
    for i, angle in enumerate(angles):
        frequency = ROPE_THETA ** (-2 * i / ROPE_HEAD_DIM)
        ax.loglog(positions, angle, color=colours[i], linewidth=2,
                  label=f"pair {i}: p · θ^(−{2 * i}/{ROPE_HEAD_DIM}) = p · {frequency:g}")
    ax.axhline(2 * np.pi, color="0.3", linestyle="--", linewidth=1)
    ax.text(1.2, 2 * np.pi * 1.3, "one full turn (2π)", fontsize=8, color="0.3")
    ax.set_xlabel("position p (at p = 0 every angle is 0: both layouts are the identity)",
                  fontsize=9)
    ax.set_ylabel("angle of the pair (radians)")
    ax.set_title("pair i turns by p · θ^(−2i/d): pair 0 fastest", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(PICTURES["rope_pairs.png"])
    return fig


def _panel(ax: Any, weights: np.ndarray, title: str, xlabels: list[str] | None = None,
           ylabels: list[str] | None = None, annotate: bool = False) -> Any:
    import matplotlib.pyplot as plt

    shown = np.ma.masked_where(weights == 0, weights)  # masked positions: white
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")
    image = ax.imshow(shown, cmap=cmap, vmin=0, vmax=max(float(weights.max()), 1e-12))
    q_len, kv_len = weights.shape
    ax.set_xticks(range(kv_len), xlabels or [str(j) for j in range(kv_len)],
                  rotation=45 if xlabels else 0, ha="right" if xlabels else "center")
    ax.set_yticks(range(q_len), ylabels or [str(i) for i in range(q_len)])
    ax.set_xticks(np.arange(-0.5, kv_len), minor=True)
    ax.set_yticks(np.arange(-0.5, q_len), minor=True)
    ax.grid(which="minor", color="0.85", linewidth=0.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(title, fontsize=10)
    if annotate:
        for i in range(q_len):
            for j in range(kv_len):
                if weights[i, j] > 0:
                    color = "black" if weights[i, j] > 0.6 * weights.max() else "white"
                    ax.text(j, i, f"{weights[i, j]:.2f}", ha="center", va="center",
                            fontsize=7, color=color)
    return image


def _figure(ncols: int, width: float = 4.2, height: float = 4.0) -> tuple[Any, Any]:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False,
                             layout="constrained")
    return fig, axes[0]


def draw(name: str) -> Any:
    """The matplotlib figure of picture ``name`` (a key of ``PICTURES``)."""
    if name == "rope_pairs.png":
        return _draw_rope()
    if name == "kv_cache_per_token.png":
        return kv_cache_sizes.draw()
    if name == "walkthrough.png":
        plain, causal = _article_weights()
        tokens = seed_example.SENTENCE.split()
        fig, axes = _figure(2, 4.6, 4.4)
        _panel(axes[0], plain, "softmax(ω / √2)", tokens, tokens, annotate=True)
        image = _panel(axes[1], causal, "causal: −inf before softmax", tokens, tokens,
                       annotate=True)
    elif name == "causal.png":
        fig, axes = _figure(2, 4.4, 3.7)
        titles = {"top_left": "top_left (torch SDPA, jax.nn):\nquery i sees keys 0..i",
                  "bottom_right": "bottom_right (flash-attn, KV cache):\nthe last query "
                                  "sees every key"}
        for ax, (alignment, title) in zip(axes, titles.items(), strict=True):
            w = _weights(6, 10, is_causal=True, causal_alignment=alignment)[0]
            image = _panel(ax, w, title)
    elif name == "padding.png":
        import numpy_attn as na

        mask = na.padding_mask(np.array([10, 6]), 10, q_lengths=np.array([10, 7]), q_len=10)
        fig, axes = _figure(2, 4.0, 4.6)
        rng = np.random.default_rng(1)
        q, k, v = (rng.standard_normal((2, 1, 10, 8)) for _ in range(3))
        _, w = na.scaled_dot_product_attention(q, k, v, mask=mask, return_weights=True)
        _panel(axes[0], w[0, 0], "sequence 0: length 10")
        image = _panel(axes[1], w[1, 0], "sequence 1: 6 keys, 7 queries\n(rows 7-9: fully "
                                          "masked → 0)")
    elif name == "window.png":
        fig, axes = _figure(2, 4.2, 4.6)
        _panel(axes[0], _weights(12, 12, window=(2, 1))[0],
               "window=(2, 1): query i sees keys i-2 … i+1")
        image = _panel(axes[1], _weights(12, 12, window=(2, 0), is_causal=True)[0],
                       "window=(2, 0), is_causal:\nkeys i-2 … i")
    elif name == "cross.png":
        tokens = seed_example.SENTENCE.split()
        x = np.array(seed_example.EMBEDDING)
        x_2 = np.array(seed_example.cross_second_input())
        w = {n: np.array(a) for n, a in seed_example.self_attention_weights().items()}
        import numpy_attn as na

        weights = na.attention_weights(na.attention_scores(x @ w["W_query"], x_2 @ w["W_key"]))
        fig, axes = _figure(1, 5.6, 4.2)
        image = _panel(axes[0], weights, "CrossAttention(3, 2, 4): the article's 6 tokens "
                       "over\nsecond_input = torch.rand(8, 3)",
                       [f"x₂[{j}]" for j in range(8)], tokens, annotate=True)
    elif name == "gqa.png":
        w = _weights(6, 6, heads=4, kv_heads=2, seed=3, is_causal=True)
        fig, axes = _figure(4, 3.2, 3.9)
        for h in range(4):
            image = _panel(axes[h], w[h], f"query head {h} → kv head {h // 2}\n(causal)")
    elif name == "sinks.png":
        plain, with_sink = sink_weights()
        fig, axes = _figure(2, 4.3, 5.1)
        row = f"row {SINK_EMPTY_ROW}: every key masked"
        _panel(axes[0], plain, f"no sink: rows sum to 1\n({row} → all 0)")
        image = _panel(axes[1], with_sink, f"sink logit {SINK_LOGIT:g}: the last column\n"
                       f"({row} → all on the sink)", [*map(str, range(6)), "sink"])
        axes[1].axvline(5.5, color="black", linewidth=1.5)
        axes[1].set_xlabel("key (the sink has no value: output = Σ weight · value over keys)",
                          fontsize=8)
    elif name == "packed.png":
        fig, axes = _figure(2, 4.3, 5.0)
        for ax, window, title in ((axes[0], (-1, -1), "window_size=(-1, -1): block-diagonal"),
                                  (axes[1], (-1, 0), "window_size=(-1, 0): causal\nwithin "
                                                     "each sequence")):
            image = _panel(ax, packed_weights(window), f"varlen_attention, {title}")
            for edge in PACKED_CU_SEQ[1:-1]:
                ax.axhline(edge - 0.5, color="0.4", linewidth=0.8)
                ax.axvline(edge - 0.5, color="0.4", linewidth=0.8)
    elif name == "chunked.png":
        fig, axes = _figure(2, 4.2, 4.6)
        _panel(axes[0], _weights(12, 12, chunk_size=4)[0],
               "chunk_size=4: query i sees\nthe keys of its own chunk")
        image = _panel(axes[1], _weights(12, 12, chunk_size=4, is_causal=True)[0],
                       "chunk_size=4, is_causal (Llama 4):\nkeys i//4·4 … i")
    elif name == "alibi.png":
        w = alibi_weights()
        fig, axes = _figure(2, 4.2, 5.0)
        for h, slope in enumerate(ALIBI_SLOPES):
            image = _panel(axes[h], w[h], f"alibi_slopes[{h}] = {slope:g}: each key further "
                           f"back\nweighs e^(−{slope:g}) times as much")
    else:
        raise KeyError(f"unknown picture {name!r}; known: {', '.join(PICTURES)}")
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="attention weight")
    fig.suptitle(PICTURES[name])
    if any(np.ma.getmaskarray(ax.images[0].get_array()).any() for ax in axes):
        from matplotlib.patches import Patch

        fig.legend(handles=[Patch(facecolor="white", edgecolor="0.4", label=MASKED_LEGEND)],
                   loc="outside lower center", frameon=False)
    return fig


def _palette_png(path: Path) -> bytes:
    """The PNG at ``path`` with a palette of at most 256 colours (Pillow, matplotlib's own
    dependency): a diagram of a few flat colours looks the same at a quarter of the bytes."""
    import io

    from PIL import Image

    with Image.open(path) as image:
        palette = image.convert("RGB").quantize(colors=256)
    out = io.BytesIO()
    palette.save(out, format="PNG", optimize=True)
    return out.getvalue()


def write(directory: str | Path, names: list[str] | None = None) -> list[Path]:
    """Write the pictures (all by default) as PNG files into ``directory``; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names or list(PICTURES):
        fig = draw(name)
        path = out / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        if name in DIAGRAMS:  # antialiased lines and text: a palette keeps it under 80 kB
            path.write_bytes(_palette_png(path))
        written.append(path)
    return written


def main(args: argparse.Namespace) -> int:
    """``python -m conformance pictures DIR``."""
    try:
        written = write(args.directory)
    except ImportError as exc:
        print(f"error: pictures need matplotlib ({exc.name}): pip install matplotlib")
        return 2
    for path in written:
        print(path)
    return 0
