"""Public modules (stubs).

Weights use the ``x @ W`` convention of the article: ``(d_in, d_out)``. Every module has
``train(mode=True)`` and ``eval()``, which set its mode in place and return the module itself;
a new module is in training mode. Training mode lets dropout act (``dropout_p`` of
``CausalSelfAttention`` and ``MultiHeadAttention``; in jax_attn only when ``forward`` gets an
``rng`` key), and ``parameter_gradients`` refuses (ValueError) a module whose dropout is
active; ``eval()`` turns dropout off.

``parameter_gradients(inputs..., grad_output)`` is named for what it returns, not ``backward``:
a torch_attn module is an ordinary ``torch.nn.Module`` trained with ``loss.backward()`` (an
``nn.Module`` has no ``backward`` method, and one called so would suggest that a PyTorch user
must write it), a jax_attn module a pytree differentiated with ``jax.grad``. Only numpy_attn,
without autodiff, needs it to train: there it is the backward pass written by hand, the lesson
(``numpy_attn/backward.py``). In every backend it is also what the harness compares
(``grad_weights``), as NumPy arrays.
"""

from __future__ import annotations

from typing import Any

MODULES = (
    "SelfAttention",
    "CrossAttention",
    "CausalSelfAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadAttention",
)

#: Methods every module has, beyond its constructor.
MODULE_METHODS = (
    "forward", "parameter_gradients", "export_weights", "load_weights", "train", "eval"
)

WEIGHTS = (
    "Each module's weights export to a flat dict of NumPy arrays (export_weights) and load from "
    "one (load_weights), with the same keys and shapes in every backend. load_weights returns "
    "the module holding the new weights: numpy_attn and torch_attn update the module in place "
    "and return it; jax_attn modules are immutable pytrees and return a new module. Write "
    "`module = module.load_weights(weights)` to be portable. "
    "parameter_gradients(inputs..., grad_output) returns the gradient of every weight (the "
    "vector-Jacobian product of forward with grad_output) as a dict of NumPy arrays with the "
    "same keys: numpy_attn derives it by hand (backward.py), jax_attn with jax.vjp and "
    "torch_attn with torch.autograd.grad (the parameters' .grad are left untouched: a torch "
    "module trains with loss.backward() like any nn.Module); it never applies dropout (every "
    "backend raises ValueError while dropout is active in training mode)."
)

INITIALISATION = (
    "SelfAttention, CrossAttention, CausalSelfAttention and MultiHeadAttentionWrapper draw "
    "every weight uniformly from [0, 1), in the article's order (W_query, W_key, W_value; head "
    "by head), so torch_attn with torch.manual_seed(123) reproduces the article's numbers. "
    "MultiHeadAttention draws W_query, W_key, W_value, W_out from the Xavier/Glorot uniform "
    "distribution (as torch.nn.MultiheadAttention's in_proj_weight) and sets biases to 0, and "
    "its sinks (sinks=True) to 0 without drawing, so the other weights are those of the same "
    "module without sinks."
)


class _Module:
    """What every module stub below has besides its own methods: the training mode."""

    def train(self, mode: bool = True) -> Any:
        """Set training mode (``mode=True``) or inference mode (``mode=False``) in place;
        returns the module itself.

        In training mode dropout is active (``dropout_p > 0``; in jax_attn only when
        ``forward`` gets an ``rng`` key) and ``parameter_gradients`` raises ValueError while it
        is.
        """

    def eval(self) -> Any:
        """Inference mode, ``train(False)``: no dropout; returns the module itself."""


class SelfAttention(_Module):
    """The article's single-head self-attention.

    Weights: ``W_query (d_in, d_out_kq)``, ``W_key (d_in, d_out_kq)``,
    ``W_value (d_in, d_out_v)``. ``scale = d_out_kq ** -0.5``.
    """

    def __init__(self, d_in: int, d_out_kq: int, d_out_v: int, *, rng: Any = None) -> None:
        """``rng``: the backend's random source for the initial weights."""

    def forward(self, x: Any) -> Any:
        """``x: (..., seq, d_in)`` → ``(..., seq, d_out_v)``."""

    def parameter_gradients(self, x: Any, grad_output: Any) -> dict:
        """Weight gradients: ``grad_output: (..., seq, d_out_v)`` → name → NumPy array."""

    def export_weights(self) -> dict:
        """Flat dict name → NumPy array."""

    def load_weights(self, weights: dict) -> Any:
        """Load weights exported by any backend; returns the module."""


