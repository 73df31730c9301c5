"""The cases of quantised KV caches (``spec.QUANTIZATION_SCHEMES``, ``spec.QUANTIZED_CACHE``),
appended to ``conformance.cases.CASES``, and their expected values from this file's own
float64 quantiser.

A ``quantized`` case (a kind of its own) describes its scheme by scalar options: ``q_dtype``
(``int8``, ``int4``, ``float8_e4m3``, ``float8_e5m2``), ``granularity``, ``group_size``,
``zero_point``, ``q_scale`` (a given fp8 scale: a number, per head a tuple), and for a cache
``residual``, the values' scheme (the same names prefixed ``v_``) and ``appends`` (the sizes of
the successive appends). Two shapes of case:

* a quantiser case holds ``x (..., kv_heads, n, head_dim)``; its steps are ``quantize_kv(x,
  scheme)``'s codes (``quantized_codes``), scales (``quantized_scales``), zero points
  (``quantized_zero_points``, schemes with zero points) and ``dequantize_kv`` of the result
  (``dequantized``);
* a cache case holds ``query (..., heads, total, head_dim)``, ``key``/``value (..., kv_heads,
  total, ·)``: a ``QuantizedKVCache`` takes the appends in turn and, after each, attends the
  query rows of the tokens just appended (``quantized_cache_output``, the rows joined).

The expected values are computed here, never by a backend: the quantiser is
``cases.quantizer``'s, written from the spec's text (its float32 arithmetic emulated in float64).
Codes are compared exactly: integer codes as they are, fp8 codes as signed ordinals
(``quantizer.fp8_ordinals``), so one step of the grid is 1 whatever the tolerance. The residual
window's rule (``moves_to_store``) is written again from ``spec.QUANTIZED_RESIDUAL``'s text.
The cache's attention is the float64 reference over the dequantised keys and values (the naive
attention in the dtype scales its tolerance).

The quantiser takes the mistakes ``diagnosing.latent_and_quantized`` replays as arguments: another
granularity for the scales, no saturation, rounding half away from zero, another residual.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .inputs import Case, CaseData
from .naive import EXACT, Precision, naive_attention
from .quantizer import LEVELS, QMAX, code_values, grouped, is_float8, quantize
from .reference import attention as reference_attention

#: The compared steps of a quantised case.
QUANTIZED_STEPS = ("quantized_codes", "quantized_scales", "quantized_zero_points",
                   "dequantized", "quantized_cache_output")
#: The options that describe a scheme (a cache's values: the same names prefixed ``v_``).
SCHEME_OPTIONS = ("q_dtype", "granularity", "group_size", "zero_point", "q_scale")
QUANTIZED_OPTIONS = frozenset({*SCHEME_OPTIONS, *(f"v_{n}" for n in SCHEME_OPTIONS),
                               "residual", "appends"})


def scheme_options(options: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``KVQuantization``'s keyword arguments of a case (``prefix`` "v_": the values' scheme,
    None when the case has none): dtype, granularity, group_size, zero_point, scale,
    residual."""
    if f"{prefix}q_dtype" not in options:
        return {} if prefix else {"dtype": "int8"}
    q_dtype = options[f"{prefix}q_dtype"]
    scale = options.get(f"{prefix}q_scale")
    kwargs: dict[str, Any] = {
        "dtype": q_dtype,
        "granularity": options.get(f"{prefix}granularity",
                                   "tensor" if is_float8(q_dtype) else "group"),
        "group_size": int(options.get(f"{prefix}group_size", 64)),
        "zero_point": bool(options.get(f"{prefix}zero_point", False)),
        "scale": tuple(float(s) for s in scale) if isinstance(scale, (list, tuple))
        else scale,
        "residual": int(options.get("residual", 0)),
    }
    return kwargs


# ------------------------------------------------------------------------------ the cache


def moves_to_store(length: int, held: int, n: int, residual: int) -> bool:
    """``spec.QUANTIZED_RESIDUAL``: an append of ``n > 0`` tokens quantises the window and the
    new tokens when there is no window, when the cache is empty, or when ``held + n >=
    residual``; otherwise the new tokens join the window."""
    if n == 0:
        return False
    return residual == 0 or length == 0 or held + n >= residual


