"""Decoding state under long use: a KV cache cannot overflow silently, and a decoding loop keeps
no state beyond its cache (``spec.DECODING``).

* every backend: ``overflowed`` is False up to ``max_len``; an eager append past it raises and
  leaves the cache as it was;
* jax_attn under ``jit``: an append past ``max_len`` sets ``overflowed``, makes every later
  ``decode`` output NaN, and ``checkify`` with ``index_checks`` reports it;
* torch_attn: ``decode`` in ``eval()`` records no autograd history and the cache never does, over
  hundreds of steps; in training mode a step's graph holds that step only (the same number of
  nodes at every step, the saved tensors one copy of the cache), and every parameter's gradient
  (``W_key`` and ``W_value`` through this step's key and value) equals autograd on an explicit
  computation in which the earlier positions' keys and values are constants, as
  ``torch_attn.kv_cache.decode_step`` promises.

Decoded outputs are compared with the float64 causal pass (``test_kv_cache.mha_reference``
on the module's exported weights), never with the same backend's forward pass.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_kv_cache import mha_reference

D_MODEL, HEADS, MAX_LEN = 8, 2, 4


def test_overflowed_flag_and_eager_overflow_leaves_cache_unchanged(backend):
    cache = backend.module.KVCache.empty((1,), 1, MAX_LEN, 2)
    x = backend.asarray(np.ones((1, 1, MAX_LEN, 2), np.float32))
    cache = cache.append(x, x)
    assert not bool(cache.overflowed) and int(cache.length) == MAX_LEN
    one = backend.asarray(np.full((1, 1, 1, 2), 7.0, np.float32))
    with pytest.raises(ValueError, match=f"max_len={MAX_LEN}"):
        cache.append(one, one)
    assert int(cache.length) == MAX_LEN and not bool(cache.overflowed)
    np.testing.assert_array_equal(backend.to_numpy(cache.keys), np.ones((1, 1, MAX_LEN, 2)))


# ------------------------------------------------------------------------------- jax under jit


@pytest.fixture(scope="module")
def jax_decoding():
    """A small jax_attn MultiHeadAttention, its jitted decoding step (one compile for all the
    tests) and the same step under checkify's index checks."""
    jax = pytest.importorskip("jax")
    from jax.experimental import checkify

    import jax_attn

    module = jax_attn.MultiHeadAttention(D_MODEL, HEADS, rng=jax.random.key(0))

    def step(module, token, cache):
        output, cache = module.decode(token, cache)
        return output, cache, cache.overflowed

    checked = jax.jit(checkify.checkify(step, errors=checkify.index_checks))
    return jax_attn, module, jax.jit(step), checked


