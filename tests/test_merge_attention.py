"""Merging partial results (``spec.MERGING``): ``merge_attention`` over disjoint key sets equals
the attention over their union, and ``merge_attention_vjp`` (numpy_attn by hand, jax_attn and
torch_attn by autodiff) equals central finite differences.

The parts are computed with ``return_lse`` and without sinks; the sinks join once, in the merge.
Expected values: the float64 reference of the full attention under the harness's tolerance rule
(``sinks_inputs``). The planted bug (a merge without its max) fails the same assertion.
"""

from __future__ import annotations

import numpy as np
import pytest
from numerics import finite_differences
from sinks_inputs import CASES, SINKS, K, Q, V, assert_close, cast, expected_values, to_backend

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