class CrossAttention(_Module):
    """The article's cross-attention: queries from ``x_1``, keys and values from ``x_2``.

    Weights as ``SelfAttention``.
    """

    def __init__(self, d_in: int, d_out_kq: int, d_out_v: int, *, rng: Any = None) -> None:
        """``rng``: the backend's random source for the initial weights."""

    def forward(self, x_1: Any, x_2: Any) -> Any:
        """``x_1: (..., q_len, d_in)``, ``x_2: (..., kv_len, d_in)`` → ``(..., q_len, d_out_v)``."""

    def parameter_gradients(self, x_1: Any, x_2: Any, grad_output: Any) -> dict:
        """Weight gradients: ``grad_output: (..., q_len, d_out_v)`` → name → NumPy array."""

    def export_weights(self) -> dict:
        """Flat dict name → NumPy array."""

    def load_weights(self, weights: dict) -> Any:
        """Load weights exported by any backend; returns the module."""


class CausalSelfAttention(_Module):
    """The article's causal (masked) self-attention, with optional dropout on the weights.

    Weights as ``SelfAttention``. Dropout applies only in training mode (``train()``/``eval()``
    in every backend; in jax_attn also only when ``forward`` gets an ``rng`` key).
    """

    def __init__(
        self, d_in: int, d_out_kq: int, d_out_v: int, *, dropout_p: float = 0.0, rng: Any = None
    ) -> None:
        """``rng``: the backend's random source for the initial weights."""

    def forward(self, x: Any, *, rng: Any = None) -> Any:
        """``x: (..., seq, d_in)`` → ``(..., seq, d_out_v)``; ``rng`` feeds dropout."""

    def parameter_gradients(self, x: Any, grad_output: Any) -> dict:
        """Weight gradients (no dropout): ``grad_output: (..., seq, d_out_v)``."""

    def export_weights(self) -> dict:
        """Flat dict name → NumPy array."""

    def load_weights(self, weights: dict) -> Any:
        """Load weights exported by any backend; returns the module."""


class MultiHeadAttentionWrapper(_Module):
    """The article's multi-head wrapper: ``num_heads`` independent ``SelfAttention`` heads.

    Outputs are concatenated on the last axis: ``(..., seq, num_heads * d_out_v)``.
    Weights: ``heads.{h}.W_query``, ``heads.{h}.W_key``, ``heads.{h}.W_value``.
    """

    def __init__(
        self, d_in: int, d_out_kq: int, d_out_v: int, num_heads: int, *, rng: Any = None
    ) -> None:
        """``rng``: the backend's random source for the initial weights."""

    def forward(self, x: Any) -> Any:
        """``x: (..., seq, d_in)`` → ``(..., seq, num_heads * d_out_v)``."""

    def parameter_gradients(self, x: Any, grad_output: Any) -> dict:
        """Weight gradients ``heads.{h}.W_*``: ``grad_output: (..., seq, num_heads * d_out_v)``."""

    def export_weights(self) -> dict:
        """Flat dict name → NumPy array."""

    def load_weights(self, weights: dict) -> Any:
        """Load weights exported by any backend; returns the module."""


