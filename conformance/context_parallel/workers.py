"""Context-parallel checks, the subprocesses: JAX on host devices and torch on spawned gloo
ranks, each printing its ``CPResult`` rows as JSON for ``run`` to collect.

* JAX runs in ONE subprocess with ``jax_num_cpu_devices`` set to the largest world size, each
  world size a mesh of the first devices, each check one ``jit`` of the forward and the VJP;
* torch runs in ONE subprocess that spawns the largest world of gloo ranks on 127.0.0.1 (each
  smaller world is a ``dist.new_group`` of the first ranks); each rank compares its own shards.
  The process group has a timeout, so a rank that never joins makes the others fail.
"""

from __future__ import annotations

import json
import socket
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from .bad_calls import BAD_CALLS, bad_call_result, bad_inputs
from .cases import DEADLINE_S, HEAD_DIM, STEPS, selected
from .checks import CPResult, check_steps, merge_ranks
from .inputs import inputs_for, options_for, shard

GROUP_TIMEOUT_S = 300  # torch: a collective waits this long for a missing rank
FAILED_RANK_TIMEOUT_S = 3  # torch: the group of the "a rank never joins" check


# ------------------------------------------------------------------------------------------
# JAX: one subprocess, host devices
# ------------------------------------------------------------------------------------------


def jax_worker(world_sizes: tuple[int, ...], strategies: tuple[str, ...],
                cases: tuple[str, ...] | None) -> list[CPResult]:
    """In the subprocess: ``jax_num_cpu_devices`` first, then every check."""
    import jax

    jax.config.update("jax_num_cpu_devices", max(world_sizes))
    from functools import partial

    from jax.sharding import Mesh

    from jax_attn import context_parallel as jcp

    results = []
    for world in world_sizes:
        mesh = Mesh(np.array(jax.devices()[:world]), ("seq",))
        for strategy in strategies:
            for case in selected(cases, world):
                x = inputs_for(case, world)
                attend = partial(jcp.context_parallel_attention, mesh=mesh,
                                 **options_for(case, strategy))

                @jax.jit
                def forward_and_vjp(q: Any, k: Any, v: Any, g: Any, attend: Any = attend) -> Any:
                    output, pullback = jax.vjp(attend, q, k, v)
                    return (output, *pullback(g))

                values = forward_and_vjp(x["query"], x["key"], x["value"], x["grad_output"])
                actual = dict(zip(STEPS, (np.asarray(a) for a in values), strict=True))
                results += check_steps("jax", world, strategy, case, actual)
        for name in BAD_CALLS:
            results.append(_jax_bad_call(jcp, mesh, world, name))
        results.append(_jax_bad_call(jcp, mesh, world, "mesh_without_axis"))
    return results


def _jax_bad_call(jcp: Any, mesh: Any, world: int, name: str) -> CPResult:
    arrays, options = bad_inputs("good" if name == "mesh_without_axis" else name, world)
    if name == "mesh_without_axis":
        options = {**options, "axis_name": "tensor"}
    try:
        jcp.context_parallel_attention(**arrays, mesh=mesh, **options)
        error = None
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        error = exc
    return bad_call_result("jax", world, name, error)


# ------------------------------------------------------------------------------------------
# torch: one subprocess spawning gloo ranks
# ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_rank(rank: int, world_max: int, port: int, world_sizes: tuple[int, ...],
                strategies: tuple[str, ...], cases: tuple[str, ...] | None, out_dir: str) -> None:
    """One spawned rank: every check of every world it belongs to; its rows to a JSON file."""
    import datetime

    import torch
    import torch.distributed as dist

    from torch_attn import context_parallel as tcp

    torch.set_num_threads(1)
    results: list[CPResult] = []
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_max, timeout=timeout)
    try:
        groups = {w: dist.new_group(list(range(w)), timeout=timeout) for w in world_sizes}
        for world in world_sizes:
            if rank >= world:
                continue
            group = groups[world]
            for strategy in strategies:
                for case in selected(cases, world):
                    x = inputs_for(case, world)
                    q, k, v = (torch.tensor(shard(x[n], world, rank)).requires_grad_(True)
                               for n in ("query", "key", "value"))
                    output = tcp.context_parallel_attention(q, k, v, group=group,
                                                            **options_for(case, strategy))
                    output.backward(torch.tensor(shard(x["grad_output"], world, rank)))
                    actual = {"output": output.detach().numpy(), "grad_query": q.grad.numpy(),
                              "grad_key": k.grad.numpy(), "grad_value": v.grad.numpy()}
                    results += check_steps("torch", world, strategy, case, actual, rank)
            for name in BAD_CALLS:
                arrays, options = bad_inputs(name, world)
                local = {n: torch.tensor(shard(a, world, rank)) for n, a in arrays.items()}
                results.append(_torch_bad_call(tcp, local, group, options, world, name, rank))
            results.append(_torch_mismatches(tcp, group, world, rank))
        missing = _torch_missing_rank(tcp, rank)  # every rank creates the group
        if missing is not None:
            results.append(missing)
    except Exception:  # noqa: BLE001 - reported as a failed row, never a hang
        results.append(CPResult("torch", world_max, "-", "rank crashed", "error", False,
                                note=f"rank {rank}: {traceback.format_exc()[-300:]}"))
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps([asdict(r) for r in results]))
        dist.destroy_process_group()


