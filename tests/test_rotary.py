"""The rotary position embedding in every backend against a float64 reference written here.

The reference multiplies each pair, as a complex number ``x1 + i x2``, by ``factor · e^{i a}``
with ``math``'s cos/sin (cmath.exp), one token at a time: nothing of it comes from the code
under test. Gradients: numpy_attn's hand-written VJP against central differences, jax.grad and
torch autograd against it. One JAX shape (``SHAPE``) for every JAX call, to compile little.
"""

from __future__ import annotations

import cmath

import ml_dtypes
import numpy as np
import pytest

import numpy_attn as na

BACKENDS = ("numpy_attn", "jax_attn", "torch_attn")
SHAPE = (2, 3, 5, 8)  # (batch, heads, seq, head_dim)
POSITIONS = np.array([[0, 1, 2, 3, 4], [-3, 7, 100, 2, -1]])  # (batch, seq): negatives too
LAYOUTS = ("half", "interleaved")


def reference(x, positions, layout="half", rotary_dim=None, theta=10000.0, factor=1.0,
              inv_freq=None):
    """float64, one pair at a time: (x[j] + i x[k]) · factor · e^{i p f_i}."""
    x = np.asarray(x).astype(np.float64)
    d = x.shape[-1]
    r = rotary_dim or d
    half = r // 2
    positions = np.asarray(positions)
    if x.ndim >= 3:
        positions = positions[..., None, :]
    positions = np.broadcast_to(positions, x.shape[:-1])
    out = x.copy()
    for index in np.ndindex(*x.shape[:-1]):
        p = int(positions[index])
        for i in range(half):
            f = float(inv_freq[i]) if inv_freq is not None else theta ** (-2 * i / r)
            j, k = (i, i + half) if layout == "half" else (2 * i, 2 * i + 1)
            z = complex(x[index + (j,)], x[index + (k,)]) * factor * cmath.exp(1j * p * f)
            out[index + (j,)], out[index + (k,)] = z.real, z.imag
    return out


def module(name):
    return pytest.importorskip(name)


def to_backend(name, a):
    """A NumPy array (or None) as the backend's array, same dtype."""
    if a is None or name == "numpy_attn":
        return a
    if name == "jax_attn":
        import jax.numpy as jnp

        return jnp.asarray(a)
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def to_numpy(name, y):
    if name == "torch_attn":
        import torch

        if y.dtype == torch.bfloat16:
            return y.float().numpy().astype(ml_dtypes.bfloat16)
        return y.detach().numpy()
    return np.asarray(y)


def rotate(name, x, positions, **kwargs):
    kwargs = {k: to_backend(name, v) if isinstance(v, np.ndarray) else v
              for k, v in kwargs.items()}
    y = module(name).rotary_embedding(to_backend(name, x), to_backend(name, positions), **kwargs)
    return to_numpy(name, y)


@pytest.fixture(scope="module")
def x32():
    return np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rotary_dim", [None, 4])
def test_float32_matches_the_reference(name, layout, rotary_dim, x32):
    y = rotate(name, x32, POSITIONS, layout=layout, rotary_dim=rotary_dim,
               attention_factor=1.25)
    expected = reference(x32, POSITIONS, layout, rotary_dim, factor=1.25)
    assert y.dtype == np.float32 and y.shape == SHAPE
    np.testing.assert_allclose(y, expected, atol=2e-5, rtol=0)
    r = rotary_dim or SHAPE[-1]
    assert np.array_equal(y[..., r:], x32[..., r:])  # pass-through, bit-identical


