"""The blocked paths for large inputs against the float64 reference.

numpy_attn (threads over query blocks) and jax_attn (``lax.map`` over query blocks) select a
blocked computation for large inputs (``_fast.use_fast_path`` returns ``"blocked"``). These
tests shrink the block size and the size threshold so small inputs exercise several blocks,
causal/window segments and skipped blocks, and judge the blocked output against the float64
``conformance.cases.reference`` under the harness's one tolerance rule (``tests/numerics.py``: exact
zeros for fully masked rows, NaN exactly where the spec's IEEE rule puts it), never against the
same backend's explicit path. They also check which inputs stay on the explicit path (the
weights, dropout, small or empty inputs), that dropout is applied where the blocked path would
otherwise run, and jax_attn's blocked path under ``jit``, ``vmap`` and ``grad``. The selection
rule at the real numbers, the documented block sizes, the default blocks at full size and
numpy_attn's thread pool are ``tests/test_performance_paths_rules.py``'s.

Shapes and structures (causal rule, alignment, window) are crossed once, in
``test_blocked_matches_reference``; the ways a mask or bias broadcasts each meet every option
set and structure once, not every combination. jax_attn runs here with x64 off (JAX's default),
float64 and the dtype test with x64 on too (``conftest.x64``).
"""

from __future__ import annotations

import numpy as np
import pytest
from numerics import (
    assert_matches_reference,
    assert_vjp_matches_reference,
)

from conformance.cases import reference

BACKENDS = ("numpy", "jax")

# (query, key, value) shapes: batch axes, heads (GQA), 2-D inputs, q_len != kv_len both ways
SHAPES = {
    "4d": ((2, 2, 40, 8), (2, 2, 40, 8), (2, 2, 40, 8)),
    "gqa_q_longer": ((1, 4, 45, 8), (1, 2, 37, 8), (1, 2, 37, 5)),
    "kv_longer": ((3, 29, 8), (3, 70, 8), (3, 70, 6)),
    "2d": ((50, 8), (33, 8), (33, 8)),
    "batch_axes": ((2, 1, 2, 34, 4), (2, 1, 1, 34, 4), (2, 1, 1, 34, 4)),
}
GEOMETRY = ("4d", "gqa_q_longer", "kv_longer")  # q_len vs kv_len: every structure
LAYOUT = ("2d", "batch_axes")  # the layouts: a few structures each

STRUCTURE = [
    {},
    {"is_causal": True},
    {"is_causal": True, "causal_alignment": "bottom_right"},
    {"window": (3, 2)},
    {"window": (5, 0), "causal_alignment": "bottom_right"},
    {"window": (None, 4)},
    {"window": (7, None), "causal_alignment": "bottom_right"},
    {"window": (0, 0)},
    {"is_causal": True, "window": (6, 3)},
]
LAYOUT_STRUCTURE = [STRUCTURE[0], STRUCTURE[2], STRUCTURE[3]]


def _module(name: str):
    if name == "jax":
        pytest.importorskip("jax", reason="pip install jax")
        import jax_attn

        return jax_attn
    import numpy_attn

    return numpy_attn


@pytest.fixture(params=BACKENDS)
def small_blocks(request, monkeypatch):
    """The backend module, with its blocked path taken by every input of at least 2 blocks
    (jax_attn with x64 off, JAX's default)."""
    if request.param == "jax":
        jax = pytest.importorskip("jax", reason="pip install jax")
        with jax.enable_x64(False):
            yield _small_blocks("jax", monkeypatch)
    else:
        yield _small_blocks("numpy", monkeypatch)


def _small_blocks(name, monkeypatch):
    module = _module(name)
    fast = module._fast
    monkeypatch.setattr(fast, "BLOCK_Q", 8)
    monkeypatch.setattr(fast, "MIN_SCORES", 0)
    monkeypatch.setattr(fast, "MIN_Q_LEN", 8)
    calls = []
    real = fast.fast_attention

    def spy(path, *args, **kwargs):
        calls.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(fast, "fast_attention", spy)
    module.blocked_calls = calls
    return module


def _inputs(shape_name: str, dtype=np.float32, seed: int = 0):
    gen = np.random.default_rng(seed)
    return [gen.standard_normal(s).astype(dtype) for s in SHAPES[shape_name]]


def _target(q, k) -> tuple[int, ...]:
    return q.shape[:-1] + (k.shape[-2],)


