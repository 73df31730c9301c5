"""torch_attn's context parallelism (``context_parallel.py``, ``context_blocks.py``) in this
process, where the gloo subprocess of ``tests/test_context_parallel.py`` (tens of seconds) does
not look: the function's and each input's name in the messages, 2-D inputs, the query's length in
the layout check, top-left causal cross-attention, no FutureWarning from deprecated collectives,
and which arguments the ranks' digest compares; about a second for the file. Expected values come
from the float64 ``conformance.cases.reference`` (the whole sequence on one device,
``kv_lengths`` as a mask of the keys), never from the module against itself. The tests came from
mutation testing, run by hand on those two files (docs/mutation.md). In process, no
subprocess:

* the blocks (``attend``, ``attend_backward``, ``finish``, ``pair_band``, ``_heads``) run every
  rank of a schedule in a loop, as the ring's ranks call them;
* the public functions run on a process group of ONE gloo rank made in this process (a
  ``HashStore``, no port), so every strategy's code runs with its collectives trivial;
* the digest comparison runs as rank 0 of 2, the other rank's call given and the two
  collectives stood in for by lists. What needs several real ranks is the gloo subprocess.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import attention_rules as rules  # noqa: E402
from attention_rules import context_parallel as cp  # noqa: E402
from conformance.cases import reference  # noqa: E402
from torch_attn import context_blocks as blocks  # noqa: E402
from torch_attn import context_parallel as tcp  # noqa: E402

FN = "context_parallel_attention"

# ------------------------------------------------------------------------------------------
# The blocks, every rank of a schedule in a loop
# ------------------------------------------------------------------------------------------

#: (q_len, kv_len, options, kv_lengths): zig-zag causal GQA with a padded and an empty
#: sequence, soft-cap and scale; cross-attention bottom-right with a window (pairs skipped)
BLOCK_CASES = {
    "causal_lengths": (8, 8, {"is_causal": True, "softcap": 5.0, "scale": 0.6}, (5, 0)),
    "cross_window": (8, 16, {"is_causal": True, "causal_alignment": "bottom_right",
                            "window": (2, 0)}, None),
}


def _natural(q_len: int, kv_len: int, seed: int = 3) -> list[np.ndarray]:
    """float64 query (2, 4, q_len, 2), key (2, 2, kv_len, 2), value (2, 2, kv_len, 3),
    grad_output (2, 4, q_len, 3): GQA, and v_dim != head_dim."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in ((2, 4, q_len, 2), (2, 2, kv_len, 2),
                                              (2, 2, kv_len, 3), (2, 4, q_len, 3))]


def _expected(case: str):
    """The float64 reference (natural order): inputs, output, lse, gradients."""
    q_len, kv_len, options, lengths = BLOCK_CASES[case]
    q, k, v, g = _natural(q_len, kv_len)
    mask = None
    if lengths is not None:
        mask = (np.arange(kv_len)[None, :] < np.asarray(lengths)[:, None])[:, None, None, :]
    steps = reference.attention(q, k, v, mask=mask, **options)
    grads = reference.attention_vjp(q, k, v, g, mask=mask, **options)
    return (q, k, v, g), steps, grads


def _args(case: str, world: int) -> tuple[rules.Arguments, cp.Schedule]:
    q_len, kv_len, options, _ = BLOCK_CASES[case]
    args = rules.attention_arguments(
        FN, ((2, 4, q_len, 2), "float64"), ((2, 2, kv_len, 2), "float64"),
        ((2, 2, kv_len, 3), "float64"), **options)
    return args, cp.schedule("ring", world, q_len, kv_len, args.is_causal,
                             args.causal_alignment, args.window, True)


def _shards(x: np.ndarray, world: int) -> list[torch.Tensor]:
    """Zig-zag layout, cut into ``world`` shards, as float64 tensors."""
    laid = x[..., cp.positions(x.shape[-2], world, True), :]
    return [torch.tensor(s) for s in np.split(laid, world, axis=-2)]


