"""The conformance harness: one spec, every backend, identical seeded inputs.

Imports run one way, from the spec to the command line. The core is flat, one concern per file;
eight wings have a folder each (their ``__init__`` says what each file holds):

====================  =========================================================================
``spec/``             the specification (standard library only), one file per chapter: rules,
                      stubs, tolerances (``spec/constants.py``), decoding, concurrency, context
                      parallelism, the plugin contract; beside them ``known_differences`` (the
                      frameworks' kernels' known differences, as data, shown as
                      ``spec.KNOWN_DIFFERENCES``), ``seed_example`` (the article's data, which
                      the cases and the teaching use) and ``specdoc`` (``docs/spec.md``)
``usage``             ``UsageError``: a mistake in calling the harness (exit code 2)
``plugins``           the contract of a checked module of yours: what it provides,
                      ``UNSUPPORTED``, ``LAYOUT``, its import errors (``docs/checking.md``)
``backends``          adapters NumPy ↔ each backend (numpy, jax, torch, your module), lazy
                      imports — **a backend adapter for a new framework goes here**
``case_inputs``       ``CaseData``, the shared shapes, and the inputs of the sinks, merge and
                      paged cases (key splits, shuffled page pools, their contiguous view)
``cases``             the named, seeded cases — **add a case here**
``cases_packed``      the cases of packed batches (varlen), chunks, ALiBi, segment ids, mods
``mods``              the cases' mask_mod / score_mod callables, named from a registry, and
                      their tabulation (mask, bias)
``reference``         the independent float64 reference of the pipeline and its VJP
``naive``             the naive low-precision baseline whose error scales every tolerance
``module_pipelines``  the spec's modules in float64 around the reference
``expected``          per case × dtype: expected value of every step, baseline errors, exact
                      zeros, positions the NaN rule leaves unspecified
``compare``           the one tolerance rule (``compare``), ``StepResult``
``diagnose``          plain-words reasons for a failure — **add a diagnosis here**
``diagnose_packed``   the mistakes of varlen, chunks, ALiBi, segment ids and mods
``results``           ``Cell``, ``RunResult`` and the other result types, known differences
``lse_alternatives``  the alternatives of the row log-sum-exp (a finite fill, ``+inf``, the
                      input dtype) that ``alternatives`` applies
``alternatives``      the alternative semantics each known difference names, computed from a
                      case in float64, and the verdict known / unexpected of a peer's cell
``composite``         steps made of several calls: the merge of split keys, the paged cache
``module_steps``      how a backend runs a module case: forward, parameter_gradients, decode
``calls``             backend calls as data, several in one compiled program, varlen's calls
``steps``             how a backend computes each compared step — **add a compared step here**
``peers/``            the frameworks' own kernels as extra columns: the registry ``PEERS`` in
                      its ``__init__`` — **add a peer here**: its adapter in a file of its own
                      (``torch_nn``, ``torch_flex``, ``jax_nn``, ``keras_ops`` with its
                      ``keras_worker``, ``flax_nnx``, ``transformers_attention``,
                      ``transformers_gpt_oss``, ``onnx_attention``), one line in ``PEERS``;
                      ``inputs``: a case's inputs in the peers' conventions
``isolation/``        a checked module runs isolated: copies of every array, a mutated input
                      named, ``SystemExit`` caught (``guard``); a module given by its path in
                      one worker process with a per-call ``--timeout`` (``worker``, ``serve``)
``errors``            bad inputs of ``spec.ERRORS`` — **add a bad input here**
``properties``        Hypothesis property checks (``--hypothesis N``)
``runner``            runs cells, bad inputs and properties into one ``RunResult``
``golden/``           golden vectors, which another user's folder may hand over: ``files``
                      (one ``.npz``: save, load with its structure checked), ``folders``
                      (export, the manifest, verify, check through the runner),
                      ``packed`` (varlen and mod files: tables, checks) and
                      ``untrusted`` (bounded reads, ``.npy`` headers before any data)
``shrink``            the smallest failing case of a failing cell, as a runnable script
``textwidth``         text within a width (``--width``, 100 columns by default): wrapped lines,
                      table panels, reproducers broken where Python allows
``plots``             ``--plot DIR``: heatmaps and error-vs-dtype plots (matplotlib)
``report``            text (``--verbose``), JSON and Markdown of a ``RunResult``
``terminal``          the default report: a summary per column, the matrix one glyph per dtype,
                      each known difference once
``verdict``           the focused report of a checked module: bugs first, compact table
``html/``             ``--html FILE``: one self-contained page to explore a ``RunResult`` (the
                      grid, filters, each cell's steps, known differences, reproducers)
``suite/``            the pytest plugin: ``pytest --pyargs conformance.suite
                      --attention-backend mypkg.attention``, one item per case × dtype × step
``context_parallel/`` context parallelism: its cases (**add a context-parallel case here**),
                      inputs, checks, bad calls, NumPy's checks (in process), the JAX and torch
                      workers (subprocesses) and the run (``python -m conformance
                      context-parallel``)
``repeat``            the bitwise-repeat promises of ``spec.REPEATABLE``, sequential and threaded
``teaching/``         the seed article step by step (``walkthrough_steps``, ``walkthrough``),
                      its heatmaps (``pictures``) and the graded exercises of ``learn/``
                      (``exercise_catalogue``, ``exercises``), beside the run
``__main__``          ``python -m conformance``
====================  =========================================================================

Backends are imported lazily, so a user with only NumPy installed can run the harness on
``numpy_attn``.
"""
