"""jax_attn's fast paths and the blocked backward pass against independent values (mutation
testing, docs/mutation.md): each test here kills mutants of ``jax_attn/_fast/__init__.py`` or
``jax_attn/_fast/backward.py`` that the modules' own tests let live (the mods on the blocked
path and in its custom VJP, which part of the call is taken for the causal rule, the cuDNN
path's result).

Expected values come from the float64 ``conformance.cases.reference`` (``attention``,
``attention_vjp``), never from jax_attn itself. Every test runs with x64 on (``conftest.x64_on``)
on float64 inputs, and the blocked path is forced on tiny inputs by shrinking its blocks
(``small_blocks``), so few, small programs compile.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.cases import reference

jax = pytest.importorskip("jax", reason="pip install jax")

import jax_attn as ja  # noqa: E402
from jax_attn import _fast  # noqa: E402

TIGHT = {"rtol": 1e-9, "atol": 1e-10}  # float64 against float64: rounding only

# batch 2, 2 query heads over 1 kv head (two items for the backward pass), 12 queries over
# 16 keys (blocks of 4), head_dim 4, v_dim 3
_G = np.random.default_rng(20261202)
Q, K, V = (_G.standard_normal(s) for s in ((2, 2, 12, 4), (2, 1, 16, 4), (2, 1, 16, 3)))
G = _G.standard_normal((2, 2, 12, 3))  # the output's cotangent


class _Ramp:
    """A score_mod ``0.75 s + (q - k) / 64 + h / 8 - b / 16`` (every index: its result has the
    scores' full shape; a slope other than 1, so its pullback matters) that runs on NumPy and
    JAX index arrays, with its derivative for ``reference.attention_vjp``; records the dtypes
    of the JAX indices it is given (``spec.MOD_INDICES``: int32)."""

    def __init__(self):
        self.index_dtypes = set()

    def __call__(self, s, b, h, q, k):
        if not isinstance(q, np.ndarray):
            self.index_dtypes |= {np.dtype(x.dtype).name for x in (b, h, q, k)}
        return 0.75 * s + (q - k) / 64 + h / 8 - b / 16

    def derivative(self, s, b, h, q, k):
        return np.full_like(s, 0.75)


@pytest.fixture
def small_blocks(monkeypatch, x64_on):
    """The blocked path on these inputs: blocks of 4 queries and 4 keys; the calls recorded."""
    for name, value in (("BLOCK_Q", 4), ("BLOCK_KV", 4), ("BLOCK_SCORES", 0), ("MIN_SCORES", 0),
                        ("MIN_Q_LEN", 4), ("BLOCKED_PLATFORMS", (jax.default_backend(),))):
        monkeypatch.setattr(_fast, name, value)
    calls = []
    real = _fast._blocked_attention_lse

    def spy(*args):
        calls.append(args[0])
        return real(*args)

    monkeypatch.setattr(_fast, "_blocked_attention_lse", spy)
    return calls


def _check(actual, expected, name, tol=TIGHT):
    np.testing.assert_allclose(np.asarray(actual), expected, err_msg=name, **tol)


def test_blocked_path_with_chunks_alibi_ids_and_both_mods_equals_the_reference(small_blocks):
    """Chunks, ALiBi, segment ids, a score_mod and a mask_mod on the blocked path (rebuilt inside
    its custom VJP): output, lse and the three gradients against the float64 reference, one
    (batch, kv head) item at a time and, with a mask that varies by batch, all at once
    (``_fast/backward.py``'s two branches); none of them is taken for the causal triangle
    (``_causal_mask_mod``), every mod reaches the backward pass (``_rebuilt``), a valid
    score_mod passes ``_check_mods``, and its indices are int32 with x64 on."""
    ids = (np.array([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3]),
           np.array([[0] * 6 + [1] * 10, [0] * 12 + [1] * 4]))
    mask = np.random.default_rng(2).random((2, 1, 12, 16)) > 0.2
    options = {"chunk_size": 8, "alibi_slopes": np.array([0.5, 0.25]), "segment_ids": ids,
               "score_mod": _Ramp(), "mask_mod": lambda b, h, q, k: (q + k) % 5 != 0}

    def run(q, k, v, g, mask, slopes, q_ids, kv_ids):
        kw = {**options, "alibi_slopes": slopes, "segment_ids": (q_ids, kv_ids)}
        out, lse = ja.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
        return (out, lse, ja.scaled_dot_product_attention_vjp(q, k, v, g, **kw)[:3],
                ja.scaled_dot_product_attention_vjp(q, k, v, g, mask=mask, **kw)[:3])

    out, lse, grads, masked = jax.jit(run)(Q, K, V, G, mask, options["alibi_slopes"], *ids)
    assert len(small_blocks) == 3 and all(args.mask_mod is not None for args in small_blocks)
    assert options["score_mod"].index_dtypes == {"int32"}  # x64 on: still int32
    want = reference.attention(Q, K, V, **options)
    _check(out, want.output, "output")
    _check(lse, want.lse, "lse")
    for got_all, opts in ((grads, options), (masked, {**options, "mask": mask})):
        grads_want = reference.attention_vjp(Q, K, V, G, **opts)
        for name, got in zip(("query", "key", "value"), got_all, strict=True):
            _check(got, getattr(grads_want, name), f"grad_{name}, mask: {'mask' in opts}")


def test_only_the_causal_triangle_known_at_trace_time_takes_the_causal_path(small_blocks):
    """``_causal_mask_mod``: a mask_mod that allows the triangle and one key past it (a
    superset, without ``is_causal``), and a mask_mod reading a traced table (unknown at trace
    time), keep their mod; both against the float64 reference."""
    table = np.random.default_rng(1).random((12, 16)) > 0.4

    def superset(b, h, q, k):
        return (k <= q) | (k == q + 3)

    def mod(b, h, q, k):  # the table with NumPy indices, for the reference
        return table[q, k]

    def run(q, k, v, t):
        first = ja.scaled_dot_product_attention(q, k, v, mask_mod=superset)
        return first, ja.scaled_dot_product_attention(q, k, v, mask_mod=lambda b, h, i, j: t[i, j])

    first, traced = jax.jit(run)(Q, K, V, jax.numpy.asarray(table))
    assert len(small_blocks) == 2 and all(a.mask_mod is not None for a in small_blocks)
    _check(first, reference.attention(Q, K, V, mask_mod=superset).output, "superset")
    _check(traced, reference.attention(Q, K, V, mask_mod=mod).output, "traced table")


@pytest.mark.parametrize(("shapes", "options"), [
    (((1, 2, 5, 4), (1, 1, 6, 4), (1, 1, 6, 4)), {}),
    (((2, 6, 4), (2, 6, 4), (2, 6, 4)), {"is_causal": True, "window": (2, 3)}),
    (((6, 4), (6, 4), (6, 4)), {"window": (1, 0)}),
], ids=["gqa_4d", "causal_window_3d", "left_window_2d"])
def test_the_cudnn_path_runs_and_equals_the_reference(monkeypatch, x64_on, shapes, options):
    """The cuDNN path forced on this machine in float64 (jax.nn's XLA implementation): its
    ``_cudnn_attention`` returns (an error there would fall back to the explicit steps
    unseen), and that result is the output, equal to the float64 reference (within 1e-5:
    jax.nn's products run at XLA's default precision)."""
    monkeypatch.setattr(_fast, "CUDNN_PLATFORMS", (jax.default_backend(),))
    monkeypatch.setattr(_fast, "CUDNN_DTYPES", ("float64",))
    monkeypatch.setattr(_fast, "CUDNN_IMPLEMENTATION", "xla")
    results = []
    real = _fast._cudnn_attention
    monkeypatch.setattr(_fast, "_cudnn_attention", lambda *a: results.append(real(*a)) or
                        results[-1])
    gen = np.random.default_rng(3)
    q, k, v = (gen.standard_normal(s) for s in shapes)
    out = ja.scaled_dot_product_attention(q, k, v, **options)
    assert len(results) == 1 and np.array_equal(np.asarray(results[0]), np.asarray(out))
    # jax.nn's products run at the default (not the highest) precision, even in float64
    _check(out, reference.attention(q, k, v, **options).output, "output", {"atol": 1e-5})
