"""ONNX Runtime running one ONNX ``Attention`` node, as a peer (column ``onnxruntime``).

The model is one node, built with ``onnx.helper`` for each case's dtype and options and run by
onnxruntime's CPU execution provider, at opset ``OPSET`` (24: the newest opset onnxruntime 1.32
runs with its CPU ``Attention`` kernel, for float32 and float16) or, for a case with a window,
``WINDOW_OPSET`` (25: the first opset with ``left_window_size`` / ``right_window_size``, which
onnxruntime 1.32 runs as the ONNX function body, op by op, since no kernel is registered for it).
float64 and bfloat16 have no CPU ``Attention`` kernel at any opset: float64 runs the function
body, whose scale is computed in float32; in bfloat16 the function body needs an ``Expand`` that
has no bfloat16 CPU kernel either, so the session cannot be built: the cell raises (an error,
not n/a: ONNX defines the node).

The adapter: layout ``(batch, heads, seq, head_dim)``, 4-D (2-D and 3-D cases get leading axes
of 1), grouped-query heads as given; ``attn_mask`` is the boolean mask (True = may attend), or,
with a bias, the float mask ``bias`` (``-inf`` where the boolean mask is False), as
``Attention`` takes one mask input; ``scale``, ``softcap``, ``is_causal`` and the window as
attributes. ``is_causal`` and the window are aligned to the end of a KV cache, so a bottom-right
case passes its first ``kv_len - q_len`` keys and values as ``past_key`` / ``past_value`` (the
decoding form); bottom-right with ``q_len > kv_len`` is n/a. The node's fourth output in mode 3
(the softmax) is compared as ``output_weights``. A dropout keep-mask is n/a.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..cases import varlen_padding
from ..cases.expected import Expected
from .inputs import four_d, need, padding_lengths, padding_reason, sdpa_case

#: The opset of the ``Attention`` node: 24, the newest that onnxruntime 1.32 runs with its CPU
#: ``Attention`` kernel (an opset-25 node takes the function body there, in every dtype).
OPSET = 24
#: The opset of a node with a window: 25, the first with ``left_window_size``.
WINDOW_OPSET = 25
_TYPES = {"float64": "DOUBLE", "float32": "FLOAT", "float16": "FLOAT16", "bfloat16": "BFLOAT16"}


@functools.lru_cache(maxsize=64)
def _session(dtype: str, mask_kind: str | None, has_past: bool, attributes: tuple,
             opset: int = OPSET, nonpad: bool = False) -> Any:
    """An ``InferenceSession`` for one node; inputs are named ``Q, K, V[, attn_mask][, past_key,
    past_value][, nonpad_kv_seqlen]``; outputs ``Y`` and ``W`` (the softmax)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    elem = getattr(TensorProto, _TYPES[dtype])
    names = ["Q", "K", "V", "attn_mask" if mask_kind else ""]
    names += ["past_key", "past_value"] if has_past else ["", ""]
    names.append("nonpad_kv_seqlen" if nonpad else "")
    while names[-1] == "":
        names.pop()
    # with past_key, the CPU kernel also needs the present_key/present_value outputs
    present = ["present_key", "present_value"] if has_past else ["", ""]
    node = helper.make_node("Attention", names, ["Y", *present, "W"], **dict(attributes))
    inputs = [helper.make_tensor_value_info(n, elem, None) for n in ("Q", "K", "V")]
    if mask_kind:
        kind = TensorProto.BOOL if mask_kind == "bool" else elem
        inputs.append(helper.make_tensor_value_info("attn_mask", kind, None))
    if has_past:
        inputs += [helper.make_tensor_value_info(n, elem, None) for n in ("past_key", "past_value")]
    if nonpad:
        inputs.append(helper.make_tensor_value_info("nonpad_kv_seqlen", TensorProto.INT64, None))
    outputs = [helper.make_tensor_value_info(n, elem, None) for n in ("Y", "W")]
    graph = helper.make_graph([node], "attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    options = ort.SessionOptions()
    options.log_severity_level = 4  # its failures are raised, not logged
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def onnxruntime_attention(exp: Expected) -> dict[str, np.ndarray]:
    """The ``onnxruntime`` peer: output and softmax of an ONNX ``Attention`` node."""
    peer = "ONNX Attention (onnxruntime CPU)"
    a, o = sdpa_case(exp, peer, softcap=True)
    x = four_d(exp, peer)
    q_len, kv_len = x.query.shape[2], x.key.shape[2]
    attributes: dict[str, Any] = {"qk_matmul_output_mode": 3}
    if o.get("is_causal"):
        attributes["is_causal"] = 1
    if o.get("scale") is not None:
        attributes["scale"] = float(o["scale"])
    if o.get("softcap") is not None:
        attributes["softcap"] = float(o["softcap"])
    opset = OPSET
    if o.get("window") is not None:
        left, right = o["window"]
        attributes["left_window_size"] = -1 if left is None else int(left)
        attributes["right_window_size"] = -1 if right is None else int(right)
        opset = WINDOW_OPSET
    feeds = {"Q": x.query, "K": x.key, "V": x.value}
    past = 0
    if o.get("causal_alignment") == "bottom_right" and (
            o.get("is_causal") or o.get("window") is not None):
        need(kv_len >= q_len, f"{peer} aligns bottom-right only behind a KV cache "
                              "(past_key), which needs kv_len >= q_len")
        past = kv_len - q_len
        feeds = {"Q": x.query, "K": x.key[:, :, past:], "V": x.value[:, :, past:],
                 "past_key": x.key[:, :, :past], "past_value": x.value[:, :, :past]}
    mask_kind = None
    if x.bias is not None:
        bias = x.bias.astype(np.float64)
        if x.mask is not None:
            bias = np.where(x.mask, bias, -np.inf)
        feeds["attn_mask"], mask_kind = bias.astype(x.query.dtype), "float"
    elif x.mask is not None:
        feeds["attn_mask"], mask_kind = np.ascontiguousarray(x.mask), "bool"
    out, weights = _run(exp.dtype, feeds, attributes, opset, mask_kind, past > 0)
    return {"output": out.reshape(x.output_shape),
            "output_weights": weights.reshape(exp.values["output_weights"].shape)}


def onnxruntime_nonpad(exp: Expected) -> dict[str, np.ndarray]:
    """The ``onnxruntime[nonpad]`` peer: a key-padding case with its key lengths as
    ``nonpad_kv_seqlen`` (output and softmax), or a packed batch, padded
    (``varlen_output (total_q, heads, v_dim)``)."""
    peer = "ONNX Attention with nonpad_kv_seqlen (onnxruntime CPU)"
    if exp.kind == "varlen":
        return _nonpad_varlen(exp, peer)
    a, o = sdpa_case(exp, peer, softcap=True)
    x = four_d(exp, peer)
    q_len, kv_len = x.query.shape[2], x.key.shape[2]
    need(not o.get("is_causal") and o.get("window") is None,
         f"{peer} aligns the causal rule and the window to each sequence's last valid key, "
         "which no sdpa case does (the onnxruntime column takes them)")
    found = padding_lengths(x.mask, q_len, kv_len)
    need(found is not None and (found[0] is None or bool((found[0] == q_len).all())),
         padding_reason(peer, x.mask, "key-padding masks (a prefix of the keys, the same for "
                                      "every query)"))
    attributes = _attributes(o)
    feeds = {"Q": x.query, "K": x.key, "V": x.value,
             "nonpad_kv_seqlen": found[1].astype(np.int64)}
    mask_kind = None
    if x.bias is not None:
        feeds["attn_mask"], mask_kind = x.bias, "float"
    out, weights = _run(exp.dtype, feeds, attributes, OPSET, mask_kind)
    return {"output": out.reshape(x.output_shape),
            "output_weights": weights.reshape(exp.values["output_weights"].shape)}


def _attributes(o: dict[str, Any]) -> dict[str, Any]:
    """The node's ``scale`` and ``softcap`` attributes (and the softmax as fourth output)."""
    attributes: dict[str, Any] = {"qk_matmul_output_mode": 3}
    for name in ("scale", "softcap"):
        if o.get(name) is not None:
            attributes[name] = float(o[name])
    return attributes


def _nonpad_varlen(exp: Expected, peer: str) -> dict[str, np.ndarray]:
    """A packed batch as a padded one: queries right-aligned (the causal rule and the window
    of ``nonpad_kv_seqlen`` are aligned to each sequence's last valid key, so a sequence's
    last query meets its last key: bottom-right, as ``spec.VARLEN``), keys left-aligned,
    ``nonpad_kv_seqlen`` the keys in use; ``window_size (-1, 0)`` is ``is_causal``, any other
    window the opset-25 attributes."""
    a, o = exp.data.arrays, exp.data.options
    need(a.get("sinks") is None, f"{peer} has no attention sinks")
    need(a.get("block_table") is None, f"the {peer} adapter does not gather paged keys")
    p = varlen_padding.unpack(a, right_align_queries=True)
    attributes, opset = _attributes(o), OPSET
    left, right = (int(w) for w in o.get("window_size", (-1, -1)))
    if (left, right) == (-1, 0):
        attributes["is_causal"] = 1
    elif (left, right) != (-1, -1):
        attributes.update(left_window_size=left, right_window_size=right)
        opset = WINDOW_OPSET
    feeds = {"Q": p.query, "K": p.key, "V": p.value,
             "nonpad_kv_seqlen": p.kv_lengths.astype(np.int64)}
    (out,) = _run(exp.dtype, feeds, attributes, opset, None, outputs=("Y",))
    return {"varlen_output": varlen_padding.repack(out, p)}


def _run(dtype: str, feeds: dict[str, np.ndarray], attributes: dict[str, Any], opset: int,
         mask_kind: str | None, has_past: bool = False, outputs: tuple[str, ...] = ("Y", "W")
         ) -> list[np.ndarray]:
    """Build (cached) and run one ``Attention`` node on ``feeds``; a session that cannot be
    built or a kernel that refuses its inputs raises ``RuntimeError`` with onnxruntime's
    reason (no C++ signature)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

    try:
        session = _session(dtype, mask_kind, has_past, tuple(sorted(attributes.items())),
                           opset, "nonpad_kv_seqlen" in feeds)
    except (ort_errors.NotImplemented, ort_errors.InvalidGraph, ort_errors.Fail) as exc:
        reason = str(exc).splitlines()[0].rsplit(" : ", 1)[-1].strip()
        raise RuntimeError(f"onnxruntime (CPU) cannot build an opset-{opset} Attention node in "
                           f"{dtype}: {reason[-160:]}") from None
    try:
        return session.run(list(outputs), {n: np.ascontiguousarray(v) for n, v in feeds.items()})
    except ort_errors.Fail as exc:  # keep the kernel's reason, drop its C++ signature
        text = str(exc)
        reason = text.rsplit(" was false.", 1)[-1].strip() if " was false." in text else text
        raise RuntimeError(f"onnxruntime Attention: {reason[-240:]}") from None


__all__ = ["OPSET", "WINDOW_OPSET", "onnxruntime_attention", "onnxruntime_nonpad"]
