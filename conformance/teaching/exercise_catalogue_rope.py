"""Exercise 11 of ``learn/``: the rotary position embedding (RoPE), half layout.

The learner writes ``rotary_embedding(x, positions, theta, rotary_dim)``: the first
``rotary_dim`` dims of each query or key vector turn, pair ``(i, i + rotary_dim/2)`` by pair, by
the angle ``positions · theta ** (-2 i / rotary_dim)`` (transformers' ``rotate_half``, GPT-NeoX);
the other dims pass through. The expected values are an independent float64 formula written
here (``rope64``), not the backends' ``rotary_embedding``; ``tests/test_learn.py`` checks them
against numpy_attn's and against the rotation's defining property (q·k depends only on the
positions' difference).

The checks are adversarial: the first has positions 0 … 5 (position 0 alone does not pass: a
rotation by 0 is the identity in every layout and direction), the second decodes at an offset
(positions 1020 … 1023: a learner who rotates by the token's index in the call, not its
position, fails there), the third is partial rotary (rotary_dim 8 of head_dim 16, Llama 3's
theta 500000), where rotating every dim or dividing the exponent by head_dim shows. The
mistakes named: the interleaved layout (Meta's pairs (2i, 2i+1)), the sine's sign flipped
(rotating backwards), positions off by one, the index instead of the positions, every dim
rotated, the exponent divided by head_dim, and ``rotate_half`` without its minus sign.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .exercise_kit import UNIT, Check, Exercise, Mistake, f32, f64, one, rng_for

NUMBER = 11


def rope64(x: np.ndarray, positions: np.ndarray, theta: float, rotary_dim: int, *,
           layout: str = "half", sign: float = 1.0, shift: float = 0.0, index: bool = False,
           exponent_dim: int | None = None, minus: bool = True,
           dtype: Any = np.float64) -> np.ndarray:
    """The rotary embedding, computed in ``dtype`` (float64: the expected value), or one of its
    classic mistakes.

    Args:
      x: ``(..., heads, seq, head_dim)``.
      positions: ``(..., seq)`` integers, broadcast as ``positions[..., None, :]``.
      theta: the base; ``rotary_dim``: the rotated dims (even, ``<= head_dim``).
      layout: "half" pairs ``(i, i + r/2)``, "interleaved" pairs ``(2i, 2i + 1)``,
        "deinterleaved" pairs ``(2i, 2i + 1)`` and writes them back as halves (transformers'
        DeepSeek-V3 ``apply_rotary_pos_emb_interleave``).
      sign: -1 turns backwards; ``shift``: added to every position; ``index``: rotate by the
        index in the sequence (``arange(seq)``) instead of ``positions``.
      exponent_dim: divides the frequencies' exponent (None: ``rotary_dim``).
      minus: False drops the minus of ``rotate_half`` (out1 = x1 cos + x2 sin).
      dtype: the compute dtype (float32: the naive baseline).

    Returns:
      ``x.shape`` float64.
    """
    x = np.asarray(x).astype(dtype)
    r, half = rotary_dim, rotary_dim // 2
    exponents = 2.0 * np.arange(half) / (exponent_dim or r)
    inv_freq = (1.0 / theta ** exponents).astype(dtype)  # (r/2,)
    p = np.arange(x.shape[-2]) if index else np.asarray(positions, np.float64) + shift
    angles = np.asarray(p).astype(dtype)[..., None, :, None] * inv_freq * dtype(sign)
    cos, sin = np.cos(angles), np.sin(angles)  # (..., 1, seq, r/2)
    rotated = x[..., :r]
    if layout == "half":
        x1, x2 = rotated[..., :half], rotated[..., half:]
    else:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
    out1 = x1 * cos + (-1.0 if minus else 1.0) * x2 * sin
    out2 = x2 * cos + x1 * sin
    if layout != "interleaved":
        out = np.concatenate([out1, out2], axis=-1)
    else:
        out = np.stack([out1, out2], axis=-1).reshape(out1.shape[:-1] + (r,))
    return np.concatenate([out, x[..., r:]], axis=-1).astype(np.float64)


def _floor(x: np.ndarray, positions: np.ndarray, theta: float, rotary_dim: int) -> float:
    """The least baseline error of a float32 rotation: per pair, the angle ``a`` rounds once
    in the product and in ``theta ** e`` (whose exponent ``e = 2i/r`` rounds too: ``a · ln θ ·
    e`` more), and cos, sin and the two products round; times the largest ``|x|``."""
    half = rotary_dim // 2
    e = 2.0 * np.arange(half) / rotary_dim
    angles = np.abs(np.asarray(positions, np.float64))[..., None] / theta ** e  # (..., seq, r/2)
    per_pair = angles * (2.0 + math.log(theta) * e)
    return UNIT * float(np.max(np.abs(x))) * (float(per_pair.max()) + 4.0)


def _check(name: str, x: np.ndarray, positions: np.ndarray, theta: float, rotary_dim: int,
           hint: str) -> Check:
    """A check: float32 x, int64 positions, the expected value in float64 and the baseline
    ``e``: the naive float32 rotation's error, never below ``_floor``."""
    args = (x, positions, theta, rotary_dim)
    expected = rope64(f64(x), positions, theta, rotary_dim)
    naive = rope64(x, positions, theta, rotary_dim, dtype=np.float32)
    measured = float(np.max(np.abs(naive - expected)))
    return Check(name, args, expected, max(measured, _floor(x, positions, theta, rotary_dim)),
                 hint)


