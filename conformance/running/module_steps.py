"""How a backend runs a module case (``cases`` kind ``"module"``): build the spec module with
the case's weights, run its ``forward``, its ``parameter_gradients`` and its ``decode`` chunk by
chunk (``steps.Execution`` caches each). On a backend that compiles (JAX) ``forward`` and the
whole decoding loop are one compiled program each; ``parameter_gradients`` runs eagerly (it
returns NumPy arrays, which a compiled program cannot).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..cases import catalogue as cases_mod
from ..cases import latent as latent_cases
from ..cases.expected import Expected
from ..cases.module_pipelines import flatten_weight_grads
from .backends import Backend
from .composite import to_backend


def build(backend: Backend, exp: Expected) -> Any:
    """The case's module in the backend, in eval mode, holding the case's weights."""
    a, o = exp.data.arrays, exp.data.options
    seed = cases_mod.get(exp.case).seed if exp.case in cases_mod.CASE_NAMES else 0
    m = getattr(backend.module, o["module"])(**o["init"], rng=backend.rng(seed))
    m = m.eval()
    return m.load_weights({n[2:]: x for n, x in a.items() if n.startswith("w:")})


def _to_numpy(backend: Backend, result: Any) -> Any:
    if isinstance(result, tuple):
        return tuple(None if x is None else backend.to_numpy(x) for x in result)
    return backend.to_numpy(result)


def forward(backend: Backend, exp: Expected) -> tuple[np.ndarray, np.ndarray | None]:
    """The module's ``forward``: ``(output (..., q_len, d_out), weights (..., heads, q_len,
    kv_len) or None)``."""
    a, o = exp.data.arrays, exp.data.options
    inputs = [a[n] for n in ("x", "x_1", "x_2", "context") if n in a]
    mask = {"mask": a["mask"]} if "mask" in a else {}
    options = dict(o["forward"])

    def make() -> Callable[..., Any]:
        return lambda m, *xs, **arrays: m.forward(*xs, **arrays, **options)

    run = backend.compiled(("forward", o["module"], tuple(sorted(options.items()))), make)
    result = run(build(backend, exp), *(to_backend(backend, x) for x in inputs),
                 **{k: to_backend(backend, v) for k, v in mask.items()})
    if isinstance(result, tuple):
        out, weights = _to_numpy(backend, result)
        return out, weights
    return _to_numpy(backend, result), None


def forward_absorbed(backend: Backend, exp: Expected) -> np.ndarray:
    """``MultiHeadLatentAttention.forward(x, **forward options, absorbed=True)``: ``(...,
    seq, d_model)`` (the ``latent_absorbed_output`` step)."""
    a, o = exp.data.arrays, exp.data.options
    options = {**o["forward"], "absorbed": True}

    def make() -> Callable[..., Any]:
        return lambda m, x: m.forward(x, **options)

    run = backend.compiled(("forward", o["module"], tuple(sorted(options.items()))), make)
    return _to_numpy(backend, run(build(backend, exp), to_backend(backend, a["x"])))


def parameter_gradients(backend: Backend, exp: Expected) -> np.ndarray:
    """The module's ``parameter_gradients``: every weight's gradient, flattened in sorted name
    order (the ``grad_weights`` step)."""
    a, o = exp.data.arrays, exp.data.options
    m = build(backend, exp)
    inputs = [to_backend(backend, a[n]) for n in ("x", "x_1", "x_2") if n in a]
    grad_output = to_backend(backend, a["grad_output"])
    if o["module"] == "MultiHeadAttention":
        kwargs = {k: v for k, v in o["forward"].items() if k != "return_weights"}
        if "mask" in a:
            kwargs["mask"] = to_backend(backend, a["mask"])
        context = to_backend(backend, a["context"]) if "context" in a else None
        grads = m.parameter_gradients(inputs[0], grad_output, context, **kwargs)
    elif o["module"] == latent_cases.MODULE:  # its forward options are keywords (is_causal)
        grads = m.parameter_gradients(inputs[0], grad_output, **o["forward"])
    else:
        grads = m.parameter_gradients(*inputs, grad_output)
    return flatten_weight_grads(grads)


def decode(backend: Backend, exp: Expected) -> np.ndarray:
    """``x`` decoded chunk by chunk (``options["decode"]``: the chunk sizes) with the module's
    ``decode`` and a KV cache: the chunks' outputs joined, ``(..., seq, d_out)``."""
    x = exp.data.arrays["x"]
    sizes, max_len = tuple(exp.data.options["decode"]), x.shape[-2]
    starts = np.cumsum((0, *sizes))
    chunks = [np.ascontiguousarray(x[..., s:s + n, :]) for s, n in zip(starts, sizes,
                                                                        strict=False)]

    def make() -> Callable[..., Any]:
        def decode_all(m: Any, *xs: Any) -> tuple[Any, ...]:
            cache, outputs = None, []
            for chunk in xs:
                out, cache = m.decode(chunk, cache, max_len=max_len)
                outputs.append(out)
            return tuple(outputs)

        return decode_all

    run = backend.compiled(("decode", exp.data.options["module"], sizes, max_len), make)
    outputs = run(build(backend, exp), *(to_backend(backend, c) for c in chunks))
    return np.concatenate([backend.to_numpy(out) for out in outputs], axis=-2)


__all__ = ["build", "decode", "forward", "forward_absorbed", "parameter_gradients"]
