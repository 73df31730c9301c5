"""Merging partial results (``spec.MERGING``): ``merge_attention`` over disjoint key sets equals
the attention over their union, and ``merge_attention_vjp`` (numpy_attn by hand, jax_attn and
torch_attn by autodiff) equals central finite differences.

The parts are computed with ``return_lse`` and without sinks; the sinks join once, in the merge.
Expected values: the float64 reference of the full attention under the harness's tolerance rule
(``sinks_inputs``). The planted bug (a merge without its max) fails the same assertion.

numpy_attn's ``merge_attention_vjp`` is also held to central differences of a float64 merge
written out here (rows without a key, sinks, ``grad_lse`` or not), keeps each input's dtype, and
names the function and the argument of a bad input (tests from mutation testing,
docs/mutation.md).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from numerics import finite_differences
from sinks_inputs import CASES, SINKS, K, Q, V, assert_close, cast, expected_values, to_backend

import numpy_attn
from conformance.running import backends


def _partials(backend, dtype, case, parts):
    """The case's attention over a random split of the keys into ``parts`` disjoint sets (the
    last one empty), each computed with ``return_lse`` and without sinks."""
    options, _ = CASES[case]
    labels = np.random.default_rng(parts).integers(0, parts - 1, size=K.shape[-2])
    outputs, lses = [], []
    for part in range(parts):
        keys = np.flatnonzero(labels == part)
        sliced = {n: options[n][..., keys] for n in ("mask", "bias") if n in options}
        scalars = {n: v for n, v in options.items() if n not in ("mask", "bias")}
        output, lse = backend.module.scaled_dot_product_attention(
            to_backend(backend, Q, dtype), to_backend(backend, K[..., keys, :], dtype),
            to_backend(backend, V[..., keys, :], dtype),
            **{n: to_backend(backend, x, dtype) for n, x in sliced.items()}, **scalars,
            return_lse=True)
        outputs.append(output)
        lses.append(lse)
    return outputs, lses


def _merged_close(backend, dtype, case, output, lse):
    values, base, ref = expected_values(dtype, case)
    empty = np.broadcast_to(np.isneginf(ref.masked_scores).all(-1, keepdims=True),
                            ref.output.shape)
    assert_close("output", backend.to_numpy(output), values, base, dtype, "input", empty)
    assert_close("lse", backend.to_numpy(lse), values, base, dtype, "compute")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("case", ["mask_bias", "mask_bias_no_sinks", "large_scores"])
@pytest.mark.parametrize("backend", ["numpy", pytest.param("jax", marks=pytest.mark.slow),
                                     "torch"], indirect=True)  # jax: a compile per case
def test_merging_partial_results_gives_the_full_attention(backend, dtype, parts, case):
    """Fully masked rows (every part ``-inf``) give 0 and the sink (or ``-inf``); sinks are
    given to the merge only, never to the parts."""
    outputs, lses = _partials(backend, dtype, case, parts)
    sinks = to_backend(backend, SINKS, dtype) if CASES[case][1] else None
    output, lse = backend.module.merge_attention(outputs, lses, sinks=sinks)
    _merged_close(backend, dtype, case, output, lse)


_M = np.random.default_rng(9)
M_OUTPUTS = [_M.standard_normal((1, 2, 3, 2)) for _ in range(3)]
M_LSES = [_M.standard_normal((1, 2, 3)) * 3 for _ in range(3)]
M_LSES[1][0, 0, 1] = -np.inf  # a part without a key for one row
for lse in M_LSES:
    lse[0, 1, 2] = -np.inf  # a row that no part has a key for
M_SINKS, M_OUT, M_LSE = _M.standard_normal(2), _M.standard_normal((1, 2, 3, 2)), \
    _M.standard_normal((1, 2, 3))


def _merge_fd() -> list[np.ndarray]:
    """Central differences of ``sum(dO ⊙ O) + sum(dL ⊙ L)`` of numpy_attn's merge (the rows
    whose L is ``-inf`` left out of the loss)."""
    import numpy_attn

    arrays = [x.copy() for x in (*M_OUTPUTS, *M_LSES, M_SINKS)]

    def loss() -> float:
        output, lse = numpy_attn.merge_attention(arrays[:3], arrays[3:6], sinks=arrays[6])
        return float((output * M_OUT).sum() + np.where(np.isfinite(lse), lse * M_LSE, 0).sum())

    return [finite_differences(loss, x) for x in arrays]


def test_merge_gradients_equal_finite_differences(backend):
    """numpy_attn's hand-written ``merge_attention_vjp``, jax_attn's ``jax.vjp`` and
    torch_attn's autograd against central differences (float64); 0 where a part has no key."""
    fd = _merge_fd()
    grad_outputs, grad_lses, grad_sinks = backend.module.merge_attention_vjp(
        [backend.asarray(x) for x in M_OUTPUTS], [backend.asarray(x) for x in M_LSES],
        backend.asarray(M_OUT), grad_lse=backend.asarray(M_LSE), sinks=backend.asarray(M_SINKS))
    got = [*grad_outputs, *grad_lses, grad_sinks]
    for i, (grad, expected) in enumerate(zip(got, fd, strict=True)):
        grad = backend.to_numpy(grad)
        assert np.isfinite(grad).all(), i
        np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-8, err_msg=str(i))
    assert grad_lses[1] is not None and backend.to_numpy(grad_lses[1])[0, 0, 1] == 0.0
    output, lse = backend.module.merge_attention([backend.asarray(x) for x in M_OUTPUTS],
                                                 [backend.asarray(x) for x in M_LSES])
    assert backend.to_numpy(lse)[0, 1, 2] == -np.inf  # no part, no sink
    assert not np.any(backend.to_numpy(output)[0, 1, 2])


def _merge_without_max(outputs, lses, sinks):
    """Wrong (a planted bug): ``sum exp(lse_i) O_i / sum exp(lse_i)``, no max subtracted."""
    weights = [np.exp(lse)[..., None] for lse in lses]
    total = sum(weights) + np.exp(sinks.astype(np.float32))[:, None, None]
    output = sum(w * o for w, o in zip(weights, outputs, strict=True)) / total
    return output, np.log(total[..., 0])


def test_a_merge_without_its_max_fails_the_same_assertion():
    """Scores in the hundreds (``large_scores``): exp(lse) overflows float32."""
    numpy_backend, dtype, case = backends.get("numpy"), "float32", "large_scores"
    outputs, lses = _partials(numpy_backend, dtype, case, 3)
    merged = numpy_backend.module.merge_attention(outputs, lses, sinks=cast(SINKS, dtype))
    _merged_close(numpy_backend, dtype, case, *merged)  # the real merge passes
    with np.errstate(all="ignore"), pytest.raises(AssertionError):
        _merged_close(numpy_backend, dtype, case, *_merge_without_max(outputs, lses, SINKS))


# ------------------------------------------------------------------------------------------
# numpy_attn's merge_attention_vjp: a float64 merge's finite differences, dtypes, bad inputs
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


def _merge64_fd(sinks: np.ndarray | None, grad_lse: np.ndarray | None) -> list[np.ndarray]:
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
    for i, (grad, want) in enumerate(zip(flat, _merge64_fd(sinks, grad_lse), strict=True)):
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
    want = _merge64_fd(MERGE_SINKS, MERGE_GRAD_LSE)
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
