"""The harness's cases of issue 24: packed batches (varlen), chunked attention, ALiBi, segment
ids and FlexAttention-style mods.

* the mods of ``conformance.cases.mods`` run on NumPy, jax (under ``jit``) and torch, equal their
  tabulation, survive pickling and hash alike when made again;
* the float64 reference: each ready-made mod equals its dedicated argument, and its gradients
  through ``score_mod`` equal a finite difference;
* a checked module declares the new features (``unsupported`` cells, the bad inputs skipped)
  or lacks ``varlen_attention`` (``not provided``);
* planted bugs fail exactly the cases that expose them, with their diagnosis: offsets off by
  one, ALiBi's sign flipped, the chunk boundary shifted by one, mask_mod ignored by the blocked
  path;
* golden files carry the offsets, slopes, ids and each mod tabulated, and refuse crafted ones.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from harness_helpers import _expected, check_planted_bug, fake_numpy

import numpy_attn
from conformance import golden, spec
from conformance.cases import catalogue as cases
from conformance.cases import mods, reference
from conformance.cases.combined import COMBINED_CASES
from conformance.cases.inputs import qkv
from conformance.cases.packed import OFFSET, PACKED_CASES, SLOPES
from conformance.diagnosing.diagnose_packed import shifted_offsets
from conformance.running import backends, errors, plugins, runner

MOD_CASES = ("mods_causal_alibi", "mods_window_softcap", "mask_mod_prefix_lm",
             "mask_mod_document", "mask_mod_random")
NEW_FEATURES = {"varlen", "chunked", "alibi", "segments", "score_mod", "mask_mod"}


# ------------------------------------------------------------------------------ the mods


def _grid(xp, shape):  # noqa: ANN001, ANN202 - the index arrays of MOD_INDICES in ``xp``
    return tuple(xp.asarray(i) for i in reference.mod_indices(shape))


@pytest.mark.parametrize("case", MOD_CASES)
def test_mods_run_on_every_framework_and_equal_their_tabulation(case: str) -> None:
    """The same callable on NumPy, torch and jax (traced under jit) gives the tabulated mask
    and bias; made again from the case it is equal and hashes alike, and pickles."""
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    data = cases.prepare_inputs(cases.get(case), "float32")
    shape = mods.score_shape(data.arrays)
    tab = mods.tabulate(data)
    scores = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    for kind in ("mask_mod", "score_mod"):
        if data.options.get(kind) is None:
            continue
        mod = mods.build(kind, data.options[kind], data.arrays)
        again = mods.build(kind, data.options[kind], dict(data.arrays))
        assert mod == again and hash(mod) == hash(again) and pickle.loads(pickle.dumps(mod)) == mod
        args = (scores,) if kind == "score_mod" else ()
        want = (np.broadcast_to(tab.mask, shape) if kind == "mask_mod" else
                scores + tab.bias if tab.bias is not None else
                tab.softcap * np.tanh(scores / tab.softcap))
        on_numpy = mod(*args, *reference.mod_indices(shape))
        on_torch = mod(*(torch.from_numpy(a) for a in args), *_grid(torch, shape)).numpy()
        on_jax = np.asarray(jax.jit(lambda *xs, m=mod: m(*xs))(*args, *_grid(jax.numpy, shape)))
        for got in (on_numpy, on_torch, on_jax):  # booleans; a score mod keeps float32
            assert got.dtype == (bool if kind == "mask_mod" else np.float32)
            np.testing.assert_allclose(np.broadcast_to(got, shape), want, rtol=1e-6, atol=1e-6)


def test_a_mod_option_outside_the_registry_is_refused() -> None:
    with pytest.raises(mods.ModError, match="expected"):
        mods.build("mask_mod", {"name": "nope"}, {})
    with pytest.raises(mods.ModError, match="parameters"):
        mods.build("mask_mod", {"name": "causal"}, {})
    with pytest.raises(mods.ModError, match="mod_table"):
        mods.build("mask_mod", {"name": "table"}, {})


# ------------------------------------------------------------------------------ the reference


def test_the_reference_mods_equal_their_dedicated_arguments() -> None:
    """On the same inputs, the reference given ALiBi and the causal rule as mods, and the
    document mask as a mod, equals it given alibi_slopes, is_causal and segment_ids."""
    a = qkv(np.random.default_rng(1))
    dedicated = reference.attention(**a, alibi_slopes=SLOPES, is_causal=True,
                                    causal_alignment="bottom_right")
    as_mods = reference.attention(**a, **mods.sdpa_kwargs({"mod_slopes": SLOPES}, {
        "mask_mod": {"name": "causal", "offset": OFFSET},
        "score_mod": {"name": "alibi", "offset": OFFSET}}))
    np.testing.assert_allclose(as_mods.output, dedicated.output, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(as_mods.lse, dedicated.lse, rtol=1e-13)
    ids = cases.get("segment_ids_bottom_right").data().arrays
    pair = (ids["q_segment_ids"], ids["kv_segment_ids"])
    by_ids = reference.attention(**a, segment_ids=pair)
    by_mod = reference.attention(**a, mask_mod=mods.build("mask_mod", {"name": "document"}, {
        "mod_q_ids": pair[0], "mod_kv_ids": pair[1]}))
    np.testing.assert_array_equal(by_mod.output, by_ids.output)
    assert (by_ids.output[1, :, 1] == 0).all()  # the padding query (id -1) attends nothing


@pytest.mark.parametrize("score_mod", [{"name": "alibi", "offset": 2},
                                       {"name": "softcap", "softcap": 1.5}])
def test_the_reference_gradient_through_score_mod_equals_a_finite_difference(
        score_mod: dict) -> None:
    rng = np.random.default_rng(2)
    a = qkv(rng)
    slopes = np.array([0.5, 0.25, 1.0, 2.0])
    kwargs = mods.sdpa_kwargs({"mod_slopes": slopes}, {"score_mod": score_mod,
                                                       "mask_mod": {"name": "causal",
                                                                    "offset": 2}})
    grad_out = rng.standard_normal(a["query"].shape)
    grads = reference.attention_vjp(a["query"], a["key"], a["value"], grad_out, **kwargs)
    eps = 1e-6
    for name, grad in (("query", grads.query), ("key", grads.key)):
        direction = rng.standard_normal(a[name].shape)
        plus = reference.attention(**{**a, name: a[name] + eps * direction}, **kwargs).output
        minus = reference.attention(**{**a, name: a[name] - eps * direction}, **kwargs).output
        numeric = ((plus - minus) / (2 * eps) * grad_out).sum()
        assert abs(numeric - (grad * direction).sum()) < 1e-6 * max(1.0, abs(numeric)), name


# ------------------------------------------------------------------------------ contract


PACKED = [c.name for c in PACKED_CASES]


def test_the_new_cases_use_the_new_features() -> None:
    used = {c: plugins.features(cases.get(c).data().arrays, cases.get(c).data().options,
                                "float32") for c in PACKED}
    assert used["varlen_causal_gqa"] >= {"varlen", "causal", "grouped_query"}
    assert used["varlen_window_sinks"] >= {"varlen", "window", "sinks", "softcap"}
    assert used["chunked_causal_bottom_right"] >= {"chunked", "causal", "bottom_right"}
    assert used["alibi_gqa"] >= {"alibi", "grouped_query"}
    assert "segments" in used["segment_ids_bottom_right"]
    assert used["mods_causal_alibi"] >= {"mask_mod", "score_mod"}
    assert all(used[c] & NEW_FEATURES for c in PACKED)
    combined = {c.name for c in COMBINED_CASES}  # features together, old and new
    assert all(not plugins.features(c.data().arrays, c.data().options, "float32") & NEW_FEATURES
               for c in cases.CASES if c.name not in PACKED and c.name not in combined)


def test_declared_unsupported_and_not_provided_are_not_failures() -> None:
    declares = fake_numpy("fake_declares", UNSUPPORTED=NEW_FEATURES)
    lacks = fake_numpy("fake_lacks_varlen", drop=("varlen_attention", "varlen_attention_vjp"))
    for case in PACKED:
        cell = runner.run_cell(declares, _expected(case, "float32"))
        assert cell.status == "unsupported", (case, cell.detail)
    for case in ("varlen_causal_gqa", "varlen_window_sinks"):
        cell = runner.run_cell(lacks, _expected(case, "float32"))
        assert cell.status == "not provided" and "varlen_attention" in cell.detail
    notes: list[str] = []
    checked = {r.case for r in runner.run_errors([declares], notes)}
    new_rules = set(spec.VARLEN_ERRORS) | set(spec.MASKS_AND_MODS_ERRORS)
    skipped = {c.name for c in errors.ERROR_CASES if c.rule in new_rules}
    assert skipped and not checked & skipped and "rank_below_2" in checked
    assert any("bad inputs:" in n for n in notes)


# ------------------------------------------------------------------------------ planted bugs


def _off_by_one(fn):  # noqa: ANN001, ANN202 - cu_seq_k's inner offsets one token late
    def varlen(*args, cu_seq_q, cu_seq_k, max_q, max_k, **kw):  # noqa: ANN001, ANN202, ANN003
        return fn(*args, cu_seq_q=cu_seq_q, cu_seq_k=shifted_offsets(cu_seq_k, 1), max_q=max_q,
                  max_k=max_k + 1, **kw)

    return varlen


def _each_sdpa(transform):  # noqa: ANN001, ANN202 - the four attention functions, kwargs changed
    def wrap(fn):  # noqa: ANN001, ANN202
        return lambda *args, **kw: fn(*args, **transform(args[0], args[1], dict(kw)))

    names = ("scaled_dot_product_attention", "scaled_dot_product_attention_vjp",
             "blockwise_attention", "blockwise_attention_vjp")
    return {n: wrap(getattr(numpy_attn, n)) for n in names}


def _alibi_flipped(q, k, kw):  # noqa: ANN001, ANN202
    if kw.get("alibi_slopes") is not None:
        kw["alibi_slopes"] = -kw["alibi_slopes"]
    return kw


def _chunk_shifted(q, k, kw):  # noqa: ANN001, ANN202 - 1-based positions in the chunk rule
    chunk = kw.pop("chunk_size", None)
    if chunk:
        offset = k.shape[-2] - q.shape[-2] if kw.get("causal_alignment") == "bottom_right" else 0
        kw["mask_mod"] = lambda b, h, i, j: ((i + offset + 1) // chunk == (j + 1) // chunk) & (
            i + offset >= 0)
    return kw


def _blocked_ignores_mask_mod(fn):  # noqa: ANN001, ANN202
    return lambda *args, mask_mod=None, **kw: fn(*args, **kw)


PLANTED = {
    # bug: (overrides, cases that must fail, cases that must pass, words of the diagnosis)
    "offsets_off_by_one": (
        {"varlen_attention": _off_by_one(numpy_attn.varlen_attention),
         "varlen_attention_vjp": _off_by_one(numpy_attn.varlen_attention_vjp)},
        {"varlen_causal_gqa", "varlen_window_sinks"}, {"self"}, "offsets are off by one"),
    "alibi_sign_flipped": (_each_sdpa(_alibi_flipped),
                           {"alibi_gqa", "alibi_causal_bottom_right"},
                           {"mods_causal_alibi", "self", "chunked_causal_bottom_right"},
                           "ALiBi's sign is flipped"),
    "chunk_boundary_shifted": (_each_sdpa(_chunk_shifted), {"chunked_causal_bottom_right"},
                               {"self", "alibi_gqa", "causal_bottom_right"},
                               "chunk boundary is shifted by one"),
    "blocked_path_ignores_mask_mod": (
        {n: _blocked_ignores_mask_mod(getattr(numpy_attn, n))
         for n in ("blockwise_attention", "blockwise_attention_vjp")},
        set(MOD_CASES), {"self", "alibi_gqa", "segment_ids_bottom_right"},
        "mask_mod is ignored"),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bug_is_caught_and_named(bug: str) -> None:
    failing = check_planted_bug(bug, *PLANTED[bug])
    if bug == "blocked_path_ignores_mask_mod":  # the other paths still pass
        for key, cell in failing.items():
            bad = {s.step for s in cell.steps if not s.passed}
            assert bad and all(s.startswith("blockwise_") for s in bad), (key, bad)


# ------------------------------------------------------------------------------ golden


GOLDEN = ["varlen_window_sinks", "mods_causal_alibi", "mask_mod_random",
          "segment_ids_bottom_right"]


@pytest.fixture(scope="module")
def gold(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("export") / "packed"
    golden.export(folder, GOLDEN, ["bfloat16"])
    return folder


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _rewrite(folder: Path, name: str, arrays: dict[str, np.ndarray]) -> None:
    with open(folder / name, "wb") as f:
        np.savez(f, **arrays)
    manifest = json.loads((folder / golden.MANIFEST).read_text())
    manifest["files"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                         for p in folder.glob("*.npz")}
    (folder / golden.MANIFEST).write_text(json.dumps(manifest))


def test_golden_files_carry_offsets_slopes_ids_and_tabulated_mods(gold: Path) -> None:
    files = {c: _arrays(gold / f"{c}__bfloat16.npz") for c in GOLDEN}
    packed = files["varlen_window_sinks"]
    assert packed["in:cu_seq_q"].tolist() == [0, 4, 5, 11] and packed["in:query"].shape == (
        11, 4, 8)
    assert json.loads(str(packed["meta"]))["options"]["window_size"] == [2, 0]
    mod = files["mods_causal_alibi"]
    q_len, kv_len = 5, 7
    causal = np.arange(kv_len) <= np.arange(q_len)[:, None] + 2
    assert (mod["table:mask_mod"] == causal).all() and mod["table:mask_mod"].shape == (2, 4, 5, 7)
    slopes = mod["in:mod_slopes"].view(backends.BFLOAT16).astype(np.float64)
    distance = np.abs(np.arange(q_len)[:, None] + 2 - np.arange(kv_len))
    np.testing.assert_array_equal(mod["table:score_mod"][0], -slopes[:, None, None] * distance)
    assert files["mask_mod_random"]["table:mask_mod"].dtype == bool
    assert {"in:q_segment_ids", "in:kv_segment_ids"} <= set(files[
        "segment_ids_bottom_right"])
    result = golden.check(gold, ["numpy"])
    assert result.ok and {c.status for c in result.cells} == {"ok"}


@pytest.mark.parametrize(("case", "change", "match"), [
    ("mask_mod_random", {"table:mask_mod": "flip"}, "not the tabulation"),
    ("mods_causal_alibi", {"meta:mask_mod": {"name": "os.system"}}, "mask_mod.*one of"),
    ("mods_causal_alibi", {"meta:score_mod": {"name": "alibi", "offset": "2"}},
     "offset = '2' is not valid"),
    ("varlen_window_sinks", {"in:cu_seq_k": np.array([0, 9, 6, 15], np.int32)}, "cu_seq"),
    ("varlen_window_sinks", {"meta:max_q": 2}, "max_q"),
    ("varlen_window_sinks", {"in:seqused_k": np.array([5, 30, 4], np.int32)}, "seqused_k"),
    ("segment_ids_bottom_right", {"in:q_segment_ids": np.zeros((2, 4), np.int64)},
     "q_segment_ids"),
], ids=["altered-table", "unknown-mod", "bad-parameter", "offsets-decrease", "max-q-short",
        "seqused-out-of-range", "ids-misshaped"])
def test_a_crafted_packed_or_mod_file_is_refused(gold: Path, tmp_path: Path, case: str,
                                                 change: dict, match: str) -> None:
    folder = tmp_path / "golden"
    shutil.copytree(gold, folder)
    name = f"{case}__bfloat16.npz"
    arrays = _arrays(folder / name)
    for key, value in change.items():
        if key.startswith("meta:"):
            meta = json.loads(str(arrays["meta"]))
            meta["options"][key.removeprefix("meta:")] = value
            arrays["meta"] = np.array(json.dumps(meta))
        elif isinstance(value, str):
            arrays[key] = ~arrays[key]
        else:
            arrays[key] = value
    _rewrite(folder, name, arrays)
    with pytest.raises(golden.GoldenError, match=match):
        golden.check(folder, ["numpy"], [case])
