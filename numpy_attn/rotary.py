"""The rotary position embedding (RoPE) in NumPy: ``rotary_embedding``, its VJP by hand, the
frequencies of every scaling method (``rope_frequencies``) and the weight permutation between
the two layouts (``permute_for_rotary_layout``); ``conformance/spec/rotary.py`` is the spec.

Each rotated pair ``(x1, x2)`` of a token at position ``p`` turns by the angle ``a_i = p ·
inv_freq[i]``: ``(x1 cos a - x2 sin a, x2 cos a + x1 sin a)``, times ``attention_factor``.
"half" pairs dims ``(i, i + r/2)`` (transformers' rotate_half), "interleaved" ``(2i, 2i + 1)``
(Meta's Llama code). The angles, cos, sin and the rotation are computed in float64 for float64
x and in float32 otherwise, and rounded once to x's dtype; the dims past ``rotary_dim`` pass
through unchanged. The rules (and the frequencies, in Python floats) are
``attention_rules.rotary``'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attention_rules import rope_scaling
from attention_rules import rotary as rotary_rules
from attention_rules.rotary import RoPE  # noqa: F401 - re-exported: the modules' rope=

from ._arrays import _describe


def rotary_embedding(
    x: Any,
    positions: Any,
    *,
    theta: float = 10000.0,
    layout: str = "half",
    rotary_dim: int | None = None,
    inv_freq: Any = None,
    attention_factor: float = 1.0,
) -> np.ndarray:
    """Rotate the first ``rotary_dim`` dims of x by the angles of their positions.

    Args:
      x: ``(..., heads, seq, head_dim)`` or ``(seq, head_dim)``, float16, bfloat16, float32 or
        float64 (queries or keys).
      positions: ``(..., seq)`` integers (negative allowed); a heads axis is inserted
        (``positions[..., None, :]``) and the result broadcasts to ``x.shape[:-1]``; ``(seq,)``
        for a 2-D x.
      theta: the base of the default frequencies ``theta ** (-2 i / rotary_dim)``.
      layout: "half" (pairs ``(i, i + rotary_dim/2)``) or "interleaved" (pairs ``(2i, 2i+1)``).
      rotary_dim: the rotated dims, even, ``<= head_dim``; None: all of head_dim.
      inv_freq: ``(rotary_dim // 2,)`` floats replacing the default frequencies (theta unused).
      attention_factor: multiplies cos and sin (YaRN / LongRoPE's attention scaling).

    Returns:
      ``x.shape`` in x's dtype, in x's layout; ``x[..., rotary_dim:]`` unchanged.
    """
    fn = "rotary_embedding"
    args = _arguments(fn, x, positions, theta, layout, rotary_dim, inv_freq, attention_factor)
    x = np.asarray(x)
    cos, sin = _cos_sin(args, x, np.asarray(positions), inv_freq)
    return _rotate(x, cos, sin, args, x.dtype)


def rotary_embedding_vjp(
    x: Any,
    positions: Any,
    grad_output: Any,
    *,
    theta: float = 10000.0,
    layout: str = "half",
    rotary_dim: int | None = None,
    inv_freq: Any = None,
    attention_factor: float = 1.0,
) -> np.ndarray:
    """The gradient of ``rotary_embedding`` with respect to x, by hand: the transpose of the
    rotation (``grad_output``'s pairs turned by ``-a``, times attention_factor); the dims past
    rotary_dim get ``grad_output`` unchanged.

    Args:
      x, positions: as in ``rotary_embedding``.
      grad_output: ``x.shape``, floating: the gradient of a loss w.r.t. the output.
      theta, layout, rotary_dim, inv_freq, attention_factor: as in ``rotary_embedding``.

    Returns:
      grad_x: ``x.shape`` in x's dtype.
    """
    fn = "rotary_embedding_vjp"
    args = _arguments(fn, x, positions, theta, layout, rotary_dim, inv_freq, attention_factor,
                      grad_output)
    x, grad_output = np.asarray(x), np.asarray(grad_output)
    cos, sin = _cos_sin(args, x, np.asarray(positions), inv_freq)
    return _rotate(grad_output, cos, -sin, args, x.dtype)  # the transpose: turned by -a


def rope_frequencies(
    head_dim: int,
    *,
    theta: float = 10000.0,
    scaling: dict | None = None,
    seq_len: int | None = None,
    max_position_embeddings: int | None = None,
) -> tuple[np.ndarray, float]:
    """The inverse frequencies of a rotary embedding and its attention factor.

    Args:
      head_dim: the rotated dims (head_dim x partial_rotary_factor), even.
      theta: the base (a "rope_theta" in scaling takes its place).
      scaling: None, or a transformers rope_scaling / rope_parameters dict: "rope_type" (or
        "type") "default", "linear", "dynamic", "llama3", "yarn" or "longrope" and that
        method's parameters, with transformers' names and defaults.
      seq_len: the sequence length dynamic and longrope depend on (None: the shortest).
      max_position_embeddings: the model's context, read by dynamic, yarn and longrope.

    Returns:
      ``(inv_freq, attention_factor)``: ``(head_dim // 2,)`` float64 and a Python float (1.0
      for the methods without one).
    """
    values, factor = rope_scaling.frequencies(
        "rope_frequencies", head_dim, theta=theta, scaling=scaling, seq_len=seq_len,
        max_position_embeddings=max_position_embeddings)
    return np.asarray(values, np.float64), factor


def permute_for_rotary_layout(
    w: Any, heads: int, *, to: str = "half", rotary_dim: int | None = None
) -> np.ndarray:
    """Reorder the rows of a query or key projection between the two rotary layouts.

    to="half": Meta's interleaved checkpoint → transformers' half layout (transformers'
    convert_llama_weights_to_hf: ``w.view(heads, r/2, 2, in).transpose(1, 2)``);
    to="interleaved": the inverse. Rotating ``w_half @ x`` with layout="half" gives the
    interleaved rotation of ``w @ x`` with its dims reordered the same way, so q·k is unchanged.

    Args:
      w: ``(heads * head_dim, in_features)`` (torch nn.Linear's (out, in)) or a bias
        ``(heads * head_dim,)``.
      heads: the number of heads of w.
      to: "half" or "interleaved": the layout of the result.
      rotary_dim: only the first rotary_dim rows of each head move (None: all of head_dim).

    Returns:
      w with its rows reordered: same shape and dtype.
    """
    fn = "permute_for_rotary_layout"
    shape, _ = _describe(fn, "w", w)
    rows = rotary_rules.layout_rows(fn, shape, heads, to, rotary_dim)
    return np.asarray(w)[np.asarray(rows, np.intp)]


def _arguments(fn: str, x: Any, positions: Any, theta: Any, layout: Any, rotary_dim: Any,
               inv_freq: Any, attention_factor: Any,
               grad_output: Any = None) -> rotary_rules.RotaryArguments:
    return rotary_rules.rotary_arguments(
        fn, _describe(fn, "x", x), _describe(fn, "positions", positions), theta=theta,
        layout=layout, rotary_dim=rotary_dim, inv_freq=_describe(fn, "inv_freq", inv_freq),
        attention_factor=attention_factor,
        grad_output=_describe(fn, "grad_output", grad_output))


def _cos_sin(args: rotary_rules.RotaryArguments, x: np.ndarray, positions: np.ndarray,
             inv_freq: Any) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the angles, times attention_factor, in x's compute dtype:
    ``(..., 1, seq, rotary_dim / 2)`` (``(seq, rotary_dim / 2)`` for a 2-D x)."""
    compute = np.dtype(rotary_rules.compute_dtype(x.dtype.name))
    if inv_freq is None:  # the default frequencies, float64 rounded once to the compute dtype
        inv_freq = np.asarray(rope_scaling.default_inv_freq(args.rotary_dim, args.theta))
    freqs = np.asarray(inv_freq).astype(compute)  # (rotary_dim / 2,)
    if args.heads_axis:
        positions = positions[..., None, :]  # (..., 1, seq)
    angles = positions.astype(compute)[..., None] * freqs  # (..., 1, seq, r/2): one multiply
    factor = compute.type(args.attention_factor)
    return np.cos(angles) * factor, np.sin(angles) * factor


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray,
            args: rotary_rules.RotaryArguments, dtype: Any) -> np.ndarray:
    """Each pair ``(x1, x2)`` → ``(x1 cos - x2 sin, x2 cos + x1 sin)`` in the compute dtype,
    rounded once to ``dtype``; the dims past rotary_dim pass through."""
    r, half = args.rotary_dim, args.rotary_dim // 2
    rotated = x[..., :r].astype(cos.dtype)  # (..., heads, seq, r)
    if args.layout == "half":
        x1, x2 = rotated[..., :half], rotated[..., half:]
    else:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
    out1 = x1 * cos - x2 * sin  # (..., heads, seq, r/2)
    out2 = x2 * cos + x1 * sin
    if args.layout == "half":
        rotated = np.concatenate([out1, out2], axis=-1)
    else:
        rotated = np.stack([out1, out2], axis=-1).reshape(out1.shape[:-1] + (r,))
    return np.concatenate([rotated.astype(dtype), x[..., r:].astype(dtype)], axis=-1)
