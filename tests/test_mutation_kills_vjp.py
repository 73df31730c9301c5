"""Tests that kill the mutants of numpy_attn's backward passes and fast paths (docs/mutation.md).

mutmut 3.8.1 on ``numpy_attn/backward.py`` and ``_fast/`` (``__init__.py``, ``forward.py``,
``backward.py``) left these behaviours untested: each test below fails under at least one
surviving mutant. The expected values come from outside numpy_attn: the float64
``conformance.cases.reference`` (its ``attention`` and ``attention_vjp``), central differences of a
float64 merge written here, or torch's autograd where noted; never numpy_attn against itself. Tiny
shapes, NumPy only.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from numerics import finite_differences

import numpy_attn
from conformance.cases import reference
from numpy_attn import _fast

# ------------------------------------------------------------------------------------------
# merge_attention_vjp
# ------------------------------------------------------------------------------------------

_MG = np.random.default_rng(28)
MERGE_OUTPUTS = [_MG.standard_normal((2, 2, 3, 2)) for _ in range(2)]
MERGE_LSES = [_MG.standard_normal((2, 2, 3)) * 2 for _ in range(2)]
MERGE_LSES[0][0, 1, 0] = -np.inf  # one part without a key for a row
for _lse in MERGE_LSES:
    _lse[1, 0, 2] = -np.inf  # a row no part has a key for
MERGE_GRAD_OUT = _MG.standard_normal((2, 2, 3, 2))
MERGE_GRAD_LSE = _MG.standard_normal((2, 2, 3))
MERGE_SINKS = _MG.standard_normal(2)


def _merge64(outputs: list[np.ndarray], lses: list[np.ndarray], sinks: np.ndarray | None
             ) -> tuple[np.ndarray, np.ndarray]:
    """The merge in float64, written out: ``L = log(sum exp(lse_i) + exp(sink))``, ``O = sum
    exp(lse_i - L) O_i`` (0 on a row with neither a part nor a sink)."""
    columns = list(lses)
    if sinks is not None:
        columns.append(np.broadcast_to(sinks[:, None], lses[0].shape))
    stacked = np.stack(columns)  # (parts [+ 1], ..., heads, q_len)
    top = stacked.max(axis=0)
    finite_top = np.where(np.isfinite(top), top, 0.0)
    total = np.exp(stacked - finite_top).sum(axis=0)
    with np.errstate(divide="ignore"):
        lse = np.log(total) + finite_top  # -inf on an empty row
    shares = [np.where(np.isfinite(lse), np.exp(part - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
              for part in lses]
    return sum(s[..., None] * o for s, o in zip(shares, outputs, strict=True)), lse


def _merge_fd(sinks: np.ndarray | None, grad_lse: np.ndarray | None) -> list[np.ndarray]:
    """Central differences of ``sum(dO ⊙ O) + sum(dL ⊙ L)`` (finite ``L`` only) of
    ``_merge64``: the gradients of the outputs, the lses (and the sinks)."""
    arrays = [x.copy() for x in (*MERGE_OUTPUTS, *MERGE_LSES)]
    if sinks is not None:
        arrays.append(sinks.copy())

    def loss() -> float:
        output, lse = _merge64(arrays[:2], arrays[2:4], arrays[4] if sinks is not None else None)
        value = (output * MERGE_GRAD_OUT).sum()
        if grad_lse is not None:
            value += np.where(np.isfinite(lse), lse * grad_lse, 0.0).sum()
        return float(value)

    return [finite_differences(loss, x) for x in arrays]


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("with_grad_lse", [False, True], ids=["no_grad_lse", "grad_lse"])
def test_merge_vjp_equals_finite_differences_of_a_float64_merge(with_sinks, with_grad_lse):
    """Without sinks the row no part has a key for is empty (its lse ``-inf``): its gradients
    are 0, not NaN; without ``grad_lse`` the merged lse's cotangent is 0."""
    sinks = MERGE_SINKS if with_sinks else None
    grad_lse = MERGE_GRAD_LSE if with_grad_lse else None
    got = numpy_attn.merge_attention_vjp(MERGE_OUTPUTS, MERGE_LSES, MERGE_GRAD_OUT,
                                         grad_lse=grad_lse, sinks=sinks)
    assert len(got) == (3 if with_sinks else 2)
    flat = [*got[0], *got[1]] + ([got[2]] if with_sinks else [])
    for i, (grad, want) in enumerate(zip(flat, _merge_fd(sinks, grad_lse), strict=True)):
        assert np.isfinite(grad).all(), i
        np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-8, err_msg=str(i))
    if not with_sinks:
        for grad in flat:  # the empty row
            assert not np.any(grad[1, 0, 2])


