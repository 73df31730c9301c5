"""Paged-decoding inputs and checks that the decoding-kernel tests share
(``test_numpy_decoding_kernel.py``, ``test_torch_decoding_kernel.py``, ``test_jax_paged_cache.py``):
the same problem, the same expected values (the float64 reference), and the same error messages in
every backend."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conformance.cases import reference


def paged_inputs(dtype: Any = np.float32) -> dict:
    """One sequence of 3 positions on page 1 of a pool of 2 pages of 4 positions; 2 query
    heads over 1 kv head; its float64 keys and values too."""
    rng = np.random.default_rng(9)
    keys, values = rng.standard_normal((1, 3, 2)), rng.standard_normal((1, 3, 3))
    key_pages, value_pages = np.zeros((2, 4, 1, 2), dtype), np.zeros((2, 4, 1, 3), dtype)
    key_pages[1, :3], value_pages[1, :3] = keys.swapaxes(0, 1), values.swapaxes(0, 1)
    return {"query": rng.standard_normal((1, 2, 1, 2)).astype(dtype), "key_pages": key_pages,
            "value_pages": value_pages, "block_table": np.array([[1, 0]], np.int32),
            "seq_lens": np.array([3], np.int32), "keys": keys, "values": values}


def far_apart_rows() -> tuple[np.ndarray, np.ndarray, np.ndarray, Any]:
    """Query (2, 1, 4), key (1, 6, 4), value (1, 6, 2): two query heads of one kv head whose
    largest scores are hundreds apart; and the float64 reference, causal bottom-right."""
    rng = np.random.default_rng(11)
    query = rng.standard_normal((2, 1, 4)) * np.array([[[200.0]], [[0.1]]])
    key, value = rng.standard_normal((1, 6, 4)) * 4.0, rng.standard_normal((1, 6, 2))
    assert np.ptp((query[:, 0] @ key[0].T).max(-1)) / 2 > 200  # scale 1/2: rows far apart
    return query, key, value, reference.attention(query, key, value, is_causal=True,
                                                  causal_alignment="bottom_right")


def check_paged_cache_errors(backend: str) -> None:
    """``backend``'s (``"numpy"`` or ``"torch"``) paged cache and ``paged_attention`` name the
    method and the argument in every error, and a refused append changes nothing."""
    module = pytest.importorskip(f"{backend}_attn")
    if backend == "torch":
        import torch

        def array(x: Any) -> Any:
            return torch.from_numpy(np.asarray(x))
    else:
        array = np.asarray
    cache = module.PagedKVCache(2, 2, 1, 2)
    with pytest.raises(ValueError, match=r"^PagedKVCache\.append: keys and values must be "
                                         r"\(batch, kv_heads, n, head_dim \| v_dim\) = \(0, 1, n"):
        cache.append(array(np.float32(0)), array(np.float32(0)))  # no batch axis: no sequence
    with pytest.raises(ValueError, match=r"^PagedKVCache\.append: keys and values must be"):
        cache.append(array(np.zeros((1, 1, 1, 3))), array(np.zeros((1, 1, 1, 2))))
    with pytest.raises(ValueError, match=r"^PagedKVCache\.append: seqs must be sequence ids"):
        cache.append(array(np.zeros((1, 1, 1, 2))), array(np.zeros((1, 1, 1, 2))), [-1])
    with pytest.raises(ValueError, match=r"^PagedKVCache\.append: the pool is full"):
        cache.append(array(np.zeros((1, 1, 9, 2))), array(np.zeros((1, 1, 9, 2))))
    with pytest.raises(ValueError, match=r"^PagedKVCache\.tables: seqs must be sequence ids"):
        cache.tables([-1])
    assert cache.num_free_blocks == 2  # nothing changed
    raw = paged_inputs()
    args = {name: array(x) for name, x in raw.items() if name not in ("keys", "values")}
    with pytest.raises(ValueError, match=r"^paged_attention: sinks"):
        module.paged_attention(**args, sinks=array(np.zeros(3, np.float32)))
    with pytest.raises(TypeError, match=r"^paged_attention: inputs must share one dtype"):
        module.paged_attention(**{**args, "query": array(raw["query"].astype(np.float16))})


def constructor_errors(device: tuple[str, str]) -> list[tuple[dict, type, str]]:
    """``PagedKVCache``'s bad constructor arguments, each with its exception and message
    (after ``"PagedKVCache: "``); ``device``: the backend's bad device and its message."""
    return [
        ({"num_blocks": 0}, ValueError, "num_blocks must be an int >= 1; got num_blocks=0"),
        ({"block_size": 0}, ValueError, "block_size must be an int >= 1; got block_size=0"),
        ({"kv_heads": 0}, ValueError, "kv_heads must be an int >= 1; got kv_heads=0"),
        ({"head_dim": -1}, ValueError, "head_dim must be an int >= 0; got head_dim=-1"),
        ({"v_dim": -1}, ValueError, "v_dim must be an int >= 0; got v_dim=-1"),
        ({"device": device[0]}, ValueError, device[1]),
        ({"dtype": "int32"}, TypeError,
         "dtype must be float16, bfloat16, float32 or float64; got dtype.dtype=int32"),
    ]
