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

from conformance.running import backends

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
    from numpy_attn import _fast, masks
    for name, value in (("BLOCK_Q", 8), ("BLOCK_KV", 8), ("BLOCK_Q_BACKWARD", 16),
                        ("MIN_SCORES", 0), ("MIN_Q_LEN", 8)):
        monkeypatch.setattr(_fast, name, value)
    backend = backends.get("numpy")
    options, want, mask = _fast_case(backend)
    calls = _spy(monkeypatch, _fast.forward, "blocked_attention")
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
    from torch_attn import _fast, masks
    for name, value in (("BLOCK_Q", 8), ("BLOCK_KV", 8), ("MIN_SCORES", 0), ("MIN_Q_LEN", 1)):
        monkeypatch.setattr(_fast, name, value)
    for name, value in (("SDPA_ROWS", 8), ("SDPA_KEYS", 8)):
        monkeypatch.setattr(_fast.sdpa, name, value)
    backend = backends.get("torch")
    for with_score_mod, path in ((False, "sdpa_blocks"), (True, "blocked")):
        options, want, mask = _fast_case(backend, with_score_mod)
        calls = _spy(monkeypatch, _fast, "_sdpa_blocks" if path == "sdpa_blocks" else
                     "blocked_attention")
        q, k, v = (torch.tensor(x, requires_grad=True) for x in (FQ, FK, FV))
        out = ta.scaled_dot_product_attention(q, k, v, **options)
        out.backward(torch.tensor(FG))
        assert calls, path
        _close("output", out, backend, want)
        for name, x in zip(("grad_query", "grad_key", "grad_value"), (q, k, v), strict=True):
            _close(name, x.grad, backend, want)
    sdpa = _spy(monkeypatch, _fast.sdpa.F, "scaled_dot_product_attention")
    ta.scaled_dot_product_attention(*(torch.tensor(x) for x in (FQ, FK, FV)),
                                    **_fast_case(backend, False)[0])
    assert sum(a[0].shape[-2] * a[1].shape[-2] for a, _ in sdpa) < 0.5 * 40 * 56  # keys skipped
    recording = _Recording(masks, backend)  # the tiles, forward and backward
    options, _, mask = _fast_case(backend)
    q = torch.tensor(FQ, requires_grad=True)
    ta.blockwise_attention(q, torch.tensor(FK), torch.tensor(FV), block_q=8, block_kv=8,
                           **{**options, "score_mod": recording}).sum().backward()
    _computed_within(recording, mask, 8)


@pytest.mark.slow
def test_jax_fast_path_and_blockwise_skip_what_the_rules_mask(monkeypatch):
    jax = pytest.importorskip("jax", reason="pip install jax")
    import jax_attn as ja
    from jax_attn import _fast, _masking, blockwise
    for name, value in (("BLOCK_Q", 8), ("BLOCK_KV", 8), ("BLOCK_SCORES", 0), ("MIN_SCORES", 0),
                        ("MIN_Q_LEN", 8), ("BLOCKED_PLATFORMS", (jax.default_backend(),))):
        monkeypatch.setattr(_fast, name, value)
    backend = backends.get("jax")
    options, want, mask = _fast_case(backend)
    calls = _spy(monkeypatch, _fast, "_blocked_attention_lse")
    segments = _spy(monkeypatch, _masking, "_mods_segments")
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


@pytest.mark.slow
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
    from numpy_attn import _fast
    for name, value in (("BLOCK_Q", 8), ("BLOCK_KV", 8), ("MIN_SCORES", 0), ("MIN_Q_LEN", 8)):
        monkeypatch.setattr(_fast, name, value)
    backend, table = backends.get("numpy"), F_TABLE
    mask, bias = rules_as_mask_and_bias(1, 4, 40, 56, mask_table=table)
    want = expected(FQ, FK, FV, FG, mask, bias)
    options = {"mask_mod": lambda b, h, q, k: table[h, q, k]}
    _close("output", na.scaled_dot_product_attention(FQ, FK, FV, **options), backend, want)
    original = _fast.forward._mods_statuses  # the bug: the blocks forget mask_mod
    monkeypatch.setattr(_fast.forward, "_mods_statuses", lambda mods, *rest: original(
        mods._replace(mask_mod=None), *rest))
    with pytest.raises(AssertionError, match="output"):
        _close("output", na.scaled_dot_product_attention(FQ, FK, FV, **options), backend, want)


