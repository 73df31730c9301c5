"""jax_attn's blocked fast path has its own backward pass (``_fast/backward.py``).

``_fast._blocked_attention_lse`` is a ``jax.custom_vjp``: the forward pass saves the output and the
row log-sum-exp, the backward pass walks blocks of keys against the query rows that see them
and skips what the causal rule or the window masks. These tests shrink the blocks so that small
inputs cross several blocks, segments and remainders, and compare the gradients (float64) with
two independent computations: JAX's autodiff of the explicit steps (``return_weights=True``
always takes them) and the float64 NumPy reference ``conformance.cases.reference.attention_vjp``.
One jitted VJP per case, on one set of shapes, keeps the compile count low. That the unpatched
VJP steps through ``spec.FAST_PATHS``' ``block_kv`` keys at a time is
``tests/test_performance_paths.py``'s (traced, not compiled).

The last section (tests from mutation testing, docs/mutation.md) runs the mods on the blocked
path, forward and through its custom VJP, against the float64 reference alone (blocks of 4,
``blocks_of_four``): chunks, ALiBi, segment ids, a score_mod and a mask_mod rebuilt in the
backward pass, and only the causal triangle known at trace time taken for the causal rule.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.cases import reference

jax = pytest.importorskip("jax", reason="pip install jax")
jnp = pytest.importorskip("jax.numpy")

import jax_attn  # noqa: E402
from jax_attn import _fast  # noqa: E402

# (query, key, value): grouped-query heads, q_len != kv_len, lengths not multiples of BLOCK_Q
Q_SHAPE, K_SHAPE, V_SHAPE = (2, 4, 37, 8), (2, 2, 30, 8), (2, 2, 30, 5)
BLOCK, BLOCK_KV = 8, 4  # queries per forward block, keys per backward step

CASES = {
    # the causal rule alone: the forward pass cuts the triangle in halves (_causal_forward)
    "causal_gqa": {"is_causal": True},
    "causal_bottom_right_softcap": {
        "is_causal": True, "causal_alignment": "bottom_right", "softcap": 2.0},
    # q_len > kv_len: the first q_len - kv_len rows see no key at all
    "causal_bottom_right_bias_softcap": {
        "is_causal": True, "causal_alignment": "bottom_right", "bias": "full", "softcap": 2.0},
    "window_bias_per_key": {"window": (5, 2), "bias": "per_key"},
    "window_bottom_right_mask": {"window": (3, 0), "causal_alignment": "bottom_right",
                                 "mask": "empty_row", "bias": "per_query"},
    "full_bias_2d_mask": {"mask": "empty_row", "bias": "2d"},
}


@pytest.fixture
def small_blocks(monkeypatch):
    """jax_attn with blocks of BLOCK rows (none grown), its blocked path taken by these small
    inputs."""
    monkeypatch.setattr(_fast, "BLOCK_Q", BLOCK)
    monkeypatch.setattr(_fast, "BLOCK_SCORES", 0)
    monkeypatch.setattr(_fast, "BLOCK_KV", BLOCK_KV)
    monkeypatch.setattr(_fast, "MIN_SCORES", 0)
    monkeypatch.setattr(_fast, "MIN_Q_LEN", BLOCK)
    monkeypatch.setattr(_fast, "BLOCKED_PLATFORMS", (jax.default_backend(),))
    calls = []
    real = _fast._blocked_attention_lse

    def spy(*args):
        calls.append(True)
        return real(*args)

    monkeypatch.setattr(_fast, "_blocked_attention_lse", spy)
    with jax.enable_x64(True):
        yield calls


def _inputs(case: dict, seed: int = 0) -> tuple[list[np.ndarray], dict]:
    gen = np.random.default_rng(seed)
    q, k, v = (gen.standard_normal(s) for s in (Q_SHAPE, K_SHAPE, V_SHAPE))
    grad_out = gen.standard_normal(Q_SHAPE[:-1] + V_SHAPE[-1:])
    scores = Q_SHAPE[:-1] + K_SHAPE[-2:-1]  # (2, 4, 37, 30)
    options = {name: value for name, value in case.items() if name not in ("mask", "bias")}
    if "mask" in case:  # True = may attend; query row 3 attends nothing
        mask = gen.random(scores) > 0.3
        mask[..., 3, :] = False
        options["mask"] = mask
    bias_shape = {"full": scores, "per_key": scores[-1:], "per_query": (4, 37, 1),
                  "2d": scores[-2:]}.get(case.get("bias"))
    if bias_shape is not None:
        options["bias"] = gen.standard_normal(bias_shape)
    return [q, k, v, grad_out], options


def _vjp(arrays: list[np.ndarray], options: dict, explicit: bool) -> list[np.ndarray]:
    """The gradients (query, key, value, bias) through the public API, jitted: the blocked
    path's custom_vjp, or autodiff of the explicit steps (``return_weights=True``)."""
    static = {n: v for n, v in options.items() if n not in ("mask", "bias")}
    mask, bias = options.get("mask"), options.get("bias")

    def loss_vjp(q, k, v, g, mask, bias):
        def attend(q, k, v, bias):
            out = jax_attn.scaled_dot_product_attention(
                q, k, v, mask=mask, bias=bias, return_weights=explicit, **static)
            return out[0] if explicit else out

        _, pullback = jax.vjp(attend, q, k, v, bias)
        return pullback(g)

    grads = jax.jit(loss_vjp)(*arrays, mask, bias)
    return [None if g is None else np.asarray(g) for g in grads]


