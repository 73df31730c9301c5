"""jax_attn inside other frameworks, one small module per host, imported on demand.

``jax_attn.integrations.flax``: an ``attention_fn`` for Flax NNX's ``MultiHeadAttention`` (and
``use_jax_attn(model)`` to put it into every attention layer of a model).

``import jax_attn`` imports none of these (nor the frameworks they adapt to).
"""
