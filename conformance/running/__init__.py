"""Running: every cell of a run, computed where the execution room decides.

What a column computes:

==================  ============================================================================
``plugins``         the contract of a checked module of yours: what it provides,
                    ``UNSUPPORTED``, ``LAYOUT``, its import errors (``docs/checking.md``)
``backends``        adapters NumPy ↔ each backend (numpy, jax, torch, your module), lazy
                    imports — **a backend adapter for a new framework goes here**
``steps``           how a backend computes each compared step — **add a compared step here**
``calls``           backend calls as data, several in one compiled program, varlen's calls
``composite``       steps made of several calls: the merge of split keys, the paged cache
``module_steps``    how a backend runs a module case: forward, parameter_gradients, decode
==================  ============================================================================

Where it runs (the execution room):

==================  ============================================================================
``guard``           every call of a checked module guarded: copies of every array, a mutated
                    input named, ``SystemExit`` caught; in the harness's process for a module
                    object (``local_view``)
``workers``         the one protocol of every worker process: a fresh interpreter, a socket,
                    pickled messages; ``Channel``, the harness's side of a helper
``module_worker``   a checked module given by its path, in one worker process with a per-call
                    ``--timeout``: the harness's side (``Worker``, ``RemoteObject``)
``module_serve``    inside that worker process: the import, the calls, the handles
``peer_worker``     inside the background peer worker: the peers' cells, judged there
``keras_worker``    one Keras backend per worker process, its requests pipelined
``room``            where and in which order a run's cells are computed: ``Room`` (here, each
                    when its turn comes), ``Threads`` (the quick command line's: JAX's cells two
                    at a time) or ``Ahead`` (the full command line's: the peers' cells computed
                    ahead in the workers, ``gc.freeze`` after the first case)
==================  ============================================================================

The run:

==================  ============================================================================
``errors``          bad inputs of ``spec.ERRORS`` — **add a bad input here**
``properties``      Hypothesis property checks (``--hypothesis N``)
``profiles``        the quick and full profiles (``spec.PROFILES``): the quick rows by a greedy
                    cover of every feature, step and module class
``progress``        the progress bar: each cell weighted by its column, the time left
``runner``          runs cells, bad inputs and properties into one ``RunResult``; its loop
                    hands each cell to the room and takes them back in the run's order
``repeat``          the bitwise-repeat promises of ``spec.REPEATABLE``, sequential and threaded
                    (``python -m conformance repeat``)
==================  ============================================================================

The frameworks' own kernels, the peers, are columns too: their adapters are ``conformance.peers``.
"""