def _torch_bad_call(tcp: Any, local: dict, group: Any, options: dict, world: int, name: str,
                    rank: int) -> CPResult:
    try:
        tcp.context_parallel_attention(**local, group=group, **options)
        error = None
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        error = exc
    return bad_call_result("torch", world, name, error, rank)


def _torch_mismatches(tcp: Any, group: Any, world: int, rank: int) -> CPResult:
    """The last rank's call differs from the others': all its shards shorter, its query alone
    shorter, another ``scale``, other ``kv_lengths`` values (a NumPy array). Each must raise, on
    every rank, the ValueError that says the ranks' calls differ (not another check's); the row
    is the first variant that does not (else the last)."""
    import torch

    arrays, options = bad_inputs("good", world)
    local = {n: torch.tensor(shard(a, world, rank)) for n, a in arrays.items()}
    last, kv_len = rank == world - 1, arrays["key"].shape[-2]
    variants = (({n: t[..., :-1, :] for n, t in local.items()} if last else local, options),
                ({**local, "query": local["query"][..., :-1, :]} if last else local, options),
                (local, {**options, "scale": 0.5 if last else None}),
                (local, {**options, "kv_lengths": np.array([kv_len - last])}))
    for call, kwargs in variants:
        result = _torch_bad_call(tcp, call, group, kwargs, world, "mismatched_shards", rank)
        if result.passed and "must pass shards of the same" not in result.note:
            result.passed, result.note = False, result.note + " (not the mismatch's error)"
        if not result.passed:
            break
    return result


def _torch_missing_rank(tcp: Any, rank: int) -> CPResult | None:
    """Ranks 0 and 1 form a group with a short timeout; rank 1 never calls: rank 0 must get an
    error within the timeout (plus a margin), not hang."""
    import datetime

    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=FAILED_RANK_TIMEOUT_S))
    if rank == 1:  # alive, but never calls: rank 0 must give up after the group's timeout
        time.sleep(FAILED_RANK_TIMEOUT_S + 2)
    if rank != 0:
        return None
    x = torch.zeros(1, 2, 4, HEAD_DIM)
    start = time.monotonic()
    try:
        tcp.context_parallel_attention(x, x, x, group=group)
        error = None
    except Exception as exc:  # noqa: BLE001 - any error within the timeout is the point
        error = exc
    waited = time.monotonic() - start
    ok = error is not None and waited < FAILED_RANK_TIMEOUT_S + 30  # failed, and in time
    note = (f"rank 0: {type(error).__name__ if error else 'no error'} after {waited:.1f} s "
            f"(group timeout {FAILED_RANK_TIMEOUT_S} s)")
    return CPResult("torch", 2, "-", "rank_never_joins", "bad call", ok, note=note)


def torch_worker(world_sizes: tuple[int, ...], strategies: tuple[str, ...],
                  cases: tuple[str, ...] | None) -> list[CPResult]:
    """In the subprocess: spawn the largest world, wait with a deadline, merge the ranks."""
    import torch.multiprocessing as mp

    world_max = max(world_sizes)
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _torch_rank, args=(world_max, free_port(), world_sizes, strategies, cases, out_dir),
            nprocs=world_max, join=False, start_method="spawn")
        deadline = time.monotonic() + DEADLINE_S
        crashed = ""
        try:
            while not context.join(timeout=max(1.0, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    crashed = f"deadline of {DEADLINE_S} s passed"
                    break
        except Exception as exc:  # noqa: BLE001 - a rank died: its error becomes a row
            crashed = f"{type(exc).__name__}: {str(exc)[-300:]}"
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        results = []
        for rank in range(world_max):
            path = Path(out_dir, f"rank{rank}.json")
            if path.exists():
                results += [CPResult(**row) for row in json.loads(path.read_text())]
            else:
                results.append(CPResult("torch", world_max, "-", "rank missing", "error", False,
                                        note=f"rank {rank} wrote nothing; {crashed}"))
    return merge_ranks(results)
