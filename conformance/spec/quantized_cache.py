"""Quantised KV caches.

Keys and values are stored as int8, int4 or fp8 codes with scales, quantised when they are
appended and dequantised inside attention: attention over a ``QuantizedKVCache`` equals
``scaled_dot_product_attention`` over the dequantised keys and values (and the unquantised
residual window). ``quantize_kv`` / ``dequantize_kv`` are the quantiser on its own,
``KVQuantization`` describes a scheme (written once in ``attention_rules/quantizing.py``,
re-exported by every backend). The expected codes come from an independent float64 quantiser
(``tests/quantized_helpers.py``, used by ``tests/test_quantize_kv.py``); fp8 rounding is
checked against ml_dtypes and torch's float8 casts.
"""

from __future__ import annotations

from typing import Any

#: The schemes, with the libraries each mirrors.
QUANTIZATION_SCHEMES = {
    "int8 / int4, symmetric": "scale = amax / qmax over the group (amax = max |x|; qmax 127 "
    "for int8, 7 for int4); code = clip(round_half_even(x / scale), -qmax, qmax), so the most "
    "negative code (-128, -8) is never used; value = code · scale. Codes int8 (int4: one code "
    "per int8 byte, unpacked; bytes_per_token counts the packed 4 bits)",
    "int8 / int4, with zero points (zero_point=True)": "the group's minimum is the zero point "
    "(a float32, mlx-lm's bias, transformers/quanto's asymmetric groups); scale = (max - min) / "
    "(2^bits - 1); code = clip(round_half_even((x - min) / scale), 0, 2^bits - 1) (uint8); "
    "value = code · scale + min (the product rounded, then the sum). min and max are exact "
    "(code 0 gives min, the top code max up to rounding)",
    "granularity of integer codes": "'group' (default): one scale (and zero point) per token, "
    "per kv head, per group of group_size consecutive channels along head_dim (default 64, "
    "mlx-lm's QuantizedKVCache and transformers' q_group_size; group_size must divide "
    "head_dim), scales (..., kv_heads, n, head_dim / group_size); 'token': one per token per "
    "kv head, scales (..., kv_heads, n, 1). A token's codes depend on that token only, so "
    "quantising tokens together or one by one gives the same codes",
    "fp8 e4m3 / e5m2": "codes float8_e4m3fn (max 448, no inf, NaN 0x7f) or float8_e5m2 (max "
    "57344, IEEE-like with inf); granularity 'tensor' (default: one scale, shape ()) or 'head' "
    "(one per kv head, shape (kv_heads,), amax over every other axis, batch included). A "
    "dynamic scale is amax / fp8_max; a given scale (KVQuantization(scale=...): a number, per "
    "head a tuple of kv_heads numbers, each finite > 0) is vLLM's kv_cache_dtype='fp8' with "
    "k_scale / v_scale (a QuantizedKVCache takes value_scheme for the values' scale). code = "
    "fp8(clip(x / scale, -fp8_max, fp8_max)), value = code · scale",
}

#: The arithmetic, to the bit.
QUANTIZED_ROUNDING = (
    "Every step is float32 in every backend, each operation rounded once (IEEE): x is first "
    "rounded to float32 (float64 inputs lose their extra bits; float16 / bfloat16 are exact); "
    "scale = float32(amax / qmax) (with zero points: float32(float32(max - min) / (2^bits - "
    "1))); the ratio float32(x / scale) (with zero points: float32(float32(x - min) / scale)); "
    "then round half to even (numpy.rint, torch.round, jnp.round) and clip for integer codes, "
    "or clip to ±fp8_max and one cast to fp8 with round-to-nearest-even (subnormals included) "
    "for fp8. Dequantisation: float32(float32(code) · scale) (+ zero point, rounded again), "
    "then rounded once to the array's dtype (quantize_kv's input dtype; the cache's dtype). "
    "The three backends give bitwise-equal codes, scales and dequantised values (jax_attn "
    "keeps the divisions IEEE: XLA on CPU would otherwise divide by a broadcast divisor as a "
    "product with its reciprocal, an ulp off; and keeps a zero point's two roundings under "
    "jax.jit, where XLA's CPU backend would contract the product and the sum into one fused "
    "multiply-add: the product's bits xor the scale's sign bit, which changes no bit, stand "
    "between them). Jitted and eager calls alike."
)

