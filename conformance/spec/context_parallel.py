"""Context parallelism.

One sequence split across devices (``docs/context_parallel.md``).
"""

from __future__ import annotations

from typing import Any

#: The public functions of context parallelism, in every backend. Their signatures are the
#: stubs below with ``devices`` replaced by the backend's own parameters
#: (``CONTEXT_PARALLEL_DEVICES``); the rest of each signature is shared.
CONTEXT_PARALLEL_FUNCTIONS = ("context_parallel_attention", "context_parallel_attention_vjp")

#: How each backend names its devices: these parameters replace ``devices`` in the stubs
#: (numpy_attn's ``trace``, a list that receives the schedule's events, comes last).
CONTEXT_PARALLEL_DEVICES = {
    "numpy_attn": ("world_size", "trace"),
    "jax_attn": ("mesh", "axis_name"),
    "torch_attn": ("group",),
}

#: How keys and values reach the queries of every rank.
CONTEXT_PARALLEL_STRATEGIES = {
    "ring": "at step s rank r holds the key/value block of rank r - s and passes it to r + 1 "
    "(jax: lax.ppermute; torch: batch_isend_irecv); steps after the last one any rank needs are "
    "dropped; the backward pass runs the ring again with dK and dV travelling with their blocks, "
    "then sends them home.",
    "all_gather": "every rank gathers every key/value block (lax.all_gather, all_gather_single); "
    "the backward pass gathers again and reduce-scatters dK and dV to their owners.",
    "ulysses": "an all-to-all turns (all heads, 1/N of the sequence) into (1/N of the heads, the "
    "whole sequence), each rank attends, a second all-to-all turns the output back; heads and "
    "kv_heads must be multiples of N (ValueError otherwise).",
}

#: The sequence layout: rank r's shard of the sequence axis, with N ranks.
CONTEXT_PARALLEL_LAYOUT = (
    "Without load_balance rank r holds the contiguous chunk r of N; q_len and kv_len must be "
    "multiples of N. With load_balance=True (zig-zag, for causal attention) the sequence is cut "
    "into 2N chunks and rank r holds chunks r and 2N - 1 - r, concatenated; q_len and kv_len "
    "must be multiples of 2N. Otherwise ValueError. Positions in is_causal, window and "
    "kv_lengths are global (natural order); attention_rules.context_parallel.positions gives "
    "the layout order, x[..., positions, :]."
)


def context_parallel_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    devices: Any,
    strategy: str = "ring",
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    kv_lengths: Any = None,
    load_balance: bool = False,
) -> Any:
    """Attention over a sequence split along its sequence axis across ``N`` ranks.

    Equals ``blockwise_attention(query, key, value, kv_lengths=kv_lengths, ...)`` on the whole
    sequence within ``TOLERANCES``, every rank holding its shard of the sequence axis
    (``CONTEXT_PARALLEL_LAYOUT``) and the ranks exchanging blocks as ``strategy`` says
    (``CONTEXT_PARALLEL_STRATEGIES``). Per (query chunk, key chunk) pair each rank runs
    ``blockwise_attention``'s online softmax and keeps the log-sum-exp; partial results merge
    exactly (``lse = logaddexp(lse_a, lse_b)``, ``out = Σ exp(lse_x - lse)·out_x``). A pair that
    the causal rule or the window masks entirely is not computed. Fully masked rows give exactly
    0; float16/bfloat16 compute in float32 and return the input dtype.

    The devices (``CONTEXT_PARALLEL_DEVICES``): numpy_attn simulates ``world_size`` ranks in
    one process on the whole (layout-ordered) arrays; jax_attn takes whole arrays and a
    ``jax.sharding.Mesh`` and runs under ``jax.shard_map`` on the axis ``axis_name`` (jit-able,
    differentiable through a ``jax.custom_vjp``; ValueError when the mesh lacks the axis);
    torch_attn is called on every rank of a ``torch.distributed`` process group with that
    rank's shards and returns its shard (differentiable through a ``torch.autograd.Function``);
    shards that differ across ranks raise ValueError on every rank, and a rank that never calls
    makes the others fail when the group's timeout expires.

    Args:
      query: ``(batch, heads, q_len, head_dim)`` in layout order (torch: the rank's shard
        ``(batch, heads, q_len / N, head_dim)``).
      key: ``(batch, kv_heads, kv_len, head_dim)`` (torch: ``kv_len / N``).
      value: ``(batch, kv_heads, kv_len, v_dim)`` (torch: ``kv_len / N``).
      devices: the backend's parameters of ``CONTEXT_PARALLEL_DEVICES``.
      strategy: a key of ``CONTEXT_PARALLEL_STRATEGIES`` (ValueError otherwise).
      is_causal, causal_alignment, window, scale, softcap: as in
        ``scaled_dot_product_attention``, on global positions.
      kv_lengths: ``(batch,)`` ints in ``[0, kv_len]`` (global), the same on every rank.
      load_balance: the zig-zag layout (``CONTEXT_PARALLEL_LAYOUT``).

    Returns:
      ``(batch, heads, q_len, v_dim)`` in layout order (torch: the rank's shard), input dtype.
    """


def context_parallel_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    *,
    devices: Any,
    strategy: str = "ring",
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: tuple | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    kv_lengths: Any = None,
    load_balance: bool = False,
) -> Any:
    """Gradients of ``context_parallel_attention``: the forward pass, then the strategy's
    backward pass (numpy_attn by hand; jax_attn through ``jax.vjp``; torch_attn through
    ``torch.autograd.grad``).

    Args:
      query: ``(batch, heads, q_len, head_dim)`` (torch: the rank's shard).
      key: ``(batch, kv_heads, kv_len, head_dim)``.
      value: ``(batch, kv_heads, kv_len, v_dim)``.
      grad_output: ``(batch, heads, q_len, v_dim)``, in layout order like query.
      devices, strategy, is_causal, causal_alignment, window, scale, softcap, kv_lengths,
        load_balance: as in ``context_parallel_attention``.

    Returns:
      ``(grad_query, grad_key, grad_value)`` shaped like query, key and value, in their dtype.
    """
