"""One check per rule of the spec's ``ERRORS``: pure Python on shapes, dtype names and numbers.

Every message is ``"<function>: <rule>; got <name>=<value>, ..."`` with shapes printed as
plain tuples, so it reads the same whichever backend raised it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")
HALF_DTYPES = ("float16", "bfloat16")
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")

Shape = tuple[int, ...]
#: What the rules see of an array: its shape and its dtype name, e.g. ``((2, 4, 5, 8), "float32")``.
ArrayInfo = tuple[Shape, str]

# Python's own containers and numbers: refused where the spec asks for an array.
_PYTHON_TYPES = (list, tuple, int, float, complex, bool)


def compute_dtype(dtype: str) -> str:
    """The dtype scores and softmax are computed in: float32 for the half types."""
    return "float32" if dtype in HALF_DTYPES else dtype


def broadcast_shapes(*shapes: Shape) -> Shape | None:
    """NumPy broadcasting of shapes, or None when they do not broadcast."""
    ndim = max([len(s) for s in shapes] + [0])  # a list: torch.compile traces it
    result = []
    for axis in range(-ndim, 0):
        sizes = {s[axis] for s in shapes if len(s) >= -axis} - {1}
        if len(sizes) > 1:
            return None
        result.append(sizes.pop() if sizes else 1)
    return tuple(result)


def check_array(fn: str, name: str, x: object) -> None:
    """An array of some framework, not a Python list, tuple or scalar (TypeError otherwise).

    A Python list has no dtype of its own: NumPy and torch would read ``[[1.0]]`` as float64
    and JAX as float32, so the spec refuses it rather than guess.
    """
    kind = type(x).__name__
    if type(x) in _PYTHON_TYPES:
        raise TypeError(
            f"{fn}: {name} must be an array (numpy.ndarray, jax.Array or torch.Tensor), not a "
            f"Python {kind}; convert it with an explicit dtype; got type({name})={kind}"
        )


def check_flag(fn: str, name: str, value: object) -> bool:
    """A Python bool or a NumPy bool (TypeError otherwise); returns it as a Python bool."""
    if not (isinstance(value, bool) or type(value).__name__ in ("bool_", "bool")):
        raise TypeError(f"{fn}: {name} must be a bool (True or False); got {name}={value!r}")
    return bool(value)


def check_float_inputs(fn: str, **dtypes: str) -> str:
    """All named inputs share one supported floating dtype; returns it (TypeError otherwise)."""
    described = ", ".join(f"{name}.dtype={dtype}" for name, dtype in dtypes.items())
    for name, dtype in dtypes.items():
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{fn}: {name} must be float16, bfloat16, float32 or float64; got {described}"
            )
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"{fn}: inputs must share one dtype; got {described}")
    return next(iter(dtypes.values()))


def check_rank(fn: str, **shapes: Shape) -> None:
    """Every named array has rank >= 2 and all have the same rank (ValueError otherwise)."""
    described = ", ".join(f"{name}.shape={tuple(shape)}" for name, shape in shapes.items())
    for name, shape in shapes.items():
        if len(shape) < 2:
            raise ValueError(f"{fn}: {name} must have at least 2 axes (seq, dim); got {described}")
    if len({len(shape) for shape in shapes.values()}) > 1:
        raise ValueError(f"{fn}: inputs must have the same number of axes; got {described}")


def check_heads(fn: str, q_shape: Shape, kv_shape: Shape, q_name: str, kv_name: str) -> None:
    """Leading batch axes equal and query heads divisible by key/value heads."""
    described = f"{q_name}.shape={tuple(q_shape)}, {kv_name}.shape={tuple(kv_shape)}"
    if tuple(q_shape[:-3]) != tuple(kv_shape[:-3]):
        raise ValueError(
            f"{fn}: {q_name} and {kv_name} must have the same batch axes; got {described}"
        )
    if len(q_shape) >= 3:
        heads, kv_heads = q_shape[-3], kv_shape[-3]
        if kv_heads == 0 or heads % kv_heads != 0:
            raise ValueError(
                f"{fn}: the heads of {q_name} must be a multiple of the heads of {kv_name}; "
                f"got {described}"
            )


def check_query_key(fn: str, q_shape: Shape, k_shape: Shape) -> None:
    """Shapes of query and key: rank, batch axes, heads, head_dim."""
    check_rank(fn, query=q_shape, key=k_shape)
    if q_shape[-1] != k_shape[-1]:
        raise ValueError(
            f"{fn}: query and key must have the same head_dim; "
            f"got query.shape={tuple(q_shape)}, key.shape={tuple(k_shape)}"
        )
    check_heads(fn, q_shape, k_shape, "query", "key")


def check_key_value(fn: str, k_shape: Shape, v_shape: Shape) -> None:
    """Key and value share rank, batch axes, kv_heads and kv_len."""
    check_rank(fn, key=k_shape, value=v_shape)
    described = f"key.shape={tuple(k_shape)}, value.shape={tuple(v_shape)}"
    if k_shape[-2] != v_shape[-2]:
        raise ValueError(f"{fn}: key and value must have the same kv_len; got {described}")
    if tuple(k_shape[:-2]) != tuple(v_shape[:-2]):
        raise ValueError(
            f"{fn}: key and value must have the same batch axes and kv_heads; got {described}"
        )


def check_weights_value(fn: str, w_shape: Shape, v_shape: Shape) -> None:
    """Weights ``(..., heads, q_len, kv_len)`` against value ``(..., kv_heads, kv_len, v_dim)``."""
    check_rank(fn, weights=w_shape, value=v_shape)
    if w_shape[-1] != v_shape[-2]:
        raise ValueError(
            f"{fn}: weights and value must have the same kv_len; "
            f"got weights.shape={tuple(w_shape)}, value.shape={tuple(v_shape)}"
        )
    check_heads(fn, w_shape, v_shape, "weights", "value")


def scores_shape(q_shape: Shape, k_shape: Shape) -> Shape:
    """``(..., heads, q_len, kv_len)`` from query and key shapes."""
    return tuple(q_shape[:-1]) + (k_shape[-2],)


def merged_heads(shape: Shape, groups: int) -> Shape:
    """Undo the grouped-query split: ``(..., kv_heads, groups, T, S)`` → ``(..., heads, T, S)``
    (``groups`` 1: ``shape`` unchanged)."""
    if groups == 1:
        return tuple(shape)
    return tuple(shape[:-4]) + (shape[-4] * shape[-3],) + tuple(shape[-2:])


def check_score_array(fn: str, name: str, info: ArrayInfo) -> ArrayInfo:
    """Scores or weights: floating point, rank >= 2; returns ``info`` (``(shape, dtype)``)."""
    shape, dtype = info
    check_float_inputs(fn, **{name: dtype})
    check_rank(fn, **{name: shape})
    return shape, dtype


def check_masks_broadcast(fn: str, shapes: list[Shape]) -> None:
    """Masks combined by AND must broadcast together (ValueError otherwise)."""
    if broadcast_shapes(*shapes) is None:
        listed = ", ".join(str(tuple(shape)) for shape in shapes)
        raise ValueError(f"{fn}: masks must broadcast together; got shapes {listed}")


def check_grad_output(fn: str, shape: Shape, out_shape: Shape) -> None:
    """``grad_output`` has the output's shape ``(..., heads, q_len, v_dim)`` (ValueError)."""
    if tuple(shape) != tuple(out_shape):
        raise ValueError(
            f"{fn}: grad_output must have the output's shape {tuple(out_shape)}; "
            f"got grad_output.shape={tuple(shape)}"
        )


