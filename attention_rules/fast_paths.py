"""The constants of every backend's fast-path selection rule (``<backend>/_fast.py``).

``FAST_PATHS[backend][path]`` holds the numbers ``use_fast_path`` of that backend compares
with; ``conformance/spec/constants.py`` shows the same dict as ``FAST_PATHS`` and explains each
key in ``FAST_PATH_RULES``. A fast path computes the same pipeline as the explicit steps and equals
them within the dtype's rounding; it is never taken for ``return_weights=True``, for dropout,
or when an axis is empty.

``TUNING[backend]`` lists the candidates a backend's tuner times on the machine at hand (the
first call of a shape class; ``<backend>/_fast/tuning.py``), and ``tuning_cache_folder`` where
it keeps what it chose. The numbers of ``FAST_PATHS`` stay the fixed table: the fallback, and
what runs with ``ATTENTION_TUNING=off``. A choice never changes what is computed, only its
rounding (``spec.FAST_PATH_RULES["tuning"]``).
"""

from __future__ import annotations

import math
import os

from .checks import Shape

FAST_PATHS = {
    "numpy_attn": {
        # the pipeline per block of block_q queries, on a thread pool; its VJP per block of
        # block_kv keys against at most block_q_backward queries at a time; the scores'
        # product as keys @ queriesᵀ (keys_first) or queries @ keysᵀ, per pass
        "blocked": {
            "block_q": 128, "block_kv": 128, "block_q_backward": 512, "min_scores": 1 << 20,
            "min_q_len": 64, "keys_first": False, "keys_first_backward": True,
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


# The candidates each tuner times, per shape class, in a few trial calls of the fast path.
TUNING = {
    "numpy_attn": {
        # forward: queries per block, the exponential unit (exp, or exp2 on scores in units
        # of log2 e) and the scores' product order; backward: (keys per task, queries per
        # tile) and the tiles' product order
        "block_q": (64, 128, 256),
        "exp2": (False, True),
        "keys_first": (False, True),
        "backward_tiles": ((128, 512), (64, 512), (256, 256), (256, 512), (512, 256)),
    },
}

# The environment variable that switches tuning off ("off"), forces a table ("block_q=64,
# exp2=1,...") or the fixed table's alternate ("alternate"); and the one that moves its cache.
TUNING_ENV = "ATTENTION_TUNING"
TUNING_CACHE_ENV = "ATTENTION_TUNING_CACHE"


def tuning_cache_folder() -> str:
    """The folder of the tuners' cache files: ``$ATTENTION_TUNING_CACHE``, else ``tuning`` in
    the project's cache folder, beside JAX's persistent compilation cache
    (``$XDG_CACHE_HOME/attention-three-ways/``, ``~/.cache/attention-three-ways/`` by
    default)."""
    folder = os.environ.get(TUNING_CACHE_ENV)
    if folder:
        return folder
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "attention-three-ways", "tuning")


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