def test_merge_vjp_gradients_take_each_input_dtype():
    """float32 outputs, lses and sinks: each gradient in its input's dtype."""
    outputs = [x.astype(np.float32) for x in MERGE_OUTPUTS]
    lses = [x.astype(np.float32) for x in MERGE_LSES]
    grad_outputs, grad_lses, grad_sinks = numpy_attn.merge_attention_vjp(
        outputs, lses, MERGE_GRAD_OUT.astype(np.float32),
        grad_lse=MERGE_GRAD_LSE.astype(np.float32), sinks=MERGE_SINKS.astype(np.float32))
    assert [g.dtype for g in (*grad_outputs, *grad_lses, grad_sinks)] == [np.float32] * 5
    want = _merge_fd(MERGE_SINKS, MERGE_GRAD_LSE)
    for i, grad in enumerate((*grad_outputs, *grad_lses, grad_sinks)):
        np.testing.assert_allclose(grad, want[i], rtol=1e-4, atol=1e-5, err_msg=str(i))


_MO = [x.astype(np.float32) for x in MERGE_OUTPUTS]
_ML = [x.astype(np.float32) for x in MERGE_LSES]
_MD = MERGE_GRAD_OUT.astype(np.float32)
BAD_MERGE_VJP = {  # name: (args, kwargs, exception, words the message must hold)
    "outputs_list": (([_MO[0], [[0.0]]], _ML, _MD), {}, TypeError, "outputs[1]"),
    "lses_list": ((_MO, [_ML[0], [0.0]], _MD), {}, TypeError, "lses[1]"),
    "outputs_not_a_list": ((np.stack(_MO), _ML, _MD), {}, TypeError, "outputs"),
    "lses_not_a_list": ((_MO, np.stack(_ML), _MD), {}, TypeError, "lses"),
    "sinks_list": ((_MO, _ML, _MD), {"sinks": [0.0, 0.0]}, TypeError, "sinks"),
    "sinks_shape": ((_MO, _ML, _MD), {"sinks": np.zeros(3, np.float32)}, ValueError, "sinks"),
    "grad_output_list": ((_MO, _ML, [[0.0]]), {}, TypeError, "grad_output"),
    "grad_output_shape": ((_MO, _ML, _MD[..., :1]), {}, ValueError, "grad_output"),
    "grad_lse_list": ((_MO, _ML, _MD), {"grad_lse": [0.0]}, TypeError, "grad_lse"),
    "grad_lse_shape": ((_MO, _ML, _MD), {"grad_lse": _ML[0][..., :2]}, ValueError, "grad_lse"),
}


def _names(message: str, name: str) -> bool:
    """Whether ``message`` names the argument ``name`` as a whole word (not ``XXnameXX``)."""
    return re.search(rf"(?<![A-Za-z_]){re.escape(name)}(?![A-Za-z_])", message) is not None


@pytest.mark.parametrize("name", sorted(BAD_MERGE_VJP))
def test_merge_vjp_bad_input_names_the_function_and_argument(name):
    args, kwargs, exception, words = BAD_MERGE_VJP[name]
    with pytest.raises(exception) as info:
        numpy_attn.merge_attention_vjp(*args, **kwargs)
    message = str(info.value)
    assert message.startswith("merge_attention_vjp: ") and _names(message, words), message


# ------------------------------------------------------------------------------------------
# scaled_dot_product_attention_vjp: bad input names the function and the argument
# ------------------------------------------------------------------------------------------

