"""The contract of a checked module ("plugin"): what it provides, what it does not support, and
its layout (``spec.PLUGIN_CONTRACT``; ``docs/checking.md`` for users).

* ``import_plugin(path)`` imports the module; a module that does not exist is a ``UsageError``
  (one line), a module whose own import fails is a ``PluginImportError`` carrying the real
  traceback (both exit code 2);
* ``contract_of(module)`` reads the ``Contract``: the names of ``spec.FUNCTIONS``,
  ``spec.MODULES`` and ``CLASSES`` it defines (only ``scaled_dot_product_attention`` is
  required), its
  ``UNSUPPORTED`` set (names of ``spec.PLUGIN_FEATURES``) and its ``LAYOUT``;
* ``view(module, contract)`` is the module as the harness calls it: unchanged in the spec's
  layout, with query/key/value and the results transposed for ``LAYOUT = "bshd"``;
* ``features(arrays, options, dtype)`` names the features a case uses, so a cell needing a
  declared-unsupported feature is reported as unsupported rather than run: ``sinks`` for a
  ``sinks`` array, ``merge`` and ``lse`` for a merge case (its parts call ``return_lse=True``);
  the ``lse`` steps of an sdpa case need ``lse`` on their own (``steps.Step.feature``);
  ``chunked``, ``alibi``, ``segments``, ``score_mod`` and ``mask_mod`` for the arguments of
  ``spec.PIPELINE_WITH_MODS`` (a mod is an option of the case, ``conformance.cases.mods``), and
  ``varlen`` for a packed batch (its ``cu_seq_q``; with ``causal``/``window`` from its
  ``window_size``, ``grouped_query``, ``sinks``, ``softcap``, ``scale`` as it uses them), and
  ``rotary`` for a rotary case (its ``positions``), ``quantized_cache`` for a quantised case
  (its scheme, option ``q_dtype``) and ``latent_attention`` for the module case of
  ``MultiHeadLatentAttention``.

Standard library and NumPy only: ``backends`` builds a plugin's adapter on top of this file.
"""

from __future__ import annotations

import functools
import importlib
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import numpy as np

from .. import spec
from ..usage import UsageError

#: The one function a checked module must define.
REQUIRED = "scaled_dot_product_attention"
#: The spec's classes a checked module may define besides its modules: the paged KV cache
#: (``spec.PAGED_CACHE``), which the paged cases fill and attend; multi-head latent attention
#: (``spec.LATENT_ATTENTION``) and the quantised cache with its scheme
#: (``spec.QUANTIZED_CACHE``; without ``KVQuantization`` the harness passes
#: ``attention_rules``' own).
CLASSES = ("PagedKVCache", "MultiHeadLatentAttention", "KVQuantization", "QuantizedKVCache")
#: Every name the harness may call, in the spec's order.
OPTIONAL = tuple(n for n in (*spec.FUNCTIONS, *spec.MODULES, *CLASSES) if n != REQUIRED)
#: ``"bhsd"``: the spec's ``(..., heads, seq, head_dim)``; ``"bshd"``: ``(..., seq, heads,
#: head_dim)`` (flash-attention, ``jax.nn``).
LAYOUTS = ("bhsd", "bshd")


class PluginImportError(UsageError):
    """Importing a checked module raised: shown with its traceback, exit code 2."""

    def __init__(self, path: str, text: str) -> None:
        super().__init__(f"importing {path!r} failed (traceback above)")
        self.traceback = text


@dataclass(frozen=True)
class Contract:
    """What a checked module provides and declares."""

    path: str
    provided: frozenset[str]  # names of spec.FUNCTIONS, spec.MODULES and CLASSES it defines
    unsupported: frozenset[str] = frozenset()  # names of spec.PLUGIN_FEATURES
    layout: str = "bhsd"

    @property
    def not_provided(self) -> tuple[str, ...]:
        """The optional names it does not define, in the spec's order."""
        return tuple(n for n in OPTIONAL if n not in self.provided)


