"""The blocked fast path of torch_attn, backward: nothing written by hand. This file mirrors
numpy_attn's and jax_attn's ``_blocked_vjp.py``, where the blocked path's backward pass is
their own, and says why torch_attn needs none.

``backward.py`` runs autograd through ``_fast.fast_attention``: the blocked path
(``_blocked.py``) is ``blockwise.BlockwiseFunction``, a ``torch.autograd.Function`` whose
backward recomputes each tile from the saved log-sum-exp (``_tiles.backward_tiles``), and SDPA,
whole or per block, has torch's own backward. So torch_attn needs no ``fast_attention_vjp``
(the function numpy_attn writes by hand) and no ``blocked_attention_vjp``.
"""