_Q = np.zeros((1, 2, 3, 4), np.float32)
_BAD_ARRAYS = {  # argument: a wrong shape (a Python list is refused as well)
    "mask": np.ones(5, bool), "bias": np.zeros(5, np.float32),
    "dropout_mask": np.ones(5, bool), "sinks": np.zeros(3, np.float32),
    "alibi_slopes": np.zeros(3, np.float32), "segment_ids": np.zeros(7, np.int32),
}
_BAD_OPTIONS = {  # argument: a value the rules refuse
    "is_causal": 1, "causal_alignment": "middle", "window": (1,), "scale": "x",
    "softcap": -1.0, "dropout_p": 1.5, "chunk_size": 0, "score_mod": 3, "mask_mod": 3,
}
BAD_VJP = {f"{name}_shape": ({name: bad}, ValueError, name) for name, bad in _BAD_ARRAYS.items()}
BAD_VJP.update({f"{name}_list": ({name: [1.0]}, TypeError, name)
                for name in ("mask", "bias", "dropout_mask", "sinks", "alibi_slopes")})
BAD_VJP.update({name: ({name: bad}, (TypeError, ValueError), name)
                for name, bad in _BAD_OPTIONS.items()})


class _WrongShape:
    """A score_mod whose result does not broadcast to the scores."""

    def __call__(self, score, batch, head, q_idx, kv_idx):
        return np.zeros(5, score.dtype)

    def derivative(self, score, batch, head, q_idx, kv_idx):
        return np.ones_like(score)


BAD_VJP.update({
    "segment_ids_list_of_one": ({"segment_ids": [np.zeros(3, np.int32)]}, ValueError,
                                "segment_ids"),
    "score_mod_without_derivative": ({"score_mod": lambda s, b, h, q, k: s},
                                     NotImplementedError, "score_mod"),
    "score_mod_wrong_shape": ({"score_mod": _WrongShape()}, ValueError, "score_mod"),
})


@pytest.mark.parametrize("name", sorted(BAD_VJP))
def test_vjp_bad_option_names_the_function_and_argument(name):
    kwargs, exception, word = BAD_VJP[name]
    if "dropout_mask" in kwargs:
        kwargs = {**kwargs, "dropout_p": 0.5}
    with pytest.raises(exception) as info:
        numpy_attn.scaled_dot_product_attention_vjp(_Q, _Q, _Q, _Q, **kwargs)
    message = str(info.value)
    assert message.startswith("scaled_dot_product_attention_vjp: ") and _names(message, word), \
        message


@pytest.mark.parametrize("position", range(4))
def test_vjp_bad_array_names_the_function_and_argument(position):
    """query, key, value, grad_output: a Python list (TypeError), and a grad_output shaped
    unlike the output (ValueError)."""
    name = ("query", "key", "value", "grad_output")[position]
    arrays = [_Q] * 4
    arrays[position] = [[1.0]]
    with pytest.raises(TypeError) as info:
        numpy_attn.scaled_dot_product_attention_vjp(*arrays)
    assert str(info.value).startswith(f"scaled_dot_product_attention_vjp: {name} must"), info.value
    if name == "grad_output":
        with pytest.raises(ValueError, match=r"^scaled_dot_product_attention_vjp: grad_output"):
            numpy_attn.scaled_dot_product_attention_vjp(_Q, _Q, _Q, _Q[..., :3])


# ------------------------------------------------------------------------------------------
# The blocked VJP (_fast.fast_attention_vjp, _fast/backward.py): blocks shrunk to a few rows
# ------------------------------------------------------------------------------------------


@pytest.fixture
def blocked(monkeypatch):
    """The blocked paths for every input, in blocks of 8 queries and 8 keys; ``calls`` lists
    the paths ``fast_attention_vjp`` ran, and ``calls.forward`` those ``fast_attention`` ran."""
    for name, value in (("BLOCK_Q", 8), ("BLOCK_KV", 8), ("BLOCK_Q_BACKWARD", 8),
                        ("MIN_SCORES", 0), ("MIN_Q_LEN", 1)):
        monkeypatch.setattr(_fast, name, value)
    calls = _Calls()
    for name, record in (("fast_attention", calls.forward), ("fast_attention_vjp", calls)):
        monkeypatch.setattr(_fast, name, _spy(getattr(_fast, name), record))
    return calls


class _Calls(list):
    """The paths the VJP ran; ``forward``: those the forward pass ran."""

    def __init__(self) -> None:
        super().__init__()
        self.forward: list[str] = []


