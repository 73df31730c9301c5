"""jax_attn's context parallelism (``context_parallel.py``, ``context_blocks.py``) in this
process, on a mesh of ONE device (the suite's one CPU device: every strategy's code runs, its
collectives trivial): the vjp with ``kv_lengths`` and options, float16 through all-gather, float32
computed in float32 with x64 on, ``kv_lengths`` and inputs refused by name, and the static tables
each device reads against a brute force over the mask. What needs several devices is
``tests/test_context_parallel.py``'s subprocess with 4 host devices. Expected values come from the
float64 ``conformance.cases.reference`` (the whole sequence on one device, ``kv_lengths`` as a
mask of the keys), never from the module against itself. Few programs compile: one jitted
function per test, tiny shapes. The tests came from mutation testing, run by hand on those two
files (docs/mutation.md).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from jax.sharding import Mesh  # noqa: E402

from attention_rules import context_parallel as cp  # noqa: E402
from conformance.cases import reference  # noqa: E402
from jax_attn import context_parallel as jcp  # noqa: E402

#: batch 3, 4 query heads over 2 kv heads (GQA), 8 positions, head_dim 4, v_dim 3: batch, kv
#: heads and head_dim all differ, so a head count read off another axis cuts other blocks
SHAPES = ((3, 4, 8, 4), (3, 2, 8, 4), (3, 2, 8, 3), (3, 4, 8, 3))
#: sequence 0 has 5 keys, sequence 1 none (fully masked rows: output and gradients 0), 2 all
LENGTHS = (5, 0, 8)


def _inputs(seed: int) -> list[np.ndarray]:
    """float32-representable query, key, value, grad_output (float64 arrays)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32).astype(np.float64) for s in SHAPES]


def _mesh() -> Mesh:
    """The suite's one CPU device as a mesh axis ``"seq"`` (``axis_name``'s default)."""
    return Mesh(np.array(jax.devices()[:1]), ("seq",))


def _expected(arrays: list[np.ndarray], **options: object) -> tuple:
    """The float64 reference's output and gradients, ``LENGTHS`` as a mask of the keys."""
    q, k, v, g = arrays
    mask = (np.arange(k.shape[-2]) < np.asarray(LENGTHS)[:, None])[:, None, None, :]
    out = reference.attention(q, reference.repeat_kv(k, q.shape[-3]),
                              reference.repeat_kv(v, q.shape[-3]), mask=mask, **options).output
    grads = reference.attention_vjp(q, k, v, g, mask=mask, **options)
    return out, grads.query, grads.key, grads.value


def test_vjp_on_one_device_with_lengths_and_options_gives_the_reference():
    """``context_parallel_attention_vjp`` (which the subprocess never calls: it differentiates
    ``context_parallel_attention`` with ``jax.vjp``) with ``kv_lengths``, the causal rule, a
    soft-cap and a scale, zig-zag layout (two chunks on the one device), the default strategy
    and axis name, jitted once together with the forward call: output and gradients equal the
    float64 reference's (float32 inputs, 1e-5), in float32."""
    options = {"is_causal": True, "softcap": 5.0, "scale": 0.6}
    _check_forward_and_vjp(_inputs(11), options, np.float32, 1e-5, load_balance=True)


def test_all_gather_in_float16_keeps_the_dtype_of_each_input():
    """float16 inputs through ``"all_gather"`` with a two-sided window and ``kv_lengths``
    (the gather's ``needed`` table has one row per device: here one): output and gradients are
    float16 (the subprocess checks float32 only, JAX's default dtype, which a cast to the
    default would give too) and equal the float64 reference's for the float16 inputs
    within float16 rounding (1e-2)."""
    arrays = [a.astype(np.float16).astype(np.float64) for a in _inputs(12)]
    _check_forward_and_vjp(arrays, {"window": (3, 1)}, np.float16, 1e-2, strategy="all_gather")


def _check_forward_and_vjp(arrays: list, options: dict, dtype: type, atol: float,
                           **extra: object) -> None:
    """Forward and vjp on the one-device mesh with ``LENGTHS``, ``options`` and ``extra``,
    jitted together, on ``arrays`` cast to ``dtype``: each result in ``dtype`` and within
    ``atol`` of the float64 reference's for ``arrays``."""
    call = {"mesh": _mesh(), "kv_lengths": np.asarray(LENGTHS), **extra, **options}

    @jax.jit
    def both(q, k, v, g):
        return (jcp.context_parallel_attention(q, k, v, **call),
                *jcp.context_parallel_attention_vjp(q, k, v, g, **call))

    got = both(*(a.astype(dtype) for a in arrays))
    for name, x, want in zip(("output", "grad_query", "grad_key", "grad_value"), got,
                             _expected(arrays, **options), strict=True):
        assert x.dtype == dtype, name
        np.testing.assert_allclose(np.asarray(x, np.float64), want, rtol=0, atol=atol,
                                   err_msg=name)


