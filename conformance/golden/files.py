"""One golden file: ``save`` writes a case × dtype as ``.npz``; ``load``/``parse`` read one back,
its structure checked (what ``save`` writes and nothing else: ``GoldenError`` otherwise)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..cases import catalogue as cases_mod
from ..cases import quantized as quantized_cases
from ..cases.catalogue import CaseData
from ..cases.dtypes import BFLOAT16, DTYPES
from ..cases.expected import Expected
from ..cases.mods import ModError
from ..running import steps as steps_mod
from ..usage import UsageError
from . import packed
from .untrusted import read_file, read_npz

FORMAT = 3
READABLE_FORMATS = (1, 2, 3)  # format 1: no ``any:`` arrays; 2: no ``table:`` arrays

#: Largest golden ``.npz`` file hashed or loaded (a full export's largest is well under 1 MiB).
MAX_FILE_BYTES = 256 * 2**20
#: Dtypes an input may declare in ``meta["input_dtypes"]``.
INPUT_DTYPES = (*DTYPES, "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                "uint64")
#: Option keys a case of each kind may carry.
OPTION_KEYS = {"sdpa": frozenset({*cases_mod.SDPA_OPTIONS, "mask_mod", "score_mod"}),
               "merge": frozenset({*cases_mod.SDPA_OPTIONS, "parts"}),
               "paged": frozenset({"scale", "softcap"}),
               "varlen": packed.VARLEN_OPTIONS,
               "module": frozenset({"module", "init", "forward", "decode"}),
               "rotary": frozenset({"layout", "theta", "rotary_dim", "scaling", "seq_len",
                                    "max_position_embeddings", "inv_freq", "attention_factor",
                                    "cu_seq"}),
               "quantized": quantized_cases.QUANTIZED_OPTIONS}
#: The most parts a merge case may split its keys into (the cases use 2 to 4).
MAX_PARTS = 16
_KINDS = ("in", "expected", "baseline", "zeros", "any", "table")
_SCALARS = (type(None), bool, int, float, str)


class GoldenError(UsageError):
    """A golden directory or file that is missing, incomplete, altered or malformed."""


def _store(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype == BFLOAT16 else x


def _restore(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.view(BFLOAT16) if dtype == "bfloat16" else x.astype(np.dtype(dtype), copy=False)


def save(exp: Expected, path: str | Path) -> None:
    """One case × dtype to ``path`` (.npz, no pickles)."""
    arrays: dict[str, np.ndarray] = {}
    input_dtypes = {}
    for name, x in exp.data.arrays.items():
        arrays[f"in:{name}"] = _store(x)
        input_dtypes[name] = np.asarray(x).dtype.name
    for step, value in exp.values.items():
        arrays[f"expected:{step}"] = np.asarray(value, np.float64)
        arrays[f"baseline:{step}"] = np.asarray(exp.baseline[step], np.float64)
    for step, zeros in exp.zeros.items():
        arrays[f"zeros:{step}"] = np.ascontiguousarray(zeros)
    for step, free in exp.unspecified.items():
        arrays[f"any:{step}"] = np.ascontiguousarray(free)
    arrays.update(packed.tables(exp.kind, exp.data))  # a mod as its mask or bias
    meta = {"case": exp.case, "dtype": exp.dtype, "kind": exp.kind,
            "options": exp.data.options, "input_dtypes": input_dtypes, "format": FORMAT}
    arrays["meta"] = np.array(json.dumps(meta))
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def _is_scalar(x: Any) -> bool:
    return isinstance(x, _SCALARS)


def _check_options(options: Any, case: cases_mod.Case, where: str) -> None:
    if not isinstance(options, dict):
        raise GoldenError(f"{where}: meta options is not an object")
    unknown = sorted(set(options) - OPTION_KEYS[case.kind])
    if unknown:
        raise GoldenError(f"{where}: meta options {', '.join(map(str, unknown))} are not options "
                          f"of a {case.kind} case")
    for name, value in options.items():
        try:
            ok = packed.check_option(name, value)
        except ModError as exc:
            raise GoldenError(f"{where}: meta option {name}: {exc}") from None
        if ok is not None:
            pass
        elif name == "window":
            ok = value is None or (isinstance(value, list) and len(value) == 2 and all(
                v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in value))
        elif name == "decode":
            ok = isinstance(value, list) and all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
        elif name in ("init", "forward"):
            ok = isinstance(value, dict) and all(
                isinstance(k, str) and _is_scalar(v) for k, v in value.items())
        elif name == "module":
            ok = value == case.data().options.get("module")
        elif name == "parts":
            ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_PARTS
        elif name == "scaling":  # a rotary case's transformers dict: numbers, lists of numbers
            ok = value is None or (isinstance(value, dict) and all(
                isinstance(k, str) and (_is_scalar(v) or (isinstance(v, list) and all(
                    isinstance(f, (int, float)) for f in v))) for k, v in value.items()))
        elif name == "appends":  # a quantised cache case's append sizes
            ok = isinstance(value, list) and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        elif name in ("q_scale", "v_q_scale"):  # a given fp8 scale: a number, one per head
            ok = value is None or (isinstance(value, (int, float)) and not isinstance(
                value, bool)) or (isinstance(value, list) and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in value))
        elif name in ("inv_freq", "cu_seq"):  # a rotary case's frequencies, packed offsets
            ok = isinstance(value, list) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        else:
            ok = _is_scalar(value)
        if not ok:
            raise GoldenError(f"{where}: meta option {name} = {value!r} is not valid for case "
                              f"{case.name}")


def _check_split(data: CaseData, label: str) -> None:
    """A merge case's split: ``parts`` and ``key_part``, ints ``(kv_len,)`` in ``[0, parts)``."""
    parts, key_part = data.options.get("parts"), data.arrays.get("key_part")
    key = data.arrays.get("key")
    if parts is None or key_part is None or key is None:
        raise GoldenError(f"{label}: a merge case needs option parts and inputs key, key_part")
    if (key_part.dtype.kind not in "iu" or key_part.shape != key.shape[-2:-1]
            or (key_part.size and not 0 <= key_part.min() <= key_part.max() < parts)):
        raise GoldenError(f"{label}: key_part must be ints (kv_len,) = {key.shape[-2:-1]} in "
                          f"[0, parts={parts}); got {key_part.dtype} {key_part.shape}")