@pytest.mark.parametrize("name", BACKENDS)
def test_float64_matches_the_reference(name, x64_on):
    x = np.random.default_rng(1).standard_normal((3, 5, 6))  # (heads, seq, head_dim)
    positions = np.array([-2, 0, 3, 17, 1000])
    for layout in LAYOUTS:
        y = rotate(name, x, positions, layout=layout, theta=500.0)
        assert y.dtype == np.float64
        np.testing.assert_allclose(y, reference(x, positions, layout, theta=500.0),
                                   atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_types_are_rounded_once(name, dtype, x32):
    """float32 computation, one rounding: within half an ulp of the exact result (plus the
    float32 error), in the input's dtype."""
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    x = x32.astype(np_dtype)
    y = rotate(name, x, POSITIONS, layout="interleaved", attention_factor=0.9)
    assert y.dtype == np_dtype
    expected = reference(x, POSITIONS, "interleaved", factor=0.9)
    eps = float(ml_dtypes.finfo(np_dtype).eps)
    error = np.abs(y.astype(np.float64) - expected)
    assert (error <= eps / 2 * np.abs(expected) * (1 + 1e-3) + 1e-5).all(), error.max()


@pytest.mark.parametrize("name", BACKENDS)
def test_positions_broadcast_and_2d_inputs(name, x32):
    seq = np.array([4, -1, 0, 2, 9])
    shared = rotate(name, x32, seq)
    per_batch = rotate(name, x32, np.stack([seq, seq]))
    np.testing.assert_array_equal(shared, per_batch)
    np.testing.assert_allclose(shared, reference(x32, seq), atol=2e-5)
    x2 = x32[0, 0]  # (seq, head_dim)
    np.testing.assert_allclose(rotate(name, x2, seq, layout="interleaved"),
                               reference(x2, seq, "interleaved"), atol=2e-5)
    other = POSITIONS.astype(np.int32)  # any integer dtype
    np.testing.assert_array_equal(rotate(name, x32, other), rotate(name, x32, POSITIONS))


@pytest.mark.parametrize("name", BACKENDS)
def test_inv_freq_replaces_theta(name, x32):
    inv_freq = np.array([0.5, 0.25, 0.1, 0.01], np.float32)
    y = rotate(name, x32, POSITIONS, inv_freq=inv_freq, theta=3.0)
    np.testing.assert_allclose(y, reference(x32, POSITIONS, inv_freq=inv_freq), atol=2e-5)


def test_scores_depend_only_on_the_distance():
    """q at p and k at p': q·k depends only on p - p' (times factor²)."""
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((2, 1, 8))
    for layout in LAYOUTS:
        def score(p, p2, layout=layout):
            rq = na.rotary_embedding(q, np.array([p]), layout=layout, attention_factor=1.5)
            rk = na.rotary_embedding(k, np.array([p2]), layout=layout, attention_factor=1.5)
            return float(rq[0] @ rk[0])

        base = score(3, 0)
        for shift in (-7, 1, 50, 1000):
            assert abs(score(3 + shift, shift) - base) < 1e-10 * max(1.0, abs(base))
        assert abs(score(3, 0) - score(0, 3)) > 1e-3  # the sign of the distance matters
        plain = float(q[0] @ k[0]) * 1.5**2
        assert abs(score(5, 5) - plain) < 1e-10


# ------------------------------------------------------------------------------------------
# Gradients
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_numpy_vjp_matches_finite_differences(layout):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 6))
    positions = np.array([1, -4, 9])
    g = rng.standard_normal(x.shape)
    kwargs = {"layout": layout, "rotary_dim": 4, "attention_factor": 0.7}
    grad = na.rotary_embedding_vjp(x, positions, g, **kwargs)
    numeric = np.zeros_like(x)
    h = 1e-6
    for index in np.ndindex(*x.shape):
        step = np.zeros_like(x)
        step[index] = h
        plus = na.rotary_embedding(x + step, positions, **kwargs)
        minus = na.rotary_embedding(x - step, positions, **kwargs)
        numeric[index] = np.sum(g * (plus - minus)) / (2 * h)
    np.testing.assert_allclose(grad, numeric, atol=1e-8)
    np.testing.assert_array_equal(grad[..., 4:], g[..., 4:])


def test_jax_grad_jit_and_vmap_match_numpy(x32):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import jax_attn as ja

    g = np.random.default_rng(4).standard_normal(SHAPE).astype(np.float32)
    for layout in LAYOUTS:
        expected = na.rotary_embedding_vjp(x32, POSITIONS, g, layout=layout, rotary_dim=6)
        fn = jax.jit(lambda x, p, layout=layout: ja.rotary_embedding(
            x, p, layout=layout, rotary_dim=6))
        grad = jax.grad(lambda x, fn=fn: jnp.sum(fn(x, POSITIONS) * g))(jnp.asarray(x32))
        np.testing.assert_allclose(np.asarray(grad), expected, atol=1e-5)
        vjp = ja.rotary_embedding_vjp(x32, POSITIONS, g, layout=layout, rotary_dim=6)
        np.testing.assert_allclose(np.asarray(vjp), expected, atol=1e-5)
        mapped = jax.vmap(fn)(jnp.asarray(x32), jnp.asarray(POSITIONS))  # (seq,) each
        np.testing.assert_allclose(np.asarray(mapped), np.asarray(fn(x32, POSITIONS)),
                                   atol=1e-6)