def test_jax_overflow_under_jit_poisons_and_flags(jax_decoding):
    jax_attn, module, step, _ = jax_decoding
    tokens = np.random.default_rng(0).standard_normal((1, MAX_LEN + 2, D_MODEL))
    tokens = tokens.astype(np.float32)
    expected = mha_reference(module.export_weights(), tokens[:, :MAX_LEN], HEADS, num_heads=HEADS)
    cache = jax_attn.KVCache.empty((1,), HEADS, MAX_LEN, D_MODEL // HEADS)
    for i in range(MAX_LEN + 2):
        output, cache, overflowed = step(module, tokens[:, i:i + 1], cache)
        output = np.asarray(output)
        assert int(cache.length) == i + 1
        if i < MAX_LEN:  # within capacity: the float64 causal pass at this position
            assert not bool(overflowed)
            np.testing.assert_allclose(output[:, 0], expected[:, i], rtol=1e-5, atol=1e-5,
                                       err_msg=f"step {i}")
            full = cache
        else:  # past it: flagged, and NaN however the write was clamped
            assert bool(overflowed) and bool(cache.overflowed), f"step {i}"
            assert np.isnan(output).all(), f"step {i}: finite output past max_len"
    with pytest.raises(ValueError, match=f"max_len={MAX_LEN}"):  # eagerly: an error, as ever
        full.append(full.key_buffer[..., :1, :], full.value_buffer[..., :1, :])


def test_jax_overflow_under_jit_reported_by_checkify(jax_decoding):
    jax_attn, module, _, checked = jax_decoding
    tokens = np.ones((1, MAX_LEN + 1, D_MODEL), np.float32)
    cache = jax_attn.KVCache.empty((1,), HEADS, MAX_LEN, D_MODEL // HEADS)
    for i in range(MAX_LEN + 1):
        error, (_, cache, _) = checked(module, tokens[:, i:i + 1], cache)
        message = error.get()
        if i < MAX_LEN:
            assert message is None, f"step {i}: {message}"
        else:
            assert message is not None and "out-of-bounds" in message


def test_jax_append_under_jit_flags_overflow(jax_decoding):
    jax = pytest.importorskip("jax")
    jax_attn = jax_decoding[0]
    append = jax.jit(lambda cache, key, value: cache.append(key, value))
    cache = jax_attn.KVCache.empty((), 1, MAX_LEN, 2)
    chunk = np.arange(6, dtype=np.float32).reshape(1, 3, 2)
    cache = append(cache, chunk, chunk)  # 3 of 4
    assert not bool(cache.overflowed)
    cache = append(cache, chunk + 10, chunk)  # 6 > 4: nothing valid is written
    assert bool(cache.overflowed) and int(cache.length) == 6
    keys = np.asarray(cache.key_buffer)
    np.testing.assert_array_equal(keys[0, 0], chunk[0, 0])
    assert np.isnan(keys[0, 1:]).all()  # the clamped write: NaN, never chunk + 10


# ------------------------------------------------------------------------------- torch autograd


def _graph(tensor) -> tuple[int, int]:
    """``(nodes, bytes)`` of the autograd graph behind ``tensor``: how many nodes it reaches and
    the bytes of the distinct tensors those nodes saved for the backward pass."""
    import torch

    nodes, seen, saved = 0, set(), {}
    stack = [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes += 1
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                if isinstance(value, torch.Tensor):
                    key = (value.data_ptr(), tuple(value.shape), tuple(value.stride()))
                    saved[key] = value.numel() * value.element_size()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return nodes, sum(saved.values())


def _torch_module(torch):
    import torch_attn

    return torch_attn.MultiHeadAttention(D_MODEL, HEADS, num_kv_heads=1,
                                         rng=torch.Generator().manual_seed(0))


STEPS = 200


def test_torch_eval_decode_keeps_no_graph(rng):
    torch = pytest.importorskip("torch", reason="pip install torch==2.13.0")
    module = _torch_module(torch).eval()  # grad mode stays on, as in a plain inference loop
    tokens = torch.from_numpy(rng.standard_normal((1, STEPS, D_MODEL)).astype(np.float32))
    cache = None
    for i in range(STEPS):
        output, cache = module.decode(tokens[:, i:i + 1], cache, max_len=STEPS)
        assert output.grad_fn is None and not output.requires_grad, f"step {i}"
    for buffer in (cache.key_buffer, cache.value_buffer):
        assert buffer.grad_fn is None and not buffer.requires_grad
    # and it decodes the float64 causal pass
    expected = mha_reference(module.export_weights(), tokens[:, -5:].numpy(), 1,
                              num_heads=HEADS)
    cache = None
    for i in range(STEPS - 5, STEPS):
        output, cache = module.decode(tokens[:, i:i + 1], cache, max_len=5)
        np.testing.assert_allclose(output[:, 0].numpy(), expected[:, i - STEPS + 5], rtol=1e-5,
                                   atol=1e-5, err_msg=f"step {i}")


@pytest.mark.slow
def test_torch_training_decode_graph_stays_one_step(rng):
    """A step's graph reaches this step's nodes only (their number is the same at every step)
    and saves one copy of the cache so far, never the graphs of the earlier steps."""
    torch = pytest.importorskip("torch", reason="pip install torch==2.13.0")
    module = _torch_module(torch).train()
    tokens = torch.from_numpy(rng.standard_normal((1, STEPS, D_MODEL)).astype(np.float32))
    cache, sizes = None, []
    for i in range(STEPS):
        output, cache = module.decode(tokens[:, i:i + 1], cache, max_len=STEPS)
        sizes.append(_graph(output))
    for buffer in (cache.key_buffer, cache.value_buffer):
        assert buffer.grad_fn is None and not buffer.requires_grad
    nodes = {n for n, _ in sizes}
    assert len(nodes) == 1, f"graph nodes per step vary: {sorted(nodes)[:3]}..{max(nodes)}"
    cache_bytes = 2 * cache.key_buffer.numel() * cache.key_buffer.element_size()  # all of it
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    assert sizes[-1][1] <= cache_bytes + weights + 4096, (sizes[-1], cache_bytes, weights)


def _explicit_last_output(torch, module, tokens):
    """The last position's output ``(batch, d_model)`` of ``module``'s causal multi-head
    attention over ``tokens (batch, seq, d_model)``, written out in plain torch ops from its
    parameters (one kv head, repeated), with the keys and values of the earlier positions
    detached: what ``decode`` promises in training mode (the cache holds values without
    history; this step's own keys and values keep theirs)."""
    head_dim = D_MODEL // HEADS

    def heads(y):  # (batch, seq, n·head_dim) → (batch, n, seq, head_dim)
        return y.reshape(y.shape[:-1] + (-1, head_dim)).transpose(1, 2)

    query = heads(tokens[:, -1:] @ module.W_query + module.b_query)  # (batch, HEADS, 1, hd)
    key, value = (tokens @ w + b for w, b in ((module.W_key, module.b_key),
                                               (module.W_value, module.b_value)))
    key, value = (torch.cat([y[:, :-1].detach(), y[:, -1:]], 1) for y in (key, value))
    key, value = heads(key), heads(value)  # (batch, 1, seq, hd): every query head's
    weights = torch.softmax(query @ key.transpose(-1, -2) * head_dim ** -0.5, -1)
    merged = (weights @ value).transpose(1, 2).reshape(tokens.shape[0], -1)  # (batch, d_model)
    return merged @ module.W_out + module.b_out


def test_torch_training_decode_gradient_of_this_step(rng):
    """Every parameter's gradient of the last step's output, W_key and W_value included (they
    reach it through this step's key and value), equals autograd on the explicit computation
    of ``_explicit_last_output``."""
    torch = pytest.importorskip("torch", reason="pip install torch==2.13.0")
    module = _torch_module(torch).double().train()
    module.load_weights({n: rng.standard_normal(w.shape)
                         for n, w in module.export_weights().items()})  # non-zero biases
    tokens = torch.from_numpy(rng.standard_normal((2, 6, D_MODEL)))
    cache = None
    for i in range(6):
        output, cache = module.decode(tokens[:, i:i + 1], cache, max_len=6)
    names = sorted(n for n, _ in module.named_parameters())
    assert {"W_key", "W_value", "b_key", "b_value"} <= set(names)
    params = [getattr(module, n) for n in names]
    got = torch.autograd.grad(output.sum(), params, allow_unused=True)
    explicit = _explicit_last_output(torch, module, tokens)
    torch.testing.assert_close(output[:, 0], explicit, rtol=0, atol=1e-12)
    expected = torch.autograd.grad(explicit.sum(), params)
    for name, g, e in zip(names, got, expected, strict=True):
        assert g is not None, f"{name}: no gradient from decode"
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12, msg=name)