def check_broadcast(fn: str, name: str, shape: Shape, target: Shape, target_name: str) -> None:
    """``shape`` broadcasts to ``target`` without enlarging it (ValueError otherwise)."""
    if len(shape) > len(target) or broadcast_shapes(tuple(shape), tuple(target)) != tuple(target):
        raise ValueError(
            f"{fn}: {name} must be broadcastable to the {target_name} shape {tuple(target)}; "
            f"got {name}.shape={tuple(shape)}"
        )


def check_bool(fn: str, name: str, dtype: str) -> None:
    """A boolean array (TypeError otherwise)."""
    if dtype != "bool":
        meaning = "keep" if name == "dropout_mask" else "may attend"
        raise TypeError(
            f"{fn}: {name} must be boolean (True = {meaning}); got {name}.dtype={dtype}"
        )


def check_bias_dtype(fn: str, dtype: str) -> None:
    """A floating-point bias (TypeError otherwise)."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: bias must be floating point; got bias.dtype={dtype}")


def check_mask_bias(
    fn: str, mask: ArrayInfo | None, bias: ArrayInfo | None, target: Shape
) -> None:
    """A boolean ``mask`` and a floating ``bias``, each broadcastable to the scores ``target``."""
    if mask is not None:
        check_bool(fn, "mask", mask[1])
        check_broadcast(fn, "mask", mask[0], target, "scores")
    if bias is not None:
        check_bias_dtype(fn, bias[1])
        check_broadcast(fn, "bias", bias[0], target, "scores")


def check_sinks(fn: str, sinks: ArrayInfo | None, heads: int) -> None:
    """Attention sinks: one floating-point logit per query head, shape ``(heads,)`` (``(1,)``
    for inputs without a heads axis); TypeError for another dtype, ValueError for another
    shape."""
    if sinks is None:
        return
    shape, dtype = sinks
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{fn}: sinks must be floating point (one logit per query head); "
            f"got sinks.dtype={dtype}"
        )
    if tuple(shape) != (heads,):
        raise ValueError(
            f"{fn}: sinks must have shape (heads,) = ({heads},), one logit per query head; "
            f"got sinks.shape={tuple(shape)}"
        )


def heads_of(shape: Shape) -> int:
    """The query heads of ``(..., heads, seq, dim)``; 1 for 2-D ``(seq, dim)`` inputs."""
    return shape[-3] if len(shape) >= 3 else 1


def check_dropout_mask(fn: str, dropout_mask: ArrayInfo | None, target: Shape) -> None:
    """A boolean keep-mask broadcastable to the weights ``target`` (or None)."""
    if dropout_mask is not None:
        check_bool(fn, "dropout_mask", dropout_mask[1])
        check_broadcast(fn, "dropout_mask", dropout_mask[0], target, "weights")


def check_alignment(fn: str, causal_alignment: object) -> None:
    """``'top_left'`` or ``'bottom_right'`` (ValueError otherwise)."""
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(
            f"{fn}: causal_alignment must be 'top_left' or 'bottom_right'; "
            f"got causal_alignment={causal_alignment!r}"
        )


def causal_offset(causal_alignment: str, q_len: int, kv_len: int) -> int:
    """The offset of ``j <= i + offset``: 0 top-left, ``kv_len - q_len`` bottom-right."""
    return 0 if causal_alignment == "top_left" else kv_len - q_len


def is_int(x: object) -> bool:
    """A Python or NumPy integer (NumPy registers its integer types as ``numbers.Integral``);
    never a bool, a float or an array."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_window(fn: str, window: object) -> tuple[int | None, int | None]:
    """A pair ``(left, right)`` of non-negative ints or None (ValueError otherwise)."""
    ok = isinstance(window, Sequence) and not isinstance(window, str) and len(window) == 2
    if ok:
        ok = all(w is None or (is_int(w) and int(w) >= 0) for w in window)
    if not ok:
        raise ValueError(
            f"{fn}: window must be a pair (left, right) of non-negative ints or None; "
            f"got window={window!r}"
        )
    left, right = window  # type: ignore[misc]
    return (None if left is None else int(left), None if right is None else int(right))


