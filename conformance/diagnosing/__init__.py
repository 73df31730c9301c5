"""Diagnosing: why a cell failed, in plain words, from the case and what was returned.

====================  ==========================================================================
``diagnose``          a spec or checked backend's failing step: planted mistakes (a flipped
                      mask, the other causal alignment, a missing scale, ...) tried on the
                      case's inputs until one reproduces the result — **add a diagnosis here**
``diagnose_packed``   the mistakes of varlen, chunks, ALiBi, segment ids and mods
``order_of_steps``    the mistakes the combined cases show: the steps before masking in a wrong
                      order, negative segment ids as padding, half precision summed in half
``rotary``            the usual mistakes of a rotary embedding (layout swapped, positions off
                      by one or restarted, theta, scaling, rotary_dim, attention factor)
``latent_and_quantized``  the usual mistakes of multi-head latent attention (rope dims not
                      decoupled, the absorbed query without W_UK, the values' latent slice) and
                      of quantised caches (the scale's granularity, saturation skipped, ties
                      away from zero, the residual window off by one)
``lse_alternatives``  the alternatives of the row log-sum-exp (a finite fill, ``+inf``, the
                      input dtype) that ``alternatives`` applies
``alternatives``      a peer's difference: the alternative semantics each entry of
                      ``spec.KNOWN_DIFFERENCES`` names, computed from a case in float64, and the
                      verdict known / unexpected of a peer's cell (``classify``)
====================  ==========================================================================

The runner (``running.runner``) diagnoses each failing step as it judges it; the reports then
group the failures by diagnosis (``reporting.groups``).
"""
