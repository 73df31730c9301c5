"""Errors conform too: every bad input of ``spec.ERRORS``, fed to every backend.

Each ``ErrorCase`` names the rule of ``spec.ERRORS`` it exercises, the public function, its
arguments (NumPy arrays, converted per backend) and the argument names the message must mention.
A backend passes a case when it raises exactly the rule's exception type with a message that
starts with the function's name and names the argument(s). ``runner.run`` feeds every case to
every backend column; the results (``results.ErrorResult``) land in the same report as the cells.
To add a bad input, append an ``ErrorCase`` to ``ERROR_CASES``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import spec
from ..comparing.results import ErrorResult
from .backends import Backend

FN = "scaled_dot_product_attention"


def _n(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return np.zeros(shape, dtype=dtype)


def _qkv(q: tuple = (2, 4, 5, 8), k: tuple = (2, 4, 7, 8), v: tuple | None = None,
         dtype: Any = np.float32) -> tuple[np.ndarray, ...]:
    v = k if v is None else v
    return _n(*q, dtype=dtype), _n(*k, dtype=dtype), _n(*v, dtype=dtype)


@dataclass(frozen=True)
class ErrorCase:
    """One bad input: rule of ``spec.ERRORS``, the call, what the message must name."""

    name: str
    rule: str  # a key of spec.ERRORS
    args: Callable[[], tuple[tuple, dict]]
    names: tuple[str, ...]  # argument names the message must contain
    fn: str = FN

    @property
    def exception(self) -> str:
        """The exception type the spec requires."""
        return spec.ERRORS[self.rule]


def _varlen(vjp: bool = False, **replaced: Any) -> Callable[[], tuple[tuple, dict]]:
    """A ``varlen_attention`` call (``_vjp``: its VJP) of two sequences (3 and 2 queries over 4
    and 2 keys, 4 over 2 heads), ``replaced`` changed; the offsets and lengths as keywords (a
    call of the packed-batch functions is known by them: ``plugins.call_features``)."""
    def call() -> tuple[tuple, dict]:
        given = {"query": _n(5, 4, 8), "key": _n(6, 2, 8), "value": _n(6, 2, 8),
                 "cu_seq_q": np.array([0, 3, 5], np.int32),
                 "cu_seq_k": np.array([0, 4, 6], np.int32), "max_q": 3, "max_k": 4,
                 "enable_gqa": True, **replaced}
        args = tuple(given.pop(n) for n in ("query", "key", "value"))
        return (*args, _n(5, 4, 8)) if vjp else args, given

    return call


def _float_mask(batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
    """A mask_mod returning float32 in every framework (a module-level function: a worker
    process unpickles it)."""
    return (q_idx >= kv_idx) * np.float32(1.0)


def _misshaped_mask(batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
    """A mask_mod returning ``(q_len, kv_len, 1)``, which does not broadcast to the scores."""
    return (q_idx >= kv_idx)[..., None]


def _call(*args: Any, **kwargs: Any) -> Callable[[], tuple[tuple, dict]]:
    return lambda: (args, kwargs)


def _rule(prefix: str) -> str:
    for key in spec.ERRORS:
        if key.startswith(prefix):
            return key
    raise KeyError(prefix)


ERROR_CASES: tuple[ErrorCase, ...] = (
    ErrorCase("rank_below_2", _rule("rank below 2"),
              _call(_n(8), _n(7, 8), _n(7, 8)), ("query",)),
    ErrorCase("different_ranks", _rule("rank below 2"),
              _call(_n(4, 5, 8), _n(7, 8), _n(7, 8)), ("query", "key")),
    ErrorCase("kv_len_differs", _rule("key and value with different kv_len"),
              _call(*_qkv(k=(2, 4, 6, 8), v=(2, 4, 5, 8))), ("key", "value")),
    ErrorCase("head_dim_differs", _rule("query and key with different head_dim"),
              _call(*_qkv(k=(2, 4, 7, 6), v=(2, 4, 7, 8))), ("query", "key")),
    ErrorCase("batch_axes_differ", _rule("different leading batch axes"),
              _call(*_qkv(k=(3, 4, 7, 8))), ("query", "key")),
    ErrorCase("heads_not_divisible", _rule("heads not divisible"),
              _call(*_qkv(k=(2, 3, 7, 8))), ("query", "key")),
    ErrorCase("kv_heads_differ", _rule("heads not divisible"),
              _call(*_qkv(k=(2, 2, 7, 8), v=(2, 1, 7, 8))), ("key", "value")),
    ErrorCase("mask_not_broadcastable", _rule("mask or bias not broadcastable"),
              lambda: (_qkv(), {"mask": np.ones((3, 3), bool)}), ("mask",)),
    ErrorCase("bias_not_broadcastable", _rule("mask or bias not broadcastable"),
              lambda: (_qkv(), {"bias": _n(4, 5, 6)}), ("bias",)),
    ErrorCase("mask_not_bool", _rule("mask that is not boolean"),
              lambda: (_qkv(), {"mask": np.ones((5, 7), np.float32)}), ("mask",)),
    ErrorCase("bias_not_float", _rule("bias that is not floating point"),
              lambda: (_qkv(), {"bias": np.ones((5, 7), np.int32)}), ("bias",)),
    ErrorCase("integer_inputs", _rule("integer, complex"),
              _call(*_qkv(dtype=np.int32)), ("query",)),
    ErrorCase("mixed_dtypes", _rule("integer, complex"),
              lambda: ((_n(2, 4, 5, 8), _n(2, 4, 7, 8, dtype=np.float64), _n(2, 4, 7, 8)), {}),
              ("query", "key")),
    ErrorCase("window_negative", _rule("window not a pair"),
              lambda: (_qkv(), {"window": (-1, 2)}), ("window",)),
    ErrorCase("window_not_pair", _rule("window not a pair"),
              lambda: (_qkv(), {"window": 3}), ("window",)),
    ErrorCase("causal_alignment_unknown", _rule("causal_alignment not"),
              lambda: (_qkv(), {"is_causal": True, "causal_alignment": "bottom"}),
              ("causal_alignment",)),
    ErrorCase("dropout_p_one", _rule("dropout_p outside"),
              lambda: (_qkv(), {"dropout_p": 1.0}), ("dropout_p",)),
    ErrorCase("dropout_mask_without_p", _rule("dropout_p outside"),
              lambda: (_qkv(), {"dropout_mask": np.ones((5, 7), bool)}), ("dropout_mask",)),
    ErrorCase("dropout_mask_not_bool", _rule("dropout_mask not boolean"),
              lambda: (_qkv(), {"dropout_p": 0.5, "dropout_mask": np.ones((5, 7), np.float32)}),
              ("dropout_mask",)),
    ErrorCase("softcap_zero", _rule("softcap not"),
              lambda: (_qkv(), {"softcap": 0.0}), ("softcap",)),
    ErrorCase("scale_nan", _rule("scale not"),
              lambda: (_qkv(), {"scale": float("nan")}), ("scale",)),
    # the same rules, other ways to break them
    ErrorCase("mask_too_many_axes", _rule("mask or bias not broadcastable"),
              lambda: (_qkv(), {"mask": np.ones((1, 2, 4, 5, 7), bool)}), ("mask",)),
    ErrorCase("mask_int", _rule("mask that is not boolean"),
              lambda: (_qkv(), {"mask": np.ones((5, 7), np.int32)}), ("mask",)),
    ErrorCase("complex_value", _rule("integer, complex"),
              lambda: ((_n(2, 4, 5, 8), _n(2, 4, 7, 8), _n(2, 4, 7, 8, dtype=np.complex64)), {}),
              ("value",)),
    ErrorCase("window_triple", _rule("window not a pair"),
              lambda: (_qkv(), {"window": (1, 2, 3)}), ("window",)),
    ErrorCase("window_float", _rule("window not a pair"),
              lambda: (_qkv(), {"window": (1.5, 2)}), ("window",)),
    ErrorCase("dropout_p_negative", _rule("dropout_p outside"),
              lambda: (_qkv(), {"dropout_p": -0.1}), ("dropout_p",)),
    ErrorCase("dropout_mask_not_broadcastable", _rule("mask or bias not broadcastable"),
              lambda: (_qkv(), {"dropout_p": 0.5, "dropout_mask": np.ones((3, 7), bool)}),
              ("dropout_mask",)),
    ErrorCase("softcap_inf", _rule("softcap not"),
              lambda: (_qkv(), {"softcap": float("inf")}), ("softcap",)),
    # arrays, not Python values; bools, not truthy values
    ErrorCase("query_python_list", _rule("a Python list"),
              lambda: (([[0.0] * 8] * 5, _n(7, 8), _n(7, 8)), {}), ("query", "list")),
    ErrorCase("key_python_tuple", _rule("a Python list"),
              lambda: ((_n(5, 8), tuple([0.0] * 8 for _ in range(7)), _n(7, 8)), {}),
              ("key", "tuple")),
    ErrorCase("bias_python_float", _rule("a Python list"),
              lambda: (_qkv(), {"bias": 0.5}), ("bias", "float")),
    ErrorCase("mask_python_list", _rule("a Python list"),
              lambda: (_qkv(), {"mask": [[True] * 7] * 5}), ("mask", "list")),
    ErrorCase("is_causal_string", _rule("is_causal, return_weights"),
              lambda: (_qkv(), {"is_causal": "yes"}), ("is_causal",)),
    ErrorCase("return_weights_int", _rule("is_causal, return_weights"),
              lambda: (_qkv(), {"return_weights": 1}), ("return_weights",)),
    ErrorCase("return_lse_int", _rule("is_causal, return_weights"),
              lambda: (_qkv(), {"return_lse": 1}), ("return_lse",)),
    # attention sinks (skipped for a module that declares sinks unsupported)
    ErrorCase("sinks_wrong_shape", _rule("sinks not shaped"),
              lambda: (_qkv(), {"sinks": _n(3)}), ("sinks",)),
    ErrorCase("sinks_per_kv_head_2d", _rule("sinks not shaped"),
              lambda: ((_n(5, 8), _n(7, 8), _n(7, 8)), {"sinks": _n(4)}), ("sinks",)),
    ErrorCase("sinks_int", _rule("sinks not floating point"),
              lambda: (_qkv(), {"sinks": _n(4, dtype=np.int32)}), ("sinks",)),
    ErrorCase("sinks_python_list", _rule("a Python list"),
              lambda: (_qkv(), {"sinks": [0.0] * 4}), ("sinks", "list")),
    ErrorCase("blockwise_sinks_2d", _rule("sinks not shaped"),
              lambda: (_qkv(), {"sinks": _n(1, 4)}), ("sinks",), fn="blockwise_attention"),
    ErrorCase("vjp_sinks_int", _rule("sinks not floating point"),
              lambda: ((*_qkv(), _n(2, 4, 5, 8)), {"sinks": _n(4, dtype=np.int64)}), ("sinks",),
              fn="scaled_dot_product_attention_vjp"),
    # merging partial results (skipped for a module that declares merge unsupported)
    ErrorCase("merge_lengths_differ", _rule("merge_attention: outputs and lses"),
              _call([_n(2, 4, 5, 8)], [_n(2, 4, 5), _n(2, 4, 5)]), ("outputs", "lses"),
              fn="merge_attention"),
    ErrorCase("merge_no_part", _rule("merge_attention: outputs and lses"),
              _call([], []), ("outputs",), fn="merge_attention"),
    ErrorCase("merge_output_shapes_differ", _rule("merge_attention: outputs and lses"),
              _call([_n(2, 4, 5, 8), _n(2, 4, 4, 8)], [_n(2, 4, 5), _n(2, 4, 4)]),
              ("outputs[1]",), fn="merge_attention"),
    ErrorCase("merge_lse_shape", _rule("merge_attention: outputs and lses"),
              _call([_n(2, 4, 5, 8)], [_n(2, 4, 2)]), ("lses[0]",), fn="merge_attention"),
    ErrorCase("merge_stacked_outputs", _rule("merge_attention: outputs or lses not a list"),
              _call(_n(2, 2, 4, 5, 8), [_n(2, 4, 5), _n(2, 4, 5)]), ("outputs",),
              fn="merge_attention"),
    ErrorCase("merge_int_lse", _rule("merge_attention: outputs or lses not a list"),
              _call([_n(2, 4, 5, 8)], [_n(2, 4, 5, dtype=np.int32)]), ("lses[0]",),
              fn="merge_attention"),
    ErrorCase("merge_sinks_shape", _rule("sinks not shaped"),
              lambda: (([_n(2, 4, 5, 8)], [_n(2, 4, 5)]), {"sinks": _n(2)}), ("sinks",),
              fn="merge_attention"),
    ErrorCase("merge_vjp_grad_output_shape", _rule("grad_output not shaped"),
              _call([_n(2, 4, 5, 8)], [_n(2, 4, 5)], _n(2, 4, 5, 7)), ("grad_output",),
              fn="merge_attention_vjp"),
    # the other public functions
    ErrorCase("vjp_grad_output_shape", _rule("grad_output not shaped"),
              lambda: ((*_qkv(), _n(2, 4, 5, 7)), {}), ("grad_output",),
              fn="scaled_dot_product_attention_vjp"),
    ErrorCase("vjp_dropout_without_mask", _rule("dropout_p outside"),
              lambda: ((*_qkv(), _n(2, 4, 5, 8)), {"dropout_p": 0.5}), ("dropout_mask",),
              fn="scaled_dot_product_attention_vjp"),
    ErrorCase("blockwise_block_q_zero", _rule("blockwise_attention: block_q"),
              lambda: (_qkv(), {"block_q": 0}), ("block_q",), fn="blockwise_attention"),
    ErrorCase("blockwise_kv_lengths_range", _rule("blockwise_attention: block_q"),
              lambda: (_qkv(), {"kv_lengths": np.array([3, 9])}), ("kv_lengths",),
              fn="blockwise_attention"),
    ErrorCase("blockwise_is_causal_int", _rule("is_causal, return_weights"),
              lambda: (_qkv(), {"is_causal": 1}), ("is_causal",), fn="blockwise_attention"),
    ErrorCase("scores_head_dim", _rule("query and key with different head_dim"),
              _call(_n(2, 4, 5, 8), _n(2, 4, 7, 6)), ("query", "key"), fn="attention_scores"),
    ErrorCase("scores_python_list", _rule("a Python list"),
              _call([[1.0, 2.0]], _n(3, 2)), ("query", "list"), fn="attention_scores"),
    ErrorCase("output_kv_len", _rule("key and value with different kv_len"),
              _call(_n(2, 4, 5, 6), _n(2, 4, 7, 8)), ("weights", "value"),
              fn="attention_output"),
    ErrorCase("mask_scores_mask_shape", _rule("mask or bias not broadcastable"),
              lambda: ((_n(5, 6),), {"mask": np.ones((6, 5), bool)}), ("mask",),
              fn="mask_scores"),
    ErrorCase("mask_scores_is_causal_string", _rule("is_causal, return_weights"),
              lambda: ((_n(5, 6),), {"is_causal": "no"}), ("is_causal",), fn="mask_scores"),
    ErrorCase("weights_int", _rule("integer, complex"),
              _call(_n(5, 6, dtype=np.int64)), ("scores",), fn="attention_weights"),
    ErrorCase("weights_python_scalar", _rule("a Python list"),
              _call(1.0), ("scores", "float"), fn="attention_weights"),
    ErrorCase("dropout_p_range", _rule("dropout_p outside"),
              _call(_n(5, 6), 1.5), ("dropout_p",), fn="apply_dropout"),
    ErrorCase("renormalize_alignment", _rule("causal_alignment not"),
              lambda: ((_n(5, 6),), {"causal_alignment": "diagonal"}), ("causal_alignment",),
              fn="renormalized_causal_weights"),
    ErrorCase("causal_mask_negative", _rule("mask builders"),
              _call(-1, 3), ("q_len",), fn="causal_mask"),
    ErrorCase("causal_mask_float", _rule("mask builders"),
              _call(3, 2.5), ("kv_len",), fn="causal_mask"),
    ErrorCase("window_mask_bad", _rule("window not a pair"),
              _call(3, 3, (1,)), ("window",), fn="sliding_window_mask"),
    ErrorCase("padding_lengths_range", _rule("mask builders"),
              _call(np.array([2, 5]), 4), ("kv_lengths",), fn="padding_mask"),
    ErrorCase("padding_lengths_2d", _rule("mask builders"),
              _call(np.array([[2]]), 4), ("kv_lengths",), fn="padding_mask"),
    ErrorCase("padding_lengths_float", _rule("mask builders"),
              _call(np.array([1.0, 2.0]), 4), ("kv_lengths",), fn="padding_mask"),
    ErrorCase("padding_q_len_missing", _rule("mask builders"),
              lambda: ((np.array([2]), 4), {"q_lengths": np.array([1])}), ("q_len",),
              fn="padding_mask"),
    ErrorCase("combine_not_bool", _rule("mask that is not boolean"),
              _call(np.ones((2, 2), np.float32)), ("masks[0]",), fn="combine_masks"),
    ErrorCase("combine_shapes", _rule("masks given to combine_masks"),
              _call(np.ones((2, 3), bool), np.ones((3, 2), bool)), ("masks",),
              fn="combine_masks"),
    # chunks, ALiBi, segment ids and the mods (skipped for a module that declares them)
    ErrorCase("chunk_size_zero", _rule("chunk_size not a positive int"),
              lambda: (_qkv(), {"chunk_size": 0}), ("chunk_size",)),
    ErrorCase("alibi_slopes_shape", _rule("chunk_size not a positive int"),
              lambda: (_qkv(), {"alibi_slopes": _n(3)}), ("alibi_slopes",)),
    ErrorCase("segment_ids_one_array_cross", _rule("chunk_size not a positive int"),
              lambda: (_qkv(), {"segment_ids": np.zeros((2, 5), np.int64)}), ("segment_ids",)),
    ErrorCase("mask_mod_misshaped", _rule("chunk_size not a positive int"),
              lambda: (_qkv(), {"mask_mod": _misshaped_mask}), ("mask_mod",)),
    ErrorCase("alibi_slopes_int", _rule("alibi_slopes not floating point"),
              lambda: (_qkv(), {"alibi_slopes": _n(4, dtype=np.int32)}), ("alibi_slopes",)),
    ErrorCase("segment_ids_float", _rule("alibi_slopes not floating point"),
              lambda: (_qkv(q=(2, 4, 7, 8)), {"segment_ids": _n(2, 7)}), ("segment_ids",)),
    ErrorCase("score_mod_not_callable", _rule("alibi_slopes not floating point"),
              lambda: (_qkv(), {"score_mod": 2.0}), ("score_mod",)),
    ErrorCase("mask_mod_floats", _rule("alibi_slopes not floating point"),
              lambda: (_qkv(), {"mask_mod": _float_mask}), ("mask_mod",)),
    ErrorCase("blockwise_chunk_size_float", _rule("chunk_size not a positive int"),
              lambda: (_qkv(), {"chunk_size": 2.5}), ("chunk_size",), fn="blockwise_attention"),
    # packed batches (skipped for a module that declares varlen unsupported)
    ErrorCase("varlen_mixed_dtypes", _rule("query, key or value of a floating dtype"),
              _varlen(key=_n(6, 2, 8, dtype=np.float64)), ("key",), fn="varlen_attention"),
    ErrorCase("varlen_query_4d", _rule("query not (total_q, heads, head_dim)"),
              _varlen(query=_n(1, 5, 4, 8)), ("query",), fn="varlen_attention"),
    ErrorCase("varlen_gqa_not_enabled", _rule("heads != kv_heads without enable_gqa"),
              _varlen(enable_gqa=False), ("enable_gqa",), fn="varlen_attention"),
    ErrorCase("varlen_offsets_float", _rule("cu_seq_q or cu_seq_k not a 1-D integer"),
              _varlen(cu_seq_q=np.array([0.0, 3.0, 5.0], np.float32)), ("cu_seq_q",),
              fn="varlen_attention"),
    ErrorCase("varlen_offsets_start", _rule("offsets that do not start at 0"),
              _varlen(cu_seq_q=np.array([1, 3, 5], np.int32)), ("cu_seq_q",),
              fn="varlen_attention"),
    ErrorCase("varlen_vjp_offsets_end", _rule("offsets that do not start at 0"),
              _varlen(True, cu_seq_k=np.array([0, 2, 3], np.int32)), ("cu_seq_k",),
              fn="varlen_attention_vjp"),
    ErrorCase("varlen_max_q_short", _rule("max_q or max_k not an int"),
              _varlen(max_q=2), ("max_q",), fn="varlen_attention"),
    ErrorCase("varlen_seqused_k_range", _rule("seqused_k not (N,) ints"),
              _varlen(seqused_k=np.array([5, 2], np.int32)), ("seqused_k",),
              fn="varlen_attention"),
    ErrorCase("varlen_window_size", _rule("window_size not a pair"),
              _varlen(window_size=(-2, 0)), ("window_size",), fn="varlen_attention"),
    ErrorCase("varlen_return_lse_int", _rule("enable_gqa or return_lse not a bool"),
              _varlen(return_lse=1), ("return_lse",), fn="varlen_attention"),
    ErrorCase("varlen_sinks_shape", _rule("scale or softcap as in"),
              _varlen(sinks=_n(2)), ("sinks",), fn="varlen_attention"),
    ErrorCase("pack_lengths_range", _rule("pack_sequences: padded not"),
              lambda: ((_n(2, 4, 3, 8),), {"lengths": np.array([3, 4])}), ("lengths",),
              fn="pack_sequences"),
    ErrorCase("unpack_max_len_short", _rule("pack_sequences: padded not"),
              lambda: ((_n(5, 4, 8),), {"cu_seq": np.array([0, 3, 5], np.int32),
                                        "max_len": 2}), ("max_len",), fn="unpack_sequences"),
)


def check(backend: Backend, case: ErrorCase) -> ErrorResult:
    """Feed one bad input to one backend and judge what it raises."""
    args, kwargs = case.args()
    conv = [backend.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    kw = {k: backend.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    try:
        fn = getattr(backend.module, case.fn)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn(*conv, **kw)
    except Exception as exc:  # noqa: BLE001 - judging the exception is the point
        raised, message = type(exc).__name__, str(exc)
        problems = []
        if raised != case.exception:
            problems.append(f"raised {raised}, the spec requires {case.exception}")
        if not message.startswith(f"{case.fn}:"):
            problems.append(f"message does not start with '{case.fn}:'")
        missing = [n for n in case.names if n not in message]
        if missing:
            problems.append(f"message does not name {', '.join(missing)}")
        return ErrorResult(case.name, backend.name, case.exception, raised, message,
                           not problems, "; ".join(problems))
    return ErrorResult(case.name, backend.name, case.exception, "", "", False,
                       f"nothing raised; the spec requires {case.exception}")


def run(backend_list: list[Backend], cases: tuple[ErrorCase, ...] = ERROR_CASES
        ) -> list[ErrorResult]:
    """Every error case on every backend."""
    return [check(b, c) for c in cases for b in backend_list]


__all__ = ["ERROR_CASES", "ErrorCase", "ErrorResult", "check", "run"]
