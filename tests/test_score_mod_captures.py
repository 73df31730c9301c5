"""Gradients to the arrays a ``score_mod`` captures (``spec.SCORE_MOD``, FlexAttention's rule):
in torch_attn and jax_attn a tensor or array the callable closes over (a closure cell, or an
attribute of a callable object) gets its gradient at every size: at 64 tokens (the explicit
steps) and at 512 (where a mod capturing nothing takes the blocked fast path, whose custom
gradient knows only its inputs). The captured gradient and the query, key and value gradients
equal a float64 reference written here (autodiff through the formula), also under
``jax.jit(jax.grad(...))``; a finite difference checks the reference's captured gradient.
"""

from __future__ import annotations

import numpy as np
import pytest

import attention_rules as rules

HEADS, HEAD_DIM = 4, 8
SIZES = (64, 512)  # 512: 4 heads x 512 x 512 = 2**20 scores, the blocked paths' size
_R = np.random.default_rng(11)


def _inputs(tokens: int) -> dict[str, np.ndarray]:
    """float64 query, key, value, output cotangent, a relative bias table and head weights."""
    shape = (1, HEADS, tokens, HEAD_DIM)
    return {"query": _R.standard_normal(shape), "key": _R.standard_normal(shape),
            "value": _R.standard_normal(shape), "grad": _R.standard_normal(shape),
            "table": 0.5 * _R.standard_normal((HEADS, 2 * tokens - 1)),
            "weight": 1.0 + 0.3 * _R.standard_normal(HEADS)}


def _table_mod(table, tokens: int):
    """``score + table[head, q_idx - kv_idx + tokens - 1]``: a closure over ``table``."""
    def score_mod(score, batch, head, q_idx, kv_idx):
        return score + table[head, q_idx - kv_idx + tokens - 1]
    return score_mod


class _HeadScale:
    """``score · weight[head]``: a callable object holding ``weight`` as an attribute."""

    def __init__(self, weight) -> None:
        self.weight = weight

    def __call__(self, score, batch, head, q_idx, kv_idx):
        return score * self.weight[head]


MODS = {"table": lambda arrays, tokens: _table_mod(arrays, tokens),
        "weight": lambda arrays, tokens: _HeadScale(arrays)}


def _reference(xp, softmax, query, key, value, score_mod, tokens):
    """The formula, whole: ``softmax(score_mod(q kᵀ / √d)) @ v``."""
    scores = query @ xp.swapaxes(key, -1, -2) * HEAD_DIM ** -0.5
    idx = xp.arange(tokens)
    scores = score_mod(scores, 0, xp.arange(HEADS)[:, None, None], idx[:, None], idx)
    return softmax(scores, -1) @ value


def _close(name: str, got, want, tokens: int, what: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.max(np.abs(got - want))
    assert err <= 1e-9 * (1 + np.max(np.abs(want))), (
        f"{name}: max |diff| {err:.3g} [{what} vs float64 reference, tokens={tokens}]")


def _fast_path_size(tokens: int, backend: str) -> bool:
    """Whether ``tokens`` reach the blocked fast path's size for this backend."""
    blocked = rules.FAST_PATHS[backend]["blocked"]
    shape = (1, HEADS, tokens, HEAD_DIM)
    return rules.large_enough(shape, shape, shape, blocked["min_scores"], blocked["min_q_len"])


def test_sizes_reach_the_fast_paths():
    assert not _fast_path_size(64, "jax_attn")
    assert _fast_path_size(512, "torch_attn") and _fast_path_size(512, "jax_attn")


def test_captures_rule():
    """What ``rules.mods.captures`` looks into, with "a string 'x'" standing for an array."""
    def wanted(value):
        return value == "x"

    x = "x"
    assert rules.mods.captures(lambda s, *i: s + len(x), wanted)  # a closure cell
    assert rules.mods.captures(lambda s, *i, w=[x]: s, wanted)  # a default, in a list
    assert rules.mods.captures(_HeadScale({"w": x}), wanted)  # an attribute, in a dict
    assert not rules.mods.captures(lambda s, *i: s, wanted)
    assert not rules.mods.captures(None, wanted)


# ------------------------------------------------------------------------------------------
# torch_attn
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(MODS))
@pytest.mark.parametrize("tokens", SIZES)
def test_torch_captured_gradient(tokens, kind):
    torch = pytest.importorskip("torch")
    import torch_attn

    arrays = _inputs(tokens)
    grads = {}
    for run in ("torch_attn", "reference"):
        q, k, v, captured = (torch.tensor(arrays[n], requires_grad=True)
                             for n in ("query", "key", "value", kind))
        mod = MODS[kind](captured, tokens)
        if run == "torch_attn":
            out = torch_attn.scaled_dot_product_attention(q, k, v, score_mod=mod)
        else:
            out = _reference(torch, torch.softmax, q, k, v, mod, tokens)
        (out * torch.tensor(arrays["grad"])).sum().backward()
        assert captured.grad is not None, f"torch_attn: no gradient for {kind}, tokens={tokens}"
        grads[run] = [x.grad.numpy() for x in (q, k, v, captured)]
    for name, got, want in zip(("query", "key", "value", kind), *grads.values(), strict=True):
        _close(name, got, want, tokens, "torch_attn")


