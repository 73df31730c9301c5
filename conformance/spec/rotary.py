"""Rotary position embedding (RoPE).

Queries and keys are rotated, pair of dims by pair of dims, by an angle proportional to their
token's position, so that ``q·k`` depends on the positions only through their difference.
``rotary_embedding`` rotates, ``rotary_embedding_vjp`` is its gradient, ``rope_frequencies``
gives the frequencies of transformers' scaling methods, ``permute_for_rotary_layout`` moves a
checkpoint's weights between the two layouts, and ``RoPE`` describes a model's embedding for
the modules. JAX has no rotary embedding in ``jax.nn``: jax_attn is checked against the other
backends and the float64 reference. The rules' code: ``attention_rules/rotary.py`` (the
frequencies: ``attention_rules/rope_scaling.py``).
"""

from __future__ import annotations

from typing import Any

#: The rotation, the two layouts and the arguments.
ROTARY = (
    "x (..., heads, seq, head_dim) (or (seq, head_dim)) and integer positions (..., seq): a "
    "heads axis is inserted (positions[..., None, :]) and the result broadcasts to "
    "x.shape[:-1], so (seq,) and (batch, seq) positions both work; for a 2-D x, (seq,). "
    "Negative positions rotate backwards. With r = rotary_dim (None: head_dim; even, 0 < r <= "
    "head_dim) the first r dims are rotated and x[..., r:] passes through bit-identical. "
    "inv_freq[i] = theta ** (-2 i / r) for i < r / 2 (computed as 1 / theta ** (2 i / r), "
    "transformers' default; with partial rotary the exponent divides by r, not head_dim), or "
    "the (r / 2,) inv_freq given (theta then unused). The angle of pair i at position p is "
    "a_i = p · inv_freq[i]. layout='half' (transformers' rotate_half, GPT-NeoX) pairs dims "
    "(i, i + r/2): out[i] = x[i] cos a_i - x[i + r/2] sin a_i, out[i + r/2] = x[i + r/2] cos "
    "a_i + x[i] sin a_i. layout='interleaved' (Meta's Llama code, GPT-J) pairs (2i, 2i + 1): "
    "out[2i] = x[2i] cos a_i - x[2i+1] sin a_i, out[2i+1] = x[2i+1] cos a_i + x[2i] sin a_i. "
    "In complex numbers, each pair (x1 + i x2) is multiplied by attention_factor · e^{i a}. "
    "attention_factor (> 0, default 1) multiplies cos and sin (YaRN's and LongRoPE's "
    "attention scaling, mscale): only the rotated dims are scaled, as transformers' "
    "apply_rotary_pos_emb with partial rotary. The output keeps x's shape, dtype and layout "
    "(interleaved in, interleaved out). Since the rotation is orthogonal (times the factor), "
    "q rotated at p and k rotated at p' give q·k that depends only on p - p' (times "
    "attention_factor²). rotary_embedding_vjp is the transpose: grad_output's pairs turned by "
    "-a_i, times attention_factor, and grad_output unchanged on the pass-through dims."
)

#: The layout each model family uses.
ROTARY_LAYOUTS = {
    "Meta's Llama reference code (llama, llama-models), Mistral's reference code": "interleaved "
    "(torch.view_as_complex on pairs (2i, 2i+1))",
    "transformers Llama, Mistral, Qwen2/3, GPT-NeoX, Phi, Gemma": "half (rotate_half); the "
    "checkpoint converter permuted W_q and W_k (permute_for_rotary_layout(w, heads, "
    "to='half'))",
    "GPT-J (transformers GPTJ)": "interleaved (rotate_every_two), partial: rotary_dim",
    "DeepSeek-V2/V3 in transformers (rope_interleave=True)": "interleaved input; "
    "apply_rotary_pos_emb_interleave returns the rotated dims in half order (de-interleaved): "
    "q·k is unchanged, but the tensors differ from an interleaved rotation (up to 4.4 on "
    "unit-normal inputs), so compare them to rotary_embedding(layout='interleaved') only after "
    "permuting, or through q·k; MLA rotates only qk_rope_head_dim dims (decoupled RoPE)",
    "partial rotary": "GPT-NeoX rotary_pct, Phi / transformers partial_rotary_factor, GLM "
    "(half of head_dim): rotary_dim = int(head_dim · factor), the rotated dims first",
}

