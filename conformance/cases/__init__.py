"""Cases: what the harness runs, and what each step must give.

A case is a named, seeded set of inputs; per dtype its expected values are computed in float64
by an implementation independent of every backend, and its tolerances from a naive
implementation's error in that dtype. Nothing here knows a backend.

======================  ========================================================================
``dtypes``              the dtypes a case runs in (``DTYPES``) and their NumPy dtypes
``inputs``              ``CaseData``, the shared shapes, and the inputs of the sinks, merge and
                        paged cases (key splits, shuffled page pools, their contiguous view)
``catalogue``           the named, seeded cases (``CASES``, ``get``, ``select``) — **add a case
                        here**
``packed``              the cases of packed batches (varlen), chunks, ALiBi, segment ids, mods
``mods``                the cases' mask_mod / score_mod callables, named from a registry, and
                        their tabulation (mask, bias)
``varlen_padding``      a packed batch as a padded batch with lengths, and back
``rotary``              the rotary embedding's cases and their float64 rotation and frequencies
``quantized``           the quantised caches' cases (quantisers, a cache with its residual
                        window) and their expected values
``quantizer``           the float64 quantiser those expected values come from, from the spec
``latent``              the latent attention (MLA) module case and its float64 MLA
``latent_grads``        that MLA's weight gradients by the chain rule (the ``grad_weights`` step)
``reference``           the independent float64 reference of the pipeline and its VJP
``naive``               the naive low-precision baseline whose error scales every tolerance
``module_pipelines``    the spec's modules in float64 around the reference
``expected``            per case × dtype (``Expected``): the expected value of every step,
                        baseline errors, exact zeros, positions the NaN rule leaves unspecified
======================  ========================================================================
"""
