"""Bad inputs raise the documented exception, with the same message in every backend."""

from __future__ import annotations

import numpy as np
import pytest

from conformance import backends, spec

F32 = np.float32
Q = np.zeros((2, 4, 5, 8), F32)
K = np.zeros((2, 2, 6, 8), F32)
V = np.zeros((2, 2, 6, 3), F32)

SDPA = "scaled_dot_product_attention"

# (id, function, positional args, keyword args, exception type, text the message must contain)
BAD_INPUTS = [
    ("rank_1", SDPA, (np.zeros(8, F32), K, V), {}, ValueError, "at least 2 axes"),
    ("ranks_differ", SDPA, (Q, K[0], V[0]), {}, ValueError, "same number of axes"),
    ("kv_len", SDPA, (Q, K, V[:, :, :5]), {}, ValueError,
     "key and value must have the same kv_len; got key.shape=(2, 2, 6, 8), "
     "value.shape=(2, 2, 5, 3)"),
    ("head_dim", SDPA, (Q, K[..., :7], V), {}, ValueError, "same head_dim"),
    ("batch_axes", SDPA, (Q, K[:1], V[:1]), {}, ValueError, "same batch axes"),
    ("heads_not_divisible", SDPA, (Q[:, :3], K, V), {}, ValueError,
     "heads of query must be a multiple of the heads of key"),
    ("kv_heads_differ", SDPA, (Q, K, V[:, :1]), {}, ValueError, "kv_heads"),
    ("mask_shape", SDPA, (Q, K, V), {"mask": np.ones((5, 5), bool)}, ValueError,
     "mask must be broadcastable to the scores shape (2, 4, 5, 6); got mask.shape=(5, 5)"),
    ("mask_too_many_axes", SDPA, (Q, K, V), {"mask": np.ones((1, 2, 4, 5, 6), bool)},
     ValueError, "mask must be broadcastable"),
    ("bias_shape", SDPA, (Q, K, V), {"bias": np.ones((3, 5, 6), F32)}, ValueError,
     "bias must be broadcastable"),
    ("mask_not_bool", SDPA, (Q, K, V), {"mask": np.ones((5, 6), np.int32)}, TypeError,
     "mask must be boolean"),
    ("mask_float", SDPA, (Q, K, V), {"mask": np.ones((5, 6), F32)}, TypeError,
     "mask must be boolean"),
    ("bias_int", SDPA, (Q, K, V), {"bias": np.ones((5, 6), np.int64)}, TypeError,
     "bias must be floating point"),
    ("int_inputs", SDPA, (Q.astype(np.int32), K, V), {}, TypeError, "query must be float16"),
    ("mixed_dtypes", SDPA, (Q, K.astype(np.float64), V), {}, TypeError,
     "inputs must share one dtype"),
    ("window_negative", SDPA, (Q, K, V), {"window": (-1, 2)}, ValueError,
     "window must be a pair"),
    ("window_triple", SDPA, (Q, K, V), {"window": (1, 2, 3)}, ValueError,
     "window must be a pair"),
    ("window_float", SDPA, (Q, K, V), {"window": (1.5, 2)}, ValueError, "window must be a pair"),
    ("alignment", SDPA, (Q, K, V), {"is_causal": True, "causal_alignment": "top"}, ValueError,
     "causal_alignment must be 'top_left' or 'bottom_right'"),
    ("dropout_p_one", SDPA, (Q, K, V), {"dropout_p": 1.0}, ValueError, "dropout_p must be in"),
    ("dropout_p_negative", SDPA, (Q, K, V), {"dropout_p": -0.1}, ValueError,
     "dropout_p must be in"),
    ("dropout_mask_without_p", SDPA, (Q, K, V), {"dropout_mask": np.ones((5, 6), bool)},
     ValueError, "dropout_mask needs dropout_p > 0"),
    ("dropout_mask_not_bool", SDPA, (Q, K, V),
     {"dropout_p": 0.5, "dropout_mask": np.ones((5, 6), F32)}, TypeError,
     "dropout_mask must be boolean"),
    ("softcap_zero", SDPA, (Q, K, V), {"softcap": 0.0}, ValueError,
     "softcap must be a positive finite number"),
    ("softcap_inf", SDPA, (Q, K, V), {"softcap": float("inf")}, ValueError, "softcap"),
    ("scale_nan", SDPA, (Q, K, V), {"scale": float("nan")}, ValueError,
     "scale must be a finite number"),
    ("scores_head_dim", "attention_scores", (Q, K[..., :7]), {}, ValueError, "same head_dim"),
    ("output_kv_len", "attention_output", (np.zeros((2, 4, 5, 7), F32), V), {}, ValueError,
     "weights and value must have the same kv_len"),
    ("mask_scores_mask", "mask_scores", (np.zeros((5, 6), F32),),
     {"mask": np.ones((6, 5), bool)}, ValueError, "mask must be broadcastable"),
    ("weights_int", "attention_weights", (np.zeros((5, 6), np.int64),), {}, TypeError,
     "scores must be float16"),
    ("dropout_p_range", "apply_dropout", (np.zeros((5, 6), F32), 1.5), {}, ValueError,
     "dropout_p must be in"),
    ("renormalize_alignment", "renormalized_causal_weights", (np.zeros((5, 6), F32),),
     {"causal_alignment": "diagonal"}, ValueError, "causal_alignment"),
    ("causal_mask_negative", "causal_mask", (-1, 3), {}, ValueError, "q_len must be an int >= 0"),
    ("window_mask_bad", "sliding_window_mask", (3, 3, (1,)), {}, ValueError,
     "window must be a pair"),
    ("padding_lengths_range", "padding_mask", (np.array([2, 5]), 4), {}, ValueError,
     "kv_lengths must lie in [0, 4]"),
    ("padding_lengths_2d", "padding_mask", (np.array([[2]]), 4), {}, ValueError,
     "kv_lengths must be a 1-D array of ints"),
    ("padding_q_len_missing", "padding_mask", (np.array([2]), 4),
     {"q_lengths": np.array([1])}, ValueError, "q_lengths needs q_len"),
    ("combine_not_bool", "combine_masks", (np.ones((2, 2), F32),), {}, TypeError,
     "masks[0] must be boolean"),
    ("combine_shapes", "combine_masks", (np.ones((2, 3), bool), np.ones((3, 2), bool)), {},
     ValueError, "masks must broadcast together"),
]


