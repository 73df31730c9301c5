"""Chunked local attention, ALiBi, segment ids, ``score_mod`` and ``mask_mod``
(``spec.MASKS_AND_MODS``) on the fast paths and under JAX's transformations, on one case large
enough for several blocks of 8: every backend's fast path gives the float64 reference's
results, and the tiles these rules empty are never computed (a recording ``score_mod`` sees
which tiles were); ``jit``, ``vmap`` and ``grad`` with the callables as static arguments. A
planted bug (a blocked path that ignores ``mask_mod``) is run through the same check, which must
reject it. The explicit steps, the tiles and the VJPs on the small cases, the errors and the
other planted bugs are ``tests/test_masks_and_mods.py``'s, whose arrays and checks these reuse.
"""

from __future__ import annotations

import numpy as np
import pytest
from masks_reference import expected, relative_bias_table, rules_as_mask_and_bias
from test_masks_and_mods import (
    ATOL,
    GRAD_OUT,
    KEY,
    QUERY,
    REL_TABLE,
    SLOPES,
    VALUE,
    B,
    H,
    K,
    Q,
    _close,
)

from conformance import backends

# ------------------------------------------------------------------------------------------
# The fast paths: the same results, and the tiles these rules empty are never computed
# ------------------------------------------------------------------------------------------

# big enough for several blocks of 8: batch 1, 4 heads over 2, 40 queries, 56 keys
_F = np.random.default_rng(7)
FQ, FK, FV = (_F.standard_normal((1, 4, 40, 8)), _F.standard_normal((1, 2, 56, 8)),
              _F.standard_normal((1, 2, 56, 3)))
FG = _F.standard_normal((1, 4, 40, 3))
F_IDS = (np.repeat(np.arange(4), 10)[None], np.repeat(np.arange(4), 14)[None])  # 4 documents
F_TABLE = np.zeros((4, 40, 56), bool)
F_TABLE[:, :20, :16] = F_TABLE[:, 20:, 40:] = True  # two blocks: most tiles empty
F_TABLE[1, 5] = False  # a fully masked row in head 1


def _fast_case(backend, with_score_mod=True):
    """The fast paths' case: chunks (bottom-right, causal), segment ids, ALiBi and a
    mask_mod table, and (``with_score_mod``) a relative bias score_mod; its reference."""
    table = backend.asarray(F_TABLE)
    options = {"chunk_size": 24, "is_causal": True, "causal_alignment": "bottom_right",
               "segment_ids": tuple(backend.asarray(x) for x in F_IDS),
               "alibi_slopes": backend.asarray(SLOPES), "mask_mod": lambda b, h, q, k:
               table[h, q, k]}
    bias_table = None
    if with_score_mod:
        options["score_mod"] = backend.module.masks.relative_bias_mod(backend.asarray(REL_TABLE),
                                                                      56 - 40)
        bias_table = relative_bias_table(REL_TABLE, 40, 56, 56 - 40)
    mask, bias = rules_as_mask_and_bias(1, 4, 40, 56, causal_alignment="bottom_right",
                                        chunk_size=24, alibi_slopes=SLOPES, segment_ids=F_IDS,
                                        mask_table=F_TABLE, bias_table=bias_table)
    want = expected(FQ, FK, FV, FG, mask, bias, is_causal=True, causal_alignment="bottom_right")
    return options, want, mask & np.tril(np.ones((40, 56), bool), k=56 - 40)  # with causality


def _spy(monkeypatch, module, name):
    """Record ``(arguments, result)`` of every call of ``module.name``."""
    calls = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append((args, result))
        return result

    monkeypatch.setattr(module, name, spy)
    return calls


class _Recording:
    """A relative-bias score_mod that records the (query, key) positions of every tile it is
    called on: only computed tiles call it."""

    def __init__(self, masks, backend):
        self.mod = masks.relative_bias_mod(backend.asarray(REL_TABLE), 56 - 40)
        self.backend, self.seen = backend, np.zeros((40, 56), bool)

    def __call__(self, score, b, h, q, k):
        q_idx, k_idx = (self.backend.to_numpy(x).reshape(-1) for x in (q, k))
        self.seen[np.ix_(q_idx, k_idx)] = True
        return self.mod(score, b, h, q, k)

    def derivative(self, score, b, h, q, k):
        return self.mod.derivative(score, b, h, q, k)