def test_torch_constant_captures_keep_the_fast_path():
    """A captured tensor without requires_grad (or under no_grad) leaves the fast path on."""
    torch = pytest.importorskip("torch")
    from torch_attn import _fast

    arrays = _inputs(512)
    q, k, v = (torch.tensor(arrays[n]) for n in ("query", "key", "value"))
    table = torch.tensor(arrays["table"], requires_grad=True)

    def path(captured):
        args = rules.attention_arguments(
            "f", (tuple(q.shape), "float64"), (tuple(k.shape), "float64"),
            (tuple(v.shape), "float64"), score_mod=_table_mod(captured, 512))
        return _fast.use_fast_path(q, k, v, None, None, args)

    assert path(table.detach()) == "blocked"
    with torch.no_grad():
        assert path(table) == "blocked"
    assert path(table) is None


def test_torch_reference_captured_gradient_by_finite_difference():
    torch = pytest.importorskip("torch")
    arrays = _inputs(16)
    q, k, v, g = (torch.tensor(arrays[n]) for n in ("query", "key", "value", "grad"))
    weight = torch.tensor(arrays["weight"], requires_grad=True)

    def loss(w):
        return (_reference(torch, torch.softmax, q, k, v, _HeadScale(w), 16) * g).sum()

    loss(weight).backward()
    step = 1e-6
    for h in range(HEADS):
        e = torch.zeros(HEADS, dtype=torch.float64)
        e[h] = step
        with torch.no_grad():
            numeric = (loss(weight + e) - loss(weight - e)) / (2 * step)
        assert abs(float(numeric) - float(weight.grad[h])) <= 1e-6 * (1 + abs(float(numeric)))


# ------------------------------------------------------------------------------------------
# jax_attn
# ------------------------------------------------------------------------------------------


def _jax_grads(arrays, kind, tokens, attend, jit):
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, captured):
        out = attend(q, k, v, MODS[kind](captured, tokens))
        return jnp.sum(out * arrays["grad"])

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    grad = jax.jit(grad) if jit else grad
    return [np.asarray(x) for x in grad(*(jnp.asarray(arrays[n])
                                          for n in ("query", "key", "value", kind)))]


@pytest.mark.parametrize(("tokens", "kind", "jit"), [  # slow but for 3: a compile each
    pytest.param(tokens, kind, jit, id=f"{tokens}-{kind}-{'jit' if jit else 'eager'}",
                 marks=() if (tokens, kind, jit) in ((64, "table", False), (64, "weight", True),
                                                     (512, "weight", True))
                 else pytest.mark.slow)
    for tokens in SIZES for kind in sorted(MODS) for jit in (False, True)])
def test_jax_captured_gradient(tokens, kind, jit, x64_on):
    jax = pytest.importorskip("jax")
    import jax_attn

    arrays = _inputs(tokens)

    def attend(q, k, v, mod):
        return jax_attn.scaled_dot_product_attention(q, k, v, score_mod=mod)

    def reference(q, k, v, mod):
        return _reference(jax.numpy, jax.nn.softmax, q, k, v, mod, tokens)

    got = _jax_grads(arrays, kind, tokens, attend, jit)
    want = _jax_grads(arrays, kind, tokens, reference, False)
    for name, g, w in zip(("query", "key", "value", kind), got, want, strict=True):
        _close(name, g, w, tokens, "jax_attn" + (" under jit" if jit else ""))


def test_torch_blockwise_refuses_captured_gradients():
    """blockwise_attention's custom backward knows only its inputs: a loud error, never a
    silent None, for a captured tensor requiring grad; a detached one runs."""
    torch = pytest.importorskip("torch")
    import torch_attn

    arrays = _inputs(16)
    q, k, v = (torch.tensor(arrays[n]) for n in ("query", "key", "value"))
    table = torch.tensor(arrays["table"], requires_grad=True)
    with pytest.raises(NotImplementedError, match="blockwise_attention: a score_mod"):
        torch_attn.blockwise_attention(q, k, v, score_mod=_table_mod(table, 16))
    out = torch_attn.blockwise_attention(q, k, v, score_mod=_table_mod(table.detach(), 16))
    want = _reference(torch, torch.softmax, q, k, v, _table_mod(table.detach(), 16), 16)
    _close("output", out, want, 16, "torch_attn.blockwise_attention")