def _convert(backend, x):
    if isinstance(x, np.ndarray):
        return backend.asarray(x)
    return x


def _raise(backend, fn, args, kwargs):
    call = getattr(backend.module, fn)
    args = [_convert(backend, a) for a in args]
    kwargs = {k: _convert(backend, v) for k, v in kwargs.items()}
    call(*args, **kwargs)


@pytest.mark.parametrize(
    "fn, args, kwargs, exc, text", [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_input_raises_documented_error(backend, fn, args, kwargs, exc, text):
    with pytest.raises(exc) as info:
        _raise(backend, fn, args, kwargs)
    message = str(info.value)
    assert message.startswith(f"{fn}: "), message
    assert text in message, message
    if backend.name != "numpy":  # the same words as the reference backend
        reference = backends.get("numpy")
        with pytest.raises(exc) as expected:
            _raise(reference, fn, args, kwargs)
        assert message == str(expected.value)


def test_every_error_rule_of_the_spec_is_exercised():
    # each rule of spec.ERRORS names its exception type; the cases above cover both types
    kinds = {exc.__name__ for *_, exc, _ in BAD_INPUTS}
    assert kinds == set(spec.ERRORS.values())
    assert len(BAD_INPUTS) >= len(spec.ERRORS)


def test_dropout_without_any_randomness_source_is_reproducible_only_with_rng(backend):
    fn = backend.module.scaled_dot_product_attention
    q = backend.asarray(np.ones((3, 4), F32))
    first = backend.to_numpy(fn(q, q, q, dropout_p=0.5, rng=backend.rng(1)))
    second = backend.to_numpy(fn(q, q, q, dropout_p=0.5, rng=backend.rng(1)))
    np.testing.assert_array_equal(first, second)