#: Moving a checkpoint between the layouts.
ROTARY_PERMUTATION = (
    "permute_for_rotary_layout(w, heads, to='half') reorders the rows of w (heads · head_dim, "
    "in_features) (torch nn.Linear's (out, in), Meta's and transformers' state dicts) or of a "
    "bias (heads · head_dim,): within each head, new row a · r/2 + i is old row 2 i + a (a in "
    "{0, 1}, i < r/2), transformers' convert_llama_weights_to_hf permute w.view(heads, r/2, 2, "
    "in).transpose(1, 2).reshape(heads · head_dim, in). to='interleaved' is the inverse. With "
    "rotary_dim, only the first rotary_dim rows of each head move. Permute W_q and W_k (and "
    "their biases) alike and switch the layout: the rotated q and k are the old ones with "
    "their dims reordered the same way, so q·k, the scores and the output are unchanged. "
    "W_v and W_o never move."
)

#: The frequencies of each scaling method (``rope_frequencies``), as transformers 5.25.
ROTARY_SCALING = {
    "format": "scaling is None or a dict in transformers' rope_scaling / rope_parameters "
    "format: 'rope_type' (legacy 'type'; absent: 'default') and the method's keys, with "
    "transformers' names and defaults. head_dim is the number of rotated dims d (head_dim · "
    "partial_rotary_factor: the dict's partial_rotary_factor is not applied again); the dict's "
    "'rope_theta', when present, is the base b, else theta. inv0[i] = 1 / b ** (2 i / d). "
    "original_max_position_embeddings comes from the dict, else from the argument "
    "max_position_embeddings (transformers' standardize_rope_params). The formulas are "
    "evaluated in Python floats (float64), the same in every backend.",
    "default": "inv0; attention_factor 1",
    "linear": "inv0 / factor; attention_factor 1",
    "dynamic": "L = max(seq_len, max_position_embeddings) (seq_len None: "
    "max_position_embeddings); b' = b · (factor · L / max_position_embeddings - (factor - "
    "1)) ** (d / (d - 2)); inv0 with b'; attention_factor 1. Needs max_position_embeddings",
    "llama3": "with L0 = original_max_position_embeddings and wavelen = 2π / inv0[i]: "
    "wavelen < L0 / high_freq_factor keeps inv0[i]; wavelen > L0 / low_freq_factor gives "
    "inv0[i] / factor; between, s = (L0 / wavelen - low_freq_factor) / (high_freq_factor - "
    "low_freq_factor) and (1 - s) · inv0[i] / factor + s · inv0[i]; attention_factor 1",
    "yarn": "factor (absent: max_position_embeddings / L0); attention_factor = the dict's "
    "attention_factor, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both "
    "are given, else mscale(factor) with mscale(s, m=1) = 0.1 m ln s + 1 (1 for s <= 1); "
    "beta_fast (default 32), beta_slow (default 1); corr(n) = d ln(L0 / (2π n)) / (2 ln b); "
    "low = corr(beta_fast), high = corr(beta_slow), floored / ceiled when truncate (default "
    "True), clipped to [0, d - 1] (high += 0.001 if equal); ramp[i] = clip((i - low) / (high - "
    "low), 0, 1); inv = inv0 / factor · ramp + inv0 · (1 - ramp)",
    "longrope": "factor (absent: max_position_embeddings / L0); attention_factor = the dict's, "
    "else 1 for factor <= 1, else sqrt(1 + ln factor / ln L0); ext = long_factor when seq_len "
    "> L0, else short_factor (d / 2 numbers each); inv[i] = 1 / (ext[i] · b ** (2 i / d))",
}

