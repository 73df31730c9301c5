"""MultiHeadAttention with a rotary position embedding (``rope=RoPE(...)``), in every backend:
the rotation at the right positions (prefill, decoding at a cache offset, packed sequences,
context-parallel shards), its gradients, and ``stages``.

Expected values come from a float64 reference written here (projections, the rotation of
each pair by ``p · theta^(-2i/r)``, softmax), from finite differences, or from another run of
the same module on the whole, unsplit sequence."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest

import numpy_attn
from attention_rules import context_parallel as cp
from attention_rules.rotary import RoPE
from conformance.running import backends

D_MODEL, HEADS, KV_HEADS, SEQ = 16, 4, 2, 6
HEAD_DIM = D_MODEL // HEADS
STAGES = ("q_proj", "k_proj", "v_proj", "rotated_q", "rotated_k", "scores", "weights",
          "context", "output")


@pytest.fixture(params=["numpy", pytest.param("jax", marks=pytest.mark.slow), "torch"])
def backend(request: pytest.FixtureRequest) -> backends.Backend:
    """The backends, JAX's runs marked slow (each new shape compiles: seconds)."""
    adapter = backends.get(request.param)
    if not adapter.available():
        pytest.skip(f"{request.param} not installed ({adapter.install})")
    return adapter


def _numpy(x):
    return np.asarray(x.detach() if hasattr(x, "detach") else x, np.float64)


def _x64(backend):
    """JAX with x64 on for a float64 check; nothing for the others."""
    if backend.name != "jax":
        return nullcontext()
    import jax

    return jax.enable_x64(True)


def _weights(bias: bool = True) -> dict[str, np.ndarray]:
    module = numpy_attn.MultiHeadAttention(D_MODEL, HEADS, num_kv_heads=KV_HEADS, bias=bias,
                                           rng=np.random.default_rng(7))
    rng = np.random.default_rng(8)
    return {k: v.astype(np.float64) + (0.1 * rng.standard_normal(v.shape) if k[0] == "b" else 0)
            for k, v in module.export_weights().items()}


def _module(backend, rope, bias: bool = True):
    rng = None
    if backend.name == "jax":
        import jax

        rng = jax.random.key(0)
    elif backend.name == "numpy":
        rng = np.random.default_rng(0)
    module = backend.module.MultiHeadAttention(D_MODEL, HEADS, num_kv_heads=KV_HEADS, bias=bias,
                                               rope=rope, rng=rng)
    return module.load_weights(_weights(bias))


