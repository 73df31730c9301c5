"""The frameworks' own attention kernels, as extra report columns ("peers"): the registry.

Each peer is a thin adapter from a case's inputs to one framework function, changing only what
the framework's conventions require; each framework API has a file of its own here, with its
adapters and what they cannot express:

==========================  =====================================================================
``torch_nn``                ``torch.sdpa`` (``torch.nn.functional.scaled_dot_product_attention``),
                            ``torch.MHA`` and ``torch.MHA[sdpa]``
                            (``torch.nn.MultiheadAttention`` with ``need_weights=True``, its
                            default, and ``need_weights=False``, which runs SDPA)
``torch_flex``              ``torch.flex`` (``torch.nn.attention.flex_attention``, eager, with
                            the row log-sum-exp)
``jax_nn``                  ``jax.nn`` (``jax.nn.dot_product_attention``, with the row
                            log-sum-exp of ``return_residual=True``) and ``jax.nn[lengths]``
                            (padding as ``query_seq_lengths`` / ``key_value_seq_lengths``; packed
                            batches, padded)
``keras_ops``               ``keras[numpy]``, ``keras[jax]``, ``keras[torch]``
                            (``keras.ops.dot_product_attention``), one worker process per Keras
                            backend (``running.keras_worker``)
``flax_nnx``                ``flax.nnx`` (``flax.nnx.dot_product_attention``)
``transformers_attention``  ``transformers.eager`` and ``transformers.sdpa``
``transformers_gpt_oss``    ``transformers.gpt_oss`` (GPT-OSS's ``eager_attention_forward``: the
                            attention sinks' reference semantics; the cases with sinks)
``transformers_rotary``     ``transformers.rope[llama]``, ``transformers.rope[deepseek_v3]``,
                            ``transformers.rope[gpt_neox]`` (each family's rotary module, its
                            ``ROPE_INIT_FUNCTIONS`` frequencies and ``apply_rotary_pos_emb``;
                            the rotary cases; JAX has no rotary embedding in ``jax.nn``)
``onnx_attention``          ``onnxruntime`` (one ONNX ``Attention`` node: opset 24, the CPU
                            kernel; opset 25 for a window, the function body) and
                            ``onnxruntime[nonpad]`` (key padding as ``nonpad_kv_seqlen``;
                            packed batches, padded)
``inputs``                  a case's inputs in the peers' conventions (4-D, BTNH, joined masks,
                            n/a), shared by every adapter
==========================  =====================================================================

A peer whose packages are not installed is reported as missing, with its install command, never
as an error.

A peer is only an adapter: ``compute(exp)`` returns the steps it can give (``output``, sometimes
``output_weights`` or the row log-sum-exp ``lse``) as NumPy arrays, and ``runner.run_peer_cell``
compares them like a backend's. Where a peer's cells are computed is ``running``'s to decide:
the command line's run (``running.room.Ahead``) computes the peers marked ``background`` (the
torch, transformers and onnxruntime columns) in one background worker process and queues the
keras requests (``submit``) up front, while the harness runs the other columns.
Each adapter calls its framework the way its users do; where users call it two common ways
that take different code paths, each way is a column (``torch.MHA`` and ``torch.MHA[sdpa]``,
``transformers.eager`` and ``transformers.sdpa``), or the adapter's docstring says which one it
takes and why. A peer that cannot express a case raises ``NotApplicable`` (shown as "n/a"); a
framework that defines the case but fails on it raises, and the cell says so. Where a peer
differs from the spec, ``spec.KNOWN_DIFFERENCES`` says how and why, and names the alternative
semantics that explain it; the harness computes that alternative (``diagnosing.alternatives``)
and the report shows "known: … (r)" only when the peer matches it (r: its worst ratio to the
alternative), "unexp." otherwise. Peers never decide the exit code. To add a peer (a new
column): write its ``compute`` function in a file of its own here, and add one ``Peer`` line to
``PEERS``.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..cases.expected import Expected
from ..usage import INSTALL, UsageError
from . import (
    flax_nnx,
    jax_nn,
    keras_ops,
    onnx_attention,
    torch_flex,
    torch_nn,
    transformers_attention,
    transformers_gpt_oss,
    transformers_rotary,
)


@dataclass(frozen=True)
class Peer:
    """A framework kernel as a report column."""

    name: str
    framework: str  # the package it needs
    install: str
    compute: Callable[[Expected], dict[str, np.ndarray]]
    requires: tuple[str, ...] = ()  # further packages it needs
    #: Starts ``compute(exp)`` elsewhere and returns a function that waits for its result
    #: (the keras workers); a run that computes ahead (``running.room.Ahead``) submits every
    #: case.
    submit: Callable[[Expected], Callable[[], dict[str, np.ndarray]]] | None = None
    #: True: a run that computes ahead computes its cells in the background peer worker
    #: (``running.peer_worker``), which needs no JAX (docs/checking.md, "Processes of a run").
    background: bool = False

    def available(self) -> bool:
        """True when the framework and every package of ``requires`` are installed (found
        without importing them)."""
        return all(importlib.util.find_spec(name) is not None
                   for name in (self.framework, *self.requires))


def install_command(*packages: str) -> str:
    """One ``pip install`` of ``packages``, each as ``usage.INSTALL`` gives it (the one command
    per package the report's missing lines use too)."""
    return "pip install " + " ".join(INSTALL[p].removeprefix("pip install ") for p in packages)


PEERS: tuple[Peer, ...] = (
    Peer("torch.sdpa", "torch", install_command("torch"), torch_nn.torch_sdpa, background=True),
    Peer("torch.MHA", "torch", install_command("torch"), torch_nn.torch_mha, background=True),
    Peer("torch.MHA[sdpa]", "torch", install_command("torch"), torch_nn.torch_mha_sdpa,
         background=True),
    Peer("torch.flex", "torch", install_command("torch"), torch_flex.torch_flex, background=True),
    Peer("jax.nn", "jax", install_command("jax"), jax_nn.jax_nn),
    Peer("jax.nn[lengths]", "jax", install_command("jax"), jax_nn.jax_nn_lengths),
    Peer("keras[numpy]", "keras", install_command("keras"), keras_ops.keras_numpy,
         submit=functools.partial(keras_ops.keras_submit, "numpy")),
    Peer("keras[jax]", "keras", install_command("keras", "jax"), keras_ops.keras_jax, ("jax",),
         functools.partial(keras_ops.keras_submit, "jax")),
    Peer("keras[torch]", "keras", install_command("keras", "torch"), keras_ops.keras_torch,
         ("torch",), functools.partial(keras_ops.keras_submit, "torch")),
    Peer("flax.nnx", "flax", install_command("flax", "jax"), flax_nnx.flax_nnx, ("jax",)),
    Peer("transformers.eager", "transformers", install_command("transformers", "torch"),
         transformers_attention.transformers_eager, ("torch",), background=True),
    Peer("transformers.sdpa", "transformers", install_command("transformers", "torch"),
         transformers_attention.transformers_sdpa, ("torch",), background=True),
    Peer("transformers.gpt_oss", "transformers", install_command("transformers", "torch"),
         transformers_gpt_oss.transformers_gpt_oss, ("torch",), background=True),
    Peer("transformers.rope[llama]", "transformers", install_command("transformers", "torch"),
         transformers_rotary.transformers_llama_rope, ("torch",), background=True),
    Peer("transformers.rope[deepseek_v3]", "transformers",
         install_command("transformers", "torch"),
         transformers_rotary.transformers_deepseek_v3_rope, ("torch",), background=True),
    Peer("transformers.rope[gpt_neox]", "transformers", install_command("transformers", "torch"),
         transformers_rotary.transformers_gpt_neox_rope, ("torch",), background=True),
    Peer("onnxruntime", "onnxruntime", install_command("onnxruntime", "onnx"),
         onnx_attention.onnxruntime_attention, ("onnx",), background=True),
    Peer("onnxruntime[nonpad]", "onnxruntime", install_command("onnxruntime", "onnx"),
         onnx_attention.onnxruntime_nonpad, ("onnx",), background=True),
)


def get(name: str) -> Peer:
    """The peer called ``name``."""
    for peer in PEERS:
        if peer.name == name:
            return peer
    raise UsageError(f"unknown peer {name!r}; known: {', '.join(p.name for p in PEERS)}")