@pytest.mark.parametrize(("lengths", "message"), [
    (np.array([3.0, 2.0, 1.0]), "must be ints shaped like the batch axes"),
    (np.array([3, 2, 1, 0]), "must be ints shaped like the batch axes"),
    (np.array([3, 9, 1]), r"must lie in \[0, 8\]; got kv_lengths=\[3, 9, 1\]"),
], ids=["floats", "four_for_a_batch_of_three", "longer_than_the_keys"])
def test_kv_lengths_that_break_the_rules_are_refused_by_name(lengths, message):
    """``kv_lengths`` goes through the spec's rules before anything compiles: a float array,
    one length too many, or a length past ``kv_len`` is a ValueError naming the function and
    the argument, for the forward call and the vjp (the subprocess's bad calls give no
    ``kv_lengths``)."""
    q, k, v, g = (a.astype(np.float32) for a in _inputs(13))
    for fn, extra in (("context_parallel_attention", ()), ("context_parallel_attention_vjp", (g,))):
        with pytest.raises(ValueError, match=rf"^{fn}: kv_lengths {message}"):
            getattr(jcp, fn)(q, k, v, *extra, mesh=_mesh(), kv_lengths=lengths)


@pytest.mark.parametrize("strategy", ["ring", "all_gather", "ulysses"])
def test_float32_inputs_compute_in_float32_with_x64_on(x64_on, strategy):
    """With JAX's float64 switch on (``conftest.x64_on``; the harness turns it on), float32
    inputs still compute in float32: the traced program of the forward call and the vjp (no
    compile) holds no float64 array (a partial result or a gradient buffer made in JAX's
    default float dtype would be float64 there, twice the memory, and a float64 block cannot
    be written into a float32 one) and returns float32."""
    q, k, v, g = (a.astype(np.float32) for a in _inputs(14))
    call = {"mesh": _mesh(), "strategy": strategy, "kv_lengths": np.asarray(LENGTHS),
            "window": (3, 1)}
    jaxpr = jax.make_jaxpr(lambda q, k, v, g: (
        jcp.context_parallel_attention(q, k, v, **call),
        *jcp.context_parallel_attention_vjp(q, k, v, g, **call)))(q, k, v, g)
    assert re.findall(r"f64\[\d[^\]]*\]", str(jaxpr)) == []
    assert [a.dtype for a in jaxpr.out_avals] == [np.float32] * 4


@pytest.mark.parametrize("name", ["query", "key", "value"])
def test_an_input_given_as_a_list_is_refused_by_its_name(name):
    """A Python list for one input is a TypeError naming the function and that input, for the
    forward call and the vjp (the spec's ``check_array``: a list has no dtype of its own)."""
    arrays = dict(zip(("query", "key", "value", "grad_output"),
                      (a.astype(np.float32) for a in _inputs(15)), strict=True))
    arrays[name] = arrays[name].tolist()
    for fn, extra in (("context_parallel_attention", ()),
                      ("context_parallel_attention_vjp", (arrays["grad_output"],))):
        with pytest.raises(TypeError, match=rf"^{fn}: {name} must be an array"):
            getattr(jcp, fn)(arrays["query"], arrays["key"], arrays["value"], *extra,
                             mesh=_mesh())


def test_each_devices_chunks_and_needed_pairs_match_a_brute_force_over_the_mask():
    """The static tables the devices read (``_own_chunks`` for all-gather, ``_chunks`` for the
    ring at every step), for every device of 4 in the zig-zag layout of 8 positions (chunks
    of ONE row) under the causal rule: each query chunk's global start, each key chunk's at
    the block the device holds, and whether a pair is computed, against a brute force over
    the float64 reference's mask (a pair is needed iff one of its positions is allowed;
    device 0's first chunk is row 0, which sees key 0 alone). No program is compiled."""
    world, seq = 4, 8
    allowed = reference.structural_mask(seq, seq, is_causal=True)  # (q_len, kv_len)
    segs = [cp.segments(seq, world, r, True) for r in range(world)]
    gather = cp.schedule("all_gather", world, seq, seq, True, "top_left", None, True)
    for rank in range(world):
        q_starts, needed = jcp._own_chunks(gather, rank)
        assert [int(s) for s in q_starts] == [a for a, _ in segs[rank]]
        assert [bool(n) for (n,) in needed] == [bool(allowed[a:b].any()) for a, b in segs[rank]]
    ring = cp.schedule("ring", world, seq, seq, True, "top_left", None, True)
    for rank in range(world):
        for step in range(ring.steps):
            q_starts, kv_starts, needed = jcp._chunks(ring, rank, step)
            held = segs[cp.ring_origin(world, rank, step)]
            assert [int(s) for s in q_starts] == [a for a, _ in segs[rank]]
            assert [int(s) for s in kv_starts] == [a for a, _ in held]
            assert [[bool(n) for n in row] for row in needed] == [
                [bool(allowed[a:b, c:d].any()) for c, d in held] for a, b in segs[rank]]
