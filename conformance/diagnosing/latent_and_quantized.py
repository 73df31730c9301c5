"""The usual mistakes of multi-head latent attention and of quantised KV caches, for
``conformance.diagnosing.diagnose``: each replayed in float64 on the case's inputs (the
harness's own MLA, ``cases.latent.mla``, and quantiser, ``cases.quantized``, with one thing
changed) and named when the replay reproduces what the implementation returned.

``latent_mistakes(exp, step, actual)``, the MLA module case:

* ``output`` (the naive form): RoPE applied to every dim of q and k (``ROPE_NOT_DECOUPLED``)
  where only the ``qk_rope_head_dim`` part is rotated;
* ``latent_absorbed_output`` and ``decode_output`` (the absorbed form): the absorbed query
  without ``W_UK`` (``NO_FOLD``), the values read from the latent's last ``kv_lora_rank`` dims
  (``WRONG_SLICE``).

``quantized_mistakes(exp, step, actual)``, the quantised cases:

* the scales computed over another granularity (``SCALE_GRANULARITY``): per tensor where the
  scheme says per token or per group, per token where it says per tensor or per head;
* fp8 saturation skipped (``SATURATION_SKIPPED``): ratios beyond fp8_max cast without clipping
  (NaN in e4m3fn, inf in e5m2);
* rounding half away from zero (``HALF_AWAY``) where the spec rounds half to even;
* the cache's residual window off by one (``RESIDUAL_OFF_BY_ONE``).

The first replay that passes the step's tolerance names the mistake; a diagnosis reads
"<name>: <why>", so the reports group the cells by its name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..cases import latent as latent_cases
from ..cases import quantized as quantized_cases
from ..cases import quantizer
from ..cases.expected import Expected
from ..comparing.compare import compare

ROPE_NOT_DECOUPLED = ("rope dims not decoupled: RoPE applied to all {qk} dims of q and k where "
                      "only the last qk_rope_head_dim={dr} (q_pe and k_pe) are rotated; q_nope "
                      "and the latent's up-projection k_nope are never rotated")
NO_FOLD = ("absorbed query missing the W_UK fold: q_nope used as the query in latent space where "
           "the spec takes q_nope @ W_UK (each head's first qk_nope_head_dim rows of kv_b_proj)")
WRONG_SLICE = ("values taken from the wrong latent slice: the last kv_lora_rank={r} dims of the "
               "cached [c ; k_pe] (k_pe included) where the values are its first kv_lora_rank "
               "dims, the latent c")
SCALE_GRANULARITY = ("scale computed per {got} where the scheme says per {want}: amax taken "
                     "over {over}; the scheme's granularity is {granularity!r}")
SATURATION_SKIPPED = ("saturation skipped: fp8 ratios beyond ±{fmax:g} cast without clipping "
                      "(NaN in e4m3fn, inf in e5m2); clip x / scale to ±fp8_max before the cast")
HALF_AWAY = ("rounding half away from zero: ties rounded away from zero (C's round, "
             "np.sign(r) * np.floor(|r| + 0.5)) where the spec rounds half to even (numpy.rint, "
             "torch.round, jnp.round; fp8 casts)")
RESIDUAL_OFF_BY_ONE = ("residual window off by one: tokens leave the window as with residual="
                       "{got} where the case has residual={want}; an append of n tokens "
                       "quantises the window and them when held + n >= residual, so the window "
                       "holds at most residual - 1 tokens")

#: How each granularity's amax reads in a diagnosis.
_OVER = {"tensor": "the whole tensor", "head": "each kv head, every token",
         "token": "each token's head_dim", "group": "each group of group_size channels"}


def _matches(exp: Expected, step: str, actual: np.ndarray, alternative: np.ndarray) -> bool:
    """``actual`` passes against ``alternative`` (a mistake replayed), which itself differs
    from the spec's value."""
    alternative = np.asarray(alternative, dtype=np.float64)
    if alternative.shape != actual.shape:
        return False
    expected = exp.values[step]
    with np.errstate(all="ignore"):
        if compare(step, alternative, expected, exp.baseline[step], exp.dtype).passed:
            return False  # the mistake changes nothing here
        return compare(step, actual, alternative, exp.baseline[step], exp.dtype).passed


# ------------------------------------------------------------------------------ MLA


def latent_mistakes(exp: Expected, step: str, actual: np.ndarray) -> str:
    """The diagnosis of the first MLA mistake whose float64 replay the result of the MLA
    module case's step matches ("" when none does). ``actual``: float64, the step's shape."""
    if exp.kind != "module" or not latent_cases.is_latent(exp.data) or step not in exp.values:
        return ""
    init = exp.data.options["init"]
    if step == "output":
        alt = latent_cases.mla(exp.data, rope_all=True)
        if _matches(exp, step, actual, alt):
            return ROPE_NOT_DECOUPLED.format(
                qk=init["qk_nope_head_dim"] + init["qk_rope_head_dim"],
                dr=init["qk_rope_head_dim"])
        return ""
    for text, mistake in ((NO_FOLD, "no_fold"), (WRONG_SLICE, "last_slice")):
        alt = latent_cases.mla(exp.data, absorbed=True, **{mistake: True})
        if _matches(exp, step, actual, alt):
            return text.format(r=init["kv_lora_rank"])
    return ""


# ------------------------------------------------------------------------------ quantised


def _granularity_replays(scheme: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(wrong granularity, the scheme's) pairs worth replaying."""
    want = scheme["granularity"]
    if quantizer.is_float8(scheme["dtype"]):
        if scheme["scale"] is not None:
            return  # a given scale: no amax to take
        yield "token", want
        if want == "head":
            yield "tensor", want
    else:
        yield "tensor", want
        yield ("group" if want == "token" else "token"), want


def _replays(exp: Expected) -> Iterator[tuple[dict[str, Any], str]]:
    """(``cases.quantized.values``' mistake arguments, the diagnosis) of a quantiser case."""
    scheme = quantized_cases.scheme_options(exp.data.options)
    for got, want in _granularity_replays(scheme):
        yield {"granularity": got}, SCALE_GRANULARITY.format(
            got=got, want=want, over=_OVER[got], granularity=want)
    if quantizer.is_float8(scheme["dtype"]):
        yield {"saturate": False}, SATURATION_SKIPPED.format(
            fmax=quantizer.FP8_MAX[scheme["dtype"]])
    yield {"ties_away": True}, HALF_AWAY


def quantized_mistakes(exp: Expected, step: str, actual: np.ndarray) -> str:
    """The diagnosis of the first quantisation mistake whose float64 replay the result of a
    quantised case's step matches ("" when none does)."""
    if exp.kind != "quantized" or step not in exp.values:
        return ""
    with np.errstate(all="ignore"):
        if step == "quantized_cache_output":
            want = int(exp.data.options.get("residual", 0))
            for got in (want - 1, want + 1):
                if got < 0:
                    continue
                alt = quantized_cases.values(exp.data, exp.dtype, residual=got)[step]
                if _matches(exp, step, actual, alt):
                    return RESIDUAL_OFF_BY_ONE.format(got=got, want=want)
            return ""
        for mistake, text in _replays(exp):
            alt = quantized_cases.values(exp.data, exp.dtype, **mistake).get(step)
            if alt is not None and _matches(exp, step, actual, alt):
                return text
    return ""


__all__ = ["HALF_AWAY", "NO_FOLD", "RESIDUAL_OFF_BY_ONE", "ROPE_NOT_DECOUPLED",
           "SATURATION_SKIPPED", "SCALE_GRANULARITY", "WRONG_SLICE", "latent_mistakes",
           "quantized_mistakes"]
