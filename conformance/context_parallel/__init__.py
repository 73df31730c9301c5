"""Context-parallel checks: ``context_parallel_attention`` of every backend, forward and
gradients, against the float64 reference, for each world size and strategy, and its bad calls.

One file per concern, imports running down this list's reverse (``cases`` imports none of the
others):

================  =========================================================================
``cases``         the cases (``CASES``), world sizes, strategies, compared steps — **add a
                  context-parallel case here**
``inputs``        a case's seeded inputs, laid out for the ranks and cut into shards; the
                  call's options; the float64 expected values
``checks``        ``CPResult`` rows: each step compared with the harness's tolerance rule,
                  the ranks merged
``bad_calls``     the bad calls (``BAD_CALLS``) and the check that each raises ValueError
``numpy_checks``  numpy_attn's checks, in this process (its ranks are simulated)
``workers``       JAX (host devices) and torch (gloo ranks), each in one subprocess
``run``           starts the workers, runs NumPy, reports; the command line
================  =========================================================================

``python -m conformance context-parallel`` (or ``python -m conformance.context_parallel``)
runs them; ``run_context_parallel(backends, world_sizes)`` returns the rows.
"""

from __future__ import annotations

from attention_rules import context_parallel as cp

from .bad_calls import BAD_CALLS
from .cases import BACKENDS, CASES, STEPS, STRATEGIES, WORLD_SIZES
from .checks import CPResult, check_steps, merge_ranks
from .inputs import inputs_for, options_for, shard
from .run import main, report, run_context_parallel
from .workers import free_port

__all__ = [
    "BACKENDS", "BAD_CALLS", "CASES", "STEPS", "STRATEGIES", "WORLD_SIZES", "CPResult", "cp",
    "check_steps", "free_port", "inputs_for", "main", "merge_ranks", "options_for", "report",
    "run_context_parallel", "shard",
]