def _rotate(x, positions, theta, layout, rotary_dim):
    """float64 reference: ``x (b, h, s, hd)`` at ``positions (b, s)``."""
    r = rotary_dim
    inv_freq = theta ** (-np.arange(0, r, 2) / r)  # (r/2,)
    angle = np.asarray(positions, np.float64)[:, None, :, None] * inv_freq  # (b, 1, s, r/2)
    cos, sin = np.cos(angle), np.sin(angle)
    first = np.arange(r // 2) if layout == "half" else np.arange(0, r, 2)
    second = first + r // 2 if layout == "half" else first + 1
    out = x.copy()
    out[..., first] = x[..., first] * cos - x[..., second] * sin
    out[..., second] = x[..., second] * cos + x[..., first] * sin
    return out


def _reference(x, positions, rope, is_causal=True, mask=None):
    """float64 forward of the module with ``_weights()``: ``(b, s, d_model)``."""
    w = _weights()
    b, s, _ = x.shape

    def project(name, heads):
        y = x @ w[f"W_{name}"] + w[f"b_{name}"]
        return y.reshape(b, s, heads, HEAD_DIM).transpose(0, 2, 1, 3)

    r = HEAD_DIM if rope.rotary_dim is None else rope.rotary_dim
    q = _rotate(project("query", HEADS), positions, rope.theta, rope.layout, r)
    k = _rotate(project("key", KV_HEADS), positions, rope.theta, rope.layout, r)
    v = project("value", KV_HEADS)
    k, v = (np.repeat(t, HEADS // KV_HEADS, axis=1) for t in (k, v))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(HEAD_DIM)
    allowed = np.ones((s, s), bool) if mask is None else mask
    if is_causal:
        allowed = allowed & np.tril(np.ones((s, s), bool))
    scores = np.where(allowed, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    context = (weights @ v).transpose(0, 2, 1, 3).reshape(b, s, -1)
    return context @ w["W_out"] + w["b_out"]


ROPES = {
    "half": RoPE(theta=100.0),
    "interleaved_partial": RoPE(theta=50.0, layout="interleaved", rotary_dim=2),
}


@pytest.fixture
def x():
    return np.random.default_rng(3).standard_normal((2, SEQ, D_MODEL))


@pytest.mark.parametrize("rope_name", list(ROPES))
def test_forward_rotates_queries_and_keys_at_their_positions(backend, x, rope_name):
    rope = ROPES[rope_name]
    positions = np.array([[5, 6, 7, 8, 9, 10], [0, 1, 2, 3, 4, 5]])
    with _x64(backend):
        got = _numpy(_module(backend, rope)(x, is_causal=True, positions=positions))
    np.testing.assert_allclose(got, _reference(x, positions, rope), rtol=1e-10, atol=1e-12)


def test_default_positions_are_0_to_seq_minus_1_and_only_relative_ones_matter(backend, x):
    """A shift of every position turns the queries and keys but not ``q · k``: the output of
    self-attention is unchanged (RoPE is relative)."""
    rope = ROPES["half"]
    with _x64(backend):
        module = _module(backend, rope)
        default = module.stages(x, is_causal=True)
        shifted = module.stages(x, is_causal=True, positions=np.arange(SEQ) + 7)
    np.testing.assert_allclose(_numpy(default["output"]),
                               _reference(x, np.tile(np.arange(SEQ), (2, 1)), rope),
                               rtol=1e-10, atol=1e-12)
    assert np.abs(_numpy(shifted["rotated_q"]) - _numpy(default["rotated_q"])).max() > 1e-3
    np.testing.assert_allclose(_numpy(shifted["output"]), _numpy(default["output"]),
                               rtol=1e-10, atol=1e-12)


def test_decode_token_by_token_at_an_offset_equals_forward(backend, x):
    """Prefill 2 tokens, then decode 1, 1, 2: each step's tokens at cache length + 0..n-1."""
    with _x64(backend):
        module = _module(backend, ROPES["interleaved_partial"])
        whole = _numpy(module(x, is_causal=True))
        out, cache = module.decode(x[:, :2], max_len=SEQ)
        parts = [_numpy(out)]
        for start, stop in ((2, 3), (3, 4), (4, 6)):
            out, cache = module.decode(x[:, start:stop], cache)
            parts.append(_numpy(out))
    np.testing.assert_allclose(np.concatenate(parts, axis=1), whole, rtol=1e-10, atol=1e-12)


def test_packed_positions_restarting_per_sequence_equal_separate_runs(backend, x):
    """Two sequences (4 and 2 tokens) packed in one row, positions restarting at 0, a
    block-diagonal causal mask: each equals its own run."""
    lengths = (4, 2)
    packed = np.concatenate([x[0, :4], x[1, :2]])[None]  # (1, 6, d_model)
    positions = np.concatenate([np.arange(n) for n in lengths])[None]  # (1, 6)
    segment = np.repeat(np.arange(len(lengths)), lengths)
    mask = segment[:, None] == segment[None, :]  # (6, 6): same sequence
    with _x64(backend):
        module = _module(backend, ROPES["half"])
        got = _numpy(module(packed, mask=mask, is_causal=True, positions=positions))
        alone = [_numpy(module(x[0:1, :4], is_causal=True)),
                 _numpy(module(x[1:2, :2], is_causal=True))]
    np.testing.assert_allclose(got, np.concatenate(alone, axis=1), rtol=1e-10, atol=1e-12)


def test_a_context_parallel_shard_rotated_at_its_global_positions_equals_the_whole():
    """Zig-zag layout over 2 ranks: each rank rotates its shard's queries and keys at the
    global positions of its tokens; context-parallel attention over the shards equals the
    unsharded module's context, in layout order."""
    rope, world = ROPES["half"], 2
    x = np.random.default_rng(4).standard_normal((2, 8, D_MODEL))
    module = numpy_attn.MultiHeadAttention(D_MODEL, HEADS, num_kv_heads=KV_HEADS, rope=rope,
                                           rng=np.random.default_rng(0)).load_weights(_weights())
    order = np.array(cp.positions(8, world, True))  # global position of each layout slot
    whole = module.stages(x, is_causal=True)
    shard_len = 8 // world
    rotated = {"rotated_q": [], "rotated_k": []}
    for rank in range(world):
        slots = order[rank * shard_len:(rank + 1) * shard_len]
        shard = module.stages(x[:, slots], positions=slots)
        for name in rotated:
            rotated[name].append(shard[name])
    q, k = (np.concatenate(rotated[n], axis=-2) for n in ("rotated_q", "rotated_k"))
    v = whole["v_proj"][..., order, :]
    context = numpy_attn.context_parallel_attention(q, k, v, world_size=world, is_causal=True,
                                                    load_balance=True)
    np.testing.assert_allclose(context, whole["context"][..., order, :], rtol=1e-10, atol=1e-12)


def test_cross_attention_keys_sit_at_0_to_kv_len_minus_1_unless_key_positions(backend, x):
    rope = ROPES["half"]
    context = np.random.default_rng(5).standard_normal((2, 4, D_MODEL))
    with _x64(backend):
        module = _module(backend, rope)
        default = module.stages(x, context, positions=np.arange(SEQ) + 3)
        explicit = module.stages(x, context, positions=np.arange(SEQ) + 3,
                                 key_positions=np.arange(4))
        moved = module.stages(x, context, key_positions=np.arange(4) + 2)
        with pytest.raises(ValueError, match="key_positions is for cross-attention"):
            module(x, key_positions=np.arange(SEQ))
    np.testing.assert_array_equal(_numpy(default["output"]), _numpy(explicit["output"]))
    k = _numpy(default["k_proj"])
    expected = _rotate(k, np.tile(np.arange(4), (2, 1)), rope.theta, "half", HEAD_DIM)
    np.testing.assert_allclose(_numpy(default["rotated_k"]), expected, rtol=1e-10, atol=1e-12)
    assert np.abs(_numpy(moved["rotated_k"]) - expected).max() > 1e-3


def test_a_bad_rope_is_refused_with_the_same_error_in_every_backend(backend):
    rng = None if backend.name == "torch" else (
        np.random.default_rng(0) if backend.name == "numpy" else __import__("jax").random.key(0))
    with pytest.raises(TypeError, match="rope must be a RoPE or None"):
        backend.module.MultiHeadAttention(D_MODEL, HEADS, rope={"theta": 1.0}, rng=rng)
    with pytest.raises(ValueError, match="rotary_dim"):
        backend.module.MultiHeadAttention(D_MODEL, HEADS, rope=RoPE(rotary_dim=8), rng=rng)


def test_stages_in_order_and_forward_equals_their_output(backend, x):
    with _x64(backend):
        for rope in (None, ROPES["half"]):
            module = _module(backend, rope)
            stages = module.stages(x, is_causal=True)
            forward = _numpy(module(x, is_causal=True))
            assert tuple(stages) == STAGES
            np.testing.assert_allclose(_numpy(stages["output"]), forward, rtol=1e-14,
                                       atol=1e-15)
            assert _numpy(stages["scores"])[0, 0, 0, 1] == -np.inf  # masked: -inf
            if rope is None:
                np.testing.assert_array_equal(_numpy(stages["rotated_q"]),
                                              _numpy(stages["q_proj"]))
                np.testing.assert_array_equal(_numpy(stages["rotated_k"]),
                                              _numpy(stages["k_proj"]))
    shapes = {n: _numpy(v).shape for n, v in stages.items()}
    assert shapes["k_proj"] == (2, KV_HEADS, SEQ, HEAD_DIM)
    assert shapes["scores"] == shapes["weights"] == (2, HEADS, SEQ, SEQ)
    assert shapes["context"] == (2, HEADS, SEQ, HEAD_DIM)
    assert shapes["output"] == (2, SEQ, D_MODEL)


def test_three_backends_give_the_same_stages(backend, x):
    positions = np.array([[2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4]])
    rope = ROPES["interleaved_partial"]
    expected = _module_numpy(rope).stages(x, is_causal=True, positions=positions)
    with _x64(backend):
        got = _module(backend, rope).stages(x, is_causal=True, positions=positions)
    for name in STAGES:
        np.testing.assert_allclose(_numpy(got[name]), expected[name], rtol=1e-10, atol=1e-12,
                                   err_msg=name)


def _module_numpy(rope):
    return numpy_attn.MultiHeadAttention(
        D_MODEL, HEADS, num_kv_heads=KV_HEADS, rope=rope, rng=np.random.default_rng(0)
    ).load_weights(_weights())


def test_numpy_gradients_through_the_rotation_equal_finite_differences(x):
    rope = ROPES["interleaved_partial"]
    positions = np.array([[3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5]])
    module = _module_numpy(rope)
    grad_output = np.random.default_rng(6).standard_normal((2, SEQ, D_MODEL))
    grads = module.parameter_gradients(x, grad_output, is_causal=True, positions=positions)
    weights = module.export_weights()
    eps = 1e-6
    for name in ("W_query", "W_key", "b_query"):
        for index in [(0,), (1,), (5,)] if name[0] == "b" else [(0, 0), (3, 5), (7, 1)]:
            loss = []
            for sign in (1, -1):
                changed = {k: v.copy() for k, v in weights.items()}
                changed[name][index] += sign * eps
                out = _module_numpy(rope).load_weights(changed)(x, is_causal=True,
                                                                positions=positions)
                loss.append(float((out * grad_output).sum()))
            numeric = (loss[0] - loss[1]) / (2 * eps)
            assert abs(grads[name][index] - numeric) < 1e-6 * max(1.0, abs(numeric)), name


def test_gradients_agree_across_backends(backend, x):
    rope = ROPES["half"]
    positions = np.array([[1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 2]])
    grad_output = np.random.default_rng(6).standard_normal((2, SEQ, D_MODEL))
    expected = _module_numpy(rope).parameter_gradients(x, grad_output, is_causal=True,
                                                       positions=positions)
    with _x64(backend):
        got = _module(backend, rope).parameter_gradients(x, grad_output, is_causal=True,
                                                         positions=positions)
    assert set(got) == set(expected)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-9, atol=1e-11,
                                   err_msg=name)