def _check_pages(data: CaseData, label: str) -> None:
    """A paged case: ``query (batch, heads, q_len, head_dim)``, pages ``(num_blocks, block_size,
    kv_heads, ·)``, ``block_table`` ints ``(batch, max_blocks)`` in ``[-1, num_blocks)`` and
    ``seq_lens`` ints ``(batch,)`` in ``[0, max_blocks · block_size]``."""
    a = data.arrays
    names = ("query", "key_pages", "value_pages", "block_table", "seq_lens")
    if any(n not in a for n in names):
        raise GoldenError(f"{label}: a paged case needs inputs {', '.join(names)}")
    q, kp, vp, table, lens = (a[n] for n in names)
    ok = (q.ndim == 4 and kp.ndim == vp.ndim == 4 and kp.shape[:3] == vp.shape[:3]
          and table.dtype.kind in "iu" and lens.dtype.kind in "iu" and table.ndim == 2
          and lens.shape == (q.shape[0],) and table.shape[0] == q.shape[0])
    if ok and table.size:
        ok = -1 <= table.min() and table.max() < kp.shape[0]
    if ok and lens.size:
        ok = 0 <= lens.min() and lens.max() <= table.shape[1] * kp.shape[1]
    if not ok:
        raise GoldenError(f"{label}: the pages, block_table {table.shape} and seq_lens "
                          f"{lens.shape} do not describe a paged cache (shapes, ranges)")


def _meta(arrays: dict[str, np.ndarray], label: str) -> dict[str, Any]:
    meta_array = arrays.get("meta")
    if meta_array is None:
        raise GoldenError(f"{label}: no meta array")
    if meta_array.dtype.kind != "U" or meta_array.shape != ():
        raise GoldenError(f"{label}: meta is not a JSON string")
    try:
        meta = json.loads(str(meta_array[()]))
    except (ValueError, RecursionError) as exc:
        raise GoldenError(f"{label}: meta is not valid JSON ({exc})") from exc
    if not isinstance(meta, dict):
        raise GoldenError(f"{label}: meta is not a JSON object")
    for key, kind in (("case", str), ("dtype", str), ("kind", str), ("options", dict),
                      ("input_dtypes", dict)):
        if not isinstance(meta.get(key), kind):
            raise GoldenError(f"{label}: meta has no valid {key!r}")
    if meta.get("format") not in READABLE_FORMATS:
        raise GoldenError(f"{label}: format {meta.get('format')!r}, expected one of "
                          f"{READABLE_FORMATS}")
    if meta["case"] not in cases_mod.CASE_NAMES:
        raise GoldenError(f"{label}: unknown case {meta['case']!r} (see --list)")
    if meta["dtype"] not in DTYPES:
        raise GoldenError(f"{label}: unknown dtype {meta['dtype']!r}; known: "
                          f"{', '.join(DTYPES)}")
    case = cases_mod.get(meta["case"])
    if meta["kind"] != case.kind:
        raise GoldenError(f"{label}: kind {meta['kind']!r}, but case {case.name} is "
                          f"{case.kind!r}")
    _check_options(meta["options"], case, label)
    return meta


