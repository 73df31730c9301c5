"""torch_attn inside other frameworks, one small module per host, imported on demand.

``torch_attn.integrations.transformers``: an attention implementation for Hugging Face
transformers (``register()`` returns its name for ``attn_implementation=``);
``torch_attn.integrations.transformers_rotary``: ``use_rotary(model)``, the models' rotary
embedding through ``torch_attn.rotary_embedding`` too.

``import torch_attn`` imports none of these (nor the frameworks they adapt to).
"""
