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