def file_path_hint(path: str) -> str:
    """"" for a dotted module name; for a file path given instead (``myattn.py``,
    ``sub/myattn.py``, ``./myattn``, ``/abs/myattn.py``) one line naming the dotted name to give
    and the folder to run from. A name ending in ``.py`` is always taken for a file (a module
    called ``py`` inside a package ``myattn`` cannot be checked by that name)."""
    if not (path.endswith(".py") or "/" in path or "\\" in path):
        return ""
    file = PurePosixPath(path.replace("\\", "/"))
    stem = file.with_suffix("") if file.suffix == ".py" else file
    parts = [p for p in stem.parts if p not in (".", "/")]
    fix = "drop '.py'" if len(parts) == 1 else "a dotted module name, not a file path"
    if file.is_absolute() or ".." in parts or not all(p.isidentifier() for p in parts):
        folder = str(file.parent)
        return (f"--backend {path!r}: a module name, not a file path: --backend {stem.name}, "
                f"run from {folder} (or with PYTHONPATH={folder})")
    where = f"{parts[0]}/" if len(parts) > 1 else f"{parts[0]}.py"
    return (f"--backend {path!r}: {fix}: --backend {'.'.join(parts)} (run from the folder "
            f"that holds {where})")


def import_plugin(path: str) -> types.ModuleType:
    """``importlib.import_module(path)``: a missing module is a one-line ``UsageError``; an
    import that fails inside the module is a ``PluginImportError`` with its traceback; a file
    path instead of a module name is a ``UsageError`` naming the module name
    (``file_path_hint``)."""
    if file_path_hint(path):
        raise UsageError(file_path_hint(path))
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as exc:
        if exc.name and (path == exc.name or path.startswith(exc.name + ".")):
            raise UsageError(
                f"no backend or module named {path!r} (numpy, jax, torch, a peer, or a module "
                f"path; install: make {path!r} importable, e.g. pip install it or run from its "
                f"folder)") from None
        raise PluginImportError(path, traceback.format_exc()) from exc
    except Exception as exc:  # noqa: BLE001 - whatever the module's own import raises
        raise PluginImportError(path, traceback.format_exc()) from exc


def contract_of(module: types.ModuleType, path: str | None = None) -> Contract:
    """The contract a module declares (``UsageError`` for a broken one, naming the fix)."""
    path = path or module.__name__
    provided = frozenset(n for n in (REQUIRED, *OPTIONAL) if callable(getattr(module, n, None)))
    if REQUIRED not in provided:
        raise UsageError(f"{path} defines no {REQUIRED}, the one function a checked module "
                         f"must provide (docs/checking.md)")
    declared = getattr(module, "UNSUPPORTED", ())
    declared = {declared} if isinstance(declared, str) else set(declared)
    unknown = sorted(str(n) for n in declared - set(spec.PLUGIN_FEATURES))
    if unknown:
        raise UsageError(f"{path}.UNSUPPORTED names {', '.join(unknown)}; known features: "
                         f"{', '.join(spec.PLUGIN_FEATURES)}")
    layout = str(getattr(module, "LAYOUT", "bhsd")).lower()
    if layout not in LAYOUTS:
        raise UsageError(f"{path}.LAYOUT is {layout!r}; expected one of {LAYOUTS}")
    return Contract(path, provided, frozenset(declared), layout)


# ------------------------------------------------------------------------------ layout


def _swap(x: Any) -> Any:
    """``(..., heads, seq, dim)`` ↔ ``(..., seq, heads, dim)``; 2-D arrays and None as they are;
    each array of a list or tuple (``merge_attention``'s ``outputs``)."""
    if isinstance(x, (list, tuple)):
        return type(x)(_swap(v) for v in x)
    if x is None or np.ndim(x) < 3:
        return x
    return x.swapaxes(-3, -2) if hasattr(x, "swapaxes") else np.swapaxes(x, -3, -2)