def test_torch_autograd_matches_numpy(x32):
    torch = pytest.importorskip("torch")
    import torch_attn as ta

    g = np.random.default_rng(5).standard_normal(SHAPE)
    x = x32.astype(np.float64)
    for layout in LAYOUTS:
        expected = na.rotary_embedding_vjp(x, POSITIONS, g, layout=layout, attention_factor=2.0)
        xt = torch.tensor(x, requires_grad=True)
        out = ta.rotary_embedding(xt, torch.tensor(POSITIONS), layout=layout,
                                  attention_factor=2.0)
        (grad,) = torch.autograd.grad(out, xt, torch.tensor(g))
        np.testing.assert_allclose(grad.numpy(), expected, atol=1e-12)
        vjp = ta.rotary_embedding_vjp(x, POSITIONS, g, layout=layout, attention_factor=2.0)
        np.testing.assert_allclose(vjp.numpy(), expected, atol=1e-12)


# ------------------------------------------------------------------------------------------
# Errors: the same type and message in every backend
# ------------------------------------------------------------------------------------------

X = np.zeros((1, 2, 3, 8), np.float32)
P = np.arange(3)
ERRORS = [
    ("x int", {"x": np.zeros((2, 3, 8), np.int32)}, TypeError, "x must be float16"),
    ("x 1-D", {"x": np.zeros(8, np.float32), "positions": np.arange(1)}, ValueError,
     "at least 2 axes"),
    ("positions float", {"positions": np.arange(3.0, dtype=np.float32)}, TypeError,
     "positions must be an integer"),
    ("positions bool", {"positions": np.ones(3, bool)}, TypeError, "positions.dtype=bool"),
    ("positions shape", {"positions": np.arange(4)}, ValueError,
     "got positions.shape=(4,), x.shape=(1, 2, 3, 8)"),
    ("positions list", {"positions": [0, 1, 2]}, TypeError, "positions must be an array"),
    ("layout", {"layout": "rotate_half"}, ValueError, "layout must be 'half'"),
    ("rotary_dim odd", {"rotary_dim": 3}, ValueError, "rotary_dim=3, head_dim=8"),
    ("rotary_dim big", {"rotary_dim": 10}, ValueError, "rotary_dim=10, head_dim=8"),
    ("rotary_dim 0", {"rotary_dim": 0}, ValueError, "rotary_dim must be an even int"),
    ("head_dim odd", {"x": np.zeros((2, 3, 5), np.float32)}, ValueError,
     "rotary_dim=None, head_dim=5"),
    ("inv_freq shape", {"inv_freq": np.ones(3, np.float32)}, ValueError,
     "inv_freq.shape=(3,), rotary_dim=8"),
    ("inv_freq int", {"inv_freq": np.ones(4, np.int32)}, TypeError, "inv_freq must be float16"),
    ("factor 0", {"attention_factor": 0.0}, ValueError, "attention_factor must be a finite"),
    ("factor nan", {"attention_factor": float("nan")}, ValueError, "attention_factor=nan"),
    ("theta", {"theta": -1.0}, ValueError, "theta must be a finite number > 0"),
]


