"""The conformance harness: one spec, every backend, identical seeded inputs.

Backends are imported lazily (``conformance.backends``), so a user with only NumPy installed can
run the harness on ``numpy_attn``.
"""