def _gather(shards: list[torch.Tensor], world: int) -> np.ndarray:
    """The inverse of ``_shards``: natural order."""
    laid = np.concatenate([s.detach().numpy() for s in shards], axis=-2)
    return laid[..., np.argsort(cp.positions(laid.shape[-2], world, True)), :]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_blocks_run_as_the_ring_give_the_reference(case, world):
    """Each rank ``r`` attends at step ``s`` to the block of rank ``r - s`` (``attend`` merges
    it into the carried result), ``finish`` marks empty rows ``+inf``, then ``attend_backward``
    adds each block's gradients: output, lse and gradients are the reference's (1e-12). At 2
    ranks ``attend_backward`` starts from zeros (``into=None``, as all-gather and Ulysses
    call it) and the test adds the parts; at 4 it adds into the carried gradients."""
    (q, k, v, g), steps, grads = _expected(case)
    args, sched = _args(case, world)
    qs, ks, vs, gs = (_shards(x, world) for x in (q, k, v, g))
    lengths = BLOCK_CASES[case][3]
    lengths = None if lengths is None else torch.tensor(lengths)
    outputs, lses, dq, dk, dv = [], [], [], [], []
    for r in range(world):
        result = None
        for s in range(sched.steps):
            o = cp.ring_origin(world, r, s)
            result = blocks.attend(qs[r], ks[o], vs[o], lengths, sched.q_segments[r],
                                   sched.kv_segments[o], sched, args, result)
        outputs.append(result[0])
        lses.append(result[1])
    dq = [torch.zeros_like(x) for x in qs]
    dk, dv = [torch.zeros_like(x) for x in ks], [torch.zeros_like(x) for x in vs]
    for r in range(world):
        for s in range(sched.steps):
            o = cp.ring_origin(world, r, s)
            carried = (dq[r], dk[o], dv[o]) if world == 4 else None
            parts = blocks.attend_backward(qs[r], ks[o], vs[o], lengths, outputs[r],
                                           blocks.finish(lses[r]), gs[r], sched.q_segments[r],
                                           sched.kv_segments[o], sched, args, carried)
            if carried is None:
                parts = [a + b for a, b in zip((dq[r], dk[o], dv[o]), parts, strict=True)]
            dq[r], dk[o], dv[o] = parts
    np.testing.assert_allclose(_gather(outputs, world), steps.output, rtol=0, atol=1e-12)
    lse = _gather(lses, world)[..., 0]
    assert np.array_equal(np.isinf(lse), np.isinf(steps.lse))
    np.testing.assert_allclose(lse, steps.lse, rtol=0, atol=1e-12)
    for got, want in ((dq, grads.query), (dk, grads.key), (dv, grads.value)):
        np.testing.assert_allclose(_gather(got, world), want, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------
# The public functions on a process group of one gloo rank
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank():
    """The default process group: one gloo rank in this process (a ``HashStore``, no port),
    destroyed after the module's tests; an existing group is used as it is."""
    if dist.is_initialized():
        yield dist.get_world_size()
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield 1
    finally:
        dist.destroy_process_group()


def _one_rank_case() -> tuple[list[np.ndarray], dict, np.ndarray]:
    """``causal_lengths``' inputs in zig-zag order for one rank, its options, the mask."""
    q_len, kv_len, options, lengths = BLOCK_CASES["causal_lengths"]
    natural = _natural(q_len, kv_len, seed=4)
    laid = [x[..., cp.positions(x.shape[-2], 1, True), :] for x in natural]
    mask = (np.arange(kv_len)[None, :] < np.asarray(lengths)[:, None])[:, None, None, :]
    return laid, {**options, "kv_lengths": np.asarray(lengths), "load_balance": True}, mask


@pytest.mark.parametrize("strategy", cp.STRATEGIES)
def test_one_rank_gives_the_reference_forward_vjp_and_autograd(one_rank, strategy):
    """Every strategy on one rank, float64: the output, the vjp and ``backward`` through the
    autograd function are the reference's (1e-12; zig-zag of 1 rank is chunks 0 and 1, the
    natural order); float32 in, float32 out; float16 in, float16 out and gradients."""
    if one_rank != 1:
        pytest.skip("a process group of more than one rank exists in this process")
    (q, k, v, g), options, mask = _one_rank_case()
    options = {**options, "strategy": strategy}
    reference_options = {n: options[n] for n in ("is_causal", "softcap", "scale")}
    want = reference.attention(q, k, v, mask=mask, **reference_options).output
    grads = reference.attention_vjp(q, k, v, g, mask=mask, **reference_options)
    tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    output = tcp.context_parallel_attention(*tensors, **options)
    output.backward(torch.tensor(g))
    vjp = tcp.context_parallel_attention_vjp(q, k, v, g, **options)  # NumPy inputs welcome
    assert output.dtype == torch.float64
    np.testing.assert_allclose(output.detach().numpy(), want, rtol=0, atol=1e-12)
    for tensor, got, expected in zip(tensors, vjp, (grads.query, grads.key, grads.value),
                                     strict=True):
        assert got.dtype == torch.float64
        np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12)
        np.testing.assert_allclose(tensor.grad.numpy(), expected, rtol=0, atol=1e-12)
    for dtype, atol in ((torch.float32, 1e-5), (torch.float16, 5e-3)):
        small = [torch.tensor(x).to(dtype) for x in (q, k, v, g)]
        output = tcp.context_parallel_attention(*small[:3], **options)
        vjp = tcp.context_parallel_attention_vjp(*small, **options)
        assert output.dtype == dtype and all(x.dtype == dtype for x in vjp)
        np.testing.assert_allclose(output.double().numpy(), want, rtol=0, atol=atol)
        np.testing.assert_allclose(vjp[1].double().numpy(), grads.key, rtol=0, atol=4 * atol)