def check_structure(
    fn: str, is_causal: object, causal_alignment: object, window: object
) -> tuple[bool, str, tuple[int | None, int | None] | None]:
    """The causal flag, the alignment and the window; returns them normalised."""
    is_causal = check_flag(fn, "is_causal", is_causal)
    check_alignment(fn, causal_alignment)
    window = None if window is None else check_window(fn, window)
    return is_causal, causal_alignment, window  # type: ignore[return-value]


def check_int(fn: str, name: str, value: object, minimum: int | None = 0) -> int:
    """A Python or NumPy integer, at least ``minimum`` (ValueError otherwise)."""
    if not is_int(value) or (minimum is not None and int(value) < minimum):  # type: ignore[arg-type]
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{fn}: {name} must be an int{bound}; got {name}={value!r}")
    return int(value)  # type: ignore[arg-type]


def check_dropout(fn: str, dropout_p: object, has_mask: bool) -> float:
    """``dropout_p`` in [0, 1); a keep-mask only with ``dropout_p > 0`` (ValueError otherwise)."""
    try:
        p = float(dropout_p)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        p = math.nan
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{fn}: dropout_p must be in [0, 1); got dropout_p={dropout_p!r}"
                         f"{traced_hint('dropout_p', dropout_p)}")
    if has_mask and p == 0.0:
        raise ValueError(
            f"{fn}: dropout_mask needs dropout_p > 0 (survivors are scaled by "
            f"1 / (1 - dropout_p)); got dropout_p={dropout_p!r}"
        )
    return p