def _spy(real, record):
    def spy(path, *args, **kwargs):
        record.append(path)
        return real(path, *args, **kwargs)

    return spy


def _arrays(q_shape, k_shape, v_dim, seed=0, dtype=np.float64):
    gen = np.random.default_rng(seed)
    q = gen.standard_normal(q_shape)
    k = gen.standard_normal(k_shape)
    v = gen.standard_normal(k_shape[:-1] + (v_dim,))
    grad_out = gen.standard_normal(q_shape[:-1] + (v_dim,))
    return tuple(x.astype(dtype) for x in (q, k, v, grad_out))


def _vjp_vs_reference(calls, arrays, rtol=1e-10, **options):
    """numpy_attn's VJP (which must take the blocked path) against the float64 reference."""
    calls.clear()
    got = numpy_attn.scaled_dot_product_attention_vjp(*arrays, **options)
    assert calls == ["blocked"], "the blocked VJP did not run"
    want = reference.attention_vjp(*arrays, **options)
    names = ("query", "key", "value", "bias", "sinks")
    for name, grad in zip(names, got, strict=False):
        expected = getattr(want, name)
        if expected is None:
            assert grad is None, name
            continue
        assert grad.shape == np.shape(expected), name
        atol = rtol * max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(grad, expected, rtol=rtol, atol=atol,
                                   err_msg=f"d{name}, {sorted(options)}")
    return got


@pytest.mark.parametrize("bias_shape", [(3, 21, 19), (3, 1, 19), (3, 21, 1), (21, 19),
                                        (1, 1, 19)], ids=str)
def test_blocked_vjp_of_unbatched_inputs_with_a_broadcast_bias(blocked, bias_shape):
    """3-D ``(heads, q_len, head_dim)`` inputs: the bias's gradient is summed over the axes it
    was broadcast along, counted from the end (per head, per key, per query, shared)."""
    arrays = _arrays((3, 21, 8), (3, 19, 8), 5)
    bias = np.random.default_rng(1).standard_normal(bias_shape)
    _vjp_vs_reference(blocked, arrays, bias=bias, is_causal=True,
                      causal_alignment="bottom_right")


def test_the_fast_path_is_taken_unless_weights_or_dropout_are_asked_for(blocked):
    """``_fast.use_fast_path``: the blocks never hold the whole weights nor a keep-mask, so
    ``return_weights`` and dropout take the explicit steps; anything else (here at the shrunk
    threshold) the blocked path, forward and backward."""
    q, k, v, grad_out = _arrays((2, 9, 4), (2, 11, 4), 3, seed=4)
    keep = np.random.default_rng(5).random((2, 9, 11)) > 0.5
    numpy_attn.scaled_dot_product_attention(q, k, v)
    numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out)
    assert blocked.forward == ["blocked"] and blocked == ["blocked"]
    blocked.clear()
    blocked.forward.clear()
    output, weights = numpy_attn.scaled_dot_product_attention(q, k, v, return_weights=True)
    dropped = numpy_attn.scaled_dot_product_attention(q, k, v, dropout_p=0.5,
                                                      dropout_mask=keep)
    grads = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out, dropout_p=0.5,
                                                        dropout_mask=keep)
    assert blocked.forward == [] and blocked == []
    want = reference.attention(q, k, v)
    np.testing.assert_allclose(weights, want.weights, rtol=1e-12, atol=1e-12)
    want = reference.attention(q, k, v, dropout_p=0.5, dropout_mask=keep)
    np.testing.assert_allclose(dropped, want.output, rtol=1e-12, atol=1e-12)
    want = reference.attention_vjp(q, k, v, grad_out, dropout_p=0.5, dropout_mask=keep)
    np.testing.assert_allclose(grads[0], want.query, rtol=1e-10, atol=1e-12)