def _blocked(module, q, k, v, **options) -> np.ndarray:
    """The output of the default call, which must take the blocked path."""
    module.blocked_calls.clear()
    out = np.asarray(module.scaled_dot_product_attention(q, k, v, **options))
    assert module.blocked_calls == ["blocked"], "the blocked path did not run"
    return out


def _check(module, q, k, v, dtype="float32", **options) -> np.ndarray:
    """The blocked output against the float64 reference (the harness's rule); returns it."""
    out = _blocked(module, q, k, v, **options)
    arrays = {"query": q, "key": k, "value": v}
    arrays.update({n: options.pop(n) for n in ("mask", "bias") if n in options})
    assert_matches_reference(out, arrays, dtype, what=f"{module.__name__} blocked, {options}",
                             **options)
    return out


def _crossings() -> list:
    """numpy_attn: every geometry × every structure, each layout × 3 structures. jax_attn (each
    call a compile): each structure once, the geometries taking turns, and the layouts' 6."""
    grid = []
    for backend in BACKENDS:
        for g, shape in enumerate(GEOMETRY):
            grid += [(backend, shape, s) for i, s in enumerate(STRUCTURE)
                     if backend == "numpy" or i % len(GEOMETRY) == g]
        grid += [(backend, shape, s) for shape in LAYOUT for s in LAYOUT_STRUCTURE]
    return grid


@pytest.mark.parametrize(("small_blocks", "shape_name", "structure"), _crossings(),
                         indirect=["small_blocks"], ids=str)
def test_blocked_matches_reference(small_blocks, shape_name, structure):
    q, k, v = _inputs(shape_name)
    out = _check(small_blocks, q, k, v, **structure)
    allowed = reference.structural_mask(q.shape[-2], k.shape[-2], **structure)
    empty = ~allowed.any(axis=-1)  # fully masked rows (e.g. bottom-right with q_len > kv_len)
    assert np.all(out[..., empty, :] == 0.0)


MASK_SHAPES = {  # every way a mask or bias broadcasts to (batch, heads, q_len, kv_len)
    "full": (2, 4, 45, 37),
    "keys": (37,),
    "rows_keys": (45, 37),
    "padding": (2, 1, 1, 37),
    "per_query": (2, 4, 45, 1),
    "per_head": (4, 1, 37),
    "kv_head_row": (1, 4, 45, 37),
    "scalar_like": (1, 1),
}
MASK_STRUCTURE = [{}, {"is_causal": True}, {"window": (4, 4)}]


@pytest.mark.parametrize("mask_shape", sorted(MASK_SHAPES))
def test_blocked_mask_and_bias_broadcasts(small_blocks, mask_shape):
    """Each broadcast shape as a mask, as a bias, and as both with soft-capping and a scale;
    the three calls take the three structures in a rotation that differs between shapes, so
    every (options, structure) pair and every (shape, structure) pair is met. jax_attn (each
    call a compile) makes one of the three calls per shape, in turn: every shape and every
    option set still meet, and each option set meets every structure."""
    gen = np.random.default_rng(1)
    q = gen.standard_normal((2, 4, 45, 8)).astype(np.float32)
    k = gen.standard_normal((2, 2, 37, 8)).astype(np.float32)
    v = gen.standard_normal((2, 2, 37, 6)).astype(np.float32)
    shape = MASK_SHAPES[mask_shape]
    mask = gen.random(shape) > 0.3
    bias = gen.standard_normal(shape).astype(np.float32)
    turn = sorted(MASK_SHAPES).index(mask_shape)
    option_sets = [{"mask": mask}, {"bias": bias},
                   {"mask": mask, "bias": bias, "softcap": 2.5, "scale": 0.3}]
    for i, options in enumerate(option_sets):
        if small_blocks.__name__ == "jax_attn" and i != turn % len(option_sets):
            continue
        structure = MASK_STRUCTURE[(turn + i) % len(MASK_STRUCTURE)]
        _check(small_blocks, q, k, v, **options, **structure)


def test_blocked_fully_masked_rows_are_exactly_zero(small_blocks):
    q, k, v = _inputs("gqa_q_longer")
    mask = np.ones(_target(q, k), dtype=bool)
    mask[0, 1, 3] = False  # one row
    mask[0, :, 16:24] = False  # a whole block of rows in every head
    mask[0, 2, :, :] = False  # a whole head
    out = _check(small_blocks, q, k, v, mask=mask)
    assert np.all(out[0, 1, 3] == 0.0)
    assert np.all(out[0, :, 16:24] == 0.0)
    assert np.all(out[0, 2] == 0.0)
    # a window that leaves the first queries nothing: whole blocks skipped, exactly 0
    out = _check(small_blocks, q, k, v, window=(0, 0), causal_alignment="bottom_right")
    assert np.all(out[..., :8, :] == 0.0)


