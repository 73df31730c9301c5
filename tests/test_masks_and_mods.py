"""Chunked local attention, ALiBi, segment ids, ``score_mod`` and ``mask_mod``
(``spec.MASKS_AND_MODS``) in every backend: the explicit steps, the tiles of
``blockwise_attention`` and the VJPs, on small cases; the errors; planted bugs. The fast paths
and JAX's transformations, on a case large enough for several blocks, are
``tests/test_masks_and_mods_fast.py``'s.

Expected values: the float64 reference of ``masks_reference`` (the rules written out position by
position, ALiBi by flash-attention's own formula, then ``conformance.cases.reference``), and central
finite differences for a score_mod that is not additive. Planted bugs (the ALiBi sign flipped,
the chunk boundary shifted by one) are run through the same checks, which must reject them.
"""

from __future__ import annotations

import numpy as np
import pytest
from masks_reference import (
    expected,
    relative_bias_table,
    rules_as_mask_and_bias,
    score_mod_attention,
)
from numerics import finite_differences

import attention_rules as rules
from conformance.running import backends

# batch 2, 4 query heads over 2 kv heads, 7 queries, 11 keys (q_len < kv_len: the alignments
# differ), head_dim 8, v_dim 3
_R = np.random.default_rng(2024)
B, H, Q, K = 2, 4, 7, 11
QUERY, KEY, VALUE = (_R.standard_normal((B, H, Q, 8)), _R.standard_normal((B, 2, K, 8)),
                     _R.standard_normal((B, 2, K, 3)))
GRAD_OUT = _R.standard_normal((B, H, Q, 3))
SLOPES = 2.0 ** -np.arange(1, H + 1)  # ALiBi's slopes for 4 heads
Q_IDS = np.array([[0, 0, 0, 1, 1, 2, 2], [5, 5, 5, 5, 7, 7, 9]])  # query 6 of batch 1: no key
KV_IDS = np.array([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7]])
MASK_TABLE = _R.random((H, Q, K)) > 0.35  # a random per-element mask_mod, tabulated
MASK_TABLE[0, 2] = False  # head 0, query 2: a fully masked row
REL_TABLE = _R.standard_normal((H, 7))  # relative bias over distances -3 ... 3
ATOL = 1e-10

# case: (the call's options, the reference's options); arrays named, made per backend. Each
# feature is in a case with both alignments' positions at stake (q_len < kv_len).
CASES = {
    "chunked_alibi_bottom_right": (  # Llama 4's chunks with causality; flash-attention's ALiBi
        {"chunk_size": 3, "is_causal": True, "causal_alignment": "bottom_right",
         "alibi_slopes": "SLOPES"},
        {"chunk_size": 3, "causal_alignment": "bottom_right", "alibi_slopes": SLOPES}),
    "segments_alibi_softcap": (  # ALiBi after the soft-cap; a query whose segment has no key
        {"segment_ids": ("Q_IDS", "KV_IDS"), "is_causal": True, "alibi_slopes": "SLOPES",
         "softcap": 2.0},
        {"segment_ids": (Q_IDS, KV_IDS), "alibi_slopes": SLOPES}),
    "mods_chunked_top_left": (  # a random per-element mask_mod, a relative-bias score_mod
        {"mask_mod": "TABLE", "score_mod": "RELATIVE", "chunk_size": 4},
        {"mask_table": MASK_TABLE, "bias_table": relative_bias_table(REL_TABLE, Q, K),
         "chunk_size": 4}),
}


def _arrays(backend, name):
    """The named input as the backend's array, or a mod built from it."""
    masks = backend.module.masks
    if name == "SLOPES":
        return backend.asarray(SLOPES)
    if name == "TABLE":
        table = backend.asarray(MASK_TABLE)
        return lambda b, h, q, k: table[h, q, k]
    if name == "RELATIVE":
        return masks.relative_bias_mod(backend.asarray(REL_TABLE))
    return backend.asarray({"Q_IDS": Q_IDS, "KV_IDS": KV_IDS}[name])


def _options(backend, case):
    call, _ = CASES[case]
    options = {}
    for name, value in call.items():
        if isinstance(value, tuple):
            value = tuple(_arrays(backend, v) for v in value)
        elif isinstance(value, str) and value.isupper():
            value = _arrays(backend, value)
        options[name] = value
    return options


