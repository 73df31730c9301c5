"""torch_attn's errors: bad inputs (NumPy arrays and tensors) and bad modules raise the
same type and message as numpy_attn, with no ``torch.`` in the message.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numpy_attn  # noqa: E402
import torch_attn  # noqa: E402

# ------------------------------------------------------------------------------------------
# Errors: same type and message as numpy_attn
# ------------------------------------------------------------------------------------------

def _a(*shape, dtype="float32"):
    return np.zeros(shape, dtype=dtype)


Q, K, V = _a(2, 4, 6, 8), _a(2, 4, 6, 8), _a(2, 4, 6, 8)
SDPA = "scaled_dot_product_attention"
BAD_INPUTS = [
    (SDPA, (_a(8), _a(8), _a(8)), {}),
    (SDPA, (_a(6, 8), K, V), {}),
    (SDPA, (Q, K, _a(2, 4, 5, 8)), {}),
    (SDPA, (Q, _a(2, 4, 6, 7), V), {}),
    (SDPA, (Q, _a(3, 4, 6, 8), _a(3, 4, 6, 8)), {}),
    (SDPA, (Q, _a(2, 3, 6, 8), _a(2, 3, 6, 8)), {}),
    (SDPA, (Q, K, _a(2, 2, 6, 8)), {}),
    (SDPA, (Q, K, V), {"mask": np.ones((5, 6), bool)}),
    (SDPA, (Q, K, V), {"mask": _a(6, 6)}),
    (SDPA, (Q, K, V), {"bias": np.zeros((6, 6), np.int64)}),
    (SDPA, (Q, K, V), {"bias": _a(3, 6, 6)}),
    (SDPA, (_a(6, 8, dtype="int64"), K, V), {}),
    (SDPA, (Q, K.astype(np.float64), V), {}),
    (SDPA, (Q, K, V.astype(np.complex64)), {}),
    (SDPA, (Q, K, V), {"window": (-1, 2)}),
    (SDPA, (Q, K, V), {"window": (1,)}),
    (SDPA, (Q, K, V), {"causal_alignment": "centre"}),
    (SDPA, (Q, K, V), {"dropout_p": 1.0}),
    (SDPA, (Q, K, V), {"dropout_p": -0.1}),
    (SDPA, (Q, K, V), {"dropout_mask": np.ones((6, 6), bool)}),
    (SDPA, (Q, K, V), {"dropout_p": 0.5, "dropout_mask": _a(6, 6)}),
    (SDPA, (Q, K, V), {"dropout_p": 0.5, "dropout_mask": np.ones((7, 6), bool)}),
    (SDPA, (Q, K, V), {"softcap": 0.0}),
    (SDPA, (Q, K, V), {"softcap": float("inf")}),
    (SDPA, (Q, K, V), {"scale": float("nan")}),
    ("attention_scores", (Q, _a(2, 4, 6, 7)), {}),
    ("attention_scores", (Q, K), {"softcap": -1}),
    ("mask_scores", (_a(6),), {}),
    ("mask_scores", (_a(6, 6),), {"mask": np.ones((6, 6), np.int64)}),
    ("mask_scores", (_a(6, 6),), {"window": "ab"}),
    ("attention_weights", (_a(6, dtype="int32"),), {}),
    ("apply_dropout", (_a(6, 6), 1.5), {}),
    ("apply_dropout", (_a(6, 6), 0.5), {"dropout_mask": np.ones((2, 6, 6), bool)}),
    ("attention_output", (_a(4, 6, 5), _a(4, 6, 8)), {}),
    ("attention_output", (_a(4, 6, 6), _a(3, 6, 8)), {}),
    ("renormalized_causal_weights", (_a(6, 6),), {"causal_alignment": "left"}),
    ("causal_mask", (-1, 3), {}),
    ("causal_mask", (3, 2.5), {}),
    ("sliding_window_mask", (3, 4, (None, -2)), {}),
    ("padding_mask", (np.array([1, 5]), 4), {}),
    ("padding_mask", (np.array([1.0, 2.0]), 4), {}),
    ("padding_mask", (np.array([1, 2]), 4), {"q_lengths": np.array([1, 2])}),
    ("padding_mask", (np.array([1, 2]), 4), {"q_lengths": np.array([1, 2, 3]), "q_len": 3}),
    ("combine_masks", (np.ones((2, 3), bool), _a(2, 3)), {}),
    ("combine_masks", (np.ones((2, 3), bool), np.ones((4, 3), bool)), {}),
]


def _to_torch(x):
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def _raised(fn):
    with pytest.raises((TypeError, ValueError)) as info:
        fn()
    return info.type, str(info.value)


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)))
def test_bad_inputs_raise_like_numpy_attn(case):
    name, args, kwargs = BAD_INPUTS[case]
    expected = _raised(lambda: getattr(numpy_attn, name)(*args, **kwargs))
    t_args = [_to_torch(a) for a in args]
    t_kwargs = {n: _to_torch(x) for n, x in kwargs.items()}
    got = _raised(lambda: getattr(torch_attn, name)(*t_args, **t_kwargs))
    assert got == expected
    assert "torch." not in got[1]


def test_example_message_of_the_brief():
    with pytest.raises(ValueError) as info:
        torch_attn.scaled_dot_product_attention(
            torch.zeros(2, 4, 6, 8), torch.zeros(2, 4, 6, 8), torch.zeros(2, 4, 5, 8)
        )
    assert str(info.value) == (
        "scaled_dot_product_attention: key and value must have the same kv_len; "
        "got key.shape=(2, 4, 6, 8), value.shape=(2, 4, 5, 8)"
    )


@pytest.mark.parametrize(
    "build",
    [
        lambda m: m.MultiHeadAttention(10, 3),
        lambda m: m.MultiHeadAttention(8, 4, num_kv_heads=3),
        lambda m: m.CausalSelfAttention(3, 2, 4, dropout_p=1.5),
        lambda m: m.SelfAttention(3, 2, 4).load_weights({"W_query": np.zeros((3, 2))}),
        lambda m: m.SelfAttention(3, 2, 4).load_weights(
            {"W_query": np.zeros((3, 2)), "W_key": np.zeros((3, 2)), "W_value": np.zeros((3, 5))}
        ),
    ],
)
def test_module_errors_like_numpy_attn(build):
    assert _raised(lambda: build(torch_attn)) == _raised(lambda: build(numpy_attn))