def cache_outputs(data: CaseData, dtype: str, naive: bool = False, residual: int | None = None,
                  **mistake: Any) -> np.ndarray:
    """A cache case: after each append the query rows of its tokens attend (bottom-right
    causal) the dequantised store and the raw window; the rows joined ``(..., heads, total,
    v_dim)``. ``residual``: another window (a mistake replayed); ``mistake``: ``quantize``'s
    replay arguments; ``naive``: the naive attention in ``dtype``."""
    a, o = data.arrays, data.options
    p = Precision(dtype) if naive else EXACT
    k_scheme = scheme_options(o)
    v_scheme = scheme_options(o, "v_") or k_scheme
    window = int(o.get("residual", 0)) if residual is None else residual
    rounding = Precision(dtype)
    key, value, query = (np.asarray(a[n]).astype(np.float64) for n in ("key", "value", "query"))
    stored_k: list[np.ndarray] = []
    stored_v: list[np.ndarray] = []
    scales: dict[str, np.ndarray | None] = {"k": None, "v": None}
    start, held, outputs = 0, 0, []
    for n in o["appends"]:
        stop = start + n
        length = start  # tokens appended before this append
        if moves_to_store(length, held, n, window):
            moving = slice(start - held, stop)
            for name, x, scheme, store in (("k", key, k_scheme, stored_k),
                                           ("v", value, v_scheme, stored_v)):
                got = quantize(x[..., moving, :], scheme, fp8_scale=scales[name], **mistake)
                if is_float8(scheme["dtype"]) and scales[name] is None:
                    scales[name] = got["scales"]
                deq = (_unrounded(got, scheme["dtype"], x[..., moving, :].shape) if naive
                       else got["values"])
                store.append(rounding.round(deq))
            held = 0
        else:
            held += n
        keys = np.concatenate(stored_k + [key[..., stop - held:stop, :]], axis=-2)
        values = np.concatenate(stored_v + [value[..., stop - held:stop, :]], axis=-2)
        arrays = {"query": query[..., start:stop, :], "key": keys, "value": values}
        options = {"is_causal": True, "causal_alignment": "bottom_right"}
        steps = naive_attention(arrays, options, p) if naive else reference_attention(
            arrays["query"], keys, values, **options)
        outputs.append(steps.output)
        start = stop
    return np.concatenate(outputs, axis=-2)


# ------------------------------------------------------------------------------ values