def _expected(case, q_len=Q, kv_len=K):
    call, ref = CASES[case]
    mask, bias = rules_as_mask_and_bias(B, H, q_len, kv_len, **ref)
    scalars = {n: call[n] for n in ("is_causal", "causal_alignment", "softcap") if n in call}
    return expected(QUERY[..., :q_len, :], KEY[..., :kv_len, :], VALUE[..., :kv_len, :],
                    GRAD_OUT[..., :q_len, :], mask, bias, **scalars)


def _close(name, actual, backend, want):
    np.testing.assert_allclose(backend.to_numpy(actual), want[name], rtol=0, atol=ATOL,
                               err_msg=name)


def _run(backend, function, *arrays):
    """``function(*arrays)``; under ``jax.jit`` in JAX (one compile, not one per operation)."""
    if backend.name == "jax":
        import jax

        return jax.jit(function)(*arrays)
    return function(*arrays)


def check_case(backend, case, functions=("sdpa", "sdpa_vjp", "blockwise", "blockwise_vjp")):
    """Every function of ``functions`` on the case's inputs against the float64 reference."""
    m, want, options = backend.module, _expected(case), _options(backend, case)
    arrays = tuple(backend.asarray(x) for x in (QUERY, KEY, VALUE, GRAD_OUT))
    tiles = {"block_q": 3, "block_kv": 4}
    grads = ("grad_query", "grad_key", "grad_value")
    if "sdpa" in functions:
        out = _run(backend, lambda q, k, v, g: m.scaled_dot_product_attention(
            q, k, v, return_weights=True, return_lse=True, **options), *arrays)
        for name, x in zip(("output", "weights", "lse"), out, strict=True):
            _close(name, x, backend, want)
    if "sdpa_vjp" in functions:
        out = _run(backend, lambda q, k, v, g: m.scaled_dot_product_attention_vjp(
            q, k, v, g, **options)[:3], *arrays)
        for name, x in zip(grads, out, strict=True):
            _close(name, x, backend, want)
    if "blockwise" in functions:
        out = _run(backend, lambda q, k, v, g: m.blockwise_attention(
            q, k, v, return_lse=True, **tiles, **options), *arrays)
        for name, x in zip(("output", "lse"), out, strict=True):
            _close(name, x, backend, want)
    if "blockwise_vjp" in functions:
        out = _run(backend, lambda q, k, v, g: m.blockwise_attention_vjp(
            q, k, v, g, **tiles, **options)[:3], *arrays)
        for name, x in zip(grads, out, strict=True):
            _close(name, x, backend, want)


# ------------------------------------------------------------------------------------------
# Every feature in every backend: explicit steps, VJP, tiles and their VJP
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_each_feature_matches_the_float64_reference(backend, case):
    check_case(backend, case)


def test_one_array_of_segment_ids_is_the_pair_for_self_attention(backend):
    m = backend.module
    ids = backend.asarray(Q_IDS)
    q, k, v = (backend.asarray(x[..., :Q, :]) for x in (QUERY, KEY, VALUE))
    mask, bias = rules_as_mask_and_bias(B, H, Q, Q, segment_ids=(Q_IDS, Q_IDS))
    want = expected(QUERY, KEY[..., :Q, :], VALUE[..., :Q, :], GRAD_OUT, mask, bias)
    _close("output", m.scaled_dot_product_attention(q, k, v, segment_ids=ids), backend, want)
    _close("output", m.blockwise_attention(q, k, v, segment_ids=ids, block_q=3, block_kv=2),
           backend, want)