def _rope_checks() -> list[Check]:
    rng = rng_for(NUMBER)
    x1 = f32(rng.standard_normal((2, 6, 8)))
    x2 = f32(rng.standard_normal((2, 2, 4, 16)))
    x3 = f32(rng.standard_normal((2, 2, 7, 16)))
    decoding = np.array([np.arange(1020, 1024), np.arange(37, 41)], np.int64)
    two = np.array([np.arange(7), np.arange(250, 257)], np.int64)
    positions_hint = ("positions is (..., seq): insert the heads axis, positions[..., None, :], "
                      "so that it broadcasts against x.shape[:-1]")
    return [
        _check("one sequence: 2 heads, 6 tokens at positions 0 … 5, head_dim 8, theta 10000",
               x1, np.arange(6, dtype=np.int64), 10000.0, 8, ""),
        _check("decoding at an offset: 2 sequences × 2 heads, 4 new tokens at positions "
               "1020 … 1023 and 37 … 40, head_dim 16", x2, decoding, 10000.0, 16,
               positions_hint),
        _check("partial rotary (GPT-NeoX, Phi): rotary_dim 8 of head_dim 16, theta 500000 "
               "(Llama 3), positions 0 … 6 and 250 … 256", x3, two, 500000.0, 8,
               "rotate x[..., :rotary_dim] only; x[..., rotary_dim:] passes through"),
    ]


def _variant(**options: Any) -> Any:
    return one(lambda x, p, theta, r: rope64(x, p, theta, r, **options))


ROPE = Exercise(NUMBER, "rope", "rotary_embedding",
                "the rotary position embedding (RoPE), half layout", _rope_checks, (
    Mistake("interleaved", "you paired dims (2i, 2i + 1), the interleaved layout of Meta's "
            "Llama code and GPT-J: this exercise is the half layout of transformers' "
            "rotate_half, pairs (i, i + rotary_dim/2)",
            "x1 = x[..., :r/2] and x2 = x[..., r/2:r] turn together; the layouts agree at "
            "position 0 only (a turn by 0), so a checkpoint read in the wrong layout drifts "
            "with the position, silently", lambda *a: [*_variant(layout="interleaved")(*a),
                                                       *_variant(layout="deinterleaved")(*a)]),
    Mistake("backwards", "you rotate backwards: the sine's sign is flipped (a turn by −angle)",
            "out1 = x1·cos − x2·sin, out2 = x2·cos + x1·sin (x·cos + rotate_half(x)·sin with "
            "rotate_half(x) = cat(−x2, x1))", _variant(sign=-1.0)),
    Mistake("off_by_one", "your positions are off by one", "the angle of the token at position "
            "p is p · inv_freq, and the first token is at position 0",
            lambda *a: [*_variant(shift=1.0)(*a), *_variant(shift=-1.0)(*a)]),
    Mistake("index", "you rotated by each token's index in x (arange(seq)), not by its "
            "position: a KV-cache step at an offset rotates by the wrong angles",
            "use the positions given: tokens decoded after 1020 cached ones are at 1020, "
            "1021, …", _variant(index=True)),
    Mistake("all_dims", "you rotated every dim: with partial rotary only the first rotary_dim "
            "dims turn", "rotate x[..., :rotary_dim] and concatenate x[..., rotary_dim:] "
            "unchanged", lambda x, p, theta, r: [
                *_variant()(x, p, theta, x.shape[-1]),
                *one(lambda x, p, theta, r: rope64(x, p, theta, x.shape[-1],
                                                   exponent_dim=r))(x, p, theta, r)]),
    Mistake("exponent_head_dim", "the frequencies' exponent is divided by head_dim: with "
            "partial rotary it is 2i / rotary_dim", "inv_freq[i] = theta ** (−2i / rotary_dim) "
            "for i < rotary_dim / 2 (transformers divides by the rotated dims)",
            lambda x, p, theta, r: _variant(exponent_dim=x.shape[-1])(x, p, theta, r)),
    Mistake("no_minus", "rotate_half lost its minus sign: out1 = x1·cos + x2·sin is no rotation",
            "rotate_half(x) = cat(−x2, x1): out1 = x1·cos − x2·sin", _variant(minus=False)),
), "angle[..., p, i] = positions · theta ** (−2i / rotary_dim); the pairs (x[i], x[i + r/2]) "
   "turn by it: (x1·cos − x2·sin, x2·cos + x1·sin); x[..., r:] passes through")


__all__ = ["NUMBER", "ROPE", "rope64"]