def test_half_precision_runs_the_blocks_in_float32(blocked, monkeypatch):
    """float16 inputs: ``_fast.forward`` and ``_fast.backward`` get every array in the compute
    dtype, float32 (``rules.compute_dtype``), the sinks and the VJP's extra columns included, and
    the results come back in float16 within its tolerance of the float64 reference."""
    seen: dict[str, list[str]] = {"forward": [], "vjp": [], "grads": []}

    def record(real, where, count):
        def spy(*args, **kwargs):
            seen[where].append([a.dtype.name for a in args[:count]] + [
                kwargs["sinks"].dtype.name if kwargs.get("sinks") is not None else
                args[7].dtype.name if len(args) > 7 and args[7] is not None else "-"])
            result = real(*args, **kwargs)
            if where == "vjp":  # the gradients of query, key, value and bias
                seen["grads"].append([g.dtype.name for g in result])
            return result
        return spy

    monkeypatch.setattr(_fast.forward, "blocked_attention",
                        record(_fast.forward.blocked_attention, "forward", 3))
    monkeypatch.setattr(_fast.backward, "blocked_attention_vjp",
                        record(_fast.backward.blocked_attention_vjp, "vjp", 4))
    q, k, v, grad_out = _arrays((2, 17, 8), (2, 19, 8), 5, seed=6, dtype=np.float16)
    sinks = np.array([0.5, -1.0], np.float16)
    bias = np.linspace(-1, 1, 19).astype(np.float16)
    output = numpy_attn.scaled_dot_product_attention(q, k, v, sinks=sinks, bias=bias)
    grads = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out, sinks=sinks,
                                                        bias=bias)
    assert blocked.forward == ["blocked"] and blocked == ["blocked"]
    assert seen["forward"] == [["float32"] * 4] * 2  # sdpa's and the VJP's forward pass
    assert seen["vjp"] == [["float32"] * 4 + ["-"]]
    assert seen["grads"] == [["float32"] * 4]
    assert output.dtype == np.float16 and all(g.dtype == np.float16 for g in grads)
    want = reference.attention_vjp(q, k, v, grad_out, sinks=sinks, bias=bias)
    np.testing.assert_allclose(output, reference.attention(q, k, v, sinks=sinks,
                                                           bias=bias).output,
                               rtol=2e-3, atol=2e-3)
    for got, name in zip(grads, ("query", "key", "value", "bias", "sinks"), strict=True):
        expected = getattr(want, name)
        np.testing.assert_allclose(got, expected, rtol=5e-3, atol=5e-3 * np.abs(expected).max(),
                                   err_msg=name)


