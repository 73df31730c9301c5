"""The mods of the conformance cases: FlexAttention's ``mask_mod`` / ``score_mod`` callables,
named from a registry so that a case (and a golden file) can store them.

A callable cannot be written to a file nor compared across processes, so a case names its mod:
``options["mask_mod"] = {"name": "prefix_lm", "prefix_length": 3, "offset": 2}`` (scalar
parameters, JSON), and the arrays a mod reads are inputs of the case like any other
(``MOD_ARRAYS``: ``mod_table``, ``mod_q_ids``/``mod_kv_ids``, ``mod_slopes``; the slopes cast to
the case's dtype). ``build(option, arrays)`` makes the callable (``Mod``): the same for every
backend, picklable (a checked module's worker process receives it), hashable (a static argument
under ``jax.jit``), written with operators and one ``tanh`` so that it runs on NumPy arrays, jax
arrays (traced too) and torch tensors alike (``spec.MOD_INDICES``: broadcast index arrays, or the
0-d indices FlexAttention passes); its tables are converted to the index arrays' framework and
a score mod returns the score's dtype. Score mods carry ``derivative`` (numpy_attn's
hand-written VJPs need it, ``spec.SCORE_MOD``).

``tabulate(data)`` evaluates a case's mods everywhere (a mask, an additive bias, a cap): what a
golden file stores for a kernel author and what a peer without callables takes;
``dedicated(data)`` folds every rule of ``spec.PIPELINE_WITH_MODS`` into the older arguments
(``mask``, ``bias``, ``softcap``), for the naive baseline and the peers. ``sdpa_kwargs`` gives
the keyword arguments of ``scaled_dot_product_attention`` for a case, mods built.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import reference
from .inputs import SDPA_ARRAYS, CaseData, sdpa_options

#: mask_mod name → its scalar parameters (each an int, or None where the name says so).
MASK_MODS: dict[str, tuple[str, ...]] = {
    "causal": ("offset",),  # q + offset >= k
    "sliding_window": ("left", "right", "offset"),  # q + offset - left <= k <= q + offset + right
    "prefix_lm": ("prefix_length", "offset"),  # k < prefix_length or q + offset >= k
    "document": (),  # mod_q_ids[b, q] == mod_kv_ids[b, k]
    "table": (),  # mod_table[b, h, q, k]: any per-element mask
}
#: score_mod name → its scalar parameters.
SCORE_MODS: dict[str, tuple[str, ...]] = {
    "alibi": ("offset",),  # score - mod_slopes[h] · |q + offset - k| (additive)
    "softcap": ("softcap",),  # softcap · tanh(score / softcap)
}
#: The arrays a mod reads (inputs of the case): name → array names.
MOD_ARRAYS = {"document": ("mod_q_ids", "mod_kv_ids"), "table": ("mod_table",),
              "alibi": ("mod_slopes",)}
#: Parameters that may be None (unbounded).
_OPTIONAL = ("left", "right")


class ModError(ValueError):
    """A mod option that names no registered mod or gives the wrong parameters."""


def check_option(kind: str, option: Any, arrays: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``mask_mod``/``score_mod`` option (``kind``), checked: a dict with a registered
    ``name`` and exactly its parameters (ints; ``left``/``right`` also None; ``softcap`` a
    positive finite number); with ``arrays``, the arrays it reads present. ``ModError``
    otherwise."""
    registry = MASK_MODS if kind == "mask_mod" else SCORE_MODS
    if not isinstance(option, dict) or option.get("name") not in registry:
        raise ModError(f"{kind} {option!r}: expected {{'name': one of {sorted(registry)}, ...}}")
    name = option["name"]
    if set(option) != {"name", *registry[name]}:
        raise ModError(f"{kind} {name}: parameters {sorted(set(option) - {'name'})}, expected "
                       f"{list(registry[name])}")
    for param in registry[name]:
        value = option[param]
        if param == "softcap":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
                math.isfinite(value) and value > 0
        else:
            ok = (value is None and param in _OPTIONAL) or (
                isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise ModError(f"{kind} {name}: {param} = {value!r} is not valid")
    for array in MOD_ARRAYS.get(name, ()) if arrays is not None else ():
        if array not in arrays:
            raise ModError(f"{kind} {name} reads the input {array}, which the case lacks")
    return option


# ------------------------------------------------------------------------------ frameworks


def _framework(*xs: Any) -> str:
    """``"torch"``, ``"jax"`` or ``"numpy"``: the framework of the arrays among ``xs``."""
    found = {type(x).__module__.split(".")[0] for x in xs}
    if "torch" in found:
        return "torch"
    return "jax" if found & {"jax", "jaxlib"} else "numpy"


def _like(table: np.ndarray, framework: str, ref: Any, dtype: Any = None) -> Any:
    """A NumPy ``table`` as an array of ``framework`` (on ``ref``'s device for torch), cast to
    ``dtype`` (a dtype of that framework) when given."""
    if framework == "torch":
        import torch

        device = next((x.device for x in ref if isinstance(x, torch.Tensor)), None)
        if table.dtype.name == "bfloat16":
            table = table.astype(np.float32)  # bfloat16 (ml_dtypes): exact in float32
        out = torch.as_tensor(np.ascontiguousarray(table), device=device)
        return out if dtype is None else out.to(dtype)
    if framework == "jax":
        import jax.numpy as jnp

        out = jnp.asarray(table)
        return out if dtype is None else out.astype(dtype)
    return table if dtype is None else table.astype(dtype)


def _tanh(x: Any, framework: str) -> Any:
    if framework == "torch":
        import torch

        return torch.tanh(x)
    if framework == "jax":
        import jax.numpy as jnp

        return jnp.tanh(x)
    return np.tanh(x)


def _cast(x: Any, dtype: Any, framework: str) -> Any:
    if framework == "torch":
        return x.to(dtype)
    if framework == "jax":
        return x.astype(dtype)
    return np.asarray(x).astype(dtype)


def _literal(x: np.ndarray) -> str:
    """A table as Python: bool and int arrays as they are, floats cast to ``dtype``."""
    if x.dtype == np.bool_:
        return f"np.array({x.tolist()!r}, dtype=bool)"
    if x.dtype.kind in "iu":
        return f"np.array({x.tolist()!r})"
    return f"np.array({x.astype(np.float64).tolist()!r}).astype(dtype)"


def _entry(index: Any, size: int) -> Any:
    """A batch or head index into a table axis of ``size`` (``size`` 1: broadcast, index 0)."""
    return index * 0 if size == 1 else index


# ------------------------------------------------------------------------------ the callables


@dataclass(frozen=True, eq=False)
class Mod:
    """A registered mod made callable (``build``): ``kind`` ``"mask_mod"`` or ``"score_mod"``,
    its option (name and parameters) and the NumPy arrays it reads."""

    kind: str
    option: tuple[tuple[str, Any], ...]
    tables: tuple[tuple[str, np.ndarray], ...]

    @property
    def name(self) -> str:
        """The registry name."""
        return dict(self.option)["name"]

    def _key(self) -> tuple:
        digest = hashlib.sha256()
        for name, table in self.tables:
            digest.update(name.encode() + str(table.dtype).encode() + str(table.shape).encode())
            digest.update(np.ascontiguousarray(table).tobytes())
        return (self.kind, self.option, digest.hexdigest())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mod) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        """Python that builds the mod again where ``np`` is NumPy and ``dtype`` the case's
        dtype (as in a shrunk reproducer, ``shrink.reproducer``)."""
        tables = ", ".join(f"{n!r}: {_literal(t)}" for n, t in self.tables)
        return (f"__import__('conformance.cases.mods').cases.mods.build({self.kind!r}, "
                f"{dict(self.option)!r}, {{{tables}}})")

    def __call__(self, *args: Any) -> Any:
        if self.kind == "mask_mod":
            return self._mask(*args)
        return self._score(*args)

    def _mask(self, b: Any, h: Any, q: Any, k: Any) -> Any:
        p, t = dict(self.option), dict(self.tables)
        name, offset = p["name"], p.get("offset", 0)
        if name == "causal":
            return q + offset >= k
        if name == "sliding_window":
            distance = k - q - offset
            allowed = distance == distance  # all True, in the index arrays' framework
            if p["left"] is not None:
                allowed = allowed & (distance >= -p["left"])
            return allowed & (distance <= p["right"]) if p["right"] is not None else allowed
        if name == "prefix_lm":
            return (k < p["prefix_length"]) | (q + offset >= k)
        framework = _framework(b, h, q, k)
        if name == "document":
            q_ids, kv_ids = (_like(t[n], framework, (b, h, q, k))
                             for n in ("mod_q_ids", "mod_kv_ids"))
            return q_ids[_entry(b, q_ids.shape[0]), q] == kv_ids[_entry(b, kv_ids.shape[0]), k]
        table = _like(t["mod_table"], framework, (b, h, q, k))
        return table[_entry(b, table.shape[0]), _entry(h, table.shape[1]), q, k]

    def _score(self, score: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
        p, t = dict(self.option), dict(self.tables)
        framework = _framework(score, b, h, q, k)
        if p["name"] == "softcap":
            return p["softcap"] * _tanh(score / p["softcap"], framework)
        slopes = _like(t["mod_slopes"], framework, (score, b, h, q, k), score.dtype)
        distance = _cast(abs(q + p["offset"] - k), score.dtype, framework)
        return score - slopes[h] * distance

    def derivative(self, score: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
        """``d score_mod / d score`` at ``score``: ``1 - tanh²`` for the cap, 1 for ALiBi."""
        p = dict(self.option)
        if p["name"] == "softcap":
            t = _tanh(score / p["softcap"], _framework(score))
            return 1.0 - t * t
        return score * 0 + 1


def build(kind: str, option: dict[str, Any], arrays: dict[str, Any]) -> Mod:
    """The callable of a ``mask_mod``/``score_mod`` option (``kind``), reading its arrays from
    ``arrays`` (``MOD_ARRAYS``)."""
    option = check_option(kind, option, arrays)
    tables = tuple((n, np.asarray(arrays[n])) for n in MOD_ARRAYS.get(option["name"], ()))
    return Mod(kind, tuple(sorted(option.items(), key=lambda kv: kv[0] != "name")), tables)


#: The options and arrays of ``spec.PIPELINE_WITH_MODS`` that ``mask_scores`` does not take.
MOD_OPTIONS = ("chunk_size", "mask_mod", "score_mod")
MOD_INPUTS = ("alibi_slopes", "q_segment_ids", "kv_segment_ids")


def uses_mods(data: CaseData) -> bool:
    """True for an sdpa case with chunks, ALiBi, segment ids or a mod."""
    return any(data.options.get(n) is not None for n in MOD_OPTIONS) or any(
        n in data.arrays for n in MOD_INPUTS)


def additive(option: dict[str, Any] | None) -> bool:
    """True for a score mod that adds a bias independent of the score (ALiBi)."""
    return option is not None and option.get("name") == "alibi"


# ------------------------------------------------------------------------------ tables


@dataclass
class Tabulated:
    """A case's mods evaluated everywhere: ``mask`` and ``bias`` shaped like the scores
    ``(..., heads, q_len, kv_len)`` (bool, float64), ``softcap`` a number; None where absent."""

    mask: np.ndarray | None = None
    bias: np.ndarray | None = None
    softcap: float | None = None


def score_shape(arrays: dict[str, Any]) -> tuple[int, ...]:
    """The scores' shape of an sdpa case: ``(..., heads, q_len, kv_len)``."""
    q, k = np.shape(arrays["query"]), np.shape(arrays["key"])
    return q[:-1] + k[-2:-1]


def tabulate(data: CaseData) -> Tabulated:
    """The mask of ``mask_mod``, the bias of an additive ``score_mod`` (float64) and the cap of
    the ``softcap`` score mod, of an sdpa case."""
    a, o = data.arrays, data.options
    shape = score_shape(a)
    idx = reference.mod_indices(shape)
    out = Tabulated()
    if o.get("mask_mod") is not None:
        out.mask = np.broadcast_to(build("mask_mod", o["mask_mod"], a)(*idx), shape).copy()
    score = o.get("score_mod")
    if additive(score):
        zeros = np.zeros(shape)
        float_arrays = {n: np.asarray(x).astype(np.float64) if np.asarray(x).dtype.kind == "f"
                        else x for n, x in a.items()}
        out.bias = build("score_mod", score, float_arrays)(zeros, *idx)
    elif score is not None:
        out.softcap = float(score["softcap"])
    return out


#: The inputs ``dedicated`` folds into ``mask`` and ``bias``.
_FOLDED = ("alibi_slopes", "q_segment_ids", "kv_segment_ids", "mod_table", "mod_q_ids",
           "mod_kv_ids", "mod_slopes")


def dedicated(data: CaseData) -> CaseData:
    """An sdpa case with ``chunk_size``, ``alibi_slopes``, the segment ids, ``mask_mod`` and an
    additive ``score_mod`` folded into ``mask`` (bool, scores-shaped, ANDed with a given mask)
    and ``bias`` (float64, added to a given bias), and the ``softcap`` score mod into option
    ``softcap``; the causal rule and the window stay options. ValueError where that changes the
    result: a ``softcap`` score mod after a bias, ALiBi or a soft-cap (the dedicated soft-cap
    comes first)."""
    a, o = data.arrays, data.options
    shape = score_shape(a)
    tab = tabulate(data)
    align = o.get("causal_alignment", "top_left")
    arrays = {n: x for n, x in a.items() if n not in _FOLDED}
    options = {n: x for n, x in o.items() if n not in MOD_OPTIONS}
    pair = (a["q_segment_ids"], a["kv_segment_ids"]) if "q_segment_ids" in a else None
    if o.get("chunk_size") is not None or pair is not None or tab.mask is not None:
        allowed = np.broadcast_to(reference.rule_mask(
            shape, causal_alignment=align, chunk_size=o.get("chunk_size"), segment_ids=pair),
            shape)
        if tab.mask is not None:
            allowed = allowed & tab.mask
        arrays["mask"] = allowed & np.asarray(a["mask"], bool) if "mask" in a else allowed
    biases = [np.asarray(a["bias"], np.float64)] if "bias" in a else []
    if "alibi_slopes" in a:
        biases.append(reference.alibi_bias(a["alibi_slopes"], shape, align))
    if tab.softcap is not None:
        if biases or o.get("softcap") is not None:
            raise ValueError("a softcap score_mod after a bias, ALiBi or a soft-cap is not the "
                             "dedicated softcap")
        options["softcap"] = tab.softcap
    if tab.bias is not None:
        biases.append(tab.bias)
    if biases:
        arrays["bias"] = np.broadcast_to(sum(biases), shape).copy() if len(biases) > 1 \
            else biases[0]
    return CaseData(arrays, options)


def sdpa_kwargs(arrays: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``scaled_dot_product_attention`` for a case: its arrays of
    ``SDPA_ARRAYS`` but query, key and value, ``segment_ids`` as the pair ``(q_segment_ids,
    kv_segment_ids)``, the scalar options and the mods built (``Mod``)."""
    kwargs = {k: v for k, v in arrays.items() if k in SDPA_ARRAYS[3:]}
    if "q_segment_ids" in arrays:
        kwargs["segment_ids"] = (arrays["q_segment_ids"], arrays["kv_segment_ids"])
    kwargs.update(sdpa_options(options))
    for kind in ("mask_mod", "score_mod"):
        if options.get(kind) is not None:
            kwargs[kind] = build(kind, options[kind], arrays)
    return kwargs


__all__ = ["MASK_MODS", "MOD_ARRAYS", "MOD_INPUTS", "MOD_OPTIONS", "SCORE_MODS", "Mod",
           "ModError", "Tabulated", "additive", "build", "check_option", "dedicated",
           "score_shape", "sdpa_kwargs", "tabulate", "uses_mods"]