def test_blocked_bias_with_minus_inf_and_softcap(small_blocks):
    q, k, v = _inputs("4d")
    bias = np.zeros(_target(q, k), dtype=np.float32)
    bias[..., ::3] = -np.inf  # an additive mask
    bias[1, 0, 5, :] = -np.inf  # a fully masked row through the bias alone
    options = {"softcap": 1.5, "is_causal": True}
    out = _blocked(small_blocks, q, k, v, bias=bias, **options)
    assert np.all(out[1, 0, 5] == 0.0)
    # the float64 reference gives a row masked by the bias alone NaN (0 / 0): it gets the
    # -inf positions as a mask instead, the spec's meaning of both
    allowed = np.isfinite(bias)
    assert_matches_reference(out, {"query": q, "key": k, "value": v, "mask": allowed,
                                   "bias": np.where(allowed, bias, 0.0)}, "float32", **options)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NaN and inf - inf: IEEE
def test_blocked_paths_follow_the_ieee_rule_for_nan_and_inf(small_blocks):
    """``spec.NON_FINITE`` on the blocked path: hand-made NaN rows, and the float64 reference
    (NaN exactly where it is NaN, any value where the rule leaves it unspecified)."""
    q, k, v = _inputs("4d")  # (2, 2, 40, 8): q_len = kv_len = 40, blocks of 8 queries

    def blocked(q, k, v, **options):
        return _check(small_blocks, q, k, v, **options)

    # a NaN in query row 5 of (batch 0, head 1): that output row only
    q_nan = q.copy()
    q_nan[0, 1, 5, 3] = np.nan
    out = blocked(q_nan, k, v, is_causal=True)
    expected = np.zeros(out.shape[:-1], dtype=bool)
    expected[0, 1, 5] = True
    np.testing.assert_array_equal(np.isnan(out).any(-1), expected)
    np.testing.assert_array_equal(np.isnan(out).all(-1), expected)

    # NaN or +inf in key 20 of (batch 1, kv head 0): rows 0-19 do not attend it (causal)
    for bad in (np.nan, np.inf):
        k_bad = k.copy()
        k_bad[1, 0, 20, :] = bad
        out = blocked(q, k_bad, v, is_causal=True)
        assert not np.isnan(out[1, 0, :20]).any(), bad  # masked there: -inf replaces it
        assert np.isnan(out[1, 0, 20:]).all(), bad  # attended: NaN rows
        assert not np.isnan(out[0]).any() and not np.isnan(out[1, 1]).any()
        mask = np.ones(_target(q, k), dtype=bool)
        mask[..., 20] = False  # masked for every query: nothing spreads
        assert not np.isnan(blocked(q, k_bad, v, mask=mask)).any()

    # -inf in query row 7 against positive key features: every score -inf, a fully masked row
    k_pos, q_minf = k.copy(), q.copy()
    k_pos[..., 0] = np.abs(k_pos[..., 0]) + 0.1
    q_minf[0, 0, 7, 0] = -np.inf
    out = blocked(q_minf, k_pos, v, is_causal=True)
    assert (out[0, 0, 7] == 0).all()

    # a NaN in value row 20: every row with a non-zero weight on key 20 is NaN (rows with
    # weight 0 on it are unspecified: the matmul gives 0 · NaN, a skipped block never reads it)
    v_nan = v.copy()
    v_nan[1, 0, 20, 2] = np.nan
    out = blocked(q, k, v_nan, is_causal=True)
    assert np.isnan(out[1, 0, 20:, 2]).all()
    assert not np.isnan(out[0]).any()


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_blocked_dtypes(small_blocks, dtype):
    """The input dtype is kept, and the output is within the dtype's tolerance of the float64
    reference; jax_attn with x64 on and, but for float64 (which needs it), off."""
    import ml_dtypes

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v = _inputs("gqa_q_longer", dtype=np_dtype)
    if small_blocks.__name__ != "jax_attn":
        out = _check(small_blocks, q, k, v, dtype, is_causal=True)
        assert out.dtype == np_dtype
        return
    import jax

    for x64 in (True,) if dtype == "float64" else (False, True):
        with jax.enable_x64(x64):
            out = _check(small_blocks, q, k, v, dtype, is_causal=True)
        assert out.dtype == np_dtype, f"x64={x64}"