def test_half_precision_query_is_scaled_in_float32(blocked):
    """float16 queries of 1.2e-7 (subnormal) with ``scale=0.1``: ``Q · scale`` underflows to 0
    in float16 but not in the compute dtype, float32, and ``dK = dSᵀ (Q · scale)`` is about
    1e-4 (``dO`` and ``V`` in the hundreds), which float16 holds."""
    gen = np.random.default_rng(7)
    q = (np.sign(gen.standard_normal((2, 9, 4))) * 1.2e-7).astype(np.float16)
    k = gen.standard_normal((2, 11, 4)).astype(np.float16)
    v, grad_out = ((gen.standard_normal(s) * 200).astype(np.float16)
                   for s in ((2, 11, 4), (2, 9, 4)))
    grad_key = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out, scale=0.1)[1]
    assert blocked == ["blocked"]
    want = reference.attention_vjp(q, k, v, grad_out, scale=0.1).key
    assert np.abs(want).max() > 1e-4
    np.testing.assert_allclose(grad_key, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


_SLOPES = 2.0 ** -np.arange(1, 5)  # ALiBi's slopes for 4 heads


class _PerHeadSlope:
    """A score_mod whose derivative depends on the head: ``score · (1 + head / 4)``."""

    def __call__(self, score, batch, head, q_idx, kv_idx):
        return score * (1.0 + 0.25 * head)

    def derivative(self, score, batch, head, q_idx, kv_idx):
        return np.broadcast_to(1.0 + 0.25 * head, np.broadcast_shapes(
            np.shape(score), np.shape(head))).astype(score.dtype)
MOD_CASES = {  # the tile adds ALiBi / applies score_mod between the product and `- lse`
    "alibi": lambda: {"alibi_slopes": _SLOPES},
    "score_mod": lambda: {"score_mod": numpy_attn.masks.softcap_mod(1.5)},
    "alibi_score_mod_bias": lambda: {"alibi_slopes": _SLOPES, "bias": np.linspace(-1, 1, 19),
                                     "score_mod": numpy_attn.masks.softcap_mod(1.5)},
    "per_head_score_mod": lambda: {"score_mod": _PerHeadSlope(), "is_causal": True},
    "softcap_alibi_chunks": lambda: {"softcap": 2.0, "alibi_slopes": _SLOPES, "chunk_size": 5,
                                     "is_causal": True},
}


@pytest.mark.parametrize("case", sorted(MOD_CASES))
def test_blocked_vjp_with_alibi_or_a_score_mod_alone(blocked, case):
    """ALiBi without a score_mod, a score_mod (not additive: a soft-cap) without ALiBi, both
    with a bias, and the soft-cap argument with ALiBi and chunks: against the float64
    reference VJP (ALiBi's slopes are constants, the score_mod's derivative is its own)."""
    arrays = _arrays((1, 4, 21, 8), (1, 2, 19, 8), 5, seed=8)
    arrays = (arrays[0] * 2,) + arrays[1:]  # scores of a few units: the soft-caps bend them
    _vjp_vs_reference(blocked, arrays, **MOD_CASES[case]())


@pytest.mark.parametrize("batch", [(), (2,)], ids=["unbatched", "batched"])
def test_blocked_vjp_with_documents_that_skip_query_blocks(blocked, batch):
    """Segment ids, no causality, 4 query blocks and 5 key blocks of 8: key block 0 is seen by
    query blocks 0 and 2 (not 1), key block 2 by query blocks 1 and 3 (not 0), key blocks 1,
    3 and 4 by no query; with and without a batch axis (the tile statuses lose one)."""
    arrays = _arrays(batch + (2, 32, 4), batch + (2, 40, 4), 3, seed=9)
    q_ids = np.broadcast_to(np.repeat([0, 2, 0, 2], 8), batch + (32,))
    kv_ids = np.broadcast_to(np.repeat(np.arange(5), 8), batch + (40,))
    grads = _vjp_vs_reference(blocked, arrays, segment_ids=(q_ids, kv_ids))
    for unseen in (slice(8, 16), slice(24, 40)):
        assert not grads[1][..., unseen, :].any() and not grads[2][..., unseen, :].any()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_blocked_vjp_where_no_query_sees_any_key(blocked, monkeypatch, dtype):
    """Segment ids that never match: no key block has a query, so no tile runs at all; every
    gradient is 0, shaped like its input, computed in float32 and returned in ``dtype``."""
    returned = []
    real = _fast.backward.blocked_attention_vjp

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        returned.append([(g.shape, g.dtype.name) for g in result[:3]])
        return result

    monkeypatch.setattr(_fast.backward, "blocked_attention_vjp", spy)
    q, k, v, grad_out = _arrays((2, 3, 9, 4), (2, 3, 11, 4), 5, seed=10, dtype=dtype)
    ids = (np.zeros((2, 9), np.int32), np.ones((2, 11), np.int32))
    grads = numpy_attn.scaled_dot_product_attention_vjp(q, k, v, grad_out, segment_ids=ids)
    assert blocked == ["blocked"]
    assert returned == [[(x.shape, "float32") for x in (q, k, v)]]
    want = reference.attention_vjp(q, k, v, grad_out, segment_ids=ids)
    for got, x, name in zip(grads[:3], (q, k, v), ("query", "key", "value"), strict=True):
        assert got.shape == x.shape and got.dtype == x.dtype, name
        assert not got.any() and not getattr(want, name).any(), name


@pytest.mark.parametrize("bias_shape", [(2, 4, 21, 1), (21, 1), (4, 1, 19)], ids=str)
def test_blocked_vjp_of_a_bias_with_sinks(blocked, bias_shape):
    """With sinks a row's weights sum to less than 1, so a bias broadcast over the keys has a
    gradient (``p_sink · rowsum(dO ⊙ O)`` per row; 0 without sinks), summed from each lane's
    own copy."""
    arrays = _arrays((2, 4, 21, 8), (2, 2, 19, 8), 5, seed=11)
    gen = np.random.default_rng(12)
    bias, sinks = gen.standard_normal(bias_shape), gen.standard_normal(4)
    grads = _vjp_vs_reference(blocked, arrays, bias=bias, sinks=sinks, window=(9, 2))
    assert np.abs(grads[3]).max() > 1e-3


