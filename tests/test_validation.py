"""Bad inputs raise the documented exception, with the same message in every backend.

The bad inputs are ONE list, ``conformance.running.errors.ERROR_CASES`` (each names its rule of
``spec.ERRORS``, which gives the exception type). Each is checked once per backend, two ways:
the harness's own judgement (``errors.check``, what ``python -m conformance`` reports) and what
a user reads: the spec's exception type, a message that starts with the function and names the
arguments, the same words in every backend (numpy_attn's), with shapes and values printed as
plain Python values. Good inputs that look like bad ones (NumPy bools, Python ints for ints)
must keep working.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from conformance import spec
from conformance.running import backends, errors

F32 = np.float32
FRAMEWORK_REPRS = re.compile(r"torch\.|Array\(|Tensor|tensor\(|dtype\(|Size\(|Traced<")


def _raised(backend, case):
    """The exception ``case`` raises on ``backend`` (its arrays converted to the backend's)."""
    args, kwargs = case.args()
    args = [backend.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    kwargs = {k: backend.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    with pytest.raises((TypeError, ValueError)) as info:
        getattr(backend.module, case.fn)(*args, **kwargs)
    return info.value


def test_every_error_rule_has_a_case():
    assert {case.rule for case in errors.ERROR_CASES} == set(spec.ERRORS)


@pytest.mark.parametrize("case", errors.ERROR_CASES, ids=lambda c: c.name)
def test_bad_input_raises_the_spec_type_with_numpy_attn_words(backend, case):
    judged = errors.check(backend, case)  # the harness's verdict on the same call
    assert judged.passed, f"{backend.name} {case.name}: {judged.problem} ({judged.message!r})"
    error = _raised(backend, case)
    message = str(error)
    assert type(error).__name__ == spec.ERRORS[case.rule], (case.rule, message)
    assert message.startswith(f"{case.fn}: "), message
    for name in case.names:
        assert name in message, f"{case.name}: {message!r} does not name {name}"
    got = message.rpartition("got ")[2]  # the values the message quotes
    assert not FRAMEWORK_REPRS.search(got), f"not plain values: {message!r}"
    if backend.name != "numpy":  # the same words as the reference backend
        assert message == str(_raised(backends.get("numpy"), case))


def test_messages_read_as_the_spec_says(backend):
    def message(name):
        return str(_raised(backend, next(c for c in errors.ERROR_CASES if c.name == name)))

    assert message("kv_len_differs") == (
        "scaled_dot_product_attention: key and value must have the same kv_len; "
        "got key.shape=(2, 4, 6, 8), value.shape=(2, 4, 5, 8)"
    )
    assert message("query_python_list") == (
        "scaled_dot_product_attention: query must be an array (numpy.ndarray, jax.Array or "
        "torch.Tensor), not a Python list; convert it with an explicit dtype; got type(query)=list"
    )
    assert message("is_causal_string") == (
        "scaled_dot_product_attention: is_causal must be a bool (True or False); "
        "got is_causal='yes'"
    )
    assert message("vjp_grad_output_shape") == (
        "scaled_dot_product_attention_vjp: grad_output must have the output's shape "
        "(2, 4, 5, 8); got grad_output.shape=(2, 4, 5, 7)"
    )


def test_look_alikes_of_bad_inputs_are_accepted(backend):
    """NumPy bools are bools; Python ints and pairs are welcome where the spec asks for ints."""
    q = backend.asarray(np.random.default_rng(0).standard_normal((2, 3, 4)).astype(F32))
    sdpa = backend.module.scaled_dot_product_attention
    plain = backend.to_numpy(sdpa(q, q, q, is_causal=True))
    np.testing.assert_array_equal(backend.to_numpy(sdpa(q, q, q, is_causal=np.True_)), plain)
    out, _ = sdpa(q, q, q, is_causal=np.bool_(True), return_weights=np.True_)
    np.testing.assert_allclose(backend.to_numpy(out), plain, rtol=1e-5, atol=1e-6)  # explicit
    windowed = backend.to_numpy(sdpa(q, q, q, window=[1, 0]))  # a list pair
    np.testing.assert_array_equal(windowed, backend.to_numpy(sdpa(q, q, q, window=(1, 0))))
    blockwise = backend.module.blockwise_attention
    q4 = backend.asarray(np.random.default_rng(1).standard_normal((2, 1, 3, 4)).astype(F32))
    from_list = backend.to_numpy(blockwise(q4, q4, q4, kv_lengths=[2, 3], block_kv=2))
    from_array = backend.to_numpy(
        blockwise(q4, q4, q4, kv_lengths=backend.asarray(np.array([2, 3])), block_kv=2)
    )
    np.testing.assert_array_equal(from_list, from_array)
    mask = backend.to_numpy(backend.module.padding_mask([2, 3], 4, q_lengths=[1, 2], q_len=2))
    assert mask.shape == (2, 1, 2, 4)


def test_dropout_with_a_seeded_rng_repeats_and_other_seeds_differ(backend):
    """The same seed gives the same keep-mask, another seed another one, and dropout drops."""
    fn = backend.module.scaled_dot_product_attention
    gen = np.random.default_rng(0)
    q = backend.asarray(gen.standard_normal((8, 4)).astype(F32))
    k = backend.asarray(gen.standard_normal((16, 4)).astype(F32))
    v = backend.asarray(np.eye(16, dtype=F32))  # output = weights after dropout
    no_dropout = backend.to_numpy(fn(q, k, v))
    first = backend.to_numpy(fn(q, k, v, dropout_p=0.5, rng=backend.rng(1)))
    again = backend.to_numpy(fn(q, k, v, dropout_p=0.5, rng=backend.rng(1)))
    other = backend.to_numpy(fn(q, k, v, dropout_p=0.5, rng=backend.rng(2)))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other), "another seed gave the same keep-mask"
    dropped = first == 0
    assert 0.3 < dropped.mean() < 0.7, f"{dropped.mean():.2f} of the weights dropped, not ~0.5"
    np.testing.assert_allclose(first[~dropped], 2 * no_dropout[~dropped], rtol=1e-5)


def test_integers_are_recognised_by_what_they_are_not_by_their_type_name():
    """``numbers.Integral`` decides: NumPy integers pass, a look-alike named ``int…`` does not."""
    import attention_rules as rules

    class interval:  # a type whose name starts with "int" and is no integer  # noqa: N801
        def __int__(self) -> int:
            return 1

    assert rules.check_window("f", (np.int64(2), np.uint8(0))) == (2, 0)
    assert rules.check_int("f", "block_q", np.int32(4), 1) == 4
    for bad in (interval(), np.float32(2.0), np.True_, np.array(2)):
        with pytest.raises(ValueError, match="window must be a pair"):
            rules.check_window("f", (bad, 0))
