"""Packed variable-length batches: ``varlen_attention``, its VJP and the converters.

Expected values come from ``reference`` below: float64, one sequence and one head at a time,
from the offsets' meaning alone (scores, the bottom-right window, soft-cap, sinks), never from
the backends. numpy_attn's hand-written VJP is checked against central differences; jax_attn's
and torch_attn's autodiff against it in float64. Planted bugs (offsets off by one, the window
aligned top-left) fail the same checks.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from conformance import spec

BACKENDS = ("numpy", "jax", "torch")
Q_LENS = [3, 0, 5, 1, 4, 2]  # an empty query sequence, length 1, q_len > k_len, q_len < k_len
K_LENS = [4, 2, 5, 0, 2, 6]  # an empty key sequence (its query row gets 0 and lse -inf)
HEADS, KV_HEADS, HEAD_DIM, V_DIM = 4, 2, 8, 6
OPTIONS = {
    "plain": {},
    "causal": {"window_size": (-1, 0)},
    "left_only": {"window_size": (1, -1)},
    "window_softcap_sinks_lse": {"window_size": (2, 1), "softcap": 2.0, "sinks": True,
                                 "return_lse": True},
}


def _offsets(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _inputs(seed: int = 0, dtype: type = np.float32) -> dict:
    rng = np.random.default_rng(seed)
    total_q, total_k = sum(Q_LENS), sum(K_LENS)
    return {
        "q": rng.standard_normal((total_q, HEADS, HEAD_DIM)).astype(dtype),
        "k": rng.standard_normal((total_k, KV_HEADS, HEAD_DIM)).astype(dtype),
        "v": rng.standard_normal((total_k, KV_HEADS, V_DIM)).astype(dtype),
        "sinks": rng.standard_normal(HEADS).astype(dtype),
        "grad": rng.standard_normal((total_q, HEADS, V_DIM)).astype(dtype),
    }


def reference(q, k, v, q_lens, k_lens, *, window_size=(-1, -1), softcap=None, sinks=None,
              used=None, scale=None):  # noqa: ANN001, ANN201 - test helper
    """float64 per sequence and head: output ``(total_q, heads, v_dim)``, lse ``(heads,
    total_q)``. Query ``i`` of a sequence with ``lq`` queries and ``n`` keys in use attends
    key ``j < n`` iff ``-left <= j - i - (n - lq) <= right`` (a side of -1 unbounded)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = np.zeros(q.shape[:2] + v.shape[-1:])
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    q_starts, k_starts = _offsets(q_lens), _offsets(k_lens)
    left, right = window_size
    for s, lq in enumerate(q_lens):
        n = k_lens[s] if used is None else used[s]
        i, j = np.arange(lq)[:, None], np.arange(n)[None, :]
        d = j - i - (n - lq)
        allowed = ((left < 0) | (d >= -left)) & ((right < 0) | (d <= right))
        rows, keys = slice(q_starts[s], q_starts[s] + lq), slice(k_starts[s], k_starts[s] + n)
        for h in range(q.shape[1]):
            scores = scale * q[rows, h] @ k[keys, h // groups].T  # (lq, n)
            if softcap is not None:
                scores = softcap * np.tanh(scores / softcap)
            scores = np.where(allowed, scores, -np.inf)
            top = scores.max(axis=1, initial=-np.inf)
            if sinks is not None:
                top = np.maximum(top, float(sinks[h]))
            top = np.where(np.isinf(top), 0.0, top)
            e = np.exp(scores - top[:, None])
            total = e.sum(axis=1) + (0.0 if sinks is None else np.exp(float(sinks[h]) - top))
            with np.errstate(divide="ignore", invalid="ignore"):
                out[rows, h] = np.where(total[:, None] > 0, e @ v[keys, h // groups]
                                        / total[:, None], 0.0)
                lse[h, rows] = top + np.log(total)
    return out, lse


def _close(got, want, tol=1e-4) -> bool:  # noqa: ANN001
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or not np.array_equal(np.isneginf(got), np.isneginf(want)):
        return False
    finite = np.isfinite(want)
    return bool(np.isfinite(got[finite]).all()
                and np.allclose(got[finite], want[finite], atol=tol, rtol=tol))


def _module(name: str):  # noqa: ANN202
    pytest.importorskip({"numpy": "numpy", "jax": "jax", "torch": "torch"}[name])
    return importlib.import_module(f"{name}_attn")


def _to(name: str, x):  # noqa: ANN001, ANN202
    if not isinstance(x, np.ndarray) or name == "numpy":
        return x
    if name == "jax":
        import jax.numpy as jnp

        return jnp.asarray(x)
    import torch

    return torch.from_numpy(np.ascontiguousarray(x))


def _np(x) -> np.ndarray:  # noqa: ANN001
    return np.asarray(x.detach() if hasattr(x, "detach") else x)


def _call(name: str, data: dict, options: dict, fn: str = "varlen_attention", **more):  # noqa: ANN202
    options = dict(options)
    sinks = data["sinks"] if options.pop("sinks", False) else None
    arrays = [data["q"], data["k"], data["v"]] + ([data["grad"]] if fn.endswith("vjp") else [])
    return getattr(_module(name), fn)(
        *(_to(name, x) for x in arrays), _to(name, _offsets(Q_LENS)), _to(name, _offsets(K_LENS)),
        max(Q_LENS), max(K_LENS), enable_gqa=True, sinks=_to(name, sinks), **options, **more)


# ------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS)
@pytest.mark.parametrize("name", BACKENDS)
def test_matches_the_float64_reference(name: str, options: dict) -> None:
    data = _inputs()
    result = _call(name, data, options)
    want, want_lse = reference(data["q"], data["k"], data["v"], Q_LENS, K_LENS,
                               window_size=options.get("window_size", (-1, -1)),
                               softcap=options.get("softcap"),
                               sinks=data["sinks"] if options.get("sinks") else None)
    if options.get("return_lse"):
        result, lse = result
        assert _close(lse, want_lse), np.abs(_np(lse) - want_lse)
        assert np.asarray(_np(lse)).dtype == np.float32
    assert _np(result).dtype == np.float32 and _close(result, want)
    assert not _np(result)[sum(Q_LENS[:3]):sum(Q_LENS[:4])].any()  # no key: output 0


def test_jax_traced_offsets_take_the_masked_path_and_agree() -> None:
    jax = pytest.importorskip("jax")
    ja = _module("jax")
    data = _inputs()

    @jax.jit
    def run(q, k, v, cu_q, cu_k, sinks):  # noqa: ANN001, ANN202 - offsets are tracers here
        return ja.varlen_attention(q, k, v, cu_q, cu_k, 5, 6, window_size=(-1, 0), softcap=2.0,
                                   enable_gqa=True, sinks=sinks, return_lse=True)

    out, lse = run(data["q"], data["k"], data["v"], _offsets(Q_LENS), _offsets(K_LENS),
                   data["sinks"])
    want, want_lse = reference(data["q"], data["k"], data["v"], Q_LENS, K_LENS,
                               window_size=(-1, 0), softcap=2.0, sinks=data["sinks"])
    assert _close(out, want) and _close(lse, want_lse)


@pytest.mark.parametrize("name", BACKENDS)
def test_only_the_work_inside_the_sequences(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pipeline call is a group of equal sequences: Σ q_len·k_len score entries in all,
    never a padded (N, max_len) batch."""
    module = importlib.import_module(f"{_module(name).__name__}.varlen")
    shapes = []
    original = module.pipeline

    def spy(q, k, *args):  # noqa: ANN001, ANN002, ANN202
        shapes.append((tuple(q.shape), tuple(k.shape)))
        return original(q, k, *args)

    monkeypatch.setattr(module, "pipeline", spy)
    if name == "jax":  # the spy sees a trace, not a call from jit's cache
        module._grouped.clear_cache()
    _call(name, _inputs(), OPTIONS["causal"])
    entries = sum(q[0] * q[1] * q[2] * k[2] for q, k in shapes)
    assert entries == HEADS * sum(a * b for a, b in zip(Q_LENS, K_LENS, strict=True))
    assert len(shapes) == 5  # six sequences, one without queries


def test_numpy_runs_large_groups_on_the_fast_path_and_small_ones_in_lanes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    na = _module("numpy")
    from numpy_attn import varlen

    lanes = []
    original = varlen._threads.run_lanes
    monkeypatch.setattr(varlen._threads, "run_lanes",
                        lambda tasks, *a: lanes.append(len(tasks)) or original(tasks, *a))
    q_lens, k_lens = [520, 3, 70], [520, 5, 90]  # 4 · 520² >= 2**20 score entries: blocked
    rng = np.random.default_rng(1)
    q = rng.standard_normal((sum(q_lens), HEADS, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((sum(k_lens), KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((sum(k_lens), KV_HEADS, V_DIM)).astype(np.float32)
    args = (_offsets(q_lens), _offsets(k_lens), 520, 520)
    out = na.varlen_attention(q, k, v, *args, window_size=(-1, 0), enable_gqa=True)
    # the 520-token group ran first, outside varlen's lanes, on its own blocked path's lanes;
    # then the two small groups, one task each
    assert len(lanes) >= 2 and lanes[-1] == 2, lanes
    assert _close(out, reference(q, k, v, q_lens, k_lens, window_size=(-1, 0))[0])
    torch = pytest.importorskip("torch")
    grad = rng.standard_normal(out.shape)
    grads = na.varlen_attention_vjp(*(x.astype(np.float64) for x in (q, k, v)), grad, *args,
                                    window_size=(-1, 0), enable_gqa=True)
    expected = _module("torch").varlen_attention_vjp(
        *(torch.from_numpy(x.astype(np.float64)) for x in (q, k, v, grad)),
        *map(torch.from_numpy, args[:2]), 520, 520, window_size=(-1, 0), enable_gqa=True)
    for got, want in zip(grads, expected, strict=True):
        assert _close(got, want, 1e-9)


# ------------------------------------------------------------------------------ gradients


def test_numpy_vjp_matches_central_differences() -> None:
    na = _module("numpy")
    data = _inputs(2, np.float64)
    options = {"window_size": (2, 0), "softcap": 2.0, "enable_gqa": True}
    args = (_offsets(Q_LENS), _offsets(K_LENS), 5, 6)
    primals = [data["q"], data["k"], data["v"], data["sinks"]]

    def loss(q, k, v, sinks) -> float:  # noqa: ANN001
        out = na.varlen_attention(q, k, v, *args, sinks=sinks, **options)
        return float((out * data["grad"]).sum())

    grads = na.varlen_attention_vjp(*primals[:3], data["grad"], *args, sinks=primals[3],
                                    **options)
    rng = np.random.default_rng(3)
    for index, (primal, grad) in enumerate(zip(primals, grads, strict=True)):
        assert grad.shape == primal.shape and grad.dtype == primal.dtype
        for _ in range(2):
            u = rng.standard_normal(primal.shape)
            shifted = [[p + s * 1e-6 * u if i == index else p for i, p in enumerate(primals)]
                       for s in (1, -1)]
            numeric = (loss(*shifted[0]) - loss(*shifted[1])) / 2e-6
            assert abs(numeric - (grad * u).sum()) <= 1e-6 * (1 + abs(numeric))


@pytest.mark.parametrize("name", ["jax", "torch"])
def test_autodiff_matches_the_numpy_vjp(name: str, request: pytest.FixtureRequest) -> None:
    if name == "jax":
        request.getfixturevalue("x64_on")
    data = _inputs(4, np.float64)
    options = dict(OPTIONS["window_softcap_sinks_lse"], window_size=(3, 0))
    del options["return_lse"]
    grads = _call(name, data, options, "varlen_attention_vjp")
    expected = _call("numpy", data, options, "varlen_attention_vjp")
    assert len(grads) == len(expected) == 4
    for got, want in zip(grads, expected, strict=True):
        assert _np(got).dtype == np.float64 and _close(got, want, 1e-10)


# ------------------------------------------------------------------------------ keys in use, pages


@pytest.mark.parametrize("name", BACKENDS)
def test_keys_beyond_seqused_k_and_padding_never_leak(name: str) -> None:
    """jax#23349 / maxtext#4476: a padded batch whose padding holds NaN and huge values,
    packed; and keys past ``seqused_k`` that hold NaN: nothing of them reaches an output."""
    module = _module(name)
    rng = np.random.default_rng(5)
    lengths = np.array([6, 2, 0, 4])
    padded = [rng.standard_normal((4, HEADS if i == 0 else KV_HEADS, 6, HEAD_DIM)).astype(
        np.float32) for i in range(3)]
    for x, poison in zip(padded, (np.nan, 1e30, np.nan), strict=True):
        x[np.arange(6) >= lengths[:, None, None].repeat(x.shape[1], 1)] = poison
    packed = [module.pack_sequences(_to(name, x), _to(name, lengths)) for x in padded]
    (q, cu), (k, _), (v, _) = packed
    assert _np(cu).tolist() == [0, 6, 8, 8, 12] and np.isfinite(_np(q)).all()
    out = module.varlen_attention(q, k, v, cu, cu, 6, 6, window_size=(-1, 0), enable_gqa=True)
    clean = [np.nan_to_num(_np(x)) for x in (q, k, v)]
    assert _close(out, reference(*clean, lengths.tolist(), lengths.tolist(),
                                 window_size=(-1, 0))[0])
    back = _np(module.unpack_sequences(out, cu, 6))  # (batch, heads, max_len, v_dim)
    assert back.shape == (4, HEADS, 6, HEAD_DIM) and not back[1, :, 2:].any()
    # keys past seqused_k hold NaN: sequence i uses its first used[i] keys only
    used = np.array([3, 2, 0, 1], np.int32)
    k_poisoned, v_poisoned = _np(k).copy(), _np(v).copy()
    for i, n in enumerate(used):
        k_poisoned[_np(cu)[i] + n:_np(cu)[i + 1]] = np.nan
        v_poisoned[_np(cu)[i] + n:_np(cu)[i + 1]] = np.nan
    out = module.varlen_attention(q, _to(name, k_poisoned), _to(name, v_poisoned), cu, cu, 6, 3,
                                  seqused_k=_to(name, used), enable_gqa=True,
                                  window_size=(-1, 0))
    assert _close(out, reference(*clean, lengths.tolist(), lengths.tolist(), used=used.tolist(),
                                 window_size=(-1, 0))[0])


PAGE = 2
BLOCK_TABLE = np.array([[3, 1, 7, 0], [2, 5, 9, 9], [4, 4, 4, 4]], np.int32)  # page 9 shared
SEQUSED = np.array([5, 8, 0], np.int32)


@pytest.mark.parametrize("name", BACKENDS)
def test_paged_keys_and_their_gradients(name: str, request: pytest.FixtureRequest) -> None:
    if name == "jax":
        request.getfixturevalue("x64_on")
    module = _module(name)
    rng = np.random.default_rng(6)
    pool_k = rng.standard_normal((10, PAGE, KV_HEADS, HEAD_DIM))
    pool_v = rng.standard_normal((10, PAGE, KV_HEADS, V_DIM))
    q, grad = rng.standard_normal((6, HEADS, HEAD_DIM)), rng.standard_normal((6, HEADS, V_DIM))
    pool_k[8], pool_v[8] = np.nan, np.nan  # a page nobody uses
    cu_q = np.array([0, 2, 5, 6], np.int32)
    # the reference reads the pages by hand, token by token
    k = np.stack([pool_k[row[t // PAGE], t % PAGE] for row, n in zip(BLOCK_TABLE, SEQUSED,
                  strict=True) for t in range(n)])
    v = np.stack([pool_v[row[t // PAGE], t % PAGE] for row, n in zip(BLOCK_TABLE, SEQUSED,
                  strict=True) for t in range(n)])
    arrays = [_to(name, x) for x in (q, pool_k, pool_v, cu_q)]
    kwargs = {"seqused_k": _to(name, SEQUSED), "block_table": _to(name, BLOCK_TABLE),
              "enable_gqa": True, "window_size": (-1, 0)}
    out = module.varlen_attention(*arrays, None, 3, 8, **kwargs)
    assert _close(out, reference(q, k, v, [2, 3, 1], SEQUSED.tolist(), window_size=(-1, 0))[0],
                  1e-12)
    if name == "numpy":  # by hand vs torch's autograd (torch is the independent one here)
        pytest.importorskip("torch")
        grads = module.varlen_attention_vjp(q, pool_k, pool_v, grad, cu_q, None, 3, 8, **kwargs)
        expected = _call_paged_torch(q, pool_k, pool_v, grad, cu_q, kwargs)
        assert np.abs(grads[1][9]).sum() > 0 and not grads[1][8].any()
        for got, want in zip(grads, expected, strict=True):
            assert _close(got, want, 1e-10)


def _call_paged_torch(q, pool_k, pool_v, grad, cu_q, kwargs):  # noqa: ANN001, ANN202
    import torch

    ta = _module("torch")
    tensors = {key: torch.from_numpy(x) if isinstance(x, np.ndarray) else x
               for key, x in kwargs.items()}
    pool_k, pool_v = np.nan_to_num(pool_k), np.nan_to_num(pool_v)  # autograd: 0 · NaN = NaN
    return ta.varlen_attention_vjp(*(torch.from_numpy(x) for x in (q, pool_k, pool_v, grad)),
                                   torch.from_numpy(cu_q), None, 3, 8, **tensors)


# ------------------------------------------------------------------------------ controls


def _top_left(data: dict) -> np.ndarray:
    """A planted bug: each sequence through scaled_dot_product_attention, causal top-left."""
    import numpy_attn as na

    out = np.zeros(data["q"].shape[:2] + (V_DIM,), np.float32)
    for s, (q0, k0) in enumerate(zip(_offsets(Q_LENS)[:-1], _offsets(K_LENS)[:-1], strict=True)):
        rows, keys = slice(q0, q0 + Q_LENS[s]), slice(k0, k0 + K_LENS[s])
        out[rows] = na.scaled_dot_product_attention(
            *(x[part].transpose(1, 0, 2) for x, part in ((data["q"], rows), (data["k"], keys),
                                                         (data["v"], keys))),
            is_causal=True, causal_alignment="top_left").transpose(1, 0, 2)
    return out


def test_planted_bugs_fail_the_reference_check() -> None:
    na = _module("numpy")
    data = _inputs()
    want = reference(data["q"], data["k"], data["v"], Q_LENS, K_LENS, window_size=(-1, 0))[0]
    good = na.varlen_attention(data["q"], data["k"], data["v"], _offsets(Q_LENS),
                               _offsets(K_LENS), 5, 6, window_size=(-1, 0), enable_gqa=True)
    assert _close(good, want)
    assert not _close(_top_left(data), want)  # top-left instead of bottom-right
    for name in ("cu_seq_q", "cu_seq_k"):  # offsets off by one: still valid offsets
        offsets = {"cu_seq_q": _offsets(Q_LENS), "cu_seq_k": _offsets(K_LENS)}
        offsets[name][1:-1] += 1
        shifted = na.varlen_attention(data["q"], data["k"], data["v"], offsets["cu_seq_q"],
                                      offsets["cu_seq_k"], 6, 7, window_size=(-1, 0),
                                      enable_gqa=True)
        assert not _close(shifted, want), name


# ------------------------------------------------------------------------------ errors


def _bad_calls() -> dict[str, tuple[str, str, dict]]:
    """rule of spec.VARLEN_ERRORS → (id, function, arguments replaced in a good call)."""
    cu = _offsets(Q_LENS)
    rules = list(spec.VARLEN_ERRORS)
    return {
        "dtype": (rules[0], "varlen_attention", {"k": np.zeros((24, 2, 8), np.float64)}),
        "rank": (rules[1], "varlen_attention", {"q": np.zeros((1, 15, 4, 8), np.float32)}),
        "head_dim": (rules[1], "varlen_attention", {"k": np.zeros((24, 2, 7), np.float32)}),
        "gqa": (rules[2], "varlen_attention", {"enable_gqa": False}),
        "offsets_dtype": (rules[3], "varlen_attention", {"cu_q": cu.astype(np.float32)}),
        "offsets_lengths": (rules[3], "varlen_attention", {"cu_k": _offsets(K_LENS)[:-1]}),
        "no_cu_seq_k": (rules[3], "varlen_attention", {"cu_k": None}),
        "start": (rules[4], "varlen_attention", {"cu_q": cu + 1}),
        "decreasing": (rules[4], "varlen_attention", {"cu_q": np.array([0, 8, 3, 8, 9, 13, 15])}),
        "end": (rules[4], "varlen_attention_vjp", {"cu_k": _offsets(K_LENS) // 2}),
        "max_q": (rules[5], "varlen_attention", {"max_q": 4}),
        "seqused_k": (rules[6], "varlen_attention", {"seqused_k": np.array(K_LENS) + 1}),
        "block_table": (rules[6], "varlen_attention", {"block_table": np.zeros((6, 1), np.int32),
                                                       "k": np.zeros((3, 8, 2, 8), np.float32),
                                                       "v": np.zeros((3, 8, 2, 6), np.float32)}),
        "window_size": (rules[7], "varlen_attention", {"window_size": (-2, 0)}),
        "flag": (rules[8], "varlen_attention", {"return_lse": 1}),
        "sinks": (rules[9], "varlen_attention", {"sinks": np.zeros(2, np.float32)}),
        "pack": (rules[10], "pack_sequences", {}),
        "unpack": (rules[10], "unpack_sequences", {}),
    }


BAD = _bad_calls()


def test_every_error_rule_has_a_bad_call() -> None:
    assert {rule for rule, _, _ in BAD.values()} == set(spec.VARLEN_ERRORS)


@pytest.mark.parametrize("case", BAD)
def test_errors_are_the_same_in_every_backend(case: str) -> None:
    rule, fn, replaced = BAD[case]
    data = _inputs()
    given = {"q": data["q"], "k": data["k"], "v": data["v"], "cu_q": _offsets(Q_LENS),
             "cu_k": _offsets(K_LENS), "max_q": 5, "max_k": 6, "enable_gqa": True, **replaced}
    errors = {}
    for name in BACKENDS:
        module = _module(name)
        convert = _to if name == "torch" else lambda _, x: x  # jax: NumPy's dtypes as given
        with pytest.raises((TypeError, ValueError)) as caught:
            if fn == "pack_sequences":
                module.pack_sequences(convert(name, np.zeros((2, 4, 3, 8))),
                                      convert(name, np.array([3, 4])))
            elif fn == "unpack_sequences":
                module.unpack_sequences(convert(name, data["q"]), convert(name, _offsets(Q_LENS)),
                                        4)
            else:
                arrays = [given["q"], given["k"], given["v"]]
                arrays += [data["grad"]] if fn.endswith("vjp") else []
                getattr(module, fn)(
                    *(convert(name, x) for x in arrays), convert(name, given["cu_q"]),
                    convert(name, given["cu_k"]), given["max_q"], given["max_k"],
                    enable_gqa=given["enable_gqa"], **{key: convert(name, value) for key, value in
                                                       replaced.items() if key in (
                                                           "seqused_k", "block_table",
                                                           "window_size", "return_lse",
                                                           "sinks")})
        errors[name] = (type(caught.value).__name__, str(caught.value))
    assert len(set(errors.values())) == 1, errors
    kind, message = errors["numpy"]
    assert kind == spec.VARLEN_ERRORS[rule] and message.startswith(fn), message


def test_jax_pack_needs_host_lengths() -> None:
    jax = pytest.importorskip("jax")
    ja = _module("jax")
    with pytest.raises(ValueError, match="lengths must be known on the host"):
        jax.jit(ja.pack_sequences)(np.zeros((2, 1, 3)), np.array([1, 2]))