#: function → (positions of its (..., seq, heads, dim) arguments, of its results: "all" for a
#: single array, a tuple of indices for a tuple of results, "first" for either). An lse keeps
#: ``(..., heads, q_len)`` in either layout (as flash-attention's ``softmax_lse``).
_SEQUENCE_ARRAYS: dict[str, tuple[tuple[int, ...], Any]] = {
    "attention_scores": ((0, 1), None),
    "attention_output": ((1,), "all"),
    "scaled_dot_product_attention": ((0, 1, 2), "first"),
    "scaled_dot_product_attention_vjp": ((0, 1, 2, 3), (0, 1, 2)),
    "blockwise_attention": ((0, 1, 2), "first"),
    "merge_attention": ((0,), (0,)),
    "blockwise_attention_vjp": ((0, 1, 2, 3), (0, 1, 2)),
    "rotary_embedding": ((0,), "all"),
    "rotary_embedding_vjp": ((0, 2), "all"),
}
_KEYWORDS = ("query", "key", "value", "grad_output", "outputs")


def _seq_first(fn: Callable[..., Any], inputs: tuple[int, ...], results: Any
               ) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args = tuple(_swap(a) if i in inputs else a for i, a in enumerate(args))
        kwargs = {k: _swap(v) if k in _KEYWORDS else v for k, v in kwargs.items()}
        out = fn(*args, **kwargs)
        if results == "all" or (results == "first" and not isinstance(out, tuple)):
            return _swap(out)
        if results == "first":
            return (_swap(out[0]), *out[1:])
        if isinstance(results, tuple):
            return tuple(_swap(r) if i in results else r for i, r in enumerate(out))
        return out

    return wrapper


def view(module: types.ModuleType, contract: Contract) -> types.ModuleType:
    """The module as the harness calls it: itself in the spec's layout; for ``"bshd"`` a copy
    whose attention functions take and return the spec's layout."""
    if contract.layout == "bhsd":
        return module
    adapted = types.ModuleType(module.__name__, module.__doc__)
    adapted.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    for name, (inputs, results) in _SEQUENCE_ARRAYS.items():
        if name in contract.provided:
            setattr(adapted, name, _seq_first(getattr(module, name), inputs, results))
    return adapted


# ------------------------------------------------------------------------------ features


#: keyword argument → the feature a call using it needs.
_KEYWORD_FEATURES = {"mask": "mask", "bias": "bias", "is_causal": "causal", "window": "window",
                     "scale": "scale", "softcap": "softcap", "dropout_p": "dropout",
                     "dropout_mask": "dropout", "return_weights": "return_weights",
                     "sinks": "sinks", "return_lse": "lse", "chunk_size": "chunked",
                     "alibi_slopes": "alibi", "segment_ids": "segments",
                     "score_mod": "score_mod", "mask_mod": "mask_mod"}
#: The keywords only the packed-batch functions take (``varlen_attention`` and its VJP,
#: ``pack_sequences``/``unpack_sequences``): a call with one needs ``varlen``.
_VARLEN_KEYWORDS = ("cu_seq_q", "cu_seq_k", "lengths", "cu_seq")


def _given(value: Any) -> bool:
    if value is None:
        return False
    return bool(value) if isinstance(value, (bool, int, float)) else True


def _dtype_name(x: Any) -> str:
    return str(getattr(x, "dtype", "")).removeprefix("torch.")


def _parts(x: Any) -> bool:
    """True for a list or tuple of arrays (or an empty one): ``merge_attention``'s arguments."""
    return isinstance(x, (list, tuple)) and all(hasattr(v, "shape") for v in x)