# ------------------------------------------------------------------------------------------
# torch_attn's "sdpa_blocks": a causal triangle without a mask, parts of keys merged by lse
# ------------------------------------------------------------------------------------------

# square, 4 heads over 2, head_dim == v_dim (the split path's kernel needs both): 6 blocks of 8
_S = np.random.default_rng(11)
SQ, SK, SV = (_S.standard_normal((1, 4, 48, 8)), _S.standard_normal((1, 2, 48, 8)),
              _S.standard_normal((1, 2, 48, 8)))
SG = _S.standard_normal((1, 4, 48, 8))
_I, _J = np.arange(48)[:, None], np.arange(48)
# attention sinks and a window: keys 0-7 and the 17 keys up to the query's own; head 1, query 40
# sees no key. Blocks of 32 rows and more skip a gap of keys; 32-39 end in a causal triangle.
SINK_TABLE = np.broadcast_to((_J < 8) | ((_I - 16 <= _J) & (_J <= _I)), (4, 48, 48)).copy()
SINK_TABLE[1, 40] = False


def _torch_sdpa_blocks(monkeypatch):
    """torch_attn with ``"sdpa_blocks"``' blocks of 8 rows and 8 keys, from any size; its
    module (``_fast.sdpa``)."""
    from torch_attn import _fast
    for name, value in (("MIN_SCORES", 0), ("MIN_Q_LEN", 1)):
        monkeypatch.setattr(_fast, name, value)
    for name, value in (("SDPA_ROWS", 8), ("SDPA_KEYS", 8)):
        monkeypatch.setattr(_fast.sdpa, name, value)
    return _fast.sdpa


def _torch_against_reference(mask_mod, table, is_causal=False):
    """Output and gradients of torch_attn with ``mask_mod`` against the float64 reference of
    its tabulation ``table`` ``(heads, 48, 48)``."""
    import torch

    import torch_attn as ta
    backend = backends.get("torch")
    q, k, v = (torch.tensor(x, requires_grad=True) for x in (SQ, SK, SV))
    out = ta.scaled_dot_product_attention(q, k, v, mask_mod=mask_mod, is_causal=is_causal)
    out.backward(torch.tensor(SG))
    want = expected(SQ, SK, SV, SG, *rules_as_mask_and_bias(1, 4, 48, 48, mask_table=table),
                    is_causal=is_causal)
    _close("output", out, backend, want)
    for name, x in zip(("grad_query", "grad_key", "grad_value"), (q, k, v), strict=True):
        _close(name, x.grad, backend, want)
    return out


def test_torch_causal_mask_mod_is_one_is_causal_call(monkeypatch):
    """The triangles of a causal mask_mod are found and joined: ONE SDPA call over all rows and
    keys with SDPA's own is_causal and no mask, as is_causal=True (issue 24's speed target)."""
    pytest.importorskip("torch", reason="pip install torch")
    from torch_attn import masks
    sdpa_route = _torch_sdpa_blocks(monkeypatch)
    calls = []
    sdpa = sdpa_route.F.scaled_dot_product_attention
    monkeypatch.setattr(sdpa_route.F, "scaled_dot_product_attention", lambda *a, **kw: (
        calls.append((a[0].shape[-2], a[1].shape[-2], kw.get("is_causal"),
                      kw.get("attn_mask"))), sdpa(*a, **kw))[1])
    _torch_against_reference(masks.causal_mod(), np.tril(np.ones((4, 48, 48), bool)))
    assert calls == [(48, 48, True, None)], calls


def test_torch_parts_of_keys_merged_by_lse(monkeypatch):
    """Sinks and a window: the runs of rows call torch's CPU kernel once per part of their keys
    (a causal triangle without a mask, the gap between sinks and window skipped), merged by
    lse in a custom autograd.Function; a row without any key gives 0, gradient 0. Without that
    private kernel (other torch versions) one masked call per run gives the same."""
    torch = pytest.importorskip("torch", reason="pip install torch")
    sdpa_route = _torch_sdpa_blocks(monkeypatch)
    table = torch.tensor(SINK_TABLE)
    mod = lambda b, h, q, k: table[h, q, k]  # noqa: E731
    runs = _spy(monkeypatch, sdpa_route, "_flash_parts")
    out = _torch_against_reference(mod, SINK_TABLE)
    kinds = {kind for args, _ in runs for _, _, kind in args[5]}  # (rows, k, v, r0, k0, parts
    spans = [(args[3], args[3] + args[0].shape[-2], args[5]) for args, _ in runs]  # ...)
    assert kinds == {"all", "causal", "mask"}, spans  # a triangle without a mask
    assert all(len({k0 for k0, _, _ in parts}) > 1 for _, _, parts in spans)  # split
    gaps = [parts for _, _, parts in spans if any(a[1] < b[0] for a, b in zip(
        parts, parts[1:], strict=False))]  # the keys between sinks and window skipped
    assert gaps and any(r0 <= 40 < r1 for r0, r1, _ in spans), spans  # the empty row too
    assert not out[0, 1, 40].detach().any()
    monkeypatch.setattr(sdpa_route, "_FLASH_CPU", None)
    runs.clear()
    _torch_against_reference(mod, SINK_TABLE)
    assert not runs