#: Saturation, zeros and non-finite values.
QUANTIZED_SPECIAL_VALUES = (
    "Saturation: fp8 ratios beyond ±fp8_max (±inf included) become ±fp8_max before the cast "
    "(the cast alone differs between libraries: ml_dtypes and jax give NaN for |x| > 464 in "
    "e4m3fn (464 ties to 448), torch saturates to 448; both give inf past e5m2's max); "
    "integer codes are clipped to their range (only a rounding of the scale can push a "
    "ratio past qmax). An all-zero "
    "group, token, head or tensor (scale 0) codes 0 and dequantises to exactly 0 (+0.0; with "
    "zero points: to the zero point, i.e. exactly the group's constant value), never NaN: a "
    "scale of 0 is never divided by. A NaN or ±inf in a group (or in the tensor / head of a "
    "dynamic fp8 scale) makes its scale NaN, its codes 0 and the whole group dequantise to "
    "NaN (never a finite wrong number); with a given fp8 scale a NaN input codes NaN (e4m3fn "
    "0x7f, e5m2's NaN) and dequantises to NaN, ±inf saturates to ±fp8_max · scale."
)

#: The cache, its residual window and its attention.
QUANTIZED_CACHE = (
    "QuantizedKVCache.empty(batch_shape, kv_heads, max_len, head_dim, v_dim=None, *, scheme, "
    "value_scheme=None, dtype='float32', device=None) mirrors KVCache.empty: keys quantised "
    "by scheme, values by value_scheme (default scheme; both must keep the same residual). "
    "append(key, value) takes (..., kv_heads, n, head_dim | v_dim), casts them to the cache's "
    "dtype, then quantises them into the store or holds them in the residual window "
    "(QUANTIZED_RESIDUAL); numpy_attn and torch_attn write in place and return the cache "
    "(torch_attn stores detached values), jax_attn returns a new cache (an immutable pytree "
    "whose lengths are Python ints, static: append runs eagerly; jit a function of the cache "
    "and it compiles once per pair of lengths). A dynamic fp8 scale is calibrated by the "
    "first quantised append (the first append: it always quantises, QUANTIZED_RESIDUAL) and "
    "then kept, as transformers' FP8 cache layer does; later values beyond it saturate (a "
    "given scale avoids depending on the first chunk). Appending past max_len is the "
    "ValueError of CACHE_OVERFLOW, before anything changes. keys / values: the dequantised "
    "store then the residual window, (..., kv_heads, length, dim) in the cache's dtype. "
    "attend(query, *, scale=None, softcap=None, sinks=None): query (..., heads, q_len, "
    "head_dim), the last q_len positions, cast to the cache's dtype, attends keys / values "
    "with the bottom-right causal rule: equal (within SPLIT_DECODING's rounding) to "
    "scaled_dot_product_attention(query, cache.keys, cache.values, is_causal=True, "
    "causal_alignment='bottom_right', ...): quantise on append, dequantise inside attention. "
    "With the default scale and no softcap, a decoding step (at most SPLIT_KV's max_q_len "
    "queries) runs split-KV: numpy_attn and torch_attn widen one part of codes at a time "
    "into a reused buffer just before its product, so no float copy of the cache is made. "
    "In a float32 cache the scales (and zero points) are folded into the products instead "
    "of multiplying every value: a key's score is sum over its channel groups g of "
    "s_g · (codes_g · q_g) (+ z_g · sum(q_g)), a value's share of the output is "
    "(weight · s_g) · codes_g (+ weight · z_g), fp8's per-tensor or per-head scale "
    "multiplies the scores and the output; that reorders float32 roundings only, within "
    "SPLIT_DECODING's rounding of the reference. float16, bfloat16 and float64 caches "
    "attend dequantize_kv's values bit for bit (float16 / bfloat16 rounded), as cache.keys "
    "holds them. jax_attn runs the same split-KV step as one compiled program per cache "
    "shape, its lengths traced (a decoding loop compiles once): the chunks of the store's "
    "max_len positions (those past the filled ones skipped, the unfilled positions masked, "
    "as KVCache's split step does) and the residual window as one more chunk, each chunk's "
    "codes dequantised a part at a time just before its product; it folds no scales (under "
    "XLA the fold took 1.0-1.7x as long): every dtype attends dequantize_kv's values bit for "
    "bit, as an eager cache.keys holds them. "
    "Sizes: stored_length (quantised positions 0..stored_length-1), "
    "residual_length (the last positions), length, max_len, overflowed, nbytes (bytes held; "
    "int4 codes unpacked)."
)