#: The dtypes of the computation.
ROTARY_PRECISION = (
    "The compute dtype is float64 for float64 x and float32 otherwise (float16, bfloat16, "
    "float32). inv_freq is rounded to the compute dtype (the default and rope_frequencies' "
    "values are float64 first); the angle float(p) · inv_freq is ONE multiply in the compute "
    "dtype (positions beyond 2**24 are not exact in float32: transformers rounds them the "
    "same way); cos and sin in the compute dtype, times attention_factor; the rotation in the "
    "compute dtype, rounded once to x's dtype. Known differences: transformers computes the "
    "angles, cos and sin in float32 even in a float64 model (its inv_freq is float32 and "
    "position_ids.float()), so a float64 comparison against it agrees to float32 rounding "
    "only (about 1e-7 relative, growing with the position); in float16 / bfloat16 "
    "transformers rounds cos and sin to x's dtype and rotates in that dtype, this spec "
    "rotates in float32 and rounds once (closer to the float64 result)."
)

#: The positions to give while decoding, in a packed batch and on a context-parallel shard.
ROTARY_POSITIONS = (
    "Positions are the tokens' positions in their own sequence. Decoding with a KV cache: the "
    "new tokens are at cache length + arange(n) (the cache offset); keys are rotated before "
    "they enter the cache and never again. A packed (varlen) batch: positions restart at 0 "
    "for each sequence (position = token index - cu_seq[i] for the tokens of sequence i), "
    "not the index in the packed axis. A context-parallel shard: the global positions of the "
    "shard's tokens (with the load-balanced layout, the two chunks a rank holds are not "
    "contiguous), never arange of the shard's length. dynamic and longrope depend on the "
    "sequence length: pass seq_len = max(position) + 1 as transformers does."
)

#: The errors of the rotary functions and ``RoPE`` (every backend: same type and message,
#: from attention_rules.rotary). A Python list where an array is expected is TypeError, as
#: ARRAY_INPUTS says.
ROTARY_ERRORS = {
    "x not float16, bfloat16, float32 or float64; positions not integer (float, bool, complex "
    "positions); inv_freq or grad_output not floating": "TypeError",
    "x with fewer than 2 axes; positions that do not broadcast to x.shape[:-1] once a heads "
    "axis is inserted (the message names both shapes); grad_output not x.shape": "ValueError",
    "layout (or to) not 'half' or 'interleaved'": "ValueError",
    "rotary_dim odd, <= 0, > head_dim or not an int (a traced value under jax.jit included); "
    "head_dim odd with rotary_dim None": "ValueError",
    "inv_freq not (rotary_dim // 2,)": "ValueError",
    "theta or attention_factor not a finite number > 0": "ValueError",
    "scaling not None nor a dict": "TypeError",
    "scaling with an unknown rope_type, a missing key (linear/dynamic: factor; llama3: factor, "
    "low_freq_factor, high_freq_factor; longrope: short_factor, long_factor; llama3/yarn/"
    "longrope: original_max_position_embeddings or max_position_embeddings) or an invalid "
    "value (the message names scaling, the key and the known types); head_dim not an even int "
    "> 0; seq_len not an int >= 0; max_position_embeddings not an int >= 1": "ValueError",
    "permute_for_rotary_layout: heads not an int > 0, w not 1-D or 2-D or its first axis not "
    "a multiple of heads": "ValueError",
}


