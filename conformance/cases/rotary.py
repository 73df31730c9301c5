"""The cases of the rotary position embedding (``spec.ROTARY``), appended to
``conformance.cases.CASES``, and their float64 expected values.

A ``rotary`` case (a kind of its own) holds ``x (..., heads, seq, head_dim)`` (cast to the
case's dtype) and integer ``positions (..., seq)``; its options are the arguments of
``rotary_embedding`` (``layout``, ``theta``, ``rotary_dim``) and of ``rope_frequencies``
(``scaling``, a transformers dict; ``seq_len``, ``max_position_embeddings``). A case with
``scaling`` also carries the method's frequencies (``inv_freq``, a tuple of floats) and
``attention_factor``, computed here in float64 when the case is built: ``rotary_embedding`` gets
them as arguments, so the rotation and the frequencies are compared as separate steps:

* ``rotary_output``: ``rotary_embedding(x, positions, ...)``;
* ``rotary_grad_x``: ``rotary_embedding_vjp(x, positions, grad_output, ...)``;
* ``rope_inv_freq`` and ``rope_attention_factor``: ``rope_frequencies(rotary_dim, theta=...,
  scaling=..., seq_len=..., max_position_embeddings=...)``.

The expected values are this file's own float64 computation, written from the spec's text and
never from a backend: each rotated pair is the complex number ``x1 + i x2`` multiplied by
``attention_factor · e^{i p·inv_freq}`` (``rotate``), and the frequencies re-derive
``spec.ROTARY_SCALING``'s formulas (``frequencies``). The naive baseline that scales the
tolerance (``naive_rotate``) is the rotation as transformers writes it: the angle one multiply
in the compute dtype, cos and sin rounded to the input dtype and every product and sum rounded
to it. Packed positions record their sequences' offsets (option ``cu_seq``), which the
diagnoses read (``diagnosing.rotary``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import spec
from .inputs import Case, CaseData
from .naive import Precision

#: The shape of most rotary cases: batch 2, heads 2, seq 6, head_dim 8.
RB, RH, RS, RD = 2, 2, 6, 8
#: The compared steps of a rotary case.
ROTARY_STEPS = ("rotary_output", "rotary_grad_x", "rope_inv_freq", "rope_attention_factor")


# ------------------------------------------------------------------------------ frequencies


def default_inv_freq(dim: int, base: float) -> np.ndarray:
    """``(dim // 2,)`` float64: ``1 / base ** (2 i / dim)``."""
    return np.array([1.0 / base ** (2 * i / dim) for i in range(dim // 2)])


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def frequencies(dim: int, theta: float, scaling: dict | None = None, seq_len: int | None = None,
                max_position_embeddings: int | None = None) -> tuple[np.ndarray, float]:
    """``(inv_freq (dim // 2,) float64, attention_factor)`` of ``spec.ROTARY_SCALING``, written
    out from its text (``dim``: the rotated dims)."""
    s = dict(scaling or {})
    kind = s.get("rope_type", s.get("type", "default"))
    base = float(s.get("rope_theta", theta))
    inv0 = default_inv_freq(dim, base)
    original = s.get("original_max_position_embeddings", max_position_embeddings)
    if kind == "default":
        return inv0, 1.0
    if kind == "linear":
        return inv0 / s["factor"], 1.0
    if kind == "dynamic":
        mpe = max_position_embeddings
        length = mpe if seq_len is None else max(seq_len, mpe)
        scaled = base * (s["factor"] * length / mpe - (s["factor"] - 1)) ** (dim / (dim - 2))
        return default_inv_freq(dim, scaled), 1.0
    if kind == "llama3":
        wavelen = 2 * math.pi / inv0
        low_wavelen = original / s["low_freq_factor"]
        high_wavelen = original / s["high_freq_factor"]
        smooth = (original / wavelen - s["low_freq_factor"]) / (
            s["high_freq_factor"] - s["low_freq_factor"])
        mid = (1 - smooth) * inv0 / s["factor"] + smooth * inv0
        out = np.where(wavelen > low_wavelen, inv0 / s["factor"], mid)
        return np.where(wavelen < high_wavelen, inv0, out), 1.0
    factor = s.get("factor", (max_position_embeddings or original) / original)
    if kind == "yarn":
        if s.get("attention_factor") is not None:
            attention = float(s["attention_factor"])
        elif s.get("mscale") and s.get("mscale_all_dim"):
            attention = _mscale(factor, s["mscale"]) / _mscale(factor, s["mscale_all_dim"])
        else:
            attention = _mscale(factor)

        def corr(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = corr(s.get("beta_fast", 32.0)), corr(s.get("beta_slow", 1.0))
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0.0, 1.0)
        return inv0 / factor * ramp + inv0 * (1 - ramp), attention
    if kind == "longrope":
        if s.get("attention_factor") is not None:
            attention = float(s["attention_factor"])
        else:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) /
                                                         math.log(original))
        long = seq_len is not None and seq_len > original
        ext = np.array(s["long_factor"] if long else s["short_factor"], dtype=np.float64)
        return 1.0 / (ext * base ** (np.arange(0, dim, 2) / dim)), attention
    raise ValueError(f"unknown rope_type {kind!r}")


# ------------------------------------------------------------------------------ the rotation


def _pairs(x: np.ndarray, layout: str, r: int) -> tuple[np.ndarray, np.ndarray]:
    """The two members of each rotated pair, ``(..., r // 2)`` each."""
    if layout == "interleaved":
        return x[..., 0:r:2], x[..., 1:r:2]
    return x[..., : r // 2], x[..., r // 2: r]


def _joined(x: np.ndarray, first: np.ndarray, second: np.ndarray, layout: str,
            r: int) -> np.ndarray:
    """``x`` with its rotated pairs replaced by ``(first, second)`` (float64)."""
    out = np.array(x, dtype=np.float64)
    if layout == "interleaved":
        out[..., 0:r:2], out[..., 1:r:2] = first, second
    else:
        out[..., : r // 2], out[..., r // 2: r] = first, second
    return out


def _angles(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
            dtype: Any = np.float64) -> np.ndarray:
    """``(..., seq, r // 2)`` broadcastable to the pairs: ``p · inv_freq`` in ``dtype``, one
    multiply (a heads axis inserted into positions for a 3-D or larger x)."""
    p = np.asarray(positions)
    p = p[..., None, :] if x.ndim > 2 else p
    return p.astype(dtype)[..., None] * np.asarray(inv_freq).astype(dtype)


def rotate(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, layout: str = "half",
           rotary_dim: int | None = None, attention_factor: float = 1.0,
           inverse: bool = False) -> np.ndarray:
    """The float64 rotation: each pair ``x1 + i x2`` times ``attention_factor · e^{± i a}``
    (``inverse``: ``-a``, the VJP's transpose).

    Args:
      x: ``(..., heads, seq, head_dim)`` or ``(seq, head_dim)``.
      positions: ``(..., seq)`` integers.
      inv_freq: ``(rotary_dim // 2,)``.
      layout: "half" or "interleaved"; rotary_dim: None for all of head_dim.

    Returns:
      ``x.shape`` float64; the dims past rotary_dim unchanged.
    """
    x = np.asarray(x).astype(np.float64)
    r = x.shape[-1] if rotary_dim is None else int(rotary_dim)
    a = _angles(x, positions, inv_freq)
    first, second = _pairs(x, layout, r)
    turned = (first + 1j * second) * attention_factor * np.exp((-1j if inverse else 1j) * a)
    return _joined(x, turned.real, turned.imag, layout, r)


def naive_rotate(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, layout: str,
                 rotary_dim: int | None, attention_factor: float, dtype: str,
                 inverse: bool = False) -> np.ndarray:
    """The rotation as transformers writes it in ``dtype``: the angle in the compute dtype,
    cos and sin (times the factor) rounded to ``dtype``, every product and sum rounded to it.
    Returns float64 values of ``dtype``."""
    p = Precision(dtype)
    x = np.asarray(x).astype(np.float64)
    r = x.shape[-1] if rotary_dim is None else int(rotary_dim)
    a = _angles(x, positions, inv_freq, p.accumulate)
    cos = p.round(np.cos(a) * p.accumulate.type(attention_factor))
    sin = p.round(np.sin(a) * p.accumulate.type(attention_factor))
    sin = -sin if inverse else sin
    first, second = _pairs(x, layout, r)
    out1 = p.round(p.round(first * cos) - p.round(second * sin))
    out2 = p.round(p.round(second * cos) + p.round(first * sin))
    return _joined(x, out1, out2, layout, r)


# ------------------------------------------------------------------------------ calls


def rotary_dim_of(data: CaseData) -> int:
    """The rotated dims of a case."""
    r = data.options.get("rotary_dim")
    return int(data.arrays["x"].shape[-1] if r is None else r)


def inv_freq_of(options: dict[str, Any], rotary_dim: int) -> np.ndarray:
    """The frequencies ``rotary_embedding`` uses: the case's ``inv_freq``, else the default."""
    if options.get("inv_freq") is not None:
        return np.asarray(options["inv_freq"], dtype=np.float64)
    return default_inv_freq(rotary_dim, options.get("theta", 10000.0))


def rotary_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """``rotary_embedding``'s keyword arguments: theta and layout; rotary_dim, inv_freq (a
    float64 array) and attention_factor where the case has them (a factor of 1 left out)."""
    kwargs: dict[str, Any] = {"theta": float(options.get("theta", 10000.0)),
                              "layout": options.get("layout", "half")}
    if options.get("rotary_dim") is not None:
        kwargs["rotary_dim"] = int(options["rotary_dim"])
    if options.get("inv_freq") is not None:
        kwargs["inv_freq"] = np.asarray(options["inv_freq"], dtype=np.float64)
    if options.get("attention_factor", 1.0) != 1.0:
        kwargs["attention_factor"] = float(options["attention_factor"])
    return kwargs


def frequencies_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """``rope_frequencies``' keyword arguments (the head_dim is ``rotary_dim_of``)."""
    kwargs: dict[str, Any] = {"theta": float(options.get("theta", 10000.0))}
    for name in ("scaling", "seq_len", "max_position_embeddings"):
        if options.get(name) is not None:
            kwargs[name] = options[name]
    return kwargs


def values(data: CaseData, dtype: str, naive: bool = False) -> dict[str, np.ndarray]:
    """Every step of a rotary case: the float64 reference, or (``naive``) the naive baseline in
    ``dtype`` (the frequencies rounded to the compute dtype)."""
    a, o = data.arrays, data.options
    r = rotary_dim_of(data)
    inv = inv_freq_of(o, r)
    factor = float(o.get("attention_factor", 1.0))
    args = (a["x"], a["positions"], inv, o.get("layout", "half"), o.get("rotary_dim"), factor)
    freq, attention = frequencies(r, **frequencies_kwargs(o))
    if naive:
        rounding = np.dtype(spec.COMPUTE_DTYPE[dtype]).type
        out = {"rotary_output": naive_rotate(*args, dtype),
               "rope_inv_freq": freq.astype(rounding).astype(np.float64),
               "rope_attention_factor": np.array(float(rounding(attention)))}
    else:
        out = {"rotary_output": rotate(*args), "rope_inv_freq": freq,
               "rope_attention_factor": np.array(attention)}
    if "grad_output" in a:
        grad_args = (a["grad_output"], *args[1:])
        out["rotary_grad_x"] = (naive_rotate(*grad_args, dtype, inverse=True) if naive
                                else rotate(*grad_args, inverse=True))
    return out


# ------------------------------------------------------------------------------ cases


def _case(x_shape: tuple[int, ...], positions: Any, **options: Any
          ) -> Callable[[np.random.Generator], CaseData]:
    """A builder: x standard normal of ``x_shape``, int64 ``positions``, the options; with a
    ``scaling``, its float64 ``inv_freq`` and ``attention_factor`` (``frequencies``)."""

    def build(rng: np.random.Generator) -> CaseData:
        opts = {"layout": "half", "theta": 10000.0, **options}
        if opts.get("scaling") is not None:
            r = opts.get("rotary_dim") or x_shape[-1]
            inv, factor = frequencies(r, **frequencies_kwargs(opts))
            opts["inv_freq"] = tuple(float(f) for f in inv)
            opts["attention_factor"] = float(factor)
        arrays = {"x": rng.standard_normal(x_shape),
                  "positions": np.asarray(positions, dtype=np.int64)}
        return CaseData(arrays, opts)

    return build


def _offsets(*starts: int) -> np.ndarray:
    """``(len(starts), RS)``: each row a decoding chunk at its own cache length."""
    return np.array(starts)[:, None] + np.arange(RS)


#: Three packed sequences of lengths 3, 2 and 1: positions restart at 0 for each.
PACKED_CU_SEQ = (0, 3, 5, 6)
_PACKED = np.concatenate([np.arange(b - a) for a, b in zip(PACKED_CU_SEQ[:-1], PACKED_CU_SEQ[1:],
                                                            strict=True)])

#: YaRN as DeepSeek-V3 uses it (interleaved pairs), shrunk to a context of 64: factor 4, its
#: attention factor 0.1 ln 4 + 1; the ramp spans the 4 frequencies of head_dim 8.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0}
#: Llama 3.1's scaling: the 4 frequencies of head_dim 8 at base 500000 fall in all three bands.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
#: LongRoPE (Phi-3) past its original context of 16 (positions up to 29): the long factors;
#: factor 4 = a context of 64 over 16.
LONGROPE = {"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0, 1.2, 1.5, 2.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0], "original_max_position_embeddings": 16}

ROTARY_CASES: tuple[Case, ...] = (
    Case("rope_yarn_interleaved_decode",
         "YaRN factor 4 (attention factor 1.139), interleaved pairs, decoding at offsets 60, 3",
         _case((RB, RH, RS, RD), _offsets(60, 3), layout="interleaved", scaling=YARN,
               max_position_embeddings=256), kind="rotary"),
    Case("rotary_half", "RoPE, half-rotated pairs (rotate_half), theta 10000, positions 0-5",
         _case((RB, RH, RS, RD), np.arange(RS)), kind="rotary"),
    Case("rotary_interleaved_partial",
         "interleaved pairs on the first 4 of 8 dims (partial), theta 500000",
         _case((RB, RH, RS, RD), np.arange(RS), layout="interleaved", rotary_dim=4,
               theta=500000.0), kind="rotary"),
    Case("rotary_partial_decode",
         "half pairs on the first 6 of 8 dims, a decoding chunk at cache lengths 37 and 5",
         _case((RB, RH, RS, RD), _offsets(37, 5), rotary_dim=6), kind="rotary"),
    Case("rotary_packed_positions",
         "a packed batch (heads, tokens, head_dim) of 3 sequences: positions 0 1 2 0 1 0",
         _case((4, RS, RD), _PACKED, cu_seq=PACKED_CU_SEQ), kind="rotary"),
    Case("rotary_large_positions",
         "positions -5 -1 0 1 8191 131071: negative, and large (float32 angles round)",
         _case((RB, RH, RS, RD), [-5, -1, 0, 1, 8191, 131071]), kind="rotary"),
    Case("rope_linear_interleaved", "linear scaling factor 4, interleaved pairs",
         _case((RB, RH, RS, RD), np.arange(RS), layout="interleaved",
               scaling={"rope_type": "linear", "factor": 4.0}), kind="rotary"),
    Case("rope_dynamic", "dynamic NTK factor 2, context 16, positions up to 25 (seq_len 26)",
         _case((RB, RH, RS, RD), _offsets(20, 0), scaling={"rope_type": "dynamic",
                                                          "factor": 2.0},
               seq_len=26, max_position_embeddings=16), kind="rotary"),
    Case("rope_llama3", "Llama 3.1 scaling (factor 8, base 500000), positions 100-105",
         _case((RB, RH, RS, RD), 100 + np.arange(RS), theta=500000.0, scaling=LLAMA3,
               max_position_embeddings=131072),
         kind="rotary"),
    Case("rope_longrope",
         "LongRoPE past its context of 16 (positions up to 29): long factors, attention factor",
         _case((RB, RH, RS, RD), _offsets(24, 10), scaling=LONGROPE, seq_len=30,
               max_position_embeddings=64), kind="rotary"),
)

__all__ = ["LLAMA3", "LONGROPE", "PACKED_CU_SEQ", "ROTARY_CASES", "ROTARY_STEPS", "YARN",
           "default_inv_freq", "frequencies", "frequencies_kwargs", "inv_freq_of",
           "naive_rotate", "rotary_dim_of", "rotary_kwargs", "rotate", "values"]