#: When tokens move from the residual window into the quantised store.
QUANTIZED_RESIDUAL = (
    "With residual = R > 0 the most recent tokens may stay unquantised, in the cache's dtype, "
    "by the rule of transformers' QuantizedCache (QuantizedLayer.update, residual_length; "
    "compared update by update with its quanto backend, QUANTIZED_PEERS): an append of n > 0 "
    "tokens to a cache whose window holds r tokens quantises the r window tokens and the n new "
    "ones, in order, and empties the window when the cache is empty (length 0: the first "
    "append, the prompt, is quantised whole, even when n < R) or when r + n >= R; otherwise "
    "the n tokens join the window (r + n < R). So the window holds 0 to R - 1 tokens and "
    "R = 1 behaves as R = 0 (every append quantised). An append of 0 tokens changes nothing. "
    "Two differences, both on transformers' side: its update returns the keys and values for "
    "that step's attention before quantising, so the tokens an update moves into the store "
    "(the whole prompt at the first) are attended once in full precision and quantised from "
    "the next update on, where here append quantises first and attend reads the codes "
    "(quantise on append); and it re-quantises its whole dequantised store at each flush, "
    "where here the flush quantises only the tokens that move and a token's codes never "
    "change once stored (with quanto's per-token groups, axis 0, its re-quantising keeps the "
    "codes and moves a scale by float32 rounding: QUANTIZED_PEERS)."
)

#: What was checked against other libraries, and what could not run here.
QUANTIZED_PEERS = (
    "fp8 rounding: ml_dtypes' float8_e4m3fn / float8_e5m2 casts (NumPy, JAX) and torch's "
    "torch.float8_e4m3fn / float8_e5m2 casts agree bit for bit on a sweep of every fp8 value, "
    "every midpoint between neighbours (ties to even), subnormals, ±0 and values up to fp8_max; "
    "beyond fp8_max they differ (QUANTIZED_SPECIAL_VALUES), which is why the spec clips "
    "first. transformers 5.25's Fp8QuantizedLayer (torch only) runs here: a dynamic "
    "float8_e4m3 'tensor' QuantizedKVCache gives its dequantised keys and values bit for bit "
    "(its scale, too, is calibrated by the first update and kept). transformers 5.25's "
    "QuantizedCache with its quanto backend (optimum-quanto 0.2.7, on the CPU; "
    "requirements-test.txt) is compared: quanto's nbits=4 (qint4, MaxOptimizer) with axis 0 "
    "and q_group_size G groups G consecutive elements of the flattened (batch, kv_heads, seq, "
    "head_dim) cache, so with G dividing head_dim it is KVQuantization('int4', group_size=G, "
    "zero_point=True): scale = (max - min) / 15, code = clip(round_half_even((x + shift) / "
    "scale), 0, 15) with shift = -min, value = code · scale - shift, the same float32 "
    "operations; codes, scales, zero points and values are equal bit for bit in float32 (all "
    "three backends). In float16 / bfloat16 quanto computes each step in the input's dtype, "
    "the project in float32 rounded once at the end: on seeded (1, 2, 32, 64) inputs, G 16, "
    "63 % / 60 % of the values differ (mostly by an ulp), 9 / 80 of 4096 by a code (at most "
    "1.00 / 1.05 steps apart; a step = (max - min) / 15), and the largest error is 0.506 / "
    "0.572 steps in quanto, 0.501 / 0.511 here. The cache (float32, R = 4, G = 16, 189 tokens "
    "in 46 updates) has the same residual window at every update (QUANTIZED_RESIDUAL); the "
    "tokens transformers returns quantised equal this cache's values bit for bit where quanto "
    "quantised them once, 99.6 % of them in all: each flush re-quantises its dequantised "
    "store, whose extremes, rounded, move a scale by float32 rounding (at most 5.4e-6 steps "
    "over 46 updates, the codes unchanged); attention over either differs by 6e-8 of the "
    "output, both up to 0.10 from float32 attention. Not compared: nbits=2 (qint2: the "
    "project has int8 and int4 only); axis -1 (quanto then groups G consecutive rows of the "
    "flattened batch · kv_heads · seq for each channel, KIVI's per-channel keys: groups along "
    "the sequence, possibly across heads, which no scheme here has); G not dividing head_dim "
    "(groups across tokens); a constant group (scale 0: quanto divides 0 by 0 and casts the "
    "NaN to uint8). hqq is not installed here, so transformers' HQQ backend is not compared. "
    "mlx-lm's "
    "QuantizedKVCache (affine, group 64) is the model of zero_point=True; its mx.quantize "
    "picks the scale so that the larger-magnitude edge is exact, so its codes may differ by "
    "one from these."
)