def test_small_inputs_dropout_and_weights_take_the_explicit_path(small_blocks, monkeypatch):
    fast = small_blocks._fast
    q, k, v = _inputs("4d")

    def calls(**options):
        small_blocks.blocked_calls.clear()
        small_blocks.scaled_dot_product_attention(q, k, v, **options)
        return len(small_blocks.blocked_calls)

    assert calls() == 1
    assert calls(return_weights=True) == 0
    monkeypatch.setattr(fast, "MIN_SCORES", q.size // q.shape[-1] * k.shape[-2] + 1)
    assert calls() == 0  # below the size threshold
    monkeypatch.setattr(fast, "MIN_SCORES", 0)
    empty = np.zeros((2, 2, 0, 8), dtype=np.float32)
    small_blocks.blocked_calls.clear()
    out = small_blocks.scaled_dot_product_attention(empty, k, v)
    assert np.asarray(out).shape == (2, 2, 0, 8) and not small_blocks.blocked_calls


def test_dropout_is_applied_where_the_blocked_path_would_run(small_blocks):
    """An input the blocked path takes, with dropout: the explicit path runs and drops. With
    ``value`` the identity the output is the weights after dropout: a given keep-mask gives
    the float64 reference's, a drawn one zeroes about ``p`` of them and scales the rest by
    ``1 / (1 - p)``."""
    q, k, _ = _inputs("4d")  # (2, 2, 40, 8): 40 keys
    eye = np.broadcast_to(np.eye(40, dtype=np.float32), (2, 2, 40, 40)).copy()
    p = 0.5
    keep = np.random.default_rng(3).random(_target(q, k)) > p
    small_blocks.blocked_calls.clear()
    out = small_blocks.scaled_dot_product_attention(q, k, eye, dropout_p=p, dropout_mask=keep)
    assert not small_blocks.blocked_calls
    assert_matches_reference(out, {"query": q, "key": k, "value": eye, "dropout_mask": keep},
                             "float32", dropout_p=p)
    if small_blocks.__name__ == "jax_attn":
        import jax

        rng = jax.random.key(0)
    else:
        rng = np.random.default_rng(0)
    out = np.asarray(small_blocks.scaled_dot_product_attention(q, k, eye, dropout_p=p, rng=rng))
    assert not small_blocks.blocked_calls
    dropped = out == 0.0
    assert 0.45 < dropped.mean() < 0.55, f"{dropped.mean():.3f} of the weights dropped"
    weights = reference.attention(q, k, eye).weights
    np.testing.assert_allclose(out[~dropped], weights[~dropped] / (1 - p), rtol=1e-5)


def test_jax_blocked_path_under_jit_vmap_and_grad(monkeypatch, x64):
    """Gradients through the blocked path under ``jit`` against the float64 reference VJP
    (x64 off and on), and ``vmap`` of the blocked path against the reference."""
    jax = pytest.importorskip("jax", reason="pip install jax")
    small_blocks = _small_blocks("jax", monkeypatch)
    q, k, v = _inputs("gqa_q_longer")
    mask = np.random.default_rng(2).random(_target(q, k)) > 0.2
    g = np.random.default_rng(4).standard_normal(q.shape[:-1] + v.shape[-1:]).astype(np.float32)
    options = {"is_causal": True, "causal_alignment": "bottom_right", "softcap": 3.0}

    def vjp(q, k, v, g):
        attend = lambda q, k, v: small_blocks.scaled_dot_product_attention(  # noqa: E731
            q, k, v, mask=mask, **options)
        return jax.vjp(attend, q, k, v)[1](g)

    small_blocks.blocked_calls.clear()
    grads = jax.jit(vjp)(q, k, v, g)
    assert small_blocks.blocked_calls
    assert all(grad.dtype == np.float32 for grad in grads)
    assert_vjp_matches_reference(grads, {"query": q, "key": k, "value": v, "mask": mask,
                                         "grad_output": g}, "float32", **options)
    small_blocks.blocked_calls.clear()
    batched = jax.vmap(lambda q: small_blocks.scaled_dot_product_attention(q, k[0], v[0]))(q)
    assert small_blocks.blocked_calls
    assert_matches_reference(batched, {"query": q, "key": k, "value": v}, "float32")
