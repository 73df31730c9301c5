"""The conformance harness: one spec, every backend, identical seeded inputs.

Imports run one way, from the spec to the command line; each file holds one concern:

==================  =========================================================================
``spec``            the specification (standard library only): rules, stubs, tolerances,
                    the peers' known differences
``usage``           ``UsageError``: a mistake in calling the harness (exit code 2)
``backends``        adapters NumPy ↔ each backend (numpy, jax, torch, your module), lazy imports
``cases``           the named, seeded cases — **add a case here**
``reference``       the independent float64 reference of the pipeline and its VJP
``naive``           the naive low-precision baseline whose error scales every tolerance
``module_pipelines``  the spec's modules in float64 around the reference
``expected``        per case × dtype: expected value of every step, baseline errors, exact
                    zeros, positions the NaN rule leaves unspecified
``compare``         the one tolerance rule (``compare``), ``StepResult``
``diagnose``        plain-words reasons for a failure — **add a diagnosis here**
``results``         ``Cell``, ``RunResult`` and the other result types, known differences
``steps``           how a backend computes each compared step — **add a compared step here**
``peers``           the frameworks' own kernels as extra columns — **add a peer here**
``errors``          bad inputs of ``spec.ERRORS`` — **add a bad input here**
``properties``      Hypothesis property checks (``--hypothesis N``)
``runner``          runs cells, bad inputs and properties into one ``RunResult``
``golden``          golden vectors: export, and check through the runner
``report``          text, JSON, Markdown and plots of a ``RunResult``
``__main__``        ``python -m conformance``
==================  =========================================================================

Beside the run: ``specdoc`` (``docs/spec.md``), ``seed_example`` (the article's data),
``walkthrough_steps`` and ``walkthrough`` (the article, step by step), ``pictures`` (heatmaps).
A backend adapter for a new framework goes in ``backends``. Backends are imported lazily, so a
user with only NumPy installed can run the harness on ``numpy_attn``.
"""
