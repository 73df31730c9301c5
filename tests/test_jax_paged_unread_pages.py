"""jax_attn's paged kernel never reads what the pool holds outside a sequence's positions
(``spec.PAGED_CACHE``: entries past a sequence's last page are never read).

jax_attn copies whole pages, and an unused slot of a table shorter than the batch's longest
copies page 0 (masked); the products then met those positions with a zero weight, so a NaN or
an infinity there (another sequence's page, a freed one, the unwritten rest of a last page)
made the output NaN, where numpy_attn and torch_attn give the sequence's attention. Here the
pool is NaN (values) and +inf (keys) everywhere but at the two sequences' positions, page 0
included; the output must equal the float64 reference (``conformance.cases.reference``) eagerly and
jitted with the table traced, and the gradients must be those of the same call on a pool with
zeros in those places.
"""

from __future__ import annotations

import numpy as np
import pytest

import attention_rules
from conformance.cases import reference

HEADS, KV_HEADS, HEAD_DIM, V_DIM, BLOCK, NUM_BLOCKS = 4, 2, 8, 6, 4, 12
PAGES, LENGTHS = ([5, 2], [9, 1, 7]), (6, 11)  # sequence 0's third slot unused: page 0 there


def _small_chunks(monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    """Chunks of 2 pages (sequence 1 is two chunks, merged), in ``steps`` steps: 2, one page
    copied per step (the path of pages of ``TAKE_POSITIONS`` or more); 1, both pages copied
    at once (the path of small pages)."""
    for name, value in (("chunk", 8), ("min_kv_len", 12), ("steps", steps)):
        monkeypatch.setitem(attention_rules.SPLIT_KV, name, value)


def _case(q_len: int, fill: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``[query, key_pages, value_pages, block_table, seq_lens]`` (float32; the places no
    sequence holds: +inf keys and NaN values when ``fill``, else zeros) and the float64
    reference output of each sequence."""
    rng = np.random.default_rng(23)
    query = rng.standard_normal((2, HEADS, q_len, HEAD_DIM))
    key_pages = np.full((NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), np.inf if fill else 0.0)
    value_pages = np.full((NUM_BLOCKS, BLOCK, KV_HEADS, V_DIM), np.nan if fill else 0.0)
    expected = []
    for b, (pages, length) in enumerate(zip(PAGES, LENGTHS, strict=True)):
        keys = rng.standard_normal((KV_HEADS, length, HEAD_DIM))
        values = rng.standard_normal((KV_HEADS, length, V_DIM))
        for t in range(length):
            key_pages[pages[t // BLOCK], t % BLOCK] = keys[:, t]
            value_pages[pages[t // BLOCK], t % BLOCK] = values[:, t]
        expected.append(reference.attention(
            query[b].astype(np.float32), keys.astype(np.float32), values.astype(np.float32),
            is_causal=True, causal_alignment="bottom_right").output)
    table = np.array([PAGES[0] + [-1], PAGES[1]], np.int32)
    arrays = [query, key_pages, value_pages]
    return [x.astype(np.float32) for x in arrays] + [table, np.array(LENGTHS, np.int32)], expected


@pytest.mark.parametrize(("q_len", "steps"), [(1, 1), (2, 2)])
def test_nan_and_inf_outside_the_sequences_never_reach_the_output(monkeypatch, q_len, steps):
    pytest.importorskip("jax")
    import jax

    import jax_attn

    _small_chunks(monkeypatch, steps)
    args, expected = _case(q_len, fill=True)
    eager = np.asarray(jax_attn.paged_attention(*args))
    traced = np.asarray(jax.jit(jax_attn.paged_attention)(*args))
    for output in (eager, traced):
        assert np.isfinite(output).all(), "a NaN or inf that no sequence holds was read"
        for b in range(2):
            np.testing.assert_allclose(output[b], expected[b], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_nan_and_inf_outside_the_sequences_never_reach_the_gradients(monkeypatch):
    pytest.importorskip("jax")
    import jax

    import jax_attn

    _small_chunks(monkeypatch, 2)
    def loss(query, key_pages, value_pages, table, lens):
        output = jax_attn.paged_attention(query, key_pages, value_pages, table, lens)
        return (output * np.linspace(-1.0, 1.0, V_DIM, dtype=np.float32)).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))  # one program for both pools
    filled, clean = ([np.asarray(g) for g in grad(*_case(1, fill=fill)[0])]
                     for fill in (True, False))
    for name, got, want in zip(("query", "key_pages", "value_pages"), filled, clean,
                               strict=True):
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_traced_entry_outside_the_pool_poisons_only_its_own_sequence(monkeypatch):
    """Sequence 0's second page is ``NUM_BLOCKS + 3`` (outside the pool; under ``jit`` nothing
    can raise): its output is NaN, sequence 1's is its reference, and the gradient of a loss
    over sequence 1 alone is finite on every page sequence 1 holds (sequence 0's NaN reaches
    neither the last page, where a clipping gather would read, nor any other page of sequence 1)."""
    pytest.importorskip("jax")
    import jax

    import jax_attn

    _small_chunks(monkeypatch, 2)
    args, expected = _case(1, fill=False)
    table = args[3].copy()
    table[0, 1] = NUM_BLOCKS + 3
    table[1, 2] = NUM_BLOCKS - 1  # sequence 1's last page: where "clip" would read
    key_pages, value_pages = args[1].copy(), args[2].copy()
    key_pages[NUM_BLOCKS - 1], value_pages[NUM_BLOCKS - 1] = args[1][7], args[2][7]
    args = [args[0], key_pages, value_pages, table, args[4]]
    output = np.asarray(jax.jit(jax_attn.paged_attention)(*args))
    assert np.isnan(output[0]).all()
    np.testing.assert_allclose(output[1], expected[1], rtol=1e-5, atol=1e-5)

    def loss(key_pages, value_pages, table):  # sequence 1 only
        return jax_attn.paged_attention(args[0], key_pages, value_pages, table, args[4])[1].sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(key_pages, value_pages, table)
    for name, grad in zip(("key_pages", "value_pages"), grads, strict=True):
        held = np.asarray(grad)[[9, 1, NUM_BLOCKS - 1]]  # sequence 1's pages
        assert np.isfinite(held).all(), name