def _computed_within(recording, mask, block):
    """Every position the tiles computed lies in a ``block``-sized tile with an allowed
    position, and far fewer than all were computed."""
    allowed = mask.any(axis=(0, 1))
    tiles = np.add.reduceat(np.add.reduceat(allowed, np.arange(0, 40, block), 0),
                            np.arange(0, 56, block), 1) > 0
    covered = np.kron(tiles, np.ones((block, block), bool))[:40, :56]
    assert not (recording.seen & ~covered).any(), "an empty tile was computed"
    assert recording.seen.mean() < 0.5, recording.seen.mean()


def test_numpy_fast_path_and_its_vjp_skip_what_the_rules_mask(monkeypatch):
    import numpy_attn as na
    from numpy_attn import _blocked, _fast, masks
    for name, value in (("BLOCK_Q", 8), ("BLOCK_KV", 8), ("BLOCK_Q_BACKWARD", 16),
                        ("MIN_SCORES", 0), ("MIN_Q_LEN", 8)):
        monkeypatch.setattr(_fast, name, value)
    backend = backends.get("numpy")
    options, want, mask = _fast_case(backend)
    calls = _spy(monkeypatch, _blocked, "blocked_attention")
    out, lse = na.scaled_dot_product_attention(FQ, FK, FV, return_lse=True, **options)
    grads = na.scaled_dot_product_attention_vjp(FQ, FK, FV, FG, **options)
    assert len(calls) == 2  # the forward pass and the VJP's
    _close("output", out, backend, want)
    _close("lse", lse, backend, want)
    for name, x in zip(("grad_query", "grad_key", "grad_value"), grads, strict=False):
        _close(name, x, backend, want)
    recording = _Recording(masks, backend)
    na.scaled_dot_product_attention(FQ, FK, FV, **{**options, "score_mod": recording})
    _computed_within(recording, mask, 8)
    recording = _Recording(masks, backend)  # blockwise: tiles of 8
    na.blockwise_attention_vjp(FQ, FK, FV, FG, block_q=8, block_kv=8,
                               **{**options, "score_mod": recording})
    _computed_within(recording, mask, 8)


def test_torch_fast_paths_skip_what_the_rules_mask(monkeypatch):
    torch = pytest.importorskip("torch", reason="pip install torch")
    import torch_attn as ta
    from torch_attn import _blocked, _fast, masks
    for name, value in (("BLOCK_Q", 8), ("BLOCK_KV", 8), ("SDPA_ROWS", 8), ("SDPA_KEYS", 8),
                        ("MIN_SCORES", 0), ("MIN_Q_LEN", 1)):
        monkeypatch.setattr(_fast, name, value)
    backend = backends.get("torch")
    for with_score_mod, path in ((False, "sdpa_blocks"), (True, "blocked")):
        options, want, mask = _fast_case(backend, with_score_mod)
        calls = _spy(monkeypatch, *((_fast, "_sdpa_blocks") if path == "sdpa_blocks" else
                                    (_blocked, "blocked_attention")))
        q, k, v = (torch.tensor(x, requires_grad=True) for x in (FQ, FK, FV))
        out = ta.scaled_dot_product_attention(q, k, v, **options)
        out.backward(torch.tensor(FG))
        assert calls, path
        _close("output", out, backend, want)
        for name, x in zip(("grad_query", "grad_key", "grad_value"), (q, k, v), strict=True):
            _close(name, x.grad, backend, want)
    sdpa = _spy(monkeypatch, _fast.F, "scaled_dot_product_attention")
    ta.scaled_dot_product_attention(*(torch.tensor(x) for x in (FQ, FK, FV)),
                                    **_fast_case(backend, False)[0])
    assert sum(a[0].shape[-2] * a[1].shape[-2] for a, _ in sdpa) < 0.5 * 40 * 56  # keys skipped
    recording = _Recording(masks, backend)  # the tiles, forward and backward
    options, _, mask = _fast_case(backend)
    q = torch.tensor(FQ, requires_grad=True)
    ta.blockwise_attention(q, torch.tensor(FK), torch.tensor(FV), block_q=8, block_kv=8,
                           **{**options, "score_mod": recording}).sum().backward()
    _computed_within(recording, mask, 8)


