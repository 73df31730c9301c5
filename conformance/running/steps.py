"""The compared steps: how a backend computes each step of a case (``STEPS``).

A ``Step`` has a name (the key of its expected value in ``expected.Expected.values``), the case
kinds it applies to, how to run it on a backend through an ``Execution``, and the dtype the spec
requires of the result. An ``Execution`` is one backend on one case in one dtype: it converts
the case's NumPy inputs to the backend's arrays, calls the backend (each function compiled once
per input signature where the backend compiles, ``Backend.function``) and caches calls that
several steps share (``scaled_dot_product_attention`` gives ``output`` and ``output_weights``).
The row log-sum-exp is a call of its own (``return_lse=True`` without the weights), so a module
whose lse is wrong, or that does not take ``return_lse``, fails that step alone; composite
steps (merging split keys, a paged cache) are ``composite``'s, a packed batch's
calls ``calls.varlen``'s (its offsets closed over, on the host), a rotary case's
``rotary_embedding`` and its VJP ordinary calls and ``rope_frequencies`` a host call (never
compiled: its arguments are Python numbers and a dict), a quantised case's ``quantize_kv``,
``dequantize_kv`` and ``QuantizedKVCache`` host calls (``quantized``: a scheme is a
``KVQuantization`` object) and the MLA case's absorbed forward a module call
(``module_steps.forward_absorbed``). To compare a new
step: give it an expected value in ``expected.pipeline`` and add a ``Step`` here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import spec
from ..cases import catalogue as cases_mod
from ..cases import mods, quantizer
from ..cases import quantized as quantized_cases
from ..cases import rotary as rotary_cases
from ..cases.dtypes import numpy_dtype
from ..cases.expected import GRAD_STEPS, Expected
from . import calls as calls_mod
from . import composite, module_steps
from .backends import Backend
from .calls import Call


class Execution:
    """One backend on one case in one dtype; each backend call made once, its result cached.

    On a backend that compiles (JAX), ``prefetch`` runs the calls of every applicable step in
    one compiled program (one compilation per case and dtype instead of one per call); if that
    fails, each step calls on its own and reports its own error.
    """

    def __init__(self, backend: Backend, exp: Expected) -> None:
        self.backend = backend
        self.exp = exp
        self.cache: dict[str, Any] = {}
        self._inputs: dict[str, np.ndarray] = {}

    @property
    def module(self) -> Any:
        """The backend's package."""
        return self.backend.module

    def to_backend(self, x: Any) -> Any:
        """NumPy array → backend array (in lists, tuples and dicts too); others unchanged."""
        return composite.to_backend(self.backend, x)

    def to_numpy(self, result: Any) -> Any:
        """Backend array (or a tuple of them, None entries kept) → NumPy."""
        return calls_mod.to_numpy(self.backend, result)

    def cached(self, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per execution."""
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]

    def result(self, call: Call) -> Any:
        """The NumPy result of ``call``, made once."""
        def compute() -> Any:
            fn = self.backend.function(call.fn, call.static())
            try:
                result = fn(*(self.to_backend(a) for a in call.args),
                            **{k: self.to_backend(v) for k, v in call.kwargs.items()})
            except Exception as exc:  # noqa: BLE001 - re-raised, naming the contract's way out
                hint = composite.keyword_hint(str(exc))
                if not hint:
                    raise
                raise TypeError(f"{exc}; {hint}") from exc
            return self.to_numpy(result)

        return self.cached(call.key, compute)

    def prefetch(self, calls: Iterable[Call]) -> None:
        """On a compiling backend, make every call not yet made in one compiled program."""
        calls_mod.prefetch(self.backend, self.cache, calls)

    def compute_input(self, step: str) -> np.ndarray:
        """The reference value of ``step`` in the compute dtype (the input of the next step)."""
        if step not in self._inputs:
            dtype = numpy_dtype(spec.COMPUTE_DTYPE[self.exp.dtype])
            self._inputs[step] = self.exp.values[step].astype(dtype)
        return self._inputs[step]

    def _options(self, names: Iterable[str]) -> dict[str, Any]:
        a, o = self.exp.data.arrays, self.exp.data.options
        return {n: a[n] if n in a else o[n] for n in names if n in a or n in o}

    def _qkv(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a = self.exp.data.arrays
        return a["query"], a["key"], a["value"]

    def scores_call(self) -> Call:
        """``attention_scores(query, key, scale, softcap)``."""
        q, k, _ = self._qkv()
        return Call("scores", "attention_scores", (q, k), self._options(("scale", "softcap")))

    def masked_call(self) -> Call:
        """``mask_scores`` of the reference scores."""
        names = ("mask", "bias", "is_causal", "causal_alignment", "window")
        return Call("masked_scores", "mask_scores", (self.compute_input("scores"),),
                    self._options(names))

    def weights_call(self) -> Call:
        """``attention_weights`` of the reference masked scores."""
        return Call("weights", "attention_weights", (self.compute_input("masked_scores"),))

    def _sdpa_kwargs(self) -> dict[str, Any]:
        return mods.sdpa_kwargs(self.exp.data.arrays, self.exp.data.options)

    @property
    def returns_weights(self) -> bool:
        """False for a checked module that declares ``return_weights`` unsupported."""
        contract = self.backend.contract
        return contract is None or "return_weights" not in contract.unsupported

    def sdpa_call(self) -> Call:
        """``scaled_dot_product_attention(..., return_weights=True)``: (output, weights); the
        output alone for a module without ``return_weights``."""
        flag = {"return_weights": True} if self.returns_weights else {}
        return Call("sdpa", "scaled_dot_product_attention", self._qkv(),
                    {**self._sdpa_kwargs(), **flag})

    def lse_call(self) -> Call:
        """``scaled_dot_product_attention(..., return_lse=True)``: (output, lse)."""
        return Call("sdpa_lse", "scaled_dot_product_attention", self._qkv(),
                    {**self._sdpa_kwargs(), "return_lse": True})

    def vjp_call(self) -> Call:
        """``scaled_dot_product_attention_vjp(...)`` against the case's grad_output."""
        return Call("vjp", "scaled_dot_product_attention_vjp",
                    (*self._qkv(), self.exp.data.arrays["grad_output"]), self._sdpa_kwargs())

    def _blockwise_kwargs(self) -> dict[str, Any]:
        a = self.exp.data.arrays
        kwargs = {k: v for k, v in self._sdpa_kwargs().items() if k != "mask"}
        kwargs.update({k: a[k] for k in ("kv_lengths",) if k in a})
        kwargs.update(cases_mod.BLOCKWISE_TILES)
        return kwargs

    def blockwise_call(self) -> Call:
        """``blockwise_attention(...)`` with small tiles."""
        return Call("blockwise", "blockwise_attention", self._qkv(), self._blockwise_kwargs())

    def blockwise_lse_call(self) -> Call:
        """``blockwise_attention(..., return_lse=True)`` with small tiles: (output, lse)."""
        return Call("blockwise_lse", "blockwise_attention", self._qkv(),
                    {**self._blockwise_kwargs(), "return_lse": True})

    def paged_call(self, return_lse: bool = False) -> Call:
        """``paged_attention(query, key_pages, value_pages, block_table, seq_lens, ...)``."""
        args, kwargs = composite.paged_arguments(self.exp, return_lse)
        return Call("paged_lse" if return_lse else "paged", "paged_attention", args, kwargs)

    def blockwise_vjp_call(self) -> Call:
        """``blockwise_attention_vjp(...)`` against the case's grad_output."""
        return Call("blockwise_vjp", "blockwise_attention_vjp",
                    (*self._qkv(), self.exp.data.arrays["grad_output"]), self._blockwise_kwargs())

    def build_module(self) -> Any:
        """The case's module in the backend, in eval mode, holding the case's weights."""
        return module_steps.build(self.backend, self.exp)

    def module_forward(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The module's ``forward``: (output, weights or None)."""
        return self.cached("module", lambda: module_steps.forward(self.backend, self.exp))

    def module_backward(self) -> np.ndarray:
        """The module's ``parameter_gradients``, flattened in sorted name order."""
        return self.cached("backward",
                           lambda: module_steps.parameter_gradients(self.backend, self.exp))

    def module_decode(self) -> np.ndarray:
        """Decode ``x`` chunk by chunk with the module's ``decode`` and a KV cache."""
        return self.cached("decode", lambda: module_steps.decode(self.backend, self.exp))

    def merged(self) -> tuple[np.ndarray, np.ndarray]:
        """A merge case: ``merge_attention`` of the parts' own attention (``composite``)."""
        return self.cached("merge", lambda: composite.merged(self.backend, self.exp))

    def varlen(self, what: str) -> Any:
        """A varlen case's ``calls.VARLEN_CALLS[what]``; on a compiling backend the three calls
        are first tried in one program."""
        if self.backend.compiles and "varlen:all" not in self.cache:
            self.cache["varlen:all"] = True
            try:
                with np.errstate(all="ignore"):
                    done = calls_mod.varlen(self.backend, self.exp, tuple(calls_mod.VARLEN_CALLS))
                self.cache.update({f"varlen:{w}": r for w, r in zip(calls_mod.VARLEN_CALLS,
                                                                     done, strict=True)})
            except Exception:  # noqa: BLE001 - each step then calls on its own and says why
                pass
        return self.cached(f"varlen:{what}",
                           lambda: calls_mod.varlen(self.backend, self.exp, (what,))[0])

    def rotary_call(self) -> Call:
        """``rotary_embedding(x, positions, theta, layout, rotary_dim, inv_freq,
        attention_factor)`` (``cases.rotary.rotary_kwargs``)."""
        a = self.exp.data.arrays
        return Call("rotary", "rotary_embedding", (a["x"], a["positions"]),
                    rotary_cases.rotary_kwargs(self.exp.data.options))

    def rotary_vjp_call(self) -> Call:
        """``rotary_embedding_vjp(x, positions, grad_output, ...)``."""
        a = self.exp.data.arrays
        return Call("rotary_vjp", "rotary_embedding_vjp",
                    (a["x"], a["positions"], a["grad_output"]),
                    rotary_cases.rotary_kwargs(self.exp.data.options))

    def frequencies(self) -> tuple[np.ndarray, np.ndarray]:
        """``rope_frequencies(rotary_dim, theta, scaling, seq_len, max_position_embeddings)``:
        ``(inv_freq, attention_factor)`` as NumPy; a host function, never compiled."""
        def compute() -> tuple[np.ndarray, np.ndarray]:
            o = self.exp.data.options
            result = self.module.rope_frequencies(rotary_cases.rotary_dim_of(self.exp.data),
                                                  **rotary_cases.frequencies_kwargs(o))
            if not isinstance(result, (tuple, list)) or len(result) != 2:
                raise ValueError("rope_frequencies(...) returned "
                                 f"{type(result).__name__}, not (inv_freq, attention_factor)")
            inv, factor = result
            return self.to_numpy(inv), np.asarray(float(factor))

        return self.cached("frequencies", compute)

    def module_absorbed(self) -> np.ndarray:
        """The MLA module's ``forward(..., absorbed=True)``."""
        return self.cached("absorbed",
                           lambda: module_steps.forward_absorbed(self.backend, self.exp))

    def scheme(self, prefix: str = "") -> Any:
        """The case's scheme as the module's ``KVQuantization`` (``attention_rules``' for a
        module without one); None for a cache case's values without a scheme of their own."""
        kwargs = quantized_cases.scheme_options(self.exp.data.options, prefix)
        if not kwargs:
            return None
        if self.backend.provides("KVQuantization"):
            return self.module.KVQuantization(**kwargs)
        from attention_rules.quantizing import KVQuantization

        return KVQuantization(**kwargs)

    def _quantize_run(self) -> Any:
        """``x -> (codes, scales, zero_points or None, dequantize_kv(q))`` of the case's scheme,
        one compiled program where the backend compiles."""
        o = self.exp.data.options
        kwargs = quantized_cases.scheme_options(o)

        def make() -> Callable[..., Any]:
            module, scheme = self.module, self.scheme()
            dequantizes = self.backend.provides("dequantize_kv")

            def run(x: Any) -> tuple[Any, ...]:
                q = module.quantize_kv(x, scheme)
                values = module.dequantize_kv(q) if dequantizes else None
                return q.codes, q.scales, getattr(q, "zero_points", None), values

            return run

        return self.backend.compiled(("quantize_kv", tuple(sorted(kwargs.items()))), make)

    def quantized(self) -> dict[str, np.ndarray]:
        """``quantize_kv(x, scheme)``: its codes (``cases.quantizer.code_values``: fp8 codes as
        ordinals), scales and zero points as NumPy float64, and ``dequantized``:
        ``dequantize_kv`` of it, NumPy in the dtype it returned."""
        def compute() -> dict[str, np.ndarray]:
            q_dtype = self.exp.data.options["q_dtype"]
            codes, scales, zero_points, values = self._quantize_run()(
                self.to_backend(self.exp.data.arrays["x"]))
            out = {"quantized_codes": quantizer.code_values(
                       _codes_numpy(self.backend, codes), q_dtype),
                   "quantized_scales": self._float64(scales)}
            if values is not None:
                out["dequantized"] = self.to_numpy(values)
            if zero_points is not None:
                out["quantized_zero_points"] = self._float64(zero_points)
            return out

        return self.cached("quantized", compute)

    def _float64(self, x: Any) -> np.ndarray:
        return np.asarray(self.to_numpy(x)).astype(np.float64)

    def quantized_cache(self) -> np.ndarray:
        """A ``QuantizedKVCache`` taking the case's appends; after each, ``attend`` of the
        query rows of the tokens appended; the outputs joined along the query axis (one
        compiled program where the backend compiles)."""
        def compute() -> np.ndarray:
            a, o = self.exp.data.arrays, self.exp.data.options
            key, value, query = a["key"], a["value"], a["query"]
            appends, dtype = tuple(o["appends"]), self.exp.dtype

            def make() -> Callable[..., Any]:
                module, scheme, value_scheme = self.module, self.scheme(), self.scheme("v_")

                def run(k: Any, v: Any, q: Any) -> tuple[Any, ...]:
                    cache = module.QuantizedKVCache.empty(
                        key.shape[:-3], key.shape[-3], key.shape[-2], key.shape[-1],
                        value.shape[-1], scheme=scheme, value_scheme=value_scheme, dtype=dtype)
                    outputs, start = [], 0
                    for n in appends:
                        part = slice(start, start + n)
                        cache = cache.append(k[..., part, :], v[..., part, :])
                        outputs.append(cache.attend(q[..., part, :]))
                        start += n
                    return tuple(outputs)

                return run

            run = self.backend.compiled(("QuantizedKVCache", self.exp.case, dtype), make)
            outputs = run(*(self.to_backend(x) for x in (key, value, query)))
            return np.concatenate([self.to_numpy(x) for x in outputs], axis=-2)

        return self.cached("quantized_cache", compute)

    def paged_cache(self) -> np.ndarray:
        """A paged case decoded from the module's own ``PagedKVCache`` (``composite``)."""
        return self.cached("paged_cache", lambda: composite.paged_cache(self.backend, self.exp))


@dataclass(frozen=True)
class Step:
    """One compared step: its name, the case kinds it applies to, how a backend computes it,
    the dtype the spec requires of the result (``"input"``, ``"compute"`` or None), and the
    backend calls it needs (run together on a compiling backend)."""

    name: str
    kinds: tuple[str, ...]
    run: Callable[[Execution], np.ndarray]
    result_dtype: str | None
    description: str
    calls: Callable[[Execution], tuple[Call, ...]] = lambda exe: ()
    #: The functions (``spec.FUNCTIONS``), modules or ``Module.method`` the step calls.
    needs: Callable[[Execution], tuple[str, ...]] = lambda exe: ()
    #: The index of the step's value in its call's result (None: the result itself).
    pick: int | None = None
    #: A ``spec.PLUGIN_FEATURES`` name the step needs beyond the case's own.
    feature: str | None = None
    #: Whether the step applies to a case that has its expected value.
    applies: Callable[[Expected], bool] = lambda exp: True


def _codes_numpy(backend: Backend, codes: Any) -> np.ndarray:
    """Codes as float64 NumPy values: fp8 tensors of torch (which NumPy cannot hold) widened
    to float32 first, exactly."""
    if "float8" in str(getattr(codes, "dtype", "")) and hasattr(codes, "float") and \
            not isinstance(codes, np.ndarray):
        codes = codes.float()
    return np.asarray(backend.to_numpy(codes)).astype(np.float64)


def _sdpa_calls(exe: Execution) -> tuple[Call, ...]:
    return (exe.sdpa_call(),) if exe.exp.kind == "sdpa" else ()


def _run_output(exe: Execution) -> np.ndarray:
    if exe.exp.kind == "module":
        return exe.module_forward()[0]
    result = exe.result(exe.sdpa_call())
    return result[0] if exe.returns_weights else result


def _zero_points(exe: Execution) -> np.ndarray:
    got = exe.quantized()
    if "quantized_zero_points" not in got:
        raise ValueError("quantize_kv(...) returned no zero_points (zero_point=True)")
    return got["quantized_zero_points"]


def _needs(*names: str) -> Callable[[Execution], tuple[str, ...]]:
    return lambda exe: names


def _needs_module(method: str = "") -> Callable[[Execution], tuple[str, ...]]:
    def needs(exe: Execution) -> tuple[str, ...]:
        if exe.exp.kind != "module":
            return ("scaled_dot_product_attention",)
        module = exe.exp.data.options["module"]
        return (module, f"{module}.{method}") if method else (module,)

    return needs


def _run_output_weights(exe: Execution) -> np.ndarray:
    if exe.exp.kind == "module":
        weights = exe.module_forward()[1]
        if weights is None:
            raise ValueError("forward(return_weights=True) returned no weights")
        return weights
    return exe.result(exe.sdpa_call())[1]


def _grad_step(index: int, blockwise: bool) -> Callable[[Execution], np.ndarray]:
    def run(exe: Execution) -> np.ndarray:
        call = exe.blockwise_vjp_call() if blockwise else exe.vjp_call()
        grads = exe.result(call)
        grad = grads[index] if isinstance(grads, tuple) and index < len(grads) else None
        if grad is None:
            raise ValueError(f"{call.fn} returned no {GRAD_STEPS[index]}"
                             + (" (with sinks, a fifth result)" if index == 4 else ""))
        return grad

    return run


def _lse_step(blockwise: bool) -> Callable[[Execution], np.ndarray]:
    def run(exe: Execution) -> np.ndarray:
        call = exe.blockwise_lse_call() if blockwise else exe.lse_call()
        return composite.pair(exe.result(call), f"{call.fn}(..., return_lse=True)")[1]

    return run


def _varlen_grad(index: int) -> Callable[[Execution], np.ndarray]:
    def run(exe: Execution) -> np.ndarray:
        grads = exe.varlen("vjp")
        if not isinstance(grads, tuple) or len(grads) <= index or grads[index] is None:
            names = GRAD_STEPS[:3] + GRAD_STEPS[4:]
            raise ValueError(f"varlen_attention_vjp returned no {names[index]}")
        return grads[index]

    return run


STEPS: dict[str, Step] = {
    s.name: s
    for s in (
        Step("scores", ("sdpa",), lambda exe: exe.result(exe.scores_call()), "compute",
             "attention_scores(query, key, scale, softcap)", lambda exe: (exe.scores_call(),),
             _needs("attention_scores")),
        Step("masked_scores", ("sdpa",), lambda exe: exe.result(exe.masked_call()), "compute",
             "mask_scores(reference scores, mask, bias, is_causal, causal_alignment, window)",
             lambda exe: (exe.masked_call(),), _needs("mask_scores"),
             applies=lambda exp: not mods.uses_mods(exp.data)),
        Step("weights", ("sdpa",), lambda exe: exe.result(exe.weights_call()), "compute",
             "attention_weights(reference masked scores)", lambda exe: (exe.weights_call(),),
             _needs("attention_weights")),
        Step("output", ("sdpa", "module"), _run_output, "input",
             "scaled_dot_product_attention(...) output, or the module's forward", _sdpa_calls,
             _needs_module(), pick=0),
        Step("output_weights", ("sdpa", "module"), _run_output_weights, "input",
             "the weights scaled_dot_product_attention(..., return_weights=True) returns",
             _sdpa_calls, _needs_module(), pick=1, feature="return_weights"),
        *(Step(name, ("sdpa",), _grad_step(i, blockwise=False), "input",
               f"scaled_dot_product_attention_vjp(..., grad_output) -> {name}",
               lambda exe: (exe.vjp_call(),), _needs("scaled_dot_product_attention_vjp"), i)
          for i, name in enumerate(GRAD_STEPS)),
        Step("lse", ("sdpa",), _lse_step(blockwise=False), "compute",
             "scaled_dot_product_attention(..., return_lse=True): the row log-sum-exp, natural "
             "log, -inf on a fully masked row (the sink's logit with sinks)",
             lambda exe: (exe.lse_call(),), _needs("scaled_dot_product_attention"), 1,
             feature="lse"),
        Step("blockwise_output", ("sdpa",), lambda exe: exe.result(exe.blockwise_call()),
             "input", "blockwise_attention(..., block_q=2, block_kv=3): online softmax in tiles",
             lambda exe: (exe.blockwise_call(),), _needs("blockwise_attention")),
        Step("blockwise_lse", ("sdpa",), _lse_step(blockwise=True), "compute",
             "blockwise_attention(..., return_lse=True) with small tiles: the row log-sum-exp",
             lambda exe: (exe.blockwise_lse_call(),), _needs("blockwise_attention"), 1,
             feature="lse"),
        *(Step(f"blockwise_{name}", ("sdpa",), _grad_step(i, blockwise=True), "input",
               f"blockwise_attention_vjp(..., grad_output) -> {name}, recomputed per tile",
               lambda exe: (exe.blockwise_vjp_call(),), _needs("blockwise_attention_vjp"), i)
          for i, name in enumerate(GRAD_STEPS)),
        Step("decode_output", ("module",), lambda exe: exe.module_decode(), "input",
             "module.decode(x chunk, cache) chunk by chunk: equals the causal forward",
             needs=_needs_module("decode")),
        Step("merge_output", ("merge",), lambda exe: exe.merged()[0], "input",
             "merge_attention of each part's scaled_dot_product_attention(..., return_lse=True)"
             ": equals the attention over every key", needs=_needs(
                 "scaled_dot_product_attention", "merge_attention"), pick=0),
        Step("merge_lse", ("merge",), lambda exe: exe.merged()[1], "compute",
             "the merged log-sum-exp: that of every key (the sinks' included)",
             needs=_needs("scaled_dot_product_attention", "merge_attention"), pick=1),
        Step("paged_output", ("paged",), lambda exe: exe.result(exe.paged_call()), "input",
             "paged_attention over shuffled pages: equals the contiguous attention, bottom-right "
             "causal per sequence", lambda exe: (exe.paged_call(),), _needs("paged_attention")),
        Step("paged_lse", ("paged",), lambda exe: composite.pair(exe.result(exe.paged_call(
            True)), "paged_attention(..., return_lse=True)")[1], "compute",
             "paged_attention(..., return_lse=True): the lse of the contiguous attention",
             lambda exe: (exe.paged_call(True),), _needs("paged_attention"), 1, feature="lse"),
        Step("paged_cache_output", ("paged",), lambda exe: exe.paged_cache(), "input",
             "PagedKVCache: append (pages reused after a free), then attend: equals the "
             "contiguous attention", needs=_needs("PagedKVCache")),
        Step("varlen_output", ("varlen",), lambda exe: exe.varlen("forward"), "input",
             "varlen_attention(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, ...): "
             "each sequence's bottom-right attention", needs=_needs("varlen_attention")),
        Step("varlen_lse", ("varlen",), lambda exe: composite.pair(exe.varlen(
            "lse"), "varlen_attention(..., return_lse=True)")[1], "compute",
             "varlen_attention(..., return_lse=True): the lse (heads, total_q)",
             needs=_needs("varlen_attention"), pick=1, feature="lse"),
        *(Step(f"varlen_{name}", ("varlen",), _varlen_grad(i), "input",
               f"varlen_attention_vjp(..., grad_output, ...) -> {name}",
               needs=_needs("varlen_attention_vjp"), pick=i)
          for i, name in enumerate(GRAD_STEPS[:3] + GRAD_STEPS[4:])),  # no grad_bias
        Step("rotary_output", ("rotary",), lambda exe: exe.result(exe.rotary_call()), "input",
             "rotary_embedding(x, positions, theta, layout, rotary_dim, inv_freq, "
             "attention_factor)", lambda exe: (exe.rotary_call(),), _needs("rotary_embedding")),
        Step("rotary_grad_x", ("rotary",), lambda exe: exe.result(exe.rotary_vjp_call()),
             "input", "rotary_embedding_vjp(x, positions, grad_output, ...): the transpose "
             "rotation", lambda exe: (exe.rotary_vjp_call(),), _needs("rotary_embedding_vjp")),
        Step("rope_inv_freq", ("rotary",), lambda exe: exe.frequencies()[0], None,
             "rope_frequencies(rotary_dim, theta, scaling, seq_len, max_position_embeddings)"
             "[0]: the inverse frequencies", needs=_needs("rope_frequencies"), pick=0),
        Step("rope_attention_factor", ("rotary",), lambda exe: exe.frequencies()[1], None,
             "rope_frequencies(...)[1]: the attention factor (YaRN's and LongRoPE's mscale)",
             needs=_needs("rope_frequencies"), pick=1),
        Step("quantized_codes", ("quantized",), lambda exe: exe.quantized()["quantized_codes"],
             None, "quantize_kv(x, scheme).codes, compared exactly (fp8 codes as signed "
             "positions on the fp8 grid, one step = 1)", needs=_needs("quantize_kv")),
        Step("quantized_scales", ("quantized",),
             lambda exe: exe.quantized()["quantized_scales"], None,
             "quantize_kv(x, scheme).scales: float32, per group / token, tensor / head",
             needs=_needs("quantize_kv")),
        Step("quantized_zero_points", ("quantized",), lambda exe: _zero_points(exe), None,
             "quantize_kv(x, scheme).zero_points: each group's minimum (zero_point=True)",
             needs=_needs("quantize_kv")),
        Step("dequantized", ("quantized",), lambda exe: exe.quantized()["dequantized"], "input",
             "dequantize_kv(quantize_kv(x, scheme)): code · scale (+ zero point) in x's dtype",
             needs=_needs("quantize_kv", "dequantize_kv")),
        Step("quantized_cache_output", ("quantized",), lambda exe: exe.quantized_cache(),
             "input", "QuantizedKVCache.empty(..., scheme, value_scheme).append(k, v) then "
             "attend(query rows of the new tokens), after each append: the dequantised store "
             "and the residual window", needs=_needs("QuantizedKVCache")),
        Step("latent_absorbed_output", ("module",), lambda exe: exe.module_absorbed(), "input",
             "MultiHeadLatentAttention.forward(x, absorbed=True): W_UK folded into the query, "
             "attention over the latent [c ; k_pe]: equals the naive forward",
             needs=_needs_module()),
        Step("grad_weights", ("module",), lambda exe: exe.module_backward(), None,
             "module.parameter_gradients(inputs, grad_output): every weight's gradient, "
             "flattened in sorted name order", needs=_needs_module("parameter_gradients")),
    )
}


def steps_for(exp: Expected, only: Iterable[str] | None = None) -> list[Step]:
    """The steps that apply to a case (those with an expected value), optionally restricted."""
    chosen = [s for s in STEPS.values()
              if exp.kind in s.kinds and s.name in exp.values and s.applies(exp)]
    if only is not None:
        keep = set(only)
        chosen = [s for s in chosen if s.name in keep]
    return chosen


__all__ = ["STEPS", "Call", "Execution", "Step", "steps_for"]