def test_planted_torch_triangle_and_ignored_mask_mod_are_caught(monkeypatch):
    """Two planted bugs in the torch plan, each rejected by the reference check: every run of
    partly masked tiles taken for a causal triangle; the plan ignoring mask_mod."""
    torch = pytest.importorskip("torch", reason="pip install torch")
    from torch_attn import _masking, masks
    sdpa_route = _torch_sdpa_blocks(monkeypatch)
    table = torch.tensor(SINK_TABLE)
    sink_mod = lambda b, h, q, k: table[h, q, k]  # noqa: E731
    _torch_against_reference(masks.causal_mod(), np.tril(np.ones((4, 48, 48), bool)))
    def eager(allowed, row, tri, *rest):  # any run of SOME tiles "is" a triangle
        tri[(row == 1) & np.r_[True, row[:-1] != 1]] = True

    with monkeypatch.context() as planted:
        planted.setattr(_masking, "_find_triangles", eager)
        with pytest.raises(AssertionError, match="output"):
            _torch_against_reference(sink_mod, SINK_TABLE)
    plan = sdpa_route._mods_plan  # the plan forgets mask_mod
    monkeypatch.setattr(sdpa_route, "_mods_plan", lambda mods, *rest: plan(
        mods._replace(mask_mod=None), *rest))
    with pytest.raises(AssertionError, match="output"):
        _torch_against_reference(masks.causal_mod(), np.tril(np.ones((4, 48, 48), bool)))


@pytest.mark.slow
def test_jax_exactly_causal_mask_mod_takes_the_causal_path(monkeypatch):
    """jax_attn: a mask_mod whose values are exactly the causal triangle runs as is_causal=True
    (the mod evaluated at trace time, not recognised by name), against the float64 reference
    under jit; one position short of the triangle keeps the mod (traced only: no compile)."""
    jax = pytest.importorskip("jax", reason="pip install jax")
    import jax_attn as ja
    from jax_attn import _fast, masks
    for name, value in (("BLOCK_Q", 8), ("BLOCK_KV", 8), ("BLOCK_SCORES", 0), ("MIN_SCORES", 0),
                        ("MIN_Q_LEN", 8), ("BLOCKED_PLATFORMS", (jax.default_backend(),))):
        monkeypatch.setattr(_fast, name, value)
    backend = backends.get("jax")
    _ = backend.module  # float64 on, as for every jax test of the harness
    calls = _spy(monkeypatch, _fast, "_blocked_attention_lse")
    q, k, v, g = (backend.asarray(x) for x in (SQ, SK, SV, SG))
    causal = np.tril(np.ones((4, 48, 48), bool))
    grads = jax.jit(lambda q, k, v, g: ja.scaled_dot_product_attention_vjp(
        q, k, v, g, mask_mod=masks.causal_mod()))(q, k, v, g)
    want = expected(SQ, SK, SV, SG, *rules_as_mask_and_bias(1, 4, 48, 48, mask_table=causal))
    for name, x in zip(("grad_query", "grad_key", "grad_value"), grads[:3], strict=True):
        _close(name, x, backend, want)
    assert {(args[0].is_causal, args[0].mask_mod) for args, _ in calls} == {(True, None)}
    calls.clear()
    almost = causal.copy()
    almost[:, 30, 2] = False
    table = backend.asarray(almost)
    jax.eval_shape(lambda q, k, v: ja.scaled_dot_product_attention(
        q, k, v, mask_mod=lambda b, h, i, j: table[h, i, j]), q, k, v)
    assert calls and all(args[0].mask_mod is not None for args, _ in calls)