class MultiHeadAttention(_Module):
    """Production-style multi-head attention with fused projections.

    ``head_dim = d_model // num_heads``; ``num_kv_heads`` (default ``num_heads``) must divide
    ``num_heads`` (grouped-query / multi-query attention). Weights: ``W_query (d_model,
    num_heads·head_dim)``, ``W_key``/``W_value (d_model, num_kv_heads·head_dim)``,
    ``W_out (num_heads·head_dim, d_model)``, with ``bias=True`` ``b_query``, ``b_key``,
    ``b_value``, ``b_out`` of matching output sizes, and with ``sinks=True`` ``sinks
    (num_heads,)``: GPT-OSS's learned attention sinks, one logit per query head that joins
    every softmax denominator of its head (``SINKS``) in ``forward``, ``parameter_gradients``
    (the sinks' gradient under the key ``sinks``) and ``decode``. Self-attention when
    ``context`` is None, cross-attention otherwise.

    With ``rope`` (a ``RoPE``, ``rotary.py``) the projected queries and keys are rotated before
    the attention: ``rotary_embedding`` with the rope's layout and rotary_dim (None: all of
    head_dim) and the inverse frequencies and attention factor of ``rope_frequencies(rotary_dim,
    theta=rope.theta, scaling=rope.scaling, max_position_embeddings=rope.max_position_embeddings)``
    (computed without ``seq_len``). Positions, integers: ``forward``'s ``positions (...,
    q_len)`` (default ``0..q_len-1``) place the queries and, in self-attention, the keys
    (a packed batch passes positions that restart at 0 per sequence; a context-parallel shard
    the global positions of its tokens). Over a ``context`` the keys sit at ``key_positions
    (..., kv_len)``, default ``0..kv_len-1`` (the context is a sequence of its own, starting
    at 0; a context that continues the queries' sequence passes both); ``key_positions``
    without a context is a ValueError. ``decode`` places its ``n`` new tokens at ``length +
    0..n-1``, after the cached ones (a ``PagedKVCache``: each sequence's own length), and
    caches rotated keys, so decoding token by token equals ``forward(x_all, is_causal=True)``.
    Without a rope positions have no effect. ``parameter_gradients`` goes back through the
    rotation (numpy_attn: ``rotary_embedding_vjp``; the others: autodiff).

    ``stages(x, ...)`` returns every intermediate tensor of ``forward`` (no dropout) as a dict,
    in this order: ``q_proj (..., heads, q_len, head_dim)``, ``k_proj``, ``v_proj (...,
    kv_heads, kv_len, head_dim)``, ``rotated_q``, ``rotated_k`` (equal to the projections
    without a rope), ``scores (..., heads, q_len, kv_len)`` (``mask_scores(attention_scores(q,
    k), ...)``: scaled, ``-inf`` where masked), ``weights (..., heads, q_len, kv_len)``,
    ``context (..., heads, q_len, head_dim)``, ``output (..., q_len, d_model)``, equal to
    ``forward``'s result. ``python -m conformance locate`` compares two attention blocks stage
    by stage through it.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        bias: bool = True,
        sinks: bool = False,
        dropout_p: float = 0.0,
        rng: Any = None,
        rope: Any = None,
    ) -> None:
        """``rng``: the backend's random source for the initial weights; ``sinks``: a learned
        sink logit per query head (initialised to 0, drawing nothing); ``rope``: None or a
        ``RoPE`` (not a weight; its rotary_dim at most head_dim, else ValueError; anything
        else TypeError)."""

    def forward(
        self,
        x: Any,
        context: Any = None,
        *,
        mask: Any = None,
        is_causal: bool = False,
        causal_alignment: str = "top_left",
        window: tuple | None = None,
        return_weights: bool = False,
        rng: Any = None,
        positions: Any = None,
        key_positions: Any = None,
    ) -> Any:
        """Attention of ``x`` over ``context`` (or over itself).

        Args:
          x: ``(..., q_len, d_model)``.
          context: ``(..., kv_len, d_model)`` or ``None`` for self-attention.
          mask: boolean, broadcastable to ``(..., num_heads, q_len, kv_len)``.
          is_causal, causal_alignment, window: as in ``scaled_dot_product_attention``.
          return_weights: also return weights ``(..., num_heads, q_len, kv_len)``.
          rng: random source for dropout.
          positions: integer ``(..., q_len)``: the queries' positions for the rope (default
            ``0..q_len-1``), the keys' too in self-attention.
          key_positions: integer ``(..., kv_len)``: the context's positions (default
            ``0..kv_len-1``); only with a ``context``.

        Returns:
          ``(..., q_len, d_model)`` (and the weights).
        """

    def parameter_gradients(
        self,
        x: Any,
        grad_output: Any,
        context: Any = None,
        *,
        mask: Any = None,
        is_causal: bool = False,
        causal_alignment: str = "top_left",
        window: tuple | None = None,
        positions: Any = None,
        key_positions: Any = None,
    ) -> dict:
        """Weight gradients of ``forward(x, context, ...)`` (no dropout).

        ``grad_output: (..., q_len, d_model)``; returns name → NumPy array for every weight.
        """

    def export_weights(self) -> dict:
        """Flat dict name → NumPy array."""

    def load_weights(self, weights: dict) -> Any:
        """Load weights exported by any backend; returns the module."""

    def stages(
        self,
        x: Any,
        context: Any = None,
        *,
        mask: Any = None,
        is_causal: bool = False,
        causal_alignment: str = "top_left",
        window: tuple | None = None,
        positions: Any = None,
        key_positions: Any = None,
    ) -> dict:
        """Every intermediate tensor of ``forward`` (no dropout), named, in the pipeline's
        order: ``q_proj``, ``k_proj``, ``v_proj``, ``rotated_q``, ``rotated_k``, ``scores``,
        ``weights``, ``context``, ``output`` (shapes in the class's text); the arguments as in
        ``forward``."""