def _unrounded(got: dict[str, np.ndarray], q_dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The naive baseline's dequantised values: ``quantize``'s codes, scales and zero points
    combined in float64, without the spec's float32 roundings of the product and the sum. Its
    distance from the expected values is the tolerance's budget for those roundings (an
    implementation that fuses the two into one multiply-add, one rounding, stays within it;
    the three backends keep both: spec.QUANTIZED_CACHE)."""
    full = got["scales"]
    if is_float8(q_dtype):
        full = full.reshape(full.shape + (1, 1)) if full.ndim == 1 else full
        return got["codes"] * full
    size = shape[-1] // got["scales"].shape[-1]
    deq = grouped(got["codes"], size) * got["scales"][..., None]
    if "zero_points" in got:
        deq = deq + got["zero_points"][..., None]
    return deq.reshape(shape)


def values(data: CaseData, dtype: str, naive: bool = False, **mistake: Any
           ) -> dict[str, np.ndarray]:
    """Every step of a quantised case: the expected values, or (``naive``) the baseline: the
    same codes and scales, the dequantised values computed in float64 without the float32
    rounding, the cache's attention naive in ``dtype``. ``mistake``: ``quantize``'s replay
    arguments (``granularity``, ``saturate``, ``ties_away``) or ``residual``."""
    o = data.options
    if "appends" in o:
        return {"quantized_cache_output": cache_outputs(data, dtype, naive, **mistake)}
    scheme = scheme_options(o)
    got = quantize(data.arrays["x"], scheme, **mistake)
    p = Precision(dtype)
    out = {"quantized_codes": code_values(got["codes"], scheme["dtype"]),
           "quantized_scales": got["scales"]}
    if "zero_points" in got:
        out["quantized_zero_points"] = got["zero_points"]
    if naive:
        out["dequantized"] = p.round(_unrounded(got, scheme["dtype"], data.arrays["x"].shape))
    else:
        out["dequantized"] = p.round(got["values"])
    return out


# ------------------------------------------------------------------------------ cases


def _int_groups(rng: np.random.Generator, q_dtype: str, zero_point: bool,
                token: bool) -> np.ndarray:
    """``(2, 2, 4, 8)``: seeded normal values, with ties and zeros planted.

    Token 0 of head 0 holds exact ties in its first 4 channels (the ratios 2.5, -0.5 (or 4.5)
    and 1.5 or -3.5, and the group's end, of a scale that is a power of two); token 1 of head
    1 is zero in its first 4 channels (a whole token per token), and with zero points token 2
    of head 1 is a constant 0.75."""
    x = rng.standard_normal((2, 2, 4, 8))
    s = 2.0 ** -4
    if zero_point:
        low = -1.0
        x[0, 0, 0, :4] = [low, low + LEVELS[q_dtype] * s, low + 2.5 * s, low + 4.5 * s]
        if token:  # the rest of the token inside [low, high]
            x[0, 0, 0, 4:] = np.clip(x[0, 0, 0, 4:], low, low + LEVELS[q_dtype] * s)
        x[1, 1, 2, :] = 0.75
    else:
        qmax = QMAX[q_dtype]
        x[0, 0, 0, :4] = [qmax * s, 2.5 * s, -0.5 * s, -3.5 * s]
        if token:
            x[0, 0, 0, 4:] = np.clip(x[0, 0, 0, 4:], -qmax * s, qmax * s)
    x[1, 1, 1, : 8 if token else 4] = 0.0
    return x


def _quantize_case(x_fn: Callable[[np.random.Generator], np.ndarray], **options: Any
                   ) -> Callable[[np.random.Generator], CaseData]:
    def build(rng: np.random.Generator) -> CaseData:
        return CaseData({"x": x_fn(rng)}, dict(options))

    return build


def _ints(q_dtype: str, zero_point: bool, token: bool
          ) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda rng: _int_groups(rng, q_dtype, zero_point, token)


def _fp8_ties(rng: np.random.Generator) -> np.ndarray:
    """``(2, 2, 4, 8)`` normal values times 2; token 0 of head 0 holds values that sit
    halfway between fp8 neighbours at a scale of 0.5 (1.0625 and 1.1875 of e4m3's grid,
    1.125 and 1.375 of e5m2's), head 1's token 2 is all zero."""
    x = 2.0 * rng.standard_normal((2, 2, 4, 8))
    x[0, 0, 0, :4] = [0.5 * 1.0625, 0.5 * 1.1875, -0.5 * 1.125, 0.5 * 1.375]
    x[:, 1, 2, :] = 0.0
    return x


def _fp8_saturating(rng: np.random.Generator) -> np.ndarray:
    """``_fp8_ties`` with values far beyond the fp8 range at a scale of 0.5: ±300, ±1000
    (ratios 600 and 2000: past e4m3's 448, where ml_dtypes gives NaN; e5m2's 57344 is passed
    by 40000 → ratio 80000, cast to inf without clipping)."""
    x = _fp8_ties(rng)
    x[1, 0, 3, :4] = [300.0, -1000.0, 40000.0, -40000.0]
    return x


def _cache_arrays(rng: np.random.Generator) -> CaseData:
    total = sum(CACHE_APPENDS)
    arrays = {"query": rng.standard_normal((1, 4, total, 8)),
              "key": rng.standard_normal((1, 2, total, 8)),
              "value": rng.standard_normal((1, 2, total, 8))}
    options = {"q_dtype": "int4", "granularity": "group", "group_size": 4, "zero_point": True,
               "v_q_dtype": "float8_e4m3", "v_granularity": "head", "residual": 3,
               "appends": CACHE_APPENDS}
    return CaseData(arrays, options)


#: The appends of the cache case with a window of 3: the prompt (quantised whole), then
#: single tokens that stay in the window until an append fills it exactly (2 held + 1 new = 3:
#: all three quantised), then 2 tokens that stay. Windows of 2 or 4 move other tokens.
CACHE_APPENDS = (4, 1, 1, 1, 2)

QUANTIZED_CASES: tuple[Case, ...] = (
    Case("quant_int8_group", "int8, symmetric, groups of 4 channels: ties, an all-zero group",
         _quantize_case(_ints("int8", False, False), q_dtype="int8", granularity="group",
                        group_size=4), kind="quantized"),
    Case("quant_int4_token", "int4, symmetric, one scale per token: ties, an all-zero group",
         _quantize_case(_ints("int4", False, True), q_dtype="int4", granularity="token"),
         kind="quantized"),
    Case("quant_int8_zero_point_token",
         "int8 with zero points, one scale per token: ties, a constant half-token",
         _quantize_case(_ints("int8", True, True), q_dtype="int8", granularity="token",
                        zero_point=True), kind="quantized"),
    Case("quant_int4_zero_point_group",
         "int4 with zero points, groups of 4: ties, an all-zero and a constant group",
         _quantize_case(_ints("int4", True, False), q_dtype="int4", granularity="group",
                        group_size=4, zero_point=True), kind="quantized"),
    Case("quant_fp8_e4m3_tensor", "fp8 e4m3, one dynamic scale per tensor",
         _quantize_case(_fp8_ties, q_dtype="float8_e4m3", granularity="tensor"),
         kind="quantized"),
    Case("quant_fp8_e4m3_head_saturate",
         "fp8 e4m3, given scales per head (0.5, 0.25): ties, values beyond 448 saturate",
         _quantize_case(_fp8_saturating, q_dtype="float8_e4m3", granularity="head",
                        q_scale=(0.5, 0.25)), kind="quantized"),
    Case("quant_fp8_e5m2_tensor_saturate",
         "fp8 e5m2, a given scale 0.5: ties, values beyond 57344 saturate (not inf)",
         _quantize_case(_fp8_saturating, q_dtype="float8_e5m2", granularity="tensor",
                        q_scale=0.5), kind="quantized"),
    Case("quant_fp8_e5m2_head", "fp8 e5m2, one dynamic scale per head, an all-zero token",
         _quantize_case(_fp8_ties, q_dtype="float8_e5m2", granularity="head"),
         kind="quantized"),
    Case("quant_cache_residual",
         "QuantizedKVCache: int4 keys with zero points, fp8 e4m3 values per head, a window "
         "of 3 crossed by appends 4 1 1 1 2, attended after each",
         _cache_arrays, kind="quantized"),
)


__all__ = ["CACHE_APPENDS", "QUANTIZED_CASES", "QUANTIZED_OPTIONS", "QUANTIZED_STEPS",
           "cache_outputs", "moves_to_store", "scheme_options", "values"]
