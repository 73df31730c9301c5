"""Steps made of several calls of an implementation: merging partial attentions over split keys
(``merge`` cases), as split-KV decoding, context parallelism and cascade attention do, and
decoding from the implementation's own paged KV cache (``paged`` cases).

``merged(backend, exp)`` computes each part of a merge case (``case_inputs.key_parts``) with
the implementation's own ``scaled_dot_product_attention(..., return_lse=True)`` — without the
sinks, which ``spec.MERGING`` applies once, in the merge — and merges the partial outputs and
lses with its own ``merge_attention``. On a backend that compiles (JAX) the whole composition
is one compiled program per case and dtype. Its result is compared with the float64 attention
over every key (``expected``), so a wrong partial lse, a wrong merge or a sink applied twice
all show.

``paged_cache(backend, exp)`` fills the implementation's ``PagedKVCache`` (``spec.PAGED_CACHE``)
with each sequence's keys — a sequence of garbage (1e4) first, freed again, so the real pages
reuse its pages — appending each sequence in two pieces (across a page boundary), and attends
the case's queries with ``attend``. It runs eagerly: the cache's bookkeeping is Python.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..cases.expected import Expected
from ..cases.inputs import contiguous, key_parts, sdpa_options
from .backends import Backend

#: A checked module's call that fails on a keyword it does not take: the keyword → the
#: ``spec.PLUGIN_FEATURES`` name it should declare instead.
_KEYWORD_FEATURES = {"sinks": "sinks", "return_lse": "lse", "chunk_size": "chunked",
                     "alibi_slopes": "alibi", "segment_ids": "segments",
                     "score_mod": "score_mod", "mask_mod": "mask_mod"}


def keyword_hint(message: str) -> str:
    """For the error of a call given a keyword it does not take (``sinks``, ``return_lse``):
    the contract's way out, ``declare UNSUPPORTED = {'lse'}``; "" for any other error."""
    for keyword, feature in _KEYWORD_FEATURES.items():
        if f"'{keyword}'" in message and "keyword" in message:
            return (f"a module without {keyword} declares it: UNSUPPORTED = {{'{feature}', ...}} "
                    f"(docs/checking.md)")
    return ""


def to_backend(backend: Backend, x: Any) -> Any:
    """NumPy arrays → the backend's arrays, inside lists, tuples and dicts too."""
    if isinstance(x, np.ndarray):
        return backend.asarray(x)
    if isinstance(x, (list, tuple)):
        return type(x)(to_backend(backend, v) for v in x)
    if isinstance(x, dict):
        return {k: to_backend(backend, v) for k, v in x.items()}
    return x


def pair(result: Any, what: str) -> tuple[Any, Any]:
    """``result`` as ``(output, lse)``; ValueError naming ``what`` returned something else."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        got = (f"{len(result)} results" if isinstance(result, (tuple, list))
               else f"one {type(result).__name__}")
        raise ValueError(f"{what} returned {got}, not the pair (output, lse)")
    return result[0], result[1]


def _composition(module: Any, options: dict[str, Any]) -> Callable[..., Any]:
    def merged(query: Any, parts: list[dict[str, Any]], extra: dict[str, Any]) -> Any:
        outputs, lses = [], []
        for part in parts:
            arrays = {k: v for k, v in part.items() if k not in ("key", "value")}
            out, lse = pair(module.scaled_dot_product_attention(
                query, part["key"], part["value"], **arrays, **options, return_lse=True),
                "scaled_dot_product_attention(..., return_lse=True)")
            outputs.append(out)
            lses.append(lse)
        return pair(module.merge_attention(outputs, lses, **extra), "merge_attention")

    return merged


def merged(backend: Backend, exp: Expected) -> tuple[np.ndarray, np.ndarray]:
    """A merge case on ``backend``: ``(output (..., heads, q_len, v_dim), lse (..., heads,
    q_len))`` of ``merge_attention`` over the parts' own ``scaled_dot_product_attention``."""
    a, o = exp.data.arrays, exp.data.options
    parts = key_parts(a, o["parts"])
    options = sdpa_options(o)
    extra = {"sinks": a["sinks"]} if "sinks" in a else {}
    module = backend.module
    key = ("merge", tuple(p["key"].shape[-2] for p in parts), tuple(sorted(parts[0])),
           tuple(sorted(options.items())), tuple(extra),
           id(module.scaled_dot_product_attention), id(module.merge_attention))
    fn = backend.compiled(key, lambda: _composition(module, options))
    try:
        out, lse = fn(to_backend(backend, a["query"]), to_backend(backend, parts),
                      to_backend(backend, extra))
    except Exception as exc:  # noqa: BLE001 - re-raised, with the contract's way out if any
        hint = keyword_hint(str(exc))
        if not hint:
            raise
        raise TypeError(f"{exc}; {hint}") from exc
    return backend.to_numpy(out), backend.to_numpy(lse)


def paged_arguments(exp: Expected, return_lse: bool = False
                    ) -> tuple[tuple[np.ndarray, ...], dict[str, Any]]:
    """``paged_attention``'s arguments for a paged case: ``(query, key_pages, value_pages,
    block_table, seq_lens)`` and the keywords (``scale``, ``softcap``, ``sinks``,
    ``return_lse``)."""
    a, o = exp.data.arrays, exp.data.options
    kwargs: dict[str, Any] = {k: v for k, v in o.items() if k in ("scale", "softcap")}
    if "sinks" in a:
        kwargs["sinks"] = a["sinks"]
    if return_lse:
        kwargs["return_lse"] = True
    names = ("query", "key_pages", "value_pages", "block_table", "seq_lens")
    return tuple(a[n] for n in names), kwargs


def paged_cache(backend: Backend, exp: Expected) -> np.ndarray:
    """A paged case decoded from the implementation's own ``PagedKVCache``: ``(batch, heads,
    q_len, v_dim)``."""
    a, o = exp.data.arrays, exp.data.options
    whole = contiguous(a)  # (batch, kv_heads, kv_len, ·) in the case's dtype
    keys, values, lens = whole["key"], whole["value"], [int(n) for n in a["seq_lens"]]
    num_blocks, block_size, kv_heads, head_dim = a["key_pages"].shape
    module = backend.module
    cache = module.PagedKVCache(num_blocks, block_size, kv_heads, head_dim,
                                a["value_pages"].shape[-1], dtype=exp.dtype)
    dirty = min(num_blocks, 2) * block_size  # pages that come back to the free list, dirty
    cache = cache.append(*(backend.asarray(np.full((1, kv_heads, dirty, x.shape[-1]), 1e4,
                                                   x.dtype)) for x in (keys, values)),
                         [len(lens)])
    cache = cache.free(len(lens))
    for b, n in enumerate(lens):
        for start, stop in ((0, (n + 1) // 2), ((n + 1) // 2, n)):  # across a page boundary
            if stop > start:
                cache = cache.append(*(backend.asarray(np.ascontiguousarray(
                    x[b:b + 1, :, start:stop])) for x in (keys, values)), [b])
    extra = {"sinks": backend.asarray(a["sinks"])} if "sinks" in a else {}
    out = cache.attend(backend.asarray(a["query"]), list(range(len(lens))),
                       **{k: v for k, v in o.items() if k in ("scale", "softcap")}, **extra)
    return backend.to_numpy(out)


__all__ = ["keyword_hint", "merged", "paged_arguments", "paged_cache", "pair", "to_backend"]