@pytest.mark.slow
def test_the_ready_made_mods_equal_the_dedicated_arguments(backend):
    m, masks = backend.module, backend.module.masks
    q, k, v = (backend.asarray(x) for x in (QUERY, KEY, VALUE))
    offset = K - Q  # bottom-right
    prefix = np.arange(K)[None, :] < 3
    causal = np.tril(np.ones((Q, K), bool), k=offset)
    pairs = [  # (mod options, dedicated options)
        ({"mask_mod": masks.causal_mod(offset)},
         {"is_causal": True, "causal_alignment": "bottom_right"}),
        ({"mask_mod": masks.sliding_window_mod((2, 1))}, {"window": (2, 1)}),
        ({"mask_mod": masks.chunked_mod(3, offset)},
         {"chunk_size": 3, "causal_alignment": "bottom_right"}),
        ({"mask_mod": masks.prefix_lm_mod(3, offset)},
         {"mask": backend.asarray(prefix | causal)}),
        ({"mask_mod": masks.document_mod((backend.asarray(Q_IDS), backend.asarray(KV_IDS)))},
         {"segment_ids": (backend.asarray(Q_IDS), backend.asarray(KV_IDS))}),
        ({"mask_mod": masks.and_masks(masks.causal_mod(), masks.chunked_mod(4))},
         {"is_causal": True, "chunk_size": 4}),
        ({"score_mod": masks.alibi_mod(backend.asarray(SLOPES), offset)},
         {"alibi_slopes": backend.asarray(SLOPES), "causal_alignment": "bottom_right"}),
        ({"score_mod": masks.softcap_mod(2.5)}, {"softcap": 2.5}),
        ({"score_mod": masks.relative_bias_mod(backend.asarray(REL_TABLE))},
         {"bias": backend.asarray(relative_bias_table(REL_TABLE, Q, K))}),
    ]
    for mod, dedicated in pairs:
        want = backend.to_numpy(m.scaled_dot_product_attention(q, k, v, **dedicated))
        got = backend.to_numpy(m.scaled_dot_product_attention(q, k, v, **mod))
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=repr(mod))
    assert masks.causal_mod(2) == masks.causal_mod(2) and hash(masks.chunked_mod(3)) == hash(
        masks.chunked_mod(3))  # made again, the same static argument under a JIT


# ------------------------------------------------------------------------------------------
# Gradients through a score_mod that is not additive
# ------------------------------------------------------------------------------------------


def test_gradients_flow_through_a_score_mod_that_is_not_additive(backend):
    """jax and torch by autodiff (and torch's tiles by autograd per tile) against finite
    differences of the float64 reference; numpy_attn refuses a callable without a
    derivative, naming the ways out, and takes one with it."""
    m = backend.module
    mask, _ = rules_as_mask_and_bias(B, H, Q, K, chunk_size=4)
    mask &= np.tril(np.ones((Q, K), bool))

    def numpy_mod(s, b, h, q, k):
        return s + 0.3 * s * s - 0.1 * h

    q, k, v, g = (backend.asarray(x) for x in (QUERY, KEY, VALUE, GRAD_OUT))
    options = {"chunk_size": 4, "is_causal": True, "score_mod": lambda s, b, h, qi, ki: s + 0.3
               * s * s - 0.1 * h}
    query = QUERY.copy()
    finite = finite_differences(lambda: float((score_mod_attention(
        query, KEY, VALUE, numpy_mod, mask) * GRAD_OUT).sum()), query)
    want = {"output": score_mod_attention(QUERY, KEY, VALUE, numpy_mod, mask),
            "grad_query": finite}
    _close("output", _run(backend, lambda q, k, v: m.scaled_dot_product_attention(
        q, k, v, **options), q, k, v), backend, want)
    if backend.name == "numpy":
        with pytest.raises(NotImplementedError, match="has no derivative; use a ready-made mod"):
            m.scaled_dot_product_attention_vjp(q, k, v, g, **options)
        with pytest.raises(NotImplementedError, match="use jax_attn or torch_attn"):
            m.blockwise_attention_vjp(q, k, v, g, **options)

        class WithDerivative:
            def __call__(self, s, b, h, qi, ki):
                return numpy_mod(s, b, h, qi, ki)

            def derivative(self, s, b, h, qi, ki):
                return 1.0 + 0.6 * s

        options["score_mod"] = WithDerivative()
    grads = _run(backend, lambda q, k, v, g: (
        m.scaled_dot_product_attention_vjp(q, k, v, g, **options)[0],
        m.blockwise_attention_vjp(q, k, v, g, block_q=3, block_kv=4, **options)[0]), q, k, v, g)
    for grad in grads:  # the explicit steps' VJP, the tiles' VJP
        np.testing.assert_allclose(backend.to_numpy(grad), finite, rtol=0, atol=1e-7)


# ------------------------------------------------------------------------------------------
# Bad input: the same exception and message in every backend
# ------------------------------------------------------------------------------------------