def test_one_rank_top_left_cross_attention_and_a_warning_free_call(one_rank):
    """4 queries over 8 keys, causal from the top left (query ``i`` sees keys ``j <= i``; the
    schedule's band follows the alignment), on one rank: the reference's output and gradients,
    every strategy. The collectives are called by their torch 2.10 names
    (``all_gather_single``, ``reduce_scatter_single``): no FutureWarning of the deprecated
    ones."""
    if one_rank != 1:
        pytest.skip("a process group of more than one rank exists in this process")
    q, k, v, g = _natural(4, 8, seed=5)
    want = reference.attention(q, k, v, is_causal=True)
    grads = reference.attention_vjp(q, k, v, g, is_causal=True)
    for strategy in cp.STRATEGIES:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            output = tcp.context_parallel_attention(q, k, v, is_causal=True, strategy=strategy)
            got = tcp.context_parallel_attention_vjp(q, k, v, g, is_causal=True,
                                                     strategy=strategy)
        np.testing.assert_allclose(output.numpy(), want.output, rtol=0, atol=1e-12)
        for x, expected in zip(got, (grads.query, grads.key, grads.value), strict=True):
            np.testing.assert_allclose(x.numpy(), expected, rtol=0, atol=1e-12)


def test_bad_calls_name_the_function_and_the_argument(one_rank):
    """Each input by name, in the forward's and the vjp's messages; 2-D inputs are not
    4-D (the shapes named as given)."""
    if one_rank != 1:
        pytest.skip("a process group of more than one rank exists in this process")
    x = torch.zeros(1, 2, 4, 2)
    for i, name in enumerate(("query", "key", "value")):
        args = [x, x, x]
        args[i] = x.tolist()
        with pytest.raises(TypeError, match=rf"^{FN}: {name} must be an array"):
            tcp.context_parallel_attention(*args)
        with pytest.raises(TypeError, match=rf"^{FN}_vjp: {name} must be an array"):
            tcp.context_parallel_attention_vjp(*args, x)
    with pytest.raises(TypeError, match=rf"^{FN}_vjp: grad_output must be an array"):
        tcp.context_parallel_attention_vjp(x, x, x, x.tolist())
    flat = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=rf"^{FN}: .* must be 4-D .*query.shape=\(4, 2\)"):
        tcp.context_parallel_attention(flat, flat, flat)
    with pytest.raises(ValueError, match=rf"^{FN}_vjp: kv_lengths must lie in \[0, 4\]"):
        tcp.context_parallel_attention_vjp(x, x, x, x, kv_lengths=[5])
    with pytest.raises(ValueError, match=rf"^{FN}: strategy must be one of"):
        tcp.context_parallel_attention(x, x, x, strategy="tree")
    odd = torch.zeros(1, 2, 3, 2)  # the query's length is checked, not the key's
    with pytest.raises(ValueError, match=rf"^{FN}: q_len and kv_len must split into 2 equal "
                       r"chunks .*q_len=3, kv_len=4"):
        tcp.context_parallel_attention(odd, x, x, load_balance=True)


