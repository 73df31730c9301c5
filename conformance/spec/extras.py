"""Backend-specific extras and integrations.

Public names that exist in one backend only, because they concern that framework alone. The
signature test allows exactly these beyond the spec.
"""

from __future__ import annotations

BACKEND_EXTRAS = {
    # NumPy has no autodiff: a minimal optimiser so NumPy-only users can train with the
    # modules' hand-written ``backward`` methods.
    "numpy_attn": ("sgd_step", "Adam"),
    "jax_attn": (),
    "torch_attn": ("weights_from_torch_multihead",),
}

# Integrations: backend-specific adapters to one host framework each, in the backend's
# ``integrations`` subpackage (``torch_attn.integrations.transformers``). They are not in the
# backend's ``__all__``: ``import torch_attn`` imports neither them nor their host framework
# (the optional extras ``transformers`` and ``flax`` of pyproject.toml install the hosts).
# backend → module → its public names. docs/integrations.md shows how they map onto this spec.
BACKEND_INTEGRATIONS = {
    "numpy_attn": {},
    "jax_attn": {"flax": ("MultiHeadAttentionWithSinks", "attention_fn", "use_jax_attn")},
    "torch_attn": {"transformers": ("NAME", "attention_forward", "attention_mask", "register"),
                   "transformers_rotary": ("use_rotary",)},
}