def call_features(args: tuple[Any, ...], kwargs: dict[str, Any]) -> frozenset[str]:
    """The names of ``spec.PLUGIN_FEATURES`` a call ``fn(*args, **kwargs)`` uses; ``args``
    start with query, key, value when the function takes them, or with ``merge_attention``'s
    ``outputs, lses`` (``merge``: a list or tuple of arrays among the first two arguments, or
    two lists; a bare Python list where an array belongs is one list alone)."""
    used = {f for k, f in _KEYWORD_FEATURES.items() if _given(kwargs.get(k))}
    if kwargs.get("chunk_size") is not None:  # chunk_size=0 is a (bad) chunk size too
        used.add("chunked")
    if any(k in kwargs for k in _VARLEN_KEYWORDS):
        return frozenset(used | _varlen_features(args, kwargs))
    first = args[:2]
    if len(first) == 2 and (any(_parts(a) for a in first)
                            or all(isinstance(a, (list, tuple)) for a in first)):
        used.add("merge")
    if kwargs.get("causal_alignment") == "bottom_right" and (
            _given(kwargs.get("is_causal")) or _given(kwargs.get("window"))):
        used.add("bottom_right")
    values = (*args, *kwargs.values())
    inner = [v for x in values if isinstance(x, (list, tuple)) for v in x]  # merge's lists
    used.update(d for d in map(_dtype_name, (*values, *inner)) if d in spec.TOLERANCES)
    shapes = [np.shape(a) for a in args[:3] if hasattr(a, "shape")]
    if len(shapes) == 3 and all(len(s) >= 2 for s in shapes):
        q, k, v = shapes
        if len(q) == 2:
            used.add("2d_inputs")
        elif len(k) >= 3 and k[-3] != q[-3]:
            used.add("grouped_query")
        if v[-1] != q[-1]:
            used.add("v_dim")
    return frozenset(used)


def _varlen_features(args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[str]:
    """A packed-batch call: ``varlen``, its dtype, ``causal``/``window`` (``window_size``: (-1,
    0) is the causal rule, anything else but (-1, -1) a window) and ``grouped_query``
    (``(total, kv_heads, dim)`` keys with fewer heads than the queries)."""
    used = {"varlen"}
    window = kwargs.get("window_size")
    if isinstance(window, (list, tuple)) and tuple(window) != (-1, -1):
        used.add("causal" if tuple(window) == (-1, 0) else "window")
    used.update(d for d in map(_dtype_name, (*args, *kwargs.values())) if d in spec.TOLERANCES)
    shapes = [np.shape(a) for a in args[:2] if hasattr(a, "shape")]
    if len(shapes) == 2 and len(shapes[0]) == 3 and len(shapes[1]) >= 3 and \
            shapes[1][-2] != shapes[0][-2]:
        used.add("grouped_query")
    return used


def features(arrays: dict[str, Any], options: dict[str, Any], dtype: str,
             finite: bool = True) -> frozenset[str]:
    """The names of ``spec.PLUGIN_FEATURES`` a case uses: those of its call (an sdpa case), its
    dtype, ``non_finite`` for NaN or Inf inputs, ``merge`` and ``lse`` for a merge case (its
    option ``parts``) and ``paged`` for a paged case (its ``key_pages``)."""
    used = {dtype} if finite else {dtype, "non_finite"}
    if "parts" in options:
        used |= {"merge", "lse"}
    if "positions" in arrays:  # a rotary case: rotary_embedding, its VJP, rope_frequencies
        used.add("rotary")
    if "q_dtype" in options:  # a quantised case: quantize_kv, dequantize_kv, the cache
        used.add("quantized_cache")
    if options.get("module") == "MultiHeadLatentAttention":
        used.add("latent_attention")
    if "key_pages" in arrays:  # a paged case: its keyword features and grouped heads
        used |= {"paged"} | call_features((), {**options, "sinks": arrays.get("sinks")})
        if np.shape(arrays["key_pages"])[-2] != np.shape(arrays["query"])[-3]:
            used.add("grouped_query")
    elif "query" in arrays:
        qkv = tuple(arrays[n] for n in ("query", "key", "value"))
        others = {k: v for k, v in arrays.items() if k not in ("query", "key", "value")}
        if "q_segment_ids" in others:  # the pair segment_ids=(q_segment_ids, kv_segment_ids)
            others["segment_ids"] = (others["q_segment_ids"], others["kv_segment_ids"])
        used |= call_features(qkv, {**others, **options})
    return frozenset(used) - {"return_weights"}


__all__ = ["CLASSES", "LAYOUTS", "OPTIONAL", "REQUIRED", "Contract", "PluginImportError",
           "call_features", "contract_of", "features", "file_path_hint", "import_plugin", "view"]
