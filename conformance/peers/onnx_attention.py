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

from ..expected import Expected
from .inputs import four_d, need, sdpa_case

#: The opset of the ``Attention`` node: 24, the newest that onnxruntime 1.32 runs with its CPU
#: ``Attention`` kernel (an opset-25 node takes the function body there, in every dtype).
OPSET = 24
#: The opset of a node with a window: 25, the first with ``left_window_size``.
WINDOW_OPSET = 25
_TYPES = {"float64": "DOUBLE", "float32": "FLOAT", "float16": "FLOAT16", "bfloat16": "BFLOAT16"}


@functools.lru_cache(maxsize=64)
def _session(dtype: str, mask_kind: str | None, has_past: bool, attributes: tuple,
             opset: int = OPSET) -> Any:
    """An ``InferenceSession`` for one node; inputs are named ``Q, K, V[, attn_mask][, past_key,
    past_value]``; outputs ``Y`` and ``W`` (the softmax)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    elem = getattr(TensorProto, _TYPES[dtype])
    names = ["Q", "K", "V", "attn_mask" if mask_kind else ""]
    if has_past:
        names += ["past_key", "past_value"]
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
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

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
    try:
        session = _session(exp.dtype, mask_kind, past > 0, tuple(sorted(attributes.items())),
                           opset)
    except (ort_errors.NotImplemented, ort_errors.InvalidGraph, ort_errors.Fail) as exc:
        reason = str(exc).splitlines()[0].rsplit(" : ", 1)[-1].strip()
        raise RuntimeError(f"onnxruntime (CPU) cannot build an opset-{opset} Attention node in "
                           f"{exp.dtype}: {reason[-160:]}") from None
    try:
        out, weights = session.run(["Y", "W"],
                                   {n: np.ascontiguousarray(v) for n, v in feeds.items()})
    except ort_errors.Fail as exc:  # keep the kernel's reason, drop its C++ signature
        text = str(exc)
        reason = text.rsplit(" was false.", 1)[-1].strip() if " was false." in text else text
        raise RuntimeError(f"onnxruntime Attention: {reason[-240:]}") from None
    return {"output": out.reshape(x.output_shape),
            "output_weights": weights.reshape(exp.values["output_weights"].shape)}


__all__ = ["OPSET", "WINDOW_OPSET", "onnxruntime_attention"]
