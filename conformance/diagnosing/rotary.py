"""The usual mistakes of a rotary position embedding, for ``conformance.diagnosing.diagnose``:
each replayed in float64 on the case's inputs (``cases.rotary.rotate`` with one argument
changed), and named when the replay reproduces what the implementation returned.

``rotary_mistakes(exp, step, actual)`` tries, for ``rotary_output`` and ``rotary_grad_x``:

* the other layout (``LAYOUT_SWAPPED``: half pairs ``(i, i + r/2)`` where the case asks for
  interleaved ``(2i, 2i+1)``, or the reverse);
* positions off by one (``p + 1`` or ``p - 1``, ``POSITIONS_OFF_BY_ONE``);
* positions restarted at 0 for the chunk (``POSITIONS_RESTARTED``: the KV-cache offset or the
  shard's start ignored) on a case whose positions start elsewhere, and, in a packed batch,
  positions not restarted per sequence (``NOT_RESTARTED``: the index in the packed axis);
* another usual base (``USUAL_THETAS``, ``THETA_WRONG``) where the case gives no frequencies;
* the given ``inv_freq`` ignored, the default frequencies used (``SCALING_IGNORED``);
* ``rotary_dim`` ignored, every dim rotated (``ROTARY_DIM_IGNORED``), or the partial
  frequencies' exponent divided by head_dim (``EXPONENT_OVER_HEAD_DIM``);
* the attention factor left out (``FACTOR_FORGOTTEN``);
* for the VJP, the forward rotation (``VJP_NOT_TRANSPOSED``: turned by ``+a``, not ``-a``).

For ``rope_inv_freq``: the scaling ignored (the default frequencies) and another usual base;
for ``rope_attention_factor``: a factor of 1 where the method has one. The first replay that
passes the step's tolerance names the mistake; a diagnosis reads "<name>: <why>", so the
reports group the cells by its name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..cases import rotary as rotary_cases
from ..cases.expected import Expected, expected_for
from ..comparing.compare import compare

#: The bases models use; a wrong one is usually another of these.
USUAL_THETAS = (10000.0, 500000.0, 1000000.0, 100000.0, 50000.0, 5000000.0, 10000000.0)

LAYOUT_SWAPPED = ("rotary layout swapped: {got} pairs rotated where the case asks for {want} "
                  "pairs (half: (i, i + r/2), transformers' rotate_half; interleaved: (2i, "
                  "2i+1), Meta's Llama code); convert the checkpoint with "
                  "permute_for_rotary_layout or switch the layout")
POSITIONS_OFF_BY_ONE = ("positions off by one: the rotation of position p {sign} 1 (a 1-based "
                        "position, or the cache length counted after the new token)")
POSITIONS_RESTARTED = ("positions restarted at 0 for the chunk: the offset (the KV-cache length "
                       "while decoding, a shard's first global position) ignored; the tokens "
                       "are at offset + arange(n)")
NOT_RESTARTED = ("positions not restarted per sequence in the packed batch: the index in the "
                 "packed axis used; each sequence's positions start at 0 (token - cu_seq[i])")
THETA_WRONG = "base theta wrong: {got:.0f} used where the case's theta is {want:.0f}"
SCALING_IGNORED = ("scaling ignored: the default frequencies theta ** (-2i / r) used where the "
                   "case gives {what}")
ROTARY_DIM_IGNORED = ("rotary_dim ignored: all {head_dim} dims rotated where only the first "
                      "{r} are (partial rotary); the rest pass through unchanged")
EXPONENT_OVER_HEAD_DIM = ("partial rotary's frequencies over head_dim: theta ** (-2i / "
                          "{head_dim}) where the spec divides by rotary_dim {r}")
FACTOR_FORGOTTEN = ("attention factor forgotten: cos and sin not multiplied by the factor "
                    "{factor:.6g} (YaRN's and LongRoPE's mscale)")
VJP_NOT_TRANSPOSED = ("VJP not transposed: grad_output rotated by +a like the forward; the "
                      "gradient turns it back, by -a")

_ROTATED = ("rotary_output", "rotary_grad_x")


def _rotation_variants(exp: Expected) -> Iterator[tuple[str, dict[str, Any]]]:
    """(diagnosis, the arguments of ``rotate`` with the mistake planted), in order."""
    a, o = exp.data.arrays, exp.data.options
    head_dim = a["x"].shape[-1]
    r = rotary_cases.rotary_dim_of(exp.data)
    layout = o.get("layout", "half")
    factor = float(o.get("attention_factor", 1.0))
    positions = np.asarray(a["positions"], dtype=np.int64)
    given = o.get("inv_freq") is not None
    inv = rotary_cases.inv_freq_of(o, r)
    theta = float(o.get("theta", 10000.0))
    base = {"positions": positions, "inv_freq": inv, "layout": layout,
            "rotary_dim": o.get("rotary_dim"), "attention_factor": factor}
    other = "interleaved" if layout == "half" else "half"
    yield LAYOUT_SWAPPED.format(got=other, want=layout), {**base, "layout": other}
    for sign, shift in (("+", 1), ("-", -1)):
        yield POSITIONS_OFF_BY_ONE.format(sign=sign), {**base, "positions": positions + shift}
    if o.get("cu_seq") is not None:
        flat = np.broadcast_to(np.arange(positions.shape[-1]), positions.shape)
        if not np.array_equal(flat, positions):
            yield NOT_RESTARTED, {**base, "positions": flat}
    restarted = positions - positions[..., :1]
    if o.get("cu_seq") is None and not np.array_equal(restarted, positions):
        yield POSITIONS_RESTARTED, {**base, "positions": restarted}
    if not given:
        for usual in USUAL_THETAS:
            if usual != theta:
                yield (THETA_WRONG.format(got=usual, want=theta),
                       {**base, "inv_freq": rotary_cases.default_inv_freq(r, usual)})
    else:
        kind = (o.get("scaling") or {}).get("rope_type", "given")
        what = f"the {kind} method's inv_freq"
        yield (SCALING_IGNORED.format(what=what),
               {**base, "inv_freq": rotary_cases.default_inv_freq(r, theta)})
    if r < head_dim:
        yield (ROTARY_DIM_IGNORED.format(head_dim=head_dim, r=r),
               {**base, "rotary_dim": None,
                "inv_freq": rotary_cases.default_inv_freq(head_dim, theta)})
        if not given:
            over = rotary_cases.default_inv_freq(head_dim, theta)[: r // 2]
            yield EXPONENT_OVER_HEAD_DIM.format(head_dim=head_dim, r=r), {**base,
                                                                          "inv_freq": over}
    if factor != 1.0:
        yield FACTOR_FORGOTTEN.format(factor=factor), {**base, "attention_factor": 1.0}


def _passes(exp: Expected, step: str, actual: np.ndarray, alt: np.ndarray) -> bool:
    return compare(step, actual, np.asarray(alt, dtype=np.float64), exp.baseline[step],
                   exp.dtype).passed


def _rotation_mistakes(exp: Expected, step: str, actual: np.ndarray) -> str:
    a = exp.data.arrays
    source = a["x"] if step == "rotary_output" else a["grad_output"]
    inverse = step == "rotary_grad_x"
    for diagnosis, kwargs in _rotation_variants(exp):
        if _passes(exp, step, actual, rotary_cases.rotate(source, inverse=inverse, **kwargs)):
            return diagnosis
    if inverse:
        o = exp.data.options
        r = rotary_cases.rotary_dim_of(exp.data)
        forward = rotary_cases.rotate(source, a["positions"], rotary_cases.inv_freq_of(o, r),
                                      o.get("layout", "half"), o.get("rotary_dim"),
                                      float(o.get("attention_factor", 1.0)))
        if _passes(exp, step, actual, forward):
            return VJP_NOT_TRANSPOSED
    return ""


def _frequency_mistakes(exp: Expected, step: str, actual: np.ndarray) -> str:
    o = exp.data.options
    r = rotary_cases.rotary_dim_of(exp.data)
    kwargs = rotary_cases.frequencies_kwargs(o)
    theta = float(o.get("theta", 10000.0))
    scaling = o.get("scaling")
    if step == "rope_attention_factor":
        want = float(exp.values[step])
        if want != 1.0 and _passes(exp, step, actual, np.array(1.0)):
            return FACTOR_FORGOTTEN.format(factor=want)
        return ""
    if scaling is not None:
        what = f"rope_type {scaling.get('rope_type', scaling.get('type'))!r}"
        if _passes(exp, step, actual, rotary_cases.default_inv_freq(r, float(
                scaling.get("rope_theta", theta)))):
            return SCALING_IGNORED.format(what=what)
    if scaling is None or scaling.get("rope_theta") is None:
        for usual in USUAL_THETAS:
            if usual != theta:
                alt, _ = rotary_cases.frequencies(r, **{**kwargs, "theta": usual})
                if _passes(exp, step, actual, alt):
                    return THETA_WRONG.format(got=usual, want=theta)
    return ""


def rotary_mistakes(exp: Expected, step: str, actual: np.ndarray) -> str:
    """The diagnosis of the first usual mistake whose float64 replay the result of a rotary
    case's step matches ("" when none does). ``actual``: float64, ``exp.values[step]``'s
    shape."""
    if exp.kind != "rotary" or step not in exp.values:
        return ""
    with np.errstate(all="ignore"):
        if step in _ROTATED:
            return _rotation_mistakes(exp, step, actual)
        return _frequency_mistakes(exp, step, actual)



# ------------------------------------------------------------------------------ peers


def float32_angle_values(exp: Expected) -> dict[str, np.ndarray]:
    """A rotary case's steps as transformers computes them in a float64 model: the inv_freq
    buffer in float32, the angles ``position_ids.float() @ inv_freq`` and cos, sin in float32
    (times the attention factor), the rotation in x's dtype (float64)."""
    a, o = exp.data.arrays, exp.data.options
    r = rotary_cases.rotary_dim_of(exp.data)
    inv = rotary_cases.inv_freq_of(o, r).astype(np.float32)
    x = np.asarray(a["x"]).astype(np.float64)
    positions = np.asarray(a["positions"])
    p = positions[..., None, :] if x.ndim > 2 else positions
    angles = p.astype(np.float32)[..., None] * inv  # (..., seq, r // 2) float32
    factor = np.float32(o.get("attention_factor", 1.0))
    cos = (np.cos(angles) * factor).astype(np.float64)
    sin = (np.sin(angles) * factor).astype(np.float64)
    layout = o.get("layout", "half")
    first = x[..., 0:r:2] if layout == "interleaved" else x[..., : r // 2]
    second = x[..., 1:r:2] if layout == "interleaved" else x[..., r // 2: r]
    out = np.array(x)
    rotated = (first * cos - second * sin, second * cos + first * sin)
    if layout == "interleaved":
        out[..., 0:r:2], out[..., 1:r:2] = rotated
    else:
        out[..., : r // 2], out[..., r // 2: r] = rotated
    freq, attention = rotary_cases.frequencies(r, **rotary_cases.frequencies_kwargs(o))
    return {"rotary_output": out,
            "rope_inv_freq": freq.astype(np.float32).astype(np.float64),
            "rope_attention_factor": np.array(attention)}


def rotary_hypothesis(exp: Expected, names: tuple[str, ...]
                      ) -> tuple[dict[str, np.ndarray], dict[str, float], str]:
    """``alternatives.hypothesis`` of a rotary case: ``(values, baseline errors, tolerance
    row)``. ``float32_angles`` (``spec.KNOWN_ALTERNATIVES``) on a float64 case gives
    ``float32_angle_values`` under float32's tolerance row, the float32 naive rotation's error
    as the baseline; otherwise the case's own values. Results keep x's dtype."""
    if "float32_angles" not in names or exp.dtype != "float64":
        return dict(exp.values), dict(exp.baseline), exp.dtype
    as32 = expected_for(exp.data, "rotary", "float32", exp.case, gradients=False)
    return float32_angle_values(exp), dict(as32.baseline), "float32"

__all__ = ["EXPONENT_OVER_HEAD_DIM", "FACTOR_FORGOTTEN", "LAYOUT_SWAPPED", "NOT_RESTARTED",
           "POSITIONS_OFF_BY_ONE", "POSITIONS_RESTARTED", "ROTARY_DIM_IGNORED",
           "SCALING_IGNORED", "THETA_WRONG", "USUAL_THETAS", "VJP_NOT_TRANSPOSED",
           "float32_angle_values", "rotary_hypothesis", "rotary_mistakes"]