def test_global_shapes_and_the_call_text():
    """``_global``: a shard's shape as the whole sequence's (axis -2 times N; rank < 2 as
    is). ``_call_text``: every argument by name, the dtype of tensors and NumPy arrays alike
    and the values of ``kv_lengths`` (a tensor or a NumPy array), so that ranks whose calls
    differ in any of them get different digests."""
    assert tcp._global(((2, 3, 5, 7), "float32"), 4) == ((2, 3, 20, 7), "float32")
    assert tcp._global(((5, 7), "float16"), 3) == ((15, 7), "float16")
    assert tcp._global(((7,), "float32"), 3) == ((7,), "float32")
    x = torch.zeros(1, 2, 4, 2)
    call = (x, x.numpy(), x.double(), None, torch.tensor([3]), "ring", True, "top_left",
            (1, 0), 0.5, None, False)
    text = tcp._call_text(call)
    assert text == ("query.shape=(1, 2, 4, 2) float32, key.shape=(1, 2, 4, 2) float32, "
                    "value.shape=(1, 2, 4, 2) float64, grad_output=None, kv_lengths=[3], "
                    "strategy='ring', is_causal=True, causal_alignment='top_left', "
                    "window=(1, 0), scale=0.5, softcap=None, load_balance=False")
    numpy_lengths = tcp._call_text(call[:4] + (np.array([3]),) + call[5:])
    assert numpy_lengths == text
    assert tcp._call_text((x.tolist(),) + call[1:]).startswith("query=[[[[0.0, 0.0]")

    class Shaped:  # a shape without a dtype: described, never raising (refused later)
        shape = (2, 3)

    assert tcp._call_text((Shaped(),) + call[1:]).startswith("query.shape=(2, 3) , key")


#: a good call's arguments after ``fn`` and ``comm``, in ``_arguments``' order
GOOD = {"query": torch.zeros(1, 2, 4, 2), "key": torch.zeros(1, 2, 4, 2),
        "value": torch.zeros(1, 2, 4, 3), "grad_output": torch.zeros(1, 2, 4, 3),
        "kv_lengths": np.array([6]), "strategy": "ring", "is_causal": False,
        "causal_alignment": "top_left", "window": None, "scale": None, "softcap": None,
        "load_balance": False}
#: per argument, another value that a rank may pass (shapes and dtypes of a shard)
OTHER = {"query": torch.zeros(1, 2, 2, 2), "key": torch.zeros(1, 2, 4, 2).double(),
         "value": torch.zeros(1, 2, 4, 2), "grad_output": torch.zeros(1, 2, 4, 3).double(),
         "kv_lengths": np.array([5]), "strategy": "all_gather", "is_causal": True,
         "causal_alignment": "bottom_right", "window": (2, 1), "scale": 0.5, "softcap": 4.0,
         "load_balance": True}


def test_a_rank_called_otherwise_makes_every_rank_raise(monkeypatch):
    """``_arguments`` on rank 0 of 2, the other rank's call given (the collectives stood in
    for by lists: the gloo subprocess of ``tests/test_context_parallel.py`` runs the real
    ones): the same call passes; where rank 0's or rank 1's call differs in any one
    argument, ValueError lists both ranks' calls."""
    import zlib

    def two_ranks(other: dict) -> None:
        text = tcp._call_text(tuple(other.values()))
        digest = zlib.crc32(text.encode())

        def gather(out: torch.Tensor, mine: torch.Tensor, comm: object) -> None:
            out.copy_(torch.tensor([int(mine[0]), digest]))

        def gather_object(texts: list, mine: str, group: object = None) -> None:
            texts[:] = [mine, text]

        monkeypatch.setattr(blocks, "all_gather_flat", gather)
        monkeypatch.setattr(dist, "all_gather_object", gather_object)

    comm = blocks.Communicator(None, 0, 2)
    two_ranks(GOOD)
    args, sched = tcp._arguments(FN, comm=comm, **GOOD)
    assert sched.world_size == 2 and sched.q_len == 8 and args.output_shape == (1, 2, 8, 3)
    for name, value in OTHER.items():
        changed = {**GOOD, name: value}
        for mine, theirs in ((GOOD, changed), (changed, GOOD)):
            two_ranks(theirs)
            rank1 = tcp._call_text(tuple(theirs.values()))
            with pytest.raises(ValueError, match=rf"^{FN}: every rank must pass shards of the "
                               rf"same shapes, dtype and options; got rank 0: .*; rank 1: ") as e:
                tcp._arguments(FN, comm=comm, **mine)
            assert str(e.value).endswith(f"; rank 1: {rank1}"), name