def check_softcap(fn: str, softcap: object) -> float | None:
    """None or a positive finite number (ValueError otherwise)."""
    if softcap is None:
        return None
    try:
        c = float(softcap)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        c = math.nan
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"{fn}: softcap must be a positive finite number; got softcap={softcap!r}"
                         f"{traced_hint('softcap', softcap)}")
    return c


def traced_hint(name: str, value: object) -> str:
    """For a value traced under ``jax.jit`` (a tracer: no number until the program runs), the
    way out; "" for anything else. The value decides the computation, so it must be static."""
    if "Tracer" not in type(value).__name__:
        return ""
    return (f" (a traced value: {name} must be a Python number when the program is built; "
            f"mark it static, e.g. jax.jit(fn, static_argnames=({name!r},)))")


def default_scale(head_dim: int) -> float:
    """``head_dim ** -0.5``, and 1.0 for ``head_dim == 0`` (every score is then 0 anyway)."""
    return head_dim**-0.5 if head_dim > 0 else 1.0


def check_scale(fn: str, scale: object, head_dim: int) -> float:
    """A finite number, or ``default_scale(head_dim)`` for None (ValueError otherwise)."""
    if scale is None:
        return default_scale(head_dim)
    try:
        s = float(scale)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        s = math.nan
    if not math.isfinite(s):
        raise ValueError(f"{fn}: scale must be a finite number; got scale={scale!r}"
                         f"{traced_hint('scale', scale)}")
    return s


# ------------------------------------------------------------------------------------------
# Lengths, caches and modules
# ------------------------------------------------------------------------------------------