BAD = {  # options → (exception, the start of the message after the function's name)
    "chunk_zero": ({"chunk_size": 0}, ValueError, "chunk_size must be a positive int"),
    "chunk_float": ({"chunk_size": 2.0}, ValueError, "chunk_size must be a positive int"),
    "alibi_shape": ({"alibi_slopes": np.ones(3)}, ValueError,
                    "alibi_slopes must have shape (heads,) = (4,)"),
    "alibi_dtype": ({"alibi_slopes": np.ones(4, np.int32)}, TypeError,
                    "alibi_slopes must be floating point"),
    "ids_shape": ({"segment_ids": (np.zeros((2, 6), np.int64), np.zeros((2, 11), np.int64))},
                  ValueError, "segment_ids[0] must be shaped like the batch axes"),
    "ids_dtype": ({"segment_ids": (np.zeros((2, 7)), np.zeros((2, 11)))}, TypeError,
                  "segment_ids[0] must be integers"),
    "ids_one_array": ({"segment_ids": np.zeros((2, 7), np.int64)}, ValueError,
                      "one segment_ids array needs q_len == kv_len"),
    "ids_triple": ({"segment_ids": (np.zeros((2, 7), np.int64),) * 3}, ValueError,
                   "segment_ids must be one array, or a pair"),
    "score_mod": ({"score_mod": 3.0}, TypeError, "score_mod must be a callable"),
    "mask_mod": ({"mask_mod": "causal"}, TypeError, "mask_mod must be a callable"),
    "mask_mod_returns": ({"mask_mod": lambda b, h, q, k: q - k}, TypeError,
                         "mask_mod must return an array of booleans"),  # got its index dtype
}


@pytest.mark.parametrize("bad", BAD)
def test_bad_arguments_raise_the_same_error_in_every_backend(bad):
    options, kind, start = BAD[bad]
    messages = set()
    for name in backends.SPEC_BACKENDS:
        backend = backends.get(name)
        if not backend.available():
            continue
        converted = {n: (tuple(backend.asarray(x) for x in value) if isinstance(value, tuple)
                         else backend.asarray(value) if isinstance(value, np.ndarray) else value)
                     for n, value in options.items()}
        q, k, v = (backend.asarray(x) for x in (QUERY, KEY, VALUE))
        for fn in ("scaled_dot_product_attention", "blockwise_attention"):
            with pytest.raises(kind) as error:
                getattr(backend.module, fn)(q, k, v, **converted)
            message = str(error.value)
            assert message.startswith(f"{fn}: {start}"), message
            messages.add(message.replace(fn, "<fn>").split("; got dtype=")[0])
    assert len(messages) == 1, messages


def test_the_chunk_rules_tile_statuses_are_exact():
    """``attention_rules.chunk_status`` against the positions, tile by tile."""
    for q_len, kv_len, offset, chunk, lo, hi in ((9, 13, 4, 3, -np.inf, 4), (12, 12, 0, 5, -2, 1),
                                                  (13, 9, -4, 4, -np.inf, np.inf)):
        i, j = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
        for c in (chunk, None):
            allowed = (j - i >= lo) & (j - i <= hi)
            allowed &= True if c is None else (i + offset) // c == j // c
            wanted = []
            for q0, q1 in rules.mods.blocks_of(q_len, 4):
                wanted.append([])
                for k0, k1 in rules.mods.blocks_of(kv_len, 3):
                    tile = allowed[q0:q1, k0:k1]
                    want = rules.ALL if tile.all() else rules.SOME if tile.any() else rules.NONE
                    assert rules.chunk_status(q0, q1, k0, k1, lo, hi, offset, c) == want
                    wanted[-1].append(want)
            assert rules.structural_statuses(q_len, kv_len, 4, 3, lo, hi, offset, c) == wanted


# ------------------------------------------------------------------------------------------
# Planted bugs: the checks above reject them
# ------------------------------------------------------------------------------------------


def test_planted_alibi_sign_flip_is_caught(monkeypatch):
    from numpy_attn import _masking

    original = _masking._add_alibi
    monkeypatch.setattr(_masking, "_add_alibi", lambda scores, mods, *a, **k: 2 * scores - original(
        scores.copy(), mods, *a, **k))  # + slope · distance
    with pytest.raises(AssertionError, match="output"):
        check_case(backends.get("numpy"), "chunked_alibi_bottom_right", ("sdpa",))


def test_planted_chunk_boundary_shift_is_caught(monkeypatch):
    from numpy_attn import _masking, _tiles

    original = _masking._mods_allowed  # (i + offset + 1) // C: ALiBi unmoved
    shifted = lambda mods, *a: original(mods._replace(offset=mods.offset + 1), *a)  # noqa: E731
    for module in (_masking, _tiles):
        monkeypatch.setattr(module, "_mods_allowed", shifted)
    for function in ("sdpa", "blockwise"):
        with pytest.raises(AssertionError, match="output"):
            check_case(backends.get("numpy"), "chunked_alibi_bottom_right", (function,))

