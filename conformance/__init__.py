"""The conformance harness: one spec, every backend, identical seeded inputs.

Imports run one way, from the spec to the command line; each file holds one concern:

==================  =========================================================================
``known_differences``  the frameworks' kernels' known differences from the spec, as data
                    (shown as ``spec.KNOWN_DIFFERENCES``)
``spec``            the specification (standard library only): rules, stubs, tolerances
``usage``           ``UsageError``: a mistake in calling the harness (exit code 2)
``plugins``         the contract of a checked module of yours: what it provides, ``UNSUPPORTED``,
                    ``LAYOUT``, its import errors (``docs/checking.md``)
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
``peer_inputs``     a case's inputs in the peers' conventions (4-D, BTNH, joined masks, n/a)
``peers_flax``      ``flax.nnx.dot_product_attention`` as a peer
``peers_keras``     ``keras.ops.dot_product_attention`` per Keras backend, each in a worker
                    process (``keras_worker``, which Keras' once-per-process backend needs)
``peers_onnx``      onnxruntime running one ONNX ``Attention`` node
``peers_transformers``  transformers' eager and SDPA attention functions, called as models do
``peers``           the frameworks' own kernels as extra columns (``PEERS``) — **add a peer
                    here** (its adapter in a ``peers_<framework>`` file of its own)
``errors``          bad inputs of ``spec.ERRORS`` — **add a bad input here**
``properties``      Hypothesis property checks (``--hypothesis N``)
``runner``          runs cells, bad inputs and properties into one ``RunResult``
``golden``          golden vectors: export, and check through the runner
``shrink``          the smallest failing case of a failing cell, as a runnable script
``report``          text, JSON, Markdown and plots of a ``RunResult``
``verdict``         the focused report of a checked module: bugs first, compact table
``context_parallel_cases``  context parallelism's cases, expected values, bad calls; NumPy's
                    checks (in process)
``context_parallel_workers``  its JAX (4 host devices) and torch (gloo ranks) subprocesses
``context_parallel``  runs and reports them (``python -m conformance context-parallel``)
``repeat``          the bitwise-repeat promises of ``spec.REPEATABLE``, sequential and threaded
``__main__``        ``python -m conformance``
==================  =========================================================================

Beside the run: ``specdoc`` (``docs/spec.md``), ``seed_example`` (the article's data),
``walkthrough_steps`` and ``walkthrough`` (the article, step by step), ``pictures`` (heatmaps).
A backend adapter for a new framework goes in ``backends``. Backends are imported lazily, so a
user with only NumPy installed can run the harness on ``numpy_attn``.
"""
