"""Each usual mistake of multi-head latent attention and of quantised KV caches, planted in a
checked module, fails its case with its diagnosis in the verdict's headline; the same module
without a mistake passes.

A planted module is numpy_attn with one piece written again the wrong way: a quantiser that
takes one scale per tensor, skips fp8 saturation or rounds ties away from zero (written here
with NumPy, numpy_attn's ``QuantizedArray`` carrying the result), a cache whose residual window
is one larger, or a ``MultiHeadLatentAttention`` subclass whose naive form rotates every dim,
whose absorbed query skips ``W_UK`` or whose absorbed values read the latent's last dims.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import numpy_attn
from conformance.diagnosing import diagnose
from conformance.reporting import terminal
from conformance.running import backends, runner
from numpy_attn.quantized_cache import QuantizedArray

QMAX = {"int8": 127, "int4": 7}
FP8 = {"float8_e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "float8_e5m2": (ml_dtypes.float8_e5m2,
                                                                        57344.0)}


def _integer(x: Any, scheme: Any, *, per_tensor: bool = False, ties_away: bool = False
             ) -> QuantizedArray:
    """Symmetric integer codes; ``per_tensor``: one amax over the whole tensor, broadcast to the
    scheme's scales; ``ties_away``: ties rounded away from zero."""
    x32 = np.asarray(x).astype(np.float32)
    size = x32.shape[-1] if scheme.granularity == "token" else scheme.group_size
    g = x32.reshape(x32.shape[:-1] + (-1, size))
    amax = np.abs(g).max() if per_tensor else np.abs(g).max(axis=-1)
    scales = np.broadcast_to(np.float32(amax) / np.float32(QMAX[scheme.dtype]),
                             g.shape[:-1]).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))[..., None]
    ratio = np.where(scales[..., None] > 0, g / safe, np.float32(0))
    rounded = np.sign(ratio) * np.floor(np.abs(ratio) + 0.5) if ties_away else np.rint(ratio)
    codes = np.clip(rounded, -QMAX[scheme.dtype], QMAX[scheme.dtype]).reshape(x32.shape)
    return QuantizedArray(codes.astype(np.int8), scales, None, scheme, x32.dtype.name
                          if np.asarray(x).dtype == np.float32 else np.asarray(x).dtype.name)


def _fp8_unsaturated(x: Any, scheme: Any) -> QuantizedArray:
    """fp8 codes of a given scale cast without clipping."""
    x32 = np.asarray(x).astype(np.float32)
    kind, _ = FP8[scheme.dtype]
    scales = np.asarray(scheme.scale, np.float32)
    full = scales.reshape(scales.shape + (1, 1)) if scales.ndim == 1 else scales
    return QuantizedArray((x32 / full).astype(kind), scales, None, scheme,
                          np.asarray(x).dtype.name)


def _quantizer(mistake: str) -> Any:
    def quantize_kv(x: Any, scheme: Any) -> Any:
        if mistake == "per_tensor" and not scheme.is_float8 and not scheme.zero_point:
            return _integer(x, scheme, per_tensor=True)
        if mistake == "ties_away" and not scheme.is_float8 and not scheme.zero_point:
            return _integer(x, scheme, ties_away=True)
        if mistake == "no_saturation" and scheme.is_float8 and scheme.scale is not None:
            return _fp8_unsaturated(x, scheme)
        return numpy_attn.quantize_kv(x, scheme)

    return quantize_kv


class _WiderWindow:
    """numpy_attn's QuantizedKVCache with a residual window one larger than asked."""

    @staticmethod
    def empty(*args: Any, scheme: Any, value_scheme: Any = None, **kwargs: Any) -> Any:
        wider = dataclasses.replace(scheme, residual=scheme.residual + 1)
        values = None if value_scheme is None else dataclasses.replace(
            value_scheme, residual=value_scheme.residual + 1)
        return numpy_attn.QuantizedKVCache.empty(*args, scheme=wider, value_scheme=values,
                                                 **kwargs)


class _RopeEverywhere(numpy_attn.MultiHeadLatentAttention):
    """The naive form rotates all of q and k (the default frequencies of qk_head_dim)."""

    def forward(self, x: Any, *, positions: Any = None, mask: Any = None,
                is_causal: bool = False, absorbed: bool = False) -> Any:
        if absorbed:
            return super().forward(x, positions=positions, mask=mask, is_causal=is_causal,
                                   absorbed=True)
        x = np.asarray(x)
        positions = np.arange(x.shape[-2])
        stages = self._stages(x, positions)
        _, key, value = self._naive(stages)
        dn, r = self.sizes.qk_nope_head_dim, self.sizes.kv_lora_rank
        k_pe = np.broadcast_to(stages["kv_a"][..., None, :, r:],
                               key.shape[:-1] + (self.sizes.qk_rope_head_dim,))
        query = numpy_attn.rotary_embedding(stages["q"], positions, layout="interleaved")
        key = numpy_attn.rotary_embedding(np.concatenate([key[..., :dn], k_pe], axis=-1),
                                          positions, layout="interleaved")
        context = numpy_attn.scaled_dot_product_attention(query, key, value, mask=mask,
                                                          is_causal=is_causal, scale=self.scale)
        return self._out(context)


