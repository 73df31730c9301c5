"""Context parallelism's NumPy checks, in this process: numpy_attn simulates the ranks, so every
world size, strategy, case and bad call runs here (JAX and torch run in ``workers``).
"""

from __future__ import annotations

from .bad_calls import BAD_CALLS, bad_call_result, bad_inputs
from .cases import STEPS, STRATEGIES, selected
from .checks import CPResult, check_steps
from .inputs import inputs_for, options_for


def run_numpy(world_sizes: tuple[int, ...], strategies: tuple[str, ...] = STRATEGIES,
              cases: tuple[str, ...] | None = None) -> list[CPResult]:
    """numpy_attn's simulated ranks, every world size, strategy and case, and the bad calls."""
    from numpy_attn import context_parallel as ncp

    results = []
    for world in world_sizes:
        for strategy in strategies:
            for case in selected(cases, world):
                x = inputs_for(case, world)
                kwargs = options_for(case, strategy)
                q, k, v, g = x["query"], x["key"], x["value"], x["grad_output"]
                output = ncp.context_parallel_attention(q, k, v, world_size=world, **kwargs)
                grads = ncp.context_parallel_attention_vjp(q, k, v, g, world_size=world, **kwargs)
                actual = dict(zip(STEPS, (output, *grads), strict=True))
                results += check_steps("numpy", world, strategy, case, actual)
        for name in BAD_CALLS:
            arrays, options = bad_inputs(name, world)
            try:
                ncp.context_parallel_attention(**arrays, world_size=world, **options)
                error = None
            except Exception as exc:  # noqa: BLE001 - the type is what is checked
                error = exc
            results.append(bad_call_result("numpy", world, name, error))
    return results
