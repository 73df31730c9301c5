"""The conformance harness: one spec, every backend, identical seeded inputs.

A run is a pipeline: each **case** is run on every column, each result **compared** with its
expected value, a failure **diagnosed**, the run **reported**. One folder per stage, each
``__init__`` a map of its files; imports run one way, down this list (the runner, which
compares and diagnoses each cell as it comes, sits above those two stages):

=====================  =========================================================================
``spec/``              the specification (standard library only), one file per chapter: rules,
                       stubs, tolerances, known differences, the plugin contract
``usage``              ``UsageError``: a mistake in calling the harness (exit code 2)
``words``              counted nouns in every report's sentences: ``plural(1, "case")``
``cases/``             what runs and what it must give: the seeded cases (**add a case here**),
                       the float64 reference, the naive baseline, the expected values
``comparing/``         the one tolerance rule, and the results a run produces
``diagnosing/``        why a cell failed: planted mistakes (**add a diagnosis here**), a peer's
                       known difference checked against its alternative semantics
``running/``           the backends' adapters (**add a framework here**), the compared steps
                       (**add a step here**), the execution room (isolation, the worker processes
                       and their one protocol, the order of the cells) and the runner
``peers/``             the frameworks' own kernels as extra columns (**add a peer here**)
``reporting/``         one renderer per format: terminal, JSON, Markdown, HTML; plots, the
                       smallest failing case
``golden/``            golden vectors: export, check, untrusted files
``suite/``             the pytest plugin (``pytest --pyargs conformance.suite``)
``teaching/``          the seed article step by step and the graded exercises of ``learn/``
``context_parallel/``  context parallelism (``python -m conformance context-parallel``)
``locating/``          where two attention blocks part, stage by stage (``locate``,
                       ``python -m conformance locate``)
``__main__``           ``python -m conformance``
=====================  =========================================================================

Backends are imported lazily, so a user with only NumPy installed can run the harness on
``numpy_attn``.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    """``conformance.locate``: imported when first used (``locating.locate``)."""
    if name == "locate":
        from .locating import locate

        return locate
    raise AttributeError(f"module 'conformance' has no attribute {name!r}")