#: The errors (every backend: same type and message, from attention_rules.quantizing).
QUANTIZED_ERRORS = {
    "KVQuantization: dtype not one of 'int8', 'int4', 'float8_e4m3', 'float8_e5m2'; a "
    "granularity the dtype does not take ('group' / 'token' for integer codes, 'tensor' / "
    "'head' for fp8); group_size not an int >= 1; zero_point not a bool, or True with fp8; a "
    "scale with integer codes, not finite > 0, or not a tuple with 'head'; residual not an "
    "int >= 0": "ValueError",
    "quantize_kv: scheme not a KVQuantization; x not float16, bfloat16, float32 or float64 "
    "(a Python list: ARRAY_INPUTS)": "TypeError",
    "quantize_kv: x with fewer than 3 axes or head_dim 0; group_size not dividing head_dim; a "
    "per-head scale whose length is not kv_heads": "ValueError",
    "dequantize_kv: q not a QuantizedArray": "TypeError",
    "QuantizedKVCache.empty: scheme or value_scheme not a KVQuantization": "TypeError",
    "QuantizedKVCache.empty: schemes with different residuals, a group_size not dividing "
    "head_dim / v_dim, a per-head scale not of kv_heads numbers, kv_heads < 1, max_len < 0, "
    "head_dim or v_dim < 1": "ValueError",
    "QuantizedKVCache.append / attend: the errors of KVCache.append (shapes, CACHE_OVERFLOW) "
    "and of scaled_dot_product_attention (query's dtype, shape, heads)": "ValueError / "
    "TypeError as there",
}


def quantize_kv(x: Any, scheme: Any) -> Any:
    """Quantise keys or values by a scheme (``QUANTIZATION_SCHEMES``, ``QUANTIZED_ROUNDING``).

    Args:
      x: ``(..., kv_heads, n, head_dim)``, floating.
      scheme: a ``KVQuantization`` (its ``residual`` belongs to the cache and is unused here).

    Returns:
      a ``QuantizedArray``: codes ``x.shape``, scales (and zero points).
    """


def dequantize_kv(q: Any) -> Any:
    """The values of a ``QuantizedArray``: ``code · scale (+ zero point)``.

    Args:
      q: what ``quantize_kv`` returned, of ``(..., kv_heads, n, head_dim)``.

    Returns:
      ``(..., kv_heads, n, head_dim)`` in the dtype ``quantize_kv`` was given
      (``QUANTIZED_SPECIAL_VALUES`` for scale 0 and NaN).
    """


class KVQuantization:
    """A scheme: ``KVQuantization(dtype="int8", granularity=None, group_size=64,
    zero_point=False, scale=None, residual=0)``, a frozen, hashable dataclass written once in
    attention_rules.quantizing and re-exported by every backend, validated when made
    (``QUANTIZED_ERRORS``). granularity None means the dtype's default ('group' for integer
    codes, 'tensor' for fp8) and reads back as it. Properties: ``is_float8``, ``code_range``
    (lowest and highest code), ``code_dtype`` (the stored codes' dtype name)."""

    def __init__(
        self,
        dtype: str = "int8",
        granularity: str | None = None,
        group_size: int = 64,
        zero_point: bool = False,
        scale: Any = None,
        residual: int = 0,
    ) -> None:
        """See the class."""


class QuantizedArray:
    """What ``quantize_kv`` returns (jax_attn: a pytree whose leaves are the arrays).

    Attributes: ``codes (..., kv_heads, n, head_dim)`` of ``scheme.code_dtype``; ``scales``
    float32, ``(..., kv_heads, n, groups)`` for integer codes, ``()`` or ``(kv_heads,)`` for
    fp8; ``zero_points`` like ``scales`` with zero points, else None; ``scheme``; ``dtype``
    (the dtype name ``dequantize_kv`` returns); ``shape`` (``codes.shape``).
    """


class QuantizedKVCache:
    """A KV cache of codes and scales, with an optional unquantised residual window
    (``QUANTIZED_CACHE``, ``QUANTIZED_RESIDUAL``).

    Attributes (read-only): ``keys`` / ``values`` (dequantised, then the window), ``length``,
    ``stored_length``, ``residual_length``, ``max_len``, ``overflowed``, ``nbytes``.
    """

    @classmethod
    def empty(
        cls,
        batch_shape: tuple,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        v_dim: int | None = None,
        *,
        scheme: Any,
        value_scheme: Any = None,
        dtype: Any = "float32",
        device: Any = None,
    ) -> Any:
        """An empty cache of ``max_len`` positions ``(*batch_shape, kv_heads, *, head_dim |
        v_dim)``; ``dtype`` and ``device`` as in ``KVCache.empty``."""

    def append(self, key: Any, value: Any) -> Any:
        """Add ``key (..., kv_heads, n, head_dim)`` and ``value (..., kv_heads, n, v_dim)``:
        quantised, or held in the residual window (``QUANTIZED_RESIDUAL``). Returns the cache
        (see ``DECODING``)."""

    def attend(
        self,
        query: Any,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: Any = None,
    ) -> Any:
        """``query (..., heads, q_len, head_dim)`` over the dequantised keys and values and
        the window, bottom-right causal: ``(..., heads, q_len, v_dim)``."""