def _check(name: str, got: np.ndarray, want: np.ndarray, source: str) -> None:
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape} [{source}]"
    assert np.isfinite(got).all(), f"{name}: not finite [{source}]"
    err = np.abs(got - want).max()
    bound = 1e-10 * (1.0 + np.abs(want).max())
    assert err <= bound, f"{name}: max |diff| {err:.2e} > {bound:.2e} [{source}]"


@pytest.mark.slow
@pytest.mark.parametrize("case_name", sorted(CASES))
def test_blocked_vjp_equals_explicit_and_reference(small_blocks, case_name):
    arrays, options = _inputs(CASES[case_name])
    fast = _vjp(arrays, options, explicit=False)
    assert small_blocks, "the blocked path did not run"
    assert fast[0].dtype == np.float64
    small_blocks.clear()
    explicit = _vjp(arrays, options, explicit=True)
    assert not small_blocks, "return_weights must take the explicit path"
    ref = reference.attention_vjp(*arrays, **options)
    names = ("grad_query", "grad_key", "grad_value", "grad_bias")
    wanted = (ref.query, ref.key, ref.value, ref.bias)
    for name, got, plain, want in zip(names, fast, explicit, wanted, strict=True):
        if want is None:
            assert got is None and plain is None
            continue
        _check(name, got, plain, f"{case_name}: blocked vs explicit autodiff")
        _check(name, got, want, f"{case_name}: blocked vs float64 reference")


GROWN_CASES = {  # no window: blocks may grow
    "causal_gqa": CASES["causal_gqa"],
    "causal_bottom_right_softcap": CASES["causal_bottom_right_softcap"],
    "full_bias_per_key_softcap": {"bias": "per_key", "softcap": 2.0},
}


@pytest.mark.parametrize("case_name", sorted(GROWN_CASES))
def test_grown_blocks_equal_the_reference(small_blocks, monkeypatch, case_name):
    """Blocks grown from BLOCK rows (``slicing._grown``): one item's scores, 2 heads × rows ×
    30 keys, may reach 2,000 entries, so blocks of 8 rows grow to 32 (37 rows: one block and
    a rest of 5); the forward pass and the VJP still equal the float64 reference."""
    from jax_attn._fast import slicing
    monkeypatch.setattr(_fast, "BLOCK_SCORES", 2000)
    grown = []
    real = slicing._grown
    monkeypatch.setattr(slicing, "_grown", lambda *a: grown.append(real(*a)[0]) or real(*a))
    arrays, options = _inputs(GROWN_CASES[case_name])
    fast = _vjp(arrays, options, explicit=False)
    assert small_blocks and grown and set(grown) == {4 * BLOCK}, grown
    ref = reference.attention_vjp(*arrays, **options)
    for name, got, want in zip(("grad_query", "grad_key", "grad_value", "grad_bias"), fast,
                               (ref.query, ref.key, ref.value, ref.bias), strict=True):
        if want is None:
            assert got is None
            continue
        _check(name, got, want, f"{case_name}, grown blocks: blocked vs float64 reference")
    static = {n: v for n, v in options.items() if n not in ("mask", "bias")}
    out = jax.jit(lambda q, k, v, bias: jax_attn.scaled_dot_product_attention(
        q, k, v, bias=bias, **static))(*arrays[:3], options.get("bias"))
    want = reference.attention(*arrays[:3], **options).output
    _check("output", np.asarray(out), want, f"{case_name}, grown blocks: output")


