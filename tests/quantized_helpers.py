"""What the quantised-cache tests share (``test_quantized_cache.py``,
``test_quantized_cache_transformers.py``, ``test_dequantizing_attention.py``,
``test_dequantizing_attention_jax.py``): the schemes, the seeded keys with their edge cases, and
the float64 attention the decoding steps are checked against."""

from __future__ import annotations

import numpy as np

from attention_rules.quantizing import KVQuantization

SHAPE = (2, 3, 5, 128)  # (batch, kv_heads, n, head_dim): one shape, few jax compiles

SCHEMES = [
    KVQuantization("int8"),
    KVQuantization("int8", granularity="token"),
    KVQuantization("int8", zero_point=True, group_size=32),
    KVQuantization("int4"),
    KVQuantization("int4", zero_point=True),
    KVQuantization("int4", granularity="token", zero_point=True),
    KVQuantization("float8_e4m3"),
    KVQuantization("float8_e4m3", granularity="head"),
    KVQuantization("float8_e5m2"),
    KVQuantization("float8_e5m2", granularity="head", scale=(0.01, 0.5, 2.0)),
    KVQuantization("float8_e4m3", scale=0.005),
]
IDS = [f"{s.dtype}-{s.granularity}{'-zp' if s.zero_point else ''}"
       f"{'-given' if s.scale is not None else ''}" for s in SCHEMES]


def seeded_keys(seed: int = 0, shape: tuple = SHAPE) -> np.ndarray:
    """Seeded float32 keys with edge cases: an all-zero group, a constant group, a tie."""
    x = (np.random.default_rng(seed).standard_normal(shape) * 3).astype(np.float32)
    x[0, 0, 0, :64] = 0.0  # an all-zero group (of 64, of 32)
    x[0, 0, 1, 64:] = -1.25  # a constant group
    x[1, 2, 3, :] = np.linspace(-127, 127, shape[-1]).astype(np.float32)  # ties at qmax = 127
    return x


def reference_attention(query, keys, values, sinks=None) -> np.ndarray:
    """float64 softmax attention of the last query rows: bottom-right causal, grouped heads,
    optional ``(heads,)`` sinks."""
    q, k, v = (np.asarray(a, np.float64) for a in (query, keys, values))
    groups = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, groups, axis=-3), np.repeat(v, groups, axis=-3)
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    q_len, kv_len = scores.shape[-2:]
    allowed = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + kv_len - q_len
    scores = np.where(allowed, scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, np.asarray(sinks, np.float64)[:, None, None])
    weights = np.exp(scores - top)
    total = weights.sum(-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(np.asarray(sinks, np.float64)[:, None, None] - top)
    return (weights / total) @ v