def test_jax_fast_path_and_blockwise_skip_what_the_rules_mask(monkeypatch):
    jax = pytest.importorskip("jax", reason="pip install jax")
    import jax_attn as ja
    from jax_attn import _extras, _fast, blockwise
    for name, value in (("BLOCK_Q", 8), ("BLOCK_KV", 8), ("MIN_SCORES", 0), ("MIN_Q_LEN", 8),
                        ("BLOCKED_PLATFORMS", (jax.default_backend(),))):
        monkeypatch.setattr(_fast, name, value)
    backend = backends.get("jax")
    options, want, mask = _fast_case(backend)
    calls = _spy(monkeypatch, _fast, "_blocked_attention_lse")
    segments = _spy(monkeypatch, _extras, "_mods_segments")
    q, k, v, g = (backend.asarray(x) for x in (FQ, FK, FV, FG))
    out, lse = jax.jit(lambda q, k, v: ja.scaled_dot_product_attention(
        q, k, v, return_lse=True, **options))(q, k, v)
    grads = jax.jit(lambda q, k, v, g: ja.scaled_dot_product_attention_vjp(
        q, k, v, g, **options))(q, k, v, g)
    assert calls and segments
    _close("output", out, backend, want)
    _close("lse", lse, backend, want)
    for name, x in zip(("grad_query", "grad_key", "grad_value"), grads, strict=False):
        _close(name, x, backend, want)
    # the static segments cover every allowed position and far fewer than all positions
    covered = np.zeros((40, 56), bool)
    for r0, r1, k0, k1 in next(result for args, result in segments if args[5]):  # by queries
        covered[r0:r1, k0:k1] = True
    assert not (mask.any(axis=(0, 1)) & ~covered).any() and covered.mean() < 0.5
    plans = _spy(monkeypatch, blockwise, "_prepare")  # the scan's tiles: only those with a key
    ja.blockwise_attention(q, k, v, block_q=8, block_kv=8, **options)
    starts = plans[0][1][2].starts
    assert 0 < len(starts) < 0.5 * 5 * 7


# ------------------------------------------------------------------------------------------
# JAX: jit, vmap and grad with the callables as static arguments
# ------------------------------------------------------------------------------------------


def test_jax_jit_vmap_and_grad():
    jax = pytest.importorskip("jax", reason="pip install jax")
    import jax_attn as ja
    from jax_attn import masks

    backend = backends.get("jax")
    _ = backend.module  # float64 on, as for every jax test of the harness
    options, want, _ = _fast_case(backend)
    ids = options.pop("segment_ids")
    q, k, v, g = (backend.asarray(x) for x in (FQ, FK, FV, FG))

    def attend(q, k, v, q_ids, kv_ids):
        return ja.scaled_dot_product_attention(q, k, v, segment_ids=(q_ids, kv_ids), **options)

    _close("output", jax.jit(attend)(q, k, v, *ids), backend, want)  # ids traced
    per_example = jax.vmap(attend)(q, k, v, *ids)  # over the batch axis
    _close("output", per_example, backend, want)
    grad = jax.jit(jax.grad(lambda q: (attend(q, k, v, *ids) * g).sum()))(q)
    _close("grad_query", grad, backend, want)
    static = jax.jit(ja.scaled_dot_product_attention, static_argnames=(
        "chunk_size", "score_mod", "mask_mod", "is_causal", "causal_alignment"))
    mod = masks.chunked_mod(3, K - Q)
    out = static(*(backend.asarray(x) for x in (QUERY, KEY, VALUE)), mask_mod=mod,
                 is_causal=True, causal_alignment="bottom_right")
    mask, bias = rules_as_mask_and_bias(B, H, Q, K, chunk_size=3, causal_alignment="bottom_right")
    want = expected(QUERY, KEY, VALUE, GRAD_OUT, mask, bias, is_causal=True,
                    causal_alignment="bottom_right")
    np.testing.assert_allclose(np.asarray(out), want["output"], rtol=0, atol=ATOL)


# ------------------------------------------------------------------------------------------
# A planted bug: the check above rejects it
# ------------------------------------------------------------------------------------------


def test_planted_blocked_path_ignoring_mask_mod_is_caught(monkeypatch):
    import numpy_attn as na
    from numpy_attn import _blocked, _fast
    for name, value in (("BLOCK_Q", 8), ("BLOCK_KV", 8), ("MIN_SCORES", 0), ("MIN_Q_LEN", 8)):
        monkeypatch.setattr(_fast, name, value)
    backend, table = backends.get("numpy"), F_TABLE
    mask, bias = rules_as_mask_and_bias(1, 4, 40, 56, mask_table=table)
    want = expected(FQ, FK, FV, FG, mask, bias)
    options = {"mask_mod": lambda b, h, q, k: table[h, q, k]}
    _close("output", na.scaled_dot_product_attention(FQ, FK, FV, **options), backend, want)
    original = _blocked._mods_statuses  # the bug: the blocks forget mask_mod
    monkeypatch.setattr(_blocked, "_mods_statuses", lambda mods, *rest: original(
        mods._replace(mask_mod=None), *rest))
    with pytest.raises(AssertionError, match="output"):
        _close("output", na.scaled_dot_product_attention(FQ, FK, FV, **options), backend, want)