def test_a_window_keeps_blocks_of_block_q_rows(small_blocks, monkeypatch):
    """A window's segments follow the blocks: with the budget that grows the cases above,
    the windowed call's blocks stay at BLOCK rows (``slicing._grown`` is not asked)."""
    from jax_attn._fast import slicing
    monkeypatch.setattr(_fast, "BLOCK_SCORES", 2000)
    grown = []
    real = slicing._grown
    monkeypatch.setattr(slicing, "_grown", lambda *a: grown.append(real(*a)[0]) or real(*a))
    arrays, options = _inputs(CASES["window_bias_per_key"])
    _vjp(arrays, options, explicit=False)
    assert small_blocks and grown == []


def test_rows_and_keys_nobody_sees_get_exact_zero_gradients(small_blocks):
    # bottom-right causal with q_len > kv_len: query rows 0..6 see no key; row 3 is masked out;
    # with the window (3, 0) key j is seen only by rows j + 7 .. j + 10
    arrays, options = _inputs(CASES["window_bottom_right_mask"], seed=1)
    options["mask"][..., :, 29] = False  # nobody attends key 29
    grad_q, grad_k, grad_v, grad_bias = _vjp(arrays, options, explicit=False)
    assert small_blocks
    offset = Q_SHAPE[-2] - K_SHAPE[-2]
    assert np.all(grad_q[..., :offset, :] == 0.0) and np.all(grad_q[..., 3, :] == 0.0)
    assert np.all(grad_k[..., 29, :] == 0.0) and np.all(grad_v[..., 29, :] == 0.0)
    assert np.all(grad_bias[..., :offset, :] == 0.0)
    # the other rows do get a gradient (a row that keeps one key only gets 0: softmax is 1)
    assert (np.abs(grad_q[..., offset + 1 :, :]).max(axis=-1) > 0.0).mean() > 0.5


def test_blocked_vjp_holds_no_query_by_key_array(small_blocks):
    # the jaxpr of forward + backward: no intermediate has (q_len, kv_len) as its last axes
    q, k, v, g = (jnp.asarray(x) for x in _inputs({})[0])

    def fwd_bwd(q, k, v, g):
        return jax_attn.scaled_dot_product_attention_vjp(q, k, v, g, is_causal=True)[:3]

    jaxpr = jax.make_jaxpr(fwd_bwd)(q, k, v, g)
    assert small_blocks

    def shapes(jaxpr):
        for eqn in jaxpr.eqns:
            yield from (var.aval.shape for var in eqn.outvars)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from shapes(inner)

    found = [s for s in shapes(jaxpr.jaxpr) if s[-2:] == (Q_SHAPE[-2], K_SHAPE[-2])]
    assert not found, f"(q_len, kv_len) arrays in the blocked VJP: {found}"
    # the explicit steps do make one (the check can fail)
    explicit = jax.make_jaxpr(lambda q, k, v: jax_attn.scaled_dot_product_attention(
        q, k, v, is_causal=True, return_weights=True)[0])(q, k, v)
    assert any(s[-2:] == (Q_SHAPE[-2], K_SHAPE[-2]) for s in shapes(explicit.jaxpr))