def rotary_embedding(
    x: Any,
    positions: Any,
    *,
    theta: float = 10000.0,
    layout: str = "half",
    rotary_dim: int | None = None,
    inv_freq: Any = None,
    attention_factor: float = 1.0,
) -> Any:
    """Rotate the first ``rotary_dim`` dims of x by their positions' angles (``ROTARY``).

    Args:
      x: ``(..., heads, seq, head_dim)`` or ``(seq, head_dim)``, floating.
      positions: ``(..., seq)`` integers; ``positions[..., None, :]`` broadcasts to
        ``x.shape[:-1]`` (``(seq,)`` for a 2-D x).
      theta: the base of the default frequencies.
      layout: "half" or "interleaved" (``ROTARY_LAYOUTS``).
      rotary_dim: the rotated dims (even, ``<= head_dim``); None: all.
      inv_freq: ``(rotary_dim // 2,)`` floats replacing the default frequencies, or None.
      attention_factor: multiplies cos and sin.

    Returns:
      ``x.shape`` in x's dtype and layout (``ROTARY_PRECISION``).
    """


def rotary_embedding_vjp(
    x: Any,
    positions: Any,
    grad_output: Any,
    *,
    theta: float = 10000.0,
    layout: str = "half",
    rotary_dim: int | None = None,
    inv_freq: Any = None,
    attention_factor: float = 1.0,
) -> Any:
    """The gradient of ``rotary_embedding`` w.r.t. x: the transpose rotation.

    Every backend writes it out (numpy_attn has no autodiff); ``jax.grad`` and torch autograd
    differentiate ``rotary_embedding`` itself to the same values.

    Args:
      x, positions: as in ``rotary_embedding``.
      grad_output: ``x.shape``, floating.
      theta, layout, rotary_dim, inv_freq, attention_factor: as in ``rotary_embedding``.

    Returns:
      grad_x: ``x.shape`` in x's dtype.
    """


def rope_frequencies(
    head_dim: int,
    *,
    theta: float = 10000.0,
    scaling: dict | None = None,
    seq_len: int | None = None,
    max_position_embeddings: int | None = None,
) -> Any:
    """The inverse frequencies and attention factor of a scaling method (``ROTARY_SCALING``).

    Args:
      head_dim: the rotated dims (head_dim · partial_rotary_factor), even.
      theta: the base ("rope_theta" in scaling takes its place).
      scaling: None or a transformers rope_scaling / rope_parameters dict.
      seq_len: the sequence length (dynamic, longrope), or None.
      max_position_embeddings: the model's context (dynamic, yarn, longrope), or None.

    Returns:
      ``(inv_freq, attention_factor)``: ``(head_dim // 2,)`` float64 (jax_attn: float32 unless
      jax_enable_x64) and a Python float.
    """


def permute_for_rotary_layout(
    w: Any, heads: int, *, to: str = "half", rotary_dim: int | None = None
) -> Any:
    """Reorder a query/key projection's rows between the layouts (``ROTARY_PERMUTATION``).

    Args:
      w: ``(heads * head_dim, in_features)`` or a bias ``(heads * head_dim,)``.
      heads: the heads of w.
      to: "half" (from Meta's interleaved) or "interleaved" (from half).
      rotary_dim: only the first rotary_dim rows of each head move; None: all.

    Returns:
      w's rows reordered: its shape and dtype.
    """


class RoPE:
    """A model's rotary embedding, for ``MultiHeadAttention(..., rope=RoPE(...))``: a frozen,
    hashable dataclass written once in attention_rules.rotary and re-exported by every backend.
    theta, layout, rotary_dim (None: all of head_dim), scaling (a transformers dict, copied)
    and max_position_embeddings, validated when made with the errors of ``ROTARY_ERRORS``
    (naming ``RoPE``). ``frequencies(head_dim, seq_len=None)`` gives ``rope_frequencies``'
    values as Python floats."""

    def __init__(
        self,
        theta: float = 10000.0,
        layout: str = "half",
        rotary_dim: int | None = None,
        scaling: dict | None = None,
        max_position_embeddings: int | None = None,
    ) -> None:
        """See the class."""

    def frequencies(self, head_dim: int, seq_len: int | None = None) -> Any:
        """``(inv_freq as a list of head_dim // 2 floats, attention_factor)`` for heads of
        ``head_dim`` (rotated dims: rotary_dim or all of head_dim)."""