def parse(data: bytes, label: str) -> Expected:
    """An ``Expected`` from the bytes of a file written by ``save``, its structure checked."""
    arrays = read_npz(data, label, GoldenError)
    meta = _meta(arrays, label)
    dtype, input_dtypes = meta["dtype"], meta["input_dtypes"]
    data_ = CaseData({}, dict(meta["options"]))
    values: dict[str, np.ndarray] = {}
    baseline: dict[str, float] = {}
    zeros: dict[str, np.ndarray] = {}
    unspecified: dict[str, np.ndarray] = {}
    extra: dict[str, dict[str, np.ndarray]] = {"baseline": {}, "zeros": {}, "any": {}}
    tables: dict[str, np.ndarray] = {}
    for key, x in arrays.items():
        if key == "meta":
            continue
        kind, _, name = key.partition(":")
        if kind not in _KINDS or not name:
            raise GoldenError(f"{label}: unexpected array {key!r}")
        if kind == "in":
            declared = input_dtypes.get(name)
            if declared not in INPUT_DTYPES:
                raise GoldenError(f"{label}: input {name!r} has no valid dtype in meta "
                                  f"({declared!r})")
            stored = np.dtype(np.uint16) if declared == "bfloat16" else np.dtype(declared)
            if x.dtype != stored:
                raise GoldenError(f"{label}: {key} is {x.dtype}, meta declares {declared}")
            if declared in DTYPES and declared != dtype:
                raise GoldenError(f"{label}: {key} is {declared} in a {dtype} file")
            data_.arrays[name] = _restore(x, declared)
        elif kind == "table":
            tables[key] = x
        elif kind == "expected":
            if name not in steps_mod.STEPS:
                raise GoldenError(f"{label}: {key} is not a step this harness knows")
            if x.dtype != np.float64:
                raise GoldenError(f"{label}: {key} is {x.dtype}, not float64")
            values[name] = x
        else:
            extra[kind][name] = x
    for name in input_dtypes:
        if name not in data_.arrays:
            raise GoldenError(f"{label}: input {name!r} named in meta has no in:{name} array")
    if meta["kind"] == "merge":
        _check_split(data_, label)
    if meta["kind"] == "paged":
        _check_pages(data_, label)
    for name in ("window", "window_size"):
        if isinstance(data_.options.get(name), list):
            data_.options[name] = tuple(data_.options[name])
    problem = packed.check_inputs(meta["kind"], data_) or packed.check_tables(
        tables, meta["kind"], data_)
    if problem:
        raise GoldenError(f"{label}: {problem}")
    if not values:
        raise GoldenError(f"{label}: no expected:<step> array")
    for kind, found in extra.items():
        for name, x in found.items():
            if name not in values:
                raise GoldenError(f"{label}: {kind}:{name} has no expected:{name}")
            if kind == "baseline":
                if x.dtype != np.float64 or x.shape != ():
                    raise GoldenError(f"{label}: baseline:{name} is not a float64 scalar")
                baseline[name] = float(x)
            else:
                if x.dtype != np.bool_ or x.shape != values[name].shape:
                    raise GoldenError(f"{label}: {kind}:{name} is {x.dtype} {x.shape}, expected "
                                      f"bool {values[name].shape} like expected:{name}")
                (zeros if kind == "zeros" else unspecified)[name] = x
    for name in values:
        if name not in baseline:
            raise GoldenError(f"{label}: expected:{name} has no baseline:{name}")
    return Expected(meta["case"], meta["kind"], dtype, data_, values, baseline, zeros,
                    unspecified)


def load(path: str | Path) -> Expected:
    """A file written by ``save``: no pickles; sizes, dtypes and structure checked
    (``GoldenError`` naming the file and the problem otherwise)."""
    path = Path(path)
    return parse(read_file(path, MAX_FILE_BYTES, follow=True, error=GoldenError), str(path))