def _is_int_dtype(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


def check_kv_lengths(fn: str, kv_lengths: ArrayInfo | None, batch: Shape) -> None:
    """``blockwise_attention``'s ``kv_lengths``: ints shaped like the batch axes (ValueError)."""
    if kv_lengths is None:
        return
    shape, dtype = kv_lengths
    if tuple(shape) != tuple(batch) or not _is_int_dtype(dtype):
        raise ValueError(
            f"{fn}: kv_lengths must be ints shaped like the batch axes {tuple(batch)}; "
            f"got kv_lengths.shape={tuple(shape)}, kv_lengths.dtype={dtype}"
        )


def check_lengths_1d(fn: str, name: str, lengths: ArrayInfo) -> None:
    """The mask builders' per-sequence lengths: a 1-D array of ints (ValueError otherwise)."""
    shape, dtype = lengths
    if len(shape) != 1 or not _is_int_dtype(dtype):
        raise ValueError(
            f"{fn}: {name} must be a 1-D array of ints; "
            f"got {name}.shape={tuple(shape)}, {name}.dtype={dtype}"
        )


def _flat(values: object) -> list:
    if isinstance(values, list):
        return [v for item in values for v in _flat(item)]
    return [values]


def check_lengths(fn: str, name: str, lengths: object, max_len: int) -> None:
    """Every length (an int or a nested list of ints, from ``.tolist()``) lies in
    ``[0, max_len]`` (ValueError otherwise)."""
    flat = _flat(lengths)
    if flat and (min(flat) < 0 or max(flat) > max_len):
        raise ValueError(f"{fn}: {name} must lie in [0, {max_len}]; got {name}={lengths}")


def check_cache_append(
    fn: str, k_shape: Shape, v_shape: Shape, k_buffer: Shape, v_buffer: Shape
) -> None:
    """Key and value match the cache in every axis but the sequence axis."""
    check_key_value(fn, k_shape, v_shape)
    k_shape, v_shape, k_buffer, v_buffer = map(tuple, (k_shape, v_shape, k_buffer, v_buffer))
    same = len(k_shape) == len(k_buffer) and k_shape[:-2] == k_buffer[:-2]
    if not (same and k_shape[-1] == k_buffer[-1] and v_shape[-1] == v_buffer[-1]):
        raise ValueError(
            f"{fn}: key and value must match the cache's (..., kv_heads, *, head_dim | v_dim) = "
            f"{k_buffer[:-2] + (k_buffer[-1],)} | {v_buffer[-1]}; "
            f"got key.shape={k_shape}, value.shape={v_shape}"
        )


def check_cache_room(fn: str, start: int, stop: int, max_len: int) -> None:
    """``stop <= max_len`` (ValueError naming max_len otherwise)."""
    if stop > max_len:
        raise ValueError(
            f"{fn}: the cache is full; {stop - start} new positions after {start} exceed "
            f"max_len={max_len}"
        )


def check_module_heads(fn: str, d_model: int, num_heads: int, num_kv_heads: int) -> None:
    """``d_model`` a multiple of ``num_heads``, ``num_heads`` of ``num_kv_heads`` (ValueError)."""
    if num_heads <= 0 or d_model % num_heads != 0:
        raise ValueError(
            f"{fn}: d_model must be a multiple of num_heads; "
            f"got d_model={d_model}, num_heads={num_heads}"
        )
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{fn}: num_heads must be a multiple of num_kv_heads; "
            f"got num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )


def check_weight_shapes(fn: str, expected: dict[str, Shape], given: dict[str, Shape]) -> None:
    """A loaded weight dict has exactly the module's names and shapes (ValueError otherwise)."""
    missing = sorted(set(expected) - set(given))
    extra = sorted(set(given) - set(expected))
    if missing or extra:
        raise ValueError(f"{fn}: weight names differ; missing {missing}, unexpected {extra}")
    for name, shape in expected.items():
        got = tuple(given[name])
        if got != tuple(shape):
            raise ValueError(f"{fn}: {name} must have shape {tuple(shape)}; got {name}.shape={got}")


def check_backward_without_dropout(module: str, dropout_active: bool, dropout_p: float) -> None:
    """A module's ``parameter_gradients`` never applies dropout (ValueError while it is
    active)."""
    # The backward pass must see the forward pass's keep-mask, which a module does not keep.
    if dropout_active:
        raise ValueError(
            f"{module}.parameter_gradients: dropout is active; call eval() or use "
            f"dropout_p=0 (got dropout_p={dropout_p})"
        )