def _error(name, fn, *args, **kwargs):
    m = module(name)
    converted = [to_backend(name, a) if isinstance(a, np.ndarray) else a for a in args]
    kw = {k: to_backend(name, v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    with pytest.raises(Exception) as info:
        getattr(m, fn)(*converted, **kw)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("case", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_are_the_same_in_every_backend(case):
    _, change, kind, words = case
    arguments = {"x": X, "positions": P} | change
    x, positions = arguments.pop("x"), arguments.pop("positions")
    seen = {name: _error(name, "rotary_embedding", x, positions, **arguments)
            for name in BACKENDS}
    for name, (error_type, message) in seen.items():
        assert error_type is kind, (name, error_type, message)
        assert message.startswith("rotary_embedding: ") and words in message, (name, message)
    assert len({message for _, message in seen.values()}) == 1, seen


def test_vjp_and_permutation_errors_are_the_same_in_every_backend():
    cases = [
        (("rotary_embedding_vjp", X, P, np.zeros((1, 2, 3, 6), np.float32)), {}, ValueError,
         "grad_output must have the output's shape"),
        (("permute_for_rotary_layout", np.zeros((10, 4)), 3), {}, ValueError,
         "a multiple of heads"),
        (("permute_for_rotary_layout", np.zeros((8, 4)), 2), {"to": "meta"}, ValueError,
         "to must be 'half'"),
        (("permute_for_rotary_layout", np.zeros((8, 4)), 0), {}, ValueError, "heads=0"),
        (("permute_for_rotary_layout", np.zeros((8, 4)), 2), {"rotary_dim": 6}, ValueError,
         "rotary_dim=6, head_dim=4"),
    ]
    for (fn, *args), kwargs, kind, words in cases:
        seen = {name: _error(name, fn, *args, **kwargs) for name in BACKENDS}
        for name, (error_type, message) in seen.items():
            assert error_type is kind and words in message, (name, fn, message)
        assert len({message for _, message in seen.values()}) == 1, seen


def test_rope_validates_and_is_hashable():
    rope = na.RoPE(theta=5e5, layout="interleaved", rotary_dim=4,
                   scaling={"rope_type": "longrope", "short_factor": [1.0, 2.0],
                            "long_factor": [3.0, 4.0], "original_max_position_embeddings": 8,
                            "factor": 1.0})
    assert hash(rope) == hash(na.RoPE(theta=5e5, layout="interleaved", rotary_dim=4, scaling={
        "rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0],
        "original_max_position_embeddings": 8, "factor": 1.0}))
    inv, factor = rope.frequencies(16)
    assert len(inv) == 2 and factor == 1.0
    for kwargs, kind in [({"layout": "meta"}, ValueError), ({"rotary_dim": 5}, ValueError),
                         ({"theta": 0}, ValueError), ({"scaling": "yarn"}, TypeError),
                         ({"scaling": {"rope_type": "ntk"}}, ValueError),
                         ({"max_position_embeddings": 0}, ValueError)]:
        with pytest.raises(kind, match="^RoPE: "):
            na.RoPE(**kwargs)


def test_rope_is_the_same_class_in_every_backend():
    import inspect

    from conformance import spec

    for name in BACKENDS:
        assert module(name).RoPE is na.RoPE
    stub = [p.name for p in inspect.signature(spec.RoPE.__init__).parameters.values()][1:]
    assert stub == [p for p in inspect.signature(na.RoPE).parameters]


# ------------------------------------------------------------------------------------------
# The weight permutation between the layouts
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("rotary_dim", [None, 4])
def test_permutation_directions_are_inverses(name, rotary_dim):
    w = np.random.default_rng(6).standard_normal((3 * 8, 5)).astype(np.float32)  # 3 heads of 8
    m = module(name)
    for to, back in (("half", "interleaved"), ("interleaved", "half")):
        moved = m.permute_for_rotary_layout(to_backend(name, w), 3, to=to, rotary_dim=rotary_dim)
        restored = m.permute_for_rotary_layout(moved, 3, to=back, rotary_dim=rotary_dim)
        np.testing.assert_array_equal(to_numpy(name, restored), w)
        assert not np.array_equal(to_numpy(name, moved), w)
    bias = np.arange(24.0, dtype=np.float32)
    half = to_numpy(name, m.permute_for_rotary_layout(to_backend(name, bias), 3,
                                                      rotary_dim=rotary_dim))
    r = rotary_dim or 8
    expected_head = [2 * i for i in range(r // 2)] + [2 * i + 1 for i in range(r // 2)]
    expected_head += list(range(r, 8))  # Meta's (2i, 2i+1) → (i, i + r/2); the rest stays
    np.testing.assert_array_equal(half[:8], expected_head)
    np.testing.assert_array_equal(half[8:16], np.array(expected_head) + 8)


@pytest.mark.parametrize("rotary_dim", [None, 4])
def test_permuted_weights_with_half_rotation_give_the_same_scores(rotary_dim):
    """Interleaved rotation of (W x) equals the half rotation of (permuted W) x, rows permuted
    back; so q·k (the scores) is unchanged."""
    rng = np.random.default_rng(7)
    heads, head_dim, d_model, seq = 2, 8, 6, 5
    x = rng.standard_normal((seq, d_model))
    w_q, w_k = rng.standard_normal((2, heads * head_dim, d_model))
    positions = np.array([0, 3, -2, 11, 40])

    def rotated(w, layout):  # (heads, seq, head_dim)
        proj = (x @ w.T).reshape(seq, heads, head_dim).transpose(1, 0, 2)
        return na.rotary_embedding(proj, positions, layout=layout, rotary_dim=rotary_dim)

    q_meta, k_meta = rotated(w_q, "interleaved"), rotated(w_k, "interleaved")
    q_half = rotated(na.permute_for_rotary_layout(w_q, heads, rotary_dim=rotary_dim), "half")
    k_half = rotated(na.permute_for_rotary_layout(w_k, heads, rotary_dim=rotary_dim), "half")
    np.testing.assert_allclose(q_half @ k_half.transpose(0, 2, 1),
                               q_meta @ k_meta.transpose(0, 2, 1), atol=1e-12)
    back = na.permute_for_rotary_layout(q_half.transpose(0, 2, 1).reshape(heads * head_dim, seq),
                                        heads, to="interleaved", rotary_dim=rotary_dim)
    np.testing.assert_allclose(back.reshape(heads, head_dim, seq).transpose(0, 2, 1), q_meta,
                               atol=1e-12)
    assert np.abs(q_half - q_meta).max() > 0.1  # the layouts do differ tensor by tensor