def test_public_vjp_takes_the_blocked_backward_pass(small_blocks):
    # the real path: scaled_dot_product_attention_vjp (jax.vjp of the forward pass) reaches the
    # blocked custom_vjp when use_fast_path selects "blocked"
    import attention_rules

    (q, k, v, g), _ = _inputs({})
    args = attention_rules.attention_arguments(
        "scaled_dot_product_attention_vjp", (q.shape, "float64"), (k.shape, "float64"),
        (v.shape, "float64"), is_causal=True)
    q, k, v, g = (jnp.asarray(x) for x in (q, k, v, g))
    assert _fast.use_fast_path(q, k, v, None, None, args) == "blocked"
    grads = jax.jit(lambda q, k, v, g: jax_attn.scaled_dot_product_attention_vjp(
        q, k, v, g, is_causal=True))(q, k, v, g)
    assert small_blocks and grads[3] is None
    ref = reference.attention_vjp(q, k, v, g, is_causal=True)
    for name, got, want in zip(("grad_query", "grad_key", "grad_value"), grads[:3],
                               (ref.query, ref.key, ref.value), strict=True):
        _check(name, np.asarray(got), want, "scaled_dot_product_attention_vjp vs float64 reference")


def test_grown_doubles_at_most_twice_within_the_budget():
    """``slicing._grown`` as FAST_PATH_RULES states it: BLOCK_Q rows doubled, at most twice,
    while heads × rows × keys stays within BLOCK_SCORES (the budget itself allowed)."""
    from jax_attn._fast import slicing
    heads, keys = 2, 30
    for budget, rows in ((0, 8), (heads * 16 * keys - 1, 8), (heads * 16 * keys, 16),
                         (heads * 32 * keys - 1, 16), (heads * 32 * keys, 32), (1 << 30, 32)):
        grown = slicing._grown((8, 4, 4, 16, budget), heads, keys)
        assert grown == (rows, 4, 4, 16, budget), (budget, grown)


# ------------------------------------------------------------------------------------------
# The mods on the blocked path and in its custom VJP (chunks, ALiBi, segment ids, score_mod,
# mask_mod), and which mask_mod is taken for the causal triangle: blocks of 4, x64 on
# ------------------------------------------------------------------------------------------

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
def blocks_of_four(monkeypatch, x64_on):
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


def _close(actual, expected, name, tol=TIGHT):
    np.testing.assert_allclose(np.asarray(actual), expected, err_msg=name, **tol)


def test_blocked_path_with_chunks_alibi_ids_and_both_mods_equals_the_reference(blocks_of_four):
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
        out, lse = jax_attn.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
        return (out, lse, jax_attn.scaled_dot_product_attention_vjp(q, k, v, g, **kw)[:3],
                jax_attn.scaled_dot_product_attention_vjp(q, k, v, g, mask=mask, **kw)[:3])

    out, lse, grads, masked = jax.jit(run)(Q, K, V, G, mask, options["alibi_slopes"], *ids)
    assert len(blocks_of_four) == 3 and all(args.mask_mod is not None for args in blocks_of_four)
    assert options["score_mod"].index_dtypes == {"int32"}  # x64 on: still int32
    want = reference.attention(Q, K, V, **options)
    _close(out, want.output, "output")
    _close(lse, want.lse, "lse")
    for got_all, opts in ((grads, options), (masked, {**options, "mask": mask})):
        grads_want = reference.attention_vjp(Q, K, V, G, **opts)
        for name, got in zip(("query", "key", "value"), got_all, strict=True):
            _close(got, getattr(grads_want, name), f"grad_{name}, mask: {'mask' in opts}")


def test_only_the_causal_triangle_known_at_trace_time_takes_the_causal_path(blocks_of_four):
    """``_causal_mask_mod``: a mask_mod that allows the triangle and one key past it (a
    superset, without ``is_causal``), and a mask_mod reading a traced table (unknown at trace
    time), keep their mod; both against the float64 reference."""
    table = np.random.default_rng(1).random((12, 16)) > 0.4

    def superset(b, h, q, k):
        return (k <= q) | (k == q + 3)

    def mod(b, h, q, k):  # the table with NumPy indices, for the reference
        return table[q, k]

    def run(q, k, v, t):
        first = jax_attn.scaled_dot_product_attention(q, k, v, mask_mod=superset)
        return first, jax_attn.scaled_dot_product_attention(
            q, k, v, mask_mod=lambda b, h, i, j: t[i, j])

    first, traced = jax.jit(run)(Q, K, V, jax.numpy.asarray(table))
    assert len(blocks_of_four) == 2 and all(a.mask_mod is not None for a in blocks_of_four)
    _close(first, reference.attention(Q, K, V, mask_mod=superset).output, "superset")
    _close(traced, reference.attention(Q, K, V, mask_mod=mod).output, "traced table")
