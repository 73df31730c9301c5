"""The constants of every backend's fast-path selection rule (``<backend>/_fast.py``).

``FAST_PATHS[backend][path]`` holds the numbers ``use_fast_path`` of that backend compares
with; ``conformance/spec/constants.py`` shows the same dict as ``FAST_PATHS`` and explains each
key in ``FAST_PATH_RULES``. A fast path computes the same pipeline as the explicit steps and equals
them within the dtype's rounding; it is never taken for ``return_weights=True``, for dropout,
or when an axis is empty.
"""

from __future__ import annotations

import math

from .checks import Shape

FAST_PATHS = {
    "numpy_attn": {
        # the pipeline per block of block_q queries, on a thread pool; its VJP per block of
        # block_kv keys against at most block_q_backward queries at a time
        "blocked": {
            "block_q": 128, "block_kv": 128, "block_q_backward": 512, "min_scores": 1 << 20,
            "min_q_len": 64,
        },
    },
    "jax_attn": {
        # jax.nn.dot_product_attention(implementation="cudnn"): GPU, half dtypes only
        "cudnn": {"platforms": ("gpu", "cuda"), "dtypes": ("float16", "bfloat16")},
        # lax.map over blocks of block_q queries (up to 4x as many while a block's scores stay
        # within block_scores entries), in at most `segments` static key ranges
        "blocked": {
            "platforms": ("cpu",), "block_q": 128, "block_kv": 128, "block_scores": 1 << 19,
            "segments": 4, "min_scores": 1 << 20, "min_q_len": 256,
        },
    },
    "torch_attn": {
        # torch.nn.functional.scaled_dot_product_attention, for finite query and key
        "sdpa": {},
        # blockwise tiles with the online softmax: softcap, window, bottom-right q_len != kv_len
        "blocked": {
            "block_q": 256, "min_scores": 1 << 20, "min_q_len": 64, "max_tile_fraction": 0.25,
        },
    },
}


def has_empty_axis(*shapes: Shape) -> bool:
    """Whether any of the shapes has an axis of size 0 (no fast path is worth a kernel)."""
    return any(0 in tuple(shape) for shape in shapes)


def large_enough(
    q_shape: Shape, k_shape: Shape, v_shape: Shape, min_scores: int, min_q_len: int
) -> bool:
    """No empty axis, at least ``min_q_len`` queries and ``min_scores`` score entries
    ``(..., heads, q_len) × kv_len``: below that, the explicit path is as fast."""
    if has_empty_axis(q_shape, k_shape, v_shape) or q_shape[-2] < min_q_len:
        return False
    return math.prod(q_shape[:-1]) * k_shape[-2] >= min_scores
