"""The rules of ``merge_attention`` and ``merge_attention_vjp``: partial results to merge.

A partial result is the attention of the same queries over one set of keys: an output
``(..., heads, q_len, v_dim)`` and its row log-sum-exp ``(..., heads, q_len)``. The backends
check the container first (``check_parts``: a list or tuple, not empty), describe each element
as ``(shape, dtype name)`` under the name ``outputs[i]`` / ``lses[i]``, and hand them to
``merge_arguments``, which raises the spec's exception for the first rule broken, in a fixed
order, or returns the normalised facts (``MergeArguments``).
"""

from __future__ import annotations

from typing import NamedTuple

from .checks import (
    ArrayInfo,
    Shape,
    check_float_inputs,
    check_grad_output,
    check_rank,
    check_sinks,
    compute_dtype,
    heads_of,
)


class MergeArguments(NamedTuple):
    """The validated facts of one merge."""

    parts: int  # how many partial results
    dtype: str  # the outputs' dtype: the merged output's
    compute: str  # the dtype the merge runs in and the merged lse has
    output_shape: Shape  # (..., heads, q_len, v_dim)
    has_sinks: bool


def check_parts(fn: str, name: str, parts: object) -> int:
    """``parts`` is a list or tuple of at least one array (TypeError / ValueError); its length."""
    if not isinstance(parts, (list, tuple)):
        shape = getattr(parts, "shape", None)  # a stacked array: its shape, the same everywhere
        got = f"{name}.shape={tuple(shape)}" if shape is not None else \
            f"type({name})={type(parts).__name__}"
        raise TypeError(
            f"{fn}: {name} must be a list or tuple of arrays, one per partial result; got {got}"
        )
    if not parts:
        raise ValueError(f"{fn}: {name} must hold at least one partial result; got len({name})=0")
    return len(parts)


def merge_arguments(
    fn: str,
    outputs: list[ArrayInfo],
    lses: list[ArrayInfo],
    *,
    sinks: ArrayInfo | None = None,
    grad_output: ArrayInfo | None = None,
    grad_lse: ArrayInfo | None = None,
) -> MergeArguments:
    """Every rule of a merge, in order; the normalised facts.

    Args:
      fn: the public function's name, which starts every message.
      outputs: ``(shape, dtype name)`` of each partial output ``(..., heads, q_len, v_dim)``.
      lses: ``(shape, dtype name)`` of each partial log-sum-exp ``(..., heads, q_len)``.
      sinks: ``(shape, dtype name)`` of ``(heads,)`` sink logits, or None.
      grad_output, grad_lse: the VJP's cotangents ``(..., heads, q_len, v_dim)`` and
        ``(..., heads, q_len)``, or None.

    Returns:
      ``MergeArguments``; raises TypeError (dtypes, as everywhere in the spec) or ValueError
      (lengths and shapes).
    """
    if len(outputs) != len(lses):
        raise ValueError(
            f"{fn}: outputs and lses must have the same length (one lse per output); "
            f"got len(outputs)={len(outputs)}, len(lses)={len(lses)}"
        )
    out_dtypes = {f"outputs[{i}]": dtype for i, (_, dtype) in enumerate(outputs)}
    if grad_output is not None:
        out_dtypes["grad_output"] = grad_output[1]
    dtype = check_float_inputs(fn, **out_dtypes)
    lse_dtypes = {f"lses[{i}]": dtype for i, (_, dtype) in enumerate(lses)}
    if grad_lse is not None:
        lse_dtypes["grad_lse"] = grad_lse[1]
    check_float_inputs(fn, **lse_dtypes)
    check_rank(fn, **{f"outputs[{i}]": tuple(shape) for i, (shape, _) in enumerate(outputs)})
    output_shape = tuple(outputs[0][0])
    for i, (shape, _) in enumerate(outputs[1:], start=1):
        if tuple(shape) != output_shape:
            raise ValueError(
                f"{fn}: outputs must share one shape (..., heads, q_len, v_dim); "
                f"got outputs[0].shape={output_shape}, outputs[{i}].shape={tuple(shape)}"
            )
    lse_shape = output_shape[:-1]
    for i, (shape, _) in enumerate(lses):
        if tuple(shape) != lse_shape:
            raise ValueError(
                f"{fn}: lses[{i}] must have the outputs' shape without v_dim, "
                f"(..., heads, q_len) = {lse_shape}; got lses[{i}].shape={tuple(shape)}"
            )
    check_sinks(fn, sinks, heads_of(output_shape))
    if grad_output is not None:
        check_grad_output(fn, grad_output[0], output_shape)
    if grad_lse is not None and tuple(grad_lse[0]) != lse_shape:
        raise ValueError(
            f"{fn}: grad_lse must have the lse's shape {lse_shape}; "
            f"got grad_lse.shape={tuple(grad_lse[0])}"
        )
    return MergeArguments(len(outputs), dtype, compute_dtype(dtype), output_shape,
                          sinks is not None)