class _NoFold(numpy_attn.MultiHeadLatentAttention):
    """The absorbed query is [q_nope ; q_pe]: W_UK never folded in."""

    def _absorbed_query(self, stages: dict[str, np.ndarray]) -> np.ndarray:
        query = np.concatenate([stages["q_nope"], stages["q_pe"]], axis=-1)
        ratio = self.scale / self.sizes.latent_dim ** -0.5
        return (query * query.dtype.type(ratio)).astype(query.dtype, copy=False)


class _LastSlice(numpy_attn.MultiHeadLatentAttention):
    """The absorbed form reads its values from the latent key's last kv_lora_rank dims."""

    def forward(self, x: Any, *, positions: Any = None, mask: Any = None,
                is_causal: bool = False, absorbed: bool = False) -> Any:
        if not absorbed:
            return super().forward(x, positions=positions, mask=mask, is_causal=is_causal)
        x = np.asarray(x)
        stages = self._stages(x, np.arange(x.shape[-2]))
        key = np.concatenate([stages["c"], stages["k_pe"]], axis=-1)
        latent = numpy_attn.scaled_dot_product_attention(
            self._absorbed_query(stages), key, key[..., -self.sizes.kv_lora_rank:], mask=mask,
            is_causal=is_causal)
        return self._out(self._absorbed_output(latent))


def _module(name: str, *, quantize: str = "", cache: Any = None, mla: Any = None
            ) -> types.ModuleType:
    module = types.ModuleType(name)
    module.scaled_dot_product_attention = numpy_attn.scaled_dot_product_attention
    module.quantize_kv = _quantizer(quantize)
    module.dequantize_kv = numpy_attn.dequantize_kv
    module.KVQuantization = numpy_attn.KVQuantization
    module.QuantizedKVCache = cache or numpy_attn.QuantizedKVCache
    module.MultiHeadLatentAttention = mla or numpy_attn.MultiHeadLatentAttention
    return module


#: bug → (the module's arguments, the case that shows it, the diagnosis's name).
PLANTED: dict[str, tuple[dict[str, Any], str, str]] = {
    "per_tensor_scale": ({"quantize": "per_tensor"}, "quant_int4_token",
                         "scale computed per tensor where the scheme says per token"),
    "saturation_skipped": ({"quantize": "no_saturation"}, "quant_fp8_e4m3_head_saturate",
                           "saturation skipped"),
    "ties_away": ({"quantize": "ties_away"}, "quant_int8_group",
                  "rounding half away from zero"),
    "residual_off_by_one": ({"cache": _WiderWindow}, "quant_cache_residual",
                            "residual window off by one"),
    "rope_not_decoupled": ({"mla": _RopeEverywhere}, "mla_naive_absorbed_decode",
                           "rope dims not decoupled"),
    "no_w_uk_fold": ({"mla": _NoFold}, "mla_naive_absorbed_decode",
                     "absorbed query missing the W_UK fold"),
    "wrong_latent_slice": ({"mla": _LastSlice}, "mla_naive_absorbed_decode",
                           "values taken from the wrong latent slice"),
}


def _run(name: str, module: types.ModuleType, cases: list[str], dtypes: tuple[str, ...]
         ) -> Any:
    backends.register(backends.from_module(module, name=name))
    try:
        return runner.run([name], cases, list(dtypes), check_errors=False, hypothesis=0)
    finally:
        backends.unregister(name)


def _names(cell: Any) -> list[str]:
    return [diagnose.short(r) for reasons in cell.reasons for r in diagnose.split(reasons)]


def test_the_module_without_a_mistake_passes() -> None:
    cases = sorted({case for _, case, _ in PLANTED.values()})
    result = _run("planted_none", _module("planted_none"), cases, ("float32",))
    assert {c.case for c in result.cells} == set(cases)
    assert all(c.status == "ok" for c in result.cells), [
        (c.case, c.status, c.detail, [s for s in c.steps if not s.passed])
        for c in result.cells if c.status != "ok"]


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_each_planted_mistake_fails_with_its_diagnosis(bug: str) -> None:
    """The float32 cell fails, every failing step names the mistake, and the headline names it
    alone."""
    kwargs, case, name = PLANTED[bug]
    result = _run(f"planted_{bug}", _module(f"planted_{bug}", **kwargs), [case], ("float32",))
    (cell,) = result.cells
    assert cell.status == "FAIL", (cell.status, cell.detail)
    assert set(_names(cell)) == {name}, cell.reasons
    failed = [s for s in cell.steps if not s.passed]
    assert failed and all(name in (s.note or "") for s in failed), failed
    headline = " ".join(terminal.text(result).split("\n\n")[0].split())
    assert headline == f"FAIL: planted_{bug}: {name} (1 case)", headline
